//! OpenAI Responses API (`POST /v1/responses`), as Codex uses it.

use serde_json::{Value, json};

use crate::{
    INPUT_TOKENS, OUTPUT_TOKENS, Reply, RequestView, ToolDecl, now_secs, pieces, sse_event, text_of,
};

/// Item types in `input` that carry a tool's result.
/// (`tool_search_output` is not one: loading deferred tools is not a turn.)
const RESULT_ITEMS: &[&str] = &[
    "function_call_output",
    "custom_tool_call_output",
    "local_shell_call_output",
];

pub(crate) fn view(req: &Value) -> RequestView {
    let mut tools = Vec::new();
    collect_tools(req.get("tools"), "", &mut tools);
    let mut tool_results = 0;
    let mut last = None;
    let mut searches = 0;
    let mut search_text = Vec::new();
    for item in req
        .get("input")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let ty = item.get("type").and_then(Value::as_str).unwrap_or_default();
        if ty == "tool_search_output" {
            // Tools loaded by a client-side tool search are declared from now on.
            collect_tools(item.get("tools"), "", &mut tools);
            searches += 1;
            search_text.push(item.get("tools").map(Value::to_string).unwrap_or_default());
        }
        if RESULT_ITEMS.contains(&ty) {
            searches = 0;
            search_text.clear();
            tool_results += 1;
            last = Some(text_of(item.get("output").unwrap_or(&Value::Null)));
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

/// Tool names: `name` of each tool (or of `function`), and the tools nested in a `namespace`
/// entry, named `NAMESPACE` + `NAME`.
fn collect_tools(tools: Option<&Value>, prefix: &str, out: &mut Vec<ToolDecl>) {
    for t in tools.and_then(Value::as_array).into_iter().flatten() {
        let ty = t.get("type").and_then(Value::as_str).unwrap_or_default();
        let name = t
            .get("name")
            .or_else(|| t.get("function").and_then(|f| f.get("name")))
            .and_then(Value::as_str);
        if ty == "namespace" {
            collect_tools(t.get("tools"), name.unwrap_or_default(), out);
            continue;
        }
        let name = match (name, ty) {
            (Some(n), _) => n.to_string(),
            // Hosted tools without a name (web_search, local_shell, ...): their type.
            (None, ty) if !ty.is_empty() => ty.to_string(),
            _ => continue,
        };
        let schema = t
            .get("parameters")
            .or_else(|| t.get("function").and_then(|f| f.get("parameters")))
            .cloned()
            .unwrap_or(Value::Null);
        out.push(ToolDecl {
            name: format!("{prefix}{name}"),
            schema,
            namespace: (!prefix.is_empty()).then(|| prefix.to_string()),
            kind: if ty.is_empty() {
                "function".into()
            } else {
                ty.to_string()
            },
        });
    }
}

fn usage() -> Value {
    json!({
        "input_tokens": INPUT_TOKENS,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": OUTPUT_TOKENS,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
    })
}

fn message_item(id: u64, n: usize, text: &str) -> Value {
    json!({
        "id": format!("msg_modelsim_{id:06}_{n}"),
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// The answer's `k`th tool call, output item `n`.
fn call_item(
    id: u64,
    n: usize,
    call_id: String,
    name: &str,
    args: &Value,
    tools: &[ToolDecl],
) -> Value {
    let decl = tools.iter().find(|t| t.name == name);
    match decl.map(|d| d.kind.as_str()) {
        // Client-executed tool search (Codex): arguments are an object.
        Some("tool_search") => {
            return json!({
                "id": format!("ts_modelsim_{id:06}_{n}"),
                "type": "tool_search_call",
                "status": "completed",
                "execution": "client",
                "call_id": call_id,
                "arguments": args,
            });
        }
        // Freeform tools (Codex `apply_patch`): raw text input, from args `{"input": "..."}`.
        Some("custom") => {
            let input = match args.get("input") {
                Some(Value::String(s)) => s.clone(),
                _ => args.to_string(),
            };
            return json!({
                "id": format!("ctc_modelsim_{id:06}_{n}"),
                "type": "custom_tool_call",
                "status": "completed",
                "name": name,
                "call_id": call_id,
                "input": input,
            });
        }
        _ => {}
    }
    let mut item = json!({
        "id": format!("fc_modelsim_{id:06}_{n}"),
        "type": "function_call",
        "status": "completed",
        "name": name,
        "call_id": call_id,
        "arguments": args.to_string(),
    });
    // A tool declared inside a namespace is called by its own name plus `namespace`.
    if let Some(ns) = decl.and_then(|d| d.namespace.as_ref()) {
        item["name"] = json!(name.strip_prefix(ns.as_str()).unwrap_or(name));
        item["namespace"] = json!(ns);
    }
    item
}

fn output(id: u64, reply: &Reply, tools: &[ToolDecl]) -> Vec<Value> {
    match reply {
        Reply::Text(t) => vec![message_item(id, 0, t)],
        Reply::Tool { say, .. } => {
            let mut out = Vec::new();
            if let Some(s) = say {
                out.push(message_item(id, out.len(), s));
            }
            for (call, name, args) in reply.calls("call_modelsim", id) {
                out.push(call_item(id, out.len(), call, name, args, tools));
            }
            out
        }
    }
}

fn response_object(model: &str, id: u64, status: &str, output: Vec<Value>, done: bool) -> Value {
    json!({
        "id": format!("resp_modelsim_{id:06}"),
        "object": "response",
        "created_at": now_secs(),
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": false,
        "tool_choice": "auto",
        "error": null,
        "incomplete_details": null,
        "usage": if done { usage() } else { Value::Null },
    })
}

/// Non-streaming answer.
pub(crate) fn response(model: &str, id: u64, reply: &Reply, tools: &[ToolDecl]) -> Value {
    response_object(model, id, "completed", output(id, reply, tools), true)
}

/// Streaming answer: the SSE events in order.
pub(crate) fn stream(model: &str, id: u64, reply: &Reply, tools: &[ToolDecl]) -> Vec<String> {
    let mut ev = Vec::new();
    let mut seq = 0u64;
    let mut push = |data: Value| {
        let mut data = data;
        data["sequence_number"] = json!(seq);
        seq += 1;
        let name = data["type"].as_str().unwrap_or_default().to_string();
        ev.push(sse_event(Some(&name), &data));
    };
    push(json!({"type": "response.created",
        "response": response_object(model, id, "in_progress", vec![], false)}));
    push(json!({"type": "response.in_progress",
        "response": response_object(model, id, "in_progress", vec![], false)}));
    let items = output(id, reply, tools);
    for (output_index, item) in items.iter().enumerate() {
        let item_id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        if item["type"] == "message" {
            let text = item["content"][0]["text"].as_str().unwrap_or_default();
            added["content"] = json!([]);
            push(json!({"type": "response.output_item.added",
                "output_index": output_index, "item": added}));
            push(
                json!({"type": "response.content_part.added", "item_id": item_id,
                "output_index": output_index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
            for p in pieces(text) {
                push(
                    json!({"type": "response.output_text.delta", "item_id": item_id,
                    "output_index": output_index, "content_index": 0, "delta": p,
                    "logprobs": []}),
                );
            }
            push(
                json!({"type": "response.output_text.done", "item_id": item_id,
                "output_index": output_index, "content_index": 0, "text": text,
                "logprobs": []}),
            );
            push(
                json!({"type": "response.content_part.done", "item_id": item_id,
                "output_index": output_index, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": []}}),
            );
        } else if item["type"] == "function_call" {
            let args = item["arguments"].as_str().unwrap_or_default();
            added["arguments"] = json!("");
            push(json!({"type": "response.output_item.added",
                "output_index": output_index, "item": added}));
            for p in pieces(args) {
                push(json!({"type": "response.function_call_arguments.delta",
                    "item_id": item_id, "output_index": output_index, "delta": p}));
            }
            push(json!({"type": "response.function_call_arguments.done",
                "item_id": item_id, "output_index": output_index, "arguments": args}));
        } else {
            push(json!({"type": "response.output_item.added",
                "output_index": output_index, "item": added}));
        }
        push(json!({"type": "response.output_item.done",
            "output_index": output_index, "item": item}));
    }
    push(json!({"type": "response.completed",
        "response": response_object(model, id, "completed", items, true)}));
    ev
}
