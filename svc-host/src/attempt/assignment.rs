//! The Attempt as the host works with it. The protobuf `AttemptAssignment` stays at the edges:
//! it is converted on receipt (a claim offer, a journal entry) and back only for the journal.

use agentscope_schemas::v1::{AttemptAssignment, TaskSpec};

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
    pub spec: TaskSpec,
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
            spec: a.spec.unwrap_or_default(),
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
            spec: Some(self.spec.clone()),
            traceparent: self.traceparent.clone(),
            task_token: self.task_token.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_round_trips() {
        let mut spec = TaskSpec {
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
