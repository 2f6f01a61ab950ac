//! Codex: `codex exec --json`, one JSON object (a `ThreadEvent`) a line.
//!
//! - `thread.started{thread_id}` → `SessionStarted` (no model is reported);
//! - `item.started`: `command_execution` → `ToolCall{id, "shell", {"command"}}`, `mcp_tool_call`
//!   → `ToolCall{id, "server/tool", arguments}`;
//! - `item.completed`: `agent_message` → `AssistantMessage`; `command_execution` → `ToolResult`
//!   (`aggregated_output`; an error when the exit code is non-zero or the status is
//!   `failed`/`declined`); `mcp_tool_call` → `ToolResult` (text content joined, else structured
//!   content, else the error message); `file_change` → one `FileChange{path, kind}` per change
//!   unless the patch failed; `error` → `ErrorEvent`. A tool item completed without having been
//!   seen started gets its `ToolCall` first;
//! - `turn.completed{usage}` → `Usage` (Codex's `input_tokens` already includes
//!   `cached_input_tokens`); `turn.failed{error}` and top-level `error` → `ErrorEvent`;
//! - `finish()` → `Result` when a turn completed or failed (the last turn decides `is_error`),
//!   its text the last agent message (or the failure message when there is none);
//! - everything else (`turn.started`, `item.updated`, `reasoning`, `web_search`, `todo_list`,
//!   `plan`, `collab_tool_call`, failed patches, …) → `Raw`.

use crate::providers::{
    StreamParser, cap, count_of, json_line, json_text, obj_of, str_of, str_or_empty, turns,
};
use agentscope_schemas::v1::{
    AssistantMessage, ErrorEvent, FileChange, Result as ResultEvent, SessionStarted, ToolCall,
    ToolResult, Usage, execution_event::Body,
};
use serde_json::{Map, Value};
use std::collections::HashSet;

pub const PROVIDER: &str = agentscope_domain::Provider::Codex.as_str();

/// Tool items seen started and not yet completed; bounded so that a stream of starts without
/// completions cannot grow memory without limit.
const MAX_OPEN_ITEMS: usize = 10_000;

#[derive(Debug, Default)]
pub struct CodexParser {
    session_id: Option<String>,
    open_items: HashSet<String>,
    last_message: Option<String>,
    /// Some(failure message) for the last turn when it failed, None when it completed; the outer
    /// None: no turn ended yet.
    last_turn: Option<Option<String>>,
    turns: u64,
}

impl CodexParser {
    pub fn new() -> Self {
        Self::default()
    }

    fn map(&mut self, v: &Map<String, Value>) -> Vec<Body> {
        let mut out = vec![];
        match str_or_empty(v, "type") {
            "thread.started" => {
                let id = str_or_empty(v, "thread_id");
                if !id.is_empty() {
                    self.session_id = Some(id.to_owned());
                    out.push(Body::SessionStarted(SessionStarted {
                        provider_session_id: id.to_owned(),
                        model: String::new(),
                    }));
                }
            }
            "item.started" => {
                if let Some(item) = obj_of(v, "item")
                    && let Some(call) = tool_call(item)
                {
                    if self.open_items.len() < MAX_OPEN_ITEMS {
                        self.open_items.insert(call.call_id.clone());
                    }
                    out.push(Body::ToolCall(call));
                }
            }
            "item.completed" => {
                if let Some(item) = obj_of(v, "item") {
                    self.item_completed(item, &mut out);
                }
            }
            "turn.completed" => {
                self.turns = self.turns.saturating_add(1);
                self.last_turn = Some(None);
                if let Some(u) = obj_of(v, "usage") {
                    let input = count_of(u, "input_tokens").unwrap_or(0);
                    let cached = count_of(u, "cached_input_tokens").unwrap_or(0);
                    out.push(Body::Usage(Usage {
                        input_tokens: input.max(cached),
                        output_tokens: count_of(u, "output_tokens").unwrap_or(0),
                        cost_usd: 0.0,
                    }));
                }
            }
            "turn.failed" => {
                self.turns = self.turns.saturating_add(1);
                let message = error_message(v.get("error"));
                self.last_turn = Some(Some(message.clone()));
                out.push(Body::Error(ErrorEvent {
                    message,
                    code: "turn.failed".into(),
                }));
            }
            "error" => out.push(Body::Error(ErrorEvent {
                message: cap(str_or_empty(v, "message")),
                code: "error".into(),
            })),
            _ => {}
        }
        out
    }

    fn item_completed(&mut self, item: &Map<String, Value>, out: &mut Vec<Body>) {
        let id = str_or_empty(item, "id");
        let status = str_or_empty(item, "status");
        match str_or_empty(item, "type") {
            "agent_message" => {
                let text = cap(str_or_empty(item, "text"));
                self.last_message = Some(text.clone());
                out.push(Body::AssistantMessage(AssistantMessage { text }));
            }
            kind @ ("command_execution" | "mcp_tool_call") => {
                if !self.open_items.remove(id)
                    && let Some(call) = tool_call(item)
                {
                    out.push(Body::ToolCall(call));
                }
                let (output, is_error) = if kind == "command_execution" {
                    let exit_failed = item
                        .get("exit_code")
                        .and_then(Value::as_i64)
                        .is_some_and(|c| c != 0);
                    (
                        cap(str_or_empty(item, "aggregated_output")),
                        exit_failed || matches!(status, "failed" | "declined"),
                    )
                } else {
                    let err = item.get("error").filter(|e| !e.is_null());
                    let output = match (item.get("result").filter(|r| !r.is_null()), err) {
                        (Some(r), _) => mcp_result_text(r),
                        (None, Some(e)) => error_message(Some(e)),
                        (None, None) => String::new(),
                    };
                    (output, err.is_some() || status == "failed")
                };
                out.push(Body::ToolResult(ToolResult {
                    call_id: id.to_owned(),
                    output,
                    is_error,
                }));
            }
            "file_change" if status != "failed" => {
                let changes = item.get("changes").and_then(Value::as_array);
                for c in changes.into_iter().flatten().filter_map(Value::as_object) {
                    let path = str_or_empty(c, "path");
                    if !path.is_empty() {
                        out.push(Body::FileChange(FileChange {
                            path: path.to_owned(),
                            change: str_or_empty(c, "kind").to_owned(),
                        }));
                    }
                }
            }
            "error" => out.push(Body::Error(ErrorEvent {
                message: cap(str_or_empty(item, "message")),
                code: "item.error".into(),
            })),
            _ => {}
        }
    }
}

impl StreamParser for CodexParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        json_line(PROVIDER, line, truncated, |v| self.map(v))
    }

    fn finish(&mut self) -> Vec<Body> {
        let Some(last) = self.last_turn.take() else {
            return vec![];
        };
        let is_error = last.is_some();
        let text = match (self.last_message.take(), last) {
            (Some(m), _) => m,
            (None, Some(failure)) => failure,
            (None, None) => String::new(),
        };
        vec![Body::Result(ResultEvent {
            is_error,
            text,
            turns: turns(self.turns),
        })]
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }
}

/// The `ToolCall` of a command or MCP tool item; None for other item types.
fn tool_call(item: &Map<String, Value>) -> Option<ToolCall> {
    let call_id = str_or_empty(item, "id").to_owned();
    match str_or_empty(item, "type") {
        "command_execution" => {
            let input = serde_json::json!({ "command": item.get("command").cloned().unwrap_or(Value::Null) });
            Some(ToolCall {
                call_id,
                name: "shell".into(),
                input_json: json_text(Some(&input)),
            })
        }
        "mcp_tool_call" => Some(ToolCall {
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

/// `{"message": ...}` or a plain string; anything else as JSON.
fn error_message(e: Option<&Value>) -> String {
    match e {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => cap(s),
        Some(Value::Object(o)) if str_of(o, "message").is_some() => cap(str_or_empty(o, "message")),
        Some(other) => json_text(Some(other)),
    }
}

/// An MCP tool result: its text content joined, else its structured content, else the whole
/// result, as text.
fn mcp_result_text(r: &Value) -> String {
    let texts: Vec<&str> = r
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("text").and_then(Value::as_str))
        .collect();
    if !texts.is_empty() {
        return cap(&texts.join("\n"));
    }
    match r.get("structured_content") {
        Some(s) if !s.is_null() => cap(&json_text(Some(s))),
        _ => cap(&json_text(Some(r))),
    }
}

/// Codex's error event while it reconnects to its model endpoint
/// (`{"type":"error","message":"Reconnecting... 1/5 (...)"}`, also as an app-server error
/// notification): the request could not be completed over the network.
pub fn is_connection_retry(line: &str) -> bool {
    if !line.contains("Reconnecting...") {
        return false;
    }
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        return false;
    };
    let message = |m: &Value| m.as_str().is_some_and(|m| m.starts_with("Reconnecting..."));
    (v["type"] == "error" && message(&v["message"]))
        || (v["method"] == "error" && message(&v["params"]["error"]["message"]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::MAX_FIELD_BYTES;
    use crate::providers::testutil::{
        arb_json, arb_line, arb_typed, assert_capped, kinds, mutated, run, sample, sample_values,
    };
    use proptest::prelude::*;

    const SAMPLE: &str = r#"{"type":"thread.started","thread_id":"0199a213-81c0-7800-8aa1-bbab2a035a53"}
{"type":"turn.started"}
{"type":"item.completed","item":{"id":"item_0","type":"error","message":"Model metadata for `fake-model` not found. Defaulting to fallback metadata; this can degrade performance and cause issues."}}
{"type":"item.completed","item":{"id":"item_1","type":"reasoning","text":"**Listing files**"}}
{"type":"item.started","item":{"id":"item_2","type":"command_execution","command":"/bin/bash -lc ls","aggregated_output":"","exit_code":null,"status":"in_progress"}}
{"type":"item.completed","item":{"id":"item_2","type":"command_execution","command":"/bin/bash -lc ls","aggregated_output":"README.md\nsrc\n","exit_code":0,"status":"completed"}}
{"type":"item.started","item":{"id":"item_3","type":"command_execution","command":"/bin/bash -lc 'cat missing'","aggregated_output":"","exit_code":null,"status":"in_progress"}}
{"type":"item.completed","item":{"id":"item_3","type":"command_execution","command":"/bin/bash -lc 'cat missing'","aggregated_output":"cat: missing: No such file or directory\n","exit_code":1,"status":"failed"}}
{"type":"item.completed","item":{"id":"item_4","type":"file_change","changes":[{"path":"/tmp/task/repo/hello.txt","kind":"add"},{"path":"/tmp/task/repo/README.md","kind":"update"}],"status":"completed"}}
{"type":"item.started","item":{"id":"item_5","type":"mcp_tool_call","server":"docs","tool":"search","arguments":{"q":"x"},"result":null,"error":null,"status":"in_progress"}}
{"type":"item.completed","item":{"id":"item_5","type":"mcp_tool_call","server":"docs","tool":"search","arguments":{"q":"x"},"result":{"content":[{"type":"text","text":"found it"}],"structured_content":null},"error":null,"status":"completed"}}
{"type":"item.started","item":{"id":"item_6","type":"todo_list","items":[{"text":"write file","completed":false}]}}
{"type":"item.updated","item":{"id":"item_6","type":"todo_list","items":[{"text":"write file","completed":true}]}}
{"type":"item.completed","item":{"id":"item_7","type":"agent_message","text":"Created hello.txt."}}
{"type":"turn.completed","usage":{"input_tokens":24763,"cached_input_tokens":24448,"output_tokens":122}}
"#;

    #[test]
    fn a_tool_using_run_maps_to_normalized_events() {
        let mut p = CodexParser::new();
        let out = run(&mut p, SAMPLE);
        assert_eq!(
            kinds(&out),
            [
                "SessionStarted",
                "Raw",
                "ErrorEvent",
                "Raw",
                "ToolCall",
                "ToolResult",
                "ToolCall",
                "ToolResult",
                "FileChange",
                "FileChange",
                "ToolCall",
                "ToolResult",
                "Raw",
                "Raw",
                "AssistantMessage",
                "Usage",
                "Result",
            ]
        );
        assert_eq!(p.session_id(), Some("0199a213-81c0-7800-8aa1-bbab2a035a53"));
        let Body::ToolCall(c) = &out[4] else {
            unreachable!()
        };
        assert_eq!((c.call_id.as_str(), c.name.as_str()), ("item_2", "shell"));
        assert_eq!(c.input_json, r#"{"command":"/bin/bash -lc ls"}"#);
        let Body::ToolResult(r) = &out[5] else {
            unreachable!()
        };
        assert_eq!(
            (r.call_id.as_str(), r.output.as_str(), r.is_error),
            ("item_2", "README.md\nsrc\n", false)
        );
        let Body::ToolResult(r) = &out[7] else {
            unreachable!()
        };
        assert!(r.is_error);
        let Body::FileChange(f) = &out[8] else {
            unreachable!()
        };
        assert_eq!(
            (f.path.as_str(), f.change.as_str()),
            ("/tmp/task/repo/hello.txt", "add")
        );
        let Body::ToolCall(c) = &out[10] else {
            unreachable!()
        };
        assert_eq!(
            (c.name.as_str(), c.input_json.as_str()),
            ("docs/search", r#"{"q":"x"}"#)
        );
        let Body::ToolResult(r) = &out[11] else {
            unreachable!()
        };
        assert_eq!((r.output.as_str(), r.is_error), ("found it", false));
        let Body::Usage(u) = &out[15] else {
            unreachable!()
        };
        assert_eq!((u.input_tokens, u.output_tokens), (24763, 122));
        let Body::Result(res) = &out[16] else {
            unreachable!()
        };
        assert_eq!(
            (res.is_error, res.text.as_str(), res.turns),
            (false, "Created hello.txt.", 1)
        );
    }

    #[test]
    fn a_failed_turn_is_an_error_result() {
        let mut p = CodexParser::new();
        let out = run(
            &mut p,
            r#"{"type":"thread.started","thread_id":"t"}
{"type":"turn.started"}
{"type":"error","message":"Reconnecting... 1/5 (stream disconnected before completion)"}
{"type":"turn.failed","error":{"message":"unexpected status 401 Unauthorized"}}
"#,
        );
        assert_eq!(
            kinds(&out),
            [
                "SessionStarted",
                "Raw",
                "ErrorEvent",
                "ErrorEvent",
                "Result"
            ]
        );
        let Body::Result(r) = &out[4] else {
            unreachable!()
        };
        assert!(r.is_error);
        assert_eq!(r.text, "unexpected status 401 Unauthorized");
        // finish() reports once.
        assert!(p.finish().is_empty());
    }

    #[test]
    fn no_turn_end_no_result_and_completions_without_starts() {
        let mut p = CodexParser::new();
        let out = run(
            &mut p,
            r#"{"type":"item.completed","item":{"id":"i","type":"mcp_tool_call","server":"s","tool":"t","arguments":{},"result":null,"error":{"message":"boom"},"status":"failed"}}
{"type":"item.completed","item":{"id":"j","type":"command_execution","command":"false","aggregated_output":"","exit_code":null,"status":"declined"}}
{"type":"item.completed","item":{"id":"k","type":"file_change","changes":[{"path":"a","kind":"add"}],"status":"failed"}}
"#,
        );
        assert_eq!(
            kinds(&out),
            ["ToolCall", "ToolResult", "ToolCall", "ToolResult", "Raw"]
        );
        let Body::ToolResult(r) = &out[1] else {
            unreachable!()
        };
        assert_eq!((r.output.as_str(), r.is_error), ("boom", true));
        let Body::ToolResult(r) = &out[3] else {
            unreachable!()
        };
        assert!(r.is_error);
    }

    #[test]
    fn unknown_invalid_truncated_and_empty_lines() {
        let mut p = CodexParser::new();
        assert!(p.line("", false).is_empty());
        for l in [
            "Reading prompt from stdin...",
            r#"{"type":"item.plan.delta","item_id":"x","delta":"y"}"#,
            r#"{"type":"thread.started","thread_id":5}"#,
            r#"{"type":"turn.completed"#,
            "null",
        ] {
            assert_eq!(kinds(&p.line(l, false)), ["Raw"], "{l}");
        }
        assert_eq!(
            kinds(&p.line(r#"{"type":"thread.started","thread_id":"t"}"#, true)),
            ["Raw"]
        );
        assert_eq!(p.session_id(), None);
        assert!(p.finish().is_empty());
    }

    #[test]
    fn long_outputs_are_capped() {
        let big = "x".repeat(MAX_FIELD_BYTES * 2);
        let l = serde_json::json!({"type": "item.completed", "item": {"id": "i", "type": "command_execution", "command": big, "aggregated_output": big, "exit_code": 0, "status": "completed"}}).to_string();
        let out = CodexParser::new().line(&l, false);
        assert_eq!(kinds(&out), ["ToolCall", "ToolResult"]);
        assert_capped(&out);
    }

    #[test]
    fn provider_samples_when_present() {
        let Some(text) = sample(&["codex"]) else {
            return;
        };
        let mut p = CodexParser::new();
        let out = run(&mut p, &text);
        let ks = kinds(&out);
        let mapped: Vec<&str> = ks.iter().copied().filter(|k| *k != "Raw").collect();
        assert_eq!(mapped.first(), Some(&"SessionStarted"), "{ks:?}");
        assert!(mapped.contains(&"AssistantMessage"), "{ks:?}");
        assert!(
            mapped.contains(&"ToolCall") && mapped.contains(&"ToolResult"),
            "{ks:?}"
        );
        assert!(mapped.contains(&"Usage"), "{ks:?}");
        assert_eq!(mapped.last(), Some(&"Result"), "{ks:?}");
        assert!(p.session_id().is_some());
        assert_capped(&out);
    }

    const TYPES: &[&str] = &[
        "thread.started",
        "turn.started",
        "turn.completed",
        "turn.failed",
        "item.started",
        "item.updated",
        "item.completed",
        "error",
    ];
    const WORDS: &[&str] = &[
        "type",
        "thread_id",
        "item",
        "id",
        "agent_message",
        "reasoning",
        "command_execution",
        "file_change",
        "mcp_tool_call",
        "web_search",
        "todo_list",
        "error",
        "text",
        "command",
        "aggregated_output",
        "exit_code",
        "status",
        "completed",
        "failed",
        "declined",
        "changes",
        "path",
        "kind",
        "server",
        "tool",
        "arguments",
        "result",
        "content",
        "structured_content",
        "message",
        "usage",
        "input_tokens",
        "cached_input_tokens",
        "output_tokens",
    ];

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic_and_are_never_dropped(line in arb_line(), truncated in any::<bool>()) {
            let mut p = CodexParser::new();
            let out = p.line(&line, truncated);
            if truncated || !line.trim().is_empty() {
                prop_assert!(!out.is_empty());
            }
            if truncated {
                prop_assert_eq!(kinds(&out), ["Raw"]);
            }
            prop_assert!(p.finish().is_empty());
        }

        #[test]
        fn arbitrary_json_never_panics(v in arb_json(WORDS)) {
            let mut p = CodexParser::new();
            let out = p.line(&v.to_string(), false);
            prop_assert!(!out.is_empty());
            assert_capped(&out);
            assert_capped(&p.finish());
        }

        #[test]
        fn known_types_with_random_fields_never_panic(
            vs in prop::collection::vec(arb_typed(TYPES, WORDS), 1..8)
        ) {
            let mut p = CodexParser::new();
            for v in &vs {
                let out = p.line(&v.to_string(), false);
                prop_assert!(!out.is_empty());
                assert_capped(&out);
            }
            let fin = p.finish();
            prop_assert!(fin.len() <= 1);
            assert_capped(&fin);
        }

        #[test]
        fn realistic_lines_with_wrong_or_missing_fields_never_panic(
            vs in prop::collection::vec(mutated(sample_values(SAMPLE), WORDS), 1..8)
        ) {
            let mut p = CodexParser::new();
            for v in &vs {
                let out = p.line(&v.to_string(), false);
                prop_assert!(!out.is_empty());
                assert_capped(&out);
            }
            assert_capped(&p.finish());
        }
    }

    #[test]
    fn reconnecting_is_a_connection_error() {
        assert!(super::is_connection_retry(
            r#"{"type":"error","message":"Reconnecting... 1/5 (stream disconnected before completion)"}"#
        ));
        assert!(super::is_connection_retry(
            r#"{"type":"error","message":"Reconnecting... waiting for network (Connection failed: error sending request)"}"#
        ));
        assert!(!super::is_connection_retry(
            r#"{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"Reconnecting... is what I said"}}"#
        ));
    }
}
