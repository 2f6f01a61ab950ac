//! Long operations on self-hosted Workers: a call longer than any request timeout completes, a
//! Worker killed mid-call is `worker_offline` within a few heartbeats (not at the deadline), and
//! an operation asked for again (a lost connection, a replica that took the session over) gets
//! the Worker's stored result without running twice.

use crate::managed::{
    kill_replica, managed_agent, managed_stack_with, session_events, spawn_worker, start_on_worker,
    wait_outcomes,
};
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{ToolOperation, ToolOperationResult};
use agentscope_system_tests::*;
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The `tool_result` events of a session.
fn results(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["kind"] == "tool_result")
        .map(|e| e["payload"].clone())
        .collect()
}

fn final_text(events: &[Value]) -> String {
    events
        .iter()
        .rfind(|e| e["kind"] == "assistant_message")
        .and_then(|e| e["payload"]["text"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_30_second_tool_call_on_a_healthy_worker_completes_and_reaches_the_model() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "sleep 30; echo done >> long.txt; cat long.txt"}, "expect": "done"}],
        "final": "The long call finished."
    });
    let (stack, _sim, _log, _simdir, _second) =
        managed_stack_with("faults-worker-long", &script, &[]).await;
    let dir = stack.dir.path.join("worker-long");
    let _worker = spawn_worker(&stack, "long", &dir).await;
    let agent = managed_agent(&stack, "patient", json!({})).await;
    let started = Instant::now();
    let id = start_on_worker(&stack, &agent, "long", "Run the long command.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert!(
        started.elapsed() >= Duration::from_secs(30),
        "the command really ran 30 s"
    );
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    let results = results(&events);
    assert_eq!(results.len(), 1, "{events:#?}");
    assert_eq!(results[0]["is_error"], false, "{events:#?}");
    let output = results[0]["output"].as_str().unwrap();
    assert!(output.starts_with("done\n"), "{output}");
    // The model saw the output (its expectation held) and answered.
    assert_eq!(
        final_text(&events),
        "The long call finished.",
        "{events:#?}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(&id).join("long.txt")).unwrap(),
        "done\n",
        "the command ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_call_is_worker_offline_within_a_few_heartbeats() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo started >> started.txt; sleep 120; echo late >> late.txt"}}],
        "final": "Reported."
    });
    let (stack, _sim, _log, _simdir, _second) =
        managed_stack_with("faults-worker-killed", &script, &[]).await;
    let dir = stack.dir.path.join("worker-doomed");
    let mut worker = spawn_worker(&stack, "doomed", &dir).await;
    let agent = managed_agent(&stack, "unlucky", json!({})).await;
    let id = start_on_worker(&stack, &agent, "doomed", "Run it.").await;
    let marker = dir.join(&id).join("started.txt");
    kit::wait_for("the command to start", Duration::from_secs(60), || {
        std::future::ready(marker.exists().then_some(()))
    })
    .await
    .unwrap();
    worker.kill9();
    let killed = Instant::now();
    let api = stack.api.clone();
    let path = format!("/v1/sessions/{id}/events");
    let result = kit::wait_for("the call's result", Duration::from_secs(60), || {
        let api = api.clone();
        let path = path.clone();
        async move {
            let events = api.get(&path).await.ok()?;
            results(events["items"].as_array()?).into_iter().next()
        }
    })
    .await
    .unwrap();
    let took = killed.elapsed();
    // worker_ttl is 3 s (beats every second): silence for 3 s, then a query nobody answers.
    assert!(
        took < Duration::from_secs(15),
        "worker_offline after {took:?}, not at the deadline (120 s + margin)"
    );
    let output = result["output"].as_str().unwrap();
    assert_eq!(result["is_error"], true, "{result:#}");
    assert!(output.starts_with("worker_offline: "), "{output}");
    assert!(output.contains("`doomed` stopped answering"), "{output}");
    assert!(output.contains("effects are unknown"), "{output}");
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "started\n",
        "the call was not sent again"
    );
}

/// Sends `op` to the Worker as the dataplane does and decodes the acknowledgement.
async fn ask(nc: &async_nats::Client, worker_id: &str, op: &ToolOperation) -> ToolOperationResult {
    let m = nc
        .send_request(
            agentscope_bus::subjects::worker_ops(worker_id),
            async_nats::Request::new()
                .payload(op.encode_to_vec().into())
                .timeout(Some(Duration::from_secs(5))),
        )
        .await
        .unwrap();
    ToolOperationResult::decode(m.payload.as_ref()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_again_for_an_operation_gets_the_stored_result_and_runs_it_once() {
    let stack = Stack::start("faults-worker-again", StackOptions::default())
        .await
        .unwrap();
    let dir = stack.dir.path.join("worker-ledger");
    let _worker = spawn_worker(&stack, "ledger", &dir).await;
    let worker_id = agentscope_domain::worker_id(&stack.workspace_id, "ledger");
    // The dataplane's side of the protocol, with the dataplane's credentials.
    let nc = stack.nats.service_client("dataplane").await.unwrap();
    let session = uuid::Uuid::new_v4();
    let op = ToolOperation {
        operation_id: "0123456789abcdef0123456789abcdef".into(),
        session_id: session.to_string(),
        tool: "shell".into(),
        input_json:
            json!({"command": "echo ran >> ledger.txt; sleep 2; echo lines=$(wc -l < ledger.txt)"})
                .to_string(),
        timeout_ms: 30_000,
        beat_ms: 200,
        ..Default::default()
    };
    let mut progress = nc
        .subscribe(agentscope_bus::subjects::worker_progress(
            &worker_id,
            &op.operation_id,
        ))
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let first = ask(&nc, &worker_id, &op).await;
    assert_eq!(first.state, "running", "acknowledged at once: {first:?}");
    // Sent again while it runs (a dataplane that missed the acknowledgement): not run twice.
    let again = ask(&nc, &worker_id, &op).await;
    assert_eq!(again.state, "running", "{again:?}");
    let mut beats = 0;
    let result = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let m = progress.next().await.unwrap();
            let r = ToolOperationResult::decode(m.payload.as_ref()).unwrap();
            match r.state.as_str() {
                "running" => beats += 1,
                _ => return r,
            }
        }
    })
    .await
    .expect("the result on the progress subject");
    assert_eq!(result.state, "done", "{result:?}");
    assert!(result.ok, "{result:?}");
    assert!(result.output.starts_with("lines=1\n"), "{result:?}");
    assert!(beats >= 3, "progress beats while it ran: {beats}");
    // Asked again after the result (a replica that lost it, or took the session over): the
    // stored result, by query and by a full resend alike.
    let query = ToolOperation {
        query_only: true,
        input_json: String::new(),
        ..op.clone()
    };
    for asked in [&query, &op] {
        let stored = ask(&nc, &worker_id, asked).await;
        assert_eq!(stored.state, "done", "{stored:?}");
        assert_eq!(stored.output, result.output);
        assert_eq!(stored.operation_id, op.operation_id);
    }
    // A query never runs an operation the Worker has not seen.
    let unseen = ToolOperation {
        operation_id: "fedcba9876543210fedcba9876543210".into(),
        ..query.clone()
    };
    assert_eq!(ask(&nc, &worker_id, &unseen).await.state, "unknown");
    assert_eq!(
        std::fs::read_to_string(dir.join(session.to_string()).join("ledger.txt")).unwrap(),
        "ran\n",
        "the side effect happened once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_takes_over_gets_the_workers_result_instead_of_interrupted() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo once >> ledger.txt; sleep 4; echo finished-on-the-worker"}, "expect": "finished-on-the-worker"}],
        "final": "Recovered."
    });
    let (mut stack, _sim, _log, _simdir, mut other) =
        managed_stack_with("faults-worker-takeover", &script, &[]).await;
    let dir = stack.dir.path.join("worker-steady");
    let _worker = spawn_worker(&stack, "steady", &dir).await;
    let agent = managed_agent(&stack, "resilient", json!({})).await;
    let id = start_on_worker(&stack, &agent, "steady", "Run it once.").await;
    let pg = stack.pg.clone();
    let sid = id.clone();
    let holder: String = kit::wait_for("the call to start", Duration::from_secs(60), || {
        let pg = pg.clone();
        let sid = sid.clone();
        async move {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT st.replica FROM session_state st JOIN session_tool_calls c ON c.session_id = st.session_id
                 WHERE st.session_id = $1::uuid AND c.status = 'started'",
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
    // The Worker has the operation (its command has begun), not only the journal its start:
    // a replica killed in between never sent it, and the call is then rightly interrupted.
    let ledger = dir.join(&id).join("ledger.txt");
    kit::wait_for(
        "the command to begin on the Worker",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                std::fs::read_to_string(&ledger)
                    .ok()
                    .filter(|t| !t.is_empty())
            }
        },
    )
    .await
    .unwrap();
    kill_replica(&mut stack, &mut other, &holder);
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    assert!(
        !events.iter().any(|e| e["kind"] == "tool_interrupted"),
        "the Worker's result was asked for, not reported interrupted: {events:#?}"
    );
    let results = results(&events);
    assert_eq!(results.len(), 1, "{events:#?}");
    let output = results[0]["output"].as_str().unwrap();
    assert!(output.starts_with("finished-on-the-worker\n"), "{output}");
    assert_eq!(final_text(&events), "Recovered.", "{events:#?}");
    assert_eq!(
        std::fs::read_to_string(dir.join(&id).join("ledger.txt")).unwrap(),
        "once\n",
        "the command ran once"
    );
    let state: (String, String) = sqlx::query_as(
        "SELECT st.replica, c.status FROM session_state st JOIN session_tool_calls c ON c.session_id = st.session_id WHERE st.session_id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_ne!(state.0, holder, "the other replica finished the session");
    assert_eq!(state.1, "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_running_across_a_broker_restart_gets_its_result_once() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo once >> ledger.txt; sleep 8; echo survived"}, "expect": "survived"}],
        "final": "Survived the restart."
    });
    let (mut stack, _sim, _log, _simdir, _second) =
        managed_stack_with("faults-worker-broker", &script, &[]).await;
    let dir = stack.dir.path.join("worker-sturdy");
    let _worker = spawn_worker(&stack, "sturdy", &dir).await;
    let agent = managed_agent(&stack, "sturdy", json!({})).await;
    let id = start_on_worker(&stack, &agent, "sturdy", "Run it.").await;
    let ledger = dir.join(&id).join("ledger.txt");
    kit::wait_for("the command to start", Duration::from_secs(60), || {
        std::future::ready(ledger.exists().then_some(()))
    })
    .await
    .unwrap();
    // Beats and maybe the result are lost while the broker is away; the dataplane asks again.
    stack.nats.restart().await.unwrap();
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    let results = results(&events);
    assert_eq!(results.len(), 1, "{events:#?}");
    let output = results[0]["output"].as_str().unwrap();
    assert!(output.starts_with("survived\n"), "{output}");
    assert_eq!(final_text(&events), "Survived the restart.", "{events:#?}");
    assert_eq!(
        std::fs::read_to_string(&ledger).unwrap(),
        "once\n",
        "the command ran once"
    );
}
