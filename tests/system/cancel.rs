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
        .api
        .post(&format!("/v1/tasks/{task_id}/cancel"), json!({}))
        .await
        .unwrap();
    let t = stack
        .wait_task(&task_id, "cancelled", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(t["attempts"][0]["failure_class"], "cancelled");
}
