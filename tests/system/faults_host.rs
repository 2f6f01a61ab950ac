//! A host that dies for good: its providers die with it (descendants that left the process group
//! included), so the retry on another host never overlaps the first attempt and no side effect
//! happens twice.

use agentscope_system_tests::*;
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
    let effects = faults::effects_dir(&stack);
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
    let (mut host_a, _) = stack.host("a", "pool", 12).await.unwrap();
    let tasks = faults::submit(&stack, &agent, 12).await;
    let mut first_attempts = Vec::new();
    for task in &tasks {
        let first = stack
            .wait_attempt(task, 1, "running", Duration::from_secs(60))
            .await
            .unwrap();
        first_attempts.push(first["id"].as_str().unwrap().to_string());
    }
    let all = first_attempts.clone();
    kit::wait_for(
        "the first attempts' processes",
        Duration::from_secs(20),
        || {
            let ready = all.iter().all(|a| processes_of_attempt(a).len() >= 2);
            std::future::ready(ready.then_some(()))
        },
    )
    .await
    .unwrap();

    // The host dies and never comes back.
    host_a.kill9_leader();
    let all = first_attempts.clone();
    kit::wait_for(
        "every process of the dead host's attempts to end",
        Duration::from_secs(5),
        || {
            let left: usize = all.iter().map(|a| processes_of_attempt(a).len()).sum();
            std::future::ready((left == 0).then_some(()))
        },
    )
    .await
    .unwrap();

    // Another host takes the retries once the leases expire; the work runs once, there.
    let _b = stack.host("b", "pool", 12).await.unwrap();
    for task in &tasks {
        let t = stack
            .wait_task(task, "succeeded", Duration::from_secs(120))
            .await
            .unwrap();
        let attempts = t["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 2, "{t:#}");
        assert_eq!(attempts[0]["status"], "lost", "{t:#}");
        assert_eq!(attempts[0]["failure_class"], "host_offline", "{t:#}");
        let done = std::fs::read_to_string(effects.join(task)).unwrap_or_default();
        assert_eq!(
            done.lines().collect::<Vec<_>>(),
            vec!["run", "late"],
            "each side effect once, from the retry: {done:?}"
        );
    }
}
