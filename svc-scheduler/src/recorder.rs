//! The recorder: stores every execution event exactly once, in order, and applies the lifecycle
//! transitions the events carry. Fencing: an event whose lease token or host does not match the
//! attempt's, or that arrives after the attempt ended, changes nothing and is recorded as rejected.

use crate::{Ctx, Error, attempts};
use agentscope_bus::{CONSUMER_RECORDER, STREAM_EVENTS, lease_key};
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{AttemptState, ExecutionEvent, execution_event::Body};
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{AckKind, Message as JsMessage};
use chrono::TimeZone;
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

/// Events of one attempt always go to the same worker, so they are handled in order.
const WORKERS: usize = 4;

/// "will retry" warnings: one line per interval during an outage.
static RETRY_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let stream = ctx.js.get_stream(STREAM_EVENTS).await.map_err(Error::bus)?;
    // Created or updated: an existing consumer takes the current `max_deliver`.
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER_RECORDER.into()),
            ack_policy: AckPolicy::Explicit,
            // Short, so events in flight when a scheduler dies are redelivered soon; a slow
            // redelivery of a message still being handled is a harmless duplicate.
            ack_wait: Duration::from_secs(5),
            max_ack_pending: 4096,
            max_deliver: ctx.config.max_deliver,
            ..Default::default()
        })
        .await
        .map_err(Error::bus)?;
    let mut messages = consumer.messages().await.map_err(Error::bus)?;
    let mut workers = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..WORKERS {
        let (tx, rx) = mpsc::channel::<JsMessage>(256);
        workers.push(tx);
        handles.push(tokio::spawn(worker(ctx.clone(), rx)));
    }
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => break,
            m = messages.next() => match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => { tracing::warn!(error = ?e, "recorder consumer"); continue }
                None => break,
            },
        };
        let shard = fxhash(msg.subject.as_str()) % WORKERS;
        if workers[shard].send(msg).await.is_err() {
            break;
        }
    }
    drop(workers);
    for h in handles {
        let _ = h.await;
    }
    Ok(())
}

fn fxhash(s: &str) -> usize {
    s.bytes()
        .fold(0usize, |h, b| h.rotate_left(5) ^ b as usize)
        .wrapping_mul(0x9e37_79b9)
}

async fn worker(ctx: Ctx, mut rx: mpsc::Receiver<JsMessage>) {
    while let Some(msg) = rx.recv().await {
        let subject = msg.subject.to_string();
        let ack = match ExecutionEvent::decode(msg.payload.as_ref()) {
            Err(_) => {
                crate::reject(
                    &ctx,
                    &subject,
                    CONSUMER_RECORDER,
                    "malformed ExecutionEvent payload",
                    &msg.payload,
                )
                .await;
                AckKind::Term
            }
            Ok(ev) => {
                let span = tracing::info_span!("record", attempt_id = %ev.attempt_id, seq = ev.seq);
                agentscope_bus::set_parent(
                    &span,
                    agentscope_bus::traceparent(msg.headers.as_ref()).as_deref(),
                );
                match record(&ctx, &subject, ev).instrument(span).await {
                    Ok(Outcome::Stored | Outcome::Duplicate) => AckKind::Ack,
                    // An earlier event is late; one that never comes leaves this event to
                    // `rejected_messages` after `max_deliver` deliveries.
                    Ok(Outcome::Gap) => {
                        crate::retry_or_reject(
                            &ctx,
                            &msg,
                            CONSUMER_RECORDER,
                            "an earlier event of the attempt never arrived",
                            true,
                            Duration::from_millis(100),
                            // An earlier event is usually only late: look again soon.
                            crate::redelivery_max(&ctx).min(Duration::from_secs(1)),
                        )
                        .await
                    }
                    Err(e) => {
                        if e.retryable()
                            && let Some(more) = RETRY_WARNING.check()
                        {
                            tracing::warn!(error = ?e, %subject, "record failed; will retry{more}");
                        }
                        crate::retry_or_reject(
                            &ctx,
                            &msg,
                            CONSUMER_RECORDER,
                            &crate::describe(&e),
                            e.retryable(),
                            Duration::from_millis(500),
                            crate::redelivery_max(&ctx),
                        )
                        .await
                    }
                }
            }
        };
        if let Err(e) = msg.ack_with(ack).await {
            tracing::warn!(error = ?e, "ack event");
        }
    }
}

enum Outcome {
    Stored,
    Duplicate,
    /// An earlier event of the attempt has not arrived yet.
    Gap,
}

async fn record(ctx: &Ctx, subject: &str, ev: ExecutionEvent) -> Result<Outcome, Error> {
    let attempt_id = Uuid::parse_str(&ev.attempt_id)
        .map_err(|_| Error::Rejected("attempt_id is not a UUID".into()))?;
    // The subject's host id is the one NATS authorized to publish it; the attempt's host is
    // checked against it below.
    if subject != agentscope_bus::subjects::events(&ev.host_id, &ev.attempt_id) {
        return Err(Error::Rejected(
            "subject does not match host_id and attempt_id".into(),
        ));
    }
    if ev.seq == 0 || ev.seq > i64::MAX as u64 {
        return Err(Error::Rejected("seq must be positive".into()));
    }
    let Some(body) = ev.body.as_ref() else {
        return Err(Error::Rejected("event has no body".into()));
    };
    let mut tx = ctx.db.begin().await?;
    let Some(a) = attempts::lock(&mut tx, attempt_id).await? else {
        return Err(Error::Rejected(format!("unknown attempt {attempt_id}")));
    };
    let seq = ev.seq as i64;
    if seq <= a.last_seq {
        // A redelivery of the host's own event is a duplicate; a host event where the scheduler
        // recorded the attempt's end (lease expiry) comes from a holder that lost its lease.
        let by_scheduler: Option<bool> = sqlx::query_scalar(
            "SELECT payload->>'recorded_by' = 'scheduler' FROM execution_events WHERE attempt_id = $1 AND seq = $2",
        )
        .bind(attempt_id)
        .bind(seq)
        .fetch_optional(&mut *tx)
        .await?
        .flatten();
        if by_scheduler != Some(true) {
            ctx.metrics.inc("agentscope_events_duplicate_total", &[]);
            return Ok(Outcome::Duplicate);
        }
    }
    if a.lease_token != Some(ev.lease_token as i64)
        || a.host_id.map(|h| h.to_string()) != Some(ev.host_id.clone())
    {
        ctx.metrics.inc("agentscope_events_fenced_total", &[]);
        return Err(Error::Rejected(format!(
            "fenced: lease token {} from host {} does not hold attempt {attempt_id}",
            ev.lease_token, ev.host_id
        )));
    }
    if a.status.is_terminal() {
        ctx.metrics.inc("agentscope_events_fenced_total", &[]);
        return Err(Error::Rejected(format!(
            "fenced: attempt {attempt_id} is already {}",
            a.status
        )));
    }
    if seq > a.last_seq + 1 {
        return Ok(Outcome::Gap);
    }
    let (kind, mut payload) = to_record(body);
    // Free text from a provider may carry NUL, which PostgreSQL cannot store.
    crate::storable_json(&mut payload);
    let at = chrono::Utc
        .timestamp_millis_opt(ev.at_ms)
        .single()
        .unwrap_or_else(chrono::Utc::now);
    sqlx::query(
        "INSERT INTO execution_events (attempt_id, seq, kind, payload, at) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(attempt_id)
    .bind(seq)
    .bind(kind)
    .bind(&payload)
    .bind(at)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE attempts SET last_seq = $2 WHERE id = $1")
        .bind(attempt_id)
        .bind(seq)
        .execute(&mut *tx)
        .await?;

    let mut terminal = false;
    let mut retry_pool = None;
    match body {
        Body::Lifecycle(l) => match AttemptState::try_from(l.state).unwrap_or_default() {
            AttemptState::Running if a.status.can_move_to(AttemptStatus::Running) => {
                sqlx::query(
                    "UPDATE attempts SET status = 'running', started_at = $2 WHERE id = $1",
                )
                .bind(attempt_id)
                .bind(at)
                .execute(&mut *tx)
                .await?;
            }
            s @ (AttemptState::Succeeded | AttemptState::Failed | AttemptState::Cancelled) => {
                let (status, class) = match s {
                    AttemptState::Succeeded => (AttemptStatus::Succeeded, None),
                    AttemptState::Cancelled => {
                        (AttemptStatus::Cancelled, Some(FailureClass::Cancelled))
                    }
                    _ => (
                        AttemptStatus::Failed,
                        Some(FailureClass::parse(&l.failure_class)),
                    ),
                };
                let exit = l.has_exit_code.then_some(l.exit_code);
                let detail = crate::storable(&l.detail);
                retry_pool = attempts::finish(&mut tx, &a, status, class, &detail, exit).await?;
                terminal = true;
            }
            _ => {}
        },
        Body::SessionStarted(s) => {
            sqlx::query("UPDATE attempts SET provider_session_id = $2 WHERE id = $1")
                .bind(attempt_id)
                .bind(crate::storable(&s.provider_session_id).as_ref())
                .execute(&mut *tx)
                .await?;
        }
        _ => {}
    }
    tx.commit().await?;
    ctx.metrics.inc("agentscope_events_recorded_total", &[]);
    if terminal {
        // The attempt is over: release its lease so nothing can renew it.
        if let Some(host) = a.host_id {
            let _ = ctx
                .leases
                .purge(lease_key(&host.to_string(), &attempt_id.to_string()))
                .await;
        }
        if let Some(pool) = a.pool_id {
            attempts::nudge(ctx, pool).await;
        }
    }
    if let Some(pool) = retry_pool {
        attempts::nudge(ctx, pool).await;
    }
    crate::intake::notify(ctx, attempt_id, a.task_id, seq as u64).await;
    Ok(Outcome::Stored)
}

/// The normalized record of an event: a kind and a JSON payload.
pub(crate) fn to_record(body: &Body) -> (&'static str, serde_json::Value) {
    match body {
        Body::Lifecycle(l) => (
            "lifecycle",
            json!({
                "state": AttemptState::try_from(l.state).unwrap_or_default().as_str_name()
                    .trim_start_matches("ATTEMPT_STATE_").to_lowercase(),
                "failure_class": (!l.failure_class.is_empty()).then_some(&l.failure_class),
                "remedy": (!l.failure_class.is_empty()).then(|| FailureClass::parse(&l.failure_class).remedy()),
                "detail": l.detail,
                "exit_code": l.has_exit_code.then_some(l.exit_code),
            }),
        ),
        Body::Output(o) => (
            "output",
            json!({"stream": o.stream, "text": o.text, "truncated": o.truncated}),
        ),
        Body::Diagnostic(d) => (
            "diagnostic",
            json!({"level": d.level, "code": d.code, "message": d.message}),
        ),
        Body::SessionStarted(s) => (
            "session_started",
            json!({"provider_session_id": s.provider_session_id, "model": s.model}),
        ),
        Body::AssistantMessage(m) => ("assistant_message", json!({"text": m.text})),
        Body::ToolCall(t) => (
            "tool_call",
            json!({"call_id": t.call_id, "name": t.name, "input": t.input_json}),
        ),
        Body::ToolResult(t) => (
            "tool_result",
            json!({"call_id": t.call_id, "output": t.output, "is_error": t.is_error}),
        ),
        Body::FileChange(f) => ("file_change", json!({"path": f.path, "change": f.change})),
        Body::Usage(u) => (
            "usage",
            json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "cost_usd": u.cost_usd}),
        ),
        Body::Error(e) => ("error", json!({"message": e.message, "code": e.code})),
        Body::Result(r) => (
            "result",
            json!({"is_error": r.is_error, "text": r.text, "turns": r.turns}),
        ),
        Body::Raw(r) => ("raw", json!({"provider": r.provider, "line": r.line})),
        Body::ApprovalRequested(a) => (
            "approval_requested",
            json!({"request_id": a.request_id, "tool_name": a.tool_name, "input": a.input_json, "timeout_ms": a.timeout_ms}),
        ),
        Body::ApprovalDecided(a) => (
            "approval_decided",
            json!({"request_id": a.request_id, "allow": a.allow, "reason": a.reason, "decided_by": a.decided_by, "failure_class": (!a.failure_class.is_empty()).then_some(&a.failure_class)}),
        ),
    }
}
