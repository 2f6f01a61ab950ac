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
    let task = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent}))
        .await
        .unwrap();
    let task_id = task["id"].as_str().unwrap().to_string();
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
    let task = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent}))
        .await
        .unwrap();
    let task_id = task["id"].as_str().unwrap().to_string();
    stack
        .wait_attempt(&task_id, 1, "queued", Duration::from_secs(30))
        .await
        .unwrap();
    stack
        .cancel_task(&task_id, Duration::from_secs(30))
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
    let task = stack
        .api
        .post(
            "/v1/tasks",
            json!({"agent_id": agent, "repository": url, "branch": "main"}),
        )
        .await
        .unwrap();
    let task_id = task["id"].as_str().unwrap().to_string();
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
