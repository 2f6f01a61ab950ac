//! SIGTERM stops a service cleanly: the dataplane hands its sessions back (their leases released
//! at once, the other replica continues without re-running a completed tool), and the gateway
//! ends its live event streams instead of waiting on them forever.

use crate::managed::{
    managed_agent, managed_stack_with, session_events, start_session, wait_outcomes,
};
use agentscope_system_tests::*;
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataplane_stopped_with_sigterm_hands_its_sessions_back_at_once() {
    let simdir = kit::TempDir::new("drain-gate");
    let release = simdir.path.join("release");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo step-one >> journal.txt"}},
            {"tool": "shell", "args": {"command": format!("while [ ! -e {} ]; do sleep 0.05; done; echo never-seen", release.display())}},
            {"tool": "shell", "args": {"command": "echo step-three >> journal.txt"}}
        ],
        "final": "Finished after the handover."
    });
    // A long session lease: a replica that merely died would hold the session for 60 s.
    let (mut stack, _sim, _log, _simdir, mut other) = managed_stack_with(
        "drain-dataplane",
        &script,
        &[("AGENTSCOPE_SESSION_LEASE_TTL_MS", "60000")],
    )
    .await;
    let agent = managed_agent(&stack, "worker", json!({})).await;
    let id = start_session(&stack, &agent, "remote", "Do the three steps.").await;
    let pg = stack.pg.clone();
    let sid = id.clone();
    let holder: String = kit::wait_for("the blocking tool to start", Duration::from_secs(60), || {
        let pg = pg.clone();
        let sid = sid.clone();
        async move {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT st.replica FROM session_state st JOIN session_tool_calls c ON c.session_id = st.session_id
                 WHERE st.session_id = $1::uuid AND c.status = 'started' AND c.input->>'command' LIKE 'while%'",
            )
            .bind(&sid)
            .fetch_optional(&pg)
            .await
            .ok()?;
            row.map(|r| r.0)
        }
    })
    .await
    .unwrap();
    let stopped_at = Instant::now();
    let status = if holder == "dp-0" {
        stack.dataplane.terminate(Duration::from_secs(20))
    } else {
        other.terminate(Duration::from_secs(20))
    };
    assert!(
        status.is_some_and(|s| s.success()),
        "the replica stops by itself on SIGTERM: {status:?}"
    );
    let s = wait_outcomes(&stack, &id, 1).await;
    assert!(
        stopped_at.elapsed() < Duration::from_secs(45),
        "the other replica took over before the 60 s lease could expire"
    );
    std::fs::write(&release, "go").unwrap();
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let journal = std::fs::read_to_string(
        stack
            .dir
            .path
            .join("shared-storage")
            .join(&id)
            .join("journal.txt"),
    )
    .unwrap();
    assert_eq!(
        journal, "step-one\nstep-three\n",
        "no completed tool call ran twice"
    );
    let events = session_events(&stack, &id).await;
    let interrupted = events
        .iter()
        .filter(|e| e["kind"] == "tool_interrupted")
        .count();
    assert_eq!(
        interrupted, 1,
        "the in-flight call is reported, not repeated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stopped_with_sigterm_ends_its_live_streams() {
    let mut stack = Stack::start("drain-gateway", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent(
            "slow",
            "pool",
            &["sh", "-c", "echo started; sleep 60; echo ok"],
            None,
        )
        .await
        .unwrap();
    let _h = stack.host("h", "pool", 1).await.unwrap();
    let task = stack
        .submit(json!({"agent_id": agent, "input": "x"}))
        .await
        .unwrap();
    stack
        .wait_attempt(&task, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    // A live follower.
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/tasks/{task}/events", stack.api.base))
        .bearer_auth(&stack.api.token)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("started") {
        let chunk = tokio::time::timeout(Duration::from_secs(30), body.next())
            .await
            .expect("events arrive")
            .expect("the stream is open")
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let stopped_at = Instant::now();
    let status = stack.gateway.terminate(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "the gateway stops by itself on SIGTERM though a stream is open: {status:?}"
    );
    assert!(stopped_at.elapsed() < Duration::from_secs(10));
    // The stream ended with a word that says so (the client resumes with Last-Event-ID).
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout(Duration::from_secs(5), body.next()).await
    {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("event: shutdown"), "{seen}");
}
