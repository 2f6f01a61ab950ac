//! Approvals: a provider's tool request becomes an Approval record; a decision is
//! applied exactly once and sent to the host holding the attempt; an undecided request turns
//! into a deny with the class `approval_timeout` when its policy deadline passes.

use crate::{Ctx, Error, attempts};
use agentscope_bus::{
    CONSUMER_APPROVALS, Consume, Endpoint, Request, SCHEDULER_QUEUE, STREAM_APPROVALS, subjects,
};
use agentscope_schemas::DecodeError;
use agentscope_schemas::v1::{
    ApprovalDecision, DecideApproval, DecideApprovalReply, HostCommand, ToolRequest, host_command,
};
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{AckKind, Message as JsMessage};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// "will retry" warnings: one line per interval during an outage.
static RETRY_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

/// Records tool requests published by hosts.
pub(crate) async fn consume_requests(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let stream = ctx
        .js
        .get_stream(STREAM_APPROVALS)
        .await
        .map_err(Error::bus)?;
    // Created or updated: an existing consumer takes the current `max_deliver`.
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER_APPROVALS.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(10),
            max_deliver: ctx.config.max_deliver,
            ..Default::default()
        })
        .await
        .map_err(Error::bus)?;
    let messages = consumer.messages().await.map_err(Error::bus)?;
    let how = Consume {
        name: CONSUMER_APPROVALS,
        concurrency: 1,
    };
    let ctx = &ctx;
    // It would not decode on any redelivery either: recorded and terminated.
    let malformed = |msg: Arc<JsMessage>, e: DecodeError| async move {
        let reason = e.to_string();
        crate::reject(ctx, &msg.subject, CONSUMER_APPROVALS, &reason, &msg.payload).await;
        AckKind::Term
    };
    agentscope_bus::consume_decoded(
        messages,
        how,
        cancel,
        |msg: Arc<JsMessage>, req: ToolRequest| async move {
            let subject = msg.subject.to_string();
            match record_request(ctx, &subject, req).await {
                Ok(()) => AckKind::Ack,
                Err(e) => {
                    if e.retryable()
                        && let Some(more) = RETRY_WARNING.check()
                    {
                        tracing::warn!(error = ?e, %subject, "record tool request failed; will retry{more}");
                    }
                    crate::retry_or_reject(
                        ctx,
                        &msg,
                        CONSUMER_APPROVALS,
                        &crate::describe(&e),
                        e.retryable(),
                        Duration::from_millis(500),
                        crate::redelivery_max(ctx),
                    )
                    .await
                }
            }
        },
        malformed,
    )
    .await;
    Ok(())
}

async fn record_request(ctx: &Ctx, subject: &str, req: ToolRequest) -> Result<(), Error> {
    // The request id is what the decision is matched by: it cannot be altered, so a NUL in it
    // refuses the request. The tool's name and input are free text, stored with U+FFFD.
    if req.request_id.contains('\0') {
        return Err(Error::Rejected(
            "invalid_field: `request_id` contains a NUL character".into(),
        ));
    }
    // The subject names who published it (NATS permissions confine hosts to their own host id
    // and leave sessions' subjects to the dataplane); the hosted query below checks the host.
    let subject_host = if req.attempt_id.is_empty() && !req.session_id.is_empty() {
        if subject != subjects::session_approval_requested(&req.session_id) {
            return Err(Error::Rejected("subject does not match session_id".into()));
        }
        None
    } else {
        let host = subjects::token(subject, 4).unwrap_or_default();
        if subject != subjects::approval_requested(host, &req.attempt_id) {
            return Err(Error::Rejected("subject does not match attempt_id".into()));
        }
        Some(
            Uuid::parse_str(host)
                .map_err(|_| Error::Rejected("the subject's host id is not a UUID".into()))?,
        )
    };
    // A hosted attempt's request, or a managed session's (svc-dataplane); each is fenced by its
    // holder's lease token: only the current holder may ask.
    let managed = req.attempt_id.is_empty() && !req.session_id.is_empty();
    let owner = if managed {
        &req.session_id
    } else {
        &req.attempt_id
    };
    let owner_id = Uuid::parse_str(owner)
        .map_err(|_| Error::Rejected("attempt_id or session_id is not a UUID".into()))?;
    let mut input: serde_json::Value = serde_json::from_str(&req.input_json)
        .unwrap_or(serde_json::Value::String(req.input_json.clone()));
    crate::storable_json(&mut input);
    let timeout_ms = if req.timeout_ms == 0 {
        600_000
    } else {
        req.timeout_ms
    } as f64;
    let tool_name = crate::storable(&req.tool_name);
    let inserted = if managed {
        sqlx::query!(
            r#"INSERT INTO approvals (id, workspace_id, session_id, request_id, tool_name, input, expires_at)
               SELECT $1, s.workspace_id, s.id::text, $3, $4, $5, now() + make_interval(secs => $6::float8 / 1000.0)
               FROM sessions s JOIN session_state st ON st.session_id = s.id
               WHERE s.id = $2 AND st.lease_token = $7
               ON CONFLICT DO NOTHING"#,
            // Derived from the session and the call: the replica listens for its decision
            // under this id before it is recorded. A conflict (on the id or on the pair) is
            // this Approval again.
            agentscope_domain::session_approval_id(owner_id, &req.request_id),
            owner_id,
            &req.request_id,
            tool_name.as_ref(),
            &input,
            timeout_ms,
            req.lease_token as i64,
        )
        .execute(&ctx.db)
        .await?
    } else {
        sqlx::query!(
            r#"INSERT INTO approvals (id, workspace_id, attempt_id, request_id, tool_name, input, expires_at)
               SELECT $1, a.workspace_id, a.id, $3, $4, $5, now() + make_interval(secs => $6::float8 / 1000.0)
               FROM attempts a WHERE a.id = $2 AND a.lease_token = $7 AND a.status IN ('claimed', 'running')
                 AND a.host_id = $8
               ON CONFLICT (attempt_id, request_id) DO NOTHING"#,
            Uuid::now_v7(),
            owner_id,
            &req.request_id,
            tool_name.as_ref(),
            &input,
            timeout_ms,
            req.lease_token as i64,
            subject_host,
        )
        .execute(&ctx.db)
        .await?
    };
    if inserted.rows_affected() == 1 {
        ctx.metrics.inc("agentscope_approvals_requested_total", &[]);
        tracing::info!(owner = %owner_id, request_id = %req.request_id, tool = %req.tool_name, "approval requested");
    }
    Ok(())
}

/// Answers decisions from the gateway, and applies each one exactly once.
pub(crate) async fn serve_decisions(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let at = Endpoint {
        subject: subjects::APPROVAL_DECIDE,
        queue_group: SCHEDULER_QUEUE,
        concurrency: 8,
    };
    agentscope_bus::serve(&ctx.nats, at, cancel, |msg: Request<DecideApproval>| {
        let ctx = ctx.clone();
        async move {
            match msg.body {
                // Every decision from the bus names the workspace it was made in; only the
                // sweeper's timeouts (in-process) decide without one.
                Ok(d) if Uuid::parse_str(&d.workspace_id).is_err() => {
                    refused("not_found", "approval not found", "")
                }
                Ok(d) if nul_field(&d).is_some() => refused(
                    "invalid_field",
                    &format!(
                        "`{}` contains a NUL character (\\u0000)",
                        nul_field(&d).unwrap_or_default()
                    ),
                    "",
                ),
                Ok(d) => match decide(&ctx, d, "allowed", "denied").await {
                    Ok(r) => r,
                    // The same decision would fail the same way: refused, not "retry".
                    Err(e) if !e.retryable() => {
                        tracing::warn!(error = ?e, "decision refused by the database");
                        refused("invalid_field", &crate::describe(&e), "")
                    }
                    Err(e) => {
                        tracing::error!(error = ?e, "decide approval");
                        refused("internal", "the decision could not be recorded; retry", "")
                    }
                },
                Err(_) => refused("malformed", "DecideApproval payload does not decode", ""),
            }
        }
    })
    .await
    .map_err(Error::bus)?;
    Ok(())
}

/// The first text field of a decision that carries NUL, which PostgreSQL cannot store.
fn nul_field(d: &DecideApproval) -> Option<&'static str> {
    [
        ("approval_id", &d.approval_id),
        ("workspace_id", &d.workspace_id),
        ("reason", &d.reason),
        ("decided_by", &d.decided_by),
    ]
    .into_iter()
    .find(|(_, v)| v.contains('\0'))
    .map(|(name, _)| name)
}

fn refused(code: &str, message: &str, status: &str) -> DecideApprovalReply {
    DecideApprovalReply {
        ok: false,
        error_code: code.into(),
        message: message.into(),
        status: status.into(),
        approval_json: String::new(),
    }
}

/// Moves a pending approval to its decision once; tells the host. `allowed`/`denied` name the
/// stored statuses (a timeout stores `timed_out`).
async fn decide(
    ctx: &Ctx,
    d: DecideApproval,
    allowed: &str,
    denied: &str,
) -> Result<DecideApprovalReply, Error> {
    let Ok(id) = Uuid::parse_str(&d.approval_id) else {
        return Ok(refused("not_found", "approval not found", ""));
    };
    let ws = Uuid::parse_str(&d.workspace_id).ok();
    let status = if d.allow { allowed } else { denied };
    // A managed session's pending request needs no attempt lock: one statement decides it (the
    // row lock of the update applies it once) and the replica holding the session is nudged at
    // once. Anything else (a replay, another workspace, a hosted attempt's request, an unknown
    // id) takes the transaction below.
    let session = sqlx::query_scalar!(
        r#"UPDATE approvals SET status = $2, decided_at = now(), decided_by = $3, reason = NULLIF($4, '')
         WHERE id = $1 AND status = 'pending' AND attempt_id IS NULL AND session_id IS NOT NULL
           AND ($5::uuid IS NULL OR workspace_id = $5)
         RETURNING session_id AS "session_id!""#,
        id,
        status,
        &d.decided_by,
        &d.reason,
        ws,
    )
    .fetch_optional(&ctx.db)
    .await?;
    if let Some(session) = session {
        let _ = ctx
            .nats
            .publish(subjects::SESSIONS_NUDGE, session.into())
            .await;
        ctx.metrics
            .inc("agentscope_approvals_decided_total", &[("status", status)]);
        tracing::info!(approval_id = %id, status, by = %d.decided_by, "approval decided");
        return Ok(DecideApprovalReply {
            ok: true,
            status: status.into(),
            ..Default::default()
        });
    }
    let mut tx = ctx.db.begin().await?;
    // status, attempt (hosted) or session (managed), request, workspace.
    let row = sqlx::query!(
        "SELECT ap.status, ap.attempt_id, ap.request_id, ap.workspace_id, ap.session_id, ap.undelivered FROM approvals ap WHERE ap.id = $1 FOR UPDATE",
        id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Ok(refused("not_found", "approval not found", ""));
    };
    let (current, attempt_id, request_id, workspace, session_id) = (
        row.status,
        row.attempt_id,
        row.request_id,
        row.workspace_id,
        row.session_id,
    );
    if ws.is_some_and(|w| w != workspace) {
        return Ok(refused("not_found", "approval not found", ""));
    }
    if current != "pending" {
        // The same decision again is a harmless replay; a different one is refused.
        let same = current == status;
        if same && row.undelivered {
            // Its host may never have been told (the client repeats the decision because the
            // first answer did not come): told now.
            drop(tx);
            deliver(ctx, id).await?;
        }
        return Ok(DecideApprovalReply {
            ok: same,
            error_code: if same {
                String::new()
            } else {
                "already_decided".into()
            },
            message: if same {
                "already decided so".into()
            } else {
                format!("this approval was already decided: {current}")
            },
            status: current,
            ..Default::default()
        });
    }
    // A hosted attempt's request is told to the host holding the attempt, which must still be
    // active; a managed session's is read from the record by the replica holding the session,
    // once nudged.
    let mut host = None;
    if let Some(attempt_id) = attempt_id {
        let Some(a) = attempts::lock(&mut tx, attempt_id).await? else {
            return Ok(refused("not_found", "approval not found", ""));
        };
        if !a.status.is_active() {
            sqlx::query!("UPDATE approvals SET status = 'denied', decided_at = now(), decided_by = 'platform', reason = 'the attempt had ended' WHERE id = $1", id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(refused(
                "attempt_ended",
                "the attempt that asked has ended",
                "denied",
            ));
        }
        host = a.host_id.map(|h| (h, attempt_id));
    }
    // Undelivered until the host's control stream has the decision (`deliver`).
    sqlx::query!(
        "UPDATE approvals SET status = $2, decided_at = now(), decided_by = $3, reason = NULLIF($4, ''), undelivered = $5 WHERE id = $1",
        id,
        status,
        &d.decided_by,
        &d.reason,
        host.is_some(),
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    if let Some((host, attempt_id)) = host {
        let decision = ApprovalDecision {
            approval_id: id.to_string(),
            request_id,
            attempt_id: attempt_id.to_string(),
            allow: d.allow,
            reason: if d.reason.is_empty() {
                status.to_string()
            } else {
                d.reason.clone()
            },
            decided_by: d.decided_by.clone(),
            always_for_task: d.always_for_task,
        };
        send(ctx, host, decision).await?;
        delivered(ctx, id).await;
    } else if let Some(session) = session_id {
        let _ = ctx
            .nats
            .publish(subjects::SESSIONS_NUDGE, session.into())
            .await;
    }
    ctx.metrics
        .inc("agentscope_approvals_decided_total", &[("status", status)]);
    tracing::info!(approval_id = %id, attempt_id = ?attempt_id, status, by = %d.decided_by, "approval decided");
    Ok(DecideApprovalReply {
        ok: true,
        status: status.into(),
        ..Default::default()
    })
}

/// Publishes a hosted attempt's decision to its host's control stream; returns once the stream
/// has it (its id dedups a repeat within the stream's window, and the host answers a request
/// once: a decision for a request it no longer waits on is ignored).
async fn send(ctx: &Ctx, host: Uuid, decision: ApprovalDecision) -> Result<(), Error> {
    let cmd = HostCommand {
        command_id: format!("decision:{}", decision.approval_id),
        command: Some(host_command::Command::ApprovalDecision(decision)),
    };
    crate::command_host(ctx, host, cmd).await
}

/// The decision `id` is in its host's control stream. A failure leaves it to the sweeper, which
/// sends it once more.
async fn delivered(ctx: &Ctx, id: Uuid) {
    if let Err(e) = sqlx::query!("UPDATE approvals SET undelivered = false WHERE id = $1", id)
        .execute(&ctx.db)
        .await
    {
        tracing::warn!(error = %e, approval_id = %id, "mark a decision delivered");
    }
}

/// Sends the committed decision `id` if its host's control stream may not have it
/// (`undelivered`): one whose attempt has ended needs nothing more. ("Always for the task" was
/// the decision's message only, so a decision sent again applies to its own request.)
pub(crate) async fn deliver(ctx: &Ctx, id: Uuid) -> Result<(), Error> {
    let row = sqlx::query!(
        r#"SELECT ap.request_id, ap.attempt_id AS "attempt_id!", ap.status, ap.reason,
                  ap.decided_by, a.host_id, a.status AS attempt_status
           FROM approvals ap JOIN attempts a ON a.id = ap.attempt_id
           WHERE ap.id = $1 AND ap.undelivered"#,
        id,
    )
    .fetch_optional(&ctx.db)
    .await?;
    let Some(r) = row else { return Ok(()) };
    let active = matches!(r.attempt_status.as_str(), "claimed" | "running");
    if let (true, Some(host)) = (active, r.host_id) {
        tracing::warn!(approval_id = %id, attempt_id = %r.attempt_id, "a decision its host may not have; sending it again");
        let decision = ApprovalDecision {
            approval_id: id.to_string(),
            request_id: r.request_id,
            attempt_id: r.attempt_id.to_string(),
            allow: r.status == "allowed",
            reason: r.reason.unwrap_or_else(|| r.status.clone()),
            decided_by: r.decided_by.unwrap_or_default(),
            always_for_task: false,
        };
        send(ctx, host, decision).await?;
    }
    delivered(ctx, id).await;
    Ok(())
}

/// Decisions of hosted attempts committed more than [`UNDELIVERED_AFTER`] ago whose command the
/// host's control stream may not have (their scheduler died, or lost NATS, after the commit):
/// sent again.
pub(crate) async fn deliver_overdue(ctx: &Ctx) -> Result<(), Error> {
    let due = sqlx::query_scalar!(
        "SELECT id FROM approvals WHERE undelivered AND decided_at < now() - make_interval(secs => $1)
         ORDER BY decided_at LIMIT 100",
        UNDELIVERED_AFTER.as_secs_f64(),
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    for id in due {
        // One that cannot be sent now is tried again next pass; the rest of the sweep goes on.
        if let Err(e) = deliver(ctx, id).await {
            tracing::warn!(error = ?e, approval_id = %id, "send a decision again");
        }
    }
    Ok(())
}

/// How long a decision may wait for its own publish before the sweeper sends it.
const UNDELIVERED_AFTER: Duration = Duration::from_secs(5);

/// Pending approvals past their deadline become denies with the class `approval_timeout`.
pub(crate) async fn expire(ctx: &Ctx) -> Result<(), Error> {
    let due = sqlx::query_scalar!(
        "SELECT id FROM approvals WHERE status = 'pending' AND expires_at < now() LIMIT 100",
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    for id in due {
        let d = DecideApproval {
            approval_id: id.to_string(),
            allow: false,
            reason: "approval_timeout: no decision before the policy deadline".into(),
            decided_by: "policy".into(),
            ..Default::default()
        };
        decide(ctx, d, "allowed", "timed_out").await?;
    }
    Ok(())
}
