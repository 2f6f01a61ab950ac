//! Response bodies. Fields that may be absent from the JSON are `Option` with
//! `skip_serializing_if`; fields that are present but may be `null` are plain `Option`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

/// A field that, when present, is kept even when `null` (absent stays absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// `{"items": [...]}`: the shape of every list.
macro_rules! list {
    ($(#[$m:meta])* $name:ident of $item:ty) => {
        $(#[$m])*
        #[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
        pub struct $name {
            pub items: Vec<$item>,
        }
    };
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Workspace {
    pub id: Uuid,
    pub name: String,
    pub max_concurrency: Option<i32>,
}

/// `POST /v1/workspaces`: the workspace and its first API token (shown once).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WorkspaceCreated {
    pub workspace: Workspace,
    pub api_token: String,
}

/// A new token; `token` is shown only here.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenCreated {
    pub id: Uuid,
    pub name: String,
    pub token: String,
}

/// An agent version as shown with its agent.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VersionSummary {
    pub id: Uuid,
    /// Present when the version was just created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<Uuid>,
    pub version: i32,
    pub provider: String,
    pub model: Option<String>,
    pub instructions: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Agent {
    pub id: Uuid,
    pub name: String,
    /// Absent in the answer to the agent's creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
    pub current_version: VersionSummary,
}
list!(AgentList of Agent);

/// A full agent version (`GET /v1/agents/{id}/versions`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentVersion {
    pub id: Uuid,
    pub version: i32,
    pub provider: String,
    pub model: Option<String>,
    pub instructions: String,
    #[schema(value_type = Object)]
    pub capability_files: Value,
    pub tools: Value,
    #[schema(value_type = Object)]
    pub policy: Value,
    pub max_iters: Option<i32>,
    pub created_at: DateTime<Utc>,
}
list!(AgentVersionList of AgentVersion);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RuntimeProfile {
    pub id: Uuid,
    pub name: String,
    pub provider: String,
    #[schema(value_type = Object)]
    pub params: Value,
    /// Absent in the answer to the profile's creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}
list!(RuntimeProfileList of RuntimeProfile);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Pool {
    pub id: Uuid,
    pub name: String,
    pub max_concurrency: Option<i32>,
    /// Absent in the answer to the pool's creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}
list!(PoolList of Pool);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Binding {
    pub id: Uuid,
    pub agent_id: Uuid,
    pub pool_id: Uuid,
    pub runtime_profile_id: Option<Uuid>,
    pub required_capabilities: Vec<String>,
    pub max_concurrency: Option<i32>,
    pub max_attempts: i32,
    pub retry_backoff_ms: i64,
    pub fallback_providers: Vec<String>,
}
list!(BindingList of Binding);

/// One of a host's three checks: as the host reported it (with its name and when it was
/// checked), or as the gateway judged it (offline, not reported).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HostCheck {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub ok: bool,
    pub detail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at_ms: Option<i64>,
}

impl HostCheck {
    /// A check the gateway failed itself.
    pub fn failed(detail: impl Into<String>) -> Self {
        HostCheck {
            name: None,
            ok: false,
            detail: detail.into(),
            checked_at_ms: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HostChecks {
    pub connectivity: HostCheck,
    pub provider_discovery: HostCheck,
    pub dispatch_readiness: HostCheck,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Host {
    pub id: Uuid,
    pub name: String,
    /// The pool's name.
    pub pool: String,
    pub pool_id: Option<Uuid>,
    pub capacity: i32,
    /// Attempts running now; `null` while the host is offline.
    pub running: Option<i32>,
    pub capabilities: Vec<String>,
    /// The providers the host discovered, as it reported them.
    pub providers: Value,
    pub version: String,
    pub online: bool,
    pub last_seen_at: DateTime<Utc>,
    pub checks: HostChecks,
}
list!(HostList of Host);

/// `POST /v1/issues`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct IssueCreated {
    pub id: Uuid,
    pub title: String,
    pub body: String,
    pub assignee_agent_id: Option<Uuid>,
    /// The task the Issue became, with an assignee.
    pub task_id: Option<Uuid>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct IssueSummary {
    pub id: Uuid,
    pub title: String,
    pub status: String,
    pub assignee_agent_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
}
list!(IssueList of IssueSummary);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Issue {
    pub id: Uuid,
    pub title: String,
    pub body: String,
    pub status: String,
    pub assignee_agent_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    /// Its tasks, oldest first.
    pub tasks: Vec<Uuid>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Comment {
    pub id: Uuid,
    /// Present in the answer to the comment's creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issue_id: Option<Uuid>,
    /// `token:<id>` for a workspace token, `agent:<id>` for an executor.
    pub author: String,
    pub body: String,
    /// Absent in the answer to the comment's creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}
list!(CommentList of Comment);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Attempt {
    pub id: Uuid,
    pub task_id: Uuid,
    pub number: i32,
    /// `queued`, `claimed`, `running`, `succeeded`, `failed`, `cancelled` or `lost`.
    pub status: String,
    pub provider: Option<String>,
    pub host_id: Option<Uuid>,
    pub lease_token: Option<i64>,
    pub agent_version_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub not_before: DateTime<Utc>,
    pub claimed_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub failure_class: Option<String>,
    pub failure_detail: Option<String>,
    pub exit_code: Option<i32>,
    pub provider_session_id: Option<String>,
    /// How many events the attempt recorded.
    pub events: i64,
    /// What to do about `failure_class`, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Task {
    pub id: Uuid,
    /// The newest attempt's status (`queued` before the first).
    pub status: String,
    pub issue_id: Option<Uuid>,
    pub agent_id: Uuid,
    pub repository: Option<String>,
    pub branch: Option<String>,
    pub input: String,
    pub timeout_secs: Option<i32>,
    pub idempotency_key: Option<String>,
    pub cancel_requested_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// Oldest first.
    pub attempts: Vec<Attempt>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TaskSummary {
    pub id: Uuid,
    pub issue_id: Option<Uuid>,
    pub agent_id: Uuid,
    pub created_at: DateTime<Utc>,
    pub newest_attempt: Option<i32>,
    pub attempt_status: Option<String>,
    pub failure_class: Option<String>,
    pub status: String,
}
list!(TaskList of TaskSummary);

/// `GET /v1/tasks/{id}/explain`: why a task waits or failed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Explanation {
    pub task_id: Uuid,
    pub status: String,
    pub agent_id: Uuid,
    pub agent_name: String,
    pub cancel_requested_at: Option<DateTime<Utc>>,
    #[schema(value_type = Vec<Object>)]
    pub attempts: Vec<Value>,
    /// The effective timeout and where it comes from.
    pub timeout: Value,
    /// The newest attempt (`null` before the first).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<Object>)]
    pub attempt: Option<Value>,
    /// For a running attempt: its host (`null` if the host is gone).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<Object>)]
    pub host: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// For a failed task: the class, evidence and remedy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub failure: Option<Value>,
    /// For a waiting task: where it would run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub target: Option<Value>,
    /// For a waiting task: the predicates that hold it back, each `{predicate, detail}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub reasons: Option<Vec<Value>>,
    /// For a waiting task: each host with its failing predicates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub hosts: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eligible_hosts: Option<i64>,
}

/// One recorded event of an attempt.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// Its cursor: `seq` in an attempt's stream, `number:seq` in a task's.
    pub id: String,
    pub attempt_id: Uuid,
    pub attempt_number: i32,
    pub seq: i64,
    pub kind: String,
    pub at: DateTime<Utc>,
    pub payload: Value,
}

/// A page of events; pass `next` as `after` for the following page.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventPage {
    pub items: Vec<Event>,
    pub next: String,
}

/// `POST /v1/task/artifacts`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ArtifactUploaded {
    pub id: Uuid,
    pub name: String,
    pub content_type: String,
    pub size_bytes: i64,
    pub sha256: String,
    pub issue_id: Option<Uuid>,
    pub task_id: Uuid,
    pub attempt_id: Uuid,
}

/// An Artifact's metadata.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Artifact {
    pub id: Uuid,
    pub name: String,
    pub content_type: String,
    pub size_bytes: i64,
    pub sha256: String,
    pub issue_id: Option<Uuid>,
    pub task_id: Option<Uuid>,
    pub attempt_id: Option<Uuid>,
    pub author: String,
    pub created_at: DateTime<Utc>,
}
list!(ArtifactList of Artifact);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Approval {
    pub id: Uuid,
    pub attempt_id: Option<Uuid>,
    pub task_id: Option<Uuid>,
    pub session_id: Option<String>,
    pub request_id: String,
    pub tool_name: String,
    pub input: Value,
    /// `pending`, `allowed`, `denied` or `timed_out`.
    pub status: String,
    pub decided_by: Option<String>,
    pub reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub decided_at: Option<DateTime<Utc>>,
}
list!(ApprovalList of Approval);

/// `POST /v1/secrets` (the value is never returned).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SecretStored {
    pub name: String,
    pub key_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Secret {
    pub name: String,
    pub key_id: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}
list!(SecretList of Secret);

/// `POST /v1/secrets/rotate`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Rotated {
    /// How many secrets were re-sealed.
    pub resealed: i64,
    /// The key they are sealed under now.
    pub key_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PinnedVersion {
    pub id: Uuid,
    pub version: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InputOutcome {
    /// `completed`, `max_iterations`, `model_connection` or `tool_denied`.
    pub status: String,
    pub detail: String,
    pub iterations: i32,
    pub finished_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SessionInput {
    pub id: Uuid,
    pub text: String,
    pub idempotency_key: Option<String>,
    /// `null` until the input's work ends.
    pub outcome: Option<InputOutcome>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Session {
    pub id: Uuid,
    pub agent_id: Uuid,
    pub environment: String,
    pub worker: Option<String>,
    pub issue_id: Option<Uuid>,
    pub agent_version: PinnedVersion,
    pub status: String,
    pub detail: String,
    pub created_at: DateTime<Utc>,
    pub inputs: Vec<SessionInput>,
}

/// `POST /v1/sessions/{id}/inputs`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InputAccepted {
    pub id: Uuid,
    pub session_id: Uuid,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SessionEvent {
    pub seq: i64,
    pub kind: String,
    pub payload: Value,
    pub at: DateTime<Utc>,
}
list!(SessionEventList of SessionEvent);

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ContextIssue {
    pub id: Uuid,
    pub title: Option<String>,
    pub body: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ContextArtifact {
    pub id: Uuid,
    pub name: String,
    pub content_type: String,
    pub size_bytes: i64,
    pub task_id: Option<Uuid>,
}

/// `GET /v1/task` (executor): the work.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TaskContext {
    pub task_id: Uuid,
    pub attempt_id: Uuid,
    pub attempt_number: i32,
    pub repository: Option<String>,
    pub branch: Option<String>,
    pub input: String,
    pub issue: Option<ContextIssue>,
    pub comments: Vec<Comment>,
    pub artifacts: Vec<ContextArtifact>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_explanation_keeps_null_fields_that_were_present_and_omits_absent_ones() {
        let v = json!({
            "task_id": "00000000-0000-0000-0000-000000000001",
            "status": "queued",
            "agent_id": "00000000-0000-0000-0000-000000000002",
            "agent_name": "a",
            "cancel_requested_at": null,
            "attempts": [],
            "timeout": {"secs": 60},
            "attempt": null,
            "waiting": true,
        });
        let e: Explanation = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&e).unwrap(), v);
    }

    #[test]
    fn a_host_check_keeps_what_the_host_reported() {
        let v = json!({"name": "connectivity", "ok": true, "detail": "", "checked_at_ms": 5});
        let c: HostCheck = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&c).unwrap(), v);
    }
}
