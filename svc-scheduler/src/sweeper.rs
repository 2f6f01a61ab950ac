//! The sweeper: the correctness backstop. Every `sweep_interval_ms` it marks attempts whose lease
//! is gone as lost (retrying them under the policy), schedules tasks whose submission message was
//! lost, binds attempts whose agent got a binding, and wakes pools with ready work.

use crate::{Ctx, attempts};
use agentscope_bus::lease_key;
use agentscope_domain::{AttemptStatus, FailureClass};
use async_nats::jetstream::kv::Operation;
use std::collections::HashMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

static REJECTED_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(60));
static RESEND_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(60));

pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(ctx.config.sweep_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut carried = Carried::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let swept = sweep(&ctx, &mut carried).await;
        ctx.metrics.inc(
            "agentscope_sweeps_total",
            &[("result", if swept.is_ok() { "ok" } else { "error" })],
        );
        if let Err(e) = swept {
            tracing::warn!(error = ?e, "sweep failed; next tick retries");
        }
    }
}

async fn sweep(ctx: &Ctx, carried: &mut Carried) -> Result<(), crate::Error> {
    sweep_leases(ctx, &mut carried.leases).await?;
    crate::approvals::expire(ctx).await?;
    crate::approvals::deliver_overdue(ctx).await?;
    sweep_rest(ctx, carried).await
}

/// Rows of a set (tasks without an attempt, pending cancellation requests) one sweep reads at
/// most.
const PAGE: i64 = 200;

/// A cancellation request still pending this long after it was made has had its message lost
/// (the usual path takes milliseconds, and a host stops a cancelled attempt within its grace of
/// 5 s): the sweeper sends it again.
const CANCEL_OVERDUE_SECS: f64 = 10.0;

/// Where the next sweep reads a set from: after the last row the previous one read (its time,
/// `id`), or from the oldest once a page came back short. Rows can stay in a set for long
/// (a task that can never have an attempt; an attempt whose host does not stop it); read from
/// the oldest every time, a page of them would hide every row after it.
#[derive(Default)]
struct Cursor(Option<(chrono::DateTime<chrono::Utc>, Uuid)>);

impl Cursor {
    fn after(&self) -> (Option<chrono::DateTime<chrono::Utc>>, Option<Uuid>) {
        self.0.unzip()
    }

    /// Where to read from after a page whose last row is `last`.
    fn next(len: usize, last: Option<(chrono::DateTime<chrono::Utc>, Uuid)>) -> Cursor {
        Cursor(last.filter(|_| len as i64 == PAGE))
    }
}

/// What one pass leaves to the next.
#[derive(Default)]
struct Carried {
    orphans: Cursor,
    cancels: Cursor,
    leases: LeaseReads,
}

/// When each active attempt's lease (by attempt and fencing token) is next worth reading. A
/// lease last written at `t` exists until `t` + TTL (the bucket's `max_age`) unless removed,
/// which its holder and the recorder do once the work is over: read at `t` + TTL, not on every
/// pass, it is found renewed (and read again a TTL after that renewal) or gone. A long-running
/// attempt's lease is read about once a TTL, not once a pass. The time is the server's; a
/// scheduler whose clock is behind the server's by `d` finds an expiry `d` later, at most a TTL.
#[derive(Default)]
struct LeaseReads(HashMap<(Uuid, i64), tokio::time::Instant>);

impl LeaseReads {
    /// When to read a lease found written at `created` again.
    fn after(ttl: Duration, created_ms: i64) -> tokio::time::Instant {
        let age = agentscope_bus::now_ms().saturating_sub(created_ms).max(0) as u64;
        tokio::time::Instant::now() + ttl.saturating_sub(Duration::from_millis(age))
    }
}

async fn sweep_leases(ctx: &Ctx, reads: &mut LeaseReads) -> Result<(), crate::Error> {
    // 1. Active attempts whose lease key is gone (expired or purged) are lost. A claim creates
    // its leases just after it commits, and a direct dispatch while its offer travels (so its
    // host may already report the attempt running): an attempt without one is lost only once a
    // lease TTL has passed since its claim (its claimer died in between, or could not put it
    // back). That delays nothing else: a lease that expired was last renewed a TTL ago, so
    // created at least that long ago.
    let active = sqlx::query!(
        r#"SELECT id, lease_token AS "lease_token!", host_id AS "host_id!" FROM attempts
           WHERE status IN ('claimed','running') AND lease_token IS NOT NULL AND host_id IS NOT NULL
             AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $1))"#,
        ctx.config.lease_ttl_ms as f64 / 1000.0,
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    let ttl = Duration::from_millis(ctx.config.lease_ttl_ms);
    let now = tokio::time::Instant::now();
    let mut next = HashMap::with_capacity(active.len());
    for a in active {
        let (attempt_id, token, host_id) = (a.id, a.lease_token, a.host_id);
        if let Some(&at) = reads.0.get(&(attempt_id, token))
            && at > now
        {
            next.insert((attempt_id, token), at);
            continue;
        }
        let key = lease_key(&host_id.to_string(), &attempt_id.to_string());
        ctx.metrics.inc("agentscope_lease_reads_total", &[]);
        match ctx.leases.entry(&key).await {
            Ok(Some(e)) if e.operation == Operation::Put => {
                let created_ms = (e.created.unix_timestamp_nanos() / 1_000_000) as i64;
                next.insert((attempt_id, token), LeaseReads::after(ttl, created_ms));
            }
            Ok(_) => mark_lost(ctx, attempt_id, token).await?,
            Err(e) => tracing::warn!(error = ?e, %attempt_id, "read lease"),
        }
    }
    reads.0 = next;
    Ok(())
}

/// Whether the host published events the recorder has not stored yet, recently enough that
/// they are still on their way (a message that can never be recorded must not block forever).
async fn unrecorded_events(
    ctx: &Ctx,
    host_id: Option<Uuid>,
    attempt_id: Uuid,
    last_seq: i64,
) -> Result<bool, crate::Error> {
    let Some(host_id) = host_id else {
        return Ok(false);
    };
    Ok(crate::last_published(ctx, host_id, attempt_id)
        .await?
        .is_some_and(|(seq, at_ms)| {
            seq as i64 > last_seq && agentscope_bus::now_ms() - at_ms < 60_000
        }))
}

async fn sweep_rest(ctx: &Ctx, carried: &mut Carried) -> Result<(), crate::Error> {
    // 2. Tasks stored without their attempt (by a gateway of an earlier version or a tool, whose
    // submission message may be lost). Only tasks not yet known to have one are read (a partial
    // index, migration 0009), a page per sweep from where the last one ended: those that have one
    // by now are marked, the rest get one.
    let (after_at, after_id) = carried.orphans.after();
    let page = sqlx::query!(
        r#"WITH unknown AS (
               SELECT id, created_at FROM tasks WHERE NOT has_attempt
                  AND created_at < now() - interval '2 seconds'
                  -- implied by the next line; said alone, it bounds the index scan
                  AND created_at >= COALESCE($1::timestamptz, '-infinity')
                  AND (created_at, id) > (COALESCE($1::timestamptz, '-infinity'), COALESCE($2::uuid, '00000000-0000-0000-0000-000000000000'))
               ORDER BY created_at, id LIMIT $3
           ), marked AS (
               UPDATE tasks t SET has_attempt = true FROM unknown u
                WHERE t.id = u.id AND EXISTS (SELECT 1 FROM attempts a WHERE a.task_id = u.id)
               RETURNING t.id
           )
           SELECT u.id AS "id!", u.created_at AS "created_at!",
                  u.id IN (SELECT id FROM marked) AS "marked!"
           FROM unknown u ORDER BY u.created_at, u.id"#,
        after_at,
        after_id,
        PAGE,
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    let next = Cursor::next(page.len(), page.last().map(|t| (t.created_at, t.id)));
    for task_id in page.into_iter().filter(|t| !t.marked).map(|t| t.id) {
        match attempts::ensure_first_attempt(ctx, task_id).await {
            Ok(_) => tracing::info!(%task_id, "scheduled a task found without attempt"),
            // A task that can never have an attempt (its row names what is not its
            // workspace's) must not stop the rest of the sweep on every tick.
            Err(crate::Error::Rejected(why)) => {
                if let Some(more) = REJECTED_WARNING.check() {
                    tracing::warn!(%task_id, %why, "task found without attempt cannot have one{more}");
                }
            }
            Err(e) => return Err(e),
        }
    }
    // Only once the page is done: a sweep that failed reads it again.
    carried.orphans = next;

    // 3. Cancellation requests whose message may be lost: pending ones only (migration 0018),
    // a page per sweep. A request is settled here once its task's newest attempt has ended
    // (nothing follows it: an end creates no retry for a task whose cancellation was
    // requested); a queued attempt is cancelled at once, an active one's host is sent the cancel
    // again once the request is overdue. A task without an attempt gets one cancelled (2).
    let (after_at, after_id) = carried.cancels.after();
    let page = sqlx::query!(
        r#"WITH pending AS (
               SELECT id, cancel_requested_at AS at FROM tasks WHERE cancel_pending
                  AND cancel_requested_at >= COALESCE($1::timestamptz, '-infinity')
                  AND (cancel_requested_at, id) > (COALESCE($1::timestamptz, '-infinity'), COALESCE($2::uuid, '00000000-0000-0000-0000-000000000000'))
               ORDER BY cancel_requested_at, id LIMIT $3
           ), newest AS (
               SELECT p.id, p.at, n.status FROM pending p LEFT JOIN LATERAL (
                   SELECT a.status FROM attempts a WHERE a.task_id = p.id
                    ORDER BY a.number DESC LIMIT 1) n ON true
           ), settled AS (
               UPDATE tasks t SET cancel_pending = false FROM newest n
                WHERE t.id = n.id AND n.status IN ('succeeded', 'failed', 'cancelled', 'lost')
           )
           SELECT id AS "id!", at AS "at!", status AS "status?",
                  at < now() - make_interval(secs => $4) AS "overdue!"
           FROM newest ORDER BY at, id"#,
        after_at,
        after_id,
        PAGE,
        CANCEL_OVERDUE_SECS,
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    let next = Cursor::next(page.len(), page.last().map(|t| (t.at, t.id)));
    for t in page {
        match t.status.as_deref() {
            Some("queued") => {}
            // Once a second while its host stops the attempt (the stream drops the repeats).
            Some("claimed" | "running") if t.overdue => {
                if let Some(more) = RESEND_WARNING.check() {
                    tracing::warn!(task_id = %t.id, "cancellation still pending; sending it to the host again{more}");
                }
            }
            _ => continue,
        }
        // One that fails now is read again when the cursor comes back to it.
        if let Err(e) = crate::intake::cancel_task(ctx, t.id, "cancel requested").await {
            tracing::warn!(error = ?e, task_id = %t.id, "apply a pending cancellation");
        }
    }
    carried.cancels = next;

    // 4. Attempts created before their agent had a binding, and pools with ready work.
    for pool in attempts::rebind_unbound(ctx).await? {
        attempts::nudge_ready(ctx, pool).await;
    }
    // A skip scan of the queue's index (migration 0017): its cost follows the pools, not the
    // backlog.
    let ready = sqlx::query_scalar!(
        r#"SELECT pool_id AS "pool_id!" FROM pools_with_ready_work() AS pool_id"#,
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    for pool in ready {
        attempts::nudge_ready(ctx, pool).await;
    }
    Ok(())
}

async fn mark_lost(ctx: &Ctx, attempt_id: Uuid, token: i64) -> Result<(), crate::Error> {
    let mut tx = ctx.db.begin().await?;
    let Some(a) = attempts::lock(&mut tx, attempt_id).await? else {
        return Ok(());
    };
    if !a.status.is_active() || a.lease_token != Some(token) {
        return Ok(());
    }
    // Read again under the row lock: a claim offered again to its host creates a missing lease
    // while it holds this row, so a lease seen missing before the lock may exist now.
    let key = lease_key(
        &a.host_id.map(|h| h.to_string()).unwrap_or_default(),
        &attempt_id.to_string(),
    );
    if let Ok(Some(e)) = ctx.leases.entry(&key).await
        && e.operation == Operation::Put
    {
        return Ok(());
    }
    // The host's last words may still be on their way to the recorder (a scheduler restart
    // delays redelivery): an attempt is lost only once everything it published is recorded.
    if unrecorded_events(ctx, a.host_id, attempt_id, a.last_seq).await? {
        tracing::debug!(%attempt_id, "lease gone but events are still unrecorded; waiting");
        return Ok(());
    }
    // A host that stopped heartbeating too is offline (crash, power, network); one that still
    // beats lost only this lease.
    let host_gone = match a.host_id {
        Some(h) => !matches!(
            ctx.presence.entry(agentscope_bus::presence_key(&h.to_string())).await,
            Ok(Some(e)) if e.operation == Operation::Put
        ),
        None => false,
    };
    let (class, why) = if host_gone {
        (
            FailureClass::HostOffline,
            "lease expired: the host stopped renewing it and stopped heartbeating",
        )
    } else {
        (
            FailureClass::LeaseLost,
            "lease expired: the host stopped renewing it",
        )
    };
    let retry = attempts::finish(&mut tx, &a, AttemptStatus::Lost, Some(class), why, None).await?;
    // The decision is part of the attempt's record, so logs and live streams show it.
    let next = a.last_seq + 1;
    sqlx::query!(
        "INSERT INTO execution_events (attempt_id, seq, kind, payload, at) VALUES ($1, $2, 'lifecycle', $3, now())",
        attempt_id,
        next,
        serde_json::json!({
        "state": "lost",
        "failure_class": class.as_str(),
        "remedy": class.remedy(),
        "detail": if retry.is_some() { format!("{why}; a new attempt is scheduled") } else { format!("{why}; no retry left") },
        "exit_code": null,
        "recorded_by": "scheduler",
        }),
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
        "UPDATE attempts SET last_seq = $2 WHERE id = $1",
        attempt_id,
        next,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    ctx.metrics.inc("agentscope_leases_lost_total", &[]);
    tracing::warn!(%attempt_id, task_id = %a.task_id, host_id = ?a.host_id, "lease expired; attempt lost");
    crate::intake::notify(ctx, attempt_id, a.task_id, a.last_seq as u64 + 1, true).await;
    if let Some(pool) = retry {
        attempts::nudge(ctx, pool).await;
    }
    Ok(())
}
