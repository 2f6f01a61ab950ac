//! The Attempt as the host works with it. The protobuf `AttemptAssignment` and its `TaskSpec`
//! stay at the edges: they are converted on receipt (a claim offer, a journal entry) and back
//! only for the journal.

use agentscope_schemas::v1::{AttemptAssignment, TaskSpec};
use std::collections::HashMap;

/// An Attempt handed to this host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Assignment {
    pub attempt_id: String,
    pub task_id: String,
    pub workspace_id: String,
    pub attempt_number: u32,
    /// The lease's key in the KV bucket `agentscope_leases`.
    pub lease_key: String,
    /// The fencing token: the revision at which the lease was created.
    pub lease_token: u64,
    /// The lease's current revision, renewed from by compare-and-set.
    pub lease_revision: u64,
    /// What to run: the task resolved with its runtime profile.
    pub spec: Spec,
    /// W3C trace context of the attempt (empty: none).
    pub traceparent: String,
    /// The executor's task-scoped credential; never logged, never in an event.
    pub task_token: String,
}

impl From<AttemptAssignment> for Assignment {
    fn from(a: AttemptAssignment) -> Self {
        Assignment {
            attempt_id: a.attempt_id,
            task_id: a.task_id,
            workspace_id: a.workspace_id,
            attempt_number: a.attempt_number,
            lease_key: a.lease_key,
            lease_token: a.lease_token,
            lease_revision: a.lease_revision,
            spec: a.spec.unwrap_or_default().into(),
            traceparent: a.traceparent,
            task_token: a.task_token,
        }
    }
}

impl Assignment {
    /// The assignment as the bus carries it (the journal keeps it in this form).
    pub fn to_wire(&self) -> AttemptAssignment {
        AttemptAssignment {
            attempt_id: self.attempt_id.clone(),
            task_id: self.task_id.clone(),
            workspace_id: self.workspace_id.clone(),
            attempt_number: self.attempt_number,
            lease_key: self.lease_key.clone(),
            lease_token: self.lease_token,
            lease_revision: self.lease_revision,
            spec: Some(self.spec.to_wire()),
            traceparent: self.traceparent.clone(),
            task_token: self.task_token.clone(),
        }
    }
}

/// What an Attempt runs, as the host uses it: the task resolved with its runtime profile (the
/// fields of `TaskSpec` the host reads; the scheduler's agent and issue ids are not among them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spec {
    /// The provider's name as the scheduler sent it (`agentscope_domain::Provider`'s name; one
    /// this host has no adapter for fails the attempt naming it, so it is kept as sent).
    pub provider: String,
    /// A local path or URL to clone into the task directory; empty: none.
    pub repository: String,
    pub branch: String,
    /// Input material, written to the task directory.
    pub input: String,
    pub instructions: String,
    /// The runtime profile's parameters, checked by the adapter.
    pub params: HashMap<String, String>,
    pub issue_title: String,
    pub issue_body: String,
    /// The argv of the `command` provider.
    pub command: Vec<String>,
    /// The run timeout (0: the spec predates resolved timeouts) and where it comes from:
    /// `task`, `profile` or the deployment default.
    pub timeout_secs: u32,
    pub timeout_source: String,
    /// A retry's previous provider session, continued when it is on this host.
    pub resume_session_id: String,
    pub resume_from_attempt_id: String,
}

impl From<TaskSpec> for Spec {
    fn from(s: TaskSpec) -> Self {
        Spec {
            provider: s.provider,
            repository: s.repository,
            branch: s.branch,
            input: s.input,
            instructions: s.instructions,
            params: s.params,
            issue_title: s.issue_title,
            issue_body: s.issue_body,
            command: s.command,
            timeout_secs: s.timeout_secs,
            timeout_source: s.timeout_source,
            resume_session_id: s.resume_session_id,
            resume_from_attempt_id: s.resume_from_attempt_id,
        }
    }
}

impl Spec {
    /// The spec as the bus carries it (for the journal).
    pub fn to_wire(&self) -> TaskSpec {
        TaskSpec {
            provider: self.provider.clone(),
            repository: self.repository.clone(),
            branch: self.branch.clone(),
            input: self.input.clone(),
            instructions: self.instructions.clone(),
            params: self.params.clone(),
            issue_title: self.issue_title.clone(),
            issue_body: self.issue_body.clone(),
            command: self.command.clone(),
            timeout_secs: self.timeout_secs,
            timeout_source: self.timeout_source.clone(),
            resume_session_id: self.resume_session_id.clone(),
            resume_from_attempt_id: self.resume_from_attempt_id.clone(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_round_trips() {
        let mut spec = Spec {
            provider: "command".into(),
            command: vec!["true".into()],
            ..Default::default()
        };
        spec.params.insert("timeout_secs".into(), "5".into());
        let a = Assignment {
            attempt_id: "a".into(),
            task_id: "t".into(),
            workspace_id: "w".into(),
            attempt_number: 2,
            lease_key: "attempt.a".into(),
            lease_token: 7,
            lease_revision: 9,
            spec,
            traceparent: "00-x-y-01".into(),
            task_token: "agt_x".into(),
        };
        assert_eq!(Assignment::from(a.to_wire()), a);
    }
}
