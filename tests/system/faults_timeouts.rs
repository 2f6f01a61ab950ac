//! Timeouts and failure classes (issue 10): a runtime profile's `timeout_secs` applies and the
//! detail names the limit; `explain` shows the effective timeout and its source; Claude Code
//! against a closed port ends `model_unreachable` with the endpoint, long before any timeout; a
//! provider whose login failed leaves the host's readiness until a re-check brings it back.

use crate::agents::{modelsim, provider_agent, provider_env};
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn newest_attempt(t: &Value) -> Value {
    t["attempts"].as_array().unwrap().last().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_timeout_ends_the_attempt_and_explain_names_the_limit() {
    let stack = Stack::start("profile_timeout", StackOptions::default())
        .await
        .unwrap();
    // Creates pool `work` too.
    let (quick, pool_id) = stack
        .command_agent("quick", "work", &["true"], None)
        .await
        .unwrap();
    let _host = stack.host("h", "work", 2).await.unwrap();
    let profile = stack
        .api
        .post(
            "/v1/runtime-profiles",
            json!({"name": "slow", "provider": "command",
                   "params": {"command": ["sh", "-c", "sleep 30"], "timeout_secs": "2"}}),
        )
        .await
        .unwrap();
    let agent = stack
        .api
        .post(
            "/v1/agents",
            json!({"name": "sleeper", "provider": "command"}),
        )
        .await
        .unwrap();
    stack
        .api
        .post(
            "/v1/bindings",
            json!({"agent_id": agent["id"], "pool_id": pool_id,
                   "runtime_profile_id": profile["id"], "max_attempts": 1}),
        )
        .await
        .unwrap();

    let started = Instant::now();
    let id = stack
        .submit(json!({"agent_id": agent["id"], "input": "x"}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&id, "failed", Duration::from_secs(25))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the profile's 2 s limit ended the 30 s command: {:?}",
        started.elapsed()
    );
    let a = newest_attempt(&t);
    assert_eq!(a["failure_class"], "timeout", "{t:#}");
    let detail = a["failure_detail"].as_str().unwrap();
    assert!(
        detail.contains("timed out after 2 s") && detail.contains("runtime profile's timeout_secs"),
        "the detail names the profile's limit: {detail}"
    );

    let e = stack
        .api
        .get(&format!("/v1/tasks/{id}/explain"))
        .await
        .unwrap();
    assert_eq!(
        (
            e["timeout"]["secs"].as_i64(),
            e["timeout"]["source"].as_str()
        ),
        (Some(2), Some("profile")),
        "{e:#}"
    );
    assert!(
        e["failure"]["remedy"]
            .as_str()
            .unwrap()
            .contains("timeout_secs"),
        "{e:#}"
    );

    // The task's own timeout wins over the profile's.
    let id = stack
        .submit(json!({"agent_id": agent["id"], "input": "x", "timeout_secs": 1}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&id, "failed", Duration::from_secs(25))
        .await
        .unwrap();
    let detail = newest_attempt(&t)["failure_detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        detail.contains("timed out after 1 s") && detail.contains("task's timeout_secs"),
        "{detail}"
    );
    let e = stack
        .api
        .get(&format!("/v1/tasks/{id}/explain"))
        .await
        .unwrap();
    assert_eq!(
        (
            e["timeout"]["secs"].as_i64(),
            e["timeout"]["source"].as_str()
        ),
        (Some(1), Some("task")),
        "{e:#}"
    );

    // Neither sets one: the deployment default, a few hours (not a day).
    let id = stack
        .submit(json!({"agent_id": quick, "input": "x"}))
        .await
        .unwrap();
    stack
        .wait_task(&id, "succeeded", Duration::from_secs(25))
        .await
        .unwrap();
    let e = stack
        .api
        .get(&format!("/v1/tasks/{id}/explain"))
        .await
        .unwrap();
    assert_eq!(
        (
            e["timeout"]["secs"].as_i64(),
            e["timeout"]["source"].as_str()
        ),
        (Some(4 * 3600), Some("default")),
        "{e:#}"
    );
    assert!(
        e["timeout"]["detail"]
            .as_str()
            .unwrap()
            .contains("AGENTSCOPE_RUN_TIMEOUT_SECS"),
        "{e:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_against_a_closed_port_ends_model_unreachable() {
    let stack = Stack::start("model_unreachable", StackOptions::default())
        .await
        .unwrap();
    // A port nothing listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = format!("http://127.0.0.1:{closed}");
    let agent = provider_agent(&stack, "coder", "claude-code", json!({}), json!({})).await;
    let mut env = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            "command,claude-code".to_string(),
        ),
        ("ANTHROPIC_BASE_URL".to_string(), endpoint.clone()),
        ("ANTHROPIC_API_KEY".to_string(), "sk-modelsim".to_string()),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _host = stack
        .spawn_host("h", "agents", 1, &stack.dir.path.join("hs"), &extra)
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();

    let started = Instant::now();
    let id = stack
        .submit(json!({"agent_id": agent, "input": "Say hello.", "timeout_secs": 600}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&id, "failed", Duration::from_secs(90))
        .await
        .unwrap();
    let a = newest_attempt(&t);
    assert_eq!(a["failure_class"], "model_unreachable", "{t:#}");
    let detail = a["failure_detail"].as_str().unwrap();
    assert!(
        detail.contains(&endpoint),
        "the endpoint is the evidence: {detail}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(90),
        "ended well before the 600 s timeout"
    );
    let e = stack
        .api
        .get(&format!("/v1/tasks/{id}/explain"))
        .await
        .unwrap();
    assert_eq!(e["failure"]["class"], "model_unreachable", "{e:#}");
    assert!(
        e["failure"]["remedy"]
            .as_str()
            .unwrap()
            .contains("ANTHROPIC_BASE_URL"),
        "{e:#}"
    );
}

/// The host's descriptor of `provider`, as the API lists it.
async fn descriptor(stack: &Stack, host: &str, provider: &str) -> Option<Value> {
    let hosts = stack.api.get("/v1/hosts").await.ok()?;
    let h = hosts["items"]
        .as_array()?
        .iter()
        .find(|h| h["name"] == host)?
        .clone();
    let p = h["providers"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == provider)?
        .clone();
    Some(json!({"provider": p, "dispatch": h["checks"]["dispatch_readiness"]}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_login_failure_takes_the_provider_out_until_a_recheck() {
    let stack = Stack::start("login_recheck", StackOptions::default())
        .await
        .unwrap();
    let (_sim, url, _log) = modelsim(&stack.dir.path, &json!({"turns": [], "final": "hi"})).await;
    let agent = provider_agent(&stack, "coder", "claude-code", json!({}), json!({})).await;
    let mut env = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            "command,claude-code".to_string(),
        ),
        ("ANTHROPIC_BASE_URL".to_string(), url.clone()),
        // The model server refuses this key with a 401.
        ("ANTHROPIC_API_KEY".to_string(), "sk-rejected".to_string()),
        (
            "AGENTSCOPE_PROVIDER_RECHECK_MS".to_string(),
            "4000".to_string(),
        ),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _host = stack
        .spawn_host("h", "agents", 1, &stack.dir.path.join("hs"), &extra)
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();

    let id = stack
        .submit(json!({"agent_id": agent, "input": "Say hello."}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&id, "failed", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        newest_attempt(&t)["failure_class"],
        "provider_login",
        "{t:#}"
    );

    // Out of the host's readiness: its descriptor says not logged in, and dispatch readiness
    // no longer offers it.
    let down = kit::wait_for(
        "claude-code not ready on h",
        Duration::from_secs(10),
        || async {
            let d = descriptor(&stack, "h", "claude-code").await?;
            (d["provider"]["logged_in"] == false).then_some(d)
        },
    )
    .await
    .unwrap();
    assert!(
        down["provider"]["detail"]
            .as_str()
            .unwrap()
            .contains("login failed"),
        "{down:#}"
    );
    assert!(
        !down["dispatch"]["detail"]
            .as_str()
            .unwrap()
            .contains("claude-code"),
        "{down:#}"
    );
    // While it is out, a new task for it waits: the host is not offered its work.
    let id2 = stack
        .submit(json!({"agent_id": agent, "input": "Say hello."}))
        .await
        .unwrap();
    let e = stack
        .api
        .get(&format!("/v1/tasks/{id2}/explain"))
        .await
        .unwrap();
    if e["waiting"] == true {
        assert!(e.to_string().contains("login failed"), "{e:#}");
    }

    // The re-check (every 4 s here) passes discovery and brings it back.
    let up = kit::wait_for(
        "claude-code ready again on h",
        Duration::from_secs(20),
        || async {
            let d = descriptor(&stack, "h", "claude-code").await?;
            (d["provider"]["logged_in"] == true).then_some(d)
        },
    )
    .await
    .unwrap();
    assert!(
        up["dispatch"]["detail"]
            .as_str()
            .unwrap()
            .contains("claude-code"),
        "{up:#}"
    );
    // ...and the waiting task is taken (and refused by the model again).
    stack
        .wait_task(&id2, "failed", Duration::from_secs(60))
        .await
        .unwrap();
}
