//! Cancelling ends the attempt `cancelled` and leaves no process of the provider's tree.

use agentscope_system_tests::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_running_attempt_kills_the_whole_tree() {
    let stack = Stack::start("cancel", StackOptions::default())
        .await
        .unwrap();
    let script = "sleep 300 & sleep 300 & (trap '' TERM; sleep 300) & echo started; wait";
    let (agent, _) = stack
        .command_agent("sleeper", "pool", &["sh", "-c", script], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let attempt = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt_id = attempt["id"].as_str().unwrap().to_string();
    let a = attempt_id.clone();
    let procs = kit::wait_for(
        "the provider's tree to start",
        Duration::from_secs(30),
        || {
            let a = a.clone();
            async move {
                let p = processes_of_attempt(&a);
                (p.len() >= 4).then_some(p)
            }
        },
    )
    .await
    .unwrap();
    assert!(procs.len() >= 4, "{procs:?}");

    stack
        .api
        .post(
            &format!("/v1/tasks/{task_id}/cancel"),
            json!({"reason": "test"}),
        )
        .await
        .unwrap();
    let task = stack
        .wait_task(&task_id, "cancelled", Duration::from_secs(60))
        .await
        .unwrap();
    let a = &task["attempts"][0];
    assert_eq!(a["status"], "cancelled");
    assert_eq!(a["failure_class"], "cancelled");
    let left = processes_of_attempt(&attempt_id);
    assert!(
        left.is_empty(),
        "processes of the cancelled attempt remain: {left:?}"
    );
    let events = stack
        .events(&format!("/v1/attempts/{attempt_id}/events"))
        .await
        .unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["payload"]["state"], "cancelled");
    // Cancelling again is harmless.
    stack
        .api
        .post(&format!("/v1/tasks/{task_id}/cancel"), json!({}))
        .await
        .unwrap();
    assert_eq!(
        stack.task(&task_id).await.unwrap()["attempts"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_queued_task_needs_no_host() {
    let stack = Stack::start("cancelq", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("idle", "empty-pool", &["true"], None)
        .await
        .unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    stack
        .wait_attempt(&task_id, 1, "queued", Duration::from_secs(30))
        .await
        .unwrap();
    stack
        .cancel_task(&task_id, Duration::from_secs(30))
        .await
        .unwrap();
}

/// A cancellation committed without its message (the gateway died, or lost NATS, between its
/// commit and its publish) still reaches the work: the sweeper cancels a queued attempt, sends
/// the cancel again to the host of a running one once the request is overdue, and settles both
/// requests once their attempts have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_whose_message_was_lost_still_stops_the_work() {
    let stack = Stack::start("cancel-lost", StackOptions::default())
        .await
        .unwrap();
    let (sleeper, _) = stack
        .command_agent("sleeper", "pool", &["sleep", "300"], None)
        .await
        .unwrap();
    let (idle, _) = stack
        .command_agent("idle", "empty-pool", &["true"], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let mut tasks = Vec::new();
    for (agent, status) in [(&sleeper, "running"), (&idle, "queued")] {
        let id = stack.submit(json!({"agent_id": agent})).await.unwrap();
        stack
            .wait_attempt(&id, 1, status, Duration::from_secs(30))
            .await
            .unwrap();
        tasks.push(id);
    }
    // What the gateway commits, without the message that follows; made a minute ago, so that
    // the running attempt's request is overdue at once.
    sqlx::query(
        "UPDATE tasks SET cancel_requested_at = now() - interval '1 minute' WHERE id = ANY($1::uuid[])",
    )
    .bind(&tasks)
    .execute(&stack.pg)
    .await
    .unwrap();
    for id in &tasks {
        let task = stack
            .wait_task(id, "cancelled", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(task["attempts"].as_array().unwrap().len(), 1, "{task}");
        assert_eq!(task["attempts"][0]["failure_class"], "cancelled", "{task}");
    }
    kit::wait_for("both requests settled", Duration::from_secs(30), || async {
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM tasks WHERE cancel_pending AND id = ANY($1::uuid[])",
        )
        .bind(&tasks)
        .fetch_one(&stack.pg)
        .await
        .ok()?;
        (pending == 0).then_some(())
    })
    .await
    .unwrap();
}

/// Live processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_while_the_repository_is_cloned_stops_git() {
    let stack = Stack::start("cancel-clone", StackOptions::default())
        .await
        .unwrap();
    // A "git server" that accepts connections and never answers: the clone hangs.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://127.0.0.1:{}/never-answers.git",
        silent.local_addr().unwrap().port()
    );
    let (agent, _) = stack
        .command_agent("a", "pool", &["true"], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task_id = stack
        .submit(json!({"agent_id": agent, "repository": url, "branch": "main"}))
        .await
        .unwrap();
    let u = url.clone();
    kit::wait_for("git to be cloning", Duration::from_secs(60), || {
        let u = u.clone();
        async move { (!processes_with(&u).is_empty()).then_some(()) }
    })
    .await
    .unwrap();
    stack
        .cancel_task(&task_id, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        processes_with(&url).is_empty(),
        "no git process is left: {:?}",
        processes_with(&url)
    );
    drop(silent);
}
