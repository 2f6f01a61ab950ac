//! The sweeper: the correctness backstop. Every `sweep_interval_ms` it marks attempts whose lease
//! is gone as lost (retrying them under the policy), schedules tasks whose submission message was
//! lost, binds attempts whose agent got a binding, and wakes pools with ready work.

use crate::{Ctx, attempts};
use agentscope_bus::lease_key;
use agentscope_domain::{AttemptStatus, FailureClass};
use async_nats::jetstream::kv::Operation;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

static REJECTED_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(60));

pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(ctx.config.sweep_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut orphans = OrphanCursor::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        if let Err(e) = sweep(&ctx, &mut orphans).await {
            tracing::warn!(error = ?e, "sweep failed; next tick retries");
        }
    }
}

async fn sweep(ctx: &Ctx, orphans: &mut OrphanCursor) -> Result<(), crate::Error> {
    sweep_leases(ctx).await?;
    crate::approvals::expire(ctx).await?;
    sweep_rest(ctx, orphans).await
}

/// Tasks without an attempt one sweep reads at most.
const ORPHAN_PAGE: i64 = 200;

/// Where the next sweep for tasks without an attempt reads from: after the last task the
/// previous one read (`created_at`, `id`), or from the oldest once a page came back short. Tasks
/// that can never have an attempt stay in that set; read from the oldest every time, a page of
/// them would hide every task after it.
#[derive(Default)]
struct OrphanCursor(Option<(chrono::DateTime<chrono::Utc>, Uuid)>);

async fn sweep_leases(ctx: &Ctx) -> Result<(), crate::Error> {
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
    .fetch_all(&ctx.db)
    .await?;
    for a in active {
        let (attempt_id, token, host_id) = (a.id, a.lease_token, a.host_id);
        let key = lease_key(&host_id.to_string(), &attempt_id.to_string());
        let alive = match ctx.leases.entry(&key).await {
            Ok(Some(e)) => e.operation == Operation::Put,
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = ?e, %attempt_id, "read lease");
                continue;
            }
        };
        if !alive {
            mark_lost(ctx, attempt_id, token).await?;
        }
    }
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

async fn sweep_rest(ctx: &Ctx, cursor: &mut OrphanCursor) -> Result<(), crate::Error> {
    // 2. Tasks stored without their attempt (by a gateway of an earlier version or a tool, whose
    // submission message may be lost). Only tasks not yet known to have one are read (a partial
    // index, migration 0009), a page per sweep from where the last one ended: those that have one
    // by now are marked, the rest get one.
    let (after_at, after_id) = cursor.0.unzip();
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
        ORPHAN_PAGE,
    )
    .fetch_all(&ctx.db)
    .await?;
    let next = match page.last() {
        Some(last) if page.len() as i64 == ORPHAN_PAGE => Some((last.created_at, last.id)),
        _ => None,
    };
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
    cursor.0 = next;

    // 3. Queued attempts of tasks whose cancellation message was lost.
    // (`tasks_cancel_requested`, migration 0009: the tasks read are those with a request.)
    let stale = sqlx::query_scalar!(
        "SELECT a.task_id FROM attempts a JOIN tasks t ON t.id = a.task_id
         WHERE a.status = 'queued' AND t.cancel_requested_at IS NOT NULL LIMIT 200",
    )
    .fetch_all(&ctx.db)
    .await?;
    for task_id in stale {
        crate::intake::cancel_task(ctx, task_id, "cancel requested").await?;
    }

    // 4. Attempts created before their agent had a binding, and pools with ready work.
    for pool in attempts::rebind_unbound(ctx).await? {
        attempts::nudge_ready(ctx, pool).await;
    }
    // A skip scan of the queue's index (migration 0017): its cost follows the pools, not the
    // backlog.
    let ready = sqlx::query_scalar!(
        r#"SELECT pool_id AS "pool_id!" FROM pools_with_ready_work() AS pool_id"#,
    )
    .fetch_all(&ctx.db)
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
