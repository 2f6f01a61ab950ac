//! The real agent CLIs, installed from npm, run unmodified on the Runtime Host against the
//! scripted model server: they read the Issue through the platform's MCP tools, edit a file in
//! the cloned repository, run a shell command, comment and upload an Artifact.

use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::Duration;

/// The provider CLIs installed by scripts/install-providers.sh.
pub(crate) fn provider_env() -> Vec<(String, String)> {
    let names = [
        "AGENTSCOPE_CLAUDE_BIN",
        "AGENTSCOPE_CODEX_BIN",
        "AGENTSCOPE_OPENCODE_BIN",
        "AGENTSCOPE_OPENCLAW_BIN",
    ];
    let mut out: Vec<(String, String)> = names
        .iter()
        .filter_map(|n| std::env::var(n).ok().map(|v| (n.to_string(), v)))
        .collect();
    if out.len() < names.len() {
        let dir = std::env::var("AGENTSCOPE_PROVIDERS_DIR")
            .unwrap_or_else(|_| "/opt/agentscope/providers".to_string());
        let env = std::fs::read_to_string(format!("{dir}/env")).unwrap_or_else(|_| {
            panic!(
                "provider CLIs are not installed: run scripts/install-providers.sh (no {dir}/env)"
            )
        });
        out = env
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
            .collect();
    }
    out
}

/// The scripted model server on a free port; returns its process and base URL.
pub(crate) async fn modelsim(
    dir: &std::path::Path,
    script: &Value,
) -> (kit::Proc, String, std::path::PathBuf) {
    let script_path = dir.join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let log = dir.join("model-requests.jsonl");
    let proc = kit::Proc::spawn(
        "modelsim",
        &kit::bin("agentscope-modelsim").unwrap(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--script",
            script_path.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ],
        &[],
        dir,
    )
    .unwrap();
    let log_file = proc.log.clone();
    let url = kit::wait_for("modelsim to listen", Duration::from_secs(20), || {
        let log_file = log_file.clone();
        async move {
            let text = std::fs::read_to_string(&log_file).ok()?;
            let line = text.lines().find(|l| l.starts_with("listening on "))?;
            Some(line.trim_start_matches("listening on ").trim().to_string())
        }
    })
    .await
    .unwrap();
    (proc, url, log)
}

/// The pool `agents` (created when missing), a runtime profile with `params` and an agent of
/// `provider`, bound with `max_attempts: 1` and the `binding` fields. Returns the agent id.
pub(crate) async fn provider_agent(
    stack: &Stack,
    name: &str,
    provider: &str,
    params: Value,
    binding: Value,
) -> String {
    let pools = stack.api.get("/v1/pools").await.unwrap();
    let pool = match pools["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "agents")
    {
        Some(p) => p.clone(),
        None => stack
            .api
            .post("/v1/pools", json!({"name": "agents"}))
            .await
            .unwrap(),
    };
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": name, "provider": provider, "params": params}),
        )
        .await
        .unwrap();
    let agent = stack
        .api
        .post("/v1/agents", json!({"name": name, "provider": provider}))
        .await
        .unwrap();
    let mut b = json!({"agent_id": agent["id"], "pool_id": pool["id"], "runtime_profile_id": profile["id"], "max_attempts": 1});
    for (k, v) in binding.as_object().cloned().unwrap_or_default() {
        b[k] = v;
    }
    stack.api.post("/v1/bindings", b).await.unwrap();
    agent["id"].as_str().unwrap().to_string()
}

/// Host `name` in pool `agents` offering `providers`, with the installed CLIs and `env`; ready.
pub(crate) async fn agent_host(
    stack: &Stack,
    name: &str,
    state: &std::path::Path,
    providers: &str,
    env: &[(&str, &str)],
) -> kit::Proc {
    let mut all = provider_env();
    all.push(("AGENTSCOPE_PROVIDERS".to_string(), providers.to_string()));
    all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let extra: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let host = stack.spawn_host(name, "agents", 1, state, &extra).unwrap();
    stack.wait_host_ready(name).await.unwrap();
    host
}

/// A host "h" (state in `hs`) offering `providers`, whose OpenAI-compatible CLIs (Codex,
/// opencode) reach the model server at `url`.
pub(crate) async fn openai_host(stack: &Stack, providers: &str, url: &str) -> kit::Proc {
    let base = format!("{url}/v1");
    agent_host(
        stack,
        "h",
        &stack.dir.path.join("hs"),
        providers,
        &[
            ("OPENAI_BASE_URL", &base),
            ("OPENAI_API_KEY", "sk-modelsim"),
        ],
    )
    .await
}

/// Waits until the attempt's long tool call (`tail -f /dev/null`) is running.
async fn wait_for_blocking_tool(attempt_id: &str) {
    let a = attempt_id.to_string();
    kit::wait_for("the long tool call to run", Duration::from_secs(90), || {
        let a = a.clone();
        async move {
            processes_of_attempt(&a)
                .iter()
                .any(|pid| {
                    std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|c| c.starts_with(b"tail\0-f\0/dev/null"))
                })
                .then_some(())
        }
    })
    .await
    .unwrap();
}

/// The attempt's provider session once it is recorded. The provider announces it before its
/// first tool call, but the record of it may come a recorder batch after the tool started.
async fn recorded_session(stack: &Stack, attempt_id: &str) -> Value {
    let path = format!("/v1/attempts/{attempt_id}");
    kit::wait_for(
        "the provider session to be recorded",
        Duration::from_secs(30),
        || {
            let api = stack.api.clone();
            let path = path.clone();
            async move {
                let v = api.get(&path).await.ok()?["provider_session_id"].clone();
                v.as_str().is_some_and(|s| !s.is_empty()).then_some(v)
            }
        },
    )
    .await
    .unwrap()
}

fn script(provider: &str) -> Value {
    json!({
        "turns": [
            {"say": "Reading the issue.", "tool": "mcp:read_issue", "args": {}, "expect": "Fix the greeting"},
            {"say": "Editing the greeting.", "tool": "shell",
             "args": {"command": "echo 'hello, fixed' > GREETING.txt && cat FEATURE.txt && git status --short"},
             "expect": "GREETING.txt"},
            {"say": "Reporting.", "tool": "mcp:post_comment", "args": {"body": format!("Fixed the greeting with {provider}")}, "expect": "agent:"},
            {"tool": "mcp:upload_artifact", "args": {"name": "summary.md", "content": "# Summary\nThe greeting is fixed.\n"}, "expect": "summary.md"}
        ],
        "final": "Done: the greeting is fixed."
    })
}

/// Runs one Issue through `provider` and checks everything the platform records.
async fn run_provider(provider: &str) -> (Stack, Value, Vec<Value>) {
    let stack = Stack::start(&format!("agent-{provider}"), StackOptions::default())
        .await
        .unwrap();
    let (_sim, url, log) = modelsim(&stack.dir.path, &script(provider)).await;
    let repo = git_fixture(&stack.dir.path).unwrap();
    let pool = stack
        .api
        .post("/v1/pools", json!({"name": "agents"}))
        .await
        .unwrap();
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": provider, "provider": provider}),
        )
        .await
        .unwrap();
    let agent = stack
        .api
        .post("/v1/agents", json!({"name": format!("{provider}-agent"), "provider": provider, "instructions": "Keep changes small."}))
        .await
        .unwrap();
    stack
        .api
        .post("/v1/bindings", json!({"agent_id": agent["id"], "pool_id": pool["id"], "runtime_profile_id": profile["id"], "max_attempts": 1}))
        .await
        .unwrap();
    let mut env: Vec<(String, String)> = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            format!("command,{provider}"),
        ),
        ("ANTHROPIC_BASE_URL".to_string(), url.clone()),
        ("ANTHROPIC_API_KEY".to_string(), "sk-modelsim".to_string()),
        ("OPENAI_BASE_URL".to_string(), format!("{url}/v1")),
        ("OPENAI_API_KEY".to_string(), "sk-modelsim".to_string()),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let state = stack.dir.path.join("host-state");
    let _host = stack
        .spawn_host("agent-host", "agents", 1, &state, &extra)
        .unwrap();
    let host = stack.wait_host_ready("agent-host").await.unwrap();
    let d = host["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == provider)
        .cloned()
        .unwrap();
    assert_eq!(
        (d["installed"].as_bool(), d["logged_in"].as_bool()),
        (Some(true), Some(true)),
        "{d}"
    );

    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": "Fix the greeting", "body": "GREETING.txt must say hello.", "assignee_agent_id": agent["id"],
                   "repository": repo.to_string_lossy(), "branch": "feature"}),
        )
        .await
        .unwrap();
    let task_id = issue["task_id"].as_str().unwrap().to_string();
    let task = match stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(240))
        .await
    {
        Ok(t) => t,
        Err(e) => panic!(
            "{e}\nmodel requests:\n{}\nhost log:\n{}",
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .map(|l| l.chars().take(400).collect::<String>())
                .collect::<Vec<_>>()
                .join("\n"),
            stack.log("host-agent-host")
        ),
    };
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains("\"expectation_failed\"") && !requests.contains("\"tool_missing\""),
        "the script ran as written:\n{requests}"
    );
    assert!(
        requests.contains("Keep changes small."),
        "the agent's instructions, translated for {provider}, reached the model"
    );

    let issue_id = issue["id"].as_str().unwrap();
    let comments = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap();
    let want = format!("Fixed the greeting with {provider}");
    assert!(
        comments["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["body"] == want.as_str()),
        "{comments}"
    );
    let arts = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/artifacts"))
        .await
        .unwrap();
    let art = arts["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "summary.md")
        .cloned()
        .expect("summary.md uploaded");
    let content = stack
        .api
        .artifact_content(art["id"].as_str().unwrap())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(content, "# Summary\nThe greeting is fixed.\n");
    let attempt = task["attempts"][0].clone();
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            attempt["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    (stack, attempt, events)
}

/// The position of the first event after `from` that matches.
fn find(events: &[Value], from: usize, what: &str, pred: impl Fn(&Value) -> bool) -> usize {
    events
        .iter()
        .enumerate()
        .skip(from)
        .find(|(_, e)| pred(e))
        .map(|(i, _)| i)
        .unwrap_or_else(|| {
            panic!(
                "no {what} after event {from}: {}",
                serde_json::to_string_pretty(events).unwrap()
            )
        })
}

fn kind(e: &Value, k: &str) -> bool {
    e["kind"] == k
}

fn tool_named(e: &Value, part: &str) -> bool {
    e["kind"] == "tool_call"
        && e["payload"]["name"]
            .as_str()
            .is_some_and(|n| n.contains(part))
}

/// Session, the four tool steps in order with their results, usage and the result.
fn assert_steps(attempt: &Value, events: &[Value], shell_tool: &str) {
    let s = find(events, 0, "session start", |e| kind(e, "session_started"));
    let session = events[s]["payload"]["provider_session_id"]
        .as_str()
        .unwrap();
    assert!(!session.is_empty());
    assert_eq!(
        attempt["provider_session_id"], session,
        "the session id is recorded on the attempt"
    );
    let read = find(events, s, "read_issue call", |e| {
        tool_named(e, "read_issue")
    });
    let read_res = find(events, read, "read_issue result", |e| {
        kind(e, "tool_result")
            && e["payload"]["output"]
                .as_str()
                .is_some_and(|o| o.contains("Fix the greeting"))
    });
    let shell = find(events, read_res, "shell call", |e| {
        tool_named(e, shell_tool)
    });
    let shell_res = find(events, shell, "shell result", |e| {
        kind(e, "tool_result")
            && e["payload"]["output"]
                .as_str()
                .is_some_and(|o| o.contains("GREETING.txt") && o.contains("feature-branch-marker"))
    });
    let comment = find(events, shell_res, "post_comment call", |e| {
        tool_named(e, "post_comment")
    });
    let upload = find(events, comment, "upload_artifact call", |e| {
        tool_named(e, "upload_artifact")
    });
    let usage = find(events, upload, "usage", |e| {
        kind(e, "usage") && e["payload"]["input_tokens"].as_u64().unwrap_or(0) > 0
    });
    let result = find(events, usage.min(upload), "result", |e| {
        kind(e, "result") && e["payload"]["is_error"] == false
    });
    assert!(result > upload);
    assert_eq!(events.last().unwrap()["payload"]["state"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_works_an_issue_through_the_platform_tools() {
    let (_stack, attempt, events) = run_provider("claude-code").await;
    assert_steps(&attempt, &events, "Bash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_works_an_issue_through_the_platform_tools() {
    let (_stack, attempt, events) = run_provider("codex").await;
    assert_steps(&attempt, &events, "shell");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_works_an_issue_through_the_platform_tools() {
    let (_stack, attempt, events) = run_provider("opencode").await;
    assert_steps(&attempt, &events, "bash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openclaw_works_an_issue_and_says_it_has_no_stream_and_no_resume() {
    let (stack, attempt, events) = run_provider("openclaw").await;
    let codes: Vec<&str> = events
        .iter()
        .filter(|e| kind(e, "diagnostic"))
        .filter_map(|e| e["payload"]["code"].as_str())
        .collect();
    assert!(
        codes.contains(&"no_live_stream") && codes.contains(&"no_resume"),
        "{codes:?}"
    );
    let s = find(&events, 0, "session start", |e| kind(e, "session_started"));
    assert_eq!(
        attempt["provider_session_id"],
        events[s]["payload"]["provider_session_id"]
    );
    find(&events, s, "usage", |e| kind(e, "usage"));
    find(&events, s, "result", |e| {
        kind(e, "result") && e["payload"]["is_error"] == false
    });
    let hosts = stack.api.get("/v1/hosts").await.unwrap();
    let d = hosts["items"][0]["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "openclaw")
        .cloned()
        .unwrap();
    assert_eq!(
        (d["live_stream"].as_bool(), d["resume"].as_bool()),
        (Some(false), Some(false)),
        "{d}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_missing_or_without_credentials_gets_no_work() {
    let stack = Stack::start("discovery", StackOptions::default())
        .await
        .unwrap();
    let env = provider_env();
    let codex_bin = env
        .iter()
        .find(|(k, _)| k == "AGENTSCOPE_CODEX_BIN")
        .map(|(_, v)| v.clone())
        .unwrap();
    let state = stack.dir.path.join("host-state");
    let _host = stack
        .spawn_host(
            "picky",
            "pool",
            2,
            &state,
            &[
                ("AGENTSCOPE_PROVIDERS", "command,claude-code,codex"),
                ("AGENTSCOPE_CLAUDE_BIN", "/nonexistent/claude"),
                ("AGENTSCOPE_CODEX_BIN", &codex_bin),
                ("OPENAI_API_KEY", ""),
            ],
        )
        .unwrap();
    let (command_agent, pool_id) = stack
        .command_agent("sentinel", "pool", &["echo", "ok"], None)
        .await
        .unwrap();
    let host = stack.wait_host_ready("picky").await.unwrap();
    let providers = host["providers"].as_array().unwrap();
    let by = |n: &str| providers.iter().find(|p| p["name"] == n).cloned().unwrap();
    assert_eq!(by("claude-code")["installed"], false);
    assert!(
        by("claude-code")["detail"]
            .as_str()
            .unwrap()
            .contains("not found")
    );
    assert_eq!(
        (
            by("codex")["installed"].as_bool(),
            by("codex")["logged_in"].as_bool()
        ),
        (Some(true), Some(false))
    );
    assert!(
        by("codex")["detail"]
            .as_str()
            .unwrap()
            .contains("OPENAI_API_KEY")
    );
    let discovery = &host["checks"]["provider_discovery"];
    let detail = discovery["detail"].as_str().unwrap();
    assert!(
        detail.contains("claude-code") && detail.contains("codex"),
        "{discovery}"
    );
    let readiness = host["checks"]["dispatch_readiness"]["detail"]
        .as_str()
        .unwrap();
    assert!(
        readiness.contains("command") && !readiness.contains("codex"),
        "{readiness}"
    );

    // Work for the missing and the unauthenticated provider is never offered to this host; the
    // host keeps claiming work it can run (submitted after, so it would be claimed later).
    let mut stuck = Vec::new();
    for provider in ["claude-code", "codex"] {
        let agent = stack
            .api
            .post(
                "/v1/agents",
                json!({"name": format!("{provider}-a"), "provider": provider}),
            )
            .await
            .unwrap();
        let profile = stack
            .api
            .post(
                "/v1/runtime-profiles",
                json!({"name": format!("{provider}-p"), "provider": provider}),
            )
            .await
            .unwrap();
        stack
            .api
            .post("/v1/bindings", json!({"agent_id": agent["id"], "pool_id": pool_id, "runtime_profile_id": profile["id"]}))
            .await
            .unwrap();
        stuck.push(
            stack
                .submit(json!({"agent_id": agent["id"]}))
                .await
                .unwrap(),
        );
    }
    let sentinel = stack
        .submit(json!({"agent_id": command_agent}))
        .await
        .unwrap();
    stack
        .wait_task(&sentinel, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    for id in stuck {
        let t = stack.task(&id).await.unwrap();
        assert_eq!(t["attempts"][0]["status"], "queued", "{t:#}");
        assert!(t["attempts"][0]["host_id"].is_null());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_runtime_parameter_fails_early_and_names_the_field() {
    let stack = Stack::start("badparam", StackOptions::default())
        .await
        .unwrap();
    let agent = provider_agent(
        &stack,
        "a",
        "claude-code",
        json!({"permission_mode": "yolo"}),
        json!({}),
    )
    .await;
    let mut env = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            "claude-code".to_string(),
        ),
        ("ANTHROPIC_API_KEY".to_string(), "sk-unused".to_string()),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _host = stack
        .spawn_host("h", "agents", 1, &stack.dir.path.join("hs"), &extra)
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let t = stack
        .wait_task(&task_id, "failed", Duration::from_secs(60))
        .await
        .unwrap();
    let a = &t["attempts"][0];
    assert_eq!(a["failure_class"], "bad_parameters");
    assert!(
        a["failure_detail"]
            .as_str()
            .unwrap()
            .contains("permission_mode"),
        "{a}"
    );
    assert!(a["remedy"].as_str().is_some_and(|r| !r.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_provider_output_is_recorded_and_never_crashes_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let stack = Stack::start("hostile", StackOptions::default())
        .await
        .unwrap();
    // A CLI posing as Claude Code: a 5 MB line, invalid UTF-8, an unknown event type, a cut-off
    // JSON object, then a proper result.
    let fake = stack.shared.join("claude");
    let script = r#"#!/bin/sh
printf '{"type":"system","subtype":"init","session_id":"sess-hostile","model":"m"}\n'
head -c 5000000 /dev/zero | tr '\0' 'x'; echo
printf '\377\376 not utf-8\n'
printf '{"type":"mystery","payload":[1,2,3]}\n'
printf '{"type":"assistant","message":{"content":[{"type":"text"\n'
printf '{"type":"result","subtype":"success","is_error":false,"result":"ok","num_turns":1,"usage":{"input_tokens":1,"output_tokens":1},"total_cost_usd":0}\n'
"#;
    std::fs::write(&fake, script).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent = provider_agent(&stack, "a", "claude-code", json!({}), json!({})).await;
    let fake_s = fake.to_string_lossy().into_owned();
    let _host = stack
        .spawn_host(
            "h",
            "agents",
            1,
            &stack.dir.path.join("hs"),
            &[
                ("AGENTSCOPE_PROVIDERS", "claude-code"),
                ("AGENTSCOPE_CLAUDE_BIN", &fake_s),
                ("ANTHROPIC_API_KEY", "x"),
            ],
        )
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();
    // Twice: the host survives the first run and takes the next one.
    for round in 0..2 {
        let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
        let t = stack
            .wait_task(&task_id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
        let events = stack
            .events(&format!(
                "/v1/attempts/{}/events",
                t["attempts"][0]["id"].as_str().unwrap()
            ))
            .await
            .unwrap();
        let raws: Vec<&Value> = events.iter().filter(|e| e["kind"] == "raw").collect();
        let has = |f: &dyn Fn(&str) -> bool| {
            raws.iter()
                .any(|e| e["payload"]["line"].as_str().is_some_and(f))
        };
        assert!(
            has(&|l| l.contains("mystery")),
            "round {round}: unknown types are kept raw: {raws:?}"
        );
        assert!(
            has(&|l| l.contains("not utf-8") && l.contains('\u{fffd}')),
            "invalid UTF-8 is kept, replaced"
        );
        assert!(
            has(&|l| l.contains(r#"{"type":"text""#)),
            "a cut-off object is kept raw"
        );
        assert!(
            has(&|l| l.starts_with("xxxx")),
            "the huge line is kept, shortened"
        );
        assert!(events.iter().any(|e| e["kind"] == "session_started"
            && e["payload"]["provider_session_id"] == "sess-hostile"));
        assert!(events.iter().any(|e| e["kind"] == "result"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_claude_code_during_a_long_tool_call_leaves_no_process() {
    let stack = Stack::start("claude-cancel", StackOptions::default())
        .await
        .unwrap();
    let script = json!({"turns": [{"tool": "shell", "args": {"command": "tail -f /dev/null"}}], "final": "done"});
    let (_sim, url, _log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(&stack, "a", "claude-code", json!({}), json!({})).await;
    let _host = agent_host(
        &stack,
        "h",
        &stack.dir.path.join("hs"),
        "claude-code",
        &[
            ("ANTHROPIC_BASE_URL", &url),
            ("ANTHROPIC_API_KEY", "sk-modelsim"),
        ],
    )
    .await;
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let attempt = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(60))
        .await
        .unwrap();
    let attempt_id = attempt["id"].as_str().unwrap().to_string();
    wait_for_blocking_tool(&attempt_id).await;
    stack
        .cancel_task(&task_id, Duration::from_secs(60))
        .await
        .unwrap();
    let left = processes_of_attempt(&attempt_id);
    assert!(
        left.is_empty(),
        "no process of the provider's tree remains: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_login_failure_falls_back_to_codex_with_a_context_pack() {
    let stack = Stack::start("fallback", StackOptions::default())
        .await
        .unwrap();
    let script = json!({"turns": [], "final": "Done from the context pack."});
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    // Earlier work on the Issue: an Artifact and a comment by an executor, a comment by a person.
    let (helper, _) = stack
        .command_agent(
            "helper",
            "agents",
            &["sh", "-c", "printf 'design notes: use the blue button\\n' > notes.md && agentscope task upload notes.md >/dev/null && agentscope task comment 'prior work done' >/dev/null"],
            None,
        )
        .await
        .unwrap();
    let agent = provider_agent(
        &stack,
        "coder",
        "claude-code",
        json!({}),
        json!({"max_attempts": 2, "fallback_providers": ["codex"]}),
    )
    .await;
    let mut env = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            "command,claude-code,codex".to_string(),
        ),
        ("ANTHROPIC_BASE_URL".to_string(), url.clone()),
        // The model provider refuses this key with a 401, as a real one refuses a bad key.
        ("ANTHROPIC_API_KEY".to_string(), "sk-rejected".to_string()),
        ("OPENAI_BASE_URL".to_string(), format!("{url}/v1")),
        ("OPENAI_API_KEY".to_string(), "sk-modelsim".to_string()),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _host = stack
        .spawn_host("h", "agents", 1, &stack.dir.path.join("hs"), &extra)
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();

    let issue = stack
        .api
        .post("/v1/issues", json!({"title": "Restyle the checkout", "body": "The button looks wrong.", "assignee_agent_id": helper}))
        .await
        .unwrap();
    stack
        .wait_task(
            issue["task_id"].as_str().unwrap(),
            "succeeded",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let issue_id = issue["id"].as_str().unwrap();
    stack
        .api
        .post(
            &format!("/v1/issues/{issue_id}/comments"),
            json!({"body": "Please keep the API stable."}),
        )
        .await
        .unwrap();

    let task_id = stack
        .submit(json!({"agent_id": agent, "issue_id": issue_id}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(180))
        .await
        .unwrap();
    let attempts = t["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{t:#}");
    assert_eq!(
        (
            attempts[0]["provider"].as_str(),
            attempts[0]["status"].as_str(),
            attempts[0]["failure_class"].as_str()
        ),
        (Some("claude-code"), Some("failed"), Some("provider_login")),
        "{t:#}"
    );
    assert_eq!(
        (
            attempts[1]["provider"].as_str(),
            attempts[1]["status"].as_str()
        ),
        (Some("codex"), Some("succeeded"))
    );
    // What Codex was given came from the records: the Issue, both comments, the Artifact's
    // content and the failed attempt's outcome.
    let requests = std::fs::read_to_string(&log).unwrap();
    let codex: Vec<&str> = requests
        .lines()
        .filter(|l| l.contains("/v1/responses"))
        .collect();
    assert!(!codex.is_empty());
    let seen = codex.join("\n");
    for needle in [
        "Context pack",
        "Restyle the checkout",
        "The button looks wrong.",
        "prior work done",
        "Please keep the API stable.",
        "design notes: use the blue button",
        "provider_login",
    ] {
        assert!(seen.contains(needle), "the context pack carries `{needle}`");
    }
}

/// A host SIGKILLed while `provider` is mid-task, restarted with the same identity, resumes
/// the same provider session in the same attempt.
async fn host_restart_resumes(provider: &str, params: Value) {
    let stack = Stack::start(
        "resume",
        StackOptions {
            lease_ttl_ms: 15_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let release = stack.shared.join("release");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo first-step"}, "expect": "first-step"},
            {"tool": "shell", "args": {"command": format!("test -e {} || tail -f /dev/null; echo second-step", release.display())}}
        ],
        "final": "Resumed and done."
    });
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    let asks = params["approvals"] == "ask";
    let agent = provider_agent(&stack, "a", provider, params, json!({})).await;
    let openai = format!("{url}/v1");
    let env = [
        ("ANTHROPIC_BASE_URL", url.as_str()),
        ("ANTHROPIC_API_KEY", "sk-modelsim"),
        ("OPENAI_BASE_URL", openai.as_str()),
        ("OPENAI_API_KEY", "sk-modelsim"),
    ];
    let state = stack.dir.path.join("hs");
    let mut host = agent_host(&stack, "h", &state, provider, &env).await;
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    // With approvals, someone approves every tool request as it comes, before and after the
    // restart.
    let approver = asks.then(|| {
        let api = stack.api.clone();
        let path = format!("/v1/approvals?task_id={task_id}&status=pending");
        tokio::spawn(async move {
            loop {
                let next = kit::wait_for("a pending approval", Duration::from_secs(300), || {
                    let api = api.clone();
                    let path = path.clone();
                    async move {
                        let v = api.get(&path).await.ok()?;
                        v["items"].as_array()?.first()?["id"]
                            .as_str()
                            .map(str::to_string)
                    }
                })
                .await;
                let Ok(id) = next else { return };
                let _ = api
                    .post(&format!("/v1/approvals/{id}/approve"), json!({}))
                    .await;
            }
        })
    });
    let attempt = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(60))
        .await
        .unwrap();
    let attempt_id = attempt["id"].as_str().unwrap().to_string();
    wait_for_blocking_tool(&attempt_id).await;
    let session = recorded_session(&stack, &attempt_id).await;

    // Crash the host mid-task; the provider is orphaned. Restart it with the same identity.
    std::fs::write(&release, "go").unwrap();
    host.kill9_leader();
    let _host = agent_host(&stack, "h", &state, provider, &env).await;
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(120))
        .await
        .unwrap();
    if let Some(a) = approver {
        a.abort();
    }
    let attempts = t["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "resumed in the same attempt: {t:#}");
    assert_eq!(
        attempts[0]["provider_session_id"], session,
        "the same provider session"
    );
    let events = stack
        .events(&format!("/v1/attempts/{attempt_id}/events"))
        .await
        .unwrap();
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "no duplicated or missing events"
    );
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "diagnostic" && e["payload"]["code"] == "resuming"),
        "the resume is in the record"
    );
    let first_results = events
        .iter()
        .filter(|e| {
            e["kind"] == "tool_result"
                && e["payload"]["output"]
                    .as_str()
                    .is_some_and(|o| o.contains("first-step"))
        })
        .count();
    assert_eq!(
        first_results, 1,
        "the completed first step was not run again"
    );
    assert!(
        processes_of_attempt(&attempt_id).is_empty(),
        "the orphaned provider is gone"
    );
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests
            .lines()
            .filter(|l| l.contains("first-step"))
            .count()
            >= 2,
        "the resumed session carried its history"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_mid_task_resumes_the_claude_session_after_restart() {
    host_restart_resumes("claude-code", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_mid_task_resumes_the_codex_thread_after_restart() {
    host_restart_resumes("codex", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_mid_task_resumes_approval_driven_sessions_after_restart() {
    // Claude's stream-json control protocol, then Codex's app-server and opencode's ACP.
    for provider in ["claude-code", "codex", "opencode"] {
        host_restart_resumes(provider, json!({"approvals": "ask"})).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_mid_task_resumes_the_opencode_session_after_restart() {
    host_restart_resumes("opencode", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_never_returns_loses_its_lease_and_claude_succeeds_elsewhere() {
    let stack = Stack::start(
        "claude-failover",
        StackOptions {
            lease_ttl_ms: 6_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let release = stack.shared.join("release");
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": format!("test -e {} || tail -f /dev/null; echo done-here", release.display())}, "expect": "done-here"}],
        "final": "Done."
    });
    let (_sim, url, _log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(
        &stack,
        "a",
        "claude-code",
        json!({}),
        json!({"max_attempts": 2, "retry_backoff_ms": 100}),
    )
    .await;
    let env = [
        ("ANTHROPIC_BASE_URL", url.as_str()),
        ("ANTHROPIC_API_KEY", "sk-modelsim"),
    ];
    let mut host_a = agent_host(&stack, "a", &stack.dir.path.join("ha"), "claude-code", &env).await;
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let first = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(60))
        .await
        .unwrap();
    let first_id = first["id"].as_str().unwrap().to_string();
    wait_for_blocking_tool(&first_id).await;
    std::fs::write(&release, "go").unwrap();
    host_a.kill9_leader();
    let _host_b = agent_host(&stack, "b", &stack.dir.path.join("hb"), "claude-code", &env).await;
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(120))
        .await
        .unwrap();
    let attempts = t["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{t:#}");
    assert_eq!(
        (
            attempts[0]["status"].as_str(),
            attempts[0]["failure_class"].as_str()
        ),
        (Some("lost"), Some("host_offline"))
    );
    assert_ne!(attempts[0]["host_id"], attempts[1]["host_id"]);
    assert_ne!(
        attempts[1]["provider_session_id"], attempts[0]["provider_session_id"],
        "another host starts a fresh session"
    );
    // Host A's orphaned provider is not the platform's to reap any more; end it for tidiness.
    for pid in processes_of_attempt(&first_id) {
        // SAFETY: plain signal to a test-owned process.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// A retry on the same host: with `break_session`, the session file is emptied first so the
/// provider rejects the resume and the attempt falls back to a fresh session, once.
async fn retry_on_the_same_host(break_session: bool) {
    let stack = Stack::start("retry-session", StackOptions::default())
        .await
        .unwrap();
    let release = stack.shared.join("release");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo first-step"}, "expect": "first-step"},
            {"tool": "shell", "args": {"command": format!("test -e {} || tail -f /dev/null; echo second-step", release.display())}}
        ],
        "final": "Done."
    });
    let (_sim, url, _log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(
        &stack,
        "a",
        "claude-code",
        json!({}),
        json!({"max_attempts": 2, "retry_backoff_ms": 100}),
    )
    .await;
    let env = [
        ("ANTHROPIC_BASE_URL", url.as_str()),
        ("ANTHROPIC_API_KEY", "sk-modelsim"),
    ];
    let state = stack.dir.path.join("hs");
    let mut host = agent_host(&stack, "h", &state, "claude-code", &env).await;
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let first = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(60))
        .await
        .unwrap();
    let first_id = first["id"].as_str().unwrap().to_string();
    wait_for_blocking_tool(&first_id).await;
    let session = recorded_session(&stack, &first_id).await;
    let session = session.as_str().unwrap().to_string();
    std::fs::write(&release, "go").unwrap();
    host.kill9_leader();
    for pid in processes_of_attempt(&first_id) {
        // SAFETY: plain signal to a test-owned process.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    // The host stays away past its lease: the attempt is lost and a retry is queued.
    stack
        .wait_attempt(&task_id, 1, "lost", Duration::from_secs(30))
        .await
        .unwrap();
    if break_session {
        let projects = state
            .join("tasks")
            .join(&first_id)
            .join("home/.claude/projects");
        for dir in std::fs::read_dir(&projects).unwrap() {
            let f = dir.unwrap().path().join(format!("{session}.jsonl"));
            if f.exists() {
                std::fs::write(&f, "").unwrap();
            }
        }
    }
    let _host = agent_host(&stack, "h", &state, "claude-code", &env).await;
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(120))
        .await
        .unwrap();
    let second = &t["attempts"][1];
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            second["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    let codes: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "diagnostic")
        .filter_map(|e| e["payload"]["code"].as_str())
        .collect();
    if break_session {
        assert!(
            codes.contains(&"reusing_session") && codes.contains(&"resume_rejected"),
            "{codes:?}"
        );
        assert_ne!(
            second["provider_session_id"],
            session.as_str(),
            "a fresh session after the rejected resume"
        );
    } else {
        assert!(
            codes.contains(&"reusing_session") && !codes.contains(&"resume_rejected"),
            "{codes:?}"
        );
        assert_eq!(
            second["provider_session_id"],
            session.as_str(),
            "the retry continued the same session"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_the_same_host_continues_the_provider_session() {
    retry_on_the_same_host(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_resume_falls_back_to_a_fresh_session_once() {
    retry_on_the_same_host(true).await;
}
