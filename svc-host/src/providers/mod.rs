//! The providers, one module each: the adapter ([`adapter`], the host's registry) and the stream
//! parser(s) of each agent CLI. The parsers are pure, stateful translators from one provider's
//! stdout lines to normalized [`Body`] events: no I/O happens in them; the attempt runner feeds
//! lines and publishes what comes back.
//!
//! Rules shared by every parser:
//! - a line that is not valid JSON, or whose event type is unknown, or that maps to no normalized
//!   event, is kept as [`Raw`] (never dropped); a truncated line is always `Raw` and never parsed;
//! - blank lines produce nothing;
//! - long `text`/`output` fields are capped at [`MAX_FIELD_BYTES`] on a char boundary, and long
//!   strings inside `input_json` are capped the same way (the JSON stays valid);
//! - `Usage` events are increments: the total for an attempt is the sum of its `Usage` events;
//! - nothing here panics, whatever the input.

pub mod acp;
pub mod claude_code;
pub mod codex;
pub mod command;
pub mod openclaw;
pub mod opencode;

use crate::provider::Adapter;
use agentscope_domain::Provider;
use agentscope_schemas::v1::{Raw, execution_event::Body};
use serde_json::{Map, Value};

/// A provider's stdout, one line at a time, turned into normalized events.
pub trait StreamParser: Send {
    /// One line of provider stdout (already bounded in length and lossily UTF-8 decoded; may be
    /// truncated). Returns the normalized events in order. Never panics on any input.
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body>;
    /// End of output: anything buffered (OpenClaw emits one JSON envelope at the end, possibly
    /// pretty-printed over several lines).
    fn finish(&mut self) -> Vec<Body>;
    /// The provider session id once seen (for resume).
    fn session_id(&self) -> Option<&str>;
    /// Lines to write to the provider's stdin now, for providers driven over a JSON-RPC
    /// protocol (the next request of a handshake once the previous one was answered).
    fn replies(&mut self) -> Vec<String> {
        vec![]
    }
    /// The host denied one of the provider's tool requests with `reason`. A protocol whose deny
    /// carries no reason (ACP) tells the model in a follow-up prompt.
    fn denied(&mut self, _tool: &str, _reason: &str) {}
}

/// What the model is told when the platform denies one of its tool requests and the provider's
/// own deny cannot carry the reason (ACP's reject, Codex app-server's decline).
pub fn denied_message(tool: &str, reason: &str) -> String {
    let reason = reason.trim();
    if reason.is_empty() {
        format!("The platform denied your `{tool}` request (no reason was given).")
    } else {
        format!("The platform denied your `{tool}` request. The reason given: {reason}")
    }
}

/// The parser for a provider name as used in `Spec.provider`; None for providers without one
/// (such as `command`).
pub fn parser_for(provider: &str) -> Option<Box<dyn StreamParser>> {
    match Provider::parse(provider)? {
        Provider::ClaudeCode => Some(Box::new(claude_code::parser::ClaudeParser::new())),
        Provider::Codex => Some(Box::new(codex::parser::CodexParser::new())),
        Provider::Opencode => Some(Box::new(opencode::parser::OpencodeParser::new())),
        Provider::Openclaw => Some(Box::new(openclaw::parser::OpenclawParser::new())),
        Provider::Command => None,
    }
}

/// The adapter of each provider: the host's registry.
pub fn adapter(provider: Provider) -> Box<dyn Adapter> {
    match provider {
        Provider::Command => Box::new(command::CommandProvider),
        Provider::ClaudeCode => Box::new(claude_code::ClaudeCode),
        Provider::Codex => Box::new(codex::Codex),
        Provider::Opencode => Box::new(opencode::Opencode),
        Provider::Openclaw => Box::new(openclaw::Openclaw),
    }
}

/// Upper bound, in bytes, of any text/output field of an emitted event.
pub const MAX_FIELD_BYTES: usize = 64 * 1024;

/// `s` cut to at most [`MAX_FIELD_BYTES`] bytes, on a char boundary.
pub(crate) fn cap(s: &str) -> String {
    cap_str(s, MAX_FIELD_BYTES).to_owned()
}

fn cap_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A JSON value as compact text, with every string inside cut to [`MAX_FIELD_BYTES`]. `null`
/// (a missing input) becomes `{}`.
pub(crate) fn json_text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "{}".into(),
        Some(v) => {
            let capped = cap_value(v, 0);
            serde_json::to_string(&capped).unwrap_or_else(|_| "{}".into())
        }
    }
}

fn cap_value(v: &Value, depth: usize) -> Value {
    // Values come from serde_json, whose parser refuses nesting deeper than 128; the depth guard
    // only protects against values built some other way.
    if depth > 256 {
        return Value::Null;
    }
    match v {
        Value::String(s) if s.len() > MAX_FIELD_BYTES => Value::String(cap(s)),
        Value::Array(a) => Value::Array(a.iter().map(|x| cap_value(x, depth + 1)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), cap_value(x, depth + 1)))
                .collect(),
        ),
        other => other.clone(),
    }
}

pub(crate) fn raw(provider: &str, line: &str) -> Body {
    Body::Raw(Raw {
        provider: provider.into(),
        line: line.into(),
    })
}

/// The common line discipline of the line-oriented parsers: blank → nothing, truncated or not a
/// JSON object → `Raw`, otherwise `map`; when `map` finds nothing to say, the line is kept as
/// `Raw`.
pub(crate) fn json_line(
    provider: &str,
    line: &str,
    truncated: bool,
    map: impl FnOnce(&Map<String, Value>) -> Vec<Body>,
) -> Vec<Body> {
    if !truncated && line.trim().is_empty() {
        return vec![];
    }
    if truncated {
        return vec![raw(provider, line)];
    }
    let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(line) else {
        return vec![raw(provider, line)];
    };
    let mut out = map(&obj);
    if out.is_empty() {
        out.push(raw(provider, line));
    }
    out
}

// ---------------------------------------------------------------- lenient field access

/// `v[key]` as a string, if it is one.
pub(crate) fn str_of<'a>(v: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// `v[key]` as a string, or "" when missing or of another type.
pub(crate) fn str_or_empty<'a>(v: &'a Map<String, Value>, key: &str) -> &'a str {
    str_of(v, key).unwrap_or("")
}

pub(crate) fn obj_of<'a>(v: &'a Map<String, Value>, key: &str) -> Option<&'a Map<String, Value>> {
    v.get(key).and_then(Value::as_object)
}

pub(crate) fn bool_of(v: &Map<String, Value>, key: &str) -> Option<bool> {
    v.get(key).and_then(Value::as_bool)
}

/// A non-negative count: integers as they are, finite non-negative floats truncated (saturating),
/// numeric strings parsed; anything else is None.
pub(crate) fn count(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Some(u)
            } else if n.as_i64().is_some() {
                Some(0)
            } else {
                n.as_f64()
                    .filter(|f| f.is_finite())
                    .map(|f| if f <= 0.0 { 0 } else { f as u64 })
            }
        }
        Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    }
}

pub(crate) fn count_of(v: &Map<String, Value>, key: &str) -> Option<u64> {
    v.get(key).and_then(count)
}

/// A finite number (cost); anything else is None.
pub(crate) fn number_of(v: &Map<String, Value>, key: &str) -> Option<f64> {
    match v.get(key)? {
        Value::Number(n) => n.as_f64().filter(|f| f.is_finite()),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|f| f.is_finite()),
        _ => None,
    }
}

pub(crate) fn turns(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;
    use proptest::prelude::*;

    /// A short name for an event's kind, for sequence assertions.
    pub fn kind(b: &Body) -> &'static str {
        match b {
            Body::Lifecycle(_) => "Lifecycle",
            Body::Output(_) => "Output",
            Body::Diagnostic(_) => "Diagnostic",
            Body::SessionStarted(_) => "SessionStarted",
            Body::AssistantMessage(_) => "AssistantMessage",
            Body::ToolCall(_) => "ToolCall",
            Body::ToolResult(_) => "ToolResult",
            Body::FileChange(_) => "FileChange",
            Body::Usage(_) => "Usage",
            Body::Error(_) => "ErrorEvent",
            Body::Result(_) => "Result",
            Body::Raw(_) => "Raw",
            Body::ApprovalRequested(_) => "ApprovalRequested",
            Body::ApprovalDecided(_) => "ApprovalDecided",
        }
    }

    pub fn kinds(events: &[Body]) -> Vec<&'static str> {
        events.iter().map(kind).collect()
    }

    /// Feeds whole `text` (one line per line) and finishes.
    pub fn run(p: &mut dyn StreamParser, text: &str) -> Vec<Body> {
        let mut out = vec![];
        for l in text.lines() {
            out.extend(p.line(l, false));
        }
        out.extend(p.finish());
        out
    }

    /// The text of `docs/provider-samples/<name>.jsonl` for the first name that exists (real
    /// output of the CLIs, recorded by scripts elsewhere in the repository).
    pub fn sample(names: &[&str]) -> Option<String> {
        names.iter().find_map(|n| {
            let path = format!(
                "{}/../docs/provider-samples/{n}.jsonl",
                env!("CARGO_MANIFEST_DIR")
            );
            std::fs::read_to_string(path).ok()
        })
    }

    /// Every capped field of `events` is within bounds.
    pub fn assert_capped(events: &[Body]) {
        for e in events {
            let n = match e {
                Body::AssistantMessage(m) => m.text.len(),
                Body::ToolResult(r) => r.output.len(),
                Body::Result(r) => r.text.len(),
                Body::Error(e) => e.message.len(),
                _ => 0,
            };
            assert!(n <= MAX_FIELD_BYTES, "field of {} bytes", n);
            if let Body::ToolCall(c) = e {
                assert!(
                    serde_json::from_str::<Value>(&c.input_json).is_ok(),
                    "input_json stays JSON: {}",
                    c.input_json
                );
            }
        }
    }

    /// Arbitrary JSON whose object keys and string values are often drawn from `words` (so that
    /// known fields show up, with random types), nested a few levels.
    pub fn arb_json(words: &'static [&'static str]) -> impl Strategy<Value = Value> {
        let word = prop::sample::select(words).prop_map(|w| w.to_string());
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            ".{0,20}".prop_map(Value::String),
            word.clone().prop_map(Value::String),
        ];
        let key = prop_oneof![3 => word, 1 => "[a-z_]{0,8}"];
        leaf.prop_recursive(5, 64, 8, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..8)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    /// An object with `"type"` set to one of `types` and otherwise random fields.
    pub fn arb_typed(
        types: &'static [&'static str],
        words: &'static [&'static str],
    ) -> impl Strategy<Value = Value> {
        (
            prop::sample::select(types),
            prop::collection::vec((prop::sample::select(words), arb_json(words)), 0..8),
        )
            .prop_map(|(t, fields)| {
                let mut m: Map<String, Value> = fields
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                m.insert("type".into(), Value::String(t.into()));
                Value::Object(m)
            })
    }

    /// One of `samples` (realistic lines) with one to three nodes replaced by arbitrary JSON
    /// (often of the wrong type) or removed: known fields with wrong types or missing.
    pub fn mutated(
        samples: Vec<Value>,
        words: &'static [&'static str],
    ) -> impl Strategy<Value = Value> {
        (
            prop::sample::select(samples),
            prop::collection::vec((any::<usize>(), arb_json(words), any::<bool>()), 1..4),
        )
            .prop_map(|(mut v, edits)| {
                for (at, replacement, remove) in edits {
                    let mut paths = vec![];
                    pointers(&v, String::new(), &mut paths);
                    let path = &paths[at % paths.len()];
                    match path.rsplit_once('/') {
                        Some((parent, key)) if remove => {
                            let key = key.replace("~1", "/").replace("~0", "~");
                            match v.pointer_mut(parent) {
                                Some(Value::Object(o)) => {
                                    o.remove(&key);
                                }
                                Some(Value::Array(a)) => {
                                    if let Ok(i) = key.parse::<usize>()
                                        && i < a.len()
                                    {
                                        a.remove(i);
                                    }
                                }
                                _ => {}
                            }
                        }
                        _ => {
                            if let Some(node) = v.pointer_mut(path) {
                                *node = replacement;
                            }
                        }
                    }
                }
                v
            })
    }

    fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    let k = k.replace('~', "~0").replace('/', "~1");
                    pointers(x, format!("{at}/{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    pointers(x, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
        out.push(at);
    }

    /// The JSON values of the lines of a sample.
    pub fn sample_values(text: &str) -> Vec<Value> {
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Lines of text that a provider might print, valid or not.
    pub fn arb_line() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            prop::collection::vec(any::<u8>(), 0..200)
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            "[\\[{]{0,300}",
            "[0-9]{1,400}(\\.[0-9]{0,50})?(e[0-9]{1,5})?",
            "\\{\"type\":\"[a-z._]{0,20}\"[,:\"a-z0-9\\[\\]{}]{0,40}",
        ]
    }

    #[test]
    fn cap_cuts_on_char_boundaries() {
        let s = "é".repeat(MAX_FIELD_BYTES); // two bytes each
        let c = cap(&s);
        assert!(c.len() <= MAX_FIELD_BYTES && c.len() >= MAX_FIELD_BYTES - 1);
        assert_eq!(cap("short"), "short");
        let big = Value::String("x".repeat(MAX_FIELD_BYTES + 10));
        let j = json_text(Some(&serde_json::json!({ "a": [big] })));
        assert!(j.len() < MAX_FIELD_BYTES + 20);
        assert!(serde_json::from_str::<Value>(&j).is_ok());
        assert_eq!(json_text(None), "{}");
    }

    #[test]
    fn counts_are_lenient_and_never_negative() {
        assert_eq!(count(&serde_json::json!(5)), Some(5));
        assert_eq!(count(&serde_json::json!(-5)), Some(0));
        assert_eq!(count(&serde_json::json!(1e300)), Some(u64::MAX));
        assert_eq!(count(&serde_json::json!(2.7)), Some(2));
        assert_eq!(count(&serde_json::json!("12")), Some(12));
        assert_eq!(count(&serde_json::json!([1])), None);
        assert_eq!(turns(u64::MAX), u32::MAX);
    }

    #[test]
    fn parser_for_knows_the_four_agent_clis() {
        for p in ["claude-code", "codex", "opencode", "openclaw"] {
            assert!(parser_for(p).is_some(), "{p}");
        }
        assert!(parser_for("command").is_none());
        assert!(parser_for("").is_none());
    }

    #[test]
    fn deep_nesting_is_raw_not_a_stack_overflow() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let deep_obj = format!(
            "{{\"type\":\"assistant\",\"message\":{}1{}}}",
            "{\"a\":".repeat(50_000),
            "}".repeat(50_000)
        );
        for name in ["claude-code", "codex", "opencode", "openclaw"] {
            let Some(mut p) = parser_for(name) else {
                panic!("{name}")
            };
            let mut out = p.line(&deep, false);
            out.extend(p.line(&deep_obj, false));
            out.extend(p.finish());
            assert_eq!(kinds(&out), ["Raw", "Raw"], "{name}");
        }
    }
}
