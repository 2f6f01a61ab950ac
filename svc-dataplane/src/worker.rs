//! Self-hosted Workers: an `agentscope worker` process on the customer's machine runs a
//! session's file and shell tools while the model loop stays in the dataplane.
//!
//! - The Worker registers on `agentscope.worker.register` with its worker token (kind `worker`);
//!   a dataplane replica answers with its id, stable per workspace and name.
//! - It beats into the KV bucket `agentscope_workers` (key `worker.<id>`, vanishing after
//!   `worker_ttl`); no key means offline, and a session that needs it shows `worker_offline`.
//! - Tool operations arrive as `ToolOperation` requests on `agentscope.worker.<id>.ops` and run
//!   with the same tool code as the `local` environment, in `<dir>/<session_id>`.

use crate::env::{Environment, Limits};
use crate::tools::{self, ToolOutput};
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{
    ToolOperation, ToolOperationResult, WorkerHeartbeat, WorkerRegistered, WorkerRegistration,
};
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The id of Worker `name` in `workspace_id`.
pub use agentscope_domain::worker_id;

fn key(worker_id: &str) -> String {
    format!("worker.{worker_id}")
}

/// Answers Worker registrations (any replica; queue group `dataplane`).
pub async fn serve_registrations(
    db: sqlx::PgPool,
    nats: async_nats::Client,
    heartbeat_ms: u32,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut sub = nats
        .queue_subscribe(
            agentscope_bus::subjects::WORKER_REGISTER,
            "dataplane".into(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("subscribe worker registrations: {e}"))?;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            m = sub.next() => match m { Some(m) => m, None => return Ok(()) },
        };
        let Some(reply) = msg.reply.clone() else {
            continue;
        };
        let answer = match WorkerRegistration::decode(msg.payload.as_ref()) {
            Err(_) => refused("malformed WorkerRegistration"),
            Ok(r) => register(&db, &r, heartbeat_ms).await,
        };
        let _ = nats.publish(reply, answer.encode_to_vec().into()).await;
    }
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
    let found: Result<Option<(Uuid,)>, _> = sqlx::query_as(
        "SELECT workspace_id FROM api_tokens WHERE token_hash = $1 AND kind = 'worker' AND revoked_at IS NULL",
    )
    .bind(agentscope_domain::hash_token(&r.worker_token))
    .fetch_optional(db)
    .await;
    match found {
        Ok(Some((ws,))) => {
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

/// The dataplane's handle on one Worker.
#[derive(Clone)]
pub struct WorkerLink {
    pub nats: async_nats::Client,
    pub workers: kv::Store,
    pub worker_id: String,
    pub name: String,
}

#[derive(Debug)]
pub enum LinkError {
    /// No heartbeat, or nobody listening: nothing was delivered.
    Offline,
    /// Sent, but no answer came: the operation may or may not have run.
    Lost(String),
}

impl WorkerLink {
    pub async fn online(&self) -> bool {
        matches!(
            self.workers.entry(key(&self.worker_id)).await,
            Ok(Some(e)) if e.operation == kv::Operation::Put
        )
    }

    /// Runs one tool operation on the Worker.
    pub async fn run(
        &self,
        session_id: Uuid,
        tool: &str,
        input: &serde_json::Value,
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<ToolOutput, LinkError> {
        if !self.online().await {
            return Err(LinkError::Offline);
        }
        let op = ToolOperation {
            operation_id: Uuid::now_v7().to_string(),
            session_id: session_id.to_string(),
            tool: tool.to_string(),
            input_json: input.to_string(),
            env: env.iter().cloned().collect(),
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
        };
        let reply = tokio::time::timeout(
            timeout + Duration::from_secs(10),
            self.nats.request(
                agentscope_bus::subjects::worker_ops(&self.worker_id),
                op.encode_to_vec().into(),
            ),
        )
        .await;
        let msg = match reply {
            Ok(Ok(m)) => m,
            // Nobody subscribed: the operation was certainly not delivered.
            Ok(Err(e)) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                return Err(LinkError::Offline);
            }
            Ok(Err(e)) => return Err(LinkError::Lost(e.to_string())),
            Err(_) => return Err(LinkError::Lost("no answer before the deadline".into())),
        };
        let r = ToolOperationResult::decode(msg.payload.as_ref())
            .map_err(|_| LinkError::Lost("unreadable answer from the worker".into()))?;
        Ok(ToolOutput {
            output: r.output,
            is_error: !r.ok,
        })
    }
}

/// A Worker accepts a NATS server without authentication only on a development install
/// (AGENTSCOPE_NATS_ALLOW_OPEN=true).
fn allow_open_nats() -> bool {
    std::env::var("AGENTSCOPE_NATS_ALLOW_OPEN").is_ok_and(|v| v == "true" || v == "1")
}

/// The `agentscope worker` process: registers, beats, and runs tool operations in `dir`.
pub async fn run_worker(
    nats_url: &str,
    token: &str,
    name: &str,
    dir: PathBuf,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let nats = agentscope_bus::connect(
        nats_url,
        "agentscope-worker",
        &agentscope_bus::Credentials::Worker {
            name: name.to_string(),
            token: token.to_string(),
        },
        allow_open_nats(),
    )
    .await?;
    let registration = WorkerRegistration {
        worker_token: token.to_string(),
        name: name.to_string(),
        version: env!("CARGO_PKG_VERSION").into(),
    };
    let mut delay = Duration::from_millis(200);
    let registered = loop {
        match nats
            .request(
                agentscope_bus::subjects::WORKER_REGISTER,
                registration.encode_to_vec().into(),
            )
            .await
        {
            Ok(m) => {
                let r = WorkerRegistered::decode(m.payload.as_ref())
                    .map_err(|_| anyhow::anyhow!("unreadable registration answer"))?;
                if !r.ok {
                    anyhow::bail!("registration refused: {}", r.error);
                }
                break r;
            }
            Err(e) => {
                tracing::warn!(error = %e, "no dataplane answered the registration; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    };
    let js = async_nats::jetstream::new(nats.clone());
    let workers =
        agentscope_bus::Topology::open_bucket(&js, agentscope_bus::BUCKET_WORKERS).await?;
    let id = registered.worker_id.clone();
    let beat = Duration::from_millis(registered.heartbeat_ms.max(100) as u64);
    let heartbeat = |at: i64| WorkerHeartbeat {
        worker_id: id.clone(),
        name: name.to_string(),
        at_ms: at,
    };
    workers
        .put(
            key(&id),
            heartbeat(agentscope_bus::now_ms()).encode_to_vec().into(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("first heartbeat: {e}"))?;
    let mut ops = nats
        .subscribe(agentscope_bus::subjects::worker_ops(&id))
        .await
        .map_err(|e| anyhow::anyhow!("subscribe to operations: {e}"))?;
    tracing::info!(worker_id = %id, %name, dir = %dir.display(), "worker ready");
    println!("worker {name} ready as {id}");
    let mut ticker = tokio::time::interval(beat);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = workers.purge(key(&id)).await;
                return Ok(());
            }
            _ = ticker.tick() => {
                if let Err(e) = workers.put(key(&id), heartbeat(agentscope_bus::now_ms()).encode_to_vec().into()).await {
                    tracing::warn!(error = %e, "heartbeat");
                }
            }
            m = ops.next() => {
                let Some(m) = m else { return Ok(()) };
                let nats = nats.clone();
                let dir = dir.clone();
                tokio::spawn(async move {
                    let Some(reply) = m.reply.clone() else { return };
                    let result = serve_op(&dir, m.payload.as_ref()).await;
                    let _ = nats.publish(reply, result.encode_to_vec().into()).await;
                });
            }
        }
    }
}

async fn serve_op(dir: &std::path::Path, payload: &[u8]) -> ToolOperationResult {
    let Ok(op) = ToolOperation::decode(payload) else {
        return ToolOperationResult {
            ok: false,
            output: "malformed ToolOperation".into(),
            error_code: "bad_request".into(),
            ..Default::default()
        };
    };
    // The session id names the directory: a UUID, never a path.
    let Ok(session) = op.session_id.parse::<Uuid>() else {
        return ToolOperationResult {
            operation_id: op.operation_id,
            ok: false,
            output: "session_id is not a UUID".into(),
            error_code: "bad_request".into(),
        };
    };
    let root = dir.join(session.to_string());
    if let Err(e) = tokio::fs::create_dir_all(&root).await {
        return ToolOperationResult {
            operation_id: op.operation_id,
            ok: false,
            output: format!("io: create {}: {e}", root.display()),
            error_code: "io".into(),
        };
    }
    let input: serde_json::Value =
        serde_json::from_str(&op.input_json).unwrap_or(serde_json::Value::Null);
    let limits = Limits {
        timeout: Duration::from_millis(op.timeout_ms.max(1000) as u64),
        max_output: tools::MAX_OUTPUT,
        max_file: 4 * 1024 * 1024,
        memory_bytes: None,
        max_processes: None,
        cpu_secs: None,
    };
    let env: Vec<(String, String)> = op.env.into_iter().collect();
    let out = tools::run(
        &Environment::Local {
            root,
            identity: None,
        },
        &limits,
        &op.tool,
        &input,
        &env,
    )
    .await;
    ToolOperationResult {
        operation_id: op.operation_id,
        ok: !out.is_error,
        output: out.output,
        error_code: String::new(),
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
}
