//! Helpers shared by the three wire formats: tool-call arguments, JSON fields, API errors.

use super::{Fail, excerpt};
use serde_json::{Value, json};

/// Tool-call arguments that arrived as a JSON string.
pub(super) fn parse_args(s: &str) -> Value {
    if s.trim().is_empty() {
        return json!({});
    }
    serde_json::from_str(s).unwrap_or_else(|_| json!({ "_raw": s }))
}

/// Tool-call input in whatever shape it came (object, JSON string, nothing).
pub(super) fn input_value(v: Option<&Value>) -> Value {
    match v {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => parse_args(s),
        Some(other) => other.clone(),
    }
}

/// Tool-call input as the JSON string the OpenAI APIs carry (a `{"_raw": s}` input goes back as `s`).
pub(super) fn args_string(input: &Value) -> String {
    if let Some(obj) = input.as_object()
        && obj.len() == 1
        && let Some(Value::String(raw)) = obj.get("_raw")
    {
        return raw.clone();
    }
    input.to_string()
}

pub(super) fn str_of(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

pub(super) fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// Text of a content value: a string, or parts with `text`.
pub(super) fn text_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

pub(super) fn parse_event_json(data: &str) -> Result<Value, Fail> {
    serde_json::from_str(data)
        .map_err(|e| Fail::Fatal(format!("malformed stream event ({e}): {}", excerpt(data))))
}

/// An error the API reported inside a 200 answer or a stream: transient when the provider says
/// it is overloaded, rate limited or failed internally.
pub(super) fn api_error(err: &Value) -> Fail {
    let kind = format!("{} {}", str_of(err, "type"), str_of(err, "code"));
    let message = match err.get("message").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => err.to_string(),
    };
    let msg = format!("model API error {}: {message}", kind.trim());
    let transient = [
        "overloaded",
        "rate_limit",
        "server_error",
        "api_error",
        "timeout",
    ]
    .iter()
    .any(|k| kind.contains(k));
    if transient {
        Fail::Transient { conn: false, msg }
    } else {
        Fail::Fatal(msg)
    }
}

pub(super) fn cut_short(what: &str) -> Fail {
    Fail::Transient {
        conn: true,
        msg: format!("answer stream ended before {what}"),
    }
}
