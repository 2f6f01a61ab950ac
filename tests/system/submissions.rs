//! Task submissions that queue up behind each other in the gateway are stored together
//! (`svc-gateway/src/batch.rs`, migration 0012): every one still gets its own task and attempt 1,
//! answered once committed, and a value PostgreSQL refuses fails only its own request.

use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;

/// The gateway's gauge of submissions handed to its batches and not answered yet.
async fn batching(stack: &Stack) -> Option<i64> {
    metric(&stack.api.base, "agentscope_submissions_batching")
        .await
        .map(|v| v as i64)
}

/// A stack without direct dispatch (every submission is stored queued), at most two batches in
/// flight at once, no host, and an agent whose plan the gateway keeps (one task submitted).
/// Returns the stack and the agent.
async fn queued_stack(label: &str) -> (Stack, String) {
    let stack = Stack::start(
        label,
        StackOptions {
            gateway_env: vec![
                ("AGENTSCOPE_DIRECT_DISPATCH".into(), "false".into()),
                ("AGENTSCOPE_SUBMIT_BATCHES".into(), "2".into()),
            ],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent("batched", "pool", &["true"], None)
        .await
        .unwrap();
    stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "first"}))
        .await
        .unwrap();
    (stack, agent)
}

/// Holds every insert into `tasks` until the returned transaction ends, then submits `inputs`
/// at once and waits until all of them are in the gateway's batches (none can be answered
/// while the lock is held). Returns the transaction and the requests, in `inputs` order.
async fn submit_behind_a_lock(
    stack: &Stack,
    agent: &str,
    inputs: &[String],
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    Vec<tokio::task::JoinHandle<(u16, Value)>>,
) {
    let mut lock = stack.pg.begin().await.unwrap();
    sqlx::query("LOCK TABLE tasks IN SHARE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let requests: Vec<_> = inputs
        .iter()
        .map(|input| {
            let api = stack.api.clone();
            let body = json!({"agent_id": agent, "input": input});
            tokio::spawn(async move {
                api.send(reqwest::Method::POST, "/v1/tasks", Some(body))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let n = inputs.len() as i64;
    kit::wait_for(
        &format!("{n} submissions in the gateway's batches"),
        Duration::from_secs(30),
        || async { batching(stack).await.filter(|&b| b == n) },
    )
    .await
    .unwrap();
    (lock, requests)
}

/// 20 submissions that arrive while the batches' statements wait are stored in at most three
/// statements (two batches in flight at once, then one with all that queued behind them), each
/// task with its own attempt 1 whose spec carries that task's input, each request answered with
/// the ids that were stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_that_queue_up_are_stored_together_each_with_its_own_attempt() {
    let (stack, agent) = queued_stack("batched-submissions").await;
    let inputs: Vec<String> = (0..20).map(|i| format!("task {i}")).collect();
    let (lock, requests) = submit_behind_a_lock(&stack, &agent, &inputs).await;
    lock.rollback().await.unwrap();
    let mut answered = HashMap::new();
    for (input, r) in inputs.iter().zip(requests) {
        let (status, body) = r.await.unwrap();
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["input"], input.as_str(), "{body}");
        assert_eq!(body["status"], "queued", "{body}");
        let attempt = &body["attempts"][0];
        assert_eq!(attempt["number"], 1, "{body}");
        assert_eq!(attempt["task_id"], body["id"], "{body}");
        answered.insert(
            body["id"].as_str().unwrap().to_string(),
            (input.clone(), attempt["id"].as_str().unwrap().to_string()),
        );
    }
    let rows: Vec<(String, String, String, String, String, i64)> = sqlx::query_as(
        "SELECT t.id::text, t.input, a.id::text, a.status, a.spec->>'input',
                (SELECT count(*) FROM attempts x WHERE x.task_id = t.id)
         FROM tasks t JOIN attempts a ON a.task_id = t.id AND a.number = 1
         WHERE t.input LIKE 'task %'",
    )
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert_eq!(rows.len(), 20, "{rows:?}");
    for (task, input, attempt, status, spec_input, attempts) in &rows {
        let (want_input, want_attempt) = &answered[task];
        assert_eq!(input, want_input);
        assert_eq!(attempt, want_attempt);
        assert_eq!(status, "queued");
        assert_eq!(
            spec_input, input,
            "the attempt is planned from its own task"
        );
        assert_eq!(*attempts, 1);
    }
    // One statement is one transaction, whose tasks share its start time.
    let statements: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT created_at) FROM tasks WHERE input LIKE 'task %'",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert!(
        statements <= 3,
        "20 queued submissions took {statements} statements"
    );
    assert_eq!(batching(&stack).await, Some(0));
}

/// A batch PostgreSQL refuses (here a trigger refuses one task's input as a bad value) stores
/// nothing, and each of its submissions is then stored on its own: the refused one is answered
/// 422, every other one 201 with its task and attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_value_fails_only_its_own_submission() {
    let (stack, agent) = queued_stack("batched-refusal").await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_input() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             RAISE EXCEPTION 'refused input' USING ERRCODE = '22023';
         END $$;
         CREATE TRIGGER refuse_input BEFORE INSERT ON tasks FOR EACH ROW
             WHEN (NEW.input = 'refused') EXECUTE FUNCTION refuse_input();",
    )
    .execute(&stack.pg)
    .await
    .unwrap();
    let mut inputs: Vec<String> = (0..9).map(|i| format!("task {i}")).collect();
    inputs.insert(4, "refused".into());
    let (lock, requests) = submit_behind_a_lock(&stack, &agent, &inputs).await;
    lock.rollback().await.unwrap();
    for (input, r) in inputs.iter().zip(requests) {
        let (status, body) = r.await.unwrap();
        if input == "refused" {
            assert_eq!(status, 422, "{body}");
            assert_eq!(body["error"]["code"], "invalid_field", "{body}");
        } else {
            assert_eq!(status, 201, "{body}");
            assert_eq!(body["input"], input.as_str(), "{body}");
        }
    }
    let stored: Vec<(String, i64)> = sqlx::query_as(
        "SELECT t.input, (SELECT count(*) FROM attempts a WHERE a.task_id = t.id)
         FROM tasks t WHERE t.input LIKE 'task %' OR t.input = 'refused' ORDER BY t.input",
    )
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    let want: Vec<(String, i64)> = (0..9).map(|i| (format!("task {i}"), 1)).collect();
    assert_eq!(stored, want);
}
