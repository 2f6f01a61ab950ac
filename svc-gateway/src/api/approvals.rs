//! Approvals: tool requests waiting for a person's decision. The scheduler owns the records and
//! applies a decision exactly once; a second, conflicting decision is refused (409). A managed
//! session's pending request is decided here by one conditional update (it too applies once) and
//! its session nudged, one hop shorter; everything else goes through the scheduler.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Id};
use agentscope_api as t;
use agentscope_api::{ApprovalFilter as Filter, Decision as DecisionBody};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{DecideApproval, DecideApprovalReply};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use sqlx::Connection as _;
use std::time::Duration;
use uuid::Uuid;

/// `sqlx::query_as!` into `t::Approval`: the approvals' shared SELECT, then `$tail` (a literal).
macro_rules! select_approvals {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            t::Approval,
            r#"SELECT ap.id, ap.attempt_id, a.task_id AS "task_id?", ap.session_id, ap.request_id,
            ap.tool_name, ap.input, ap.status, ap.decided_by, ap.reason, ap.created_at, ap.expires_at,
            ap.decided_at
            FROM approvals ap LEFT JOIN attempts a ON a.id = ap.attempt_id "# + $tail,
            $($arg),+
        )
    };
}

pub async fn list(
    State(s): State<AppState>,
    auth: Auth,
    q: Result<Query<Filter>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<t::ApprovalList>> {
    let Query(q) = q?;
    let items = select_approvals!(
        "WHERE ap.workspace_id = $1 AND ($2::text IS NULL OR ap.status = $2)
           AND ($3::uuid IS NULL OR a.task_id = $3)
           AND ($4::uuid IS NULL OR ap.session_id = $4::text) ORDER BY ap.created_at DESC LIMIT 500",
        auth.workspace_id,
        q.status.as_deref(),
        q.task_id,
        q.session_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::ApprovalList { items }))
}

pub async fn get(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Approval>> {
    let row = select_approvals!(
        "WHERE ap.workspace_id = $1 AND ap.id = $2",
        auth.workspace_id,
        id
    )
    .fetch_optional(&s.db)
    .await?;
    Ok(Json(row.ok_or_else(|| ApiError::not_found("approval"))?))
}

fn body_of(bytes: &axum::body::Bytes) -> ApiResult<DecisionBody> {
    crate::extract::optional_body(bytes, "decision")
}

async fn decide(
    s: &AppState,
    auth: Auth,
    id: Uuid,
    allow: bool,
    body: DecisionBody,
) -> ApiResult<Json<t::Approval>> {
    decide_as(s, auth, id, allow, body, "api").await
}

pub(crate) async fn decide_as(
    s: &AppState,
    auth: Auth,
    id: Uuid,
    allow: bool,
    body: DecisionBody,
    decided_by: &str,
) -> ApiResult<Json<t::Approval>> {
    let reason = body.reason.unwrap_or_default();
    if reason.len() > 4096 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`reason` is limited to 4096 bytes",
        ));
    }
    if let Some(decided) = decide_session_request(s, &auth, id, allow, &reason, decided_by).await? {
        return Ok(Json(decided));
    }
    let req = DecideApproval {
        approval_id: id.to_string(),
        workspace_id: auth.workspace_id.to_string(),
        allow,
        reason,
        decided_by: decided_by.into(),
        always_for_task: allow && body.always_for_task,
    };
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        s.nats.request(
            agentscope_bus::subjects::APPROVAL_DECIDE,
            req.encode_to_vec().into(),
        ),
    )
    .await
    .map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the scheduler did not answer; retry",
        )
    })?
    .map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the scheduler is not reachable; retry",
        )
    })?;
    let r = DecideApprovalReply::decode(reply.payload.as_ref()).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "internal",
            "unreadable answer from the scheduler",
        )
    })?;
    if !r.ok {
        return Err(match r.error_code.as_str() {
            "not_found" => ApiError::not_found("approval"),
            "already_decided" => ApiError::conflict("already_decided", r.message),
            "attempt_ended" => ApiError::conflict("attempt_ended", r.message),
            // The scheduler refused the data itself: the same request fails the same way.
            "invalid_field" => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", r.message)
            }
            _ => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", r.message),
        });
    }
    let approval = select_approvals!("WHERE ap.id = $1", id)
        .fetch_one(&s.db)
        .await?;
    Ok(Json(approval))
}

/// A managed session's pending request, decided without the scheduler: by the dataplane replica
/// whose call waits for it (see [`decided_by_replica`]), or else here by the record
/// ([`decide_by_record`]). `None` when the approval is not a pending session request of the
/// caller's workspace (a hosted attempt's, a replay, another workspace, an unknown id) or a field
/// could not be stored: the scheduler's path decides those, as it did before.
async fn decide_session_request(
    s: &AppState,
    auth: &Auth,
    id: Uuid,
    allow: bool,
    reason: &str,
    decided_by: &str,
) -> ApiResult<Option<t::Approval>> {
    if reason.contains('\0') || decided_by.contains('\0') {
        return Ok(None);
    }
    let status = if allow { "allowed" } else { "denied" };
    let brought = DecideApproval {
        approval_id: id.to_string(),
        workspace_id: auth.workspace_id.to_string(),
        allow,
        reason: reason.into(),
        decided_by: decided_by.into(),
        always_for_task: false,
    };
    let (decided, by) = match decided_by_replica(s, id, brought).await {
        // As the replica's statement read it back; read here if that did not come whole.
        Some(reply) => match serde_json::from_str::<t::Approval>(&reply.approval_json) {
            Ok(a) if a.id == id => (a, "replica"),
            _ => {
                let a = select_approvals!("WHERE ap.id = $1", id)
                    .fetch_one(&s.db)
                    .await?;
                (a, "replica")
            }
        },
        None => match decide_by_record(s, auth, id, status, reason, decided_by).await? {
            Some(a) => (a, "gateway"),
            None => return Ok(None),
        },
    };
    s.metrics
        .inc("agentscope_approvals_decided_total", &[("status", status)]);
    tracing::info!(approval_id = %id, status, by = %decided_by, applied_by = by, "approval decided");
    Ok(Some(decided))
}

/// A session's pending request decided here: one statement applies the decision once (the row
/// lock of the update), and the dataplane replica holding the session is nudged at once to read
/// it from the record. `None` when it is not such a request of the caller's workspace.
async fn decide_by_record(
    s: &AppState,
    auth: &Auth,
    id: Uuid,
    status: &str,
    reason: &str,
    decided_by: &str,
) -> ApiResult<Option<t::Approval>> {
    // The nudge leaves once the row is locked, with the commit: the replica's read of the
    // decision (which locks the row, see the dataplane's `start_if_allowed`) waits for this
    // transaction and sees it, so the hop to the replica and its statement overlap the commit.
    // A rollback leaves the record pending and the replica reads that; a lost nudge only delays
    // (it polls).
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    let decided = sqlx::query_as!(
        t::Approval,
        r#"UPDATE approvals ap SET status = $3, decided_at = now(), decided_by = $4, reason = NULLIF($5, '')
        WHERE ap.id = $1 AND ap.workspace_id = $2 AND ap.status = 'pending'
          AND ap.attempt_id IS NULL AND ap.session_id IS NOT NULL
        RETURNING ap.id, ap.attempt_id, NULL::uuid AS "task_id?", ap.session_id, ap.request_id,
            ap.tool_name, ap.input, ap.status, ap.decided_by, ap.reason, ap.created_at, ap.expires_at,
            ap.decided_at"#,
        id,
        auth.workspace_id,
        status,
        decided_by,
        reason,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(decided) = decided else {
        return Ok(None);
    };
    // Published (queued on the connection) while the row is locked, so the replica's read can
    // never come before the update; the commit does not wait for NATS: the flush, bounded, runs
    // beside it, and the decision is committed whatever NATS does.
    let nudge = async {
        let Some(session) = &decided.session_id else {
            return;
        };
        let sent = async {
            s.nats
                .publish(
                    agentscope_bus::subjects::SESSIONS_NUDGE,
                    session.clone().into(),
                )
                .await?;
            s.nats.flush().await.map_err(anyhow::Error::from)
        };
        match tokio::time::timeout(Duration::from_millis(50), sent).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, session_id = %session, "nudge dataplane"),
            Err(_) => tracing::warn!(session_id = %session, "nudge dataplane: timed out"),
        }
    };
    let ((), committed) = tokio::join!(nudge, tx.commit());
    committed?;
    conn.release();
    Ok(Some(decided))
}

/// How long the gateway waits for a session's replica to record a decision before it decides by
/// the record itself (which then waits for the replica's update, if it is still running, and
/// finds the Approval decided).
const REPLICA_WAIT: Duration = Duration::from_secs(2);

/// Asks the dataplane replica whose session waits for Approval `id` (if one listens) to record
/// the decision `req` and, if it allows the call, start it in the same statement: one commit and
/// one hop from the decision to the tool. Its answer when it did; otherwise (no replica listens,
/// it did not answer in time, or the decision did not apply: not pending, not the caller's)
/// `None`, and the record decides, as before.
async fn decided_by_replica(
    s: &AppState,
    id: Uuid,
    req: DecideApproval,
) -> Option<DecideApprovalReply> {
    let asked = s.nats.request(
        agentscope_bus::subjects::session_decide(&id.to_string()),
        req.encode_to_vec().into(),
    );
    match tokio::time::timeout(REPLICA_WAIT, asked).await {
        Ok(Ok(m)) => DecideApprovalReply::decode(m.payload.as_ref())
            .ok()
            .filter(|r| r.ok),
        Ok(Err(e)) => {
            if e.kind() != async_nats::RequestErrorKind::NoResponders {
                tracing::warn!(error = %e, approval_id = %id, "ask a session's replica to decide");
            }
            None
        }
        Err(_) => {
            tracing::warn!(approval_id = %id, "a session's replica did not answer a decision in time");
            None
        }
    }
}

pub async fn approve(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    body: axum::body::Bytes,
) -> ApiResult<Json<t::Approval>> {
    decide(&s, auth, id, true, body_of(&body)?).await
}

pub async fn deny(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    body: axum::body::Bytes,
) -> ApiResult<Json<t::Approval>> {
    decide(&s, auth, id, false, body_of(&body)?).await
}
