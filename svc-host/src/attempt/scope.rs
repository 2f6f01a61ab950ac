//! Call and approval ids of a resumed or restarted provider session, kept unique within the
//! attempt.

use agentscope_schemas::v1::execution_event::Body;

/// `id` within launch `scope` of an attempt (None: the attempt's first launch, ids unchanged).
pub fn scoped_id(scope: Option<&str>, id: &str) -> String {
    match scope {
        Some(g) if !id.is_empty() => format!("{g}:{id}"),
        _ => id.to_string(),
    }
}

/// Puts the call ids of `body` in launch `scope`, so that a provider that restarts its item
/// numbering on resume never records two different calls under one id in an attempt.
pub fn scope_ids(mut body: Body, scope: Option<&str>) -> Body {
    if scope.is_some() {
        match &mut body {
            Body::ToolCall(c) => c.call_id = scoped_id(scope, &c.call_id),
            Body::ToolResult(r) => r.call_id = scoped_id(scope, &r.call_id),
            _ => {}
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentscope_schemas::v1::{ToolCall, ToolResult};

    fn call(id: &str) -> Body {
        Body::ToolCall(ToolCall {
            call_id: id.into(),
            name: "shell".into(),
            input_json: "{}".into(),
        })
    }

    #[test]
    fn call_ids_stay_unique_across_resumes() {
        // Codex numbers its items from item_0 again after a resume.
        let first = scope_ids(call("item_0"), None);
        let resumed = scope_ids(call("item_0"), Some("g12"));
        let again = scope_ids(call("item_0"), Some("g30"));
        let ids: Vec<String> = [first, resumed, again]
            .into_iter()
            .map(|b| match b {
                Body::ToolCall(c) => c.call_id,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(ids, ["item_0", "g12:item_0", "g30:item_0"]);
        // A result names the same call as its call.
        match scope_ids(
            Body::ToolResult(ToolResult {
                call_id: "item_0".into(),
                output: "ok".into(),
                is_error: false,
            }),
            Some("g12"),
        ) {
            Body::ToolResult(r) => assert_eq!(r.call_id, "g12:item_0"),
            _ => unreachable!(),
        }
    }

    #[test]
    fn approval_keys_follow_the_call_ids() {
        // The approval is keyed (and decided) under the scoped id; the provider is answered
        // under its own id, which the ControlRequest keeps.
        assert_eq!(scoped_id(None, "item_0"), "item_0");
        assert_eq!(scoped_id(Some("g12"), "item_0"), "g12:item_0");
        assert_ne!(scoped_id(Some("g12"), "item_0"), scoped_id(None, "item_0"));
        assert_eq!(scoped_id(Some("g12"), ""), "");
    }
}
