use serde_json::{Value, json};

use super::*;

fn script() -> Script {
    Script::from_json(
        r#"{"turns": [
            {"say": "Reading the issue.", "tool": "mcp:read_issue", "args": {"id": 7}, "expect": "ISSUE-7"},
            {"tool": "shell", "args": {"command": "echo hi > out.txt"}},
            {"tool": "Read", "args": {"file_path": "out.txt"}}
        ], "final": "All done."}"#,
    )
    .unwrap()
}

fn decl(name: &str, schema: Value) -> ToolDecl {
    ToolDecl {
        name: name.to_string(),
        schema,
        namespace: None,
        kind: "function".into(),
    }
}

fn claude_tools() -> Vec<ToolDecl> {
    vec![
        decl(
            "Bash",
            json!({"properties": {"command": {"type": "string"}, "description": {"type": "string"}}}),
        ),
        decl("Read", json!({})),
        decl("mcp__agentscope__read_issue", json!({})),
    ]
}

fn view(tools: Vec<ToolDecl>, results: usize, last: Option<&str>) -> RequestView {
    RequestView {
        model: "m".into(),
        stream: true,
        tools,
        tool_results: results,
        last_tool_result: last.map(str::to_string),
        searches_since_result: 0,
        search_results: None,
        mentioned: vec![],
    }
}

#[test]
fn turns_follow_tool_results() {
    let s = script();
    let d = decide(&s, &view(claude_tools(), 0, None));
    assert_eq!(d.turn, Some(0));
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: Some("Reading the issue.".into()),
            name: "mcp__agentscope__read_issue".into(),
            args: json!({"id": 7}),
            more: vec![],
        }
    );
    let d = decide(&s, &view(claude_tools(), 1, Some("text ISSUE-7 text")));
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: None,
            name: "Bash".into(),
            args: json!({"command": "echo hi > out.txt", "description": "Run a scripted shell command"}),
            more: vec![],
        }
    );
    let d = decide(&s, &view(claude_tools(), 2, Some("")));
    assert_eq!(d.outcome, Outcome::Tool);
    let d = decide(&s, &view(claude_tools(), 3, Some("hi")));
    assert_eq!(d.outcome, Outcome::Final);
    assert_eq!(d.reply, Reply::Text("All done.".into()));
    let d = decide(&s, &view(claude_tools(), 9, Some("hi")));
    assert_eq!(d.outcome, Outcome::Final);
}

#[test]
fn expectation_failure_and_missing_tool() {
    let s = script();
    let d = decide(&s, &view(claude_tools(), 1, Some("nope")));
    assert_eq!(d.outcome, Outcome::ExpectationFailed);
    let Reply::Text(t) = d.reply else { panic!() };
    assert!(t.starts_with(EXPECTATION_FAILED), "{t}");
    let d = decide(&s, &view(vec![decl("Read", json!({}))], 0, None));
    assert_eq!(d.outcome, Outcome::ToolMissing);
    let Reply::Text(t) = d.reply else { panic!() };
    assert!(t.starts_with(TOOL_MISSING), "{t}");
    let d = decide(&s, &view(vec![], 0, None));
    assert_eq!(d.outcome, Outcome::NoTools);
    assert_eq!(d.turn, None);
}

#[test]
fn shell_args_follow_the_schema() {
    let args = json!({"command": "ls"});
    let codex = [decl(
        "exec_command",
        json!({"properties": {"cmd": {"type": "string"}, "workdir": {}}}),
    )];
    assert_eq!(
        resolve_tool("shell", &args, &codex).unwrap(),
        ("exec_command".into(), json!({"cmd": "ls"}))
    );
    let old = [decl(
        "shell",
        json!({"properties": {"command": {"type": "array"}}}),
    )];
    assert_eq!(
        resolve_tool("shell", &args, &old).unwrap().1,
        json!({"command": ["bash", "-lc", "ls"]})
    );
    let opencode = [
        decl(
            "bash",
            json!({"properties": {"command": {}, "description": {}}}),
        ),
        decl("agentscope_read_issue", json!({})),
    ];
    assert_eq!(resolve_tool("shell", &args, &opencode).unwrap().0, "bash");
    assert_eq!(
        resolve_tool("mcp:read_issue", &json!({}), &opencode)
            .unwrap()
            .0,
        "agentscope_read_issue"
    );
    assert!(resolve_tool("mcp:read_issue", &json!({}), &codex).is_err());
}

/// Names mentioning agentscope in any case, anywhere in the body, each once and sorted; other
/// words and strings are not names.
#[test]
fn mentioned_names_are_found_in_any_string() {
    let body = json!({
        "system": "Use the AgentScope_read_issue tool, not read_issue.",
        "messages": [
            {"content": [{"type": "text", "text": "call mcp__agentscope__comment (or agentscope.cli)"}]},
            {"content": "nothing here; agent scope is two words"},
            {"content": "again: mcp__agentscope__comment"},
        ],
        "n": 3,
    });
    assert_eq!(
        mentioned_names(&body),
        vec![
            "AgentScope_read_issue",
            "agentscope.cli",
            "mcp__agentscope__comment"
        ]
    );
    assert!(mentioned_names(&json!({"a": ["agent", "scope"]})).is_empty());
}

#[test]
fn script_validation() {
    assert!(Script::from_json(r#"{"turns": [{"tool": "shell", "args": {}}]}"#).is_err());
    assert!(Script::from_json(r#"{"turns": [{"tool": "x", "bogus": 1}]}"#).is_err());
    let s = Script::from_json(r#"{"turns": []}"#).unwrap();
    assert_eq!(s.final_text, "Done.");
}

#[test]
fn anthropic_history_counts_tool_results() {
    let req = json!({
        "model": "claude-x", "stream": true,
        "tools": [{"name": "Bash", "input_schema": {}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                "content": [{"type": "text", "text": "first"}]}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "b", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "second"},
                {"type": "text", "text": "more"}]},
        ]
    });
    let v = anthropic::view(&req);
    assert_eq!(v.tool_results, 2);
    assert_eq!(v.last_tool_result.as_deref(), Some("second"));
    assert_eq!(v.model, "claude-x");
    assert!(v.stream);
}

#[test]
fn responses_and_chat_history() {
    let req = json!({
        "model": "gpt", "stream": true,
        "tools": [{"type": "function", "name": "exec_command", "parameters": {}},
                  {"type": "web_search"},
                  {"type": "namespace", "name": "mcp__agentscope__", "tools": [{"type": "function", "name": "read_issue"}]}],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ran"},
        ]
    });
    let v = responses::view(&req);
    assert_eq!(v.tool_results, 1);
    assert_eq!(v.last_tool_result.as_deref(), Some("ran"));
    let names: Vec<_> = v.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["exec_command", "web_search", "mcp__agentscope__read_issue"]
    );

    let req = json!({
        "model": "oc", "stream": true, "stream_options": {"include_usage": true},
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "out"}]},
        ]
    });
    let v = chat::view(&req);
    assert_eq!(v.tool_results, 1);
    assert_eq!(v.last_tool_result.as_deref(), Some("out"));
    assert_eq!(v.tools[0].name, "bash");
    assert!(chat::include_usage(&req));
}

fn data_lines(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .flat_map(|e| e.lines())
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn anthropic_stream_reassembles() {
    let reply = Reply::Tool {
        say: Some("Looking at the issue now, please wait.".into()),
        name: "Bash".into(),
        args: json!({"command": "echo 'hello world' > out.txt"}),
        more: vec![],
    };
    let events = anthropic::stream("m", 1, &reply);
    assert!(events[0].starts_with("event: message_start\n"));
    let data = data_lines(&events);
    let mut text = String::new();
    let mut json_text = String::new();
    for d in &data {
        if d["type"] == "content_block_delta" {
            match d["delta"]["type"].as_str().unwrap() {
                "text_delta" => text.push_str(d["delta"]["text"].as_str().unwrap()),
                "input_json_delta" => {
                    json_text.push_str(d["delta"]["partial_json"].as_str().unwrap())
                }
                _ => panic!(),
            }
        }
    }
    assert_eq!(text, "Looking at the issue now, please wait.");
    assert_eq!(
        serde_json::from_str::<Value>(&json_text).unwrap(),
        json!({"command": "echo 'hello world' > out.txt"})
    );
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(delta["usage"]["output_tokens"], OUTPUT_TOKENS);
    assert_eq!(data.last().unwrap()["type"], "message_stop");
    let m = anthropic::message("m", 1, &Reply::Text("hi".into()));
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["content"][0]["text"], "hi");
}

#[test]
fn responses_stream_has_function_call_item() {
    let reply = Reply::Tool {
        say: Some("ok".into()),
        name: "exec_command".into(),
        args: json!({"cmd": "ls"}),
        more: vec![],
    };
    let data = data_lines(&responses::stream("m", 3, &reply, &[]));
    assert_eq!(data[0]["type"], "response.created");
    let done: Vec<_> = data
        .iter()
        .filter(|d| d["type"] == "response.output_item.done")
        .collect();
    assert_eq!(done.len(), 2);
    assert_eq!(done[1]["item"]["type"], "function_call");
    assert_eq!(done[1]["item"]["name"], "exec_command");
    assert_eq!(done[1]["item"]["arguments"], r#"{"cmd":"ls"}"#);
    assert!(done[1]["item"]["call_id"].is_string());
    let last = data.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"]["usage"]["input_tokens"], INPUT_TOKENS);
    let seqs: Vec<_> = data
        .iter()
        .map(|d| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
}

#[test]
fn chat_stream_tool_calls_and_usage() {
    let reply = Reply::Tool {
        say: None,
        name: "bash".into(),
        args: json!({"command": "ls -la /tmp"}),
        more: vec![],
    };
    let events = chat::stream("m", 4, &reply, true);
    assert_eq!(events.last().unwrap(), "data: [DONE]\n\n");
    let data = data_lines(&events);
    let mut args = String::new();
    for d in &data {
        if let Some(calls) = d["choices"][0]["delta"]["tool_calls"].as_array() {
            args.push_str(calls[0]["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"command": "ls -la /tmp"})
    );
    let fin = data
        .iter()
        .find(|d| d["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(data.last().unwrap()["usage"]["prompt_tokens"], INPUT_TOKENS);
    let no_usage = data_lines(&chat::stream("m", 4, &Reply::Text("x".into()), false));
    assert!(no_usage.iter().all(|d| d.get("usage").is_none()));
}

#[tokio::test]
async fn serves_over_http() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = std::env::temp_dir().join(format!("modelsim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log.jsonl");
    let _ = std::fs::remove_file(&log);
    let (addr, _h) = spawn("127.0.0.1:0", script(), Some(log.clone()))
        .await
        .unwrap();
    async fn raw(addr: std::net::SocketAddr, req: String) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }
    let body = json!({"model": "claude", "stream": true, "max_tokens": 10,
        "tools": [{"name": "mcp__agentscope__read_issue", "input_schema": {}}],
        "messages": [{"role": "user", "content": "go"}]})
    .to_string();
    let resp = raw(
        addr,
        format!(
            "POST /v1/messages?beta=true HTTP/1.1\r\nhost: x\r\nx-api-key: k\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("text/event-stream"));
    assert!(resp.contains("mcp__agentscope__read_issue"));
    let resp = raw(
        addr,
        "GET /nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_string(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
    assert!(resp.contains("not_found_error"));
    let logged = std::fs::read_to_string(&log).unwrap();
    let line: Value = serde_json::from_str(logged.lines().next().unwrap()).unwrap();
    assert_eq!(line["path"], "/v1/messages?beta=true");
    assert_eq!(line["turn"], 0);
    assert_eq!(line["tools"], json!(["mcp__agentscope__read_issue"]));
    assert_eq!(line["body"]["model"], "claude");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deferred_mcp_tool_is_loaded_through_tool_search() {
    let s = script();
    let tools = vec![decl("Bash", json!({})), decl("ToolSearch", json!({}))];
    let mut v = view(tools, 0, None);
    v.mentioned = mentioned_names(
        &json!({"m": [{"text": "deferred tools:\nWebFetch\nmcp__agentscope__read_issue\n"}]}),
    );
    assert_eq!(v.mentioned, ["mcp__agentscope__read_issue"]);
    let d = decide(&s, &v);
    assert_eq!(d.outcome, Outcome::ToolSearch);
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: None,
            name: "ToolSearch".into(),
            args: json!({"query": "select:mcp__agentscope__read_issue", "max_results": 5}),
            more: vec![],
        }
    );
    // A search that did not load it is not repeated.
    v.searches_since_result = 1;
    assert_eq!(decide(&s, &v).outcome, Outcome::ToolMissing);
    // Once loaded, the tool is declared and called.
    v.tools.push(decl("mcp__agentscope__read_issue", json!({})));
    assert_eq!(decide(&s, &v).outcome, Outcome::Tool);

    let req = json!({
        "tools": [{"name": "ToolSearch", "input_schema": {}}],
        "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "s", "name": "ToolSearch", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "s", "content": "loaded"}]},
        ]
    });
    let v = anthropic::view(&req);
    assert_eq!(v.tool_results, 0);
    assert_eq!(v.last_tool_result, None);
}

#[test]
fn codex_tool_search_loads_namespaced_tools() {
    let s = script();
    let mut req = json!({
        "model": "gpt", "stream": true,
        "tools": [{"type": "function", "name": "exec_command", "parameters": {}},
                  {"type": "tool_search", "execution": "client",
                   "parameters": {"properties": {"query": {}, "limit": {}}}}],
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text",
            "text": "<tools>\nDeferred tool namespaces:\n- mcp__agentscope\n</tools>"}]}]
    });
    let mut v = responses::view(&req);
    v.mentioned = mentioned_names(&req);
    let d = decide(&s, &v);
    assert_eq!(d.outcome, Outcome::ToolSearch);
    let data = data_lines(&responses::stream("m", 1, &d.reply, &v.tools));
    let done = data
        .iter()
        .find(|d| d["type"] == "response.output_item.done")
        .unwrap();
    assert_eq!(done["item"]["type"], "tool_search_call");
    assert_eq!(done["item"]["execution"], "client");
    assert_eq!(
        done["item"]["arguments"]["query"],
        "mcp__agentscope read_issue"
    );

    let input = req["input"].as_array_mut().unwrap();
    input.push(done["item"].clone());
    input.push(json!({"type": "tool_search_output", "call_id": done["item"]["call_id"],
        "execution": "client", "status": "completed",
        "tools": [{"type": "namespace", "name": "mcp__agentscope", "tools": [
            {"type": "function", "name": "read_issue", "defer_loading": true, "parameters": {}}]}]}));
    let mut v = responses::view(&req);
    v.mentioned = mentioned_names(&req);
    assert_eq!(v.tool_results, 0);
    assert_eq!(v.searches_since_result, 1);
    let d = decide(&s, &v);
    assert_eq!(d.outcome, Outcome::Tool);
    let data = data_lines(&responses::stream("m", 2, &d.reply, &v.tools));
    let call = data
        .iter()
        .filter(|d| d["type"] == "response.output_item.done")
        .find(|d| d["item"]["type"] == "function_call")
        .unwrap();
    assert_eq!(call["item"]["name"], "read_issue");
    assert_eq!(call["item"]["namespace"], "mcp__agentscope");
}

#[test]
fn openclaw_tool_search_then_tool_call() {
    let s = script();
    let tools = json!([
        {"type": "function", "function": {"name": "exec", "parameters": {"properties": {"command": {}}}}},
        {"type": "function", "function": {"name": "tool_search", "parameters": {"properties": {"query": {}, "limit": {}}}}},
        {"type": "function", "function": {"name": "tool_call", "parameters": {"properties": {"id": {}, "args": {}}}}},
    ]);
    let mut req = json!({"model": "m", "stream": true, "tools": tools,
        "messages": [{"role": "user", "content": "go"}]});
    let v = chat::view(&req);
    let d = decide(&s, &v);
    assert_eq!(d.outcome, Outcome::ToolSearch);
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: None,
            name: "tool_search".into(),
            args: json!({"query": "agentscope read_issue", "limit": 8}),
            more: vec![],
        }
    );
    let msgs = req["messages"].as_array_mut().unwrap();
    msgs.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "tool_search", "arguments": "{}"}}]}),
    );
    msgs.push(json!({"role": "tool", "tool_call_id": "c1",
        "content": "[{\"id\": \"mcp:agentscope:agentscope__read_issue\", \"name\": \"agentscope__read_issue\"}]"}));
    let v = chat::view(&req);
    assert_eq!(v.tool_results, 0);
    assert_eq!(v.searches_since_result, 1);
    let d = decide(&s, &v);
    assert_eq!(d.outcome, Outcome::Tool);
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: Some("Reading the issue.".into()),
            name: "tool_call".into(),
            args: json!({"id": "mcp:agentscope:agentscope__read_issue", "args": {"id": 7}}),
            more: vec![],
        }
    );
    let msgs = req["messages"].as_array_mut().unwrap();
    msgs.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c2", "type": "function",
        "function": {"name": "tool_call", "arguments": "{}"}}]}),
    );
    msgs.push(json!({"role": "tool", "tool_call_id": "c2", "content": "ISSUE-7 text"}));
    let v = chat::view(&req);
    assert_eq!(v.tool_results, 1);
    assert_eq!(
        decide(&s, &v).reply.clone(),
        Reply::Tool {
            say: None,
            name: "exec".into(),
            args: json!({"command": "echo hi > out.txt"}),
            more: vec![],
        }
    );
}

#[test]
fn a_turn_with_parallel_calls_is_answered_once_all_have_results() {
    let s = Script::from_json(
        r#"{"turns": [
            {"tool": "Read", "args": {"file_path": "a"}, "also": [{"tool": "shell", "args": {"command": "ls"}}]},
            {"tool": "Read", "args": {"file_path": "b"}, "expect": "B"}
        ], "final": "Both."}"#,
    )
    .unwrap();
    let d = decide(&s, &view(claude_tools(), 0, None));
    assert_eq!((d.turn, d.outcome), (Some(0), Outcome::Tool));
    assert_eq!(
        d.reply,
        Reply::Tool {
            say: None,
            name: "Read".into(),
            args: json!({"file_path": "a"}),
            more: vec![More {
                name: "Bash".into(),
                args: json!({"command": "ls", "description": "Run a scripted shell command"}),
                repeat_id: false,
            }],
        }
    );
    // One of the two results only: the turn is not answered.
    let d = decide(&s, &view(claude_tools(), 1, Some("a")));
    assert_eq!((d.turn, d.outcome), (Some(0), Outcome::ExpectationFailed));
    let d = decide(&s, &view(claude_tools(), 2, Some("ls output")));
    assert_eq!((d.turn, d.outcome), (Some(1), Outcome::Tool));
    let d = decide(&s, &view(claude_tools(), 3, Some("B")));
    assert_eq!((d.turn, d.outcome), (Some(2), Outcome::Final));
    let d = decide(&s, &view(claude_tools(), 5, Some("B")));
    assert_eq!((d.turn, d.outcome), (Some(4), Outcome::Final));
    let bad = r#"{"turns": [{"tool": "Read", "also": [{"tool": "shell", "args": {}}]}]}"#;
    assert!(
        Script::from_json(bad).is_err(),
        "an `also` call is checked as a turn's is"
    );
}

#[test]
fn parallel_calls_render_in_every_wire_format() {
    let reply = Reply::Tool {
        say: Some("Two at once.".into()),
        name: "read_file".into(),
        args: json!({"path": "a"}),
        more: vec![More {
            name: "list_files".into(),
            args: json!({"path": "."}),
            repeat_id: false,
        }],
    };
    // Anthropic: two tool_use blocks with their own ids, streamed and not.
    let m = anthropic::message("m", 5, &reply);
    let uses: Vec<&Value> = m["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert_eq!(uses.len(), 2);
    assert_eq!(uses[1]["name"], "list_files");
    assert_ne!(uses[0]["id"], uses[1]["id"]);
    let data = data_lines(&anthropic::stream("m", 5, &reply));
    let starts: Vec<&Value> = data
        .iter()
        .filter(|d| d["type"] == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .collect();
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[1]["index"], 2);
    // Chat Completions: tool_calls at indexes 0 and 1.
    let c = chat::completion("m", 6, &reply);
    let calls = c["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    let data = data_lines(&chat::stream("m", 6, &reply, false));
    let mut args = [String::new(), String::new()];
    for d in &data {
        for call in d["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = call["index"].as_u64().unwrap() as usize;
            args[i].push_str(call["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(args[1], r#"{"path":"."}"#);
    // Responses: two function_call items with their own call ids.
    let r = responses::response("m", 7, &reply, &[]);
    let items: Vec<&Value> = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(items.len(), 2);
    assert_eq!(items[1]["name"], "list_files");
    assert_ne!(items[0]["call_id"], items[1]["call_id"]);
}

#[test]
fn a_repeated_call_id_is_sent_as_scripted() {
    let reply = Reply::Tool {
        say: None,
        name: "read_file".into(),
        args: json!({"path": "a"}),
        more: vec![
            More {
                name: "read_file".into(),
                args: json!({"path": "b"}),
                repeat_id: true,
            },
            More {
                name: "list_files".into(),
                args: json!({"path": "."}),
                repeat_id: false,
            },
        ],
    };
    let ids = |v: Vec<&Value>| {
        v.into_iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let m = anthropic::message("m", 8, &reply);
    let a = ids(m["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| &b["id"])
        .collect());
    let c = chat::completion("m", 8, &reply);
    let c = ids(c["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["id"])
        .collect());
    let r = responses::response("m", 8, &reply, &[]);
    let r = ids(r["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| &i["call_id"])
        .collect());
    for got in [a, c, r] {
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], got[1], "{got:?}");
        assert_ne!(got[0], got[2], "{got:?}");
    }
}
