//! The error body every failed request carries, and its stable codes.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `{"error": {"code": ..., "message": ...}}`: `code` is stable and machine-readable (see
/// [`codes`]); `message` is for people and may change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// One of [`codes`].
    pub code: String,
    pub message: String,
}

/// The stable error codes, with the status each comes with.
pub mod codes {
    /// 400: the body is not JSON.
    pub const MALFORMED_JSON: &str = "malformed_json";
    /// 400: a `{id}` path segment is not a UUID.
    pub const INVALID_ID: &str = "invalid_id";
    /// 400: a query parameter is unknown or of the wrong type.
    pub const INVALID_QUERY: &str = "invalid_query";
    /// 400: an event cursor (`after`, `Last-Event-ID`) is not one of the stream's.
    pub const INVALID_CURSOR: &str = "invalid_cursor";
    /// 400: any other request the gateway cannot read.
    pub const BAD_REQUEST: &str = "bad_request";
    /// 400 (a value out of its documented range) or 422 (an unknown field, a field of the
    /// wrong type, a NUL character, a value PostgreSQL refuses): the message names the field.
    pub const INVALID_FIELD: &str = "invalid_field";
    /// 422: the body is JSON but not an object.
    pub const INVALID_BODY: &str = "invalid_body";
    /// 422: a referenced resource is not in the caller's workspace.
    pub const INVALID_REFERENCE: &str = "invalid_reference";
    /// 401: no credential, or not a valid one for this route.
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// 404.
    pub const NOT_FOUND: &str = "not_found";
    /// 409: a resource with the same unique fields exists.
    pub const ALREADY_EXISTS: &str = "already_exists";
    /// 409: an idempotency key was used before with another request.
    pub const IDEMPOTENCY_CONFLICT: &str = "idempotency_conflict";
    /// 409: an approval was already decided otherwise.
    pub const ALREADY_DECIDED: &str = "already_decided";
    /// 409: the approval's attempt has ended.
    pub const ATTEMPT_ENDED: &str = "attempt_ended";
    /// 409: the executor's task has no Issue to comment on.
    pub const NO_ISSUE: &str = "no_issue";
    /// 409: a secret is sealed under a key no longer configured.
    pub const VAULT_KEY_MISSING: &str = "vault_key_missing";
    /// 413.
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// 415: the body is not sent as `application/json`.
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported_media_type";
    /// 503 (with `Retry-After`): a dependency (PostgreSQL, NATS, the scheduler) is unavailable.
    pub const UNAVAILABLE: &str = "unavailable";
    /// 503: the Vault has no key configured.
    pub const VAULT_NOT_CONFIGURED: &str = "vault_not_configured";
    /// 500: a bug; the gateway's log has the detail.
    pub const INTERNAL: &str = "internal";
}
