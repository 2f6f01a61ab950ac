//! Request bodies and query parameters. Every body refuses unknown fields (`422 invalid_field`
//! naming the field), and the gateway refuses a body that is not a JSON object
//! (`422 invalid_body`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// The providers an agent version or a runtime profile may name: the hosted ones
/// (`agentscope_domain::Provider`) and `managed`.
pub const PROVIDERS: [&str; agentscope_domain::KNOWN_PROVIDERS.len() + 1] = {
    let known = agentscope_domain::KNOWN_PROVIDERS;
    let mut names =
        [agentscope_domain::MANAGED_PROVIDER; agentscope_domain::KNOWN_PROVIDERS.len() + 1];
    let mut i = 0;
    while i < known.len() {
        names[i] = known[i];
        i += 1;
    }
    names
};

fn provider_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(PROVIDERS))
}

fn providers_schema() -> ArrayBuilder {
    ArrayBuilder::new().items(provider_schema())
}

// Names (`pattern` below): 1 to 200 printable characters, not only blanks (the gateway counts
// bytes: a name of many multi-byte characters may still be refused with `400 invalid_field`).

/// `POST /v1/workspaces` (admin).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewWorkspace {
    /// 1 to 200 printable characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
    /// At most this many attempts of the workspace run at once (positive; none: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_concurrency: Option<i32>,
}

/// `POST /v1/api-tokens`, `/v1/host-tokens`, `/v1/worker-tokens`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
}

/// `POST /v1/agents/{id}/versions`: a new immutable version of an agent.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewVersion {
    /// At most 256 KiB.
    #[serde(default)]
    pub instructions: String,
    /// A hosted provider or `managed`.
    #[schema(schema_with = provider_schema)]
    pub provider: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// File name to content, written into the attempt's working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub capability_files: Option<Value>,
    /// The managed tools the agent may use, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<String>>)]
    pub tools: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub policy: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_iters: Option<i32>,
}

/// `POST /v1/agents`: an agent with its first version (the fields of [`NewVersion`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAgent {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
    #[serde(default)]
    pub instructions: String,
    #[schema(schema_with = provider_schema)]
    pub provider: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub capability_files: Option<Value>,
    /// The managed tools the agent may use, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<String>>)]
    pub tools: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub policy: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_iters: Option<i32>,
}

impl NewAgent {
    /// Its first version.
    pub fn version(&self) -> NewVersion {
        NewVersion {
            instructions: self.instructions.clone(),
            provider: self.provider.clone(),
            model: self.model.clone(),
            capability_files: self.capability_files.clone(),
            tools: self.tools.clone(),
            policy: self.policy.clone(),
            max_iters: self.max_iters,
        }
    }
}

/// `POST /v1/runtime-profiles`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewProfile {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
    #[schema(schema_with = provider_schema)]
    pub provider: String,
    /// Provider parameters; `command`, when present, is a non-empty array of strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub params: Option<Value>,
}

/// `POST /v1/pools`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewPool {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_concurrency: Option<i32>,
}

/// `POST /v1/bindings`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewBinding {
    pub agent_id: Uuid,
    pub pool_id: Uuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_profile_id: Option<Uuid>,
    #[serde(default)]
    pub required_capabilities: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_concurrency: Option<i32>,
    /// Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_attempts: Option<i32>,
    /// 0 to 3600000; default 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 3600000)]
    pub retry_backoff_ms: Option<i64>,
    #[serde(default)]
    #[schema(schema_with = providers_schema)]
    pub fallback_providers: Vec<String>,
}

/// `POST /v1/issues`; with an assignee the Issue becomes a task at once.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewIssue {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub title: String,
    /// At most 256 KiB.
    #[serde(default)]
    pub body: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignee_agent_id: Option<Uuid>,
    /// With an assignee: where the task's work happens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// At most 256 KiB.
    #[serde(default)]
    pub input: String,
}

/// `POST /v1/issues/{id}/comments`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewComment {
    /// 1 byte to 64 KiB.
    pub body: String,
    /// Ignored: the author is the credential's (`token:<id>`), never the body's. Still accepted
    /// so that older clients keep working; the response shows the recorded author.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author: Option<String>,
}

/// `POST /v1/task/comments` (executor).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTaskComment {
    /// 1 byte to 64 KiB.
    pub body: String,
}

/// `POST /v1/tasks`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTask {
    pub agent_id: Uuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issue_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// At most 256 KiB.
    #[serde(default)]
    pub input: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub timeout_secs: Option<i32>,
    /// Submitting twice with the same key creates one task; the same key with another request
    /// is `409 idempotency_conflict`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `POST /v1/tasks/{id}/cancel` (the body is optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelTask {
    /// At most 1024 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/approvals/{id}/approve` and `/deny` (the body is optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// At most 4096 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Allow the same tool without asking for the rest of this task (never beyond it).
    #[serde(default)]
    pub always_for_task: bool,
}

/// `POST /v1/secrets`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSecret {
    /// An environment variable name: A-Z, 0-9 and _, not starting with a digit.
    #[schema(pattern = "^[A-Z_][A-Z0-9_]{0,127}$")]
    pub name: String,
    /// 4 bytes to 64 KiB; never returned.
    pub value: String,
}

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSession {
    pub agent_id: Uuid,
    /// `local`, `sandbox` (the default), `remote` or `self_hosted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// The self-hosted Worker (by name) of a `self_hosted` session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The Issue the session works on (its comment and upload tools write there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issue_id: Option<Uuid>,
    pub input: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `POST /v1/sessions/{id}/inputs`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewInput {
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// What to do when the session waits for an Approval: `reject` (the default), `enqueue`
    /// (run after the current work) or `interrupt` (deny the pending request, then run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when_awaiting_approval: Option<String>,
}

/// `GET /v1/tasks`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct TaskFilter {
    /// Only tasks in this status (`queued`, `running`, `succeeded`, `failed`, `cancelled`...).
    pub status: Option<String>,
    /// At most this many (1 to 1000; default 100), newest first.
    pub limit: Option<i64>,
}

/// `GET /v1/approvals`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ApprovalFilter {
    /// `pending`, `allowed`, `denied` or `expired`.
    pub status: Option<String>,
    pub task_id: Option<Uuid>,
    pub session_id: Option<Uuid>,
}

/// `GET /v1/tasks/{id}/events`, `/v1/attempts/{id}/events`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventQuery {
    /// Return events after this cursor (`seq` for an attempt, `number:seq` for a task); the
    /// `Last-Event-ID` header, when sent, takes its place.
    pub after: Option<String>,
    /// At most this many (1 to 5000; default 500).
    pub limit: Option<i64>,
    /// Stream live over SSE (also chosen by `Accept: text/event-stream`).
    pub follow: Option<bool>,
}

/// `POST /v1/task/artifacts` (executor; the body is the file).
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UploadQuery {
    /// The file's name.
    pub name: String,
}
