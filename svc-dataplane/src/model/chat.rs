//! OpenAI Chat Completions: messages, answers and stream chunks to a [`Turn`].

use super::sse::{SseEvent, StreamAcc};
use super::wire::*;
use super::{Fail, Message, ModelConfig, ToolCallReq, ToolSpec, Turn, excerpt};
use serde_json::{Value, json};
use std::collections::BTreeMap;

pub(super) fn chat_message(m: &Message) -> Value {
    match m {
        Message::User { text } => json!({"role": "user", "content": text}),
        Message::Assistant { text, tool_calls } => {
            let mut msg = json!({"role": "assistant"});
            msg["content"] = if text.is_empty() && !tool_calls.is_empty() {
                Value::Null
            } else {
                json!(text)
            };
            if !tool_calls.is_empty() {
                msg["tool_calls"] = tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": args_string(&c.input)},
                        })
                    })
                    .collect();
            }
            msg
        }
        Message::ToolResult {
            call_id, output, ..
        } => json!({"role": "tool", "tool_call_id": call_id, "content": output}),
    }
}

/// The request without its messages (the system message is the first of them).
pub(super) fn chat_head(cfg: &ModelConfig, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_completion_tokens": cfg.max_tokens,
        "stream": cfg.stream,
    });
    if cfg.stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.schema,
                }})
            })
            .collect();
    }
    body
}

pub(super) fn chat_usage(u: &Value, turn: &mut Turn) {
    if let Some(n) = u64_of(u, "prompt_tokens") {
        turn.input_tokens = n;
    }
    if let Some(n) = u64_of(u, "completion_tokens") {
        turn.output_tokens = n;
    }
}

pub(super) fn chat_turn(v: &Value) -> Result<Turn, Fail> {
    let Some(choice) = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(api_error(err));
        }
        return Err(Fail::Fatal(format!(
            "answer has no choices: {}",
            excerpt(&v.to_string())
        )));
    };
    let msg = choice.get("message").unwrap_or(&Value::Null);
    let mut turn = Turn {
        text: text_of(msg.get("content")),
        stop_reason: str_of(choice, "finish_reason"),
        ..Turn::default()
    };
    for (i, call) in msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let f = call.get("function").unwrap_or(&Value::Null);
        let id = match call.get("id").and_then(Value::as_str) {
            Some(id) if !id.is_empty() => id.to_string(),
            _ => format!("call_{i}"),
        };
        turn.tool_calls.push(ToolCallReq {
            id,
            name: str_of(f, "name"),
            input: input_value(f.get("arguments")),
        });
    }
    if let Some(u) = v.get("usage") {
        chat_usage(u, &mut turn);
    }
    Ok(turn)
}

#[derive(Debug, Default)]
pub(super) struct ChatCall {
    id: String,
    name: String,
    args: String,
}

#[derive(Debug, Default)]
pub(super) struct ChatAcc {
    turn: Turn,
    calls: BTreeMap<u64, ChatCall>,
    finished: bool,
}

impl ChatAcc {
    fn build(&mut self) -> Turn {
        let mut turn = std::mem::take(&mut self.turn);
        for (i, c) in std::mem::take(&mut self.calls) {
            turn.tool_calls.push(ToolCallReq {
                id: if c.id.is_empty() {
                    format!("call_{i}")
                } else {
                    c.id
                },
                name: c.name,
                input: parse_args(&c.args),
            });
        }
        turn
    }
}

impl StreamAcc for ChatAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        if ev.data.trim() == "[DONE]" {
            return Ok(Some(self.build()));
        }
        let v = parse_event_json(&ev.data)?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(api_error(err));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            chat_usage(u, &mut self.turn);
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return Ok(None);
        };
        let delta = choice.get("delta").unwrap_or(&Value::Null);
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            self.turn.text.push_str(text);
        }
        for (pos, tc) in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = u64_of(tc, "index").unwrap_or(pos as u64);
            let call = self.calls.entry(index).or_default();
            if let Some(id) = tc.get("id").and_then(Value::as_str)
                && !id.is_empty()
            {
                call.id = id.to_string();
            }
            let f = tc.get("function").unwrap_or(&Value::Null);
            if let Some(name) = f.get("name").and_then(Value::as_str)
                && name != call.name
            {
                call.name.push_str(name);
            }
            match f.get("arguments") {
                Some(Value::String(a)) => call.args.push_str(a),
                Some(obj @ Value::Object(_)) => call.args = obj.to_string(),
                _ => {}
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.turn.stop_reason = reason.to_string();
            self.finished = true;
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        // Some compatible servers omit `[DONE]`; a finish_reason is enough.
        if self.finished {
            Ok(self.build())
        } else {
            Err(cut_short("[DONE]"))
        }
    }
}
