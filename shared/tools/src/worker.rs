//! The self-hosted Worker (`agentscope worker`): registers with a worker token, beats into its
//! presence key and runs the file and shell operations the dataplane sends it, in
//! `<dir>/<session_id>`, with the same tool code and sandbox as the dataplane's own
//! environments. The dataplane's side of the protocol (registration, `WorkerLink`) is in
//! svc-dataplane's `worker.rs`; the protocol itself:
//!
//! - The Worker registers on `agentscope.worker.register` with its worker token (kind `worker`);
//!   a dataplane replica answers with its id, stable per workspace and name.
//! - It beats into the KV bucket `agentscope_workers` (key [`presence_key`], vanishing after
//!   `worker_ttl`); no key means offline.
//! - Tool operations arrive as `ToolOperation` requests on `agentscope.worker.<id>.ops`.
//! - Long operations: the Worker acknowledges an operation at once, publishes progress beats on
//!   `agentscope.worker.<id>.progress.<operation_id>` while it runs, then its result there. It
//!   keeps each result for 30 minutes, so a dataplane that lost its connection, or a replica
//!   that took the session over, gets the result by asking again (`query_only`); an operation id
//!   is never run twice by a Worker.

use crate::env::{self, Environment, Limits, ToolError};
use crate::ops;
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{
    ToolOperation, ToolOperationResult, WorkerHeartbeat, WorkerRegistered, WorkerRegistration,
};
use futures::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The Worker's presence key in the bucket `agentscope_workers`.
pub fn presence_key(worker_id: &str) -> String {
    format!("worker.{worker_id}")
}

/// How long a Worker keeps the result of an operation for a dataplane that asks again.
const RESULT_RETENTION: Duration = Duration::from_secs(30 * 60);

/// Where and how this Worker runs sessions' operations, settled once at start-up: the
/// directory, the uids a root Worker gives its sessions (AGENTSCOPE_WORKER_SESSION_UIDS, default
/// 800000-865535, apart from the dataplane's and the hosts' ranges), the bubblewrap sandbox
/// (AGENTSCOPE_WORKER_SANDBOX `off` runs operations unsandboxed, still under each session's uid
/// when root; otherwise AGENTSCOPE_BWRAP_PATH or /usr/bin/bwrap when installed), and each
/// session's prepared directory and identity.
struct Sessions {
    dir: PathBuf,
    uids: env::UidRange,
    sandbox: Option<std::sync::Arc<env::SandboxSpec>>,
    prepared: Mutex<HashMap<Uuid, (PathBuf, Option<env::Identity>)>>,
}

impl Sessions {
    fn new(dir: PathBuf) -> Sessions {
        let uids = std::env::var("AGENTSCOPE_WORKER_SESSION_UIDS")
            .ok()
            .and_then(|v| env::UidRange::parse(&v).ok())
            .unwrap_or_else(|| env::UidRange::parse("800000-865535").expect("a valid range"));
        let bwrap = PathBuf::from(
            std::env::var("AGENTSCOPE_BWRAP_PATH").unwrap_or_else(|_| "/usr/bin/bwrap".into()),
        );
        let off = std::env::var("AGENTSCOPE_WORKER_SANDBOX").is_ok_and(|v| v == "off");
        let sandbox = (!off && bwrap.exists()).then(|| {
            std::sync::Arc::new(env::SandboxSpec {
                bwrap,
                etc_dir: dir.join(".etc"),
                extra_ro: vec![],
                limit_mode: env::LimitMode::Rlimits,
            })
        });
        Sessions {
            dir,
            uids,
            sandbox,
            prepared: Mutex::new(HashMap::new()),
        }
    }

    /// The environment of `session`'s operations; its directory and identity are prepared on
    /// its first operation.
    async fn environment(self: &Arc<Self>, session: Uuid) -> Result<Environment, ToolError> {
        let known = self
            .prepared
            .lock()
            .expect("sessions lock")
            .get(&session)
            .cloned();
        let (root, identity) = match known {
            Some(p) => p,
            None => {
                let me = self.clone();
                let p = tokio::task::spawn_blocking(move || {
                    env::prepare_session_dir(&me.dir, session, me.uids)
                })
                .await
                .map_err(|e| ToolError::Failed {
                    code: "io",
                    message: format!("prepare the session directory: {e}"),
                })??;
                self.prepared
                    .lock()
                    .expect("sessions lock")
                    .insert(session, p.clone());
                p
            }
        };
        Ok(match &self.sandbox {
            Some(spec) => Environment::Sandbox {
                root,
                identity,
                spec: spec.clone(),
            },
            None => Environment::Local { root, identity },
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
            presence_key(&id),
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
    let operations = SharedOperations::default();
    let sessions = Arc::new(Sessions::new(dir));
    let mut ticker = tokio::time::interval(beat);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = workers.purge(presence_key(&id)).await;
                return Ok(());
            }
            _ = ticker.tick() => {
                if let Err(e) = workers.put(presence_key(&id), heartbeat(agentscope_bus::now_ms()).encode_to_vec().into()).await {
                    tracing::warn!(error = %e, "heartbeat");
                }
            }
            m = ops.next() => {
                let Some(m) = m else { return Ok(()) };
                let Some(reply) = m.reply.clone() else { continue };
                let answer = accept(&nats, &id, &sessions, &operations, m.payload.as_ref());
                if let Err(e) = nats.publish(reply, answer.encode_to_vec().into()).await {
                    tracing::warn!(error = %e, "answer an operation");
                }
            }
        }
    }
}

/// What a Worker knows of the operations it was sent, by operation id.
#[derive(Default)]
struct Operations {
    map: std::collections::HashMap<String, Known>,
}

enum Known {
    Running,
    Done(ToolOperationResult, std::time::Instant),
}

type SharedOperations = std::sync::Arc<std::sync::Mutex<Operations>>;

fn done(mut r: ToolOperationResult) -> ToolOperationResult {
    r.state = "done".into();
    r
}

/// Answers one operation request at once: the stored result, "running" (started now, or
/// already), or "unknown" for a query about an operation never received. An operation id is run
/// at most once per Worker process.
fn accept(
    nats: &async_nats::Client,
    worker_id: &str,
    sessions: &Arc<Sessions>,
    operations: &SharedOperations,
    payload: &[u8],
) -> ToolOperationResult {
    let Ok(op) = ToolOperation::decode(payload) else {
        return done(ToolOperationResult {
            ok: false,
            output: "malformed ToolOperation".into(),
            error_code: "bad_request".into(),
            ..Default::default()
        });
    };
    // The id names a subject token.
    if op.operation_id.is_empty()
        || op.operation_id.len() > 64
        || !op
            .operation_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return done(ToolOperationResult {
            ok: false,
            output: "operation_id must be 1 to 64 letters, digits, `-` or `_`".into(),
            error_code: "bad_request".into(),
            ..Default::default()
        });
    }
    let id = op.operation_id.clone();
    let status = |state: &str| ToolOperationResult {
        operation_id: id.clone(),
        state: state.into(),
        ..Default::default()
    };
    {
        let mut known = operations.lock().expect("operations lock");
        known.map.retain(|_, k| match k {
            Known::Done(_, at) => at.elapsed() < RESULT_RETENTION,
            Known::Running => true,
        });
        match known.map.get(&op.operation_id) {
            Some(Known::Done(r, _)) => return r.clone(),
            Some(Known::Running) => return status("running"),
            None if op.query_only => return status("unknown"),
            None => {
                known.map.insert(op.operation_id.clone(), Known::Running);
            }
        }
    }
    let nats = nats.clone();
    let operations = operations.clone();
    let subject = agentscope_bus::subjects::worker_progress(worker_id, &op.operation_id);
    let sessions = sessions.clone();
    let beat = Duration::from_millis(if op.beat_ms == 0 {
        1000
    } else {
        op.beat_ms.max(100)
    } as u64);
    let operation_id = op.operation_id.clone();
    let running = status("running").encode_to_vec();
    let accepted = status("running");
    tokio::spawn(async move {
        let work = serve_op(&sessions, op);
        tokio::pin!(work);
        let mut ticker = tokio::time::interval(beat);
        ticker.tick().await;
        let result = loop {
            tokio::select! {
                r = &mut work => break done(r),
                _ = ticker.tick() => {
                    let _ = nats.publish(subject.clone(), running.clone().into()).await;
                }
            }
        };
        operations.lock().expect("operations lock").map.insert(
            operation_id,
            Known::Done(result.clone(), std::time::Instant::now()),
        );
        if let Err(e) = nats.publish(subject, result.encode_to_vec().into()).await {
            tracing::warn!(error = %e, "publish an operation's result; it is kept for a query");
        }
    });
    accepted
}

async fn serve_op(sessions: &Arc<Sessions>, op: ToolOperation) -> ToolOperationResult {
    // The session id names the directory: a UUID, never a path.
    let Ok(session) = op.session_id.parse::<Uuid>() else {
        return ToolOperationResult {
            operation_id: op.operation_id,
            ok: false,
            output: "session_id is not a UUID".into(),
            error_code: "bad_request".into(),
            ..Default::default()
        };
    };
    // Each session's operations run under its own identity (when the Worker is root) and, where
    // bubblewrap is installed, in the same sandbox as the dataplane's: one session's commands
    // cannot read another's directory on this machine.
    let environment = match sessions.environment(session).await {
        Ok(e) => e,
        Err(e) => {
            return ToolOperationResult {
                operation_id: op.operation_id,
                ok: false,
                output: e.to_string(),
                error_code: e.code().into(),
                ..Default::default()
            };
        }
    };
    let input: serde_json::Value =
        serde_json::from_str(&op.input_json).unwrap_or(serde_json::Value::Null);
    let limits = Limits {
        timeout: Duration::from_millis(op.timeout_ms.max(1000) as u64),
        max_output: ops::MAX_OUTPUT,
        max_file: 4 * 1024 * 1024,
        memory_bytes: None,
        max_processes: None,
        cpu_secs: None,
    };
    let env: Vec<(String, String)> = op.env.into_iter().collect();
    let out = ops::run(&environment, &limits, &op.tool, &input, &env).await;
    ToolOperationResult {
        operation_id: op.operation_id,
        ok: !out.is_error,
        output: out.output,
        error_code: String::new(),
        state: "done".into(),
    }
}
