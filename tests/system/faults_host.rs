//! A host that dies for good: its providers die with it (descendants that left the process group
//! included), so the retry on another host never overlaps the first attempt and no side effect
//! happens twice.

use agentscope_system_tests::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_for_good_takes_its_providers_with_it() {
    let stack = Stack::start(
        "faults-host",
        StackOptions {
            lease_ttl_ms: 6_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let effects = stack.shared.join("effects");
    std::fs::create_dir_all(&effects).unwrap();
    std::fs::set_permissions(
        &effects,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let e = effects.display();
    // The work: a side effect after a while, and a descendant that leaves the process group and
    // would write later still.
    let script = format!(
        "F={e}/$AGENTSCOPE_TASK_ID; setsid sh -c \"sleep 7; echo late >> $F\" & \
         echo started; sleep 5; echo run >> $F; wait; sleep 3; echo ok"
    );
    let (agent, _) = stack
        .command_agent("effects", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (mut host_a, _) = stack.host("a", "pool", 1).await.unwrap();
    let t = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "x"}))
        .await
        .unwrap();
    let task = t["id"].as_str().unwrap().to_string();
    let first = stack
        .wait_attempt(&task, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt1 = first["id"].as_str().unwrap().to_string();
    let a1 = attempt1.clone();
    kit::wait_for(
        "the first attempt's processes",
        Duration::from_secs(10),
        || {
            let n = processes_of_attempt(&a1).len();
            std::future::ready((n >= 2).then_some(()))
        },
    )
    .await
    .unwrap();

    // The host dies and never comes back.
    host_a.kill9_leader();
    let a1 = attempt1.clone();
    kit::wait_for(
        "every process of the dead host's attempt to end",
        Duration::from_secs(5),
        || {
            let left = processes_of_attempt(&a1);
            std::future::ready(left.is_empty().then_some(()))
        },
    )
    .await
    .unwrap();

    // Another host takes the retry once the lease expires; the work runs once, there.
    let _b = stack.host("b", "pool", 1).await.unwrap();
    let t = stack
        .wait_task(&task, "succeeded", Duration::from_secs(90))
        .await
        .unwrap();
    let attempts = t["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{t:#}");
    assert_eq!(attempts[0]["status"], "lost", "{t:#}");
    assert_eq!(attempts[0]["failure_class"], "host_offline", "{t:#}");
    let done = std::fs::read_to_string(effects.join(&task)).unwrap_or_default();
    assert_eq!(
        done.lines().collect::<Vec<_>>(),
        vec!["run", "late"],
        "each side effect once, from the retry: {done:?}"
    );
}
