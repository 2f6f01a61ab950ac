//! Managed sessions: the platform runs the agent itself (svc-dataplane). The gateway records a
//! session pinned to the agent's current version and the work submitted to it, then nudges the
//! dataplane replicas; their state, outcomes and events are read back from PostgreSQL.

use crate::AppState;
use crate::api::from_json;
use crate::api::resources::check_name;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Body, Id};
use agentscope_api as t;
use agentscope_api::{NewInput, NewSession};
use agentscope_domain::{MANAGED_PROVIDER, SessionStatus};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use sqlx::Connection as _;
use uuid::Uuid;

/// Longest input text accepted.
const MAX_INPUT: usize = 256 * 1024;

/// What makes two inputs the same request (everything but the key).
fn input_hash(text: &str, when_awaiting_approval: &str) -> String {
    crate::api::request_hash(
        &json!({"text": text, "when_awaiting_approval": when_awaiting_approval}),
    )
}

/// The input an earlier submission with `key` created, if the request was the same.
async fn existing_input(
    s: &AppState,
    session_id: Uuid,
    key: &str,
    hash: &str,
) -> ApiResult<Option<Uuid>> {
    let existing = sqlx::query!(
        "SELECT id, request_hash FROM session_inputs WHERE session_id = $1 AND idempotency_key = $2",
        session_id,
        key,
    )
    .fetch_optional(&s.db)
    .await?;
    match existing {
        Some(r) => {
            crate::api::same_request(key, r.request_hash.as_deref(), hash)?;
            Ok(Some(r.id))
        }
        None => Ok(None),
    }
}

fn check_input(text: &str) -> ApiResult<()> {
    if text.trim().is_empty() || text.len() > MAX_INPUT {
        return Err(ApiError::bad_request(
            "invalid_field",
            "the input must be 1 byte to 256 KiB of text",
        ));
    }
    Ok(())
}

/// Wakes the dataplane replicas (a lost nudge only delays: replicas also sweep).
async fn nudge(s: &AppState, session_id: Uuid) {
    if let Err(e) = s
        .nats
        .publish(
            agentscope_bus::subjects::SESSIONS_NUDGE,
            session_id.to_string().into(),
        )
        .await
    {
        tracing::warn!(error = %e, %session_id, "nudge dataplane");
    }
}

pub async fn create(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewSession>,
) -> ApiResult<(StatusCode, Json<t::Session>)> {
    check_input(&b.input)?;
    let environment = b.environment.unwrap_or_else(|| "sandbox".into());
    if !["local", "sandbox", "remote", "self_hosted"].contains(&environment.as_str()) {
        return Err(ApiError::bad_request(
            "invalid_field",
            format!(
                "`environment` must be local, sandbox, remote or self_hosted, not `{environment}`"
            ),
        ));
    }
    // `local` and `remote` run the agent's tools unsandboxed on the dataplane's machine.
    if ["local", "remote"].contains(&environment.as_str()) && !s.config.allow_local_environment {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "environment_not_allowed",
            format!(
                "the `{environment}` environment runs tools unsandboxed on the dataplane's machine and this deployment does not enable it (AGENTSCOPE_ALLOW_LOCAL_ENVIRONMENT=true, for a trusted single-user install); use `sandbox`"
            ),
        ));
    }
    match (&b.worker, environment == "self_hosted") {
        (Some(w), true) => check_name("worker", w)?,
        (None, false) => {}
        (None, true) => {
            return Err(ApiError::bad_request(
                "invalid_field",
                "a self_hosted session names its `worker`",
            ));
        }
        (Some(_), false) => {
            return Err(ApiError::bad_request(
                "invalid_field",
                "`worker` is only for self_hosted sessions",
            ));
        }
    }
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k)?;
    }
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    // The session is pinned to the version current now; saving the agent later never moves it.
    let version = sqlx::query!(
        "SELECT v.id, v.provider FROM agents a JOIN agent_versions v ON v.agent_id = a.id
         WHERE a.id = $1 AND a.workspace_id = $2 ORDER BY v.version DESC LIMIT 1",
        b.agent_id,
        auth.workspace_id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some((version_id, provider)) = version.map(|v| (v.id, v.provider)) else {
        return Err(ApiError::not_found("agent"));
    };
    if provider != MANAGED_PROVIDER {
        return Err(ApiError::bad_request(
            "not_managed",
            format!(
                "the agent's provider is `{provider}`: sessions run agents whose provider is `{MANAGED_PROVIDER}`; submit a task for hosted agents"
            ),
        ));
    }
    if let Some(issue) = b.issue_id {
        let found = sqlx::query_scalar!(
            "SELECT id FROM issues WHERE id = $1 AND workspace_id = $2",
            issue,
            auth.workspace_id,
        )
        .fetch_optional(&mut *tx)
        .await?;
        if found.is_none() {
            return Err(ApiError::not_found("issue"));
        }
    }
    let id = Uuid::now_v7();
    let hash = crate::api::request_hash(&json!({
        "agent_id": b.agent_id,
        "environment": environment,
        "worker": b.worker,
        "issue_id": b.issue_id,
        "input": b.input,
    }));
    // The same request again (same idempotency key) is the session it created: a unique key per
    // workspace, so concurrent duplicates make one session. Another request under the same key
    // is a conflict.
    let created = sqlx::query_scalar!(
        "INSERT INTO sessions (id, workspace_id, agent_id, agent_version_id, environment, worker, issue_id, idempotency_key, request_hash)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (workspace_id, idempotency_key) DO NOTHING RETURNING id",
        id,
        auth.workspace_id,
        b.agent_id,
        version_id,
        &environment,
        b.worker.as_deref(),
        b.issue_id,
        b.idempotency_key.as_deref(),
        &hash,
    )
    .fetch_optional(&mut *tx)
    .await?;
    if created.is_none() {
        tx.rollback().await?;
        let existing = sqlx::query!(
            "SELECT id, request_hash FROM sessions WHERE workspace_id = $1 AND idempotency_key = $2",
            auth.workspace_id,
            b.idempotency_key.as_deref(),
        )
        .fetch_one(&s.db)
        .await?;
        let key = b.idempotency_key.as_deref().unwrap_or_default();
        crate::api::same_request(key, existing.request_hash.as_deref(), &hash)?;
        return Ok((
            StatusCode::OK,
            Json(session_json(&s, auth, existing.id).await?),
        ));
    }
    sqlx::query!(
        "INSERT INTO session_inputs (id, session_id, workspace_id, text, idempotency_key, request_hash) VALUES ($1, $2, $3, $4, $5, $6)",
        Uuid::now_v7(),
        id,
        auth.workspace_id,
        &b.input,
        b.idempotency_key.as_deref(),
        input_hash(&b.input, "reject"),
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    conn.release();
    nudge(&s, id).await;
    Ok((StatusCode::CREATED, Json(session_json(&s, auth, id).await?)))
}

pub async fn submit(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    Body(b): Body<NewInput>,
) -> ApiResult<(StatusCode, Json<t::InputAccepted>)> {
    check_input(&b.text)?;
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k)?;
    }
    let policy = b.when_awaiting_approval.as_deref().unwrap_or("reject");
    if !["reject", "enqueue", "interrupt"].contains(&policy) {
        return Err(ApiError::bad_request(
            "invalid_field",
            format!(
                "`when_awaiting_approval` must be reject, enqueue or interrupt, not `{policy}`"
            ),
        ));
    }
    own_session(&s, auth, id).await?;
    let hash = input_hash(&b.text, policy);
    // The same request again is answered with what it created, whatever the session does now;
    // another request under the same key is a conflict.
    if let Some(k) = &b.idempotency_key
        && let Some(input_id) = existing_input(&s, id, k, &hash).await?
    {
        return Ok((
            StatusCode::OK,
            Json(t::InputAccepted {
                id: input_id,
                session_id: id,
            }),
        ));
    }
    let (waiting, pending): (bool, Vec<Uuid>) = {
        let st = sqlx::query_scalar!("SELECT status FROM session_state WHERE session_id = $1", id,)
            .fetch_optional(&s.db)
            .await?;
        let pending = sqlx::query_scalar!(
            "SELECT id FROM approvals WHERE session_id = $1 AND status = 'pending' ORDER BY created_at",
            id.to_string(),
        )
        .fetch_all(&s.db)
        .await?;
        let status = st.as_deref().and_then(SessionStatus::parse);
        (
            status == Some(SessionStatus::AwaitingApproval) || !pending.is_empty(),
            pending,
        )
    };
    if waiting && policy == "reject" {
        let names = if pending.is_empty() {
            "an Approval being recorded".to_string()
        } else {
            pending
                .iter()
                .map(|p| format!("Approval {p}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(ApiError::conflict(
            "awaiting_approval",
            format!(
                "the session waits for {names}; decide it, or resubmit with when_awaiting_approval: enqueue or interrupt"
            ),
        ));
    }
    if waiting && policy == "interrupt" {
        for approval in &pending {
            let body = agentscope_api::Decision {
                reason: Some("interrupted by new input".into()),
                always_for_task: false,
            };
            match crate::api::approvals::decide_as(&s, auth, *approval, false, body, "interrupt")
                .await
            {
                Ok(_)
                | Err(ApiError::Client {
                    code: "already_decided",
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let input_id = Uuid::now_v7();
    let inserted = sqlx::query!(
        "INSERT INTO session_inputs (id, session_id, workspace_id, text, idempotency_key, request_hash) VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (session_id, idempotency_key) DO NOTHING",
        input_id,
        id,
        auth.workspace_id,
        &b.text,
        b.idempotency_key.as_deref(),
        &hash,
    )
    .execute(&s.db)
    .await?
    .rows_affected();
    let input_id = if inserted == 1 {
        nudge(&s, id).await;
        input_id
    } else {
        // A concurrent request with the same key won the race: the input it created, if the
        // request was the same.
        let key = b.idempotency_key.as_deref().unwrap_or_default();
        existing_input(&s, id, key, &hash)
            .await?
            .ok_or_else(|| ApiError::Db(sqlx::Error::RowNotFound))?
    };
    let status = if inserted == 1 {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(t::InputAccepted {
            id: input_id,
            session_id: id,
        }),
    ))
}

async fn own_session(s: &AppState, auth: Auth, id: Uuid) -> ApiResult<()> {
    let found = sqlx::query_scalar!(
        "SELECT id FROM sessions WHERE id = $1 AND workspace_id = $2",
        id,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?;
    found
        .map(|_| ())
        .ok_or_else(|| ApiError::not_found("session"))
}

async fn session_json(s: &AppState, auth: Auth, id: Uuid) -> ApiResult<t::Session> {
    let row = sqlx::query_scalar!(
        r#"SELECT json_build_object('id', s.id, 'agent_id', s.agent_id, 'environment', s.environment,
            'worker', s.worker, 'issue_id', s.issue_id,
            'agent_version', json_build_object('id', v.id, 'version', v.version),
            'status', COALESCE(st.status, $3), 'detail', COALESCE(st.detail, ''),
            'created_at', s.created_at,
            'inputs', (SELECT COALESCE(json_agg(json_build_object('id', i.id, 'text', i.text,
                    'idempotency_key', i.idempotency_key,
                    'outcome', CASE WHEN o.input_id IS NULL THEN NULL ELSE json_build_object(
                        'status', o.status, 'detail', o.detail, 'iterations', o.iterations,
                        'finished_at', o.finished_at) END) ORDER BY i.id), '[]'::json)
                FROM session_inputs i LEFT JOIN session_outcomes o ON o.input_id = i.id
                WHERE i.session_id = s.id)) AS "session!"
         FROM sessions s JOIN agent_versions v ON v.id = s.agent_version_id
         LEFT JOIN session_state st ON st.session_id = s.id
         WHERE s.id = $1 AND s.workspace_id = $2"#,
        id,
        auth.workspace_id,
        // A session no replica has taken up yet has no state row.
        SessionStatus::Queued.as_str(),
    )
    .fetch_optional(&s.db)
    .await?;
    let v = row.ok_or_else(|| ApiError::not_found("session"))?;
    from_json(v)
}

pub async fn get(State(s): State<AppState>, auth: Auth, Id(id): Id) -> ApiResult<Json<t::Session>> {
    Ok(Json(session_json(&s, auth, id).await?))
}

pub async fn events(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::SessionEventList>> {
    own_session(&s, auth, id).await?;
    let items = sqlx::query_as!(
        t::SessionEvent,
        "SELECT seq, kind, payload, at FROM session_events WHERE session_id = $1 ORDER BY seq",
        id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::SessionEventList { items }))
}
