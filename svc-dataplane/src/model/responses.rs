//! OpenAI Responses: input items, answers and stream events to a [`Turn`].

use super::sse::{SseEvent, StreamAcc};
use super::wire::*;
use super::{Fail, Message, ModelConfig, ToolCallReq, ToolSpec, Turn, excerpt};
use serde_json::{Value, json};
use std::collections::BTreeMap;

pub(super) fn responses_items(m: &Message) -> Vec<Value> {
    match m {
        Message::User { text } => vec![json!({"role": "user", "content": text})],
        Message::Assistant { text, tool_calls } => {
            let mut items = Vec::new();
            if !text.is_empty() {
                items.push(json!({"role": "assistant", "content": text}));
            }
            for c in tool_calls {
                items.push(json!({
                    "type": "function_call",
                    "call_id": c.id,
                    "name": c.name,
                    "arguments": args_string(&c.input),
                }));
            }
            items
        }
        Message::ToolResult {
            call_id, output, ..
        } => vec![json!({
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
        })],
    }
}

/// The request without its input items.
pub(super) fn responses_head(cfg: &ModelConfig, system: &str, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_output_tokens": cfg.max_tokens,
        "stream": cfg.stream,
        "store": false,
    });
    if !system.is_empty() {
        body["instructions"] = json!(system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "name": t.name, "description": t.description,
                    "parameters": t.schema, "strict": false})
            })
            .collect();
    }
    body
}

#[derive(Debug)]
pub(super) enum ResponsesItem {
    Message(String),
    Call {
        call_id: String,
        name: String,
        args: String,
    },
    Other,
}

pub(super) fn responses_item(item: &Value) -> ResponsesItem {
    match item.get("type").and_then(Value::as_str) {
        Some("message") => ResponsesItem::Message(
            item.get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("output_text") | Some("text") => p.get("text").and_then(Value::as_str),
                    Some("refusal") => p.get("refusal").and_then(Value::as_str),
                    _ => None,
                })
                .collect(),
        ),
        Some("function_call") => ResponsesItem::Call {
            call_id: match item.get("call_id").and_then(Value::as_str) {
                Some(id) if !id.is_empty() => id.to_string(),
                _ => str_of(item, "id"),
            },
            name: str_of(item, "name"),
            args: match item.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            },
        },
        _ => ResponsesItem::Other,
    }
}

pub(super) fn responses_build<'a>(
    items: impl IntoIterator<Item = &'a ResponsesItem>,
    turn: &mut Turn,
) {
    for item in items {
        match item {
            ResponsesItem::Message(t) => turn.text.push_str(t),
            ResponsesItem::Call {
                call_id,
                name,
                args,
            } => turn.tool_calls.push(ToolCallReq {
                id: call_id.clone(),
                name: name.clone(),
                input: parse_args(args),
            }),
            ResponsesItem::Other => {}
        }
    }
}

/// Stop reason and usage of a finished response object.
pub(super) fn responses_finish(resp: &Value, turn: &mut Turn) {
    let status = str_of(resp, "status");
    turn.stop_reason = match resp
        .get("incomplete_details")
        .and_then(|d| d.get("reason"))
        .and_then(Value::as_str)
    {
        Some(reason) if status == "incomplete" => reason.to_string(),
        _ => status,
    };
    if let Some(u) = resp.get("usage").filter(|u| u.is_object()) {
        turn.input_tokens = u64_of(u, "input_tokens").unwrap_or(0);
        turn.output_tokens = u64_of(u, "output_tokens").unwrap_or(0);
    }
}

pub(super) fn responses_turn(v: &Value) -> Result<Turn, Fail> {
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(api_error(err));
    }
    let Some(output) = v.get("output").and_then(Value::as_array) else {
        return Err(Fail::Fatal(format!(
            "answer has no output: {}",
            excerpt(&v.to_string())
        )));
    };
    let items: Vec<ResponsesItem> = output.iter().map(responses_item).collect();
    let mut turn = Turn::default();
    responses_build(&items, &mut turn);
    responses_finish(v, &mut turn);
    Ok(turn)
}

#[derive(Debug, Default)]
pub(super) struct ResponsesAcc {
    items: BTreeMap<u64, ResponsesItem>,
}

impl StreamAcc for ResponsesAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        let v = parse_event_json(&ev.data)?;
        let ty = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(ev.event.as_str());
        let index = u64_of(&v, "output_index").unwrap_or(0);
        let delta = v.get("delta").and_then(Value::as_str).unwrap_or("");
        match ty {
            "response.output_item.added" => {
                let item = responses_item(v.get("item").unwrap_or(&Value::Null));
                self.items.insert(index, item);
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                match self
                    .items
                    .entry(index)
                    .or_insert_with(|| ResponsesItem::Message(String::new()))
                {
                    ResponsesItem::Message(t) => t.push_str(delta),
                    other => *other = ResponsesItem::Message(delta.to_string()),
                }
            }
            "response.function_call_arguments.delta" => {
                if let Some(ResponsesItem::Call { args, .. }) = self.items.get_mut(&index) {
                    args.push_str(delta);
                }
            }
            "response.output_item.done" => {
                let item = responses_item(v.get("item").unwrap_or(&Value::Null));
                // The final item is authoritative, unless it lost the streamed text.
                let keep_streamed = matches!(&item, ResponsesItem::Message(t) if t.is_empty());
                if !keep_streamed || !self.items.contains_key(&index) {
                    self.items.insert(index, item);
                }
            }
            "response.completed" | "response.incomplete" => {
                let resp = v.get("response").unwrap_or(&Value::Null);
                let mut turn = Turn::default();
                if self.items.is_empty() {
                    let items: Vec<ResponsesItem> = resp
                        .get("output")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .map(responses_item)
                        .collect();
                    responses_build(&items, &mut turn);
                } else {
                    responses_build(self.items.values(), &mut turn);
                }
                responses_finish(resp, &mut turn);
                return Ok(Some(turn));
            }
            "response.failed" => {
                let resp = v.get("response").unwrap_or(&Value::Null);
                return Err(api_error(
                    resp.get("error")
                        .filter(|e| !e.is_null())
                        .unwrap_or(&json!({"type": "server_error", "message": "response failed"})),
                ));
            }
            "error" => return Err(api_error(v.get("error").unwrap_or(&v))),
            _ => {}
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        Err(cut_short("response.completed"))
    }
}
