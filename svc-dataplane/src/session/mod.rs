//! The managed loop: one replica at a time works on a session (a lease in KV, fenced in
//! PostgreSQL), turning each submitted input into model turns and tool calls until the model
//! answers without tools, `max_iters` is reached, or the model cannot be reached.
//!
//! Durability: every message, tool call and event is written in a transaction that first checks
//! the replica's fencing token. A tool call is journaled `started` before it runs and
//! `completed` with its result message in one transaction after. File reads, which change
//! nothing, are the exception: those at the head of a turn run while their `started` rows are
//! written, later ones once the calls before them have run, without a `started` row; their
//! output goes to the model before any of that commits, and their ends (or whole rows) are
//! written with the next turn. A replica that
//! takes a session over rebuilds it from the journal: a completed call is never run again; a
//! read left `started` is read again; any other call left `started` is reported to the model as
//! interrupted, never silently repeated.
//!
//! The parts: `lease` (who works on a session), `pinned` (what it runs with), `journal` (every
//! durable step as one fenced write), `turn` (one input's model turns), `calls` (one tool call
//! through the policy and the journal), `approvals` (a call that waits for an Approval),
//! `dispatch` (where a tool runs: Environment, E2B, Worker, the Issue).

mod approvals;
mod calls;
mod dispatch;
mod journal;
mod lease;
mod pinned;
mod turn;

pub use lease::lease_key;

use crate::Config;
use crate::env::{SandboxSpec, UidRange};
use agentscope_domain::SessionStatus;
use agentscope_telemetry::supervisor::Work;
use async_nats::jetstream::kv;
use serde_json::json;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub struct Runner {
    /// Takes its connections back without a round trip (`agentscope_store::warm`): a session's
    /// statements come one after another.
    pub db: agentscope_store::warm::Warm,
    /// The sweep's connection: it plans no sequential scan, so that statistics of a young
    /// `session_inputs` cannot turn its search for unanswered inputs into a read of every input.
    sweep_db: sqlx::PgPool,
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
    /// Sessions of `active` nudged since they last looked (see [`Runner::nudge`]).
    nudged: Mutex<HashSet<Uuid>>,
    /// Fired when the replica stops: sessions stop at their next await point and hand their
    /// lease back.
    stopping: CancellationToken,
    /// Where every session this replica works on is spawned: the supervisor's work, awaited
    /// (within its grace period) at shutdown.
    sessions: Work,
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
        sessions: Work,
    ) -> Arc<Self> {
        // One connection pool for the model and E2B.
        let http = reqwest::Client::new();
        Arc::new(Runner {
            sweep_db: agentscope_store::sibling_by_key(&db, 1),
            db: agentscope_store::warm_sibling(&db, config.db_max_connections),
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
            nudged: Mutex::new(HashSet::new()),
            stopping: sessions.stopping(),
            sessions,
        })
    }

    /// Sessions with an input that has no outcome yet.
    pub async fn sessions_with_work(&self) -> Result<Vec<Uuid>, sqlx::Error> {
        // Only inputs not known to be answered are read (a partial index, migration 0009); one
        // found with an outcome after all (written before its flag was) is marked here.
        sqlx::query_scalar!(
            r#"WITH marked AS (
                   UPDATE session_inputs i SET answered = true
                    WHERE NOT i.answered
                      AND EXISTS (SELECT 1 FROM session_outcomes o WHERE o.input_id = i.id)
                   RETURNING i.id
               )
               SELECT DISTINCT i.session_id FROM session_inputs i
                WHERE NOT i.answered AND i.id NOT IN (SELECT id FROM marked) LIMIT 500"#,
        )
        .fetch_all(&self.sweep_db)
        .await
    }

    /// Returns on news for any session, or after `at_most`.
    async fn wait_for_news(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.news.notified()).await;
    }

    /// Takes the session over under `token`, then works through its inputs in order.
    async fn run(&self, session_id: Uuid, token: i64) -> Result<(), Stop> {
        // A session refused here was already told so: leave it (and its events) alone.
        let row = sqlx::query!(
            r#"SELECT s.environment, st.status AS "status?" FROM sessions s LEFT JOIN session_state st ON st.session_id = s.id WHERE s.id = $1"#,
            session_id,
        )
        .fetch_one(&self.db)
        .await?;
        let (environment, status) = (row.environment, row.status);
        if ["local", "remote"].contains(&environment.as_str())
            && !self.config.allow_local_environment
            && status.as_deref().and_then(SessionStatus::parse)
                == Some(SessionStatus::EnvironmentNotAllowed)
        {
            return Ok(());
        }
        // Nothing to do (a nudge or sweep that came after the last input's outcome): leave the
        // session as it is. Taking it over would set it `running` with nothing running and tell
        // its followers of a takeover that never happened.
        let Some(mut next) = self.next_input(session_id).await? else {
            return Ok(());
        };
        let taken: Option<i64> = sqlx::query_scalar!(
            "INSERT INTO session_state (session_id, status, lease_token, replica) VALUES ($1, 'running', $2, $3)
             ON CONFLICT (session_id) DO UPDATE SET lease_token = EXCLUDED.lease_token, replica = EXCLUDED.replica,
                 status = 'running', detail = '', updated_at = now()
             WHERE session_state.lease_token < EXCLUDED.lease_token
             RETURNING last_seq",
            session_id,
            token,
            &self.replica,
        )
        .fetch_optional(&self.db)
        .await?;
        let Some(last_seq) = taken else {
            return Err(Stop::Fenced);
        };
        let s = Session {
            r: self,
            id: session_id,
            token,
        };
        // A takeover continues an input another replica began; a session's next input, taken
        // by whichever replica is free, is not one.
        let continued = last_seq > 0
            && sqlx::query_scalar!(
                r#"SELECT EXISTS (SELECT 1 FROM session_messages WHERE session_id = $1 AND input_id = $2) AS "begun!""#,
                session_id,
                next.0,
            )
            .fetch_one(&self.db)
            .await?;
        if continued {
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
            s.work(&pinned, next.0, &next.1).await?;
            next = match self.next_input(session_id).await? {
                Some(n) => n,
                None => return Ok(()),
            };
        }
    }

    /// The session's first input without an outcome: its id and text.
    async fn next_input(&self, session_id: Uuid) -> Result<Option<(Uuid, String)>, sqlx::Error> {
        let row = sqlx::query!(
            "SELECT i.id, i.text FROM session_inputs i WHERE i.session_id = $1
             AND NOT EXISTS (SELECT 1 FROM session_outcomes o WHERE o.input_id = i.id)
             ORDER BY i.id LIMIT 1",
            session_id,
        )
        .fetch_optional(&self.db)
        .await?;
        Ok(row.map(|r| (r.id, r.text)))
    }
}

struct Session<'a> {
    r: &'a Runner,
    id: Uuid,
    token: i64,
}
