//! What a claim hands a host, built the same way by every service that claims: the scheduler
//! (a host's claim request) and the gateway (an attempt it claimed for an idle host when it
//! stored the task).

use agentscope_schemas::v1::{LeaseRecord, TaskSpec};

/// The record of the lease `host` holds on `attempt` under its claim's fencing `token`: the
/// value its creator writes and its holder renews, byte for byte, so that the holder knows it
/// for its own whichever revision it is at.
pub fn new_lease(host: &str, attempt: &str, token: i64) -> LeaseRecord {
    LeaseRecord {
        attempt_id: attempt.to_string(),
        host_id: host.to_string(),
        token: token as u64,
        acquired_at_ms: 0,
        renewed_at_ms: 0,
    }
}

/// An attempt's stored spec (`attempts.spec`, JSON) as the host receives it.
pub fn spec_from_json(v: &serde_json::Value) -> TaskSpec {
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    TaskSpec {
        provider: s("provider"),
        repository: s("repository"),
        branch: s("branch"),
        input: s("input"),
        instructions: s("instructions"),
        params: v["params"]
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default(),
        issue_title: s("issue_title"),
        issue_body: s("issue_body"),
        command: v["command"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| {
                        x.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| x.to_string())
                    })
                    .collect()
            })
            .unwrap_or_default(),
        agent_id: s("agent_id"),
        agent_version_id: s("agent_version_id"),
        timeout_secs: v["timeout_secs"].as_u64().unwrap_or(0) as u32,
        issue_id: s("issue_id"),
        resume_session_id: s("resume_session_id"),
        resume_from_attempt_id: s("resume_from_attempt_id"),
        timeout_source: s("timeout_source"),
    }
}
