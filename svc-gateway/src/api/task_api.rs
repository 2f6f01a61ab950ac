//! The executor's API (`/v1/task/...`), reached with a task-scoped credential: read the work
//! (the task, its Issue, comments, input material, Artifacts), post a comment, upload an
//! Artifact. Nothing else accepts that credential.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, TaskAuth};
use agentscope_api as t;
use agentscope_api::NewTaskComment;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use uuid::Uuid;

pub async fn context(State(s): State<AppState>, task: TaskAuth) -> ApiResult<Json<t::TaskContext>> {
    let row = sqlx::query!(
        r#"SELECT t.repository, t.branch, t.input, a.number, i.title AS "title?", i.body AS "body?"
         FROM tasks t JOIN attempts a ON a.id = $2 LEFT JOIN issues i ON i.id = t.issue_id
         WHERE t.id = $1"#,
        task.task_id,
        task.attempt_id,
    )
    .fetch_one(&s.db)
    .await?;
    // The list of an Issue's comments leaves each comment's `issue_id` out.
    let comments = sqlx::query_as!(
        t::Comment,
        r#"SELECT id, NULL::uuid AS "issue_id?", author, body, created_at
         FROM comments WHERE issue_id = $1 ORDER BY created_at, id"#,
        task.issue_id,
    )
    .fetch_all(&s.db)
    .await?;
    let artifacts = sqlx::query_as!(
        t::ContextArtifact,
        "SELECT id, name, content_type, size_bytes, task_id
         FROM artifacts WHERE workspace_id = $1 AND (issue_id = $2 OR task_id = $3) ORDER BY created_at, id",
        task.workspace_id,
        task.issue_id,
        task.task_id,
    )
    .fetch_all(&s.db)
    .await?;
    let issue = task.issue_id.map(|id| t::ContextIssue {
        id,
        title: row.title,
        body: row.body,
    });
    Ok(Json(t::TaskContext {
        task_id: task.task_id,
        attempt_id: task.attempt_id,
        attempt_number: row.number,
        repository: row.repository,
        branch: row.branch,
        input: row.input,
        issue,
        comments,
        artifacts,
    }))
}

pub async fn comment(
    State(s): State<AppState>,
    task: TaskAuth,
    Body(b): Body<NewTaskComment>,
) -> ApiResult<(StatusCode, Json<t::Comment>)> {
    if b.body.trim().is_empty() || b.body.len() > 64 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`body` must be 1 byte to 64 KiB",
        ));
    }
    let Some(issue) = task.issue_id else {
        return Err(ApiError::conflict(
            "no_issue",
            "this task has no Issue to comment on",
        ));
    };
    let id = Uuid::now_v7();
    let author = format!("agent:{}", task.agent_id);
    sqlx::query!(
        "INSERT INTO comments (id, workspace_id, issue_id, author, body) VALUES ($1, $2, $3, $4, $5)",
        id,
        task.workspace_id,
        issue,
        &author,
        &b.body,
    )
    .execute(&s.db)
    .await?;
    tracing::info!(comment_id = %id, task_id = %task.task_id, attempt_id = %task.attempt_id, "executor commented");
    Ok((
        StatusCode::CREATED,
        Json(t::Comment {
            id,
            issue_id: Some(issue),
            author,
            body: b.body,
            created_at: None,
        }),
    ))
}
