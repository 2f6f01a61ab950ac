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

type Tx<'a> = sqlx::Transaction<'a, sqlx::Postgres>;

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

impl Session<'_> {
    /// Opens a transaction that holds the session's state row, if this replica still owns it.
    async fn begin(&self) -> Result<(Tx<'static>, i64), Stop> {
        let mut tx = self.r.db.begin().await?;
        let row: Option<(i64,)> = sqlx::query_as(
            "SELECT last_seq FROM session_state WHERE session_id = $1 AND lease_token = $2 FOR UPDATE",
        )
        .bind(self.id)
        .bind(self.token)
        .fetch_optional(&mut *tx)
        .await?;
        match row {
            Some((seq,)) => Ok((tx, seq)),
            None => Err(Stop::Fenced),
        }
    }

    async fn append_events(
        &self,
        tx: &mut Tx<'_>,
        last_seq: &mut i64,
        events: &[(&str, Value)],
    ) -> Result<(), sqlx::Error> {
        for (kind, payload) in events {
            *last_seq += 1;
            sqlx::query(
                "INSERT INTO session_events (session_id, seq, kind, payload) VALUES ($1, $2, $3, $4)",
            )
            .bind(self.id)
            .bind(*last_seq)
            .bind(kind)
            .bind(payload)
            .execute(&mut **tx)
            .await?;
        }
        sqlx::query(
            "UPDATE session_state SET last_seq = $2, updated_at = now() WHERE session_id = $1",
        )
        .bind(self.id)
        .bind(*last_seq)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn event(&self, kind: &str, payload: Value) -> Result<(), Stop> {
        let (mut tx, mut seq) = self.begin().await?;
        self.append_events(&mut tx, &mut seq, &[(kind, payload)])
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn set_status(&self, status: &str, detail: &str) -> Result<(), Stop> {
        let (mut tx, _) = self.begin().await?;
        sqlx::query("UPDATE session_state SET status = $2, detail = $3, updated_at = now() WHERE session_id = $1")
            .bind(self.id)
            .bind(status)
            .bind(detail)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn append_message(
        &self,
        tx: &mut Tx<'_>,
        input_id: Uuid,
        m: &Message,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO session_messages (session_id, seq, input_id, message)
             VALUES ($1, (SELECT COALESCE(max(seq), 0) + 1 FROM session_messages WHERE session_id = $1), $2, $3)",
        )
        .bind(self.id)
        .bind(input_id)
        .bind(serde_json::to_value(m).unwrap_or(Value::Null))
        .execute(&mut **tx)
        .await?;
        Ok(())
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

    async fn finish(
        &self,
        input_id: Uuid,
        status: &str,
        detail: &str,
        iterations: u32,
    ) -> Result<(), Stop> {
        let (mut tx, mut seq) = self.begin().await?;
        sqlx::query(
            "INSERT INTO session_outcomes (input_id, session_id, status, detail, iterations) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (input_id) DO NOTHING",
        )
        .bind(input_id)
        .bind(self.id)
        .bind(status)
        .bind(detail)
        .bind(iterations as i32)
        .execute(&mut *tx)
        .await?;
        // Finishing a turn is an outcome, never the acceptance of the Issue.
        let shown = if status == "completed" {
            "completed_awaiting_acceptance"
        } else {
            status
        };
        sqlx::query("UPDATE session_state SET status = $2, detail = $3, updated_at = now() WHERE session_id = $1")
            .bind(self.id)
            .bind(shown)
            .bind(detail)
            .execute(&mut *tx)
            .await?;
        self.append_events(
            &mut tx,
            &mut seq,
            &[(
                "outcome",
                json!({"input_id": input_id, "status": status, "detail": detail, "iterations": iterations}),
            )],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// A session this replica will not run (its environment is not enabled): the state says so
    /// with a stable code, once, and its inputs stay unanswered until the deployment changes.
    async fn refuse(&self, reason: &str) -> Result<(), Stop> {
        // The status and its diagnostic commit together.
        let (mut tx, mut seq) = self.begin().await?;
        sqlx::query("UPDATE session_state SET status = 'environment_not_allowed', detail = $2, updated_at = now() WHERE session_id = $1")
            .bind(self.id)
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        self.append_events(
            &mut tx,
            &mut seq,
            &[(
                "diagnostic",
                json!({"code": "environment_not_allowed", "message": reason}),
            )],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// One input: model turns and tool calls until the model stops calling tools.
    async fn work(&self, p: &Pinned, input_id: Uuid, text: &str) -> Result<(), Stop> {
        let mut history = self.history().await?;
        if !history.iter().any(|(i, _)| *i == input_id) {
            let m = Message::User {
                text: text.to_string(),
            };
            let (mut tx, mut seq) = self.begin().await?;
            self.append_message(&mut tx, input_id, &m).await?;
            self.append_events(
                &mut tx,
                &mut seq,
                &[("input", json!({"input_id": input_id, "text": text}))],
            )
            .await?;
            tx.commit().await?;
            history.push((input_id, m));
        }
        self.set_status("running", "").await?;
        let specs = tools::specs(&p.enabled);
        let model = self.r.model_config(&p.model);
        let mut denied = false;
        loop {
            // Tool calls of the last assistant message that have no result yet (a fresh turn, or
            // a takeover): run them, or report them interrupted.
            let last_assistant = history
                .iter()
                .rposition(|(_, m)| matches!(m, Message::Assistant { .. }));
            if let Some(at) = last_assistant
                && let (_, Message::Assistant { tool_calls, .. }) = &history[at]
            {
                let answered: HashSet<&str> = history[at..]
                    .iter()
                    .filter_map(|(_, m)| match m {
                        Message::ToolResult { call_id, .. } => Some(call_id.as_str()),
                        _ => None,
                    })
                    .collect();
                let calls: Vec<ToolCallReq> = tool_calls
                    .iter()
                    .filter(|c| !answered.contains(c.id.as_str()))
                    .cloned()
                    .collect();
                for call in calls {
                    let out = self.call(p, input_id, &call).await?;
                    denied |= out.1;
                    history.push((
                        input_id,
                        Message::ToolResult {
                            call_id: call.id.clone(),
                            output: out.0.output,
                            is_error: out.0.is_error,
                        },
                    ));
                }
            }
            let iterations = history
                .iter()
                .filter(|(i, m)| *i == input_id && matches!(m, Message::Assistant { .. }))
                .count() as u32;
            if iterations >= p.max_iters {
                let detail = format!("stopped after {iterations} model turns (max_iters)");
                return self
                    .finish(input_id, "max_iterations", &detail, iterations)
                    .await;
            }
            let messages: Vec<Message> = history.iter().map(|(_, m)| m.clone()).collect();
            let turn =
                match model::complete(&self.r.http, &model, &p.instructions, &messages, &specs)
                    .await
                {
                    Ok(t) => t,
                    Err(e) => {
                        let detail = match &e {
                            ModelError::Connection(m) | ModelError::Rejected(m) => m.clone(),
                        };
                        self.event(
                            "diagnostic",
                            json!({"code": "model_connection", "message": detail}),
                        )
                        .await?;
                        return self
                            .finish(input_id, "model_connection", &detail, iterations)
                            .await;
                    }
                };
            let m = Message::Assistant {
                text: turn.text.clone(),
                tool_calls: turn.tool_calls.clone(),
            };
            let (mut tx, mut seq) = self.begin().await?;
            self.append_message(&mut tx, input_id, &m).await?;
            let mut events: Vec<(&str, Value)> = vec![];
            if !turn.text.is_empty() {
                events.push(("assistant_message", json!({"text": turn.text})));
            }
            events.push((
                "usage",
                json!({"input_tokens": turn.input_tokens, "output_tokens": turn.output_tokens}),
            ));
            self.append_events(&mut tx, &mut seq, &events).await?;
            tx.commit().await?;
            let done = turn.tool_calls.is_empty();
            history.push((input_id, m));
            if done {
                let (status, detail) = if denied {
                    (
                        "tool_denied",
                        "the turn ended after a tool was denied by policy",
                    )
                } else {
                    ("completed", "")
                };
                return self.finish(input_id, status, detail, iterations + 1).await;
            }
        }
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
            let (mut tx, mut seq) = self.begin().await?;
            if status == "started" {
                let done = if kind == "tool_result" {
                    "completed"
                } else {
                    "interrupted"
                };
                sqlx::query("UPDATE session_tool_calls SET status = $4, output = $3, is_error = $5, finished_at = now() WHERE session_id = $1 AND call_id = $2")
                    .bind(self.id)
                    .bind(&call.id)
                    .bind(&out.output)
                    .bind(done)
                    .bind(out.is_error)
                    .execute(&mut *tx)
                    .await?;
            }
            self.result_message(&mut tx, input_id, call, &out).await?;
            self.append_events(&mut tx, &mut seq, &[(kind, json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}))])
                .await?;
            tx.commit().await?;
            return Ok((out, status == "denied"));
        }
        let (decision, why) = p.policy.decide(&call.name, &call.input);
        let known = tools::ALL.contains(&call.name.as_str())
            && (p.enabled.is_empty() || p.enabled.contains(&call.name));
        if known && decision == Decision::Ask {
            let (mut tx, mut seq) = self.begin().await?;
            self.journal(&mut tx, input_id, call, "awaiting_approval", None)
                .await?;
            sqlx::query("UPDATE session_state SET status = 'awaiting_approval', detail = $2, updated_at = now() WHERE session_id = $1")
                .bind(self.id)
                .bind(format!("tool `{}` waits for an approval", call.name))
                .execute(&mut *tx)
                .await?;
            self.append_events(&mut tx, &mut seq, &[("approval_requested", json!({"call_id": call.id, "tool": call.name, "input": call.input, "policy": why}))])
                .await?;
            tx.commit().await?;
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
            let (mut tx, mut seq) = self.begin().await?;
            self.journal(&mut tx, input_id, call, "denied", Some(&out))
                .await?;
            self.result_message(&mut tx, input_id, call, &out).await?;
            self.append_events(&mut tx, &mut seq, &[("tool_denied", json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output}))])
                .await?;
            tx.commit().await?;
            return Ok((out, known));
        }
        self.execute(p, input_id, call, false).await
    }

    /// Runs an allowed call: journaled `started` first (once committed, never run again), then
    /// `completed` with its result message in one transaction.
    async fn execute(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        approved: bool,
    ) -> Result<(ToolOutput, bool), Stop> {
        if let Some(link) = &p.worker
            && !call.name.starts_with("memory_")
        {
            self.wait_worker(link).await?;
        }
        let (mut tx, mut seq) = self.begin().await?;
        if approved {
            let moved = sqlx::query("UPDATE session_tool_calls SET status = 'started' WHERE session_id = $1 AND call_id = $2 AND status = 'awaiting_approval'")
                .bind(self.id)
                .bind(&call.id)
                .execute(&mut *tx)
                .await?;
            if moved.rows_affected() != 1 {
                return Err(Stop::Fenced);
            }
        } else {
            self.journal(&mut tx, input_id, call, "started", None)
                .await?;
        }
        self.append_events(
            &mut tx,
            &mut seq,
            &[(
                "tool_call",
                json!({"call_id": call.id, "tool": call.name, "input": call.input}),
            )],
        )
        .await?;
        tx.commit().await?;
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
        let (mut tx, mut seq) = self.begin().await?;
        let mut out = if call.name == "memory_write" && secrets.is_ok() {
            // The note commits with the journal: never written twice.
            tools::memory_write(&mut tx, p.workspace_id, self.id, &call.input).await?
        } else {
            out
        };
        if let Ok(values) = &secrets {
            out.output = agentscope_domain::vault::Redactor::new(values).redact(&out.output);
        }
        sqlx::query("UPDATE session_tool_calls SET status = 'completed', output = $3, is_error = $4, finished_at = now() WHERE session_id = $1 AND call_id = $2")
            .bind(self.id)
            .bind(&call.id)
            .bind(&out.output)
            .bind(out.is_error)
            .execute(&mut *tx)
            .await?;
        self.result_message(&mut tx, input_id, call, &out).await?;
        self.append_events(&mut tx, &mut seq, &[("tool_result", json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}))])
            .await?;
        tx.commit().await?;
        Ok((out, false))
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
            self.r.wait_for_news(Duration::from_millis(500)).await;
        };
        let allowed = status == "allowed";
        let decided = json!({"call_id": call.id, "allow": allowed, "status": status, "reason": reason, "decided_by": decided_by});
        if allowed {
            self.event("approval_decided", decided).await?;
            self.set_status("running", "").await?;
            return self.execute(p, input_id, call, true).await;
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
        let (mut tx, mut seq) = self.begin().await?;
        sqlx::query("UPDATE session_tool_calls SET status = 'denied', output = $3, is_error = true, finished_at = now() WHERE session_id = $1 AND call_id = $2")
            .bind(self.id)
            .bind(&call.id)
            .bind(&out.output)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE session_state SET status = 'running', detail = '', updated_at = now() WHERE session_id = $1")
            .bind(self.id)
            .execute(&mut *tx)
            .await?;
        self.result_message(&mut tx, input_id, call, &out).await?;
        self.append_events(
            &mut tx,
            &mut seq,
            &[
                ("approval_decided", decided),
                ("tool_denied", json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output})),
            ],
        )
        .await?;
        tx.commit().await?;
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

    async fn journal(
        &self,
        tx: &mut Tx<'_>,
        input_id: Uuid,
        call: &ToolCallReq,
        status: &str,
        out: Option<&ToolOutput>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO session_tool_calls (session_id, call_id, input_id, tool, input, status, output, is_error, finished_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, CASE WHEN $6 = 'started' THEN NULL ELSE now() END)",
        )
        .bind(self.id)
        .bind(&call.id)
        .bind(input_id)
        .bind(&call.name)
        .bind(&call.input)
        .bind(status)
        .bind(out.map(|o| o.output.as_str()))
        .bind(out.is_some_and(|o| o.is_error))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn result_message(
        &self,
        tx: &mut Tx<'_>,
        input_id: Uuid,
        call: &ToolCallReq,
        out: &ToolOutput,
    ) -> Result<(), sqlx::Error> {
        self.append_message(
            tx,
            input_id,
            &Message::ToolResult {
                call_id: call.id.clone(),
                output: out.output.clone(),
                is_error: out.is_error,
            },
        )
        .await
    }
}
