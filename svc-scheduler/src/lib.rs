//! svc-scheduler: answers host registrations and claims under KV leases, records execution
//! events exactly once, detects lost leases and retries, and gives a task found without an
//! attempt its first one.
//!
//! Architecture invariant: the scheduler is the only writer of `hosts`, `attempts`,
//! `execution_events`, `approvals`, `runs`, `run_nodes` and `rejected_messages`, with two
//! exceptions made for latency (ARCHITECTURE.md, "Data ownership"): the gateway inserts a task's
//! attempt 1 with the task, and decides a managed session's pending approval.

mod approvals;
mod attempts;
mod callout;
mod claim;
mod config;
mod hosts;
mod intake;
mod recorder;
mod sweeper;

pub use config::Config;

use agentscope_bus::Topology;
use agentscope_telemetry::health::{self, Metrics};
use agentscope_telemetry::supervisor::{Policy, Supervisor};
use anyhow::Context as _;
use async_nats::jetstream;
use sqlx::PgPool;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database")]
    Db(#[from] sqlx::Error),
    #[error("bus")]
    Bus(#[source] async_nats::Error),
    #[error("{0}")]
    Rejected(String),
}

impl Error {
    /// Transient errors are retried (delayed NAK); everything else terminates the message at
    /// once and records it in `rejected_messages`. A database error is transient unless the
    /// data itself is refused (SQLSTATE 22xxx data exceptions such as a NUL character, 23xxx
    /// integrity violations, values that do not encode or decode): those fail the same way on
    /// every redelivery.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Db(e) => agentscope_store::fault(e) != agentscope_store::Fault::BadData,
            Error::Bus(_) => true,
            Error::Rejected(_) => false,
        }
    }
    fn bus(e: impl Into<async_nats::Error>) -> Self {
        Error::Bus(e.into())
    }
}

/// Publishes `cmd` to `host`'s control stream (its durable consumer); returns once the stream
/// has it. The command's id dedups a repeat within the stream's duplicate window.
pub(crate) async fn command_host(
    ctx: &Ctx,
    host: uuid::Uuid,
    cmd: agentscope_schemas::v1::HostCommand,
) -> Result<(), Error> {
    use agentscope_schemas::Message as _;
    ctx.js
        .publish_with_headers(
            agentscope_bus::subjects::control(&host.to_string()),
            agentscope_bus::headers(&cmd.command_id),
            cmd.encode_to_vec().into(),
        )
        .await
        .map_err(Error::bus)?
        .await
        .map_err(Error::bus)?;
    Ok(())
}

/// The sweeper runs one statement at a time.
const SWEEP_CONNECTIONS: u32 = 1;

/// Everything the scheduler's tasks share. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub db: PgPool,
    /// Claims' own connections (`Config::db_claim_connections`) and the recorder's
    /// (`Config::db_recorder_connections`): a few backends that stay warm.
    pub claim_db: PgPool,
    pub recorder_db: agentscope_store::warm::Warm,
    /// The sweeper's own reads, by index whatever the statistics say ([`SWEEP_CONNECTIONS`]).
    pub sweep_db: PgPool,
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    pub leases: jetstream::kv::Store,
    /// Host heartbeats: a host without a key here is offline.
    pub presence: jetstream::kv::Store,
    pub events: jetstream::stream::Stream,
    pub config: Arc<Config>,
    pub metrics: Metrics,
}

pub struct App {
    ctx: Ctx,
    health_addr: SocketAddr,
    cancel: CancellationToken,
    health_task: tokio::task::JoinHandle<()>,
}

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let db = agentscope_store::connect(&config.database_url, config.db_max_connections)
            .await
            .context("start svc-scheduler")?;
        agentscope_store::migrate(&db).await?;
        let claim_db = agentscope_store::sibling(&db, config.db_claim_connections);
        // Its statements find attempts by id: planned on a young database, `finish_many`'s join
        // was kept as a scan of every attempt, once per recorded batch.
        let recorder_db =
            agentscope_store::warm_sibling_by_key_planned_once(&db, config.db_recorder_connections);
        // Its passes look for a few rows among many (unbound, cancelled, orphaned, lost), once a
        // second: planned on a young database, such a search was kept as a scan of the table.
        let sweep_db = agentscope_store::sibling_by_key(&db, SWEEP_CONNECTIONS);
        let nats = config
            .nats
            .connect(&config.nats_url, "svc-scheduler")
            .await?;
        let js = jetstream::new(nats.clone());
        let events = Topology::events(&js).await?;
        Topology::control(&js).await?;
        Topology::tasks(&js).await?;
        Topology::approvals(&js).await?;
        let leases = Topology::leases(&js, Duration::from_millis(config.lease_ttl_ms)).await?;
        let presence =
            Topology::presence(&js, Duration::from_millis(config.heartbeat_ttl_ms)).await?;

        let metrics = Metrics::default();
        let cancel = CancellationToken::new();
        let probe = health::nats_and_postgres(nats.clone(), db.clone());
        let (health_addr, health_task) = health::serve(
            &config.health_addr,
            "svc-scheduler",
            probe,
            metrics.clone(),
            cancel.clone(),
        )
        .await
        .with_context(|| format!("bind health listener {}", config.health_addr))?;
        tracing::info!(%health_addr, "svc-scheduler listening for health checks");
        Ok(App {
            ctx: Ctx {
                db,
                claim_db,
                recorder_db,
                sweep_db,
                nats,
                js,
                leases,
                presence,
                events,
                config: Arc::new(config),
                metrics,
            },
            health_addr,
            cancel,
            health_task,
        })
    }

    fn callout_issuer(&self) -> anyhow::Result<Option<agentscope_bus::auth::AccountKey>> {
        let c = &self.ctx.config;
        let seed = agentscope_bus::secret_setting(
            "nats_callout_seed",
            c.nats_callout_seed.as_deref(),
            c.nats_callout_seed_file.as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        seed.map(|s| {
            agentscope_bus::auth::AccountKey::from_seed(&s)
                .map_err(|e| anyhow::anyhow!("nats_callout_seed: {e}"))
        })
        .transpose()
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    /// Runs every scheduler task until `shutdown` resolves or one of them fails; in-flight
    /// messages finish first. Every task is critical (the scheduler cannot do its job without
    /// any of them: the first to end stops the scheduler with its error, and the process's own
    /// supervisor starts it again) except the presence mirror, which is started again after a
    /// failure.
    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let mut sup = Supervisor::new("svc-scheduler", self.cancel.clone(), STOP_GRACE);
        let ctx = &self.ctx;
        let critical = Policy::Critical;
        sup.spawn("register", critical, with(ctx, hosts::serve_register));
        let restart = Policy::Restart {
            backoff: Duration::from_secs(1),
        };
        sup.spawn("presence", restart, with(ctx, hosts::watch_presence));
        sup.spawn("new-work", restart, with(ctx, attempts::watch_new_work));
        sup.spawn("claim", critical, with(ctx, claim::serve));
        sup.spawn("intake", critical, with(ctx, intake::run));
        sup.spawn("recorder", critical, with(ctx, recorder::run));
        sup.spawn("sweeper", critical, with(ctx, sweeper::run));
        let requests = with(ctx, approvals::consume_requests);
        sup.spawn("approval-requests", critical, requests);
        let decisions = with(ctx, approvals::serve_decisions);
        sup.spawn("approval-decisions", critical, decisions);
        match self.callout_issuer()? {
            Some(issuer) => {
                tracing::info!(
                    issuer = %issuer.public_key(),
                    "serving the NATS auth callout for hosts and workers"
                );
                let (c, issuer) = (ctx.clone(), Arc::new(issuer));
                sup.spawn("nats-callout", critical, move |stop| {
                    callout::serve(c.clone(), issuer.clone(), stop)
                });
            }
            None => tracing::info!(
                "not serving the NATS auth callout (no nats_callout_seed): hosts and workers connect only where another scheduler serves it or NATS is open"
            ),
        }
        tracing::info!("svc-scheduler running");
        let res = sup.run(shutdown).await;
        let _ = self.ctx.nats.flush().await;
        let _ = self.health_task.await;
        tracing::info!("svc-scheduler stopped");
        // A failed task's error, if one stopped the scheduler: the process exits with it.
        res
    }
}

/// How long the scheduler's tasks get to finish what they hold at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A core task's maker: `task` started with its own copy of the context.
fn with<F, Fut>(ctx: &Ctx, task: F) -> impl Fn(CancellationToken) -> Fut + Send + 'static
where
    F: Fn(Ctx, CancellationToken) -> Fut + Send + 'static,
{
    let ctx = ctx.clone();
    move |stop| task(ctx.clone(), stop)
}

/// The newest event the host has published for an attempt, as the stream holds it (the
/// recorder may not have caught up): its seq and the host's timestamp (ms). None when the host
/// never reported anything.
pub(crate) async fn last_published(
    ctx: &Ctx,
    host_id: uuid::Uuid,
    attempt_id: uuid::Uuid,
) -> Result<Option<(u64, i64)>, Error> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = agentscope_bus::subjects::events(&host_id.to_string(), &attempt_id.to_string());
    match ctx.events.get_last_raw_message_by_subject(&subject).await {
        Ok(m) => Ok(Some(
            agentscope_schemas::decode_events(m.payload.as_ref())
                .ok()
                .and_then(|events| events.last().map(|e| (e.seq, e.at_ms)))
                .unwrap_or((0, 0)),
        )),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(Error::bus(e)),
    }
}

/// An error as recorded in `rejected_messages`: with the database's own message and SQLSTATE.
pub(crate) fn describe(e: &Error) -> String {
    match e {
        Error::Db(sqlx::Error::Database(d)) => format!(
            "database refused the data ({}): {}",
            d.code().unwrap_or_default(),
            d.message()
        ),
        Error::Db(e) => format!("database: {e}"),
        Error::Bus(e) => format!("bus: {e}"),
        Error::Rejected(m) => m.clone(),
    }
}

/// The longest delay between deliveries of a message that failed transiently.
pub(crate) fn redelivery_max(ctx: &Ctx) -> Duration {
    Duration::from_millis(ctx.config.redelivery_max_ms)
}

/// How a stream consumer settles a message it could not handle now: a non-retryable failure is
/// recorded in `rejected_messages` and terminated at once; a retryable one is redelivered after
/// `base · 2^(n-1)` (at most `max`), until its `max_deliver`-th delivery, which
/// is recorded and terminated instead (a poison message is never retried forever).
pub(crate) async fn retry_or_reject(
    ctx: &Ctx,
    msg: &jetstream::Message,
    consumer: &str,
    reason: &str,
    retryable: bool,
    base: Duration,
    max: Duration,
) -> jetstream::AckKind {
    let subject = msg.subject.as_str();
    if !retryable {
        reject(ctx, subject, consumer, reason, &msg.payload).await;
        return jetstream::AckKind::Term;
    }
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).max(1);
    if delivered >= ctx.config.max_deliver {
        let reason = format!("gave up after {delivered} deliveries: {reason}");
        reject(ctx, subject, consumer, &reason, &msg.payload).await;
        return jetstream::AckKind::Term;
    }
    jetstream::AckKind::Nak(Some(redelivery_delay(base, delivered, max)))
}

/// `base · 2^(delivered-1)`, capped at `max`.
fn redelivery_delay(base: Duration, delivered: i64, max: Duration) -> Duration {
    let exp = (delivered - 1).clamp(0, 20) as u32;
    base.saturating_mul(1u32 << exp).min(max)
}

/// Text as PostgreSQL can store it: NUL (`\u0000`) is the one character a `text` or `jsonb`
/// value cannot hold; it is stored as U+FFFD. Used for free text hosts and sessions report
/// (output, messages, tool input), which must not make an event or request unrecordable.
pub(crate) fn storable(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains('\0') {
        std::borrow::Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// [`storable`] for every string (keys included) of a JSON value.
pub(crate) fn storable_json(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::String(s) if s.contains('\0') => *s = storable(s).into_owned(),
        Value::Array(a) => a.iter_mut().for_each(storable_json),
        Value::Object(o) if o.keys().any(|k| k.contains('\0')) => {
            let old = std::mem::take(o);
            for (k, mut v) in old {
                storable_json(&mut v);
                o.insert(storable(&k).into_owned(), v);
            }
        }
        Value::Object(o) => o.values_mut().for_each(storable_json),
        _ => {}
    }
}

/// Records a bus message that was terminated instead of processed.
pub(crate) async fn reject(ctx: &Ctx, subject: &str, consumer: &str, reason: &str, payload: &[u8]) {
    let (subject, reason) = (storable(subject), storable(reason));
    let (subject, reason) = (subject.as_ref(), reason.as_ref());
    ctx.metrics.inc(
        "agentscope_rejected_messages_total",
        &[("consumer", consumer)],
    );
    tracing::warn!(subject, consumer, reason, "bus message rejected");
    let excerpt = &payload[..payload.len().min(64 * 1024)];
    if let Err(e) = sqlx::query!(
        "INSERT INTO rejected_messages (subject, consumer, reason, payload) VALUES ($1, $2, $3, $4)",
        subject,
        consumer,
        reason,
        excerpt,
    )
    .execute(&ctx.db)
    .await
    {
        tracing::error!(error = ?e, "record rejected message");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redelivery_doubles_up_to_the_cap() {
        let base = Duration::from_millis(500);
        let max = Duration::from_secs(10);
        assert_eq!(redelivery_delay(base, 1, max), base);
        assert_eq!(redelivery_delay(base, 2, max), Duration::from_secs(1));
        assert_eq!(redelivery_delay(base, 5, max), Duration::from_secs(8));
        assert_eq!(redelivery_delay(base, 6, max), max);
        assert_eq!(redelivery_delay(base, 999, max), max);
    }

    #[test]
    fn nul_characters_are_stored_as_replacement_characters() {
        assert_eq!(storable("a\0b"), "a\u{FFFD}b");
        let mut v = serde_json::json!({"k\0": ["x\0", {"y": "\0"}], "n": 1});
        storable_json(&mut v);
        assert_eq!(
            v,
            serde_json::json!({"k\u{FFFD}": ["x\u{FFFD}", {"y": "\u{FFFD}"}], "n": 1})
        );
    }
}
