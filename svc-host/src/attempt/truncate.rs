//! Events too large for the bus, cut to size.

use agentscope_schemas::v1::execution_event::Body;

/// Cuts every text field of `body` to at most `max` bytes (on a char boundary).
pub fn shrink(body: &mut Body, max: usize) {
    fn cut(s: &mut String, max: usize) -> bool {
        if s.len() <= max {
            return false;
        }
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        true
    }
    match body {
        Body::Output(o) => o.truncated |= cut(&mut o.text, max),
        Body::Raw(r) => {
            cut(&mut r.line, max);
        }
        Body::AssistantMessage(m) => {
            cut(&mut m.text, max);
        }
        Body::ToolCall(t) => {
            cut(&mut t.input_json, max);
        }
        Body::ToolResult(t) => {
            cut(&mut t.output, max);
        }
        Body::Result(r) => {
            cut(&mut r.text, max);
        }
        Body::Error(e) => {
            cut(&mut e.message, max);
        }
        Body::Diagnostic(d) => {
            cut(&mut d.message, max);
        }
        Body::Lifecycle(l) => {
            cut(&mut l.detail, max);
        }
        Body::FileChange(f) => {
            cut(&mut f.path, max);
        }
        Body::ApprovalRequested(r) => {
            cut(&mut r.input_json, max);
        }
        Body::ApprovalDecided(d) => {
            cut(&mut d.reason, max);
        }
        Body::SessionStarted(_) | Body::Usage(_) => {}
    }
}
