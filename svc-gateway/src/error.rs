//! One error type for the API, mapped to an HTTP status and a stable machine-readable code at the
//! very end. Internal detail is logged, never sent.

use agentscope_store::Fault;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    Client {
        status: StatusCode,
        code: &'static str,
        message: String,
    },
    #[error("database")]
    Db(#[from] sqlx::Error),
    #[error("bus")]
    Bus(#[source] async_nats::Error),
}

/// `Retry-After` of every `503 unavailable`, in seconds.
pub const RETRY_AFTER_SECS: &str = "2";

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Client {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or invalid bearer token",
        )
    }
    pub fn bus(e: impl Into<async_nats::Error>) -> Self {
        ApiError::Bus(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code, message) = match self {
            ApiError::Client {
                status,
                code,
                message,
            } => (status, code, message),
            ApiError::Db(sqlx::Error::Database(e)) if e.is_unique_violation() => (
                StatusCode::CONFLICT,
                "already_exists",
                "a resource with these unique fields already exists".to_string(),
            ),
            ApiError::Db(sqlx::Error::Database(e)) if e.is_foreign_key_violation() => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_reference",
                "a referenced resource does not exist".to_string(),
            ),
            // A dependency outage (PostgreSQL unreachable or refusing connections, the pool
            // timed out) or a conflict between transactions: the same request later may pass.
            ApiError::Db(e)
                if matches!(
                    agentscope_store::fault(&e),
                    Fault::Unavailable | Fault::Conflict
                ) =>
            {
                tracing::warn!(error = %e, "database unavailable; answering 503");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the database is unavailable; retry later".to_string(),
                )
            }
            // A value PostgreSQL refuses (data exception, integrity violation) that no check
            // caught before: the request, not the server, is at fault.
            ApiError::Db(sqlx::Error::Database(e))
                if e.code()
                    .is_some_and(|c| c.starts_with("22") || c.starts_with("23")) =>
            {
                tracing::warn!(error = %e, "database refused a value");
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid_field",
                    "a value of the request is not accepted (text with characters that cannot be stored, or a value out of range)".to_string(),
                )
            }
            ApiError::Bus(e) => {
                tracing::warn!(error = %e, "message bus unavailable; answering 503");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the message bus is unavailable; retry later".to_string(),
                )
            }
            other => {
                tracing::error!(error = ?other, "request failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; see the gateway's logs".to_string(),
                )
            }
        };
        let body = axum::Json(json!({"error": {"code": code, "message": message}}));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            // Every 503 is temporary: say when to come back.
            (status, [(header::RETRY_AFTER, RETRY_AFTER_SECS)], body).into_response()
        } else {
            (status, body).into_response()
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::MissingJsonContentType(_) => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send Content-Type: application/json",
            ),
            JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    "request body is larger than the limit",
                )
            }
            JsonRejection::JsonDataError(e) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                e.body_text(),
            ),
            JsonRejection::JsonSyntaxError(_) => {
                Self::bad_request("malformed_json", "request body is not valid JSON")
            }
            other => Self::bad_request("bad_request", other.body_text()),
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        Self::bad_request("invalid_id", r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::bad_request("invalid_query", r.body_text())
    }
}
