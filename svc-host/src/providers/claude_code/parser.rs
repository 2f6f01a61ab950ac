//! Claude Code: `claude -p PROMPT --output-format stream-json --verbose`, one JSON object a line.
//!
//! - `system`/`init` → `SessionStarted{session_id, model}` (again only if the id changes);
//! - `assistant` → one `AssistantMessage` per non-empty `text` block and one `ToolCall` per
//!   `tool_use` block; `Write` yields `FileChange{change: "write"}` and `Edit`/`MultiEdit`/
//!   `NotebookEdit` yield `FileChange{change: "edit"}` right after their `ToolCall` (the path is
//!   `input.file_path`, or `input.notebook_path`); `thinking` blocks are skipped;
//! - `user` with `tool_result` blocks → `ToolResult{tool_use_id, text content joined, is_error}`;
//! - `result` → `Usage` (input counts cache creation and cache reads) then `Result`;
//! - everything else (`control_request`, `stream_event`, other `system` subtypes, …) → `Raw`.

use crate::providers::{
    StreamParser, bool_of, cap, count_of, json_line, json_text, number_of, obj_of, str_of,
    str_or_empty, turns,
};
use agentscope_schemas::v1::{
    AssistantMessage, FileChange, Result as ResultEvent, SessionStarted, ToolCall, ToolResult,
    Usage, execution_event::Body,
};
use serde_json::{Map, Value};

pub const PROVIDER: &str = agentscope_domain::Provider::ClaudeCode.as_str();

#[derive(Debug, Default)]
pub struct ClaudeParser {
    session_id: Option<String>,
}

impl ClaudeParser {
    pub fn new() -> Self {
        Self::default()
    }

    fn map(&mut self, v: &Map<String, Value>) -> Vec<Body> {
        let mut out = vec![];
        match str_or_empty(v, "type") {
            "system" if str_of(v, "subtype") == Some("init") => {
                let sid = str_or_empty(v, "session_id");
                if !sid.is_empty() && self.session_id.as_deref() != Some(sid) {
                    self.session_id = Some(sid.to_owned());
                    out.push(Body::SessionStarted(SessionStarted {
                        provider_session_id: sid.to_owned(),
                        model: str_or_empty(v, "model").to_owned(),
                    }));
                }
            }
            "assistant" => {
                for block in content_blocks(v) {
                    match str_or_empty(block, "type") {
                        "text" => {
                            let text = str_or_empty(block, "text");
                            if !text.trim().is_empty() {
                                out.push(Body::AssistantMessage(AssistantMessage {
                                    text: cap(text),
                                }));
                            }
                        }
                        "tool_use" => {
                            let name = str_or_empty(block, "name");
                            let input = block.get("input");
                            out.push(Body::ToolCall(ToolCall {
                                call_id: str_or_empty(block, "id").to_owned(),
                                name: name.to_owned(),
                                input_json: json_text(input),
                            }));
                            if let Some(change) = file_change(name, input) {
                                out.push(Body::FileChange(change));
                            }
                        }
                        _ => {}
                    }
                }
            }
            "user" => {
                for block in content_blocks(v) {
                    if str_of(block, "type") == Some("tool_result") {
                        out.push(Body::ToolResult(ToolResult {
                            call_id: str_or_empty(block, "tool_use_id").to_owned(),
                            output: cap(&content_text(block.get("content"))),
                            is_error: bool_of(block, "is_error").unwrap_or(false),
                        }));
                    }
                }
            }
            "result" => {
                let usage = obj_of(v, "usage");
                let cost = number_of(v, "total_cost_usd");
                if usage.is_some() || cost.is_some() {
                    let u = |k: &str| usage.and_then(|u| count_of(u, k)).unwrap_or(0);
                    out.push(Body::Usage(Usage {
                        input_tokens: u("input_tokens")
                            .saturating_add(u("cache_creation_input_tokens"))
                            .saturating_add(u("cache_read_input_tokens")),
                        output_tokens: u("output_tokens"),
                        cost_usd: cost.unwrap_or(0.0),
                    }));
                }
                let is_error = bool_of(v, "is_error")
                    .unwrap_or_else(|| str_of(v, "subtype").is_some_and(|s| s != "success"));
                out.push(Body::Result(ResultEvent {
                    is_error,
                    text: cap(&result_text(v)),
                    turns: turns(count_of(v, "num_turns").unwrap_or(0)),
                }));
            }
            _ => {}
        }
        if self.session_id.is_none()
            && let Some(sid) = str_of(v, "session_id").filter(|s| !s.is_empty())
        {
            self.session_id = Some(sid.to_owned());
        }
        out
    }
}

impl StreamParser for ClaudeParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        json_line(PROVIDER, line, truncated, |v| self.map(v))
    }

    fn finish(&mut self) -> Vec<Body> {
        vec![]
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }
}

/// The object blocks of `message.content` (a string content has none).
fn content_blocks(v: &Map<String, Value>) -> impl Iterator<Item = &Map<String, Value>> {
    obj_of(v, "message")
        .and_then(|m| m.get("content"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
}

fn file_change(tool: &str, input: Option<&Value>) -> Option<FileChange> {
    let change = match tool {
        "Write" => "write",
        "Edit" | "MultiEdit" | "NotebookEdit" => "edit",
        _ => return None,
    };
    let input = input?.as_object()?;
    let path = str_of(input, "file_path")
        .or_else(|| str_of(input, "notebook_path"))
        .filter(|p| !p.is_empty())?;
    Some(FileChange {
        path: path.to_owned(),
        change: change.into(),
    })
}

/// A tool result's content: a string, or the `text` of its blocks joined by newlines (images and
/// other non-text blocks are left out); anything else as JSON.
fn content_text(content: Option<&Value>) -> String {
    match content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut out = String::new();
            for text in blocks
                .iter()
                .filter_map(Value::as_object)
                .filter_map(|b| str_of(b, "text"))
            {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(text);
                if out.len() > crate::providers::MAX_FIELD_BYTES {
                    break;
                }
            }
            out
        }
        Some(other) => json_text(Some(other)),
    }
}

/// `result`, or for error subtypes without one, their `errors` joined, or the subtype.
fn result_text(v: &Map<String, Value>) -> String {
    if let Some(r) = str_of(v, "result") {
        return r.to_owned();
    }
    let errors: Vec<&str> = v
        .get("errors")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if !errors.is_empty() {
        return errors.join("\n");
    }
    str_or_empty(v, "subtype").to_owned()
}

/// Claude Code's `api_retry` system event for a request that got no HTTP status: the model
/// endpoint could not be reached (refused connection, DNS, TLS). Retries with a status (429,
/// 5xx) and refused credentials (401/403, `fatal`) are something else.
pub fn is_connection_retry(line: &str) -> bool {
    if !line.contains("api_retry") {
        return false;
    }
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        return false;
    };
    v["type"] == "system"
        && v["subtype"] == "api_retry"
        && v["error_status"].is_null()
        && v["error"] != "authentication_failed"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::MAX_FIELD_BYTES;
    use crate::providers::testutil::{
        arb_json, arb_line, arb_typed, assert_capped, kinds, mutated, run, sample, sample_values,
    };
    use proptest::prelude::*;

    const SAMPLE: &str = r#"{"type":"system","subtype":"init","cwd":"/tmp/task/repo","session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","tools":["Task","Bash","Glob","Grep","Read","Edit","MultiEdit","Write","NotebookEdit","WebFetch","TodoWrite"],"mcp_servers":[],"model":"claude-sonnet-4-5-20250929","permissionMode":"default","slash_commands":["compact","review"],"apiKeySource":"ANTHROPIC_API_KEY","claude_code_version":"2.1.332","output_style":"default","agents":[],"uuid":"0b8c6a42-8f59-4a8a-a1a5-5fb0b0d1c001"}
{"type":"assistant","message":{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"thinking","thinking":"list files","signature":"x"},{"type":"text","text":"I'll look at the repository first."}],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":1500,"cache_read_input_tokens":0,"output_tokens":30,"service_tier":"standard"}},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"a1"}
{"type":"assistant","message":{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"tool_use","id":"toolu_01A","name":"Bash","input":{"command":"ls -la","description":"List files"}}],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":30}},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"a2"}
{"type":"user","message":{"role":"user","content":[{"tool_use_id":"toolu_01A","type":"tool_result","content":"total 8\n-rw-r--r-- 1 u u 12 README.md","is_error":false}]},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"u1","tool_use_result":{"stdout":"total 8","stderr":"","interrupted":false,"isImage":false}}
{"type":"assistant","message":{"id":"msg_02","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"tool_use","id":"toolu_01B","name":"Write","input":{"file_path":"/tmp/task/repo/hello.txt","content":"hello\n"}}],"stop_reason":null,"usage":{"input_tokens":4,"output_tokens":20}},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"a3"}
{"type":"user","message":{"role":"user","content":[{"tool_use_id":"toolu_01B","type":"tool_result","content":[{"type":"text","text":"File created successfully at: /tmp/task/repo/hello.txt"}]}]},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"u2"}
{"type":"assistant","message":{"id":"msg_03","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"tool_use","id":"toolu_01C","name":"Edit","input":{"file_path":"/tmp/task/repo/README.md","old_string":"a","new_string":"b"}}],"usage":{"input_tokens":4,"output_tokens":20}},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"a4"}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"<tool_use_error>String to replace not found in file.</tool_use_error>","is_error":true,"tool_use_id":"toolu_01C"}]},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"u3"}
{"type":"assistant","message":{"id":"msg_04","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"text","text":"Created hello.txt."}],"usage":{"input_tokens":4,"output_tokens":6}},"parent_tool_use_id":null,"session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","uuid":"a5"}
{"type":"result","subtype":"success","is_error":false,"duration_ms":5321,"duration_api_ms":4100,"num_turns":4,"result":"Created hello.txt.","session_id":"5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11","total_cost_usd":0.0123,"usage":{"input_tokens":24,"cache_creation_input_tokens":1500,"cache_read_input_tokens":3000,"output_tokens":76,"server_tool_use":{"web_search_requests":0},"service_tier":"standard"},"modelUsage":{},"permission_denials":[],"uuid":"r1"}
"#;

    #[test]
    fn a_tool_using_run_maps_to_normalized_events() {
        let mut p = ClaudeParser::new();
        let out = run(&mut p, SAMPLE);
        assert_eq!(
            kinds(&out),
            [
                "SessionStarted",
                "AssistantMessage",
                "ToolCall",
                "ToolResult",
                "ToolCall",
                "FileChange",
                "ToolResult",
                "ToolCall",
                "FileChange",
                "ToolResult",
                "AssistantMessage",
                "Usage",
                "Result",
            ]
        );
        assert_eq!(p.session_id(), Some("5d0b7a4e-2f0e-4c1a-9d64-0c1b3f0e9a11"));
        let Body::SessionStarted(s) = &out[0] else {
            unreachable!()
        };
        assert_eq!(s.model, "claude-sonnet-4-5-20250929");
        let Body::ToolCall(c) = &out[2] else {
            unreachable!()
        };
        assert_eq!((c.call_id.as_str(), c.name.as_str()), ("toolu_01A", "Bash"));
        let input: Value = serde_json::from_str(&c.input_json).unwrap();
        assert_eq!(input["command"], "ls -la");
        let Body::ToolResult(r) = &out[3] else {
            unreachable!()
        };
        assert_eq!(r.call_id, "toolu_01A");
        assert!(r.output.contains("README.md") && !r.is_error);
        let Body::FileChange(f) = &out[5] else {
            unreachable!()
        };
        assert_eq!(
            (f.path.as_str(), f.change.as_str()),
            ("/tmp/task/repo/hello.txt", "write")
        );
        let Body::ToolResult(r) = &out[6] else {
            unreachable!()
        };
        assert_eq!(
            r.output,
            "File created successfully at: /tmp/task/repo/hello.txt"
        );
        let Body::FileChange(f) = &out[8] else {
            unreachable!()
        };
        assert_eq!(f.change, "edit");
        let Body::ToolResult(r) = &out[9] else {
            unreachable!()
        };
        assert!(r.is_error);
        let Body::Usage(u) = &out[11] else {
            unreachable!()
        };
        assert_eq!((u.input_tokens, u.output_tokens), (24 + 1500 + 3000, 76));
        assert!((u.cost_usd - 0.0123).abs() < 1e-12);
        let Body::Result(res) = &out[12] else {
            unreachable!()
        };
        assert_eq!(
            (res.is_error, res.text.as_str(), res.turns),
            (false, "Created hello.txt.", 4)
        );
    }

    #[test]
    fn error_results_and_approval_requests() {
        let mut p = ClaudeParser::new();
        let out = p.line(
            r#"{"type":"result","subtype":"error_max_turns","is_error":true,"num_turns":2,"session_id":"s1","total_cost_usd":0.5,"usage":{"input_tokens":1,"output_tokens":2}}"#,
            false,
        );
        assert_eq!(kinds(&out), ["Usage", "Result"]);
        let Body::Result(r) = &out[1] else {
            unreachable!()
        };
        assert!(r.is_error);
        assert_eq!(r.text, "error_max_turns");
        assert_eq!(p.session_id(), Some("s1"));

        let out = p.line(
            r#"{"type":"result","subtype":"error_during_execution","num_turns":1,"errors":["No conversation found with session ID: x"]}"#,
            false,
        );
        assert_eq!(kinds(&out), ["Result"]);
        let Body::Result(r) = &out[0] else {
            unreachable!()
        };
        assert!(r.is_error && r.text.contains("No conversation found"));

        let approval = r#"{"type":"control_request","request_id":"req_1","request":{"subtype":"can_use_tool","tool_name":"Bash","input":{"command":"rm -rf /"},"permission_suggestions":[]}}"#;
        let out = p.line(approval, false);
        assert_eq!(kinds(&out), ["Raw"]);
        let Body::Raw(raw) = &out[0] else {
            unreachable!()
        };
        assert_eq!(
            (raw.provider.as_str(), raw.line.as_str()),
            (PROVIDER, approval)
        );
    }

    #[test]
    fn unknown_invalid_truncated_and_empty_lines() {
        let mut p = ClaudeParser::new();
        assert!(p.line("", false).is_empty());
        assert!(p.line("   ", false).is_empty());
        for l in [
            "not json at all",
            "[1,2,3]",
            r#"{"type":"stream_event","event":{"type":"content_block_delta"}}"#,
            r#"{"type":"system","subtype":"compact_boundary"}"#,
            r#"{"type":"assistant","message":{"content":[{"type":"thinking","thinking":"hm"}]}}"#,
            r#"{"type":"user","message":{"role":"user","content":"plain prompt"}}"#,
            r#"{"type":"assistant","message":{"content":"#,
        ] {
            assert_eq!(kinds(&p.line(l, false)), ["Raw"], "{l}");
        }
        // A truncated line is never parsed, even when it happens to be valid JSON.
        let out = p.line(
            r#"{"type":"system","subtype":"init","session_id":"x"}"#,
            true,
        );
        assert_eq!(kinds(&out), ["Raw"]);
        assert_eq!(p.session_id(), None);
    }

    #[test]
    fn a_repeated_init_with_the_same_id_is_raw_and_a_new_id_restarts() {
        let mut p = ClaudeParser::new();
        let init = |id: &str| {
            format!(r#"{{"type":"system","subtype":"init","session_id":"{id}","model":"m"}}"#)
        };
        assert_eq!(kinds(&p.line(&init("a"), false)), ["SessionStarted"]);
        assert_eq!(kinds(&p.line(&init("a"), false)), ["Raw"]);
        assert_eq!(kinds(&p.line(&init("b"), false)), ["SessionStarted"]);
        assert_eq!(p.session_id(), Some("b"));
    }

    #[test]
    fn long_fields_are_capped() {
        let big = "ü".repeat(MAX_FIELD_BYTES);
        let line = serde_json::json!({
            "type": "assistant",
            "message": {"content": [
                {"type": "text", "text": big},
                {"type": "tool_use", "id": "t", "name": "Write", "input": {"file_path": "/a", "content": big}},
            ]}
        })
        .to_string();
        let out = p_line(&line);
        assert_eq!(kinds(&out), ["AssistantMessage", "ToolCall", "FileChange"]);
        assert_capped(&out);
        let tr = serde_json::json!({
            "type": "user",
            "message": {"content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": big}, {"type": "text", "text": big}]}]}
        })
        .to_string();
        let out = p_line(&tr);
        assert_eq!(kinds(&out), ["ToolResult"]);
        assert_capped(&out);
    }

    fn p_line(l: &str) -> Vec<Body> {
        ClaudeParser::new().line(l, false)
    }

    #[test]
    fn provider_samples_when_present() {
        let Some(text) = sample(&["claude-code", "claude"]) else {
            return;
        };
        let mut p = ClaudeParser::new();
        let out = run(&mut p, &text);
        let ks = kinds(&out);
        let mapped: Vec<&str> = ks.iter().copied().filter(|k| *k != "Raw").collect();
        assert_eq!(mapped.first(), Some(&"SessionStarted"), "{ks:?}");
        assert!(mapped.contains(&"AssistantMessage"), "{ks:?}");
        assert!(
            mapped.contains(&"ToolCall") && mapped.contains(&"ToolResult"),
            "{ks:?}"
        );
        assert_eq!(&mapped[mapped.len() - 2..], ["Usage", "Result"], "{ks:?}");
        assert!(p.session_id().is_some());
        assert_capped(&out);
    }

    const TYPES: &[&str] = &[
        "system",
        "assistant",
        "user",
        "result",
        "control_request",
        "stream_event",
    ];
    const WORDS: &[&str] = &[
        "type",
        "subtype",
        "init",
        "session_id",
        "model",
        "message",
        "content",
        "text",
        "tool_use",
        "tool_result",
        "id",
        "name",
        "input",
        "tool_use_id",
        "is_error",
        "file_path",
        "notebook_path",
        "Write",
        "Edit",
        "MultiEdit",
        "NotebookEdit",
        "usage",
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "total_cost_usd",
        "num_turns",
        "result",
        "errors",
        "success",
    ];

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic_and_are_never_dropped(line in arb_line(), truncated in any::<bool>()) {
            let mut p = ClaudeParser::new();
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
            let out = ClaudeParser::new().line(&v.to_string(), false);
            prop_assert!(!out.is_empty());
            assert_capped(&out);
        }

        #[test]
        fn known_types_with_random_fields_never_panic(
            vs in prop::collection::vec(arb_typed(TYPES, WORDS), 1..6)
        ) {
            let mut p = ClaudeParser::new();
            for v in &vs {
                let out = p.line(&v.to_string(), false);
                prop_assert!(!out.is_empty());
                assert_capped(&out);
            }
            p.finish();
        }

        #[test]
        fn realistic_lines_with_wrong_or_missing_fields_never_panic(
            vs in prop::collection::vec(mutated(sample_values(SAMPLE), WORDS), 1..8)
        ) {
            let mut p = ClaudeParser::new();
            for v in &vs {
                let out = p.line(&v.to_string(), false);
                prop_assert!(!out.is_empty());
                assert_capped(&out);
            }
            assert_capped(&p.finish());
        }
    }

    #[test]
    fn a_retry_without_status_is_a_connection_error() {
        let down = r#"{"type":"system","subtype":"api_retry","attempt":1,"max_retries":10,"retry_delay_ms":520,"error_status":null,"error":"unknown","session_id":"s"}"#;
        assert!(super::is_connection_retry(down));
        let absent = r#"{"type":"system","subtype":"api_retry","attempt":2,"error":"unknown"}"#;
        assert!(super::is_connection_retry(absent));
        let overloaded = r#"{"type":"system","subtype":"api_retry","attempt":1,"error_status":529,"error":"overloaded"}"#;
        assert!(!super::is_connection_retry(overloaded));
        let refused = r#"{"type":"system","subtype":"api_retry","attempt":1,"error_status":null,"error":"authentication_failed"}"#;
        assert!(!super::is_connection_retry(refused));
        assert!(!super::is_connection_retry(
            r#"{"type":"system","subtype":"init"}"#
        ));
    }
}
