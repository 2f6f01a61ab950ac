//! A host killed with SIGKILL mid-attempt: the lease expires, the attempt is `lost`, a retry is a
//! new attempt that succeeds on a second host; the first host keeps its identity after a restart
//! and cannot change anything for the lost attempt (fencing).

use agentscope_schemas::v1::{ExecutionEvent, Output, execution_event::Body};
use agentscope_system_tests::*;
use prost::Message;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_host_loses_its_lease_and_the_retry_succeeds_elsewhere() {
    // The lease outlives the heartbeat: a killed host is known offline when its lease expires.
    let stack = Stack::start(
        "failover",
        StackOptions {
            lease_ttl_ms: 6_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let release = stack.dir.path.join("release");
    let script = format!(
        "if [ -e '{0}' ]; then echo released; exit 0; fi; echo waiting; sleep 60",
        release.display()
    );
    let (agent, _) = stack
        .command_agent("worker", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (mut host_a, state_a) = stack.host("a", "pool", 1).await.unwrap();
    let id_a = std::fs::read_to_string(state_a.join("host_id")).unwrap();
    let events_a1 = |a1: &str| format!("agentscope.events.{}.{a1}", id_a.trim());

    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let first = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(first["host_id"], id_a.trim());
    let attempt1 = first["id"].as_str().unwrap().to_string();
    // Wait until the provider is mid-task (its first line is recorded).
    let api = stack.api.clone();
    let a1 = attempt1.clone();
    kit::wait_for("the provider's first line", Duration::from_secs(30), || {
        let api = api.clone();
        let a1 = a1.clone();
        async move {
            let ev = api.get(&format!("/v1/attempts/{a1}/events")).await.ok()?;
            ev["items"]
                .as_array()?
                .iter()
                .any(|e| e["payload"]["text"] == "waiting")
                .then_some(())
        }
    })
    .await
    .unwrap();

    let (_host_b, state_b) = stack.host("b", "pool", 1).await.unwrap();
    let id_b = std::fs::read_to_string(state_b.join("host_id")).unwrap();
    std::fs::write(&release, "go").unwrap();
    host_a.kill9_leader();

    let lost = stack
        .wait_attempt(&task_id, 1, "lost", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(lost["failure_class"], "host_offline");
    assert!(lost["remedy"].as_str().is_some_and(|r| !r.is_empty()));
    let task = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let attempts = task["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "a retry is a new attempt: {task:#}");
    assert_eq!(attempts[0]["status"], "lost", "the old record stays");
    assert_eq!(attempts[1]["host_id"], id_b.trim());
    let events_before: i64 = attempts[0]["events"].as_i64().unwrap();
    // The lease decision is part of the attempt's record (logs and live streams show it).
    let a1_events = stack
        .events(&format!("/v1/attempts/{attempt1}/events"))
        .await
        .unwrap();
    let last = a1_events.last().unwrap();
    assert_eq!(
        (last["kind"].as_str(), last["payload"]["state"].as_str()),
        (Some("lifecycle"), Some("lost")),
        "{last}"
    );
    assert!(
        last["payload"]["detail"]
            .as_str()
            .unwrap()
            .contains("new attempt"),
        "{last}"
    );

    // The orphaned provider of host A is not the platform's to reap; end it for tidiness.
    for pid in processes_of_attempt(&attempt1) {
        // SAFETY: plain signal to a test-owned process.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }

    // Host A comes back with the same identity and reports its journaled attempt: refused.
    let _host_a2 = stack.spawn_host("a", "pool", 1, &state_a, &[]).unwrap();
    stack.wait_host_ready("a").await.unwrap();
    assert_eq!(
        std::fs::read_to_string(state_a.join("host_id")).unwrap(),
        id_a,
        "identity kept on disk"
    );
    let hosts = stack.api.get("/v1/hosts").await.unwrap();
    let ids: Vec<&str> = hosts["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "the restart did not create a second host: {ids:?}"
    );
    assert!(ids.contains(&id_a.trim()));
    let pg = stack.pg.clone();
    let a1 = attempt1.clone();
    let reason: String = kit::wait_for(
        "the restarted host's stale report to be refused",
        Duration::from_secs(30),
        || {
            let pg = pg.clone();
            let a1 = a1.clone();
            async move {
                sqlx::query_scalar::<_, String>(
                    "SELECT reason FROM rejected_messages WHERE subject = $1",
                )
                .bind(events_a1(&a1))
                .fetch_optional(&pg)
                .await
                .ok()
                .flatten()
            }
        },
    )
    .await
    .unwrap();
    assert!(reason.contains("fenced"), "{reason}");

    // A forged event with the old fencing token changes nothing either.
    let nats = stack.nats.service_client("scheduler").await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let forged = ExecutionEvent {
        attempt_id: attempt1.clone(),
        seq: events_before as u64 + 5,
        lease_token: first["lease_token"].as_u64().unwrap(),
        host_id: id_a.trim().to_string(),
        at_ms: 0,
        body: Some(Body::Output(Output {
            stream: "stdout".into(),
            text: "forged".into(),
            truncated: false,
        })),
    };
    js.publish(
        format!("agentscope.events.{}.{attempt1}", id_a.trim()),
        forged.encode_to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let pg = stack.pg.clone();
    let a1 = attempt1.clone();
    kit::wait_for(
        "the forged event to be refused",
        Duration::from_secs(30),
        || {
            let pg = pg.clone();
            let a1 = a1.clone();
            async move {
                let n: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM rejected_messages WHERE subject = $1")
                        .bind(events_a1(&a1))
                        .fetch_one(&pg)
                        .await
                        .ok()?;
                (n >= 2).then_some(())
            }
        },
    )
    .await
    .unwrap();
    let after = stack
        .api
        .get(&format!("/v1/attempts/{attempt1}"))
        .await
        .unwrap();
    assert_eq!(after["status"], "lost");
    assert_eq!(
        after["events"].as_i64().unwrap(),
        events_before,
        "no event was added for the lost attempt"
    );
}
