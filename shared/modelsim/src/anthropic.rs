//! Anthropic Messages API (`POST /v1/messages`).

use serde_json::{Value, json};

use crate::{
    INPUT_TOKENS, OUTPUT_TOKENS, Reply, RequestView, ToolDecl, UNCOUNTED_TOOLS, pieces, sse_event,
    text_of,
};

pub(crate) fn view(req: &Value) -> RequestView {
    let tools = req
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| {
            Some(ToolDecl {
                name: t.get("name")?.as_str()?.to_string(),
                schema: t.get("input_schema").cloned().unwrap_or(Value::Null),
                namespace: None,
                kind: "function".into(),
            })
        })
        .collect();
    let mut tool_results = 0;
    let mut last = None;
    // Results of the tool-search tool do not count: ids of its calls.
    let mut search_ids = Vec::new();
    let mut searches = 0;
    let mut search_text = Vec::new();
    for msg in req
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for block in msg
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let ty = block.get("type").and_then(Value::as_str);
            if ty == Some("tool_use")
                && block
                    .get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| UNCOUNTED_TOOLS.contains(&n))
            {
                search_ids.extend(block.get("id").and_then(Value::as_str));
            }
            if ty == Some("tool_result") {
                let id = block.get("tool_use_id").and_then(Value::as_str);
                if id.is_some_and(|id| search_ids.contains(&id)) {
                    searches += 1;
                    search_text.push(text_of(block.get("content").unwrap_or(&Value::Null)));
                    continue;
                }
                searches = 0;
                search_text.clear();
                tool_results += 1;
                last = Some(text_of(block.get("content").unwrap_or(&Value::Null)));
            }
        }
    }
    RequestView {
        model: req
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        stream: req.get("stream").and_then(Value::as_bool).unwrap_or(false),
        tools,
        tool_results,
        last_tool_result: last,
        searches_since_result: searches,
        search_results: (!search_text.is_empty()).then(|| search_text.join("\n")),
        mentioned: Vec::new(),
    }
}

fn usage() -> Value {
    json!({
        "input_tokens": INPUT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

fn stop_reason(reply: &Reply) -> &'static str {
    match reply {
        Reply::Text(_) => "end_turn",
        Reply::Tool { .. } => "tool_use",
    }
}

/// The content blocks of the answer.
fn blocks(id: u64, reply: &Reply) -> Vec<Value> {
    match reply {
        Reply::Text(t) => vec![json!({"type": "text", "text": t})],
        Reply::Tool { say, .. } => {
            let mut out = Vec::new();
            if let Some(s) = say {
                out.push(json!({"type": "text", "text": s}));
            }
            for (call, name, args) in reply.calls("toolu_modelsim", id) {
                out.push(json!({
                    "type": "tool_use",
                    "id": call,
                    "name": name,
                    "input": args,
                }));
            }
            out
        }
    }
}

/// Non-streaming answer.
pub(crate) fn message(model: &str, id: u64, reply: &Reply) -> Value {
    json!({
        "id": format!("msg_modelsim_{id:06}"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(id, reply),
        "stop_reason": stop_reason(reply),
        "stop_sequence": null,
        "usage": usage(),
    })
}

/// Streaming answer: the SSE events in order.
pub(crate) fn stream(model: &str, id: u64, reply: &Reply) -> Vec<String> {
    let mut ev = Vec::new();
    let mut push = |name: &str, data: Value| ev.push(sse_event(Some(name), &data));
    push(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": format!("msg_modelsim_{id:06}"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {
                "input_tokens": INPUT_TOKENS,
                "output_tokens": 1,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }}),
    );
    push("ping", json!({"type": "ping"}));
    for (index, block) in blocks(id, reply).into_iter().enumerate() {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                let text = block["text"].as_str().unwrap_or_default();
                push(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "text", "text": ""}}),
                );
                for p in pieces(text) {
                    push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": p}}),
                    );
                }
            }
            _ => {
                let input = block["input"].to_string();
                push(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "tool_use", "id": block["id"],
                            "name": block["name"], "input": {}}}),
                );
                for p in pieces(&input) {
                    push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": p}}),
                    );
                }
            }
        }
        push(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        );
    }
    push(
        "message_delta",
        json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(reply), "stop_sequence": null},
            "usage": usage()}),
    );
    push("message_stop", json!({"type": "message_stop"}));
    ev
}
