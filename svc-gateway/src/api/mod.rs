//! The `/v1` API. One table lists every route; the router and the OpenAPI document are both
//! built from it, so the document always matches what is served.

pub mod approvals;
pub mod artifacts;
pub mod events;
pub mod explain;
pub mod resources;
pub mod secrets;
pub mod sessions;
pub mod task_api;
pub mod work;

use crate::AppState;
use axum::routing::{MethodRouter, get, post};
use serde_json::{Map, Value, json};

pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: &'static str,
    /// "bearer" (workspace API token), "task" (task-scoped executor credential), "admin"
    /// (deployment admin token) or "none".
    pub auth: &'static str,
    /// Success status.
    pub status: u16,
    pub handler: MethodRouter<AppState>,
}

macro_rules! route {
    (GET $path:literal, $h:path, $auth:literal, $summary:literal) => {
        Route {
            method: "get",
            path: $path,
            summary: $summary,
            auth: $auth,
            status: 200,
            handler: get($h),
        }
    };
    (POST $path:literal, $h:path, $auth:literal, $status:literal, $summary:literal) => {
        Route {
            method: "post",
            path: $path,
            summary: $summary,
            auth: $auth,
            status: $status,
            handler: post($h),
        }
    };
}

pub fn routes(config: &crate::Config) -> Vec<Route> {
    use events::*;
    use resources::*;
    use work::*;
    let upload_limit = axum::extract::DefaultBodyLimit::max(config.max_artifact_bytes);
    vec![
        route!(POST "/v1/workspaces", create_workspace, "admin", 201, "Create a workspace and its first API token"),
        route!(GET "/v1/workspace", get_workspace, "bearer", "The caller's workspace"),
        route!(POST "/v1/api-tokens", create_api_token, "bearer", 201, "Create a workspace API token"),
        route!(POST "/v1/host-tokens", create_host_token, "bearer", 201, "Create a host registration token"),
        route!(POST "/v1/worker-tokens", create_worker_token, "bearer", 201, "Create a self-hosted Worker token"),
        route!(POST "/v1/agents", create_agent, "bearer", 201, "Create an agent with its first version"),
        route!(GET "/v1/agents", list_agents, "bearer", "List agents"),
        route!(GET "/v1/agents/{id}", get_agent, "bearer", "Show an agent and its current version"),
        route!(POST "/v1/agents/{id}/versions", create_version, "bearer", 201, "Save a new immutable agent version"),
        route!(GET "/v1/agents/{id}/versions", list_versions, "bearer", "List an agent's versions"),
        route!(POST "/v1/runtime-profiles", create_profile, "bearer", 201, "Create a runtime profile"),
        route!(GET "/v1/runtime-profiles", list_profiles, "bearer", "List runtime profiles"),
        route!(POST "/v1/pools", create_pool, "bearer", 201, "Create a pool"),
        route!(GET "/v1/pools", list_pools, "bearer", "List pools"),
        route!(POST "/v1/bindings", create_binding, "bearer", 201, "Bind an agent to a pool and runtime profile"),
        route!(GET "/v1/bindings", list_bindings, "bearer", "List bindings"),
        route!(GET "/v1/hosts", list_hosts, "bearer", "List hosts with their three checks"),
        route!(GET "/v1/hosts/{id}", get_host, "bearer", "Show a host with its three checks"),
        route!(POST "/v1/issues", create_issue, "bearer", 201, "Create an issue; with an assignee it becomes a task"),
        route!(GET "/v1/issues", list_issues, "bearer", "List issues"),
        route!(GET "/v1/issues/{id}", get_issue, "bearer", "Show an issue"),
        route!(POST "/v1/issues/{id}/comments", create_comment, "bearer", 201, "Comment on an issue"),
        route!(GET "/v1/issues/{id}/comments", list_comments, "bearer", "List an issue's comments"),
        route!(POST "/v1/tasks", create_task, "bearer", 201, "Submit a task (idempotent with idempotency_key)"),
        route!(GET "/v1/tasks", list_tasks, "bearer", "List tasks"),
        route!(GET "/v1/tasks/{id}", get_task, "bearer", "Show a task with its attempts"),
        route!(POST "/v1/tasks/{id}/cancel", cancel_task, "bearer", 202, "Cancel a task"),
        route!(GET "/v1/tasks/{id}/explain", explain::explain, "bearer", "Why a task waits or failed: each host's failing predicate, or the failure class, evidence and remedy"),
        route!(GET "/v1/tasks/{id}/events", task_events, "bearer", "A task's events across attempts (JSON, or SSE with follow)"),
        route!(GET "/v1/attempts/{id}", get_attempt, "bearer", "Show an attempt"),
        route!(GET "/v1/attempts/{id}/events", attempt_events, "bearer", "An attempt's events (JSON, or SSE with follow)"),
        route!(GET "/v1/issues/{id}/artifacts", artifacts::list_for_issue, "bearer", "List an issue's Artifacts"),
        route!(GET "/v1/tasks/{id}/artifacts", artifacts::list_for_task, "bearer", "List a task's Artifacts"),
        route!(GET "/v1/artifacts/{id}", artifacts::get, "bearer", "Show an Artifact's metadata"),
        route!(GET "/v1/artifacts/{id}/content", artifacts::content, "bearer", "Download an Artifact"),
        route!(GET "/v1/approvals", approvals::list, "bearer", "List approvals (filter by status, task_id)"),
        route!(GET "/v1/approvals/{id}", approvals::get, "bearer", "Show an approval"),
        route!(POST "/v1/approvals/{id}/approve", approvals::approve, "bearer", 200, "Allow a tool request (once; a conflicting second decision is refused)"),
        route!(POST "/v1/approvals/{id}/deny", approvals::deny, "bearer", 200, "Deny a tool request (once)"),
        route!(POST "/v1/secrets", secrets::put, "bearer", 201, "Store (or replace) a tool credential in the Vault; its value is never returned"),
        route!(GET "/v1/secrets", secrets::list, "bearer", "List the Vault's secret names and key ids (never values)"),
        route!(POST "/v1/secrets/rotate", secrets::rotate, "bearer", 200, "Re-seal every secret under the current Vault key"),
        route!(POST "/v1/sessions", sessions::create, "bearer", 201, "Start a managed session of a managed agent, pinned to its current version (idempotent with idempotency_key)"),
        route!(GET "/v1/sessions/{id}", sessions::get, "bearer", "Show a session: status, pinned version, inputs and their outcomes"),
        route!(POST "/v1/sessions/{id}/inputs", sessions::submit, "bearer", 202, "Submit work to a session (idempotent with idempotency_key)"),
        route!(GET "/v1/sessions/{id}/events", sessions::events, "bearer", "A session's events"),
        route!(GET "/v1/task", task_api::context, "task", "Executor: the task, its Issue, comments, input and Artifacts"),
        route!(POST "/v1/task/comments", task_api::comment, "task", 201, "Executor: comment on the task's Issue"),
        Route {
            method: "post",
            path: "/v1/task/artifacts",
            summary: "Executor: upload an Artifact (raw body, ?name=FILE, Content-Type kept)",
            auth: "task",
            status: 201,
            handler: post(artifacts::upload).layer(upload_limit),
        },
    ]
}

/// The OpenAPI 3.1 document of [`routes`].
pub fn openapi(routes: &[Route]) -> Value {
    let mut paths = Map::new();
    for r in routes {
        let entry = paths.entry(r.path.to_string()).or_insert_with(|| json!({}));
        let mut op = json!({
            "summary": r.summary,
            "operationId": format!("{}_{}", r.method, r.path.trim_start_matches("/v1/").replace(['/', '{', '}', '-'], "_")),
            "responses": {
                r.status.to_string(): {"description": "success", "content": {"application/json": {}}},
                "4XX": {"$ref": "#/components/responses/Error"},
            },
        });
        if r.path.contains("{id}") {
            op["parameters"] = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}]);
        }
        if r.path.ends_with("/events") {
            op["responses"][r.status.to_string()]["content"]["text/event-stream"] = json!({});
        }
        if r.path == "/v1/task/artifacts" {
            op["parameters"] = json!([{"name": "name", "in": "query", "required": true, "schema": {"type": "string"}}]);
            op["requestBody"] = json!({"required": true, "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}});
        } else if r.method == "post" && r.path != "/v1/secrets/rotate" {
            // (Rotation reads no body.)
            op["requestBody"] = json!({"required": !(r.path.ends_with("/cancel") || r.path.ends_with("/approve") || r.path.ends_with("/deny")), "content": {"application/json": {"schema": {"type": "object"}}}});
        }
        op["security"] = match r.auth {
            "none" => json!([]),
            "admin" => json!([{"admin": []}]),
            "task" => json!([{"task": []}]),
            _ => json!([{"bearer": []}]),
        };
        entry[r.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {"title": "agentscope", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "workspace API token (ags_...)"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the deployment's admin token"},
                "task": {"type": "http", "scheme": "bearer", "description": "task-scoped executor credential (agt_...), valid while its attempt runs"},
            },
            "responses": {
                "Error": {
                    "description": "a client error with a stable code",
                    "content": {"application/json": {"schema": {
                        "type": "object",
                        "properties": {"error": {"type": "object", "properties": {
                            "code": {"type": "string"}, "message": {"type": "string"}}}},
                    }}},
                },
            },
        },
    })
}

/// The hash stored with an idempotency key: SHA-256 of the request's normalized JSON (the
/// fields that define it, with defaults filled in, built by one `json!` in a fixed order, so
/// the same request always serializes the same).
pub(crate) fn request_hash(normalized: &Value) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(normalized.to_string().as_bytes()))
}

/// Refuses a request whose key was first used with another request. A record made before
/// hashes were stored (no hash) is taken as the same request.
pub(crate) fn same_request(
    key: &str,
    stored: Option<&str>,
    hash: &str,
) -> crate::error::ApiResult<()> {
    match stored {
        Some(stored) if stored != hash => Err(crate::error::ApiError::conflict(
            "idempotency_conflict",
            format!(
                "the idempotency key `{key}` was already used with a different request; send the same request to get its result, or use a new key"
            ),
        )),
        _ => Ok(()),
    }
}
