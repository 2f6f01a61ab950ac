//! Anthropic Messages: the conversation as content blocks, answers and stream events to a [`Turn`].

use super::sse::{SseEvent, StreamAcc};
use super::wire::*;
use super::{Fail, Message, ModelConfig, ToolCallReq, ToolSpec, Turn, excerpt};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// One message's role and content blocks (none: the message is left out).
pub(super) fn anthropic_blocks(m: &Message) -> (&'static str, Vec<Value>) {
    match m {
        Message::User { text } => {
            let blocks = if text.is_empty() {
                vec![]
            } else {
                vec![json!({"type": "text", "text": text})]
            };
            ("user", blocks)
        }
        Message::Assistant { text, tool_calls } => {
            let mut blocks = Vec::new();
            if !text.is_empty() {
                blocks.push(json!({"type": "text", "text": text}));
            }
            for c in tool_calls {
                blocks.push(json!({
                    "type": "tool_use",
                    "id": c.id,
                    "name": c.name,
                    "input": if c.input.is_object() { c.input.clone() } else { json!({"_raw": c.input}) },
                }));
            }
            ("assistant", blocks)
        }
        Message::ToolResult {
            call_id,
            output,
            is_error,
        } => {
            let mut block = json!({
                "type": "tool_result",
                "tool_use_id": call_id,
                "content": output,
            });
            if *is_error {
                block["is_error"] = json!(true);
            }
            ("user", vec![block])
        }
    }
}

/// The request without its messages.
pub(super) fn anthropic_head(cfg: &ModelConfig, system: &str, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "stream": cfg.stream,
    });
    if !system.is_empty() {
        body["system"] = json!(system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(
                |t| json!({"name": t.name, "description": t.description, "input_schema": t.schema}),
            )
            .collect();
    }
    body
}

/// Sets the token counts from an Anthropic `usage` object (input includes cache reads/writes).
pub(super) fn anthropic_usage(u: &Value, turn: &mut Turn) {
    if let Some(input) = u64_of(u, "input_tokens") {
        turn.input_tokens = input
            + u64_of(u, "cache_creation_input_tokens").unwrap_or(0)
            + u64_of(u, "cache_read_input_tokens").unwrap_or(0);
    }
    if let Some(output) = u64_of(u, "output_tokens") {
        turn.output_tokens = output;
    }
}

pub(super) fn anthropic_turn(v: &Value) -> Result<Turn, Fail> {
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Err(api_error(v.get("error").unwrap_or(v)));
    }
    let Some(content) = v.get("content").and_then(Value::as_array) else {
        return Err(Fail::Fatal(format!(
            "answer has no content: {}",
            excerpt(&v.to_string())
        )));
    };
    let mut turn = Turn {
        stop_reason: str_of(v, "stop_reason"),
        ..Turn::default()
    };
    for block in content {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => turn.text.push_str(&str_of(block, "text")),
            Some("tool_use") => turn.tool_calls.push(ToolCallReq {
                id: str_of(block, "id"),
                name: str_of(block, "name"),
                input: input_value(block.get("input")),
            }),
            _ => {}
        }
    }
    if let Some(u) = v.get("usage") {
        anthropic_usage(u, &mut turn);
    }
    Ok(turn)
}

#[derive(Debug)]
pub(super) enum AnthropicBlock {
    Text(String),
    Tool {
        id: String,
        name: String,
        json: String,
        start_input: Value,
    },
    Other,
}

#[derive(Debug, Default)]
pub(super) struct AnthropicAcc {
    blocks: BTreeMap<u64, AnthropicBlock>,
    turn: Turn,
}

impl AnthropicAcc {
    fn build(&mut self) -> Turn {
        let mut turn = std::mem::take(&mut self.turn);
        for block in std::mem::take(&mut self.blocks).into_values() {
            match block {
                AnthropicBlock::Text(t) => turn.text.push_str(&t),
                AnthropicBlock::Tool {
                    id,
                    name,
                    json,
                    start_input,
                } => {
                    let input = if json.trim().is_empty() {
                        input_value(Some(&start_input))
                    } else {
                        parse_args(&json)
                    };
                    turn.tool_calls.push(ToolCallReq { id, name, input });
                }
                AnthropicBlock::Other => {}
            }
        }
        turn
    }
}

impl StreamAcc for AnthropicAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        let v = parse_event_json(&ev.data)?;
        let ty = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(ev.event.as_str());
        let index = u64_of(&v, "index").unwrap_or(0);
        match ty {
            "message_start" => {
                if let Some(u) = v.get("message").and_then(|m| m.get("usage")) {
                    anthropic_usage(u, &mut self.turn);
                }
            }
            "content_block_start" => {
                let cb = v.get("content_block").unwrap_or(&Value::Null);
                let block = match cb.get("type").and_then(Value::as_str) {
                    Some("text") => AnthropicBlock::Text(str_of(cb, "text")),
                    Some("tool_use") => AnthropicBlock::Tool {
                        id: str_of(cb, "id"),
                        name: str_of(cb, "name"),
                        json: String::new(),
                        start_input: cb.get("input").cloned().unwrap_or(Value::Null),
                    },
                    _ => AnthropicBlock::Other,
                };
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                match (
                    delta.get("type").and_then(Value::as_str),
                    self.blocks.get_mut(&index),
                ) {
                    (Some("text_delta"), Some(AnthropicBlock::Text(t))) => {
                        t.push_str(delta.get("text").and_then(Value::as_str).unwrap_or(""));
                    }
                    (Some("text_delta"), None) => {
                        self.blocks
                            .insert(index, AnthropicBlock::Text(str_of(delta, "text")));
                    }
                    (Some("input_json_delta"), Some(AnthropicBlock::Tool { json, .. })) => {
                        json.push_str(
                            delta
                                .get("partial_json")
                                .and_then(Value::as_str)
                                .unwrap_or(""),
                        );
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = v
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.turn.stop_reason = reason.to_string();
                }
                if let Some(u) = v.get("usage") {
                    anthropic_usage(u, &mut self.turn);
                }
            }
            "message_stop" => return Ok(Some(self.build())),
            "error" => return Err(api_error(v.get("error").unwrap_or(&v))),
            _ => {}
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        Err(cut_short("message_stop"))
    }
}
