//! Self-hosted Workers: an `agentscope worker` process on the customer's machine runs a
//! session's file and shell tools while the model loop stays in the dataplane.
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

use crate::env::{Environment, Limits, ToolError};
use crate::tools::{self, ToolOutput};
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{
    ToolOperation, ToolOperationResult, WorkerHeartbeat, WorkerRegistered, WorkerRegistration,
};
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
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
/// How long a Worker keeps the result of an operation for a dataplane that asks again.
const RESULT_RETENTION: Duration = Duration::from_secs(30 * 60);

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
            self.workers.entry(key(&self.worker_id)).await,
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

/// Where and how this Worker runs sessions' operations, settled once at start-up: the
/// directory, the uids a root Worker gives its sessions (AGENTSCOPE_WORKER_SESSION_UIDS, default
/// 800000-865535, apart from the dataplane's and the hosts' ranges), the bubblewrap sandbox
/// (AGENTSCOPE_WORKER_SANDBOX `off` runs operations unsandboxed, still under each session's uid
/// when root; otherwise AGENTSCOPE_BWRAP_PATH or /usr/bin/bwrap when installed), and each
/// session's prepared directory and identity.
struct Sessions {
    dir: PathBuf,
    uids: crate::env::UidRange,
    sandbox: Option<std::sync::Arc<crate::env::SandboxSpec>>,
    prepared: Mutex<HashMap<Uuid, (PathBuf, Option<crate::env::Identity>)>>,
}

impl Sessions {
    fn new(dir: PathBuf) -> Sessions {
        let uids = std::env::var("AGENTSCOPE_WORKER_SESSION_UIDS")
            .ok()
            .and_then(|v| crate::env::UidRange::parse(&v).ok())
            .unwrap_or_else(|| {
                crate::env::UidRange::parse("800000-865535").expect("a valid range")
            });
        let bwrap = PathBuf::from(
            std::env::var("AGENTSCOPE_BWRAP_PATH").unwrap_or_else(|_| "/usr/bin/bwrap".into()),
        );
        let off = std::env::var("AGENTSCOPE_WORKER_SANDBOX").is_ok_and(|v| v == "off");
        let sandbox = (!off && bwrap.exists()).then(|| {
            std::sync::Arc::new(crate::env::SandboxSpec {
                bwrap,
                etc_dir: dir.join(".etc"),
                extra_ro: vec![],
                limit_mode: crate::env::LimitMode::Rlimits,
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
                    crate::env::prepare_session_dir(&me.dir, session, me.uids)
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
    let operations = SharedOperations::default();
    let sessions = Arc::new(Sessions::new(dir));
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
        max_output: tools::MAX_OUTPUT,
        max_file: 4 * 1024 * 1024,
        memory_bytes: None,
        max_processes: None,
        cpu_secs: None,
    };
    let env: Vec<(String, String)> = op.env.into_iter().collect();
    let out = tools::run(&environment, &limits, &op.tool, &input, &env).await;
    ToolOperationResult {
        operation_id: op.operation_id,
        ok: !out.is_error,
        output: out.output,
        error_code: String::new(),
        state: "done".into(),
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
