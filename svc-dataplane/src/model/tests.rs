fn test_http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

use super::sse::{SseEvent, SseParser};
use super::wire::{args_string, parse_args};
use super::*;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const APIS: [Api; 3] = [Api::Anthropic, Api::OpenaiChat, Api::OpenaiResponses];

fn cfg(api: Api, base_url: String, stream: bool) -> ModelConfig {
    ModelConfig {
        api,
        base_url,
        api_key: "sk-test".into(),
        model: "modelsim".into(),
        max_tokens: 1024,
        stream,
        max_retries: 2,
        retry_base_ms: 1,
    }
}

#[tokio::test]
async fn a_hosted_api_without_a_key_is_reported_unconfigured_at_once() {
    let mut c = cfg(Api::Anthropic, "https://api.anthropic.com".into(), false);
    c.api_key = String::new();
    c.max_retries = 100;
    let started = std::time::Instant::now();
    let err = complete(&test_http(), &c, "s", &[], &[]).await.unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    match err {
        ModelError::Rejected(m) => assert!(m.contains("no model is configured"), "{m}"),
        other => panic!("{other:?}"),
    }
    // A self-hosted server needs no key; a hosted API with a key is configured.
    c.base_url = "http://127.0.0.1:9".into();
    assert!(unconfigured(&c).is_none());
    c.base_url = "https://api.openai.com/v1".into();
    c.api_key = "sk-x".into();
    assert!(unconfigured(&c).is_none());
}

fn read_file_tool() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "read_file".into(),
        description: "Read a file".into(),
        schema: json!({"type": "object", "properties": {"path": {"type": "string"}},
            "required": ["path"]}),
    }]
}

fn log_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let p = std::env::temp_dir().join(format!(
        "svc-dataplane-model-{tag}-{}-{n}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&p);
    p
}

fn read_log(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("log line is JSON"))
        .collect()
}

async fn modelsim(script: &str, log: &Path) -> SocketAddr {
    let script = agentscope_modelsim::Script::from_json(script).expect("script");
    let (addr, _task) = agentscope_modelsim::spawn("127.0.0.1:0", script, Some(log.to_path_buf()))
        .await
        .expect("spawn modelsim");
    addr
}

async fn two_step(api: Api, stream: bool) {
    let log = log_path("two-step");
    let addr = modelsim(
        r#"{"turns":[{"tool":"read_file","args":{"path":"a.txt"},"say":"Reading."}],"final":"All done."}"#,
        &log,
    )
    .await;
    let http = test_http();
    let cfg = cfg(api, format!("http://{addr}"), stream);
    let tools = read_file_tool();
    let mut history = vec![Message::User {
        text: "Read a.txt".into(),
    }];
    let t1 = complete(&http, &cfg, "You are a test.", &history, &tools)
        .await
        .expect("first turn");
    assert_eq!(t1.text, "Reading.", "{api:?} stream={stream}");
    assert_eq!(t1.tool_calls.len(), 1, "{t1:?}");
    assert_eq!(t1.tool_calls[0].name, "read_file");
    assert_eq!(t1.tool_calls[0].input, json!({"path": "a.txt"}));
    assert!(!t1.tool_calls[0].id.is_empty());
    let expected_stop = match api {
        Api::Anthropic => "tool_use",
        Api::OpenaiChat => "tool_calls",
        Api::OpenaiResponses => "completed",
    };
    assert_eq!(t1.stop_reason, expected_stop);
    assert_eq!(
        (t1.input_tokens, t1.output_tokens),
        (
            agentscope_modelsim::INPUT_TOKENS,
            agentscope_modelsim::OUTPUT_TOKENS
        )
    );
    history.push(Message::Assistant {
        text: t1.text.clone(),
        tool_calls: t1.tool_calls.clone(),
    });
    history.push(Message::ToolResult {
        call_id: t1.tool_calls[0].id.clone(),
        output: "hello from a.txt".into(),
        is_error: false,
    });
    let t2 = complete(&http, &cfg, "You are a test.", &history, &tools)
        .await
        .expect("second turn");
    assert_eq!(t2.text, "All done.", "{api:?} stream={stream}");
    assert!(t2.tool_calls.is_empty());
    let lines = read_log(&log);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["outcome"], "tool");
    assert_eq!(lines[0]["stream"], json!(stream));
    assert_eq!(lines[0]["tools"], json!(["read_file"]));
    assert_eq!(lines[1]["outcome"], "final");
    assert_eq!(lines[1]["tool_results"], 1);
    let body = &lines[1]["body"];
    match api {
        Api::Anthropic => {
            assert_eq!(body["system"], "You are a test.");
            let msgs = body["messages"].as_array().unwrap();
            assert_eq!(msgs.len(), 3);
            assert_eq!(msgs[1]["content"][1]["type"], "tool_use");
            assert_eq!(msgs[2]["content"][0]["tool_use_id"], t1.tool_calls[0].id);
        }
        Api::OpenaiChat => {
            let msgs = body["messages"].as_array().unwrap();
            assert_eq!(msgs[0]["role"], "system");
            assert_eq!(
                msgs[2]["tool_calls"][0]["function"]["arguments"],
                json!({"path": "a.txt"}).to_string()
            );
            assert_eq!(msgs[3]["role"], "tool");
            if stream {
                assert_eq!(body["stream_options"]["include_usage"], true);
            }
        }
        Api::OpenaiResponses => {
            assert_eq!(body["instructions"], "You are a test.");
            let input = body["input"].as_array().unwrap();
            assert_eq!(input[2]["type"], "function_call");
            assert_eq!(input[3]["type"], "function_call_output");
            assert_eq!(input[3]["call_id"], t1.tool_calls[0].id);
        }
    }
}

#[tokio::test]
async fn anthropic_two_steps() {
    two_step(Api::Anthropic, false).await;
}

#[tokio::test]
async fn anthropic_two_steps_streaming() {
    two_step(Api::Anthropic, true).await;
}

#[tokio::test]
async fn chat_two_steps() {
    two_step(Api::OpenaiChat, false).await;
}

#[tokio::test]
async fn chat_two_steps_streaming() {
    two_step(Api::OpenaiChat, true).await;
}

#[tokio::test]
async fn responses_two_steps() {
    two_step(Api::OpenaiResponses, false).await;
}

#[tokio::test]
async fn responses_two_steps_streaming() {
    two_step(Api::OpenaiResponses, true).await;
}

#[tokio::test]
async fn parallel_tool_calls_come_back_in_order_in_every_api() {
    for api in APIS {
        for stream in [false, true] {
            let log = log_path("parallel");
            let addr = modelsim(
                r#"{"turns":[{"say":"Both.","tool":"read_file","args":{"path":"a.txt"},
                    "also":[{"tool":"read_file","args":{"path":"b.txt"}}]}],"final":"Done."}"#,
                &log,
            )
            .await;
            let history = vec![Message::User {
                text: "Read both at once".into(),
            }];
            let turn = complete(
                &test_http(),
                &cfg(api, format!("http://{addr}"), stream),
                "",
                &history,
                &read_file_tool(),
            )
            .await
            .expect("turn");
            let inputs: Vec<&Value> = turn.tool_calls.iter().map(|c| &c.input).collect();
            assert_eq!(
                inputs,
                [&json!({"path": "a.txt"}), &json!({"path": "b.txt"})],
                "{api:?} stream={stream}: {turn:?}"
            );
            assert!(turn.tool_calls.iter().all(|c| c.name == "read_file"));
            assert_ne!(turn.tool_calls[0].id, turn.tool_calls[1].id);
            assert_eq!(turn.text, "Both.", "{api:?} stream={stream}");
        }
    }
}

#[tokio::test]
async fn consecutive_tool_results() {
    for api in APIS {
        for stream in [false, true] {
            let log = log_path("two-results");
            let addr = modelsim(
                r#"{"turns":[{"tool":"read_file","args":{"path":"a.txt"}},
                    {"tool":"read_file","args":{"path":"b.txt"},"expect":"BBB"}],
                    "final":"Both read."}"#,
                &log,
            )
            .await;
            let history = vec![
                Message::User {
                    text: "Read both".into(),
                },
                Message::Assistant {
                    text: String::new(),
                    tool_calls: vec![
                        ToolCallReq {
                            id: "c1".into(),
                            name: "read_file".into(),
                            input: json!({"path": "a.txt"}),
                        },
                        ToolCallReq {
                            id: "c2".into(),
                            name: "read_file".into(),
                            input: json!({"path": "b.txt"}),
                        },
                    ],
                },
                Message::ToolResult {
                    call_id: "c1".into(),
                    output: "AAA".into(),
                    is_error: false,
                },
                Message::ToolResult {
                    call_id: "c2".into(),
                    output: "BBB".into(),
                    is_error: true,
                },
            ];
            let turn = complete(
                &test_http(),
                &cfg(api, format!("http://{addr}/"), stream),
                "",
                &history,
                &read_file_tool(),
            )
            .await
            .expect("turn");
            assert_eq!(turn.text, "Both read.", "{api:?} {stream}");
            assert!(turn.tool_calls.is_empty());
            let lines = read_log(&log);
            assert_eq!(lines[0]["tool_results"], 2);
            if api == Api::Anthropic {
                let msgs = lines[0]["body"]["messages"].as_array().unwrap();
                assert_eq!(msgs.len(), 3, "{msgs:?}");
                assert!(lines[0]["body"].get("system").is_none());
                let last = &msgs[2];
                assert_eq!(last["role"], "user");
                assert_eq!(
                    last["content"],
                    json!([
                        {"type": "tool_result", "tool_use_id": "c1", "content": "AAA"},
                        {"type": "tool_result", "tool_use_id": "c2", "content": "BBB",
                            "is_error": true},
                    ])
                );
                // The assistant message has only its two tool_use blocks.
                assert_eq!(msgs[1]["content"].as_array().unwrap().len(), 2);
            }
        }
    }
}

// The whole-history construction the incremental [`Conversation`] replaced: the reference it
// must match, request for request.
mod reference {
    use super::super::wire::args_string;
    use super::super::*;

    fn anthropic_messages(history: &[Message]) -> Vec<Value> {
        let mut out: Vec<Value> = Vec::new();
        for m in history {
            let (role, blocks) = match m {
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
            };
            if blocks.is_empty() {
                continue;
            }
            if let Some(last) = out.last_mut()
                && last["role"] == role
                && let Some(content) = last["content"].as_array_mut()
            {
                content.extend(blocks);
                continue;
            }
            out.push(json!({"role": role, "content": blocks}));
        }
        out
    }

    pub(super) fn anthropic_body(
        cfg: &ModelConfig,
        system: &str,
        history: &[Message],
        tools: &[ToolSpec],
    ) -> Value {
        let mut body = json!({
            "model": cfg.model,
            "max_tokens": cfg.max_tokens,
            "messages": anthropic_messages(history),
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

    pub(super) fn chat_body(
        cfg: &ModelConfig,
        system: &str,
        history: &[Message],
        tools: &[ToolSpec],
    ) -> Value {
        let mut messages = Vec::new();
        if !system.is_empty() {
            messages.push(json!({"role": "system", "content": system}));
        }
        for m in history {
            messages.push(match m {
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
            });
        }
        let mut body = json!({
            "model": cfg.model,
            "max_completion_tokens": cfg.max_tokens,
            "messages": messages,
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

    pub(super) fn responses_body(
        cfg: &ModelConfig,
        system: &str,
        history: &[Message],
        tools: &[ToolSpec],
    ) -> Value {
        let mut input = Vec::new();
        for m in history {
            match m {
                Message::User { text } => input.push(json!({"role": "user", "content": text})),
                Message::Assistant { text, tool_calls } => {
                    if !text.is_empty() {
                        input.push(json!({"role": "assistant", "content": text}));
                    }
                    for c in tool_calls {
                        input.push(json!({
                            "type": "function_call",
                            "call_id": c.id,
                            "name": c.name,
                            "arguments": args_string(&c.input),
                        }));
                    }
                }
                Message::ToolResult {
                    call_id, output, ..
                } => input.push(json!({
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": output,
                })),
            }
        }
        let mut body = json!({
            "model": cfg.model,
            "max_output_tokens": cfg.max_tokens,
            "input": input,
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
}

fn anthropic_messages(history: &[Message]) -> Vec<Value> {
    let c = cfg(Api::Anthropic, String::new(), false);
    let prompt = Prompt::new(&c, "", &[]);
    let mut conversation = Conversation::new(c.api);
    for m in history {
        conversation.push(m);
    }
    let body: Value = serde_json::from_slice(&prompt.body(&conversation)).unwrap();
    body["messages"].as_array().unwrap().clone()
}

fn arb_message() -> impl proptest::strategy::Strategy<Value = Message> {
    use proptest::prelude::*;
    let text = prop_oneof![Just(String::new()), "[a-z\"\\\\ é\n]{1,8}"];
    let input = prop_oneof![
        Just(json!({})),
        Just(json!({"path": "a.txt", "n": 1})),
        Just(json!({"_raw": "{oops"})),
        Just(json!("a string")),
    ];
    let call = ("[a-z0-9_]{1,6}", "[a-z_]{1,6}", input).prop_map(|(id, name, input)| ToolCallReq {
        id,
        name,
        input,
    });
    prop_oneof![
        text.clone().prop_map(|text| Message::User { text }),
        (text.clone(), proptest::collection::vec(call, 0..3))
            .prop_map(|(text, tool_calls)| Message::Assistant { text, tool_calls }),
        ("[a-z0-9_]{1,6}", text, any::<bool>()).prop_map(|(call_id, output, is_error)| {
            Message::ToolResult {
                call_id,
                output,
                is_error,
            }
        }),
    ]
}

proptest::proptest! {
    /// Every request the incremental conversation sends equals the whole-history rebuild, for
    /// every prefix of any history, in each API, streaming or not, with or without a system
    /// prompt and tools.
    #[test]
    fn the_incremental_conversation_sends_what_a_rebuild_would(
        history in proptest::collection::vec(arb_message(), 0..12),
        system in proptest::prop_oneof![proptest::strategy::Just(String::new()), "[a-z ]{1,10}"],
        with_tools in proptest::bool::ANY,
        stream in proptest::bool::ANY,
    ) {
        let tools = if with_tools { read_file_tool() } else { vec![] };
        for api in APIS {
            let c = cfg(api, "http://h".into(), stream);
            let prompt = Prompt::new(&c, &system, &tools);
            let mut conversation = Conversation::new(api);
            for n in 0..=history.len() {
                if n > 0 {
                    conversation.push(&history[n - 1]);
                }
                let body: Value = serde_json::from_slice(&prompt.body(&conversation)).unwrap();
                let expected = match api {
                    Api::Anthropic => reference::anthropic_body(&c, &system, &history[..n], &tools),
                    Api::OpenaiChat => reference::chat_body(&c, &system, &history[..n], &tools),
                    Api::OpenaiResponses => reference::responses_body(&c, &system, &history[..n], &tools),
                };
                proptest::prop_assert_eq!(body, expected, "{:?} after {} messages", api, n);
            }
        }
    }
}

#[test]
fn anthropic_merges_user_text_after_results() {
    let msgs = anthropic_messages(&[
        Message::User { text: "hi".into() },
        Message::Assistant {
            text: "x".into(),
            tool_calls: vec![ToolCallReq {
                id: "c1".into(),
                name: "t".into(),
                input: json!({}),
            }],
        },
        Message::ToolResult {
            call_id: "c1".into(),
            output: "out".into(),
            is_error: false,
        },
        Message::User {
            text: "more".into(),
        },
    ]);
    assert_eq!(msgs.len(), 3);
    assert_eq!(msgs[2]["content"][0]["type"], "tool_result");
    assert_eq!(
        msgs[2]["content"][1],
        json!({"type": "text", "text": "more"})
    );
}

#[tokio::test]
async fn connection_refused_is_connection_error() {
    // A port bound without listening: every connection to it is refused, and no other test
    // (each starts its model server on a free port) can take it meanwhile, as it could a port
    // released again.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    for api in APIS {
        let mut c = cfg(api, format!("http://127.0.0.1:{port}"), true);
        c.max_retries = 3;
        let err = complete(&test_http(), &c, "", &[], &read_file_tool())
            .await
            .unwrap_err();
        match err {
            ModelError::Connection(msg) => assert!(msg.contains("4 attempts"), "{msg}"),
            other => panic!("expected Connection, got {other:?}"),
        }
    }
    drop(held);
}

#[tokio::test]
async fn rejected_key_is_not_retried() {
    for api in APIS {
        let log = log_path("401");
        let addr = modelsim(r#"{"turns":[],"final":"x"}"#, &log).await;
        let mut c = cfg(api, format!("http://{addr}/v1"), false);
        c.api_key = agentscope_modelsim::REJECTED_KEY.into();
        c.max_retries = 5;
        let history = [Message::User { text: "hi".into() }];
        let err = complete(&test_http(), &c, "", &history, &read_file_tool())
            .await
            .unwrap_err();
        match err {
            ModelError::Rejected(msg) => {
                assert!(msg.contains("401"), "{msg}");
                assert!(msg.to_lowercase().contains("key"), "{msg}");
            }
            other => panic!("expected Rejected, got {other:?}"),
        }
        let lines = read_log(&log);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["outcome"], "unauthorized");
    }
}

/// A server answering from `plan` in order (the last entry repeats); counts the requests.
async fn plan_server(plan: Vec<(u16, &'static str, String)>) -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let plan = Arc::new(plan);
    let counter = hits.clone();
    let app = axum::Router::new().fallback(move || {
        let plan = plan.clone();
        let counter = counter.clone();
        async move {
            let i = counter.fetch_add(1, Ordering::SeqCst);
            let (status, ctype, body) = plan[i.min(plan.len() - 1)].clone();
            axum::response::Response::builder()
                .status(status)
                .header("content-type", ctype)
                .body(axum::body::Body::from(body))
                .unwrap()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), hits)
}

fn ok_anthropic() -> String {
    json!({"type": "message", "role": "assistant",
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 4}})
    .to_string()
}

fn server_error() -> (u16, &'static str, String) {
    (
        500,
        "application/json",
        r#"{"type":"error","error":{"type":"api_error","message":"boom"}}"#.into(),
    )
}

#[tokio::test]
async fn server_errors_are_retried() {
    let (base, hits) = plan_server(vec![
        server_error(),
        server_error(),
        (200, "application/json", ok_anthropic()),
    ])
    .await;
    let c = cfg(Api::Anthropic, base, false);
    let turn = complete(&test_http(), &c, "", &[], &[])
        .await
        .expect("third attempt succeeds");
    assert_eq!(turn.text, "ok");
    assert_eq!((turn.input_tokens, turn.output_tokens), (3, 4));
    assert_eq!(hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn server_errors_exhaust_retries() {
    let (base, hits) = plan_server(vec![server_error()]).await;
    let mut c = cfg(Api::OpenaiChat, base, false);
    c.max_retries = 1;
    let err = complete(&test_http(), &c, "", &[], &[]).await.unwrap_err();
    match err {
        ModelError::Rejected(msg) => assert!(msg.contains("500") && msg.contains("boom")),
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn bad_request_is_rejected_at_once() {
    let (base, hits) = plan_server(vec![(
        400,
        "application/json",
        r#"{"error":{"message":"bad field"}}"#.into(),
    )])
    .await;
    let mut c = cfg(Api::OpenaiResponses, base, true);
    c.max_retries = 4;
    let err = complete(&test_http(), &c, "", &[], &[]).await.unwrap_err();
    match err {
        ModelError::Rejected(msg) => assert!(msg.contains("400") && msg.contains("bad field")),
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn malformed_body_is_rejected() {
    let (base, hits) = plan_server(vec![(200, "application/json", "not json".into())]).await;
    let err = complete(
        &test_http(),
        &cfg(Api::Anthropic, base, false),
        "",
        &[],
        &[],
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ModelError::Rejected(_)), "{err:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn stream_cut_short_is_retried() {
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":\
        {\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
    let full = format!(
        "{start}event: content_block_start\ndata: {{\"type\":\"content_block_start\",\
        \"index\":0,\"content_block\":{{\"type\":\"tool_use\",\"id\":\"t1\",\"name\":\"x\",\
        \"input\":{{}}}}}}\n\n\
        event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\
        \"delta\":{{\"type\":\"input_json_delta\",\"partial_json\":\"{{not json\"}}}}\n\n\
        event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":0}}\n\n\
        event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":\
        {{\"stop_reason\":\"tool_use\"}},\"usage\":{{\"output_tokens\":7}}}}\n\n\
        event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
    );
    let (base, hits) = plan_server(vec![
        (200, "text/event-stream", start.to_string()),
        (200, "text/event-stream", full),
    ])
    .await;
    let turn = complete(&test_http(), &cfg(Api::Anthropic, base, true), "", &[], &[])
        .await
        .expect("second attempt succeeds");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    assert_eq!(turn.tool_calls.len(), 1);
    assert_eq!(turn.tool_calls[0].input, json!({"_raw": "{not json"}));
    assert_eq!(turn.stop_reason, "tool_use");
    assert_eq!((turn.input_tokens, turn.output_tokens), (5, 7));
}

#[test]
fn sse_parser_handles_any_split() {
    let text = "event: a\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\n: comment\n\ndata:héllo\n\nevent: b\ndata: last";
    let expected = vec![
        SseEvent {
            event: "a".into(),
            data: "{\"x\":\n1}".into(),
        },
        SseEvent {
            event: String::new(),
            data: "héllo".into(),
        },
        SseEvent {
            event: "b".into(),
            data: "last".into(),
        },
    ];
    let bytes = text.as_bytes();
    for split in 0..=bytes.len() {
        for split2 in split..=bytes.len() {
            let mut p = SseParser::default();
            let mut out = Vec::new();
            p.push(&bytes[..split], &mut out);
            p.push(&bytes[split..split2], &mut out);
            p.push(&bytes[split2..], &mut out);
            p.finish(&mut out);
            assert_eq!(out, expected, "split at {split}/{split2}");
        }
    }
}

#[test]
fn args_and_backoff() {
    assert_eq!(parse_args(""), json!({}));
    assert_eq!(parse_args("{\"a\":1}"), json!({"a": 1}));
    assert_eq!(parse_args("{oops"), json!({"_raw": "{oops"}));
    assert_eq!(args_string(&json!({"_raw": "{oops"})), "{oops");
    assert_eq!(backoff_ms(100, 0), 100);
    assert_eq!(backoff_ms(100, 3), 800);
    assert_eq!(backoff_ms(100, 10), MAX_BACKOFF_MS);
    assert_eq!(backoff_ms(u64::MAX, 200), MAX_BACKOFF_MS);
    let c = cfg(Api::OpenaiChat, "http://h:1/v1/".into(), false);
    assert_eq!(endpoint(&c), "http://h:1/v1/chat/completions");
}
