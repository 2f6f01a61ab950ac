//! Hosted approvals with the real Claude Code: a tool request becomes an Approval, waits for a
//! decision from the API, and the decision is applied exactly once; an undecided request times
//! out into a deny with the class `approval_timeout`.

use crate::agents::{agent_host, modelsim, openai_host, provider_agent};
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::Duration;

async fn pending_approval(stack: &Stack, task_id: &str) -> Value {
    first_pending(stack, &format!("task_id={task_id}")).await
}

/// The first pending approval matching `filter` (`task_id=...` or `session_id=...`), waited for.
pub(crate) async fn first_pending(stack: &Stack, filter: &str) -> Value {
    let api = stack.api.clone();
    let path = format!("/v1/approvals?{filter}&status=pending");
    kit::wait_for("a pending approval", Duration::from_secs(120), || {
        let api = api.clone();
        let path = path.clone();
        async move {
            api.get(&path).await.ok()?["items"]
                .as_array()?
                .first()
                .cloned()
        }
    })
    .await
    .unwrap()
}

/// The events of `task`'s first attempt and the one decision among them (applied once).
async fn the_decision(stack: &Stack, task: &Value) -> (Vec<Value>, Value) {
    let attempt = task["attempts"][0]["id"].as_str().unwrap();
    let events = stack
        .events(&format!("/v1/attempts/{attempt}/events"))
        .await
        .unwrap();
    let decided: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "approval_decided")
        .collect();
    assert_eq!(decided.len(), 1, "applied once: {decided:?}");
    let decided = decided[0].clone();
    (events, decided)
}

async fn decide(stack: &Stack, id: &str, verb: &str, body: Value) -> (u16, Value) {
    stack
        .api
        .send(
            reqwest::Method::POST,
            &format!("/v1/approvals/{id}/{verb}"),
            Some(body),
        )
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_waits_for_approval_and_each_decision_applies_once() {
    let stack = Stack::start("approvals", StackOptions::default())
        .await
        .unwrap();
    let script = json!({
        "turns": [{"say": "Running the build.", "tool": "shell", "args": {"command": "echo approved-work > ran.txt && cat ran.txt"}}],
        "final": "Finished."
    });
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    let mut agents = Vec::new();
    for (name, timeout) in [("patient", "600"), ("hasty", "2")] {
        let params = json!({"approvals": "ask", "approval_timeout_secs": timeout});
        agents.push(provider_agent(&stack, name, "claude-code", params, json!({})).await);
    }
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

    // 1. Approved: the command runs. A conflicting second decision is refused; the same one is
    //    a harmless replay.
    let task1 = stack.submit(json!({"agent_id": agents[0]})).await.unwrap();
    let ap = pending_approval(&stack, &task1).await;
    assert_eq!(ap["tool_name"], "Bash");
    assert!(
        ap["input"]["command"]
            .as_str()
            .unwrap()
            .contains("approved-work"),
        "{ap}"
    );
    let id = ap["id"].as_str().unwrap();
    let (st, v) = decide(&stack, id, "approve", json!({})).await;
    assert_eq!((st, v["status"].as_str()), (200, Some("allowed")), "{v}");
    let (st, v) = decide(&stack, id, "deny", json!({"reason": "changed my mind"})).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (409, Some("already_decided")),
        "{v}"
    );
    let (st, _) = decide(&stack, id, "approve", json!({})).await;
    assert_eq!(st, 200, "approving twice is a replay");
    let t = stack
        .wait_task(&task1, "succeeded", Duration::from_secs(120))
        .await
        .unwrap();
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            t["attempts"][0]["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    let decided: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "approval_decided")
        .collect();
    assert_eq!(
        decided.len(),
        1,
        "the decision was applied once: {decided:?}"
    );
    assert_eq!(decided[0]["payload"]["allow"], true);
    assert!(events.iter().any(|e| e["kind"] == "approval_requested"));
    assert!(
        events.iter().any(|e| e["kind"] == "tool_result"
            && e["payload"]["output"]
                .as_str()
                .is_some_and(|o| o.contains("approved-work"))),
        "the approved command ran"
    );

    // 2. Denied: the command does not run and the agent is told why.
    let task2 = stack.submit(json!({"agent_id": agents[0]})).await.unwrap();
    let ap = pending_approval(&stack, &task2).await;
    let (st, v) = decide(
        &stack,
        ap["id"].as_str().unwrap(),
        "deny",
        json!({"reason": "not on a Friday"}),
    )
    .await;
    assert_eq!((st, v["status"].as_str()), (200, Some("denied")), "{v}");
    // The turn ended because its tool was denied: not a plain success.
    let t = stack
        .wait_task(&task2, "failed", Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(t["attempts"][0]["failure_class"], "tool_denied", "{t}");
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            t["attempts"][0]["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    assert!(
        !events.iter().any(|e| e["payload"]["output"]
            .as_str()
            .is_some_and(|o| o.contains("approved-work"))),
        "denied: nothing ran"
    );
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests.contains("not on a Friday"),
        "the model was told the reason"
    );

    // 3. Undecided: the policy deadline turns it into a deny with the class approval_timeout.
    let task3 = stack.submit(json!({"agent_id": agents[1]})).await.unwrap();
    let ap = pending_approval(&stack, &task3).await;
    let t = stack
        .wait_task(&task3, "failed", Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(t["attempts"][0]["failure_class"], "approval_timeout", "{t}");
    let after = stack
        .api
        .get(&format!("/v1/approvals/{}", ap["id"].as_str().unwrap()))
        .await
        .unwrap();
    assert_eq!(
        (after["status"].as_str(), after["decided_by"].as_str()),
        (Some("timed_out"), Some("policy")),
        "{after}"
    );
    let (st, v) = decide(&stack, ap["id"].as_str().unwrap(), "approve", json!({})).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (409, Some("already_decided"))
    );
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            t["attempts"][0]["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    let d = events
        .iter()
        .find(|e| e["kind"] == "approval_decided")
        .expect("a decision event");
    assert_eq!(
        (
            d["payload"]["allow"].as_bool(),
            d["payload"]["failure_class"].as_str()
        ),
        (Some(false), Some("approval_timeout")),
        "{d}"
    );
}

/// A provider with its own approval protocol (`approvals: ask`): an approved shell command runs,
/// a denied one does not and the run still finishes (its task `failed` with `tool_denied`), and
/// each decision applies once.
async fn approve_then_deny(label: &str, provider: &str, tool_name: &str) {
    let stack = Stack::start(label, StackOptions::default()).await.unwrap();
    let script = json!({
        "turns": [{"say": "Running the build.", "tool": "shell", "args": {"command": "echo approved-work > ran.txt && cat ran.txt"}}],
        "final": "Finished."
    });
    let (_sim, url, _log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(
        &stack,
        label,
        provider,
        json!({"approvals": "ask"}),
        json!({}),
    )
    .await;
    let _host = openai_host(&stack, provider, &url).await;

    for (verb, runs) in [("approve", true), ("deny", false)] {
        let task = stack.submit(json!({"agent_id": agent})).await.unwrap();
        let ap = pending_approval(&stack, &task).await;
        assert_eq!(ap["tool_name"], tool_name, "{ap}");
        assert!(
            ap["input"].to_string().contains("approved-work"),
            "the request shows the command: {ap}"
        );
        let id = ap["id"].as_str().unwrap();
        let (st, v) = decide(&stack, id, verb, json!({"reason": "policy"})).await;
        assert_eq!(st, 200, "{v}");
        let other = if verb == "approve" { "deny" } else { "approve" };
        let (st, v) = decide(&stack, id, other, json!({})).await;
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (409, Some("already_decided")),
            "{v}"
        );
        let status = if runs { "succeeded" } else { "failed" };
        let t = stack
            .wait_task(&task, status, Duration::from_secs(120))
            .await
            .unwrap();
        if !runs {
            assert_eq!(t["attempts"][0]["failure_class"], "tool_denied", "{t}");
        }
        let (events, decided) = the_decision(&stack, &t).await;
        assert_eq!(decided["payload"]["allow"], runs);
        let ran = events.iter().any(|e| {
            e["kind"] == "tool_result"
                && !e["payload"]["is_error"].as_bool().unwrap_or(false)
                && e["payload"]["output"]
                    .as_str()
                    .is_some_and(|o| o.contains("approved-work"))
        });
        assert_eq!(ran, runs, "{verb}: the command ran = {runs}; {events:#?}");
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "result" && e["payload"]["is_error"] == false),
            "the run finished: {events:#?}"
        );
    }
}

/// A Codex agent (`approvals: ask`) whose model runs `command` in one `shell` call, then
/// finishes, and a host for it; the model server and the host run while the processes returned
/// with the agent's id are kept.
async fn codex_asking(stack: &Stack, command: &str) -> (String, [kit::Proc; 2]) {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": command}}],
        "final": "Finished."
    });
    let (sim, url, _log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(stack, "a", "codex", json!({"approvals": "ask"}), json!({})).await;
    let host = openai_host(stack, "codex", &url).await;
    (agent, [sim, host])
}

/// A decision committed without its command reaching the host (the scheduler died, or lost
/// NATS, between its commit and its publish) still reaches the waiting attempt: the sweeper sends
/// it once it is overdue, and a client repeating the decision sends it at once. Either way the
/// tool runs once and the decision is marked delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_committed_without_its_command_still_reaches_the_attempt() {
    let stack = Stack::start("approval-undelivered", StackOptions::default())
        .await
        .unwrap();
    let (agent, _running) =
        codex_asking(&stack, "echo approved-work > ran.txt && cat ran.txt").await;
    // Decided a minute ago (the sweeper's to send), or "later" (only a repeat can send it).
    for (decided_at, repeat) in [
        ("now() - interval '1 minute'", false),
        ("now() + interval '1 hour'", true),
    ] {
        let task = stack.submit(json!({"agent_id": agent})).await.unwrap();
        let ap = pending_approval(&stack, &task).await;
        let id = ap["id"].as_str().unwrap().to_string();
        // What the scheduler commits before it publishes the command.
        sqlx::query(&format!(
            "UPDATE approvals SET status = 'allowed', decided_at = {decided_at}, decided_by = 'api',
                    undelivered = true WHERE id = $1::uuid"
        ))
        .bind(&id)
        .execute(&stack.pg)
        .await
        .unwrap();
        if repeat {
            let (st, v) = decide(&stack, &id, "approve", json!({})).await;
            assert_eq!((st, v["status"].as_str()), (200, Some("allowed")), "{v}");
        }
        let t = stack
            .wait_task(&task, "succeeded", Duration::from_secs(120))
            .await
            .unwrap();
        let (_, decided) = the_decision(&stack, &t).await;
        assert_eq!(decided["payload"]["allow"], true);
        let undelivered: bool =
            sqlx::query_scalar("SELECT undelivered FROM approvals WHERE id = $1::uuid")
                .bind(&id)
                .fetch_one(&stack.pg)
                .await
                .unwrap();
        assert!(!undelivered, "repeat {repeat}: marked delivered");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_asks_through_app_server_and_each_decision_applies_once() {
    approve_then_deny("codex-approvals", "codex", "shell").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_asks_through_acp_and_each_decision_applies_once() {
    approve_then_deny("opencode-approvals", "opencode", "bash").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_an_attempt_awaiting_approval() {
    let stack = Stack::start("approval-cancel", StackOptions::default())
        .await
        .unwrap();
    let (agent, _running) = codex_asking(&stack, "echo never > ran.txt").await;
    let task = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let ap = pending_approval(&stack, &task).await;
    let attempt = ap["attempt_id"].as_str().unwrap().to_string();
    assert!(
        !processes_of_attempt(&attempt).is_empty(),
        "the provider waits for the decision"
    );
    stack
        .cancel_task(&task, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        processes_of_attempt(&attempt).is_empty(),
        "no process of the tree is left"
    );
    let after = stack
        .api
        .get(&format!("/v1/approvals/{}", ap["id"].as_str().unwrap()))
        .await
        .unwrap();
    assert_eq!(
        (after["status"].as_str(), after["decided_by"].as_str()),
        (Some("denied"), Some("platform")),
        "the open request is closed with the attempt: {after}"
    );
    let (st, v) = decide(&stack, ap["id"].as_str().unwrap(), "approve", json!({})).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (409, Some("already_decided")),
        "{v}"
    );
}
