//! `GET /v1/tasks/{id}/explain` and `agentscope explain`: a waiting task names, for every host,
//! the exact predicate that keeps it from claiming (scope, pool, connectivity, provider,
//! capability, capacity) and its task-level blockers (binding, backoff); a failed task names its
//! failure class, the remedy and the evidence.

use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The codex CLI: AGENTSCOPE_CODEX_BIN, or the one scripts/install-providers.sh installed.
fn codex_bin() -> String {
    if let Ok(b) = std::env::var("AGENTSCOPE_CODEX_BIN") {
        return b;
    }
    let dir = std::env::var("AGENTSCOPE_PROVIDERS_DIR")
        .unwrap_or_else(|_| "/opt/agentscope/providers".to_string());
    let env = std::fs::read_to_string(format!("{dir}/env")).unwrap_or_else(|_| {
        panic!("provider CLIs are not installed: run scripts/install-providers.sh (no {dir}/env)")
    });
    env.lines()
        .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
        .find(|(k, _)| *k == "AGENTSCOPE_CODEX_BIN")
        .map(|(_, v)| v.trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("{dir}/env names no AGENTSCOPE_CODEX_BIN"))
}

/// Polls the explanation of `task` until `cond` holds; on timeout, panics with the last one.
async fn explain_until(api: &Api, task: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let last = Arc::new(Mutex::new(Value::Null));
    let path = format!("/v1/tasks/{task}/explain");
    let cond = &cond;
    let got = kit::wait_for(what, Duration::from_secs(45), || {
        let api = api.clone();
        let path = path.clone();
        let last = last.clone();
        async move {
            let v = api.get(&path).await.ok()?;
            *last.lock().unwrap() = v.clone();
            cond(&v).then_some(v)
        }
    })
    .await;
    match got {
        Ok(v) => v,
        Err(e) => panic!("{e}; last explanation: {:#}", last.lock().unwrap()),
    }
}

fn host<'a>(e: &'a Value, name: &str) -> &'a Value {
    e["hosts"]
        .as_array()
        .and_then(|h| h.iter().find(|h| h["name"] == name))
        .unwrap_or_else(|| panic!("host {name} not in the explanation: {e:#}"))
}

/// The predicates failing for host `name`, in order.
fn failing(e: &Value, name: &str) -> Vec<String> {
    host(e, name)["failing"]
        .as_array()
        .map(|f| {
            f.iter()
                .filter_map(|p| p["predicate"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn detail<'a>(e: &'a Value, name: &str, predicate: &str) -> &'a str {
    host(e, name)["failing"]
        .as_array()
        .and_then(|f| f.iter().find(|p| p["predicate"] == predicate))
        .and_then(|p| p["detail"].as_str())
        .unwrap_or_else(|| panic!("host {name} does not fail {predicate}: {e:#}"))
}

fn reasons(e: &Value) -> Vec<String> {
    e["reasons"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|p| p["predicate"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Waiting with an attempt the scheduler created.
fn queued(e: &Value) -> bool {
    e["waiting"] == true && e["attempt"]["status"] == "queued"
}

async fn submit(stack: &Stack, agent: &Value) -> String {
    stack.submit(json!({"agent_id": agent})).await.unwrap()
}

fn cli(stack: &Stack, args: &[&str]) -> String {
    let out = std::process::Command::new(kit::bin("agentscope").unwrap())
        .args(["--api", &stack.api.base, "--token", &stack.api.token])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "agentscope {args:?} failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_out_of_reach_name_scope_pool_capability_and_binding() {
    let stack = Stack::start("explain-reach", StackOptions::default())
        .await
        .unwrap();
    // The task's agent is bound to `alpha`, where no host runs.
    let (alpha_agent, _) = stack
        .command_agent("alpha-agent", "alpha", &["echo", "hi"], None)
        .await
        .unwrap();
    let beta = stack
        .api
        .post("/v1/pools", json!({"name": "beta"}))
        .await
        .unwrap();
    let (_beta_host, _) = stack.host("beta-host", "beta", 1).await.unwrap();
    // A host whose pool name exists nowhere in the workspace: it registers but never dispatches.
    let ghost_state = stack.dir.path.join("ghost-state");
    let _ghost = stack
        .spawn_host("ghost-host", "ghost", 1, &ghost_state, &[])
        .unwrap();
    let api = stack.api.clone();
    kit::wait_for("ghost-host online", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let hosts = api.get("/v1/hosts").await.ok()?;
            hosts["items"]
                .as_array()?
                .iter()
                .any(|h| h["name"] == "ghost-host" && h["online"] == true)
                .then_some(())
        }
    })
    .await
    .unwrap();

    // 1 and 2: wrong scope and wrong pool.
    let alpha_task = submit(&stack, &json!(alpha_agent)).await;
    let e = explain_until(&stack.api, &alpha_task, "alpha task explained", |e| {
        queued(e) && failing(e, "beta-host") == ["pool"] && failing(e, "ghost-host")[0] == "scope"
    })
    .await;
    assert_eq!(e["task_id"], alpha_task.as_str());
    assert_eq!(e["status"], "queued");
    assert_eq!(e["hosts"].as_array().unwrap().len(), 2, "{e:#}");
    assert!(reasons(&e).is_empty(), "the task itself is fine: {e:#}");
    assert_eq!(e["eligible_hosts"], 0);
    assert_eq!(host(&e, "beta-host")["eligible"], false);
    let scope = detail(&e, "ghost-host", "scope");
    assert!(
        scope.contains("`ghost`") && scope.contains("does not exist in this workspace"),
        "{scope}"
    );
    let pool = detail(&e, "beta-host", "pool");
    assert!(pool.contains("beta") && pool.contains("alpha"), "{pool}");

    // 3: an agent without a binding.
    let unbound = stack
        .api
        .post(
            "/v1/agents",
            json!({"name": "unbound", "provider": "command"}),
        )
        .await
        .unwrap();
    let unbound_task = submit(&stack, &unbound["id"]).await;
    let e = explain_until(&stack.api, &unbound_task, "unbound task explained", queued).await;
    assert_eq!(reasons(&e), ["binding"], "{e:#}");
    let binding = e["reasons"][0]["detail"].as_str().unwrap();
    assert!(
        binding.contains("unbound") && binding.contains("no binding"),
        "{binding}"
    );
    assert!(host(&e, "beta-host")["eligible"] == false, "{e:#}");

    // 5: a capability the only host of the pool lacks.
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": "gpu-profile", "provider": "command", "params": {"command": ["echo", "gpu"]}}),
        )
        .await
        .unwrap();
    let gpu_agent = stack
        .api
        .post(
            "/v1/agents",
            json!({"name": "gpu-agent", "provider": "command"}),
        )
        .await
        .unwrap();
    stack
        .api
        .post(
            "/v1/bindings",
            json!({"agent_id": gpu_agent["id"], "pool_id": beta["id"], "runtime_profile_id": profile["id"],
                   "required_capabilities": ["gpu"]}),
        )
        .await
        .unwrap();
    let gpu_task = submit(&stack, &gpu_agent["id"]).await;
    let e = explain_until(&stack.api, &gpu_task, "gpu task explained", |e| {
        queued(e) && failing(e, "beta-host") == ["capability"]
    })
    .await;
    assert!(
        detail(&e, "beta-host", "capability").contains("gpu"),
        "{e:#}"
    );
    assert_eq!(e["target"]["required_capabilities"], json!(["gpu"]));
    assert!(failing(&e, "ghost-host").contains(&"capability".to_string()));

    // The CLI prints each host's failing predicate.
    let out = cli(&stack, &["explain", &alpha_task]);
    assert!(
        out.contains("ghost-host") && out.contains("scope") && out.contains("does not exist"),
        "{out}"
    );
    assert!(out.contains("beta-host") && out.contains("pool"), "{out}");
    let raw: Value = serde_json::from_str(&cli(&stack, &["--json", "explain", &alpha_task]))
        .expect("--json prints the API's JSON");
    assert_eq!(raw["task_id"], alpha_task.as_str());

    // Unknown tasks and tasks of another workspace are not found.
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::GET,
            &format!("/v1/tasks/{}/explain", uuid::Uuid::now_v7()),
            None,
        )
        .await
        .unwrap();
    assert_eq!((st, v["error"]["code"].as_str()), (404, Some("not_found")));
    let other = stack
        .api
        .with_token(ADMIN_TOKEN)
        .post("/v1/workspaces", json!({"name": "explain-other"}))
        .await
        .unwrap();
    let other = stack.api.with_token(other["api_token"].as_str().unwrap());
    let (st, v) = other
        .send(
            reqwest::Method::GET,
            &format!("/v1/tasks/{alpha_task}/explain"),
            None,
        )
        .await
        .unwrap();
    assert_eq!((st, v["error"]["code"].as_str()), (404, Some("not_found")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_provider_is_not_logged_in_names_provider() {
    let stack = Stack::start("explain-provider", StackOptions::default())
        .await
        .unwrap();
    let pool = stack
        .api
        .post("/v1/pools", json!({"name": "pool"}))
        .await
        .unwrap();
    let codex = codex_bin();
    let state = stack.dir.path.join("codex-host-state");
    let _host = stack
        .spawn_host(
            "codex-host",
            "pool",
            1,
            &state,
            &[
                ("AGENTSCOPE_PROVIDERS", "command,codex"),
                ("AGENTSCOPE_CODEX_BIN", &codex),
                ("OPENAI_API_KEY", ""),
            ],
        )
        .unwrap();
    stack.wait_host_ready("codex-host").await.unwrap();
    let agent = stack
        .api
        .post("/v1/agents", json!({"name": "coder", "provider": "codex"}))
        .await
        .unwrap();
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": "codex-profile", "provider": "codex"}),
        )
        .await
        .unwrap();
    stack
        .api
        .post(
            "/v1/bindings",
            json!({"agent_id": agent["id"], "pool_id": pool["id"], "runtime_profile_id": profile["id"]}),
        )
        .await
        .unwrap();
    let task = submit(&stack, &agent["id"]).await;
    let e = explain_until(&stack.api, &task, "codex task explained", |e| {
        queued(e) && failing(e, "codex-host") == ["provider"]
    })
    .await;
    let d = detail(&e, "codex-host", "provider");
    assert!(
        d.contains("codex") && d.contains("not logged in") && d.contains("OPENAI_API_KEY"),
        "{d}"
    );
    assert_eq!(e["target"]["provider"], "codex");
    assert!(reasons(&e).is_empty(), "{e:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_host_names_capacity_and_the_running_task_names_its_host() {
    let stack = Stack::start("explain-capacity", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("sleeper", "pool", &["sh", "-c", "sleep 30"], None)
        .await
        .unwrap();
    let (_host, state) = stack.host("solo", "pool", 1).await.unwrap();
    let solo_id = std::fs::read_to_string(state.join("host_id")).unwrap();
    let busy = submit(&stack, &json!(agent)).await;
    stack
        .wait_attempt(&busy, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let waiting = submit(&stack, &json!(agent)).await;
    let e = explain_until(&stack.api, &waiting, "second task explained", |e| {
        queued(e) && failing(e, "solo") == ["capacity"]
    })
    .await;
    let d = detail(&e, "solo", "capacity");
    assert!(d.contains("capacity 1"), "{d}");
    assert_eq!(host(&e, "solo")["eligible"], false);

    let e = stack
        .api
        .get(&format!("/v1/tasks/{busy}/explain"))
        .await
        .unwrap();
    assert_eq!(e["status"], "running");
    assert_eq!(e["waiting"], false);
    assert_eq!(e["host"]["name"], "solo");
    assert_eq!(e["host"]["host_id"], solo_id.trim());
    assert!(e["failure"].is_null(), "{e:#}");

    // Cancel the queued task first so that it never takes the freed slot.
    for id in [&waiting, &busy] {
        stack
            .api
            .post(&format!("/v1/tasks/{id}/cancel"), json!({}))
            .await
            .unwrap();
        stack
            .wait_task(id, "cancelled", Duration::from_secs(60))
            .await
            .unwrap();
    }
    let e = stack
        .api
        .get(&format!("/v1/tasks/{busy}/explain"))
        .await
        .unwrap();
    assert_eq!(e["status"], "cancelled");
    assert_eq!(e["failure"]["class"], "cancelled", "{e:#}");
    assert!(
        e["failure"]["remedy"]
            .as_str()
            .is_some_and(|r| !r.is_empty())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_in_backoff_shows_the_idle_host_eligible_and_the_dead_one_offline() {
    // The lease outlives the heartbeat: a killed host is known offline when its lease expires.
    let stack = Stack::start(
        "explain-backoff",
        StackOptions {
            lease_ttl_ms: 6_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let pool = stack
        .api
        .post("/v1/pools", json!({"name": "pool"}))
        .await
        .unwrap();
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": "slow", "provider": "command", "params": {"command": ["sh", "-c", "echo started; sleep 60"]}}),
        )
        .await
        .unwrap();
    let agent = stack
        .api
        .post("/v1/agents", json!({"name": "slow", "provider": "command"}))
        .await
        .unwrap();
    // The retry waits for the longest backoff (the scheduler caps it at 60 s).
    stack
        .api
        .post(
            "/v1/bindings",
            json!({"agent_id": agent["id"], "pool_id": pool["id"], "runtime_profile_id": profile["id"],
                   "max_attempts": 3, "retry_backoff_ms": 3_600_000}),
        )
        .await
        .unwrap();
    let (mut doomed, _) = stack.host("doomed", "pool", 1).await.unwrap();
    let task = submit(&stack, &agent["id"]).await;
    let first = stack
        .wait_attempt(&task, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt1 = first["id"].as_str().unwrap().to_string();
    let (_idle, _) = stack.host("idle", "pool", 1).await.unwrap();
    doomed.kill9();
    stack
        .wait_attempt(&task, 1, "lost", Duration::from_secs(30))
        .await
        .unwrap();
    // The host's provider is in a process group of its own; end it for tidiness.
    for pid in processes_of_attempt(&attempt1) {
        // SAFETY: plain signal to a test-owned process.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }

    let e = explain_until(&stack.api, &task, "the retry explained", |e| {
        queued(e)
            && e["attempt"]["number"] == 2
            && failing(e, "doomed") == ["connectivity"]
            && host(e, "idle")["eligible"] == true
    })
    .await;
    assert_eq!(reasons(&e), ["backoff"], "{e:#}");
    assert!(failing(&e, "idle").is_empty());
    assert_eq!(e["eligible_hosts"], 1);
    assert!(
        detail(&e, "doomed", "connectivity").contains("no heartbeat"),
        "{e:#}"
    );
    let attempts = e["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["failure_class"], "host_offline", "{e:#}");

    stack
        .api
        .post(&format!("/v1/tasks/{task}/cancel"), json!({}))
        .await
        .unwrap();
    stack
        .wait_task(&task, "cancelled", Duration::from_secs(30))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_shows_its_class_evidence_and_remedy() {
    let stack = Stack::start("explain-failed", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("boomer", "pool", &["sh", "-c", "echo boom; exit 3"], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task = submit(&stack, &json!(agent)).await;
    stack
        .wait_task(&task, "failed", Duration::from_secs(60))
        .await
        .unwrap();
    let e = stack
        .api
        .get(&format!("/v1/tasks/{task}/explain"))
        .await
        .unwrap();
    assert_eq!(e["status"], "failed");
    assert_eq!(e["waiting"], false);
    let f = &e["failure"];
    assert_eq!(f["class"], "exit_nonzero", "{e:#}");
    assert!(f["remedy"].as_str().is_some_and(|r| !r.is_empty()), "{e:#}");
    assert_eq!(f["exit_code"], 3, "{e:#}");
    let evidence = f["evidence"].as_array().unwrap();
    assert!(!evidence.is_empty() && evidence.len() <= 10, "{e:#}");
    assert!(
        evidence.iter().any(|ev| ev["kind"] == "output"
            && ev["payload"]["text"]
                .as_str()
                .is_some_and(|t| t.contains("boom"))),
        "{e:#}"
    );
    assert!(evidence.iter().all(|ev| ev["seq"].as_i64().is_some()));
    assert_eq!(e["attempts"][0]["failure_class"], "exit_nonzero");

    let out = cli(&stack, &["explain", &task]);
    assert!(
        out.contains("exit_nonzero") && out.contains("boom"),
        "{out}"
    );
}
