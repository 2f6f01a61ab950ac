//! Task submissions stored together when they arrive faster than their statements complete.
//!
//! A submission that will be stored queued (no direct dispatch for it, no issue, no idempotency
//! key, and a plan this gateway kept for its agent) joins a queue instead of running
//! `submit_task` on its own. A few runners (at most `submit_batches`) each take what is queued, up to
//! [`MAX_BATCH`], and store each agent's share in one statement (`submit_queued_tasks`,
//! migration 0012): its tasks and their attempts 1, all or none, checked against the plan once.
//! Nobody waits for a batch to fill: a submission that finds a runner free is stored at once, on
//! its own, and a batch is whatever queued up while the runners were busy. Each submission still
//! answers only once its own rows are committed.
//!
//! A batch PostgreSQL refuses (a value of one submission it cannot store, a conflict between
//! transactions) has stored nothing: each of its submissions is then stored on its own, so one
//! request's bad value fails that request only. A batch whose outcome is unknown (the
//! connection failed) is answered with that error, as a submission on its own would be: a
//! retry by the server could store a task twice.

use agentscope_store::first_attempt::{AgentPlan, Plan};
use agentscope_telemetry::health::Metrics;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use uuid::Uuid;

/// Submissions one statement stores at most.
const MAX_BATCH: usize = 64;

/// The gauge of submissions handed to the batches and not answered yet.
const PENDING: &str = "agentscope_submissions_batching";

/// A submission to store queued, resolved by its agent's kept plan.
pub(crate) struct Item {
    pub workspace_id: Uuid,
    pub agent_id: Uuid,
    /// The kept plan it was resolved by: submissions of one plan share a statement.
    pub kept: Arc<AgentPlan>,
    /// Attempt 1's columns as that plan resolves them, but its spec (in `spec`).
    pub plan: Plan,
    pub spec: serde_json::Value,
    pub task_id: Uuid,
    pub attempt_id: Uuid,
    pub repository: Option<String>,
    pub branch: Option<String>,
    pub input: String,
    pub timeout_secs: Option<i32>,
    pub request_hash: Option<String>,
}

/// What became of a submission.
pub(crate) enum Outcome {
    /// Stored, committed, at this `created_at`.
    Stored(chrono::DateTime<chrono::Utc>),
    /// The plan is not the agent's any more: nothing was stored.
    Stale,
    /// PostgreSQL refused its batch and stored nothing: store it on its own.
    Alone,
}

/// A queued submission and where its answer goes.
type Queued = (Item, oneshot::Sender<Result<Outcome, sqlx::Error>>);

#[derive(Default)]
struct Queue {
    items: Vec<Queued>,
    runners: usize,
    /// Queued or being stored, not answered yet.
    pending: usize,
}

/// The submission queue of one gateway.
#[derive(Clone)]
pub(crate) struct Batches {
    queue: Arc<Mutex<Queue>>,
    /// Batches in flight at once, at most.
    runners: usize,
}

impl Batches {
    pub(crate) fn new(runners: usize) -> Batches {
        Batches {
            queue: Default::default(),
            runners: runners.max(1),
        }
    }

    /// Stores `item` with whatever else is queued; answers once it is committed (or refused).
    pub(crate) async fn submit(
        &self,
        db: &agentscope_store::warm::Warm,
        metrics: &Metrics,
        item: Item,
    ) -> Result<Outcome, sqlx::Error> {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.queue.lock().expect("submission queue");
            q.items.push((item, tx));
            q.pending += 1;
            metrics.set(PENDING, &[], q.pending as i64);
            let start = q.runners < self.runners;
            if start {
                q.runners += 1;
            }
            start
        };
        if start {
            tokio::spawn(run(self.clone(), db.clone(), metrics.clone()));
        }
        rx.await.unwrap_or_else(|_| {
            Err(sqlx::Error::Protocol(
                "the submission batch ended without an answer".into(),
            ))
        })
    }
}

/// Counts a runner out of its queue when it ends, whichever way: a runner that ends by a panic
/// drops what is queued (each submission then fails), so that none waits for ever.
struct Running {
    batches: Batches,
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            let mut q = self.batches.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.runners -= 1;
            q.pending -= q.items.len();
            q.items.clear();
        }
    }
}

/// Takes and stores batches until the queue is empty.
async fn run(batches: Batches, db: agentscope_store::warm::Warm, metrics: Metrics) {
    let mut running = Running {
        batches: batches.clone(),
        done: false,
    };
    loop {
        let taken: Vec<Queued> = {
            let mut q = batches.queue.lock().expect("submission queue");
            if q.items.is_empty() {
                // Under the lock a submission checks for a runner: none is left waiting.
                q.runners -= 1;
                running.done = true;
                return;
            }
            let n = q.items.len().min(MAX_BATCH);
            q.items.drain(..n).collect()
        };
        // One statement per plan, in the order they came.
        let mut groups: Vec<Vec<Queued>> = Vec::new();
        for entry in taken {
            let found = groups.iter_mut().find(|g| {
                let (a, b) = (&g[0].0, &entry.0);
                a.workspace_id == b.workspace_id
                    && a.agent_id == b.agent_id
                    && Arc::ptr_eq(&a.kept, &b.kept)
            });
            match found {
                Some(g) => g.push(entry),
                None => groups.push(vec![entry]),
            }
        }
        for group in groups {
            let (items, replies): (Vec<Item>, Vec<_>) = group.into_iter().unzip();
            metrics.inc("agentscope_submission_batches_total", &[]);
            let answer = store(&db, items).await;
            {
                let mut q = batches.queue.lock().expect("submission queue");
                q.pending -= replies.len();
                metrics.set(PENDING, &[], q.pending as i64);
            }
            for reply in replies {
                let _ = reply.send(match &answer {
                    Ok(Some(at)) => Ok(Outcome::Stored(*at)),
                    Ok(None) => Ok(Outcome::Stale),
                    // Refused by PostgreSQL: the statement, and so the batch, stored nothing.
                    Err(sqlx::Error::Database(_)) => Ok(Outcome::Alone),
                    Err(e) => Err(copy_error(e)),
                });
            }
        }
    }
}

/// One plan's submissions in one statement: their `created_at`, or None when the plan is stale.
/// Takes the items apart into the statement's columns (their inputs and specs are not copied).
async fn store(
    db: &agentscope_store::warm::Warm,
    items: Vec<Item>,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, sqlx::Error> {
    let n = items.len();
    let (mut tasks, mut attempts, mut repositories, mut branches, mut inputs) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut timeouts, mut hashes, mut specs) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut items = items.into_iter();
    let first = items.next().expect("a batch has a submission");
    let (workspace_id, agent_id, p) = (first.workspace_id, first.agent_id, first.plan.clone());
    for i in std::iter::once(first).chain(items) {
        tasks.push(i.task_id);
        attempts.push(i.attempt_id);
        repositories.push(i.repository);
        branches.push(i.branch);
        inputs.push(i.input);
        timeouts.push(i.timeout_secs);
        hashes.push(i.request_hash);
        specs.push(i.spec);
    }
    let row = sqlx::query!(
        r#"SELECT r_stale AS "stale!", r_created_at AS created_at
           FROM submit_queued_tasks($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"#,
        workspace_id,
        agent_id,
        p.agent_version_id,
        p.binding_id,
        p.pool_id,
        p.provider.as_deref(),
        &p.required_capabilities,
        &tasks,
        &attempts,
        &repositories as &[Option<String>],
        &branches as &[Option<String>],
        &inputs,
        &timeouts as &[Option<i32>],
        &hashes as &[Option<String>],
        &specs,
    )
    .fetch_one(db)
    .await?;
    Ok(match (row.stale, row.created_at) {
        (false, Some(at)) => Some(at),
        _ => None,
    })
}

/// The batch's error for each of its submissions (sqlx's errors are not `Clone`), keeping what
/// decides the answer: a connection or pool failure stays one.
fn copy_error(e: &sqlx::Error) -> sqlx::Error {
    match e {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}
