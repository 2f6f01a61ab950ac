//! The managed loop: one replica at a time works on a session (a lease in KV, fenced in
//! PostgreSQL), turning each submitted input into model turns and tool calls until the model
//! answers without tools, `max_iters` is reached, or the model cannot be reached.
//!
//! Durability: every message, tool call and event is written in a transaction that first checks
//! the replica's fencing token. A tool call is journaled `started` before it runs and
//! `completed` with its result message in one transaction after. A replica that takes a session
//! over rebuilds it from the journal: a completed call is never run again; a call left `started`
//! is reported to the model as interrupted, never silently repeated.

use crate::Config;
use crate::env::{Environment, Limits, SandboxSpec, UidRange};
use crate::model::{self, Message, ModelConfig, ModelError, ToolCallReq};
use crate::policy::{Decision, Policy};
use crate::tools::{self, ToolOutput};
use agentscope_schemas::v1::issue_write::What;
use async_nats::jetstream::kv;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub struct Runner {
    pub db: sqlx::PgPool,
    pub nats: async_nats::Client,
    /// Self-hosted Worker heartbeats.
    pub workers: kv::Store,
    pub js: async_nats::jetstream::Context,
    pub leases: kv::Store,
    /// Woken by nudges (new input, a decided approval).
    news: tokio::sync::Notify,
    vault: Option<agentscope_domain::vault::Keyring>,
    /// The E2B backend of `sandbox`, when configured.
    e2b: Option<crate::e2b::E2b>,
    /// This replica's E2B sandbox of each session.
    sandboxes: tokio::sync::Mutex<std::collections::HashMap<Uuid, crate::e2b::Sandbox>>,
    pub http: reqwest::Client,
    pub config: Arc<Config>,
    pub replica: String,
    active: Mutex<HashSet<Uuid>>,
    /// Fired on SIGTERM: sessions stop at their next await point and hand their lease back.
    pub stopping: CancellationToken,
    /// Every session this replica works on, awaited (within a grace period) at shutdown.
    pub sessions: tokio_util::task::TaskTracker,
    /// The bubblewrap sandbox's settings (shared by every sandbox session).
    sandbox: Arc<SandboxSpec>,
    uids: UidRange,
}

#[derive(Debug)]
enum Stop {
    /// Another replica took the session over (its fencing token moved on).
    Fenced,
    Db(sqlx::Error),
    /// This replica's lease could not be renewed.
    Lost,
    /// This replica stops (SIGTERM): the session is handed back.
    Shutdown,
}

impl From<sqlx::Error> for Stop {
    fn from(e: sqlx::Error) -> Self {
        Stop::Db(e)
    }
}

/// What a session runs with, resolved once from its pinned agent version.
struct Pinned {
    workspace_id: Uuid,
    instructions: String,
    model: String,
    enabled: Vec<String>,
    policy: Policy,
    max_iters: u32,
    env: Environment,
    /// `self_hosted`: the Worker that runs the file and shell tools.
    worker: Option<crate::worker::WorkerLink>,
    /// `sandbox` on the E2B backend.
    e2b: bool,
    /// The definition's files, written into the session directory when it is new.
    files: Vec<(String, String)>,
    /// Why this replica refuses to run the session's tools (`environment_not_allowed: ...`).
    refused: Option<String>,
}

pub fn lease_key(session_id: Uuid) -> String {
    format!("session.{session_id}")
}

impl Runner {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        db: sqlx::PgPool,
        nats: async_nats::Client,
        workers: kv::Store,
        js: async_nats::jetstream::Context,
        leases: kv::Store,
        config: Arc<Config>,
        replica: String,
        limit_mode: crate::env::LimitMode,
    ) -> Arc<Self> {
        // One connection pool for the model and E2B.
        let http = reqwest::Client::new();
        Arc::new(Runner {
            db,
            nats,
            workers,
            js,
            leases,
            news: tokio::sync::Notify::new(),
            vault: agentscope_domain::vault::Keyring::parse(&config.vault_keys.0)
                .ok()
                .flatten(),
            e2b: (config.sandbox_backend == "e2b").then(|| crate::e2b::E2b {
                http: http.clone(),
                api_url: config.e2b_api_url.clone(),
                api_key: config.e2b_api_key.0.clone(),
                template: config.e2b_template.clone(),
                domain: config.e2b_domain.clone(),
            }),
            sandboxes: Default::default(),
            http,
            sandbox: Arc::new(SandboxSpec {
                bwrap: PathBuf::from(&config.bwrap_path),
                etc_dir: PathBuf::from(&config.sessions_dir).join(".etc"),
                extra_ro: config.ro_paths(),
                limit_mode,
            }),
            uids: UidRange::parse(&config.session_uids).unwrap_or(UidRange {
                first: 700_000,
                last: 765_535,
            }),
            config,
            replica,
            active: Mutex::new(HashSet::new()),
            stopping: CancellationToken::new(),
            sessions: tokio_util::task::TaskTracker::new(),
        })
    }

    /// Sessions with an input that has no outcome yet.
    pub async fn sessions_with_work(&self) -> Result<Vec<Uuid>, sqlx::Error> {
        let rows: Vec<(Uuid,)> = sqlx::query_as(
            "SELECT DISTINCT i.session_id FROM session_inputs i
             WHERE NOT EXISTS (SELECT 1 FROM session_outcomes o WHERE o.input_id = i.id) LIMIT 500",
        )
        .fetch_all(&self.db)
        .await?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// Asks the gateway to write a comment or an Artifact on the session's Issue.
    async fn issue_write(&self, p: &Pinned, session_id: Uuid, what: What) -> ToolOutput {
        use agentscope_schemas::Message as _;
        let kind = match &what {
            What::Comment(_) => "comment",
            What::Artifact(_) => "artifact",
        };
        let req = agentscope_schemas::v1::IssueWrite {
            workspace_id: p.workspace_id.to_string(),
            session_id: session_id.to_string(),
            author: format!("session:{session_id}"),
            what: Some(what),
        };
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            self.nats.request(
                agentscope_bus::subjects::ISSUE_WRITE,
                req.encode_to_vec().into(),
            ),
        )
        .await;
        let r = match reply {
            Ok(Ok(m)) => agentscope_schemas::v1::IssueWriteReply::decode(m.payload.as_ref()).ok(),
            _ => None,
        };
        match r {
            Some(r) if r.ok => ToolOutput {
                output: format!("{kind} {} written on the Issue", r.id),
                is_error: false,
            },
            Some(r) => ToolOutput {
                output: format!("{}: {}", r.error_code, r.message),
                is_error: true,
            },
            None => ToolOutput {
                output: format!(
                    "unavailable: the gateway did not confirm the {kind}; it was not retried"
                ),
                is_error: true,
            },
        }
    }

    /// Opens the Vault secrets `names` of the workspace, now that a tool runs.
    async fn secrets(
        &self,
        workspace_id: Uuid,
        names: &[String],
    ) -> Result<Result<Vec<(String, String)>, String>, sqlx::Error> {
        if names.is_empty() {
            return Ok(Ok(vec![]));
        }
        let Some(vault) = &self.vault else {
            return Ok(Err(
                "vault_not_configured: this agent uses Vault secrets but the dataplane has no vault keys".into(),
            ));
        };
        let rows: Vec<(String, String, Vec<u8>, Vec<u8>)> = sqlx::query_as(
            "SELECT name, key_id, nonce, ciphertext FROM vault_secrets WHERE workspace_id = $1 AND name = ANY($2)",
        )
        .bind(workspace_id)
        .bind(names)
        .fetch_all(&self.db)
        .await?;
        let mut out = vec![];
        for name in names {
            let Some((_, key_id, nonce, ciphertext)) = rows.iter().find(|r| &r.0 == name) else {
                return Ok(Err(format!("secret_missing: no Vault secret named {name}")));
            };
            let sealed = agentscope_domain::vault::Sealed {
                key_id: key_id.clone(),
                nonce: nonce.clone(),
                ciphertext: ciphertext.clone(),
            };
            match vault.open(&workspace_id.to_string(), name, &sealed) {
                Ok(v) => out.push((name.clone(), String::from_utf8_lossy(&v).into_owned())),
                Err(e) => return Ok(Err(format!("secret_unavailable: {name}: {e}"))),
            }
        }
        Ok(Ok(out))
    }

    /// Publishes a tool request for the scheduler to record as an Approval (idempotent).
    async fn ask(&self, req: &agentscope_schemas::v1::ToolRequest) {
        use agentscope_schemas::Message as _;
        let msg_id = format!("approval:session:{}:{}", req.session_id, req.request_id);
        let sent = async {
            self.js
                .publish_with_headers(
                    agentscope_bus::subjects::session_approval_requested(&req.session_id),
                    agentscope_bus::headers(&msg_id),
                    req.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, session_id = %req.session_id, "publish tool request; will retry");
        }
    }

    /// Returns on news for any session, or after `at_most`.
    async fn wait_for_news(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.news.notified()).await;
    }

    /// Works on `session_id` if no replica holds its lease; returns at once otherwise.
    pub fn offer(self: &Arc<Self>, session_id: Uuid) {
        self.news.notify_waiters();
        if self.stopping.is_cancelled() {
            return;
        }
        {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            if !active.insert(session_id) {
                return;
            }
        }
        let me = self.clone();
        self.sessions.spawn(async move {
            me.hold_and_run(session_id).await;
            me.active
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&session_id);
        });
    }

    async fn hold_and_run(self: &Arc<Self>, session_id: Uuid) {
        use agentscope_bus::lease::Lease;
        let key = lease_key(session_id);
        let ttl = Duration::from_millis(self.config.session_lease_ttl_ms);
        // The same lease type as hosted attempts: a renewal applied while its reply was lost is
        // still ours; one that cannot be renewed is given up before the TTL ends.
        let lease = match Lease::acquire(&self.leases, &key, self.replica.clone().into(), ttl).await
        {
            Ok(Some(lease)) => lease,
            Ok(None) => return, // another replica holds it
            Err(e) => {
                tracing::warn!(%session_id, error = %e, "session lease could not be created");
                return;
            }
        };
        let token = lease.revision();
        let lost = CancellationToken::new();
        let done = CancellationToken::new();
        let keeper = {
            let lease = lease.clone();
            let lost = lost.clone();
            let done = done.clone();
            tokio::spawn(async move {
                if let Some(why) = lease.keep(done).await {
                    tracing::warn!(%session_id, reason = %why, "session lease lost");
                    lost.cancel();
                }
            })
        };
        let result = tokio::select! {
            r = self.run(session_id, token as i64) => r,
            _ = lost.cancelled() => Err(Stop::Lost),
            // A tool call interrupted here is journaled `started`: the replica that takes over
            // reports it interrupted to the model and never runs it again.
            _ = self.stopping.cancelled() => Err(Stop::Shutdown),
        };
        match result {
            Ok(()) => {}
            Err(Stop::Shutdown) => {
                tracing::info!(%session_id, replica = %self.replica, "replica stopping; session handed back");
            }
            Err(Stop::Fenced) | Err(Stop::Lost) => {
                tracing::warn!(%session_id, replica = %self.replica, "session taken over; stopping");
            }
            Err(Stop::Db(e)) => tracing::error!(%session_id, error = %e, "session stopped"),
        }
        done.cancel();
        let _ = keeper.await;
        if !lost.is_cancelled() {
            lease.release().await;
        }
    }

    async fn pinned(&self, session_id: Uuid) -> Result<Pinned, Stop> {
        type Row = (
            Uuid,
            String,
            String,
            Option<String>,
            Value,
            Value,
            Option<i32>,
            Value,
            Option<String>,
        );
        let (workspace_id, environment, instructions, model, tools, policy, max_iters, files, worker): Row = sqlx::query_as(
            "SELECT s.workspace_id, s.environment, v.instructions, v.model, v.tools, v.policy, v.max_iters, v.capability_files, s.worker
             FROM sessions s JOIN agent_versions v ON v.id = s.agent_version_id WHERE s.id = $1",
        )
        .bind(session_id)
        .fetch_one(&self.db)
        .await?;
        let base = match (environment.as_str(), self.config.remote_dir.as_str()) {
            ("remote", "") => PathBuf::from(&self.config.sessions_dir).join("remote"),
            ("remote", shared) => PathBuf::from(shared),
            _ => PathBuf::from(&self.config.sessions_dir),
        };
        // `local` and `remote` run tools unsandboxed on this machine: only when enabled.
        let refused = (["local", "remote"].contains(&environment.as_str())
            && !self.config.allow_local_environment)
            .then(|| {
                format!(
                    "environment_not_allowed: the `{environment}` environment runs tools unsandboxed on the dataplane's machine and this deployment does not enable it (AGENTSCOPE_ALLOW_LOCAL_ENVIRONMENT); use `sandbox`"
                )
            });
        let (root, identity) = if refused.is_some() {
            (base.join(session_id.to_string()), None)
        } else {
            let uids = self.uids;
            let b = base.clone();
            match tokio::task::spawn_blocking(move || {
                crate::env::prepare_session_dir(&b, session_id, uids)
            })
            .await
            {
                Ok(Ok(prepared)) => prepared,
                Ok(Err(e)) => {
                    tracing::error!(%session_id, error = %e, "session directory");
                    return Err(Stop::Db(sqlx::Error::Io(std::io::Error::other(
                        e.to_string(),
                    ))));
                }
                Err(e) => return Err(Stop::Db(sqlx::Error::Io(std::io::Error::other(e)))),
            }
        };
        let env = match environment.as_str() {
            "sandbox" => Environment::Sandbox {
                root,
                identity,
                spec: self.sandbox.clone(),
            },
            _ => Environment::Local { root, identity },
        };
        let worker = worker.map(|name| crate::worker::WorkerLink {
            nats: self.nats.clone(),
            workers: self.workers.clone(),
            worker_id: crate::worker::worker_id(&workspace_id.to_string(), &name),
            name,
            ttl: Duration::from_millis(self.config.worker_ttl_ms),
        });
        Ok(Pinned {
            refused,
            e2b: environment == "sandbox" && self.e2b.is_some(),
            worker,
            files: files
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| v.as_str().map(|t| (k.clone(), t.to_string())))
                .collect(),
            workspace_id,
            instructions,
            model: model
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| self.config.model_default.clone()),
            enabled: tools
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect(),
            policy: Policy::from_json(&policy).unwrap_or_else(|e| {
                tracing::warn!(%session_id, error = %e, "invalid policy; denying every tool");
                Policy {
                    default: Decision::Deny,
                    ..Policy::default()
                }
            }),
            max_iters: max_iters.unwrap_or(20).max(1) as u32,
            env,
        })
    }

    fn limits(&self) -> Limits {
        Limits {
            timeout: Duration::from_secs(self.config.shell_timeout_secs),
            max_output: tools::MAX_OUTPUT,
            max_file: 4 * 1024 * 1024,
            memory_bytes: Some(self.config.session_memory_mb * 1024 * 1024),
            max_processes: Some(self.config.session_max_processes),
            cpu_secs: (self.config.session_cpu_secs > 0).then_some(self.config.session_cpu_secs),
        }
    }

    fn model_config(&self, model: &str) -> ModelConfig {
        ModelConfig {
            api: match self.config.model_api.as_str() {
                "openai_chat" => model::Api::OpenaiChat,
                "openai_responses" => model::Api::OpenaiResponses,
                _ => model::Api::Anthropic,
            },
            base_url: self.config.model_base_url.clone(),
            api_key: self.config.model_api_key.0.clone(),
            model: model.to_string(),
            max_tokens: 4096,
            stream: self.config.model_stream,
            max_retries: self.config.model_max_retries,
            retry_base_ms: 200,
        }
    }

    /// Takes the session over under `token`, then works through its inputs in order.
    async fn run(&self, session_id: Uuid, token: i64) -> Result<(), Stop> {
        // A session refused here was already told so: leave it (and its events) alone.
        let (environment, status): (String, Option<String>) = sqlx::query_as(
            "SELECT s.environment, st.status FROM sessions s LEFT JOIN session_state st ON st.session_id = s.id WHERE s.id = $1",
        )
        .bind(session_id)
        .fetch_one(&self.db)
        .await?;
        if ["local", "remote"].contains(&environment.as_str())
            && !self.config.allow_local_environment
            && status.as_deref() == Some("environment_not_allowed")
        {
            return Ok(());
        }
        let taken: Option<(i64,)> = sqlx::query_as(
            "INSERT INTO session_state (session_id, status, lease_token, replica) VALUES ($1, 'running', $2, $3)
             ON CONFLICT (session_id) DO UPDATE SET lease_token = EXCLUDED.lease_token, replica = EXCLUDED.replica,
                 status = 'running', detail = '', updated_at = now()
             WHERE session_state.lease_token < EXCLUDED.lease_token
             RETURNING last_seq",
        )
        .bind(session_id)
        .bind(token)
        .bind(&self.replica)
        .fetch_optional(&self.db)
        .await?;
        let Some((last_seq,)) = taken else {
            return Err(Stop::Fenced);
        };
        let s = Session {
            r: self,
            id: session_id,
            token,
        };
        if last_seq > 0 {
            s.event(
                "diagnostic",
                json!({"code": "taken_over", "message": format!("replica {} continues the session from its journal", self.replica)}),
            )
            .await?;
        }
        let pinned = self.pinned(session_id).await?;
        if let Some(reason) = &pinned.refused {
            return s.refuse(reason).await;
        }
        s.materialize(&pinned).await?;
        loop {
            let next: Option<(Uuid, String)> = sqlx::query_as(
                "SELECT i.id, i.text FROM session_inputs i WHERE i.session_id = $1
                 AND NOT EXISTS (SELECT 1 FROM session_outcomes o WHERE o.input_id = i.id)
                 ORDER BY i.id LIMIT 1",
            )
            .bind(session_id)
            .fetch_optional(&self.db)
            .await?;
            let Some((input_id, text)) = next else {
                return Ok(());
            };
            s.work(&pinned, input_id, &text).await?;
        }
    }
}

struct Session<'a> {
    r: &'a Runner,
    id: Uuid,
    token: i64,
}

/// The rows of one durable step, written by one statement ([`WRITE`]): one round trip and one
/// transaction that first checks the replica's fencing token and writes all of them, or nothing.
#[derive(Default)]
struct Batch {
    /// The input the messages and new journal rows belong to.
    input_id: Option<Uuid>,
    events: Vec<(&'static str, Value)>,
    messages: Vec<Value>,
    /// New tool-call journal rows: call, status, output.
    journal: Vec<(String, String, Value, &'static str, String, bool)>,
    /// A call moved from `awaiting_approval` to `started`: nothing is written unless it waited.
    started: Option<String>,
    /// The end of a journaled call: call id, status, output, is_error.
    ended: Option<(String, &'static str, String, bool)>,
    /// The session's status and detail.
    status: Option<(String, String)>,
    /// The input's outcome: status, detail, iterations.
    outcome: Option<(&'static str, String, i32)>,
}

/// Applies a [`Batch`] in one statement. `fence` takes the session's row (`FOR UPDATE` by its
/// update) only if this replica's token still holds it (and, for an approved call, only if the
/// call still waits), and reserves the events' sequence numbers; every other part reads `fence`,
/// so a fenced replica writes nothing. Data-modifying CTEs run once, in one snapshot and one
/// transaction.
const WRITE: &str = r#"WITH fence AS (
    UPDATE session_state SET last_seq = last_seq + cardinality($3::text[]),
        status = COALESCE($13::text, status), detail = COALESCE($14::text, detail), updated_at = now()
    WHERE session_id = $1 AND lease_token = $2
      AND ($15::text IS NULL OR EXISTS (SELECT 1 FROM session_tool_calls
          WHERE session_id = $1 AND call_id = $15::text AND status = 'awaiting_approval'))
    RETURNING last_seq - cardinality($3::text[]) AS base
), events AS (
    INSERT INTO session_events (session_id, seq, kind, payload)
    SELECT $1, fence.base + e.n, e.kind, e.payload
    FROM fence, unnest($3::text[], $4::jsonb[]) WITH ORDINALITY AS e(kind, payload, n)
), messages AS (
    INSERT INTO session_messages (session_id, seq, input_id, message)
    SELECT $1, (SELECT COALESCE(max(seq), 0) FROM session_messages WHERE session_id = $1) + m.n, $5::uuid, m.message
    FROM fence, unnest($6::jsonb[]) WITH ORDINALITY AS m(message, n)
), journal AS (
    INSERT INTO session_tool_calls (session_id, call_id, input_id, tool, input, status, output, is_error, finished_at)
    SELECT $1, j.call_id, $5::uuid, j.tool, j.input, j.status,
        CASE WHEN j.status IN ('started', 'awaiting_approval') THEN NULL ELSE j.output END, j.is_error,
        CASE WHEN j.status = 'started' THEN NULL ELSE now() END
    FROM fence, unnest($7::text[], $8::text[], $9::jsonb[], $10::text[], $11::text[], $12::bool[])
        AS j(call_id, tool, input, status, output, is_error)
), started AS (
    UPDATE session_tool_calls c SET status = 'started' FROM fence
    WHERE c.session_id = $1 AND c.call_id = $15::text AND c.status = 'awaiting_approval'
), ended AS (
    UPDATE session_tool_calls c SET status = $16::text, output = $17::text, is_error = $18::bool, finished_at = now()
    FROM fence WHERE c.session_id = $1 AND c.call_id = $19::text
), outcome AS (
    INSERT INTO session_outcomes (input_id, session_id, status, detail, iterations)
    SELECT $5::uuid, $1, $20::text, $21::text, $22::int4 FROM fence WHERE $20::text IS NOT NULL
    ON CONFLICT (input_id) DO NOTHING
)
SELECT base FROM fence"#;

impl Batch {
    fn of(input_id: Uuid) -> Batch {
        Batch {
            input_id: Some(input_id),
            ..Batch::default()
        }
    }

    fn event(&mut self, kind: &'static str, payload: Value) {
        self.events.push((kind, payload));
    }

    fn message(&mut self, m: &Message) {
        self.messages
            .push(serde_json::to_value(m).unwrap_or(Value::Null));
    }

    fn journal(&mut self, call: &ToolCallReq, status: &'static str, out: Option<&ToolOutput>) {
        self.journal.push((
            call.id.clone(),
            call.name.clone(),
            call.input.clone(),
            status,
            out.map(|o| o.output.clone()).unwrap_or_default(),
            out.is_some_and(|o| o.is_error),
        ));
    }

    fn status(&mut self, status: &str, detail: &str) {
        self.status = Some((status.to_string(), detail.to_string()));
    }

    /// The result message of `call`.
    fn result(&mut self, call: &ToolCallReq, out: &ToolOutput) {
        self.message(&Message::ToolResult {
            call_id: call.id.clone(),
            output: out.output.clone(),
            is_error: out.is_error,
        });
    }

    /// The input's outcome, the session's status and the `outcome` event.
    fn finish(&mut self, status: &'static str, detail: &str, iterations: u32) {
        let input_id = self.input_id;
        // Finishing a turn is an outcome, never the acceptance of the Issue.
        let shown = if status == "completed" {
            "completed_awaiting_acceptance"
        } else {
            status
        };
        self.status(shown, detail);
        self.outcome = Some((status, detail.to_string(), iterations as i32));
        self.event(
            "outcome",
            json!({"input_id": input_id, "status": status, "detail": detail, "iterations": iterations}),
        );
    }
}

/// A call's end, not written yet: its batch, and the transaction holding its memory note.
struct Ended {
    batch: Batch,
    note: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
}

impl Session<'_> {
    /// Writes `b` if this replica still holds the session.
    async fn write(&self, b: Batch) -> Result<(), Stop> {
        self.write_on(&self.r.db, b).await
    }

    /// [`Self::write`] on a connection (inside a transaction that holds more of the step).
    async fn write_on<'e>(&self, on: impl sqlx::PgExecutor<'e>, b: Batch) -> Result<(), Stop> {
        let (kinds, payloads): (Vec<&str>, Vec<Value>) = b.events.into_iter().unzip();
        let mut j = (vec![], vec![], vec![], vec![], vec![], vec![]);
        for (call_id, tool, input, status, output, is_error) in b.journal {
            j.0.push(call_id);
            j.1.push(tool);
            j.2.push(input);
            j.3.push(status);
            j.4.push(output);
            j.5.push(is_error);
        }
        let (status, detail) = b.status.unzip();
        let (ended_id, ended_status, ended_output, ended_error) = match b.ended {
            Some((id, s, o, e)) => (Some(id), Some(s), Some(o), Some(e)),
            None => (None, None, None, None),
        };
        let (outcome, outcome_detail, iterations) = match b.outcome {
            Some((s, d, n)) => (Some(s), Some(d), Some(n)),
            None => (None, None, None),
        };
        let row: Option<(i64,)> = sqlx::query_as(WRITE)
            .bind(self.id)
            .bind(self.token)
            .bind(kinds)
            .bind(payloads)
            .bind(b.input_id)
            .bind(b.messages)
            .bind(j.0)
            .bind(j.1)
            .bind(j.2)
            .bind(j.3)
            .bind(j.4)
            .bind(j.5)
            .bind(status)
            .bind(detail)
            .bind(b.started)
            .bind(ended_status)
            .bind(ended_output)
            .bind(ended_error)
            .bind(ended_id)
            .bind(outcome)
            .bind(outcome_detail)
            .bind(iterations)
            .fetch_optional(on)
            .await?;
        match row {
            Some(_) => Ok(()),
            None => Err(Stop::Fenced),
        }
    }

    /// Writes a call's end (and commits its memory note with it).
    async fn commit(&self, ended: Ended) -> Result<(), Stop> {
        match ended.note {
            Some(mut tx) => {
                self.write_on(&mut *tx, ended.batch).await?;
                tx.commit().await?;
                Ok(())
            }
            None => self.write(ended.batch).await,
        }
    }

    async fn event(&self, kind: &'static str, payload: Value) -> Result<(), Stop> {
        let mut b = Batch::default();
        b.event(kind, payload);
        self.write(b).await
    }

    async fn set_status(&self, status: &str, detail: &str) -> Result<(), Stop> {
        let mut b = Batch::default();
        b.status(status, detail);
        self.write(b).await
    }

    async fn history(&self) -> Result<Vec<(Uuid, Message)>, Stop> {
        let rows: Vec<(Uuid, Value)> = sqlx::query_as(
            "SELECT input_id, message FROM session_messages WHERE session_id = $1 ORDER BY seq",
        )
        .bind(self.id)
        .fetch_all(&self.r.db)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(i, v)| serde_json::from_value(v).ok().map(|m| (i, m)))
            .collect())
    }

    /// A session this replica will not run (its environment is not enabled): the state says so
    /// with a stable code, once, and its inputs stay unanswered until the deployment changes.
    async fn refuse(&self, reason: &str) -> Result<(), Stop> {
        // The status and its diagnostic commit together.
        let mut b = Batch::default();
        b.status("environment_not_allowed", reason);
        b.event(
            "diagnostic",
            json!({"code": "environment_not_allowed", "message": reason}),
        );
        self.write(b).await
    }

    /// One input: model turns and tool calls until the model stops calling tools.
    ///
    /// The conversation is loaded once and then kept in the model API's wire format, each new
    /// message appended ([`model::Conversation`]). A model turn is one write: its message and
    /// events, and, when the turn's first call can run at once, that call's `started` journal row
    /// (or, for the last turn, the input's outcome). A tool's result is another write.
    async fn work(&self, p: &Pinned, input_id: Uuid, text: &str) -> Result<(), Stop> {
        let history = self.history().await?;
        let model = self.r.model_config(&p.model);
        let specs = tools::specs(&p.enabled);
        let prompt = model::Prompt::new(&model, &p.instructions, &specs);
        let mut conversation = model::Conversation::new(model.api);
        // Every call id the session has seen: a model that repeats one goes through the journal.
        let mut known_calls: HashSet<String> = HashSet::new();
        let mut iterations: u32 = 0;
        let mut has_input = false;
        // Tool calls of the last assistant message that have no result yet (a takeover): run
        // them, or report them interrupted.
        let mut pending: Vec<ToolCallReq> = vec![];
        for (i, m) in &history {
            has_input |= *i == input_id;
            match m {
                Message::Assistant { tool_calls, .. } => {
                    if *i == input_id {
                        iterations += 1;
                    }
                    known_calls.extend(tool_calls.iter().map(|c| c.id.clone()));
                    pending = tool_calls.clone();
                }
                Message::ToolResult { call_id, .. } => pending.retain(|c| &c.id != call_id),
                Message::User { .. } => {}
            }
            conversation.push(m);
        }
        drop(history);
        let mut b = Batch::of(input_id);
        b.status("running", "");
        if !has_input {
            let m = Message::User {
                text: text.to_string(),
            };
            b.message(&m);
            b.event("input", json!({"input_id": input_id, "text": text}));
            conversation.push(&m);
        }
        self.write(b).await?;
        let mut denied = false;
        // The call journaled `started` together with the turn that asked for it.
        let mut started_with_turn: Option<String> = None;
        // That call's end, written while the next model request is in flight (before anything
        // else is written, so the journal's order is the conversation's).
        let mut unwritten: Option<Ended> = None;
        loop {
            for call in std::mem::take(&mut pending) {
                if let Some(ended) = unwritten.take() {
                    self.commit(ended).await?;
                }
                let (out, was_denied) = if started_with_turn.as_deref() == Some(call.id.as_str()) {
                    started_with_turn = None;
                    let (out, ended) = self.run_started(p, input_id, &call).await?;
                    unwritten = Some(ended);
                    (out, false)
                } else {
                    self.call(p, input_id, &call).await?
                };
                denied |= was_denied;
                conversation.push(&Message::ToolResult {
                    call_id: call.id,
                    output: out.output,
                    is_error: out.is_error,
                });
            }
            if iterations >= p.max_iters {
                if let Some(ended) = unwritten.take() {
                    self.commit(ended).await?;
                }
                let detail = format!("stopped after {iterations} model turns (max_iters)");
                let mut b = Batch::of(input_id);
                b.finish("max_iterations", &detail, iterations);
                return self.write(b).await;
            }
            // The model already has the result; the turn is written only after it is.
            let ((), turn) = tokio::try_join!(
                async {
                    match unwritten.take() {
                        Some(ended) => self.commit(ended).await,
                        None => Ok(()),
                    }
                },
                async {
                    Ok(model::complete_turn(&self.r.http, &model, &prompt, &conversation).await)
                }
            )?;
            let turn = match turn {
                Ok(t) => t,
                Err(e) => {
                    let detail = match &e {
                        ModelError::Connection(m) | ModelError::Rejected(m) => m.clone(),
                    };
                    let mut b = Batch::of(input_id);
                    b.event(
                        "diagnostic",
                        json!({"code": "model_connection", "message": detail}),
                    );
                    b.finish("model_connection", &detail, iterations);
                    return self.write(b).await;
                }
            };
            let mut b = Batch::of(input_id);
            if !turn.text.is_empty() {
                b.event("assistant_message", json!({"text": turn.text}));
            }
            b.event(
                "usage",
                json!({"input_tokens": turn.input_tokens, "output_tokens": turn.output_tokens}),
            );
            let m = Message::Assistant {
                text: turn.text,
                tool_calls: turn.tool_calls,
            };
            b.message(&m);
            // Appended now: a failed write ends the session's work here anyway.
            conversation.push(&m);
            iterations += 1;
            let Message::Assistant { tool_calls, .. } = m else {
                unreachable!("an assistant message")
            };
            if tool_calls.is_empty() {
                let (status, detail) = if denied {
                    (
                        "tool_denied",
                        "the turn ended after a tool was denied by policy",
                    )
                } else {
                    ("completed", "")
                };
                b.finish(status, detail, iterations);
                return self.write(b).await;
            }
            if let Some(first) = tool_calls.first()
                && self.starts_at_once(p, first, &known_calls)
            {
                b.journal(first, "started", None);
                b.event(
                    "tool_call",
                    json!({"call_id": first.id, "tool": first.name, "input": first.input}),
                );
                started_with_turn = Some(first.id.clone());
            }
            self.write(b).await?;
            known_calls.extend(tool_calls.iter().map(|c| c.id.clone()));
            pending = tool_calls;
        }
    }

    /// Whether `call` (the first of a fresh turn) may be journaled `started` with the turn: the
    /// policy allows it, it is one of the agent's tools, its id is new to the session, and it
    /// waits for nothing (a Worker's calls first wait for the Worker to beat).
    fn starts_at_once(
        &self,
        p: &Pinned,
        call: &ToolCallReq,
        known_calls: &HashSet<String>,
    ) -> bool {
        p.worker.is_none()
            && !known_calls.contains(&call.id)
            && tools::ALL.contains(&call.name.as_str())
            && (p.enabled.is_empty() || p.enabled.contains(&call.name))
            && p.policy.decide(&call.name, &call.input).0 == Decision::Allow
    }

    /// One tool call, journaled; returns its output and whether it was denied.
    async fn call(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
    ) -> Result<(ToolOutput, bool), Stop> {
        let existing: Option<(String, Option<String>, bool)> = sqlx::query_as(
            "SELECT status, output, is_error FROM session_tool_calls WHERE session_id = $1 AND call_id = $2",
        )
        .bind(self.id)
        .bind(&call.id)
        .fetch_optional(&self.r.db)
        .await?;
        if existing
            .as_ref()
            .is_some_and(|e| e.0 == "awaiting_approval")
        {
            return self.await_decision(p, input_id, call).await;
        }
        if let Some((status, output, is_error)) = existing {
            // Seen before this replica: a `started` call may have run; it is never run again.
            // A Worker that ran it (or still runs it) is asked for its result.
            let recovered = if status == "started" {
                self.recover(p, call).await?
            } else {
                None
            };
            let (out, kind) = if let Some(out) = recovered {
                (out, "tool_result")
            } else if status == "started" {
                (
                    ToolOutput {
                        output: "interrupted: the dataplane replica running this tool stopped before it reported; the tool was not run again, its effects (if any) are unknown".into(),
                        is_error: true,
                    },
                    "tool_interrupted",
                )
            } else {
                (
                    ToolOutput {
                        output: output.unwrap_or_default(),
                        is_error,
                    },
                    "tool_result",
                )
            };
            let mut b = Batch::of(input_id);
            if status == "started" {
                let done = if kind == "tool_result" {
                    "completed"
                } else {
                    "interrupted"
                };
                b.ended = Some((call.id.clone(), done, out.output.clone(), out.is_error));
            }
            b.result(call, &out);
            b.event(
                kind,
                json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}),
            );
            self.write(b).await?;
            return Ok((out, status == "denied"));
        }
        let (decision, why) = p.policy.decide(&call.name, &call.input);
        let known = tools::ALL.contains(&call.name.as_str())
            && (p.enabled.is_empty() || p.enabled.contains(&call.name));
        if known && decision == Decision::Ask {
            let mut b = Batch::of(input_id);
            b.journal(call, "awaiting_approval", None);
            b.status(
                "awaiting_approval",
                &format!("tool `{}` waits for an approval", call.name),
            );
            b.event(
                "approval_requested",
                json!({"call_id": call.id, "tool": call.name, "input": call.input, "policy": why}),
            );
            self.write(b).await?;
            return self.await_decision(p, input_id, call).await;
        }
        if decision != Decision::Allow || !known {
            let reason = if !known {
                format!(
                    "unknown_tool: `{}` is not one of this agent's tools",
                    call.name
                )
            } else if decision == Decision::Deny {
                format!("tool_denied: the agent's tool policy denies this call ({why})")
            } else {
                unreachable!("ask is handled above")
            };
            let out = ToolOutput {
                output: reason,
                is_error: true,
            };
            let mut b = Batch::of(input_id);
            b.journal(call, "denied", Some(&out));
            b.result(call, &out);
            b.event(
                "tool_denied",
                json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output}),
            );
            self.write(b).await?;
            return Ok((out, known));
        }
        self.execute(p, input_id, call, None).await
    }

    /// Runs an allowed call: journaled `started` first (once committed, never run again), then
    /// `completed` with its result message in one write. `decided`: the call waited for an
    /// Approval, allowed with this decision, which commits with the start.
    async fn execute(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        decided: Option<Value>,
    ) -> Result<(ToolOutput, bool), Stop> {
        let mut b = Batch::of(input_id);
        let approved = decided.is_some();
        if let Some(decided) = decided {
            b.event("approval_decided", decided);
            b.status("running", "");
        }
        if let Some(link) = &p.worker
            && !call.name.starts_with("memory_")
        {
            if approved {
                // The decision is recorded before the wait for the Worker is.
                self.write(std::mem::replace(&mut b, Batch::of(input_id)))
                    .await?;
            }
            self.wait_worker(link).await?;
        }
        if approved {
            b.started = Some(call.id.clone());
        } else {
            b.journal(call, "started", None);
        }
        b.event(
            "tool_call",
            json!({"call_id": call.id, "tool": call.name, "input": call.input}),
        );
        self.write(b).await?;
        let (out, ended) = self.run_started(p, input_id, call).await?;
        self.commit(ended).await?;
        Ok((out, false))
    }

    /// Runs a call journaled `started`; returns its output and its end (the journal row's
    /// `completed`, the result message and event, and a memory note), to be written together.
    async fn run_started(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
    ) -> Result<(ToolOutput, Ended), Stop> {
        let limits = self.r.limits();
        // Secrets are opened only now, injected into the shell's environment, and redacted from
        // whatever any tool returns (the model, the events and the journal never hold them).
        let secrets = self.r.secrets(p.workspace_id, &p.policy.secrets).await?;
        let out = match (&secrets, call.name.as_str()) {
            (Err(e), _) => ToolOutput {
                output: e.clone(),
                is_error: true,
            },
            (Ok(_), "memory_search") => {
                tools::memory_search(&self.r.db, p.workspace_id, &call.input).await?
            }
            (Ok(_), "memory_write") => ToolOutput {
                output: String::new(),
                is_error: false,
            },
            (Ok(_), "comment") => match call.input.get("text").and_then(Value::as_str) {
                Some(text) => {
                    self.r
                        .issue_write(p, self.id, What::Comment(text.to_string()))
                        .await
                }
                None => ToolOutput {
                    output: "bad_arguments: `text` (a string) is required".into(),
                    is_error: true,
                },
            },
            (Ok(values), "upload_artifact") => self.upload(p, &limits, call, values).await?,
            (Ok(env), name) => {
                let env: &[(String, String)] = if name == "shell" { env } else { &[] };
                self.run_tool(p, &limits, call, env).await?
            }
        };
        // The note commits with the journal: never written twice.
        let mut note = None;
        let mut out = if call.name == "memory_write" && secrets.is_ok() {
            let mut tx = self.r.db.begin().await?;
            let out = tools::memory_write(&mut tx, p.workspace_id, self.id, &call.input).await?;
            note = Some(tx);
            out
        } else {
            out
        };
        if let Ok(values) = &secrets {
            out.output = agentscope_domain::vault::Redactor::new(values).redact(&out.output);
        }
        let mut b = Batch::of(input_id);
        b.ended = Some((
            call.id.clone(),
            "completed",
            out.output.clone(),
            out.is_error,
        ));
        b.result(call, &out);
        b.event(
            "tool_result",
            json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}),
        );
        Ok((out, Ended { batch: b, note }))
    }

    /// Waits for the Approval of `call` (asking the scheduler to record it, idempotently), then
    /// runs the call or reports the deny to the model.
    async fn await_decision(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
    ) -> Result<(ToolOutput, bool), Stop> {
        let request = agentscope_schemas::v1::ToolRequest {
            request_id: call.id.clone(),
            attempt_id: String::new(),
            session_id: self.id.to_string(),
            tool_name: call.name.clone(),
            input_json: call.input.to_string(),
            lease_token: self.token as u64,
            requested_at_ms: agentscope_bus::now_ms(),
            timeout_ms: p
                .policy
                .approval_timeout_secs
                .unwrap_or(600)
                .saturating_mul(1000),
        };
        let mut asked_at: Option<tokio::time::Instant> = None;
        let (status, reason, decided_by) = loop {
            // Listening before reading: a decision's nudge that arrives during the read wakes
            // the wait below instead of being missed until the next poll.
            let news = self.r.news.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            let row: Option<(String, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT status, reason, decided_by FROM approvals WHERE session_id = $1 AND request_id = $2",
            )
            .bind(self.id.to_string())
            .bind(&call.id)
            .fetch_optional(&self.r.db)
            .await?;
            match row {
                Some((status, reason, by)) if status != "pending" => break (status, reason, by),
                Some(_) => {}
                None if asked_at.is_none_or(|t| t.elapsed() > Duration::from_secs(2)) => {
                    self.r.ask(&request).await;
                    asked_at = Some(tokio::time::Instant::now());
                }
                None => {}
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), news).await;
        };
        let allowed = status == "allowed";
        let decided = json!({"call_id": call.id, "allow": allowed, "status": status, "reason": reason, "decided_by": decided_by});
        if allowed {
            return self.execute(p, input_id, call, Some(decided)).await;
        }
        let out = ToolOutput {
            output: format!(
                "tool_denied: the approval was {status}{}",
                reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
            is_error: true,
        };
        let mut b = Batch::of(input_id);
        b.ended = Some((call.id.clone(), "denied", out.output.clone(), true));
        b.status("running", "");
        b.result(call, &out);
        b.event("approval_decided", decided);
        b.event(
            "tool_denied",
            json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output}),
        );
        self.write(b).await?;
        Ok((out, true))
    }

    /// The result of a `started` call that a previous replica sent to the session's Worker,
    /// asked for by its operation id (waiting while it still runs); `None` when there is no
    /// Worker, the call is not a Worker operation, or the Worker does not know it or is gone.
    async fn recover(&self, p: &Pinned, call: &ToolCallReq) -> Result<Option<ToolOutput>, Stop> {
        let Some(link) = &p.worker else {
            return Ok(None);
        };
        if p.e2b
            || matches!(
                call.name.as_str(),
                "memory_search" | "memory_write" | "comment" | "upload_artifact"
            )
        {
            return Ok(None);
        }
        let operation_id = crate::worker::operation_id(self.id, &call.id, &call.name);
        match link
            .recover(self.id, &operation_id, self.r.limits().timeout)
            .await
        {
            Ok(mut out) => {
                tracing::info!(session_id = %self.id, call_id = %call.id, %operation_id, "result of an interrupted call recovered from the worker");
                if let Ok(values) = self.r.secrets(p.workspace_id, &p.policy.secrets).await? {
                    out.output =
                        agentscope_domain::vault::Redactor::new(&values).redact(&out.output);
                }
                Ok(Some(out))
            }
            Err(e) => {
                tracing::info!(session_id = %self.id, call_id = %call.id, %operation_id, error = ?e, "an interrupted call's result is not on the worker");
                Ok(None)
            }
        }
    }

    /// Writes the definition's files into a new session directory (through the Worker for
    /// `self_hosted`).
    async fn materialize(&self, p: &Pinned) -> Result<(), Stop> {
        let limits = self.r.limits();
        for (name, text) in &p.files {
            let call = |tool: &str, input: Value| ToolCallReq {
                id: format!("materialize:{name}"),
                name: tool.into(),
                input,
            };
            let read = self
                .run_tool(p, &limits, &call("read_file", json!({"path": name})), &[])
                .await?;
            if !read.is_error {
                continue;
            }
            let write = call("write_file", json!({"path": name, "content": text}));
            let out = self.run_tool(p, &limits, &write, &[]).await?;
            if out.is_error {
                tracing::warn!(session_id = %self.id, file = %name, error = %out.output, "capability file not written");
            }
        }
        Ok(())
    }

    /// Returns once the session's Worker beats; meanwhile the session shows `worker_offline`.
    async fn wait_worker(&self, link: &crate::worker::WorkerLink) -> Result<(), Stop> {
        let mut reported = false;
        while !link.online().await {
            self.report_offline(link, &mut reported).await?;
            self.r.wait_for_news(Duration::from_millis(500)).await;
        }
        self.report_online(link, reported).await
    }

    async fn report_offline(
        &self,
        link: &crate::worker::WorkerLink,
        reported: &mut bool,
    ) -> Result<(), Stop> {
        if !*reported {
            let detail = format!("worker `{}` is not answering; waiting for it", link.name);
            self.set_status("worker_offline", &detail).await?;
            self.event(
                "diagnostic",
                json!({"code": "worker_offline", "message": detail}),
            )
            .await?;
            *reported = true;
        }
        Ok(())
    }

    async fn report_online(
        &self,
        link: &crate::worker::WorkerLink,
        reported: bool,
    ) -> Result<(), Stop> {
        if reported {
            self.set_status("running", "").await?;
            self.event("diagnostic", json!({"code": "worker_online", "message": format!("worker `{}` is back", link.name)}))
                .await?;
        }
        Ok(())
    }

    /// upload_artifact: the file's text (read where the session's files are), redacted of the
    /// agent's secrets, becomes an Artifact of the session's Issue.
    async fn upload(
        &self,
        p: &Pinned,
        limits: &Limits,
        call: &ToolCallReq,
        secrets: &[(String, String)],
    ) -> Result<ToolOutput, Stop> {
        let Some(path) = call.input.get("path").and_then(Value::as_str) else {
            return Ok(ToolOutput {
                output: "bad_arguments: `path` (a string) is required".into(),
                is_error: true,
            });
        };
        let read = ToolCallReq {
            id: call.id.clone(),
            name: "read_file".into(),
            input: json!({"path": path}),
        };
        let content = self.run_tool(p, limits, &read, &[]).await?;
        if content.is_error {
            return Ok(content);
        }
        let name = call
            .input
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| path.rsplit('/').next().unwrap_or(path).to_string());
        let text = agentscope_domain::vault::redact(&content.output, secrets);
        let content_type = if name.ends_with(".md") {
            "text/markdown"
        } else if name.ends_with(".json") {
            "application/json"
        } else {
            "text/plain"
        };
        Ok(self
            .r
            .issue_write(
                p,
                self.id,
                What::Artifact(agentscope_schemas::v1::ArtifactUpload {
                    name,
                    content_type: content_type.into(),
                    content: text.into_bytes(),
                }),
            )
            .await)
    }

    /// A file or shell tool in this session's E2B sandbox (created on first use).
    async fn run_in_e2b(
        &self,
        limits: &Limits,
        call: &ToolCallReq,
        env: &[(String, String)],
    ) -> ToolOutput {
        let Some(e2b) = &self.r.e2b else {
            return ToolOutput {
                output: "sandbox_unavailable: no E2B backend is configured".into(),
                is_error: true,
            };
        };
        let sandbox = {
            let mut boxes = self.r.sandboxes.lock().await;
            match boxes.get(&self.id) {
                Some(s) => s.clone(),
                None => match e2b.create(Duration::from_secs(3600)).await {
                    Ok(s) => {
                        tracing::info!(session_id = %self.id, sandbox = %s.id, "E2B sandbox created");
                        boxes.insert(self.id, s.clone());
                        s
                    }
                    Err(out) => return out,
                },
            }
        };
        sandbox
            .run(&e2b.http, &call.name, &call.input, env, limits)
            .await
    }

    /// A file or shell tool, here or on the session's Worker. An operation that certainly did
    /// not reach the Worker waits for it and is sent again; one that may have run is reported,
    /// never repeated.
    async fn run_tool(
        &self,
        p: &Pinned,
        limits: &Limits,
        call: &ToolCallReq,
        env: &[(String, String)],
    ) -> Result<ToolOutput, Stop> {
        if p.e2b {
            return Ok(self.run_in_e2b(limits, call, env).await);
        }
        let Some(link) = &p.worker else {
            return Ok(tools::run(&p.env, limits, &call.name, &call.input, env).await);
        };
        let operation_id = crate::worker::operation_id(self.id, &call.id, &call.name);
        let mut reported = false;
        loop {
            match link
                .run(
                    self.id,
                    &operation_id,
                    &call.name,
                    &call.input,
                    env,
                    limits.timeout,
                )
                .await
            {
                Ok(out) => {
                    self.report_online(link, reported).await?;
                    return Ok(out);
                }
                Err(crate::worker::LinkError::Offline) => {
                    self.report_offline(link, &mut reported).await?;
                    self.r.wait_for_news(Duration::from_millis(500)).await;
                }
                Err(crate::worker::LinkError::Unknown) => {
                    unreachable!("only a query is answered `unknown`")
                }
                Err(crate::worker::LinkError::Lost(e)) => {
                    self.report_online(link, reported).await?;
                    tracing::warn!(session_id = %self.id, worker = %link.name, %operation_id, error = %e, "worker operation lost");
                    return Ok(ToolOutput {
                        output: format!(
                            "worker_offline: worker `{}` stopped answering during this call ({e}); it was not retried, its effects are unknown",
                            link.name
                        ),
                        is_error: true,
                    });
                }
            }
        }
    }
}
