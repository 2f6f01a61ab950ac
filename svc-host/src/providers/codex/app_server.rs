//! Codex driven over `codex app-server` (JSON-RPC, one object a line, no `jsonrpc` field), the
//! mode that asks for approvals. The host writes `initialize`, `initialized` and `thread/start`
//! (or `thread/resume`) at launch; this parser answers the thread's response with `turn/start`
//! and maps notifications:
//!
//! - the response to `thread/start`/`thread/resume` (`result.thread.id`) → `SessionStarted`;
//!   an error response to it → `ErrorEvent{code: "thread/resume"}` and a failed `Result`;
//! - `item/started`: `commandExecution` → `ToolCall{id, "shell", {"command"}}` (the model's own
//!   command from `commandActions`, else the wrapped one), `mcpToolCall` → `ToolCall{id,
//!   "server/tool", arguments}`;
//! - `item/completed`: `agentMessage` → `AssistantMessage`; `commandExecution` → `ToolResult`
//!   (`aggregatedOutput`; an error when the exit code is non-zero or the status is
//!   `failed`/`declined`); `mcpToolCall` → `ToolResult`; `fileChange` → one `FileChange` per
//!   change;
//! - `thread/tokenUsage/updated` for the current turn → `Usage` (`last`, one model request);
//! - `turn/completed` → `Result` (status `completed` is a success; `failed` and `interrupted`
//!   are errors, with an `ErrorEvent` carrying the turn's error);
//! - `error` → `ErrorEvent` (`code` "retrying" when Codex retries by itself);
//! - a server request this host does not handle (anything but the approval requests, which the
//!   adapter turns into Approvals) is answered with a JSON-RPC error so that Codex never waits;
//! - everything else (deltas, status changes, rate limits, …) → `Raw`.

use crate::providers::{
    StreamParser, cap, count_of, json_line, json_text, obj_of, str_of, str_or_empty,
};
use agentscope_schemas::v1::{
    AssistantMessage, ErrorEvent, FileChange, Result as ResultEvent, SessionStarted, ToolCall,
    ToolResult, Usage, execution_event::Body,
};
use serde_json::{Map, Value, json};

pub const PROVIDER: &str = agentscope_domain::Provider::Codex.as_str();

/// The id of the host's `thread/start` or `thread/resume` request.
pub const THREAD_REQUEST_ID: u64 = 2;
const TURN_REQUEST_ID: u64 = 3;

/// Server requests that are Approvals (handled by the adapter, never by the parser).
pub const APPROVAL_METHODS: [&str; 2] = [
    "item/commandExecution/requestApproval",
    "item/fileChange/requestApproval",
];

#[derive(Debug, Default)]
pub struct CodexAppParser {
    prompt: String,
    session_id: Option<String>,
    turn_id: Option<String>,
    turn_sent: bool,
    last_message: Option<String>,
    turns: u64,
    replies: Vec<String>,
}

impl CodexAppParser {
    /// `prompt` is sent as the turn's input once the thread is open.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            ..Self::default()
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
            if !APPROVAL_METHODS.contains(&method) {
                self.replies.push(
                    json!({"id": v["id"], "error": {"code": -32601, "message": format!("agentscope does not handle {method}")}})
                        .to_string()
                        + "\n",
                );
            }
            return out;
        }
        let empty = Map::new();
        let params = obj_of(v, "params").unwrap_or(&empty);
        match method {
            "turn/started" => {
                if let Some(id) = obj_of(params, "turn").and_then(|t| str_of(t, "id")) {
                    self.turn_id = Some(id.to_owned());
                }
            }
            "item/started" => {
                if let Some(call) = obj_of(params, "item").and_then(tool_call) {
                    out.push(Body::ToolCall(call));
                }
            }
            "item/completed" => {
                if let Some(item) = obj_of(params, "item") {
                    self.item_completed(item, &mut out);
                }
            }
            "thread/tokenUsage/updated" => {
                let current = self
                    .turn_id
                    .as_deref()
                    .is_some_and(|t| str_of(params, "turnId") == Some(t));
                if let Some(last) = obj_of(params, "tokenUsage").and_then(|u| obj_of(u, "last"))
                    && current
                {
                    let input = count_of(last, "inputTokens").unwrap_or(0);
                    let cached = count_of(last, "cachedInputTokens").unwrap_or(0);
                    out.push(Body::Usage(Usage {
                        input_tokens: input.max(cached),
                        output_tokens: count_of(last, "outputTokens").unwrap_or(0),
                        cost_usd: 0.0,
                    }));
                }
            }
            "turn/completed" => {
                self.turns = self.turns.saturating_add(1);
                let turn = obj_of(params, "turn");
                let status = turn.map(|t| str_or_empty(t, "status")).unwrap_or("");
                let error = turn
                    .and_then(|t| t.get("error"))
                    .filter(|e| !e.is_null())
                    .map(|e| match e.get("message").and_then(Value::as_str) {
                        Some(m) => cap(m),
                        None => json_text(Some(e)),
                    });
                let failed = status != "completed";
                if failed {
                    out.push(Body::Error(ErrorEvent {
                        message: error
                            .clone()
                            .unwrap_or_else(|| format!("the turn ended {status}")),
                        code: format!("turn.{status}"),
                    }));
                }
                let text = match (self.last_message.take(), failed) {
                    (Some(m), _) => m,
                    (None, true) => error.unwrap_or_else(|| format!("the turn ended {status}")),
                    (None, false) => String::new(),
                };
                out.push(Body::Result(ResultEvent {
                    is_error: failed,
                    text,
                    turns: crate::providers::turns(self.turns),
                }));
            }
            "error" => {
                let e = params.get("error");
                let message = match e.and_then(|e| e.get("message")).and_then(Value::as_str) {
                    Some(m) => cap(m),
                    None => json_text(e),
                };
                let retrying = params.get("willRetry").and_then(Value::as_bool) == Some(true);
                out.push(Body::Error(ErrorEvent {
                    message,
                    code: if retrying { "retrying" } else { "error" }.into(),
                }));
            }
            _ => {}
        }
        out
    }

    fn response(&mut self, v: &Map<String, Value>, out: &mut Vec<Body>) {
        if v.get("id").and_then(Value::as_u64) != Some(THREAD_REQUEST_ID) {
            return;
        }
        if let Some(e) = v.get("error") {
            let message = match e.get("message").and_then(Value::as_str) {
                Some(m) => cap(m),
                None => json_text(Some(e)),
            };
            out.push(Body::Error(ErrorEvent {
                message: message.clone(),
                code: "thread/resume".into(),
            }));
            out.push(Body::Result(ResultEvent {
                is_error: true,
                text: message,
                turns: 0,
            }));
            return;
        }
        let result = obj_of(v, "result");
        let id = result
            .and_then(|r| obj_of(r, "thread"))
            .and_then(|t| str_of(t, "id"))
            .unwrap_or("");
        if id.is_empty() || self.turn_sent {
            return;
        }
        self.session_id = Some(id.to_owned());
        self.turn_sent = true;
        out.push(Body::SessionStarted(SessionStarted {
            provider_session_id: id.to_owned(),
            model: result
                .map(|r| str_or_empty(r, "model"))
                .unwrap_or("")
                .to_owned(),
        }));
        self.replies.push(
            json!({"id": TURN_REQUEST_ID, "method": "turn/start", "params": {
                "threadId": id,
                "input": [{"type": "text", "text": self.prompt, "text_elements": []}]}})
            .to_string()
                + "\n",
        );
    }

    fn item_completed(&mut self, item: &Map<String, Value>, out: &mut Vec<Body>) {
        let id = str_or_empty(item, "id");
        let status = str_or_empty(item, "status");
        match str_or_empty(item, "type") {
            "agentMessage" => {
                let text = cap(str_or_empty(item, "text"));
                self.last_message = Some(text.clone());
                out.push(Body::AssistantMessage(AssistantMessage { text }));
            }
            "commandExecution" => {
                let exit_failed = item
                    .get("exitCode")
                    .and_then(Value::as_i64)
                    .is_some_and(|c| c != 0);
                out.push(Body::ToolResult(ToolResult {
                    call_id: id.to_owned(),
                    output: cap(str_or_empty(item, "aggregatedOutput")),
                    is_error: exit_failed || matches!(status, "failed" | "declined"),
                }));
            }
            "mcpToolCall" => {
                let err = item.get("error").filter(|e| !e.is_null());
                let output = match (item.get("result").filter(|r| !r.is_null()), err) {
                    (Some(r), _) => mcp_text(r),
                    (None, Some(e)) => match e.get("message").and_then(Value::as_str) {
                        Some(m) => cap(m),
                        None => json_text(Some(e)),
                    },
                    (None, None) => String::new(),
                };
                out.push(Body::ToolResult(ToolResult {
                    call_id: id.to_owned(),
                    output,
                    is_error: err.is_some() || status == "failed",
                }));
            }
            "fileChange" if !matches!(status, "failed" | "declined") => {
                let changes = item.get("changes").and_then(Value::as_array);
                for c in changes.into_iter().flatten().filter_map(Value::as_object) {
                    let path = str_or_empty(c, "path");
                    // `kind` is a string or `{"type": "add"}`.
                    let kind = match c.get("kind") {
                        Some(Value::String(s)) => s.as_str(),
                        Some(Value::Object(o)) => str_or_empty(o, "type"),
                        _ => "",
                    };
                    if !path.is_empty() {
                        out.push(Body::FileChange(FileChange {
                            path: path.to_owned(),
                            change: kind.to_owned(),
                        }));
                    }
                }
            }
            _ => {}
        }
    }
}

impl StreamParser for CodexAppParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        json_line(PROVIDER, line, truncated, |v| self.map(v))
    }

    fn finish(&mut self) -> Vec<Body> {
        vec![]
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    fn replies(&mut self) -> Vec<String> {
        std::mem::take(&mut self.replies)
    }
}

/// The `ToolCall` of a command or MCP tool item; None for other item types.
fn tool_call(item: &Map<String, Value>) -> Option<ToolCall> {
    let call_id = str_or_empty(item, "id").to_owned();
    match str_or_empty(item, "type") {
        "commandExecution" => Some(ToolCall {
            call_id,
            name: "shell".into(),
            input_json: json_text(Some(&json!({ "command": command_of(item) }))),
        }),
        "mcpToolCall" => Some(ToolCall {
            call_id,
            name: format!(
                "{}/{}",
                str_or_empty(item, "server"),
                str_or_empty(item, "tool")
            ),
            input_json: json_text(item.get("arguments")),
        }),
        _ => None,
    }
}

/// The model's own command (`commandActions[0].command`), else the wrapped command line.
pub fn command_of(v: &Map<String, Value>) -> String {
    v.get("commandActions")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(|a| a.get("command"))
        .and_then(Value::as_str)
        .or_else(|| str_of(v, "command"))
        .unwrap_or("")
        .to_owned()
}

fn mcp_text(r: &Value) -> String {
    let texts: Vec<&str> = r
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("text").and_then(Value::as_str))
        .collect();
    if texts.is_empty() {
        cap(&json_text(Some(r)))
    } else {
        cap(&texts.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::testutil::{arb_json, arb_line, kinds, run, sample};
    use proptest::prelude::*;

    #[test]
    fn the_recorded_approving_run_maps_to_normalized_events() {
        let Some(text) = sample(&["codex-app-server"]) else {
            return;
        };
        let mut p = CodexAppParser::new("do it");
        let mut out = vec![];
        let mut replies = vec![];
        for l in text.lines() {
            // The approval request is the adapter's, never the parser's.
            if l.contains("requestApproval") {
                continue;
            }
            out.extend(p.line(l, false));
            replies.extend(p.replies());
        }
        out.extend(p.finish());
        let k = kinds(&out);
        for want in [
            "SessionStarted",
            "ToolCall",
            "ToolResult",
            "AssistantMessage",
            "Usage",
            "Result",
        ] {
            assert!(k.contains(&want), "{want} missing from {k:?}");
        }
        assert_eq!(replies.len(), 1, "one turn/start: {replies:?}");
        let turn: Value = serde_json::from_str(&replies[0]).unwrap();
        assert_eq!(turn["method"], "turn/start");
        assert_eq!(turn["params"]["threadId"], p.session_id().unwrap());
        assert_eq!(turn["params"]["input"][0]["text"], "do it");
        let Some(Body::ToolCall(call)) = out.iter().find(|b| matches!(b, Body::ToolCall(_))) else {
            unreachable!()
        };
        assert!(call.input_json.contains("echo hi > note.txt"), "{call:?}");
        let Some(Body::Result(r)) = out.last() else {
            panic!("ends with a result: {out:?}")
        };
        assert!(!r.is_error && r.text == "Done.", "{r:?}");
    }

    #[test]
    fn a_declined_command_is_an_error_result_of_the_tool_not_of_the_turn() {
        let Some(text) = sample(&["codex-app-server-deny"]) else {
            return;
        };
        let mut p = CodexAppParser::new("x");
        let out = run(&mut p, &text);
        let r = out
            .iter()
            .find_map(|b| match b {
                Body::ToolResult(r) => Some(r),
                _ => None,
            })
            .expect("a tool result");
        assert!(r.is_error, "{r:?}");
        assert!(matches!(out.last(), Some(Body::Result(r)) if !r.is_error));
    }

    #[test]
    fn a_rejected_resume_is_an_error_result_and_sends_no_turn() {
        let mut p = CodexAppParser::new("x");
        let out = p.line(
            r#"{"error":{"code":-32600,"message":"no rollout found for thread id 01a2"},"id":2}"#,
            false,
        );
        assert_eq!(kinds(&out), ["ErrorEvent", "Result"]);
        assert!(p.replies().is_empty());
        assert!(matches!(&out[1], Body::Result(r) if r.is_error && r.text.contains("no rollout")));
    }

    #[test]
    fn failed_and_interrupted_turns_are_errors() {
        for status in ["failed", "interrupted"] {
            let mut p = CodexAppParser::new("x");
            let line = json!({"method": "turn/completed", "params": {"threadId": "t", "turn": {"id": "u", "status": status, "error": {"message": "boom"}}}}).to_string();
            let out = p.line(&line, false);
            assert_eq!(kinds(&out), ["ErrorEvent", "Result"], "{status}");
            assert!(matches!(&out[1], Body::Result(r) if r.is_error && r.text == "boom"));
        }
    }

    #[test]
    fn unhandled_server_requests_are_answered_with_an_error_and_approvals_are_not() {
        let mut p = CodexAppParser::new("x");
        p.line(
            r#"{"id":7,"method":"item/tool/requestUserInput","params":{}}"#,
            false,
        );
        let r = p.replies();
        assert_eq!(r.len(), 1);
        let v: Value = serde_json::from_str(&r[0]).unwrap();
        assert_eq!(
            (v["id"].as_u64(), v["error"]["code"].as_i64()),
            (Some(7), Some(-32601))
        );
        p.line(
            r#"{"id":8,"method":"item/commandExecution/requestApproval","params":{}}"#,
            false,
        );
        assert!(p.replies().is_empty());
    }

    #[test]
    fn usage_of_an_earlier_turn_replayed_on_resume_is_not_counted_again() {
        let mut p = CodexAppParser::new("x");
        let usage = |turn: &str| {
            json!({"method": "thread/tokenUsage/updated", "params": {"threadId": "t", "turnId": turn, "tokenUsage": {"last": {"inputTokens": 10, "outputTokens": 2}}}}).to_string()
        };
        assert_eq!(kinds(&p.line(&usage("old"), false)), ["Raw"]);
        p.line(
            r#"{"method":"turn/started","params":{"turn":{"id":"new"}}}"#,
            false,
        );
        assert_eq!(kinds(&p.line(&usage("new"), false)), ["Usage"]);
    }

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic_and_are_never_dropped(line in arb_line(), truncated in any::<bool>()) {
            let mut p = CodexAppParser::new("x");
            let out = p.line(&line, truncated);
            prop_assert!(line.trim().is_empty() && !truncated || !out.is_empty());
        }

        #[test]
        fn arbitrary_json_never_panics(v in arb_json(&["method", "params", "item", "turn", "id", "result", "error", "thread"])) {
            let mut p = CodexAppParser::new("x");
            p.line(&v.to_string(), false);
            p.replies();
        }
    }
}
