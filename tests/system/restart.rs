//! Crashes and restarts of the platform's own parts lose no accepted work and duplicate nothing.

use agentscope_system_tests::*;
use serde_json::json;
use std::time::Duration;

/// Every task succeeded with exactly one attempt and contiguous, unduplicated events.
async fn assert_clean(stack: &Stack, ids: &[String]) {
    for id in ids {
        let t = stack
            .wait_task(id, "succeeded", Duration::from_secs(120))
            .await
            .unwrap();
        let attempts = t["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 1, "no duplicate attempt: {t:#}");
        let events = stack
            .events(&format!(
                "/v1/attempts/{}/events",
                attempts[0]["id"].as_str().unwrap()
            ))
            .await
            .unwrap();
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
        assert!(
            events.iter().any(|e| e["payload"]["text"] == "ok"),
            "{events:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_killed_mid_stream_loses_no_work() {
    let mut stack = Stack::start("schedkill", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("w", "pool", &["sh", "-c", "sleep 0.2; echo ok"], None)
        .await
        .unwrap();
    let _h1 = stack.host("h1", "pool", 2).await.unwrap();
    let _h2 = stack.host("h2", "pool", 2).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(
            stack
                .submit(json!({"agent_id": agent, "input": i.to_string()}))
                .await
                .unwrap(),
        );
    }
    // Kill it while work is in flight, then start a new one.
    let pg = stack.pg.clone();
    kit::wait_for("some tasks to finish", Duration::from_secs(60), || {
        let pg = pg.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status = 'succeeded'")
                    .fetch_one(&pg)
                    .await
                    .ok()?;
            (n >= 3).then_some(())
        }
    })
    .await
    .unwrap();
    stack.restart_scheduler(true).await.unwrap();
    // More work accepted while the new scheduler catches up.
    for i in 20..25 {
        ids.push(
            stack
                .submit(json!({"agent_id": agent, "input": i.to_string()}))
                .await
                .unwrap(),
        );
    }
    assert_clean(&stack, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bus_restarting_loses_no_work() {
    let mut stack = Stack::start(
        "natsrestart",
        StackOptions {
            lease_ttl_ms: 10_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent("w", "pool", &["sh", "-c", "sleep 0.5; echo ok"], None)
        .await
        .unwrap();
    let _h = stack.host("h", "pool", 2).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(stack.submit(json!({"agent_id": agent})).await.unwrap());
    }
    stack.nats.restart().await.unwrap();
    for _ in 0..4 {
        // The gateway may still be reconnecting: a submission is accepted once it is back.
        let api = stack.api.clone();
        let agent = agent.clone();
        let t = kit::wait_for(
            "a submission after the restart",
            Duration::from_secs(30),
            || {
                let api = api.clone();
                let agent = agent.clone();
                async move { api.post("/v1/tasks", json!({"agent_id": agent})).await.ok() }
            },
        )
        .await
        .unwrap();
        ids.push(t["id"].as_str().unwrap().to_string());
    }
    assert_clean(&stack, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_stopped_with_sigterm_hands_its_work_back() {
    let stack = Stack::start("hostterm", StackOptions::default())
        .await
        .unwrap();
    let release = stack.dir.path.join("release");
    let script = format!(
        "if [ -e '{0}' ]; then echo ok; exit 0; fi; echo waiting; sleep 60",
        release.display()
    );
    let (agent, _) = stack
        .command_agent("w", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (mut host_a, _) = stack.host("a", "pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let first = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt1 = first["id"].as_str().unwrap().to_string();
    let a1 = attempt1.clone();
    kit::wait_for("the provider to run", Duration::from_secs(30), || {
        let a1 = a1.clone();
        async move { (!processes_of_attempt(&a1).is_empty()).then_some(()) }
    })
    .await
    .unwrap();
    std::fs::write(&release, "go").unwrap();
    let status = host_a
        .terminate(Duration::from_secs(30))
        .expect("the host exits on SIGTERM");
    assert!(status.success(), "graceful exit: {status:?}");
    assert!(
        processes_of_attempt(&attempt1).is_empty(),
        "the provider's tree is gone"
    );
    let first = stack
        .wait_attempt(&task_id, 1, "failed", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(first["failure_class"], "host_restart");
    let _host_b = stack.host("b", "pool", 1).await.unwrap();
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(t["attempts"].as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_configuration_stops_a_service_with_a_clear_message() {
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 3] = [
        (
            "svc-scheduler",
            &[("AGENTSCOPE_LEASE_TTL_MS", "5")],
            "lease_ttl_ms",
        ),
        (
            "svc-host",
            &[("AGENTSCOPE_HOST_TOKEN", "nope")],
            "host_token",
        ),
        (
            "svc-gateway",
            &[("AGENTSCOPE_MAX_BODY_BYTES", "not-a-number")],
            "max_body_bytes",
        ),
    ];
    for (bin, env, needle) in cases {
        let out = tokio::process::Command::new(kit::bin(bin).unwrap())
            .envs(env.iter().copied())
            .env("AGENTSCOPE_NATS_URL", "nats://127.0.0.1:1")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bin} must refuse {env:?}");
        assert!(
            stderr.contains(needle),
            "{bin}: the error names `{needle}`: {stderr}"
        );
    }
}

/// A host killed after an event of its attempt was lost but a later one was stored (a reconnect
/// can do that to pipelined publishes) marks the lost seq when it restarts, so the recorder
/// goes past the gap and records the attempt's end, instead of waiting at the gap until the
/// lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_host_fills_a_gap_left_by_a_lost_event() {
    use agentscope_schemas::Message as _;
    use agentscope_schemas::v1::{ExecutionEvent, Output, execution_event::Body};
    let stack = Stack::start(
        "hostgap",
        StackOptions {
            // Long enough that only the restarted host's report can end the attempt in time.
            lease_ttl_ms: 60_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent(
            "g",
            "pool",
            &["sh", "-c", "echo one; echo two; sleep 60"],
            None,
        )
        .await
        .unwrap();
    let (mut host, state_dir) = stack.host("h", "pool", 1).await.unwrap();
    let host_id = std::fs::read_to_string(state_dir.join("host_id"))
        .unwrap()
        .trim()
        .to_string();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let attempt = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt_id = attempt["id"].as_str().unwrap().to_string();
    let path = format!("/v1/attempts/{attempt_id}/events");
    kit::wait_for(
        "the second line recorded",
        Duration::from_secs(30),
        || async {
            let events = stack.events(&path).await.ok()?;
            events
                .iter()
                .any(|e| e["payload"]["text"] == "two")
                .then_some(())
        },
    )
    .await
    .unwrap();
    host.kill9();
    let (stored, token): (i64, i64) =
        sqlx::query_as("SELECT last_seq, lease_token FROM attempts WHERE id = $1::uuid")
            .bind(&attempt_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();

    // The stream gets seq stored + 2 but never stored + 1, as the host's window would have
    // left it had the connection dropped stored + 1 and carried stored + 2.
    let nc = async_nats::ConnectOptions::new()
        .user_and_password(host_id.clone(), stack.host_token.clone())
        .custom_inbox_prefix(agentscope_bus::auth::host_inbox(&host_id))
        .connect(stack.nats.url())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(nc);
    let seq = stored as u64 + 2;
    let ev = ExecutionEvent {
        attempt_id: attempt_id.clone(),
        seq,
        lease_token: token as u64,
        host_id: host_id.clone(),
        at_ms: agentscope_bus::now_ms(),
        body: Some(Body::Output(Output {
            stream: "stdout".into(),
            text: "after the gap".into(),
            truncated: false,
        })),
    };
    js.publish_with_headers(
        agentscope_bus::subjects::events(&host_id, &attempt_id),
        agentscope_bus::headers(&format!("{attempt_id}:{seq}")),
        ev.encode_to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let _host = stack.spawn_host("h", "pool", 1, &state_dir, &[]).unwrap();
    let first = stack
        .wait_attempt(&task_id, 1, "failed", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(first["failure_class"], "host_restart", "{first:#}");
    let events = stack.events(&path).await.unwrap();
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "{events:#?}"
    );
    let at = |s: i64| &events[(s - 1) as usize];
    assert_eq!(at(stored + 1)["kind"], "diagnostic", "{events:#?}");
    assert_eq!(
        at(stored + 1)["payload"]["code"],
        "event_lost",
        "{events:#?}"
    );
    assert_eq!(
        at(stored + 2)["payload"]["text"],
        "after the gap",
        "{events:#?}"
    );
    let _ = stack.cancel_task(&task_id, Duration::from_secs(30)).await;
}
