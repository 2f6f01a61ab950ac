//! OpenAI Chat Completions API (`POST /v1/chat/completions`).

use serde_json::{Value, json};

use crate::{
    INPUT_TOKENS, OUTPUT_TOKENS, Reply, RequestView, ToolDecl, UNCOUNTED_TOOLS, now_secs, pieces,
    sse_event, text_of,
};

pub(crate) fn view(req: &Value) -> RequestView {
    let tools = req
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let f = t.get("function").unwrap_or(t);
            Some(ToolDecl {
                name: f.get("name")?.as_str()?.to_string(),
                schema: f.get("parameters").cloned().unwrap_or(Value::Null),
                namespace: None,
                kind: "function".into(),
            })
        })
        .collect();
    let mut tool_results = 0;
    let mut last = None;
    // Results of search tools do not count: ids of their calls.
    let mut search_ids: Vec<&str> = Vec::new();
    let mut searches = 0;
    let mut search_text = Vec::new();
    for msg in req
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for call in msg
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = call
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            if name.is_some_and(|n| UNCOUNTED_TOOLS.contains(&n)) {
                search_ids.extend(call.get("id").and_then(Value::as_str));
            }
        }
        if msg.get("role").and_then(Value::as_str) == Some("tool") {
            let text = text_of(msg.get("content").unwrap_or(&Value::Null));
            let id = msg.get("tool_call_id").and_then(Value::as_str);
            if id.is_some_and(|id| search_ids.contains(&id)) {
                searches += 1;
                search_text.push(text);
                continue;
            }
            searches = 0;
            search_text.clear();
            tool_results += 1;
            last = Some(text);
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

/// Whether the streaming request asked for a final usage chunk.
pub(crate) fn include_usage(req: &Value) -> bool {
    req.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

fn usage() -> Value {
    json!({
        "prompt_tokens": INPUT_TOKENS,
        "completion_tokens": OUTPUT_TOKENS,
        "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

fn finish_reason(reply: &Reply) -> &'static str {
    match reply {
        Reply::Text(_) => "stop",
        Reply::Tool { .. } => "tool_calls",
    }
}

/// The answer's tool calls, in order: (id, name, arguments).
fn calls(id: u64, reply: &Reply) -> Vec<(String, &str, String)> {
    reply
        .calls("call_modelsim", id)
        .into_iter()
        .map(|(call, name, args)| (call, name, args.to_string()))
        .collect()
}

/// Non-streaming answer.
pub(crate) fn completion(model: &str, id: u64, reply: &Reply) -> Value {
    let message = match reply {
        Reply::Text(t) => json!({"role": "assistant", "content": t}),
        Reply::Tool { say, .. } => json!({
            "role": "assistant",
            "content": say,
            "tool_calls": calls(id, reply).into_iter().map(|(call, name, args)| json!({
                "id": call,
                "type": "function",
                "function": {"name": name, "arguments": args},
            })).collect::<Vec<_>>(),
        }),
    };
    json!({
        "id": format!("chatcmpl-modelsim-{id:06}"),
        "object": "chat.completion",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(reply),
            "logprobs": null}],
        "usage": usage(),
    })
}

/// Streaming answer: the SSE events in order, `data: [DONE]` last.
pub(crate) fn stream(model: &str, id: u64, reply: &Reply, include_usage: bool) -> Vec<String> {
    let created = now_secs();
    let chunk = |choices: Value| {
        json!({
            "id": format!("chatcmpl-modelsim-{id:06}"),
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        })
    };
    let delta = |d: Value| chunk(json!([{"index": 0, "delta": d, "finish_reason": null}]));
    let mut ev = vec![sse_event(
        None,
        &delta(json!({"role": "assistant", "content": ""})),
    )];
    let text = match reply {
        Reply::Text(t) => Some(t.as_str()),
        Reply::Tool { say, .. } => say.as_deref(),
    };
    for p in pieces(text.unwrap_or_default()) {
        ev.push(sse_event(None, &delta(json!({"content": p}))));
    }
    for (index, (call, name, args)) in calls(id, reply).into_iter().enumerate() {
        ev.push(sse_event(
            None,
            &delta(
                json!({"tool_calls": [{"index": index, "id": call, "type": "function",
                "function": {"name": name, "arguments": ""}}]}),
            ),
        ));
        for p in pieces(&args) {
            ev.push(sse_event(
                None,
                &delta(json!({"tool_calls": [{"index": index, "function": {"arguments": p}}]})),
            ));
        }
    }
    ev.push(sse_event(
        None,
        &chunk(json!([{"index": 0, "delta": {}, "finish_reason": finish_reason(reply)}])),
    ));
    if include_usage {
        let mut last = chunk(json!([]));
        last["usage"] = usage();
        ev.push(sse_event(None, &last));
    }
    ev.push("data: [DONE]\n\n".to_string());
    ev
}
