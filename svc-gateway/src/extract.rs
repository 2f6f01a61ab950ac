//! Extractors whose rejections are `ApiError`s: JSON bodies, UUID path ids, bearer auth.

use crate::AppState;
use crate::error::ApiError;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use uuid::Uuid;

/// A JSON request body; malformed, oversized or mistyped bodies become 4xx `ApiError`s.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Body(v))
    }
}

/// The `{id}` path segment as a UUID.
pub struct Id(pub Uuid);

impl<S: Send + Sync> FromRequestParts<S> for Id {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(raw) =
            axum::extract::Path::<String>::from_request_parts(parts, state).await?;
        Uuid::parse_str(&raw)
            .map(Id)
            .map_err(|_| ApiError::bad_request("invalid_id", format!("`{raw}` is not a UUID")))
    }
}

/// A caller authenticated by a workspace API token. Everything it reads or writes is scoped to
/// `workspace_id`; what it writes in its own name (comments) is by `token:<token_id>`.
#[derive(Debug, Clone, Copy)]
pub struct Auth {
    pub workspace_id: Uuid,
    /// The `api_tokens` row the caller presented.
    pub token_id: Uuid,
}

impl Auth {
    /// The author of what this credential writes: its token's id, which no request can choose
    /// (token names can: any token may create another with any name).
    pub fn author(&self) -> String {
        format!("token:{}", self.token_id)
    }
}

fn bearer(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

impl FromRequestParts<AppState> for Auth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        if !token.starts_with(agentscope_domain::TokenKind::Api.prefix()) || token.len() > 256 {
            return Err(ApiError::unauthorized());
        }
        let hash = agentscope_domain::hash_token(token);
        let row: Option<(Uuid, Uuid)> = sqlx::query_as(
            "SELECT workspace_id, id FROM api_tokens WHERE token_hash = $1 AND kind = 'api' AND revoked_at IS NULL",
        )
        .bind(hash)
        .fetch_optional(&state.db)
        .await?;
        let (workspace_id, token_id) = row.ok_or_else(ApiError::unauthorized)?;
        tracing::Span::current().record("workspace_id", tracing::field::display(workspace_id));
        Ok(Auth {
            workspace_id,
            token_id,
        })
    }
}

/// The deployment's admin, for creating workspaces.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let expected = state.config.admin_token.as_bytes();
        // Constant-time comparison; an empty admin token disables the route.
        let ok = !expected.is_empty()
            && token.len() == expected.len()
            && token
                .bytes()
                .zip(expected)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if ok {
            Ok(Admin)
        } else {
            Err(ApiError::unauthorized())
        }
    }
}

/// An executor authenticated by a task-scoped token: it reaches only its own task, and only
/// while its attempt is claimed or running.
#[derive(Debug, Clone, Copy)]
pub struct TaskAuth {
    pub workspace_id: Uuid,
    pub task_id: Uuid,
    pub attempt_id: Uuid,
    pub issue_id: Option<Uuid>,
    pub agent_id: Uuid,
}

impl FromRequestParts<AppState> for TaskAuth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let refused = || {
            ApiError::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "unauthorized",
                "task credential is not valid: unknown, or its attempt has ended",
            )
        };
        let token = bearer(parts).ok_or_else(refused)?;
        if !token.starts_with(agentscope_domain::TokenKind::Task.prefix()) || token.len() > 256 {
            return Err(refused());
        }
        let row: Option<(Uuid, Uuid, Uuid, Option<Uuid>, Uuid)> = sqlx::query_as(
            "SELECT a.workspace_id, a.task_id, a.id, t.issue_id, a.agent_id FROM attempts a
             JOIN tasks t ON t.id = a.task_id
             WHERE a.task_token_hash = $1 AND a.status IN ('claimed', 'running')",
        )
        .bind(agentscope_domain::hash_token(token))
        .fetch_optional(&state.db)
        .await?;
        let (workspace_id, task_id, attempt_id, issue_id, agent_id) = row.ok_or_else(refused)?;
        let span = tracing::Span::current();
        span.record("workspace_id", tracing::field::display(workspace_id));
        Ok(TaskAuth {
            workspace_id,
            task_id,
            attempt_id,
            issue_id,
            agent_id,
        })
    }
}
