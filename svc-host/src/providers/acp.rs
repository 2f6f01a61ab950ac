//! Agent Client Protocol (JSON-RPC 2.0 on stdio), spoken by `opencode acp`: the mode that asks
//! for approvals. The host writes `initialize` and `session/new` (or `session/resume`, which,
//! unlike `session/load`, does not replay history) at launch; this parser answers the session's
//! response with `session/prompt` and maps:
//!
//! - the response to the session request → `SessionStarted` (its `sessionId`, or the resumed
//!   one); an error response → `ErrorEvent{code: "session"}` and a failed `Result`;
//! - `session/update`: `agent_message_chunk` text is gathered per message and becomes one
//!   `AssistantMessage` when another update or the end of the turn follows; the first
//!   `tool_call_update` that carries a status past `pending` → `ToolCall{toolCallId, name (the
//!   first title, e.g. `bash`), rawInput}`; `completed`/`failed` → `ToolResult` (rawOutput's
//!   `output`, else its `error`, else the text content);
//! - the response to `session/prompt` → `Usage` and `Result` (`end_turn` is a success; any other
//!   stop reason or an error is a failure). ACP's reject carries no reason and ends the turn
//!   without asking the model again, so after a deny (`StreamParser::denied`) a turn that ends
//!   `end_turn` is followed by one more `session/prompt` telling the model what was denied and
//!   why; its response is the `Result`;
//! - a server request other than `session/request_permission` (which the adapter turns into an
//!   Approval) is answered with a JSON-RPC error so that the agent never waits;
//! - everything else → `Raw`.

use super::{StreamParser, cap, count_of, json_line, json_text, obj_of, str_of, str_or_empty};
use agentscope_schemas::v1::{
    AssistantMessage, ErrorEvent, Result as ResultEvent, SessionStarted, ToolCall, ToolResult,
    Usage, execution_event::Body,
};
use serde_json::{Map, Value, json};
use std::collections::HashMap;

/// The id of the host's `session/new` or `session/resume` request.
pub const SESSION_REQUEST_ID: u64 = 2;
const PROMPT_REQUEST_ID: u64 = 3;
pub const PERMISSION_METHOD: &str = "session/request_permission";
/// Tool calls remembered between their start and their result.
const MAX_OPEN_CALLS: usize = 10_000;
/// Follow-up prompts (deny reasons) sent in one run at most.
const MAX_FOLLOW_UPS: u64 = 100;

#[derive(Debug)]
struct Call {
    name: String,
    started: bool,
}

#[derive(Debug)]
pub struct AcpParser {
    provider: &'static str,
    prompt: String,
    resume: Option<String>,
    session_id: Option<String>,
    prompt_sent: bool,
    calls: HashMap<String, Call>,
    /// The assistant message being streamed: (message id, text so far).
    message: Option<(String, String)>,
    last_message: Option<String>,
    replies: Vec<String>,
    /// The line just mapped was a chunk kept in `message`.
    absorbed: bool,
    /// The id of the `session/prompt` whose response ends the current turn.
    prompt_id: u64,
    /// Deny reasons the model has not been told yet.
    follow_ups: Vec<String>,
}

impl AcpParser {
    /// `prompt` is sent once the session is open; `resume` names the session a
    /// `session/resume` continues.
    pub fn new(provider: &'static str, prompt: impl Into<String>, resume: Option<String>) -> Self {
        Self {
            provider,
            prompt: prompt.into(),
            resume,
            session_id: None,
            prompt_sent: false,
            calls: HashMap::new(),
            message: None,
            last_message: None,
            replies: vec![],
            absorbed: false,
            prompt_id: PROMPT_REQUEST_ID,
            follow_ups: vec![],
        }
    }

    fn flush_message(&mut self, out: &mut Vec<Body>) {
        if let Some((_, text)) = self.message.take()
            && !text.is_empty()
        {
            let text = cap(&text);
            self.last_message = Some(text.clone());
            out.push(Body::AssistantMessage(AssistantMessage { text }));
        }
    }

    fn map(&mut self, v: &Map<String, Value>) -> Vec<Body> {
        let mut out = vec![];
        let method = str_or_empty(v, "method");
        if method.is_empty() {
            self.response(v, &mut out);
            return out;
        }
        if v.contains_key("id") {
            if method != PERMISSION_METHOD {
                self.replies.push(
                    json!({"jsonrpc": "2.0", "id": v["id"], "error": {"code": -32601, "message": format!("agentscope does not handle {method}")}})
                        .to_string()
                        + "\n",
                );
            }
            return out;
        }
        if method != "session/update" {
            return out;
        }
        let Some(update) = obj_of(v, "params").and_then(|p| obj_of(p, "update")) else {
            return out;
        };
        match str_or_empty(update, "sessionUpdate") {
            "agent_message_chunk" => {
                let id = str_or_empty(update, "messageId").to_owned();
                let text = update
                    .get("content")
                    .and_then(|c| c.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if self.message.as_ref().is_some_and(|(m, _)| *m != id) {
                    self.flush_message(&mut out);
                }
                let (_, acc) = self.message.get_or_insert_with(|| (id, String::new()));
                if acc.len() < super::MAX_FIELD_BYTES {
                    acc.push_str(text);
                }
                self.absorbed = true;
            }
            kind @ ("tool_call" | "tool_call_update") => {
                self.flush_message(&mut out);
                let id = str_or_empty(update, "toolCallId").to_owned();
                if id.is_empty() {
                    return out;
                }
                if kind == "tool_call" && !self.calls.contains_key(&id) {
                    if self.calls.len() >= MAX_OPEN_CALLS {
                        self.calls.clear();
                    }
                    self.calls.insert(
                        id.clone(),
                        Call {
                            name: str_or_empty(update, "title").to_owned(),
                            started: false,
                        },
                    );
                }
                let status = str_or_empty(update, "status");
                if status.is_empty() || status == "pending" {
                    return out;
                }
                let call = self.calls.entry(id.clone()).or_insert_with(|| Call {
                    name: str_or_empty(update, "kind").to_owned(),
                    started: false,
                });
                if !call.started {
                    call.started = true;
                    out.push(Body::ToolCall(ToolCall {
                        call_id: id.clone(),
                        name: call.name.clone(),
                        input_json: json_text(update.get("rawInput")),
                    }));
                }
                if matches!(status, "completed" | "failed") {
                    self.calls.remove(&id);
                    out.push(Body::ToolResult(ToolResult {
                        call_id: id,
                        output: tool_output(update),
                        is_error: status == "failed",
                    }));
                }
            }
            _ => {}
        }
        out
    }

    fn response(&mut self, v: &Map<String, Value>, out: &mut Vec<Body>) {
        let id = v.get("id").and_then(Value::as_u64);
        if id != Some(SESSION_REQUEST_ID) && id != Some(self.prompt_id) {
            return;
        }
        if let Some(e) = v.get("error") {
            self.flush_message(out);
            let message = match e.get("message").and_then(Value::as_str) {
                Some(m) => cap(m),
                None => json_text(Some(e)),
            };
            out.push(Body::Error(ErrorEvent {
                message: message.clone(),
                code: if id == Some(SESSION_REQUEST_ID) {
                    "session"
                } else {
                    "session/prompt"
                }
                .into(),
            }));
            out.push(Body::Result(ResultEvent {
                is_error: true,
                text: message,
                turns: 0,
            }));
            return;
        }
        let result = obj_of(v, "result");
        if id == Some(SESSION_REQUEST_ID) {
            let session = result
                .and_then(|r| str_of(r, "sessionId"))
                .map(str::to_string)
                .or_else(|| self.resume.clone())
                .unwrap_or_default();
            if session.is_empty() || self.prompt_sent {
                return;
            }
            self.prompt_sent = true;
            self.session_id = Some(session.clone());
            out.push(Body::SessionStarted(SessionStarted {
                provider_session_id: session.clone(),
                model: String::new(),
            }));
            self.replies.push(
                json!({"jsonrpc": "2.0", "id": PROMPT_REQUEST_ID, "method": "session/prompt", "params": {
                    "sessionId": session, "prompt": [{"type": "text", "text": self.prompt}]}})
                .to_string()
                    + "\n",
            );
            return;
        }
        self.flush_message(out);
        let stop = result.map(|r| str_or_empty(r, "stopReason")).unwrap_or("");
        if let Some(u) = result.and_then(|r| obj_of(r, "usage")) {
            out.push(Body::Usage(Usage {
                input_tokens: count_of(u, "inputTokens").unwrap_or(0),
                output_tokens: count_of(u, "outputTokens").unwrap_or(0),
                cost_usd: 0.0,
            }));
        }
        let failed = stop != "end_turn";
        let follow_up = self.prompt_id - PROMPT_REQUEST_ID < MAX_FOLLOW_UPS;
        if !failed && follow_up && !self.follow_ups.is_empty() {
            let text = std::mem::take(&mut self.follow_ups).join("\n\n");
            self.prompt_id += 1;
            self.replies.push(
                json!({"jsonrpc": "2.0", "id": self.prompt_id, "method": "session/prompt", "params": {
                    "sessionId": self.session_id.clone().unwrap_or_default(),
                    "prompt": [{"type": "text", "text": text}]}})
                .to_string()
                    + "\n",
            );
            return;
        }
        out.push(Body::Result(ResultEvent {
            is_error: failed,
            text: match (self.last_message.take(), failed) {
                (Some(m), _) => m,
                (None, true) => format!("the turn stopped: {stop}"),
                (None, false) => String::new(),
            },
            turns: super::turns(self.prompt_id - PROMPT_REQUEST_ID + 1),
        }));
    }
}

fn tool_output(update: &Map<String, Value>) -> String {
    if let Some(raw) = obj_of(update, "rawOutput") {
        for k in ["output", "error"] {
            if let Some(s) = str_of(raw, k) {
                return cap(s);
            }
        }
    }
    let texts: Vec<&str> = update
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("content")?.get("text")?.as_str())
        .collect();
    cap(&texts.join("\n"))
}

impl StreamParser for AcpParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        let provider = self.provider;
        self.absorbed = false;
        let out = json_line(provider, line, truncated, |v| self.map(v));
        // A streamed chunk lives on in its message: the chunk line itself is not an event.
        if self.absorbed && out.len() == 1 && matches!(out[0], Body::Raw(_)) {
            return vec![];
        }
        out
    }

    fn finish(&mut self) -> Vec<Body> {
        let mut out = vec![];
        self.flush_message(&mut out);
        out
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    fn replies(&mut self) -> Vec<String> {
        std::mem::take(&mut self.replies)
    }

    fn denied(&mut self, tool: &str, reason: &str) {
        self.follow_ups.push(super::denied_message(tool, reason));
    }
}

/// `initialize` and `session/new` (or `session/resume`) for an ACP agent; the parser sends
/// `session/prompt` once the session is open.
pub fn handshake(cwd: &str, resume: Option<&str>) -> String {
    let session = match resume {
        None => {
            json!({"jsonrpc": "2.0", "id": SESSION_REQUEST_ID, "method": "session/new",
            "params": {"cwd": cwd, "mcpServers": []}})
        }
        // `session/resume`, unlike `session/load`, does not replay the history as updates.
        Some(id) => {
            json!({"jsonrpc": "2.0", "id": SESSION_REQUEST_ID, "method": "session/resume",
            "params": {"sessionId": id, "cwd": cwd, "mcpServers": []}})
        }
    };
    [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1,
            "clientCapabilities": {"fs": {"readTextFile": false, "writeTextFile": false}, "terminal": false}}}),
        session,
    ]
    .iter()
    .map(|m| m.to_string() + "\n")
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::testutil::{arb_json, arb_line, kinds, sample};
    use proptest::prelude::*;

    fn feed(p: &mut AcpParser, text: &str) -> (Vec<Body>, Vec<String>) {
        let (mut out, mut replies) = (vec![], vec![]);
        for l in text.lines() {
            if l.contains(PERMISSION_METHOD) {
                continue;
            }
            out.extend(p.line(l, false));
            replies.extend(p.replies());
        }
        out.extend(p.finish());
        (out, replies)
    }

    #[test]
    fn a_denied_turn_is_followed_by_a_prompt_with_the_reason_and_only_its_end_is_the_result() {
        let mut p = AcpParser::new("opencode", "do it", None);
        p.line(
            r#"{"jsonrpc":"2.0","id":2,"result":{"sessionId":"ses_1"}}"#,
            false,
        );
        assert_eq!(p.replies().len(), 1, "the first prompt");
        p.denied("bash", "not on a Friday");
        let out = p.line(
            r#"{"jsonrpc":"2.0","id":3,"result":{"stopReason":"end_turn"}}"#,
            false,
        );
        assert!(!out.iter().any(|b| matches!(b, Body::Result(_))), "{out:?}");
        let r = p.replies();
        assert_eq!(r.len(), 1, "{r:?}");
        let v: Value = serde_json::from_str(&r[0]).unwrap();
        assert_eq!(
            (v["id"].as_u64(), v["method"].as_str()),
            (Some(4), Some("session/prompt"))
        );
        assert_eq!(v["params"]["sessionId"], "ses_1");
        assert!(
            v["params"]["prompt"][0]["text"]
                .as_str()
                .unwrap()
                .contains("not on a Friday")
        );
        // A late answer to the first prompt is not the end; the follow-up's is.
        let late = p.line(
            r#"{"jsonrpc":"2.0","id":3,"result":{"stopReason":"end_turn"}}"#,
            false,
        );
        assert!(
            !late.iter().any(|b| matches!(b, Body::Result(_))),
            "{late:?}"
        );
        let out = p.line(
            r#"{"jsonrpc":"2.0","id":4,"result":{"stopReason":"end_turn"}}"#,
            false,
        );
        assert!(
            matches!(out.last(), Some(Body::Result(r)) if !r.is_error && r.turns == 2),
            "{out:?}"
        );
        assert!(p.replies().is_empty());
    }

    #[test]
    fn the_recorded_approving_run_maps_to_normalized_events() {
        let Some(text) = sample(&["opencode-acp"]) else {
            return;
        };
        let mut p = AcpParser::new("opencode", "do it", None);
        let (out, replies) = feed(&mut p, &text);
        let k: Vec<&str> = kinds(&out).into_iter().filter(|k| *k != "Raw").collect();
        assert_eq!(
            k,
            [
                "SessionStarted",
                "ToolCall",
                "ToolResult",
                "AssistantMessage",
                "Usage",
                "Result"
            ],
            "{out:#?}"
        );
        assert_eq!(replies.len(), 1, "{replies:?}");
        let prompt: Value = serde_json::from_str(&replies[0]).unwrap();
        assert_eq!(prompt["method"], "session/prompt");
        assert_eq!(prompt["params"]["sessionId"], p.session_id().unwrap());
        assert_eq!(prompt["params"]["prompt"][0]["text"], "do it");
        let call = out
            .iter()
            .find_map(|b| match b {
                Body::ToolCall(c) => Some(c),
                _ => None,
            })
            .unwrap();
        assert_eq!(call.name, "bash");
        assert!(call.input_json.contains("echo hi > note.txt"), "{call:?}");
        assert!(matches!(out.last(), Some(Body::Result(r)) if !r.is_error && r.text == "Done."));
    }

    #[test]
    fn a_rejected_call_is_a_failed_tool_result() {
        let Some(text) = sample(&["opencode-acp-deny"]) else {
            return;
        };
        let mut p = AcpParser::new("opencode", "x", None);
        let (out, _) = feed(&mut p, &text);
        let r = out
            .iter()
            .find_map(|b| match b {
                Body::ToolResult(r) => Some(r),
                _ => None,
            })
            .unwrap();
        assert!(r.is_error && r.output.contains("rejected"), "{r:?}");
    }

    #[test]
    fn a_resumed_session_keeps_its_id_and_a_refused_one_is_an_error() {
        let mut p = AcpParser::new("opencode", "go on", Some("ses_1".into()));
        let out = p.line(
            r#"{"jsonrpc":"2.0","id":2,"result":{"configOptions":[]}}"#,
            false,
        );
        assert!(matches!(&out[0], Body::SessionStarted(s) if s.provider_session_id == "ses_1"));
        assert_eq!(p.replies().len(), 1);
        let mut p = AcpParser::new("opencode", "go on", Some("ses_x".into()));
        let out = p.line(
            r#"{"jsonrpc":"2.0","id":2,"error":{"code":-32603,"message":"Internal error: OpenCode service failure"}}"#,
            false,
        );
        assert_eq!(kinds(&out), ["ErrorEvent", "Result"]);
        assert!(p.replies().is_empty());
    }

    #[test]
    fn chunks_of_one_message_become_one_assistant_message() {
        let mut p = AcpParser::new("opencode", "x", None);
        let chunk = |m: &str, t: &str| {
            json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s", "update": {"sessionUpdate": "agent_message_chunk", "messageId": m, "content": {"type": "text", "text": t}}}}).to_string()
        };
        assert!(p.line(&chunk("a", "Hel"), false).is_empty());
        assert!(p.line(&chunk("a", "lo"), false).is_empty());
        let out = p.line(&chunk("b", "Next"), false);
        assert!(matches!(&out[..], [Body::AssistantMessage(m)] if m.text == "Hello"));
        let out = p.line(
            r#"{"jsonrpc":"2.0","id":3,"result":{"stopReason":"max_tokens"}}"#,
            false,
        );
        assert_eq!(kinds(&out), ["AssistantMessage", "Result"]);
        assert!(matches!(&out[1], Body::Result(r) if r.is_error && r.text == "Next"));
    }

    #[test]
    fn unhandled_server_requests_are_answered_with_an_error() {
        let mut p = AcpParser::new("opencode", "x", None);
        p.line(
            r#"{"jsonrpc":"2.0","id":5,"method":"fs/read_text_file","params":{}}"#,
            false,
        );
        let r = p.replies();
        let v: Value = serde_json::from_str(&r[0]).unwrap();
        assert_eq!(
            (v["id"].as_u64(), v["error"]["code"].as_i64()),
            (Some(5), Some(-32601))
        );
        p.line(
            r#"{"jsonrpc":"2.0","id":6,"method":"session/request_permission","params":{}}"#,
            false,
        );
        assert!(p.replies().is_empty());
    }

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic(line in arb_line(), truncated in any::<bool>()) {
            let mut p = AcpParser::new("opencode", "x", None);
            p.line(&line, truncated);
            p.finish();
        }

        #[test]
        fn arbitrary_json_never_panics(v in arb_json(&["method", "params", "update", "sessionUpdate", "id", "result", "error", "toolCallId", "status"])) {
            let mut p = AcpParser::new("opencode", "x", None);
            p.line(&v.to_string(), false);
            p.replies();
            p.finish();
        }
    }
}
