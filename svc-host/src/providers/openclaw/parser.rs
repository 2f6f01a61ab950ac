//! OpenClaw: `openclaw agent --local --json` has no live stream; it prints one JSON envelope at
//! the end (`ok`, `status`, `final`, `payloads`, `usage`, `costUsd`, `assistantTurns`, `model`,
//! `provider`, `sessionId`, `error{message, kind}`), possibly pretty-printed over several lines
//! and possibly preceded or followed by log lines.
//!
//! `line()` only buffers (up to [`MAX_BUFFER_BYTES`]; beyond that the oldest lines leave as `Raw`).
//! `finish()` looks for the last complete top-level JSON object that looks like an envelope (it
//! starts at the beginning of a line, ends at the end of one, spans no truncated line, and has one
//! of `payloads`, `final`, `sessionId`, `ok`+`status` or `meta.agentMeta`) and returns, in line
//! order: `Raw` for each line before it, then `SessionStarted{sessionId, model}` (when either is
//! known), `AssistantMessage` for the final text (else one per visible payload text),
//! `ErrorEvent` for `error`, `Usage` (input counts `cacheRead` and `cacheWrite`; cost `costUsd`),
//! `Result{is_error: !ok, final, assistantTurns}`, then `Raw` for each line after it. Without an
//! envelope every line is `Raw`. The older shape `{payloads, meta: {agentMeta: {sessionId,
//! provider, model, usage}, aborted, error}}` is read too.

use crate::providers::{
    StreamParser, bool_of, cap, count_of, number_of, obj_of, raw, str_of, str_or_empty, turns,
};
use agentscope_schemas::v1::{
    AssistantMessage, ErrorEvent, Result as ResultEvent, SessionStarted, Usage,
    execution_event::Body,
};
use serde_json::{Map, Value};
use std::collections::VecDeque;

pub const PROVIDER: &str = agentscope_domain::Provider::Openclaw.as_str();

/// How much output is held for the envelope search.
pub const MAX_BUFFER_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, Default)]
pub struct OpenclawParser {
    lines: VecDeque<(String, bool)>,
    bytes: usize,
    session_id: Option<String>,
}

impl OpenclawParser {
    pub fn new() -> Self {
        Self::default()
    }
}

impl StreamParser for OpenclawParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        self.bytes = self.bytes.saturating_add(line.len() + 1);
        self.lines.push_back((line.to_owned(), truncated));
        let mut out = vec![];
        while self.bytes > MAX_BUFFER_BYTES {
            let Some((l, _)) = self.lines.pop_front() else {
                break;
            };
            self.bytes = self.bytes.saturating_sub(l.len() + 1);
            if !l.trim().is_empty() {
                out.push(raw(PROVIDER, &l));
            }
        }
        out
    }

    fn finish(&mut self) -> Vec<Body> {
        let lines: Vec<(String, bool)> = std::mem::take(&mut self.lines).into();
        self.bytes = 0;
        let envelope = find_envelope(&lines);
        let mut out = vec![];
        let raw_line = |out: &mut Vec<Body>, (l, truncated): &(String, bool)| {
            if *truncated || !l.trim().is_empty() {
                out.push(raw(PROVIDER, l));
            }
        };
        match envelope {
            None => lines.iter().for_each(|l| raw_line(&mut out, l)),
            Some((first, last, env)) => {
                lines[..first].iter().for_each(|l| raw_line(&mut out, l));
                self.map_envelope(&env, &mut out);
                lines[last + 1..].iter().for_each(|l| raw_line(&mut out, l));
            }
        }
        out
    }

    fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }
}

impl OpenclawParser {
    fn map_envelope(&mut self, env: &Map<String, Value>, out: &mut Vec<Body>) {
        let meta = obj_of(env, "meta");
        let agent_meta = meta.and_then(|m| obj_of(m, "agentMeta"));
        // A field of the envelope, else of the older `meta.agentMeta`.
        let field = |k: &str| env.get(k).or_else(|| agent_meta.and_then(|a| a.get(k)));
        let string = |k: &str| field(k).and_then(Value::as_str).unwrap_or("");

        let sid = string("sessionId");
        let model = string("model");
        if !sid.is_empty() {
            self.session_id = Some(sid.to_owned());
        }
        if !sid.is_empty() || !model.is_empty() {
            out.push(Body::SessionStarted(SessionStarted {
                provider_session_id: sid.to_owned(),
                model: model.to_owned(),
            }));
        }

        let payloads: Vec<&Map<String, Value>> = env
            .get("payloads")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .collect();
        let visible = |p: &Map<String, Value>| {
            !["isError", "isReasoning", "isCommentary"]
                .iter()
                .any(|k| bool_of(p, k) == Some(true))
        };
        let final_text = str_or_empty(env, "final");
        let text = if final_text.trim().is_empty() {
            let texts: Vec<&str> = payloads
                .iter()
                .filter(|p| visible(p))
                .filter_map(|p| str_of(p, "text"))
                .filter(|t| !t.trim().is_empty())
                .collect();
            for t in &texts {
                out.push(Body::AssistantMessage(AssistantMessage { text: cap(t) }));
            }
            cap(&texts.join("\n"))
        } else {
            let t = cap(final_text);
            out.push(Body::AssistantMessage(AssistantMessage { text: t.clone() }));
            t
        };

        let error = env
            .get("error")
            .filter(|e| !e.is_null())
            .or_else(|| meta.and_then(|m| m.get("error")).filter(|e| !e.is_null()));
        if let Some(e) = error {
            let (message, code) = match e {
                Value::Object(o) => (
                    str_or_empty(o, "message"),
                    str_of(o, "kind")
                        .or_else(|| str_of(o, "code"))
                        .unwrap_or(""),
                ),
                Value::String(s) => (s.as_str(), ""),
                _ => ("", ""),
            };
            out.push(Body::Error(ErrorEvent {
                message: cap(message),
                code: code.to_owned(),
            }));
        }

        let usage = field("usage").and_then(Value::as_object);
        let cost =
            number_of(env, "costUsd").or_else(|| agent_meta.and_then(|a| number_of(a, "costUsd")));
        if usage.is_some() || cost.is_some() {
            let u = |k: &str| usage.and_then(|u| count_of(u, k)).unwrap_or(0);
            out.push(Body::Usage(Usage {
                input_tokens: u("input")
                    .saturating_add(u("cacheRead"))
                    .saturating_add(u("cacheWrite")),
                output_tokens: u("output"),
                cost_usd: cost.unwrap_or(0.0),
            }));
        }

        let ok = bool_of(env, "ok").unwrap_or_else(|| match str_of(env, "status") {
            Some(s) => s == "ok",
            None => {
                error.is_none()
                    && meta.and_then(|m| bool_of(m, "aborted")) != Some(true)
                    && !payloads.iter().any(|p| bool_of(p, "isError") == Some(true))
            }
        });
        out.push(Body::Result(ResultEvent {
            is_error: !ok,
            text,
            turns: turns(
                field("assistantTurns")
                    .and_then(crate::providers::count)
                    .unwrap_or(0),
            ),
        }));
    }
}

fn looks_like_envelope(o: &Map<String, Value>) -> bool {
    o.contains_key("payloads")
        || o.contains_key("final")
        || o.contains_key("sessionId")
        || (o.contains_key("ok") && o.contains_key("status"))
        || obj_of(o, "meta").is_some_and(|m| m.contains_key("agentMeta"))
}

/// (first line, last line, object) of the last complete top-level JSON object of `lines` that
/// looks like an envelope.
fn find_envelope(lines: &[(String, bool)]) -> Option<(usize, usize, Map<String, Value>)> {
    // The text, and where each line starts in it.
    let mut text = String::new();
    let mut starts = Vec::with_capacity(lines.len());
    for (l, _) in lines {
        starts.push(text.len());
        text.push_str(l);
        text.push('\n');
    }
    let line_of = |offset: usize| starts.partition_point(|&s| s <= offset).saturating_sub(1);
    let mut found = None;
    let mut i = 0;
    while i < lines.len() {
        let (l, truncated) = &lines[i];
        let lead = l.len() - l.trim_start().len();
        if *truncated || !l[lead..].starts_with('{') {
            i += 1;
            continue;
        }
        let start = starts[i] + lead;
        let mut values = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        let parsed = match values.next() {
            Some(Ok(Value::Object(o))) => Some((o, start + values.byte_offset())),
            _ => None,
        };
        let Some((obj, end)) = parsed else {
            i += 1;
            continue;
        };
        // `end` is just past the closing brace; it must end its line and span no truncated line.
        let last = line_of(end.saturating_sub(1));
        let line_end = starts[last] + lines[last].0.len();
        let rest = text.get(end..line_end).unwrap_or("");
        let clean = rest.trim().is_empty() && !lines[i..=last].iter().any(|(_, t)| *t);
        if !clean {
            i += 1;
            continue;
        }
        if looks_like_envelope(&obj) {
            found = Some((i, last, obj));
        }
        i = last + 1;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::MAX_FIELD_BYTES;
    use crate::providers::testutil::{
        arb_json, arb_line, assert_capped, kinds, mutated, run, sample,
    };
    use proptest::prelude::*;

    const ENVELOPE: &str = r#"{
  "ok": true,
  "status": "ok",
  "final": "Created hello.txt.",
  "payloads": [
    {
      "text": "Created hello.txt."
    }
  ],
  "usage": {
    "input": 1200,
    "output": 45,
    "cacheRead": 300,
    "cacheWrite": 0,
    "total": 1545
  },
  "costUsd": 0.0042,
  "assistantTurns": 3,
  "toolSummary": {
    "calls": 2,
    "tools": ["exec", "write"]
  },
  "model": "fake-model",
  "provider": "local",
  "sessionId": "task-0193"
}"#;

    #[test]
    fn a_pretty_printed_envelope_after_log_lines() {
        let mut p = OpenclawParser::new();
        let text = format!(
            "[plugins] loaded 3 plugins\n{{not json}}\n{{\"level\":\"info\",\"msg\":\"a log object\"}}\n{ENVELOPE}\n\n"
        );
        let mut out = vec![];
        for l in text.lines() {
            assert!(p.line(l, false).is_empty(), "buffered");
        }
        out.extend(p.finish());
        assert_eq!(
            kinds(&out),
            [
                "Raw",
                "Raw",
                "Raw",
                "SessionStarted",
                "AssistantMessage",
                "Usage",
                "Result"
            ]
        );
        assert_eq!(p.session_id(), Some("task-0193"));
        let Body::SessionStarted(s) = &out[3] else {
            unreachable!()
        };
        assert_eq!(
            (s.provider_session_id.as_str(), s.model.as_str()),
            ("task-0193", "fake-model")
        );
        let Body::AssistantMessage(m) = &out[4] else {
            unreachable!()
        };
        assert_eq!(m.text, "Created hello.txt.");
        let Body::Usage(u) = &out[5] else {
            unreachable!()
        };
        assert_eq!((u.input_tokens, u.output_tokens), (1500, 45));
        assert!((u.cost_usd - 0.0042).abs() < 1e-12);
        let Body::Result(r) = &out[6] else {
            unreachable!()
        };
        assert_eq!(
            (r.is_error, r.text.as_str(), r.turns),
            (false, "Created hello.txt.", 3)
        );
        // Finishing again has nothing more to say.
        assert!(p.finish().is_empty());
    }

    #[test]
    fn a_compact_failed_envelope_followed_by_a_log_line() {
        let mut p = OpenclawParser::new();
        let out = run(
            &mut p,
            r#"{"ok":false,"status":"error","final":"","payloads":[{"text":"LLM request failed: connection refused","isError":true}],"model":null,"provider":null,"sessionId":"s-1","error":{"message":"LLM request failed: connection refused","kind":"error_payload"}}
[gateway] bye
"#,
        );
        assert_eq!(
            kinds(&out),
            ["SessionStarted", "ErrorEvent", "Result", "Raw"]
        );
        let Body::Error(e) = &out[1] else {
            unreachable!()
        };
        assert_eq!(e.code, "error_payload");
        let Body::Result(r) = &out[2] else {
            unreachable!()
        };
        assert!(r.is_error);
        assert_eq!(r.text, "");
    }

    #[test]
    fn the_older_meta_shape() {
        let mut p = OpenclawParser::new();
        let out = run(
            &mut p,
            r#"{
  "payloads": [{"text": "first"}, {"text": "thinking", "isReasoning": true}, {"text": "second"}],
  "meta": {"durationMs": 10, "agentMeta": {"sessionId": "old", "provider": "p", "model": "m", "usage": {"input": 3, "output": 4}}}
}
"#,
        );
        assert_eq!(
            kinds(&out),
            [
                "SessionStarted",
                "AssistantMessage",
                "AssistantMessage",
                "Usage",
                "Result"
            ]
        );
        let Body::Result(r) = &out[4] else {
            unreachable!()
        };
        assert_eq!((r.is_error, r.text.as_str()), (false, "first\nsecond"));
        assert_eq!(p.session_id(), Some("old"));
    }

    #[test]
    fn no_envelope_means_every_line_is_raw() {
        let mut p = OpenclawParser::new();
        // Unclosed, truncated inside, inner objects only, and non-envelope objects.
        let text = "log\n{\n  \"ok\": true,\n  \"payloads\": [\n    {\"text\": \"x\"}\n";
        let out = run(&mut p, text);
        assert_eq!(kinds(&out), ["Raw"; 5]);
        let mut p = OpenclawParser::new();
        p.line("{\"ok\": true,", false);
        p.line("\"status\": \"ok\", \"final\": \"cut", true);
        p.line("\"}", false);
        assert_eq!(kinds(&p.finish()), ["Raw"; 3]);
        let mut p = OpenclawParser::new();
        assert_eq!(kinds(&run(&mut p, "{\"a\":1}\n[1]\n")), ["Raw", "Raw"]);
        assert_eq!(p.session_id(), None);
    }

    #[test]
    fn the_last_envelope_wins() {
        let mut p = OpenclawParser::new();
        let out = run(
            &mut p,
            "{\"ok\":true,\"status\":\"ok\",\"final\":\"one\",\"sessionId\":\"a\"}\n{\"ok\":true,\"status\":\"ok\",\"final\":\"two\",\"sessionId\":\"b\"}\n",
        );
        assert_eq!(
            kinds(&out),
            ["Raw", "SessionStarted", "AssistantMessage", "Result"]
        );
        assert_eq!(p.session_id(), Some("b"));
    }

    #[test]
    fn the_buffer_is_bounded() {
        let mut p = OpenclawParser::new();
        let line = "x".repeat(1024 * 1024);
        let mut early = vec![];
        for _ in 0..12 {
            early.extend(p.line(&line, false));
        }
        assert!(!early.is_empty() && early.len() <= 12);
        let later = p.finish();
        assert_eq!(early.len() + later.len(), 12);
    }

    #[test]
    fn long_final_text_is_capped() {
        let big = "ж".repeat(MAX_FIELD_BYTES);
        let env = serde_json::json!({"ok": true, "status": "ok", "final": big, "payloads": [], "sessionId": "s"});
        let mut p = OpenclawParser::new();
        let out = run(&mut p, &serde_json::to_string_pretty(&env).unwrap());
        assert_eq!(
            kinds(&out),
            ["SessionStarted", "AssistantMessage", "Result"]
        );
        assert_capped(&out);
    }

    #[test]
    fn provider_samples_when_present() {
        let Some(text) = sample(&["openclaw"]) else {
            return;
        };
        let mut p = OpenclawParser::new();
        let out = run(&mut p, &text);
        let ks = kinds(&out);
        let mapped: Vec<&str> = ks.iter().copied().filter(|k| *k != "Raw").collect();
        assert_eq!(mapped.first(), Some(&"SessionStarted"), "{ks:?}");
        assert_eq!(mapped.last(), Some(&"Result"), "{ks:?}");
        assert!(p.session_id().is_some());
        assert_capped(&out);
    }

    const WORDS: &[&str] = &[
        "ok",
        "status",
        "final",
        "payloads",
        "text",
        "isError",
        "isReasoning",
        "usage",
        "input",
        "output",
        "cacheRead",
        "cacheWrite",
        "costUsd",
        "assistantTurns",
        "model",
        "provider",
        "sessionId",
        "error",
        "message",
        "kind",
        "meta",
        "agentMeta",
        "aborted",
    ];

    /// An envelope-ish object: some envelope keys with random values.
    fn arb_envelope() -> impl Strategy<Value = Value> {
        prop::collection::vec((prop::sample::select(WORDS), arb_json(WORDS)), 0..10).prop_map(
            |fields| {
                let mut m: Map<String, Value> = fields
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                m.insert("ok".into(), Value::Bool(true));
                m.insert("status".into(), Value::String("ok".into()));
                Value::Object(m)
            },
        )
    }

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic_and_are_never_dropped(
            lines in prop::collection::vec((arb_line(), any::<bool>()), 0..8)
        ) {
            let mut p = OpenclawParser::new();
            let mut out = vec![];
            for (l, t) in &lines {
                out.extend(p.line(l, *t));
            }
            out.extend(p.finish());
            let kept = lines.iter().filter(|(l, t)| *t || !l.trim().is_empty()).count();
            let raws = out.iter().filter(|e| matches!(e, Body::Raw(_))).count();
            let results = out.iter().filter(|e| matches!(e, Body::Result(_))).count();
            prop_assert!(results <= 1);
            if results == 0 {
                prop_assert_eq!(raws, kept);
            } else {
                prop_assert!(raws < kept);
            }
            assert_capped(&out);
        }

        #[test]
        fn arbitrary_envelopes_never_panic(
            v in arb_envelope(), pretty in any::<bool>(), before in arb_line(), after in "[a-z ]{0,10}"
        ) {
            let body = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            let mut p = OpenclawParser::new();
            let out = run(&mut p, &format!("{before}\n{body}\n{after}\n"));
            let results = out.iter().filter(|e| matches!(e, Body::Result(_))).count();
            prop_assert_eq!(results, 1, "{:?}", kinds(&out));
            assert_capped(&out);
        }

        #[test]
        fn arbitrary_json_never_panics(v in arb_json(WORDS), pretty in any::<bool>()) {
            let body = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            let mut p = OpenclawParser::new();
            let out = run(&mut p, &body);
            prop_assert!(!out.is_empty() || body.trim().is_empty());
            assert_capped(&out);
        }

        #[test]
        fn envelopes_with_wrong_or_missing_fields_never_panic(
            v in mutated(vec![serde_json::from_str(ENVELOPE).unwrap()], WORDS),
            pretty in any::<bool>(),
        ) {
            let body = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            let mut p = OpenclawParser::new();
            let out = run(&mut p, &body);
            prop_assert!(!out.is_empty());
            prop_assert!(out.iter().filter(|e| matches!(e, Body::Result(_))).count() <= 1);
            assert_capped(&out);
        }
    }
}
