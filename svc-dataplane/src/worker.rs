//! Self-hosted Workers, the dataplane's side: an `agentscope worker` process on the customer's
//! machine (`agentscope_tools::worker`) runs a session's file and shell tools while the model
//! loop stays in the dataplane.
//!
//! - The Worker registers on `agentscope.worker.register` with its worker token (kind `worker`);
//!   a dataplane replica answers with its id, stable per workspace and name.
//! - It beats into the KV bucket `agentscope_workers` (key `worker.<id>`, vanishing after
//!   `worker_ttl`); no key means offline, and a session that needs it shows `worker_offline`.
//! - Tool operations arrive as `ToolOperation` requests on `agentscope.worker.<id>.ops` and run
//!   with the same tool code as the `local` environment, in `<dir>/<session_id>`.
//! - Long operations: the Worker acknowledges an operation at once, publishes progress beats on
//!   `agentscope.worker.<id>.progress.<operation_id>` while it runs, then its result there. The
//!   dataplane waits until the tool's timeout plus a margin; when beats stop for `worker_ttl` it
//!   asks by operation id (`query_only`), and only a Worker that does not answer that either is
//!   `worker_offline` (effects unknown). The Worker keeps each result for 30 minutes, so a
//!   dataplane that lost its connection, or a replica that took the session over, gets the
//!   result by asking again; an operation id is never run twice by a Worker.

use crate::tools::ToolOutput;
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{
    ToolOperation, ToolOperationResult, WorkerRegistered, WorkerRegistration,
};
use agentscope_tools::worker::presence_key;
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The id of Worker `name` in `workspace_id`.
pub use agentscope_domain::worker_id;

/// Answers Worker registrations (any replica; queue group `dataplane`, one at a time) until
/// `cancel` fires; an error when the subscription cannot be made or ends.
pub async fn serve_registrations(
    db: sqlx::PgPool,
    nats: async_nats::Client,
    heartbeat_ms: u32,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let at = agentscope_bus::Endpoint {
        subject: agentscope_bus::subjects::WORKER_REGISTER,
        queue_group: "dataplane",
        concurrency: 1,
    };
    // A reply that cannot be sent is not retried: the Worker asks again when its request times
    // out.
    agentscope_bus::serve(
        &nats,
        at,
        cancel.clone(),
        |req: agentscope_bus::Request<WorkerRegistration>| {
            let db = db.clone();
            async move {
                match req.body {
                    Err(_) => refused("malformed WorkerRegistration"),
                    Ok(r) => register(&db, &r, heartbeat_ms).await,
                }
            }
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("subscribe worker registrations: {e}"))?;
    if !cancel.is_cancelled() {
        anyhow::bail!("the subscription to worker registrations ended");
    }
    Ok(())
}

fn refused(why: &str) -> WorkerRegistered {
    WorkerRegistered {
        ok: false,
        error: why.to_string(),
        ..Default::default()
    }
}

async fn register(
    db: &sqlx::PgPool,
    r: &WorkerRegistration,
    heartbeat_ms: u32,
) -> WorkerRegistered {
    let valid_name =
        !r.name.is_empty() && r.name.len() <= 200 && !r.name.chars().any(|c| c.is_control());
    if !valid_name {
        return refused("the worker name must be 1 to 200 printable characters");
    }
    if !r
        .worker_token
        .starts_with(agentscope_domain::TokenKind::Worker.prefix())
    {
        return refused("not a worker token (agw_...)");
    }
    let found: Result<Option<Uuid>, _> = sqlx::query_scalar!(
        "SELECT workspace_id FROM api_tokens WHERE token_hash = $1 AND kind = 'worker' AND revoked_at IS NULL",
        agentscope_domain::hash_token(&r.worker_token),
    )
    .fetch_optional(db)
    .await;
    match found {
        Ok(Some(ws)) => {
            let id = worker_id(&ws.to_string(), &r.name);
            tracing::info!(worker_id = %id, name = %r.name, workspace_id = %ws, "worker registered");
            WorkerRegistered {
                ok: true,
                worker_id: id,
                workspace_id: ws.to_string(),
                error: String::new(),
                heartbeat_ms,
            }
        }
        Ok(None) => refused("unknown or revoked worker token"),
        Err(e) => {
            tracing::warn!(error = %e, "worker registration");
            refused("the dataplane could not check the token; retry")
        }
    }
}

/// The operation id of `tool` for call `call_id` of `session_id`: the same on every replica, so
/// a replica that took the session over asks the Worker about the very operation the first one
/// sent (a call's `read_file` and `write_file`, as in `materialize`, are different operations).
pub fn operation_id(session_id: Uuid, call_id: &str, tool: &str) -> String {
    agentscope_domain::hash_token(&format!("agentscope-op:{session_id}:{tool}:{call_id}"))[..32]
        .to_string()
}

/// How long the dataplane waits for the Worker's acknowledgement of one request.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Beyond the tool's own timeout (which the Worker enforces), how long a running operation may
/// take to report its result.
const DEADLINE_MARGIN: Duration = Duration::from_secs(15);

/// The dataplane's handle on one Worker.
#[derive(Clone)]
pub struct WorkerLink {
    pub nats: async_nats::Client,
    pub workers: kv::Store,
    pub worker_id: String,
    pub name: String,
    /// A Worker silent this long is offline (`worker_ttl_ms`); it beats three times as often.
    pub ttl: Duration,
}

#[derive(Debug)]
pub enum LinkError {
    /// No heartbeat, or nobody listening: nothing was delivered.
    Offline,
    /// Sent, but no answer came: the operation may or may not have run.
    Lost(String),
    /// A query only: the Worker never received this operation (or no longer remembers it).
    Unknown,
}

/// What one request to the Worker got back.
enum Reply {
    Done(ToolOutput),
    Running,
    Unknown,
}

fn reply_of(r: &ToolOperationResult) -> Reply {
    match r.state.as_str() {
        "running" => Reply::Running,
        "unknown" => Reply::Unknown,
        // "done", or an older Worker that answers with the result only.
        _ => Reply::Done(ToolOutput {
            output: r.output.clone(),
            is_error: !r.ok,
        }),
    }
}

impl WorkerLink {
    pub async fn online(&self) -> bool {
        matches!(
            self.workers.entry(presence_key(&self.worker_id)).await,
            Ok(Some(e)) if e.operation == kv::Operation::Put
        )
    }

    fn beat(&self) -> Duration {
        (self.ttl / 3).max(Duration::from_millis(100))
    }

    /// Sends `op` and waits for the acknowledgement (an explicit timeout, never the client's
    /// default).
    async fn ask(&self, op: &ToolOperation) -> Result<Reply, async_nats::RequestError> {
        let m = self
            .nats
            .send_request(
                agentscope_bus::subjects::worker_ops(&self.worker_id),
                async_nats::Request::new()
                    .payload(op.encode_to_vec().into())
                    .timeout(Some(ACK_TIMEOUT)),
            )
            .await?;
        Ok(match ToolOperationResult::decode(m.payload.as_ref()) {
            Ok(r) => reply_of(&r),
            // Something answered, but not a Worker: treat it as a silent one.
            Err(_) => Reply::Running,
        })
    }

    /// Runs one tool operation on the Worker (`operation_id` from [`operation_id`]). The Worker
    /// acknowledges at once and beats while it runs; the call waits until the result, the
    /// tool's timeout plus a margin, or a Worker that stopped beating and does not answer a
    /// query either (then `Lost`: its effects are unknown).
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        session_id: Uuid,
        operation_id: &str,
        tool: &str,
        input: &serde_json::Value,
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<ToolOutput, LinkError> {
        if !self.online().await {
            return Err(LinkError::Offline);
        }
        let op = ToolOperation {
            operation_id: operation_id.to_string(),
            session_id: session_id.to_string(),
            tool: tool.to_string(),
            input_json: input.to_string(),
            env: env.iter().cloned().collect(),
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
            query_only: false,
            beat_ms: self.beat().as_millis() as u32,
        };
        self.follow(op, timeout).await
    }

    /// What became of an operation a replica sent before this one took the session over: its
    /// result (waiting while it still runs), or `Unknown` when the Worker never received it. It
    /// is never run by this call.
    pub async fn recover(
        &self,
        session_id: Uuid,
        operation_id: &str,
        timeout: Duration,
    ) -> Result<ToolOutput, LinkError> {
        let op = ToolOperation {
            operation_id: operation_id.to_string(),
            session_id: session_id.to_string(),
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
            query_only: true,
            beat_ms: self.beat().as_millis() as u32,
            ..Default::default()
        };
        self.follow(op, timeout).await
    }

    async fn follow(&self, op: ToolOperation, timeout: Duration) -> Result<ToolOutput, LinkError> {
        let deadline = tokio::time::Instant::now() + timeout + DEADLINE_MARGIN;
        // Subscribed before the request, so a quick result is not missed.
        let mut progress = match self
            .nats
            .subscribe(agentscope_bus::subjects::worker_progress(
                &self.worker_id,
                &op.operation_id,
            ))
            .await
        {
            Ok(s) => s,
            // Nothing was sent yet.
            Err(_) if !op.query_only => return Err(LinkError::Offline),
            Err(e) => return Err(LinkError::Lost(format!("subscribe to its progress: {e}"))),
        };
        let silence = self.ttl.max(Duration::from_millis(300));
        let mut failing_since: Option<tokio::time::Instant> = None;
        let mut next_check = tokio::time::Instant::now() + silence;
        match self.ask(&op).await {
            Ok(Reply::Done(out)) => return Ok(out),
            Ok(Reply::Unknown) => return Err(LinkError::Unknown),
            Ok(Reply::Running) => {}
            // Nobody subscribed: the operation was certainly not delivered.
            Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                return Err(if op.query_only {
                    LinkError::Lost("the worker is not connected".into())
                } else {
                    LinkError::Offline
                });
            }
            // It may have arrived: from now on the Worker is only asked about it.
            Err(e) => {
                tracing::warn!(worker = %self.name, operation_id = %op.operation_id, error = %e, "no acknowledgement; asking again");
                failing_since = Some(tokio::time::Instant::now());
                next_check = tokio::time::Instant::now() + self.beat();
            }
        }
        let query = ToolOperation {
            query_only: true,
            input_json: String::new(),
            env: Default::default(),
            ..op
        };
        loop {
            tokio::select! {
                m = progress.next() => {
                    let Some(m) = m else {
                        return Err(LinkError::Lost("the progress subscription ended".into()));
                    };
                    match ToolOperationResult::decode(m.payload.as_ref()).map(|r| reply_of(&r)) {
                        Ok(Reply::Done(out)) => return Ok(out),
                        Ok(_) => {
                            failing_since = None;
                            next_check = tokio::time::Instant::now() + silence;
                        }
                        Err(_) => {}
                    }
                }
                _ = tokio::time::sleep_until(next_check.min(deadline)) => {
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        return Err(LinkError::Lost(format!(
                            "no result within the tool's timeout of {} s and a margin of {} s",
                            timeout.as_secs(),
                            DEADLINE_MARGIN.as_secs()
                        )));
                    }
                    // No beat for a while: ask (a lost connection, a result published while
                    // this replica was away) before calling the Worker gone.
                    match self.ask(&query).await {
                        Ok(Reply::Done(out)) => return Ok(out),
                        Ok(Reply::Running) => {
                            failing_since = None;
                            next_check = now + silence;
                        }
                        Ok(Reply::Unknown) => {
                            return Err(LinkError::Lost(
                                "the worker no longer knows this operation (it restarted)".into(),
                            ));
                        }
                        Err(e) => {
                            let since = *failing_since.get_or_insert(now);
                            if now.duration_since(since) >= silence {
                                return Err(LinkError::Lost(format!(
                                    "no progress for {} s and no answer when asked: {e}",
                                    (now.duration_since(since) + silence).as_secs()
                                )));
                            }
                            next_check = now + self.beat();
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_stable_per_workspace_and_name() {
        assert_eq!(worker_id("w", "laptop"), worker_id("w", "laptop"));
        assert_ne!(worker_id("w", "laptop"), worker_id("w2", "laptop"));
        assert_ne!(worker_id("w", "laptop"), worker_id("w", "desk"));
        assert_eq!(worker_id("w", "laptop").len(), 32);
    }

    #[test]
    fn operation_ids_are_the_same_on_every_replica_and_distinct_per_call_and_tool() {
        let s = Uuid::now_v7();
        let id = operation_id(s, "toolu_1", "shell");
        assert_eq!(id, operation_id(s, "toolu_1", "shell"));
        assert_ne!(id, operation_id(s, "toolu_2", "shell"));
        assert_ne!(id, operation_id(s, "toolu_1", "read_file"));
        assert_ne!(id, operation_id(Uuid::now_v7(), "toolu_1", "shell"));
        // A subject token, whatever the call id holds.
        let odd = operation_id(s, "materialize:notes.md", "write_file");
        assert_eq!(odd.len(), 32);
        assert!(odd.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
