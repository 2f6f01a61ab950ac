//! opencode: `opencode run --format json`, one JSON object a line, each
//! `{type, timestamp, sessionID, part | error}`.
//!
//! - the first `sessionID` seen → `SessionStarted` (no model is reported), before the line's
//!   other events;
//! - `text` → `AssistantMessage{part.text}` (blank texts are skipped);
//! - `tool_use` (emitted once the tool is `completed` or `error`) → `ToolCall{part.callID,
//!   part.tool, state.input}` then `ToolResult{state.output | state.error}`; a completed `write`
//!   / `edit` / `multiedit` also yields `FileChange{input.filePath, "write" | "edit"}` between
//!   the two;
//! - `step_finish` → `Usage` from `part.tokens` (input counts `cache.read` and `cache.write`,
//!   which opencode reports apart from `input`) and `part.cost`;
//! - `error` → `ErrorEvent{error.data.message | error.message | error.name, code: error.name}`;
//! - `finish()` → `Result` once a step finished or an error was seen: `is_error` when an error was
//!   seen, the last text, `turns` = finished steps;
//! - everything else (`step_start`, `reasoning`, unknown types) → `Raw`.

use crate::providers::{
    StreamParser, cap, count_of, json_line, json_text, number_of, obj_of, str_of, str_or_empty,
    turns,
};
use agentscope_schemas::v1::{
    AssistantMessage, ErrorEvent, FileChange, Result as ResultEvent, SessionStarted, ToolCall,
    ToolResult, Usage, execution_event::Body,
};
use serde_json::{Map, Value};

pub const PROVIDER: &str = agentscope_domain::Provider::Opencode.as_str();

#[derive(Debug, Default)]
pub struct OpencodeParser {
    session_id: Option<String>,
    last_text: Option<String>,
    steps: u64,
    saw_error: bool,
    first_error: Option<String>,
}

impl OpencodeParser {
    pub fn new() -> Self {
        Self::default()
    }

    fn map(&mut self, v: &Map<String, Value>) -> Vec<Body> {
        let mut out = vec![];
        if self.session_id.is_none()
            && let Some(sid) = str_of(v, "sessionID").filter(|s| !s.is_empty())
        {
            self.session_id = Some(sid.to_owned());
            out.push(Body::SessionStarted(SessionStarted {
                provider_session_id: sid.to_owned(),
                model: String::new(),
            }));
        }
        let part = obj_of(v, "part");
        match (str_or_empty(v, "type"), part) {
            ("text", Some(part)) => {
                let text = str_or_empty(part, "text");
                if !text.trim().is_empty() {
                    let text = cap(text);
                    self.last_text = Some(text.clone());
                    out.push(Body::AssistantMessage(AssistantMessage { text }));
                }
            }
            ("tool_use", Some(part)) => tool_use(part, &mut out),
            ("step_finish", Some(part)) => {
                self.steps = self.steps.saturating_add(1);
                let tokens = obj_of(part, "tokens");
                let t = |k: &str| tokens.and_then(|t| count_of(t, k)).unwrap_or(0);
                let cache = tokens.and_then(|t| obj_of(t, "cache"));
                let c = |k: &str| cache.and_then(|c| count_of(c, k)).unwrap_or(0);
                let cost = number_of(part, "cost");
                if tokens.is_some() || cost.is_some() {
                    out.push(Body::Usage(Usage {
                        input_tokens: t("input")
                            .saturating_add(c("read"))
                            .saturating_add(c("write")),
                        output_tokens: t("output"),
                        cost_usd: cost.unwrap_or(0.0),
                    }));
                }
            }
            ("error", _) => {
                let (message, code) = error_fields(v.get("error"));
                self.saw_error = true;
                if self.first_error.is_none() {
                    self.first_error = Some(message.clone());
                }
                out.push(Body::Error(ErrorEvent { message, code }));
            }
            _ => {}
        }
        out
    }
}

impl StreamParser for OpencodeParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        json_line(PROVIDER, line, truncated, |v| self.map(v))
    }

    fn finish(&mut self) -> Vec<Body> {
        if self.steps == 0 && !self.saw_error {
            return vec![];
        }
        let text = match (self.last_text.take(), self.first_error.take()) {
            (Some(t), _) => t,
            (None, Some(e)) => e,
            (None, None) => String::new(),
        };
        let out = vec![Body::Result(ResultEvent {
            is_error: self.saw_error,
            text,
            turns: turns(self.steps),
        })];
        self.steps = 0;
        self.saw_error = false;
        out
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }
}

fn tool_use(part: &Map<String, Value>, out: &mut Vec<Body>) {
    let Some(state) = obj_of(part, "state") else {
        return;
    };
    let status = str_or_empty(state, "status");
    if !matches!(status, "completed" | "error") {
        return;
    }
    let call_id = str_of(part, "callID")
        .or_else(|| str_of(part, "id"))
        .unwrap_or("");
    let tool = str_or_empty(part, "tool");
    let input = state.get("input");
    out.push(Body::ToolCall(ToolCall {
        call_id: call_id.to_owned(),
        name: tool.to_owned(),
        input_json: json_text(input),
    }));
    if status == "completed"
        && let Some(change) = file_change(tool, input)
    {
        out.push(Body::FileChange(change));
    }
    let output = if status == "completed" {
        text_of(state.get("output"))
    } else {
        text_of(state.get("error"))
    };
    out.push(Body::ToolResult(ToolResult {
        call_id: call_id.to_owned(),
        output,
        is_error: status == "error",
    }));
}

fn file_change(tool: &str, input: Option<&Value>) -> Option<FileChange> {
    let change = match tool {
        "write" => "write",
        "edit" | "multiedit" => "edit",
        _ => return None,
    };
    let input = input?.as_object()?;
    let path = str_of(input, "filePath")
        .or_else(|| str_of(input, "file_path"))
        .filter(|p| !p.is_empty())?;
    Some(FileChange {
        path: path.to_owned(),
        change: change.into(),
    })
}

/// A string as it is (capped); other JSON as compact text; missing → "".
fn text_of(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => cap(s),
        Some(other) => cap(&json_text(Some(other))),
    }
}

/// (message, code) of an opencode error object `{name, data: {message}}`.
fn error_fields(e: Option<&Value>) -> (String, String) {
    match e {
        Some(Value::Object(o)) => {
            let name = str_or_empty(o, "name");
            let message = obj_of(o, "data")
                .and_then(|d| str_of(d, "message"))
                .or_else(|| str_of(o, "message"))
                .filter(|m| !m.is_empty())
                .map(cap)
                .unwrap_or_else(|| {
                    if name.is_empty() {
                        json_text(e).chars().take(4096).collect()
                    } else {
                        name.to_owned()
                    }
                });
            (message, name.to_owned())
        }
        Some(Value::String(s)) => (cap(s), String::new()),
        None | Some(Value::Null) => (String::new(), String::new()),
        Some(other) => (cap(&json_text(Some(other))), String::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::MAX_FIELD_BYTES;
    use crate::providers::testutil::{
        arb_json, arb_line, arb_typed, assert_capped, kinds, mutated, run, sample, sample_values,
    };
    use proptest::prelude::*;

    const SAMPLE: &str = r#"{"type":"step_start","timestamp":1767000000000,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_1","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_1","type":"step-start","snapshot":"4b825dc642cb6eb9a060e54bf8d69288fbee4904"}}
{"type":"tool_use","timestamp":1767000000100,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_2","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_1","type":"tool","callID":"call_abc","tool":"bash","state":{"status":"completed","input":{"command":"ls","description":"List files"},"output":"README.md\n","title":"List files","metadata":{"output":"README.md\n","exit":0},"time":{"start":1767000000050,"end":1767000000090}}}}
{"type":"tool_use","timestamp":1767000000200,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_3","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_1","type":"tool","callID":"call_def","tool":"write","state":{"status":"completed","input":{"filePath":"/tmp/task/repo/hello.txt","content":"hello\n"},"output":"","title":"hello.txt","metadata":{},"time":{"start":1,"end":2}}}}
{"type":"tool_use","timestamp":1767000000300,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_4","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_1","type":"tool","callID":"call_ghi","tool":"edit","state":{"status":"error","input":{"filePath":"/tmp/task/repo/x.txt","oldString":"a","newString":"b"},"error":"Error: File /tmp/task/repo/x.txt not found","time":{"start":1,"end":2}}}}
{"type":"step_finish","timestamp":1767000000400,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_5","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_1","type":"step-finish","reason":"tool-calls","snapshot":"x","cost":0.0021,"tokens":{"input":1200,"output":40,"reasoning":0,"cache":{"read":800,"write":0}}}}
{"type":"step_start","timestamp":1767000000500,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_6","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_2","type":"step-start"}}
{"type":"text","timestamp":1767000000600,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_7","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_2","type":"text","text":"Created hello.txt.","time":{"start":1767000000550,"end":1767000000600}}}
{"type":"step_finish","timestamp":1767000000700,"sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","part":{"id":"prt_8","sessionID":"ses_4a1b2c3d4e5fGhIjKlMnOpQr","messageID":"msg_2","type":"step-finish","reason":"stop","cost":0.001,"tokens":{"input":50,"output":8,"reasoning":0,"cache":{"read":1900,"write":0}}}}
"#;

    #[test]
    fn a_tool_using_run_maps_to_normalized_events() {
        let mut p = OpencodeParser::new();
        let out = run(&mut p, SAMPLE);
        assert_eq!(
            kinds(&out),
            [
                "SessionStarted",
                "ToolCall",
                "ToolResult",
                "ToolCall",
                "FileChange",
                "ToolResult",
                "ToolCall",
                "ToolResult",
                "Usage",
                "Raw",
                "AssistantMessage",
                "Usage",
                "Result",
            ]
        );
        assert_eq!(p.session_id(), Some("ses_4a1b2c3d4e5fGhIjKlMnOpQr"));
        let Body::ToolCall(c) = &out[1] else {
            unreachable!()
        };
        assert_eq!((c.call_id.as_str(), c.name.as_str()), ("call_abc", "bash"));
        assert_eq!(
            serde_json::from_str::<Value>(&c.input_json).unwrap()["command"],
            "ls"
        );
        let Body::ToolResult(r) = &out[2] else {
            unreachable!()
        };
        assert_eq!((r.output.as_str(), r.is_error), ("README.md\n", false));
        let Body::FileChange(f) = &out[4] else {
            unreachable!()
        };
        assert_eq!(
            (f.path.as_str(), f.change.as_str()),
            ("/tmp/task/repo/hello.txt", "write")
        );
        let Body::ToolResult(r) = &out[7] else {
            unreachable!()
        };
        assert!(r.is_error && r.output.contains("not found"));
        let Body::Usage(u) = &out[8] else {
            unreachable!()
        };
        assert_eq!((u.input_tokens, u.output_tokens), (2000, 40));
        assert!((u.cost_usd - 0.0021).abs() < 1e-12);
        let Body::Result(res) = &out[12] else {
            unreachable!()
        };
        assert_eq!(
            (res.is_error, res.text.as_str(), res.turns),
            (false, "Created hello.txt.", 2)
        );
    }

    #[test]
    fn a_session_error_makes_an_error_result() {
        let mut p = OpencodeParser::new();
        let out = run(
            &mut p,
            r#"{"type":"error","timestamp":1,"sessionID":"ses_x","error":{"name":"APIError","data":{"message":"Connection refused","statusCode":503,"isRetryable":true}}}
"#,
        );
        assert_eq!(kinds(&out), ["SessionStarted", "ErrorEvent", "Result"]);
        let Body::Error(e) = &out[1] else {
            unreachable!()
        };
        assert_eq!(
            (e.message.as_str(), e.code.as_str()),
            ("Connection refused", "APIError")
        );
        let Body::Result(r) = &out[2] else {
            unreachable!()
        };
        assert!(r.is_error);
        assert_eq!(r.text, "Connection refused");
        assert!(p.finish().is_empty());
    }

    #[test]
    fn unknown_invalid_truncated_and_empty_lines() {
        let mut p = OpencodeParser::new();
        assert!(p.line("", false).is_empty());
        for l in [
            "npm warn something",
            r#"{"type":"reasoning","part":{"text":"hm"}}"#,
            r#"{"type":"tool_use","part":{"tool":"bash","state":{"status":"running"}}}"#,
            r#"{"type":"text","part":{"text":"   "}}"#,
            r#"{"type":"text","sessionID":7}"#,
        ] {
            assert_eq!(kinds(&p.line(l, false)), ["Raw"], "{l}");
        }
        assert_eq!(
            kinds(&p.line(
                r#"{"type":"text","sessionID":"s","part":{"text":"x"}}"#,
                true
            )),
            ["Raw"]
        );
        assert_eq!(p.session_id(), None);
        assert!(p.finish().is_empty());
    }

    #[test]
    fn long_outputs_are_capped() {
        let big = "ß".repeat(MAX_FIELD_BYTES);
        let l = serde_json::json!({"type": "tool_use", "sessionID": "s", "part": {"callID": "c", "tool": "bash", "state": {"status": "completed", "input": {"command": big}, "output": big}}}).to_string();
        let out = OpencodeParser::new().line(&l, false);
        assert_eq!(kinds(&out), ["SessionStarted", "ToolCall", "ToolResult"]);
        assert_capped(&out);
    }

    #[test]
    fn provider_samples_when_present() {
        let Some(text) = sample(&["opencode"]) else {
            return;
        };
        let mut p = OpencodeParser::new();
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
        "step_start",
        "text",
        "tool_use",
        "step_finish",
        "error",
        "reasoning",
    ];
    const WORDS: &[&str] = &[
        "type",
        "sessionID",
        "part",
        "text",
        "tool",
        "callID",
        "id",
        "state",
        "status",
        "completed",
        "error",
        "input",
        "output",
        "filePath",
        "write",
        "edit",
        "multiedit",
        "tokens",
        "cache",
        "read",
        "cost",
        "reason",
        "name",
        "data",
        "message",
    ];

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic_and_are_never_dropped(line in arb_line(), truncated in any::<bool>()) {
            let mut p = OpencodeParser::new();
            let out = p.line(&line, truncated);
            if truncated || !line.trim().is_empty() {
                prop_assert!(!out.is_empty());
            }
            if truncated {
                prop_assert_eq!(kinds(&out), ["Raw"]);
            }
            p.finish();
        }

        #[test]
        fn arbitrary_json_never_panics(v in arb_json(WORDS)) {
            let mut p = OpencodeParser::new();
            let out = p.line(&v.to_string(), false);
            prop_assert!(!out.is_empty());
            assert_capped(&out);
            assert_capped(&p.finish());
        }

        #[test]
        fn known_types_with_random_fields_never_panic(
            vs in prop::collection::vec(arb_typed(TYPES, WORDS), 1..8)
        ) {
            let mut p = OpencodeParser::new();
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
            let mut p = OpencodeParser::new();
            for v in &vs {
                let out = p.line(&v.to_string(), false);
                prop_assert!(!out.is_empty());
                assert_capped(&out);
            }
            assert_capped(&p.finish());
        }
    }
}
