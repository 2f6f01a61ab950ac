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
use agentscope_api as t;
use agentscope_api::Schemas;
use axum::routing::{MethodRouter, get, post};
use serde_json::{Map, Value, json};

/// A document fragment made from a type: its schema (and those it refers to) go to the
/// document's components, the fragment refers to it.
type SchemaFn = fn(&mut Schemas) -> Value;

pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: &'static str,
    /// The credential the route takes (its extractors check it; this is what the document says).
    pub auth: RouteAuth,
    /// Success status.
    pub status: u16,
    pub handler: MethodRouter<AppState>,
    /// The JSON request body, and whether it may be left out.
    pub body: Option<(SchemaFn, bool)>,
    /// The JSON success body (`None`: not JSON, see the route's special case in [`openapi`]).
    pub response: Option<SchemaFn>,
    /// Query parameters.
    pub query: fn() -> Vec<Value>,
}

/// The credential a route in the table takes. Routes outside the table (`/v1/openapi.json`,
/// health and metrics) take none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteAuth {
    /// A workspace API token (`ags_...`).
    Bearer,
    /// A task-scoped executor credential (`agt_...`), valid while its attempt runs.
    Task,
    /// The deployment's admin token.
    Admin,
}

impl RouteAuth {
    pub const ALL: [RouteAuth; 3] = [RouteAuth::Bearer, RouteAuth::Task, RouteAuth::Admin];

    /// The name of its security scheme in the document's components.
    pub fn scheme(self) -> &'static str {
        match self {
            RouteAuth::Bearer => "bearer",
            RouteAuth::Task => "task",
            RouteAuth::Admin => "admin",
        }
    }

    /// Its security scheme's description.
    fn description(self) -> &'static str {
        match self {
            RouteAuth::Bearer => "workspace API token (ags_...)",
            RouteAuth::Task => {
                "task-scoped executor credential (agt_...), valid while its attempt runs"
            }
            RouteAuth::Admin => "the deployment's admin token",
        }
    }
}

impl Route {
    /// The request body is a `T`.
    fn body<T: utoipa::ToSchema>(mut self) -> Self {
        self.body = Some((agentscope_api::schema_ref::<T>, true));
        self
    }
    /// The request body, when sent, is a `T`; it may be left out.
    fn optional_body<T: utoipa::ToSchema>(mut self) -> Self {
        self.body = Some((agentscope_api::schema_ref::<T>, false));
        self
    }
    /// The success body is a `T`.
    fn answers<T: utoipa::ToSchema>(mut self) -> Self {
        self.response = Some(agentscope_api::schema_ref::<T>);
        self
    }
    /// The query parameters are `T`'s fields.
    fn query<T: utoipa::IntoParams>(mut self) -> Self {
        self.query = agentscope_api::query_params::<T>;
        self
    }
}

macro_rules! route {
    (GET $path:literal, $h:path, $auth:ident, $summary:literal) => {
        Route {
            method: "get",
            path: $path,
            summary: $summary,
            auth: RouteAuth::$auth,
            status: 200,
            handler: get($h),
            body: None,
            response: None,
            query: Vec::new,
        }
    };
    (POST $path:literal, $h:path, $auth:ident, $status:literal, $summary:literal) => {
        Route {
            method: "post",
            path: $path,
            summary: $summary,
            auth: RouteAuth::$auth,
            status: $status,
            handler: post($h),
            body: None,
            response: None,
            query: Vec::new,
        }
    };
}

pub fn routes(config: &crate::Config) -> Vec<Route> {
    use events::*;
    use resources::*;
    use work::*;
    let upload_limit = axum::extract::DefaultBodyLimit::max(config.max_artifact_bytes);
    vec![
        route!(POST "/v1/workspaces", create_workspace, Admin, 201, "Create a workspace and its first API token").body::<t::NewWorkspace>().answers::<t::WorkspaceCreated>(),
        route!(GET "/v1/workspace", get_workspace, Bearer, "The caller's workspace").answers::<t::Workspace>(),
        route!(POST "/v1/api-tokens", create_api_token, Bearer, 201, "Create a workspace API token").body::<t::NewToken>().answers::<t::TokenCreated>(),
        route!(POST "/v1/host-tokens", create_host_token, Bearer, 201, "Create a host registration token").body::<t::NewToken>().answers::<t::TokenCreated>(),
        route!(POST "/v1/worker-tokens", create_worker_token, Bearer, 201, "Create a self-hosted Worker token").body::<t::NewToken>().answers::<t::TokenCreated>(),
        route!(POST "/v1/agents", create_agent, Bearer, 201, "Create an agent with its first version").body::<t::NewAgent>().answers::<t::Agent>(),
        route!(GET "/v1/agents", list_agents, Bearer, "List agents").answers::<t::AgentList>(),
        route!(GET "/v1/agents/{id}", get_agent, Bearer, "Show an agent and its current version").answers::<t::Agent>(),
        route!(POST "/v1/agents/{id}/versions", create_version, Bearer, 201, "Save a new immutable agent version").body::<t::NewVersion>().answers::<t::VersionSummary>(),
        route!(GET "/v1/agents/{id}/versions", list_versions, Bearer, "List an agent's versions").answers::<t::AgentVersionList>(),
        route!(POST "/v1/runtime-profiles", create_profile, Bearer, 201, "Create a runtime profile").body::<t::NewProfile>().answers::<t::RuntimeProfile>(),
        route!(GET "/v1/runtime-profiles", list_profiles, Bearer, "List runtime profiles").answers::<t::RuntimeProfileList>(),
        route!(POST "/v1/pools", create_pool, Bearer, 201, "Create a pool").body::<t::NewPool>().answers::<t::Pool>(),
        route!(GET "/v1/pools", list_pools, Bearer, "List pools").answers::<t::PoolList>(),
        route!(POST "/v1/bindings", create_binding, Bearer, 201, "Bind an agent to a pool and runtime profile").body::<t::NewBinding>().answers::<t::Binding>(),
        route!(GET "/v1/bindings", list_bindings, Bearer, "List bindings").answers::<t::BindingList>(),
        route!(GET "/v1/hosts", list_hosts, Bearer, "List hosts with their three checks").answers::<t::HostList>(),
        route!(GET "/v1/hosts/{id}", get_host, Bearer, "Show a host with its three checks").answers::<t::Host>(),
        route!(POST "/v1/issues", create_issue, Bearer, 201, "Create an issue; with an assignee it becomes a task").body::<t::NewIssue>().answers::<t::IssueCreated>(),
        route!(GET "/v1/issues", list_issues, Bearer, "List issues").answers::<t::IssueList>(),
        route!(GET "/v1/issues/{id}", get_issue, Bearer, "Show an issue").answers::<t::Issue>(),
        route!(POST "/v1/issues/{id}/comments", create_comment, Bearer, 201, "Comment on an issue").body::<t::NewComment>().answers::<t::Comment>(),
        route!(GET "/v1/issues/{id}/comments", list_comments, Bearer, "List an issue's comments").answers::<t::CommentList>(),
        route!(POST "/v1/tasks", create_task, Bearer, 201, "Submit a task (idempotent with idempotency_key: a repeat answers 200 with the first task)").body::<t::NewTask>().answers::<t::Task>(),
        route!(GET "/v1/tasks", list_tasks, Bearer, "List tasks").query::<t::TaskFilter>().answers::<t::TaskList>(),
        route!(GET "/v1/tasks/{id}", get_task, Bearer, "Show a task with its attempts").answers::<t::Task>(),
        route!(POST "/v1/tasks/{id}/cancel", cancel_task, Bearer, 202, "Cancel a task").optional_body::<t::CancelTask>().answers::<t::Task>(),
        route!(GET "/v1/tasks/{id}/explain", explain::explain, Bearer, "Why a task waits or failed: each host's failing predicate, or the failure class, evidence and remedy").answers::<t::Explanation>(),
        route!(GET "/v1/tasks/{id}/events", task_events, Bearer, "A task's events across attempts (JSON, or SSE with follow)").query::<t::EventQuery>().answers::<t::EventPage>(),
        route!(GET "/v1/attempts/{id}", get_attempt, Bearer, "Show an attempt").answers::<t::Attempt>(),
        route!(GET "/v1/attempts/{id}/events", attempt_events, Bearer, "An attempt's events (JSON, or SSE with follow)").query::<t::EventQuery>().answers::<t::EventPage>(),
        route!(GET "/v1/issues/{id}/artifacts", artifacts::list_for_issue, Bearer, "List an issue's Artifacts").answers::<t::ArtifactList>(),
        route!(GET "/v1/tasks/{id}/artifacts", artifacts::list_for_task, Bearer, "List a task's Artifacts").answers::<t::ArtifactList>(),
        route!(GET "/v1/artifacts/{id}", artifacts::get, Bearer, "Show an Artifact's metadata").answers::<t::Artifact>(),
        route!(GET "/v1/artifacts/{id}/content", artifacts::content, Bearer, "Download an Artifact"),
        route!(GET "/v1/approvals", approvals::list, Bearer, "List approvals (filter by status, task_id, session_id)").query::<t::ApprovalFilter>().answers::<t::ApprovalList>(),
        route!(GET "/v1/approvals/{id}", approvals::get, Bearer, "Show an approval").answers::<t::Approval>(),
        route!(POST "/v1/approvals/{id}/approve", approvals::approve, Bearer, 200, "Allow a tool request (once; a conflicting second decision is refused)").optional_body::<t::Decision>().answers::<t::Approval>(),
        route!(POST "/v1/approvals/{id}/deny", approvals::deny, Bearer, 200, "Deny a tool request (once)").optional_body::<t::Decision>().answers::<t::Approval>(),
        route!(POST "/v1/secrets", secrets::put, Bearer, 201, "Store (or replace) a tool credential in the Vault; its value is never returned").body::<t::NewSecret>().answers::<t::SecretStored>(),
        route!(GET "/v1/secrets", secrets::list, Bearer, "List the Vault's secret names and key ids (never values)").answers::<t::SecretList>(),
        route!(POST "/v1/secrets/rotate", secrets::rotate, Bearer, 200, "Re-seal every secret under the current Vault key (no body)").answers::<t::Rotated>(),
        route!(POST "/v1/sessions", sessions::create, Bearer, 201, "Start a managed session of a managed agent, pinned to its current version (idempotent with idempotency_key: a repeat answers 200 with the first session)").body::<t::NewSession>().answers::<t::Session>(),
        route!(GET "/v1/sessions/{id}", sessions::get, Bearer, "Show a session: status, pinned version, inputs and their outcomes").answers::<t::Session>(),
        route!(POST "/v1/sessions/{id}/inputs", sessions::submit, Bearer, 202, "Submit work to a session (idempotent with idempotency_key: a repeat answers 200)").body::<t::NewInput>().answers::<t::InputAccepted>(),
        route!(GET "/v1/sessions/{id}/events", sessions::events, Bearer, "A session's events").answers::<t::SessionEventList>(),
        route!(GET "/v1/task", task_api::context, Task, "Executor: the task, its Issue, comments, input and Artifacts").answers::<t::TaskContext>(),
        route!(POST "/v1/task/comments", task_api::comment, Task, 201, "Executor: comment on the task's Issue").body::<t::NewTaskComment>().answers::<t::Comment>(),
        Route {
            handler: post(artifacts::upload).layer(upload_limit),
            ..route!(POST "/v1/task/artifacts", artifacts::upload, Task, 201, "Executor: upload an Artifact (raw body, ?name=FILE, Content-Type kept)")
        }
        .query::<t::UploadQuery>()
        .answers::<t::ArtifactUploaded>(),
    ]
}

/// The error statuses a route can answer, each with the error body: 400 for what cannot be
/// read (an id, a body, a query), 401 without a valid credential, 404 for an `{id}` not in
/// the caller's workspace, 409 for conflicts of writes, 413/415 for bodies, 422 for values
/// refused (every route: a NUL in any query parameter), 503 while a dependency is down.
fn error_statuses(r: &Route) -> Vec<(u16, &'static str)> {
    let has_id = r.path.contains("{id}");
    let has_query = !(r.query)().is_empty();
    let takes_body = r.body.is_some() || r.path == "/v1/task/artifacts";
    let mut out = Vec::new();
    if has_id || has_query || takes_body || r.path.ends_with("/events") {
        out.push((400, "the request cannot be read: `malformed_json`, `invalid_id`, `invalid_query`, `invalid_cursor` or `invalid_field` (a value out of range)"));
    }
    // Every route in the table takes a credential (a [`RouteAuth`]).
    out.push((401, "`unauthorized`: no valid credential for this route"));
    // A session names its agent and Issue in its body; they are looked up like ids.
    if has_id || r.path == "/v1/sessions" {
        out.push((
            404,
            "`not_found`: no such resource in the caller's workspace",
        ));
    }
    if r.method == "post" {
        out.push((409, "a conflict: `already_exists`, `idempotency_conflict`, `already_decided`, `attempt_ended`, `no_issue` or `vault_key_missing`"));
    }
    if takes_body {
        out.push((413, "`payload_too_large`"));
    }
    if r.body.is_some() {
        out.push((
            415,
            "`unsupported_media_type`: send Content-Type: application/json",
        ));
    }
    out.push((422, "a value is refused: `invalid_body` (not a JSON object), `invalid_field` (an unknown or mistyped field, named in the message; a NUL character), `invalid_reference`"));
    out.push((503, "`unavailable` (or `vault_not_configured`): a dependency is down; retry after `Retry-After` seconds"));
    out
}

/// The OpenAPI 3.1 document of [`routes`]: request bodies, success and error bodies, path and
/// query parameters and security schemes, all from the types of `agentscope-api`.
pub fn openapi(routes: &[Route]) -> Value {
    let mut schemas: Schemas = Vec::new();
    let error_ref = agentscope_api::schema_ref::<agentscope_api::ErrorBody>(&mut schemas);
    let mut paths = Map::new();
    for r in routes {
        let entry = paths.entry(r.path.to_string()).or_insert_with(|| json!({}));
        let success = match r.response {
            Some(f) => json!({"application/json": {"schema": f(&mut schemas)}}),
            None => {
                json!({"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}, "*/*": {"schema": {"type": "string", "format": "binary"}}})
            }
        };
        let mut responses = Map::new();
        responses.insert(
            r.status.to_string(),
            json!({"description": "success", "content": success}),
        );
        if r.path.ends_with("/events") && r.path != "/v1/sessions/{id}/events" {
            responses[&r.status.to_string()]["content"]["text/event-stream"] = json!({"schema": {
                "description": "one server-sent event: an Event (JSON in `data`, its kind as `event`, its cursor as `id`); then `end` with `{\"status\": ...}` when nothing more can follow, `shutdown` (`{\"resume\": true}`) when the gateway stops, `error` (`{\"code\": ...}`) when reading fails",
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "event": {"type": "string"},
                    "data": {"type": "string"},
                    "retry": {"type": "integer"},
                },
            }});
        }
        if r.status == 201 && (r.path == "/v1/tasks" || r.path == "/v1/sessions") {
            responses.insert("200".into(), json!({"description": "a repeat of an earlier request with the same idempotency_key: its result", "content": responses["201"]["content"].clone()}));
        }
        if r.status == 202 && r.path == "/v1/sessions/{id}/inputs" {
            responses.insert("200".into(), json!({"description": "a repeat of an earlier input with the same idempotency_key: its result", "content": responses["202"]["content"].clone()}));
        }
        for (status, description) in error_statuses(r) {
            let mut resp = json!({"description": description, "content": {"application/json": {"schema": error_ref.clone()}}});
            if status == 503 {
                resp["headers"] = json!({"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}});
            }
            responses.insert(status.to_string(), resp);
        }
        let mut op = json!({
            "summary": r.summary,
            "operationId": format!("{}_{}", r.method, r.path.trim_start_matches("/v1/").replace(['/', '{', '}', '-'], "_")),
            "responses": responses,
        });
        let mut params = Vec::new();
        if r.path.contains("{id}") {
            params.push(json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}));
        }
        params.extend((r.query)());
        if !params.is_empty() {
            op["parameters"] = json!(params);
        }
        if let Some((f, required)) = r.body {
            op["requestBody"] = json!({"required": required, "content": {"application/json": {"schema": f(&mut schemas)}}});
        } else if r.path == "/v1/task/artifacts" {
            op["requestBody"] = json!({"required": true, "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}});
        }
        op["security"] = json!([{ r.auth.scheme(): [] }]);
        entry[r.method] = op;
    }
    let components: Map<String, Value> = schemas
        .into_iter()
        .map(|(name, schema)| {
            (
                name,
                serde_json::to_value(schema).expect("a schema serializes"),
            )
        })
        .collect();
    // Every credential is an HTTP bearer token; they differ in what issues them.
    let security_schemes: Map<String, Value> = RouteAuth::ALL
        .into_iter()
        .map(|a| {
            (
                a.scheme().to_string(),
                json!({"type": "http", "scheme": "bearer", "description": a.description()}),
            )
        })
        .collect();
    json!({
        "openapi": "3.1.0",
        "info": {"title": "agentscope", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": security_schemes,
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

/// Reads a row that SQL built as JSON (`json_build_object`) into its API type. A mismatch is
/// a bug of the gateway (the query and the type disagree): `500 internal`, logged.
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(v: Value) -> crate::error::ApiResult<T> {
    serde_json::from_value(v).map_err(|e| {
        tracing::error!(error = %e, type_name = std::any::type_name::<T>(), "a row does not fit its API type");
        crate::error::ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; see the gateway's logs",
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_documented_providers_are_the_known_ones() {
        let mut known = agentscope_domain::KNOWN_PROVIDERS.to_vec();
        known.push(agentscope_domain::MANAGED_PROVIDER);
        assert_eq!(agentscope_api::PROVIDERS.to_vec(), known);
    }
}
