//! Extractors whose rejections are `ApiError`s: JSON bodies, UUID path ids, bearer auth.

use crate::AppState;
use crate::error::ApiError;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use serde_json::Value;
use uuid::Uuid;

/// A JSON request body of a type of `agentscope-api`. Malformed JSON is `400 malformed_json`;
/// a body that is JSON but not an object (an array, a string...) is `422 invalid_body`; an
/// unknown field or a field of the wrong type is `422 invalid_field` naming the field; a NUL
/// character in any string of it is `422 invalid_field` too, a number beyond ±1e300 `400 invalid_field` (see [`refuse_unstorable`]).
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(v) = axum::Json::<Value>::from_request(req, state).await?;
        typed(v).map(Body)
    }
}

/// Reads a parsed JSON body into `T`: it must be an object without NUL characters, whose
/// fields `T` knows and whose values have `T`'s types.
fn typed<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    if !v.is_object() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            agentscope_api::codes::INVALID_BODY,
            "request body must be a JSON object",
        ));
    }
    refuse_unstorable(&v)?;
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if path == "." {
            inner.to_string()
        } else {
            format!("`{path}`: {inner}")
        };
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            agentscope_api::codes::INVALID_FIELD,
            message,
        )
    })
}

/// Parses an optional JSON body (empty or whitespace is `T::default()`), refused the same
/// ways as [`Body`].
pub fn optional_body<T: DeserializeOwned + Default>(
    bytes: &[u8],
    what: &str,
) -> Result<T, ApiError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(T::default());
    }
    let v: Value = serde_json::from_slice(bytes).map_err(|_| {
        ApiError::bad_request(
            "malformed_json",
            format!("request body is not a valid {what}"),
        )
    })?;
    typed(v)
}

/// What PostgreSQL would not keep, or not give back: a NUL (`\u0000`) it cannot store in text
/// or JSON (and no field of the API means one), in any string, keys included; and a number
/// beyond ±1e300, which `jsonb` keeps as its exact decimal, so that reading it back into a
/// JSON value overflows and every later read of the record would fail. A request carrying
/// either is refused naming the JSON path of the first one (`input.files[2]`, `params.<key>`):
/// a NUL with `422 invalid_field`, a number with `400 invalid_field` (a value out of range).
pub fn refuse_unstorable(v: &Value) -> Result<(), ApiError> {
    if let Some(path) = nul_path(v, String::new()) {
        return Err(nul_error(if path.is_empty() { "(body)" } else { &path }));
    }
    if let Some(path) = huge_number_path(v, String::new()) {
        let path = if path.is_empty() { "(body)" } else { &path };
        return Err(ApiError::bad_request(
            "invalid_field",
            format!("`{path}` is a number beyond ±1e300, which cannot be stored"),
        ));
    }
    Ok(())
}

/// The JSON path of the first number in `v` whose magnitude is 1e300 or more.
fn huge_number_path(v: &Value, at: String) -> Option<String> {
    let huge = |v: &Value| match v {
        Value::Number(n) => n.as_f64().is_none_or(|f| f.abs() >= 1e300),
        _ => false,
    };
    first_path(v, at, &|_| false, &huge)
}

pub(crate) fn nul_error(field: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_field",
        format!("`{field}` contains a NUL character (\\u0000), which no text field accepts"),
    )
}

fn nul_path(v: &Value, at: String) -> Option<String> {
    let nul = |v: &Value| v.as_str().is_some_and(|s| s.contains('\0'));
    first_path(v, at, &|k| k.contains('\0'), &nul)
}

/// The JSON path (`input.files[2]`, `params.<key>`; NUL in a key written `\u0000`) of the first
/// place in `v`, in document order, where `key_hit` holds for an object's key or `value_hit` for a
/// value.
fn first_path(
    v: &Value,
    at: String,
    key_hit: &dyn Fn(&str) -> bool,
    value_hit: &dyn Fn(&Value) -> bool,
) -> Option<String> {
    if value_hit(v) {
        return Some(at);
    }
    match v {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| first_path(item, format!("{at}[{i}]"), key_hit, value_hit)),
        Value::Object(map) => map.iter().find_map(|(k, item)| {
            let key = k.replace('\0', "\\u0000");
            let path = if at.is_empty() {
                key
            } else {
                format!("{at}.{key}")
            };
            if key_hit(k) {
                Some(path)
            } else {
                first_path(item, path, key_hit, value_hit)
            }
        }),
        _ => None,
    }
}

/// Refuses a query string whose decoded parameters carry NUL (`%00`), naming the parameter,
/// for every route (a middleware).
pub async fn refuse_nul_in_query(
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Some(q) = req.uri().query()
        && let Some(name) = nul_query_param(q)
    {
        return ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            format!("query parameter `{name}` contains a NUL character (\\u0000)"),
        )
        .into_response();
    }
    next.run(req).await
}

fn nul_query_param(q: &str) -> Option<String> {
    if !q.contains("%00") {
        return None;
    }
    q.split('&').find(|p| p.contains("%00")).map(|pair| {
        let key = pair.split('=').next().unwrap_or_default();
        percent_decode(key).replace('\0', "\\u0000")
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b'+', ..) => {
                out.push(b' ');
                i += 1;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
        let (workspace_id, token_id) = verify_api_token(state, token)
            .await?
            .ok_or_else(ApiError::unauthorized)?;
        tracing::Span::current().record("workspace_id", tracing::field::display(workspace_id));
        Ok(Auth {
            workspace_id,
            token_id,
        })
    }
}

/// How long a verified API token is trusted without asking the database again: a token revoked
/// in the database stops working within this time.
const TOKEN_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// The workspace and id of an API token, if it is valid. Valid answers are cached per token hash
/// for [`TOKEN_CACHE_TTL`]; refusals are not cached.
async fn verify_api_token(state: &AppState, token: &str) -> Result<Option<(Uuid, Uuid)>, ApiError> {
    static CACHE: std::sync::LazyLock<agentscope_domain::TrustCache<(Uuid, Uuid)>> =
        std::sync::LazyLock::new(|| agentscope_domain::TrustCache::new(TOKEN_CACHE_TTL));
    let hash = agentscope_domain::hash_token(token);
    if let Some(found) = CACHE.get(&hash) {
        return Ok(Some(found));
    }
    let found = sqlx::query!(
        "SELECT workspace_id, id FROM api_tokens WHERE token_hash = $1 AND kind = 'api' AND revoked_at IS NULL",
        hash,
    )
    .fetch_optional(&state.db)
    .await?
    .map(|r| (r.workspace_id, r.id));
    CACHE.set(hash, found);
    Ok(found)
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
        let row = sqlx::query!(
            "SELECT a.workspace_id, a.task_id, a.id, t.issue_id, a.agent_id FROM attempts a
             JOIN tasks t ON t.id = a.task_id
             WHERE a.task_token_hash = $1 AND a.status IN ('claimed', 'running')",
            agentscope_domain::hash_token(token),
        )
        .fetch_optional(&state.db)
        .await?;
        let (workspace_id, task_id, attempt_id, issue_id, agent_id) = row
            .map(|r| (r.workspace_id, r.task_id, r.id, r.issue_id, r.agent_id))
            .ok_or_else(refused)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_first_nul_is_named_by_its_json_path() {
        assert_eq!(
            nul_path(&json!({"title": "ok", "n": 1}), String::new()),
            None
        );
        assert_eq!(
            nul_path(&json!({"title": "a\0b"}), String::new()).as_deref(),
            Some("title")
        );
        assert_eq!(
            nul_path(&json!({"input": {"files": ["x", "y\0"]}}), String::new()).as_deref(),
            Some("input.files[1]")
        );
        assert_eq!(
            nul_path(&json!({"params": {"k\0": "v"}}), String::new()).as_deref(),
            Some("params.k\\u0000")
        );
        assert_eq!(nul_path(&json!("\0"), String::new()).as_deref(), Some(""));
    }

    #[test]
    fn the_first_number_beyond_1e300_is_named_by_its_json_path() {
        assert_eq!(
            huge_number_path(&json!({"params": {"n": 1e299, "m": -5}}), String::new()),
            None
        );
        assert_eq!(
            huge_number_path(&json!({"params": {"n": 1.7e308}}), String::new()).as_deref(),
            Some("params.n")
        );
        assert_eq!(
            huge_number_path(&json!({"policy": {"limits": [1, -1e300]}}), String::new()).as_deref(),
            Some("policy.limits[1]")
        );
        match refuse_unstorable(&json!({"params": {"x": 1e305}})) {
            Err(ApiError::Client { status, code, .. }) => {
                assert_eq!(status, StatusCode::BAD_REQUEST);
                assert_eq!(code, "invalid_field");
            }
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn query_parameters_with_nul_are_named() {
        assert_eq!(nul_query_param("status=pending&task_id=x"), None);
        assert_eq!(
            nul_query_param("status=pend%00ing").as_deref(),
            Some("status")
        );
        assert_eq!(
            nul_query_param("a=1&na%00me=x").as_deref(),
            Some("na\\u0000me")
        );
    }
}
