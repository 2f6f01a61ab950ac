//! Artifacts: deliverables uploaded by executors (through their task credential) and read by
//! people. Content is stored in PostgreSQL with its metadata: one transaction, one backup, and
//! size-limited (`max_artifact_bytes`). Files left in a task directory are not Artifacts.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Id, TaskAuth};
use agentscope_api as t;
use agentscope_api::UploadQuery;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::Digest;
use uuid::Uuid;

/// A plain file name: no directories, no `..`, no control characters.
pub(crate) fn check_artifact_name(name: &str) -> ApiResult<()> {
    let bad = name.is_empty()
        || name.len() > 255
        || name == "."
        || name == ".."
        || name.contains(['/', '\\'])
        || name.chars().any(|c| c.is_control());
    if bad {
        return Err(ApiError::bad_request(
            "invalid_field",
            "artifact `name` must be a plain file name (no path separators or `..`, at most 255 bytes)",
        ));
    }
    Ok(())
}

fn check_content_type(ct: &str) -> ApiResult<()> {
    let essence = ct.split(';').next().unwrap_or("").trim();
    let ok = essence.len() <= 127
        && essence.split_once('/').is_some_and(|(t, s)| {
            let part = |p: &str| {
                !p.is_empty()
                    && p.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "!#$&-^_.+".contains(c))
            };
            part(t) && part(s)
        });
    if !ok {
        return Err(ApiError::bad_request(
            "invalid_field",
            "Content-Type must be a media type such as text/plain",
        ));
    }
    Ok(())
}

/// `POST /v1/task/artifacts?name=FILE`: the raw body is the content; its Content-Type is kept.
pub async fn upload(
    State(s): State<AppState>,
    task: TaskAuth,
    q: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<(StatusCode, Json<t::ArtifactUploaded>)> {
    let Query(q) = q?;
    check_artifact_name(&q.name)?;
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!(
                    "artifacts are limited to {} bytes",
                    s.config.max_artifact_bytes
                ),
            )
        } else {
            ApiError::bad_request("bad_request", e.body_text())
        }
    })?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/octet-stream")
        .to_string();
    check_content_type(&content_type)?;
    let id = Uuid::now_v7();
    let sha = hex::encode(sha2::Sha256::digest(&body));
    let author = format!("agent:{}", task.agent_id);
    sqlx::query!(
        "INSERT INTO artifacts (id, workspace_id, issue_id, task_id, attempt_id, name, content_type, size_bytes, sha256, content, author)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        id,
        task.workspace_id,
        task.issue_id,
        task.task_id,
        task.attempt_id,
        &q.name,
        &content_type,
        body.len() as i64,
        &sha,
        body.as_ref(),
        &author,
    )
    .execute(&s.db)
    .await?;
    s.metrics.inc("agentscope_artifacts_uploaded_total", &[]);
    tracing::info!(artifact_id = %id, task_id = %task.task_id, attempt_id = %task.attempt_id, size = body.len(), "artifact uploaded");
    Ok((
        StatusCode::CREATED,
        Json(t::ArtifactUploaded {
            id,
            name: q.name,
            content_type,
            size_bytes: body.len() as i64,
            sha256: sha,
            issue_id: task.issue_id,
            task_id: task.task_id,
            attempt_id: task.attempt_id,
        }),
    ))
}

/// `sqlx::query_as!` into `t::Artifact`: the artifacts' shared SELECT, then `$tail` (a literal).
macro_rules! select_artifacts {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            t::Artifact,
            "SELECT id, name, content_type, size_bytes, sha256, issue_id, task_id, attempt_id, author,
            created_at FROM artifacts " + $tail,
            $($arg),+
        )
    };
}

pub async fn list_for_issue(
    State(s): State<AppState>,
    auth: Auth,
    Id(issue): Id,
) -> ApiResult<Json<t::ArtifactList>> {
    let owned = sqlx::query_scalar!(
        "SELECT id FROM issues WHERE id = $1 AND workspace_id = $2",
        issue,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?;
    owned.ok_or_else(|| ApiError::not_found("issue"))?;
    let items = select_artifacts!("WHERE issue_id = $1 ORDER BY created_at, id", issue)
        .fetch_all(&s.db)
        .await?;
    Ok(Json(t::ArtifactList { items }))
}

pub async fn list_for_task(
    State(s): State<AppState>,
    auth: Auth,
    Id(task): Id,
) -> ApiResult<Json<t::ArtifactList>> {
    let items = select_artifacts!(
        "WHERE task_id = $1 AND workspace_id = $2 ORDER BY created_at, id",
        task,
        auth.workspace_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::ArtifactList { items }))
}

pub async fn get(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Artifact>> {
    let row = select_artifacts!("WHERE id = $1 AND workspace_id = $2", id, auth.workspace_id)
        .fetch_optional(&s.db)
        .await?;
    Ok(Json(row.ok_or_else(|| ApiError::not_found("artifact"))?))
}

pub async fn content(State(s): State<AppState>, auth: Auth, Id(id): Id) -> ApiResult<Response> {
    let row = sqlx::query!(
        "SELECT name, content_type, content FROM artifacts WHERE id = $1 AND workspace_id = $2",
        id,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?
    .ok_or_else(|| ApiError::not_found("artifact"))?;
    let (name, ct, bytes) = (row.name, row.content_type, row.content);
    // The name was checked at upload; quote it and drop quotes/backslashes all the same.
    let safe: String = name.chars().filter(|c| *c != '"' && *c != '\\').collect();
    Ok((
        [
            (header::CONTENT_TYPE, ct),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{safe}\""),
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
        ],
        bytes,
    )
        .into_response())
}
