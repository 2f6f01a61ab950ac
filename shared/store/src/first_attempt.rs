//! What a task's first Attempt is: the one resolution of a task's agent (newest version), binding
//! (pool, required capabilities) and runtime profile (provider, parameters, run timeout) into
//! the attempt's columns and its spec.
//!
//! Two writers create attempt 1 with it (ARCHITECTURE.md, "Data ownership"): the gateway, in the
//! same statement that stores a submitted task, and the scheduler, for a task found without one
//! (its sweep, a submission message from an older gateway). Retries and fallbacks copy an
//! earlier attempt's spec and stay the scheduler's.

use serde_json::{Value, json};
use sqlx::PgExecutor;
use uuid::Uuid;

/// The fields of a task's row that its first attempt depends on.
#[derive(Debug, Clone, Copy)]
pub struct TaskFields<'a> {
    pub workspace_id: Uuid,
    pub agent_id: Uuid,
    pub issue_id: Option<Uuid>,
    pub repository: Option<&'a str>,
    pub branch: Option<&'a str>,
    pub input: &'a str,
    pub timeout_secs: Option<i32>,
}

/// Attempt 1's columns, as resolved now.
#[derive(Debug, Clone)]
pub struct Plan {
    pub agent_version_id: Option<Uuid>,
    pub binding_id: Option<Uuid>,
    pub pool_id: Option<Uuid>,
    pub provider: Option<String>,
    pub required_capabilities: Vec<String>,
    pub spec: Value,
}

/// Where a run timeout comes from when neither the task nor its runtime profile sets one: the
/// deployment's `run_timeout_secs`, a setting of the services that claim (the scheduler, and the
/// gateway for its direct dispatch). The spec then carries this source and no `timeout_secs`
/// until the claim that leases the attempt writes it in (`claim_attempts`, or `submit_task` for
/// an attempt stored claimed; migrations 0006 and 0007).
pub const DEFAULT_TIMEOUT_SOURCE: &str = "default";

/// `run_timeout_secs` unless configured: 4 hours.
pub const DEFAULT_RUN_TIMEOUT_SECS: u64 = 4 * 3600;

/// The run timeout an attempt's task or runtime profile sets, and which of the two: the task's own
/// `timeout_secs`, else the profile's `timeout_secs` parameter. Values that are not positive
/// integers (at most `u32::MAX`) count as unset; `None` leaves the deployment default.
pub fn explicit_timeout(
    task_secs: Option<i64>,
    profile_param: Option<&Value>,
) -> Option<(u64, &'static str)> {
    if let Some(t) = task_secs.filter(|t| *t > 0) {
        return Some((t as u64, "task"));
    }
    let profile = profile_param.and_then(|v| match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    });
    profile
        .filter(|p| *p > 0 && *p <= u32::MAX as u64)
        .map(|p| (p, "profile"))
}

/// What attempt 1 of an agent's tasks is made of, whatever the task: the agent's newest version,
/// its binding, and the binding's runtime profile. Agents, versions, bindings and profiles are
/// never changed, deleted nor moved, so this changes only when the agent gets a newer version or
/// its first binding: a reader may keep it and check those two ids where it writes
/// (`submit_task` does, migration 0008).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentPlan {
    pub agent_version_id: Option<Uuid>,
    pub instructions: Option<String>,
    pub version_provider: Option<String>,
    pub binding_id: Option<Uuid>,
    pub pool_id: Option<Uuid>,
    pub required_capabilities: Option<Vec<String>>,
    pub profile_provider: Option<String>,
    pub params: Option<Value>,
}

/// The title and body of the issue a task works on.
#[derive(Debug, Clone, Default)]
pub struct IssueText {
    pub title: String,
    pub body: String,
}

/// Reads what attempt 1 of `task` is made of: its agent's part, and the issue's text when the
/// task names one. `None` when the agent, or the issue, is not in the task's workspace.
pub async fn read<'c>(
    db: impl PgExecutor<'c>,
    task: &TaskFields<'_>,
) -> Result<Option<(AgentPlan, Option<IssueText>)>, sqlx::Error> {
    let row = sqlx::query!(
        r#"
        SELECT i.id AS "issue_id?", i.title AS "issue_title?", i.body AS "issue_body?",
               v.id AS "version_id?", v.instructions AS "instructions?",
               v.provider AS "version_provider?",
               b.id AS "binding_id?", b.pool_id AS "pool_id?",
               b.required_capabilities AS "required_capabilities?",
               rp.provider AS "profile_provider?", rp.params AS "params?"
        FROM agents ag
        LEFT JOIN issues i ON i.id = $3 AND i.workspace_id = ag.workspace_id
        LEFT JOIN LATERAL (
            SELECT * FROM agent_versions WHERE agent_id = ag.id ORDER BY version DESC LIMIT 1
        ) v ON true
        LEFT JOIN bindings b ON b.agent_id = ag.id
        LEFT JOIN runtime_profiles rp ON rp.id = b.runtime_profile_id
        WHERE ag.id = $1 AND ag.workspace_id = $2
        "#,
        task.agent_id,
        task.workspace_id,
        task.issue_id,
    )
    .fetch_optional(db)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let issue = match (task.issue_id, row.issue_id) {
        (None, _) => None,
        (Some(_), None) => return Ok(None),
        (Some(_), Some(_)) => Some(IssueText {
            title: row.issue_title.unwrap_or_default(),
            body: row.issue_body.unwrap_or_default(),
        }),
    };
    let agent = AgentPlan {
        agent_version_id: row.version_id,
        instructions: row.instructions,
        version_provider: row.version_provider,
        binding_id: row.binding_id,
        pool_id: row.pool_id,
        required_capabilities: row.required_capabilities,
        profile_provider: row.profile_provider,
        params: row.params,
    };
    Ok(Some((agent, issue)))
}

/// Resolves a task's first attempt. `None` when the agent, or the issue the task names, is not
/// in the task's workspace.
pub async fn plan<'c>(
    db: impl PgExecutor<'c>,
    task: &TaskFields<'_>,
) -> Result<Option<Plan>, sqlx::Error> {
    Ok(read(db, task)
        .await?
        .map(|(agent, issue)| agent.plan(task, issue.as_ref())))
}

impl AgentPlan {
    /// Attempt 1 of `task` (which works on `issue`, if it names one).
    pub fn plan(&self, task: &TaskFields<'_>, issue: Option<&IssueText>) -> Plan {
        let empty = json!({});
        let params: &Value = self.params.as_ref().unwrap_or(&empty);
        let provider: Option<String> = self
            .profile_provider
            .clone()
            .or_else(|| self.version_provider.clone());
        // The command provider's argv is a JSON array in the profile; other params are strings.
        let command = params.get("command").cloned().unwrap_or_else(|| json!([]));
        let mut str_params = serde_json::Map::new();
        if let Some(obj) = params.as_object() {
            for (k, v) in obj {
                if k == "command" {
                    continue;
                }
                let s = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                str_params.insert(k.clone(), json!(s));
            }
        }
        let version_id = self.agent_version_id;
        let mut spec = json!({
            "provider": provider.clone().unwrap_or_default(),
            "repository": task.repository.unwrap_or_default(),
            "branch": task.branch.unwrap_or_default(),
            "input": task.input,
            "instructions": self.instructions.clone().unwrap_or_default(),
            "params": str_params,
            "command": command,
            "issue_id": task.issue_id.map(|u| u.to_string()).unwrap_or_default(),
            "issue_title": issue.map(|i| i.title.as_str()).unwrap_or_default(),
            "issue_body": issue.map(|i| i.body.as_str()).unwrap_or_default(),
            "agent_id": task.agent_id.to_string(),
            "agent_version_id": version_id.map(|v| v.to_string()).unwrap_or_default(),
            "timeout_source": DEFAULT_TIMEOUT_SOURCE,
        });
        if let Some((secs, source)) =
            explicit_timeout(task.timeout_secs.map(i64::from), params.get("timeout_secs"))
        {
            spec["timeout_secs"] = json!(secs);
            spec["timeout_source"] = json!(source);
        }
        Plan {
            agent_version_id: version_id,
            binding_id: self.binding_id,
            pool_id: self.pool_id,
            provider,
            required_capabilities: self.required_capabilities.clone().unwrap_or_default(),
            spec,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_wins_over_the_profile_and_bad_values_count_as_unset() {
        assert_eq!(
            explicit_timeout(Some(30), Some(&json!(60))),
            Some((30, "task"))
        );
        assert_eq!(
            explicit_timeout(None, Some(&json!(60))),
            Some((60, "profile"))
        );
        assert_eq!(
            explicit_timeout(Some(0), Some(&json!(" 61 "))),
            Some((61, "profile"))
        );
        assert_eq!(explicit_timeout(Some(-5), Some(&json!("soon"))), None);
        assert_eq!(explicit_timeout(None, Some(&json!(0))), None);
        assert_eq!(
            explicit_timeout(None, Some(&json!(u64::from(u32::MAX) + 1))),
            None
        );
        assert_eq!(explicit_timeout(None, None), None);
    }
}
