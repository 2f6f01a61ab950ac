//! Task submissions and cancellations from the gateway (stream AGENTSCOPE_TASKS).

use crate::{Ctx, Error, attempts};
use agentscope_bus::{CONSUMER_INTAKE, Consume, STREAM_TASKS, subjects};
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{
    CancelAttempt, CancelRequest, HostCommand, TaskSubmitted, host_command,
};
use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

/// "will retry" warnings: one line per interval during an outage.
static RETRY_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let stream = ctx.js.get_stream(STREAM_TASKS).await.map_err(Error::bus)?;
    // Created or updated: an existing consumer takes the current `max_deliver`.
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER_INTAKE.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: ctx.config.max_deliver,
            ..Default::default()
        })
        .await
        .map_err(Error::bus)?;
    let messages = consumer.messages().await.map_err(Error::bus)?;
    // Handlers are idempotent and independent per task, so messages are handled concurrently.
    let how = Consume {
        name: CONSUMER_INTAKE,
        concurrency: 16,
    };
    let ctx = &ctx;
    agentscope_bus::consume(messages, how, cancel, |msg| async move {
        let subject = msg.subject.to_string();
        let parent = agentscope_bus::traceparent(msg.headers.as_ref());
        let span = tracing::info_span!("intake", %subject, task_id = tracing::field::Empty);
        agentscope_bus::set_parent(&span, parent.as_deref());
        let res = handle(ctx, &subject, &msg.payload).instrument(span).await;
        match res {
            Ok(()) => AckKind::Ack,
            Err(e) => {
                if e.retryable()
                    && let Some(more) = RETRY_WARNING.check()
                {
                    tracing::warn!(error = ?e, %subject, "intake failed; will retry{more}");
                }
                crate::retry_or_reject(
                    ctx,
                    &msg,
                    CONSUMER_INTAKE,
                    &crate::describe(&e),
                    e.retryable(),
                    Duration::from_millis(500),
                    crate::redelivery_max(ctx),
                )
                .await
            }
        }
    })
    .await;
    Ok(())
}

async fn handle(ctx: &Ctx, subject: &str, payload: &[u8]) -> Result<(), Error> {
    match subject {
        subjects::TASK_SUBMITTED => {
            let m = TaskSubmitted::decode(payload)
                .map_err(|_| Error::Rejected("malformed TaskSubmitted payload".into()))?;
            let task_id = parse_id(&m.task_id)?;
            tracing::Span::current().record("task_id", m.task_id.as_str());
            if let Some(pool) = attempts::ensure_first_attempt(ctx, task_id).await? {
                attempts::nudge_ready(ctx, pool).await;
            }
            Ok(())
        }
        subjects::TASK_CANCEL => {
            let m = CancelRequest::decode(payload)
                .map_err(|_| Error::Rejected("malformed CancelRequest payload".into()))?;
            cancel_task(ctx, parse_id(&m.task_id)?, &m.reason).await
        }
        other => Err(Error::Rejected(format!("unexpected subject {other}"))),
    }
}

fn parse_id(s: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(s).map_err(|_| Error::Rejected(format!("invalid id {s:?}")))
}

/// Cancels the newest attempt of a task: a queued one at once, an active one through its host.
pub(crate) async fn cancel_task(ctx: &Ctx, task_id: Uuid, reason: &str) -> Result<(), Error> {
    let mut tx = ctx.db.begin().await?;
    let newest = sqlx::query_scalar!(
        "SELECT id FROM attempts WHERE task_id = $1 ORDER BY number DESC LIMIT 1",
        task_id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(attempt_id) = newest else {
        // No attempt yet: creation sees cancel_requested_at and creates it cancelled.
        return Ok(());
    };
    let Some(a) = attempts::lock(&mut tx, attempt_id).await? else {
        return Ok(());
    };
    match a.status {
        AttemptStatus::Queued => {
            attempts::finish(
                &mut tx,
                &a,
                AttemptStatus::Cancelled,
                Some(FailureClass::Cancelled),
                reason,
                None,
            )
            .await?;
            tx.commit().await?;
            notify(ctx, a.id, a.task_id, a.last_seq as u64, true).await;
        }
        s if s.is_active() => {
            tx.commit().await?;
            let Some(host) = a.host_id else { return Ok(()) };
            let cmd = HostCommand {
                command_id: format!("cancel:{}", a.id),
                command: Some(host_command::Command::Cancel(CancelAttempt {
                    attempt_id: a.id.to_string(),
                    reason: reason.to_string(),
                    grace_ms: 5_000,
                })),
            };
            crate::command_host(ctx, host, cmd).await?;
            tracing::info!(attempt_id = %a.id, %host, "cancel sent to host");
        }
        _ => {}
    }
    Ok(())
}

/// Wakes live followers of an attempt's events; `ended`: the attempt's end was just committed.
pub(crate) async fn notify(ctx: &Ctx, attempt_id: Uuid, task_id: Uuid, seq: u64, ended: bool) {
    let n = agentscope_schemas::v1::Recorded {
        attempt_id: attempt_id.to_string(),
        seq,
        task_id: task_id.to_string(),
        ended,
        ..Default::default()
    };
    publish_recorded(ctx, n).await;
}

/// Publishes a commit notice (core NATS: a lost one delays a live stream, never breaks it).
pub(crate) async fn publish_recorded(ctx: &Ctx, n: agentscope_schemas::v1::Recorded) {
    let subject = subjects::recorded(&n.attempt_id);
    let _ = ctx.nats.publish(subject, n.encode_to_vec().into()).await;
}
