//! Domain types and state machines. Architecture invariant: this crate does no I/O (the Vault
//! cipher reads only the system's randomness).

pub mod vault;

use serde::{Deserialize, Serialize};
use std::fmt;

/// Lifecycle of one Attempt. A retry is a new Attempt; terminal states never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptStatus {
    /// Created, waiting for an eligible host (or for its backoff to pass).
    Queued,
    /// Leased to a host; the host is preparing the task directory.
    Claimed,
    /// The provider process runs.
    Running,
    Succeeded,
    Failed,
    Cancelled,
    /// The lease expired while the attempt was active.
    Lost,
}

impl AttemptStatus {
    pub const ALL: [AttemptStatus; 7] = [
        Self::Queued,
        Self::Claimed,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Cancelled,
        Self::Lost,
    ];
    /// States in which a host holds the attempt's lease and a capacity slot.
    pub const ACTIVE: [AttemptStatus; 2] = [Self::Claimed, Self::Running];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Claimed => "claimed",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Failed | Self::Cancelled | Self::Lost
        )
    }

    pub fn is_active(self) -> bool {
        Self::ACTIVE.contains(&self)
    }

    /// Whether a report from the lease holder may move the attempt from `self` to `next`.
    pub fn can_move_to(self, next: AttemptStatus) -> bool {
        use AttemptStatus::*;
        matches!(
            (self, next),
            (Claimed, Running)
                | (Claimed | Running, Succeeded | Failed | Cancelled | Lost)
                | (Queued, Cancelled)
        )
    }
}

impl fmt::Display for AttemptStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Status of a Task, derived from its newest Attempt.
pub fn task_status(newest_attempt: Option<AttemptStatus>) -> &'static str {
    match newest_attempt {
        None | Some(AttemptStatus::Queued) => "queued",
        Some(AttemptStatus::Claimed | AttemptStatus::Running) => "running",
        Some(AttemptStatus::Succeeded) => "succeeded",
        Some(AttemptStatus::Cancelled) => "cancelled",
        Some(AttemptStatus::Failed | AttemptStatus::Lost) => "failed",
    }
}

/// What a managed session does now (`session_state.status`, written by the dataplane; a session
/// without a state row yet is `queued`). The end of each input is an [`InputOutcome`]; the
/// session then shows that outcome's [`InputOutcome::session_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// No replica has taken the session up yet.
    Queued,
    /// A replica works on it.
    Running,
    /// A tool call waits for an Approval.
    AwaitingApproval,
    /// A tool call waits for the session's self-hosted Worker to come back.
    WorkerOffline,
    /// Its environment is not enabled in this deployment; its inputs stay unanswered.
    EnvironmentNotAllowed,
    /// The last input was answered; finishing a turn is never the acceptance of the Issue.
    CompletedAwaitingAcceptance,
    /// The last input stopped at the agent's `max_iters`.
    MaxIterations,
    /// The last input stopped because the model could not be reached.
    ModelConnection,
    /// The last input ended after a tool was denied.
    ToolDenied,
}

impl SessionStatus {
    pub const ALL: [SessionStatus; 9] = [
        Self::Queued,
        Self::Running,
        Self::AwaitingApproval,
        Self::WorkerOffline,
        Self::EnvironmentNotAllowed,
        Self::CompletedAwaitingAcceptance,
        Self::MaxIterations,
        Self::ModelConnection,
        Self::ToolDenied,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::AwaitingApproval => "awaiting_approval",
            Self::WorkerOffline => "worker_offline",
            Self::EnvironmentNotAllowed => "environment_not_allowed",
            Self::CompletedAwaitingAcceptance => "completed_awaiting_acceptance",
            Self::MaxIterations => "max_iterations",
            Self::ModelConnection => "model_connection",
            Self::ToolDenied => "tool_denied",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

impl fmt::Display for SessionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one input of a managed session ended (`session_outcomes.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputOutcome {
    /// The model answered without calling tools.
    Completed,
    /// The agent's `max_iters` model turns were used up.
    MaxIterations,
    /// The model could not be reached (or refused the request).
    ModelConnection,
    /// The turn ended after a tool was denied by policy.
    ToolDenied,
}

impl InputOutcome {
    pub const ALL: [InputOutcome; 4] = [
        Self::Completed,
        Self::MaxIterations,
        Self::ModelConnection,
        Self::ToolDenied,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::MaxIterations => "max_iterations",
            Self::ModelConnection => "model_connection",
            Self::ToolDenied => "tool_denied",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// The session's status once this input ended.
    pub fn session_status(self) -> SessionStatus {
        match self {
            Self::Completed => SessionStatus::CompletedAwaitingAcceptance,
            Self::MaxIterations => SessionStatus::MaxIterations,
            Self::ModelConnection => SessionStatus::ModelConnection,
            Self::ToolDenied => SessionStatus::ToolDenied,
        }
    }
}

impl fmt::Display for InputOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an Attempt did not succeed. Every class carries a remedy hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    ProviderLogin,
    BadParameters,
    TaskDir,
    ToolDependency,
    ProviderCrash,
    ExitNonzero,
    AgentError,
    LeaseLost,
    HostOffline,
    HostRestart,
    ApprovalTimeout,
    ToolDenied,
    Cancelled,
    Timeout,
    ModelUnreachable,
    NoBinding,
    Internal,
}

impl FailureClass {
    pub const ALL: [FailureClass; 17] = [
        Self::ProviderLogin,
        Self::BadParameters,
        Self::TaskDir,
        Self::ToolDependency,
        Self::ProviderCrash,
        Self::ExitNonzero,
        Self::AgentError,
        Self::LeaseLost,
        Self::HostOffline,
        Self::HostRestart,
        Self::ApprovalTimeout,
        Self::ToolDenied,
        Self::Cancelled,
        Self::Timeout,
        Self::ModelUnreachable,
        Self::NoBinding,
        Self::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::ProviderLogin => "provider_login",
            Self::BadParameters => "bad_parameters",
            Self::TaskDir => "task_dir",
            Self::ToolDependency => "tool_dependency",
            Self::ProviderCrash => "provider_crash",
            Self::ExitNonzero => "exit_nonzero",
            Self::AgentError => "agent_error",
            Self::LeaseLost => "lease_lost",
            Self::HostOffline => "host_offline",
            Self::HostRestart => "host_restart",
            Self::ApprovalTimeout => "approval_timeout",
            Self::ToolDenied => "tool_denied",
            Self::Cancelled => "cancelled",
            Self::Timeout => "timeout",
            Self::ModelUnreachable => "model_unreachable",
            Self::NoBinding => "no_binding",
            Self::Internal => "internal",
        }
    }

    /// Unknown strings from a host map to `Internal`, never to a panic.
    pub fn parse(s: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .unwrap_or(Self::Internal)
    }

    pub fn remedy(self) -> &'static str {
        match self {
            Self::ProviderLogin => {
                "log the provider CLI in on the host (or set its API key) and check `agentscope hosts`"
            }
            Self::BadParameters => "fix the runtime profile parameter named in the detail",
            Self::TaskDir => {
                "check the repository URL/path and branch named on the task, and the host's disk"
            }
            Self::ToolDependency => {
                "install the missing tool on the host or add it to the binding's required capabilities"
            }
            Self::ProviderCrash => {
                "read the attempt's last events; the provider process died without a result"
            }
            Self::ExitNonzero => {
                "the provider exited with a failure status; read its output events"
            }
            Self::AgentError => "the agent reported that its turn failed; read its error events",
            Self::LeaseLost => {
                "the host stopped renewing its lease (crash, network partition); a retry runs elsewhere"
            }
            Self::HostOffline => "start the host again or add capacity to the pool",
            Self::HostRestart => {
                "the host restarted during the attempt; a retry runs under a new lease"
            }
            Self::ApprovalTimeout => {
                "decide approvals faster or raise the approval timeout in the policy"
            }
            Self::ToolDenied => {
                "the agent's turn ended after a tool request was denied: approve it, or change the instructions or the tools the agent may use, then resubmit"
            }
            Self::Cancelled => "the task was cancelled on request",
            Self::Timeout => {
                "raise the limit named in the detail (the task's `timeout_secs`, the runtime \
                 profile's `timeout_secs`, or AGENTSCOPE_RUN_TIMEOUT_SECS of the scheduler and the gateway) or split the work"
            }
            Self::ModelUnreachable => {
                "the provider could not connect to its model endpoint (named in the detail): check \
                 the host's ANTHROPIC_BASE_URL / OPENAI_BASE_URL and that the model service is up"
            }
            Self::NoBinding => "bind the agent to a pool: POST /v1/bindings",
            Self::Internal => "report a bug with the attempt id; the platform failed unexpectedly",
        }
    }

    /// Infrastructure failures are retried; failures of the work itself are not.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::LeaseLost | Self::HostOffline | Self::HostRestart | Self::ProviderCrash
        )
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Retry policy of a binding: how many Attempts a Task may have and how long to wait between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            backoff_base_ms: 1_000,
            backoff_max_ms: 60_000,
        }
    }
}

impl RetryPolicy {
    /// Delay before attempt `next_number` (2 for the first retry), or None when attempts are spent.
    pub fn delay_before(&self, next_number: u32) -> Option<u64> {
        if next_number > self.max_attempts {
            return None;
        }
        let exp = next_number.saturating_sub(2).min(20);
        Some(
            self.backoff_base_ms
                .saturating_mul(1u64 << exp)
                .min(self.backoff_max_ms),
        )
    }
}

/// Kinds of bearer token. Tokens are stored only as hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// Workspace API token: `ags_...`.
    Api,
    /// Host registration token: `agh_...`.
    Host,
    /// Task-scoped executor credential: `agt_...`.
    Task,
    /// Self-hosted Worker credential: `agw_...`.
    Worker,
}

impl TokenKind {
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Api => "ags_",
            Self::Host => "agh_",
            Self::Task => "agt_",
            Self::Worker => "agw_",
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Host => "host",
            Self::Task => "task",
            Self::Worker => "worker",
        }
    }
}

/// A new random token of `kind` (244 bits from two v4 UUIDs).
pub fn new_token(kind: TokenKind) -> String {
    format!(
        "{}{}{}",
        kind.prefix(),
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The stored form of a token.
pub fn hash_token(token: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(token.as_bytes()))
}

/// Verified tokens by their hash ([`hash_token`]), trusted for `ttl` without asking the database
/// again (a token revoked meanwhile works until then); refusals are never kept.
pub struct TrustCache<V: Copy> {
    ttl: std::time::Duration,
    map: std::sync::Mutex<std::collections::HashMap<String, (V, std::time::Instant)>>,
}

impl<V: Copy> TrustCache<V> {
    pub fn new(ttl: std::time::Duration) -> Self {
        Self {
            ttl,
            map: Default::default(),
        }
    }

    /// What `hash` was verified as, if that was within the trust period.
    pub fn get(&self, hash: &str) -> Option<V> {
        let map = self.map.lock().expect("trust cache");
        map.get(hash)
            .filter(|(_, at)| at.elapsed() < self.ttl)
            .map(|(v, _)| *v)
    }

    /// Records a verification (`Some`) or forgets a refused token (`None`).
    pub fn set(&self, hash: String, verified: Option<V>) {
        let mut map = self.map.lock().expect("trust cache");
        match verified {
            Some(v) => {
                if map.len() > 10_000 {
                    let ttl = self.ttl;
                    map.retain(|_, (_, at)| at.elapsed() < ttl);
                }
                map.insert(hash, (v, std::time::Instant::now()));
            }
            None => {
                map.remove(&hash);
            }
        }
    }
}

/// The provider of agents the platform runs itself (managed execution, svc-dataplane).
pub const MANAGED_PROVIDER: &str = "managed";

/// A provider a host knows how to run: a configured command, or one of the agent CLIs. The one
/// list of their names (`TaskSpec.provider`, runtime profiles, host configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    /// The runtime profile's `command` argv.
    Command,
    ClaudeCode,
    Codex,
    Opencode,
    Openclaw,
}

impl Provider {
    pub const ALL: [Provider; 5] = [
        Self::Command,
        Self::ClaudeCode,
        Self::Codex,
        Self::Opencode,
        Self::Openclaw,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Command => "command",
            Self::ClaudeCode => "claude-code",
            Self::Codex => "codex",
            Self::Opencode => "opencode",
            Self::Openclaw => "openclaw",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not a [`Provider`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown provider `{0}`")]
pub struct UnknownProvider(pub String);

impl std::str::FromStr for Provider {
    type Err = UnknownProvider;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s).ok_or_else(|| UnknownProvider(s.to_string()))
    }
}

/// The names of [`Provider::ALL`], in order.
pub const KNOWN_PROVIDERS: [&str; Provider::ALL.len()] = {
    let mut names = [""; Provider::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = Provider::ALL[i].as_str();
        i += 1;
    }
    names
};

/// The id of a managed session's Approval of its call `request_id`, derived from the two (a
/// UUID of version 8 from SHA-256): the replica whose call waits for it knows it before the
/// scheduler records it, and listens for its decision from the start.
pub fn session_approval_id(session_id: uuid::Uuid, request_id: &str) -> uuid::Uuid {
    use sha2::Digest;
    // The session id has a fixed form: nothing of the call's id can shift the boundary.
    let digest = sha2::Sha256::digest(format!("agentscope-approval:{session_id}:{request_id}"));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// A self-hosted Worker's id: stable per workspace and worker name.
pub fn worker_id(workspace_id: &str, name: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("agentscope-worker:{workspace_id}:{name}"));
    hex::encode(&digest[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_approval_id_is_one_per_session_and_call() {
        let s = uuid::Uuid::from_u128(7);
        let id = session_approval_id(s, "call_1");
        assert_eq!(id, session_approval_id(s, "call_1"));
        assert_eq!(id.get_version_num(), 8);
        assert_ne!(id, session_approval_id(s, "call_2"));
        assert_ne!(id, session_approval_id(uuid::Uuid::from_u128(8), "call_1"));
        assert_ne!(session_approval_id(s, "a:b"), session_approval_id(s, "a:c"));
    }

    #[test]
    fn a_trusted_token_is_kept_for_its_period_and_a_refused_one_is_forgotten() {
        let cache = TrustCache::new(std::time::Duration::from_secs(3600));
        assert_eq!(cache.get("h"), None);
        cache.set("h".into(), Some(7));
        assert_eq!(cache.get("h"), Some(7));
        cache.set("h".into(), None);
        assert_eq!(cache.get("h"), None);
        let expired = TrustCache::new(std::time::Duration::ZERO);
        expired.set("h".into(), Some(7));
        assert_eq!(expired.get("h"), None, "past its trust period");
    }

    #[test]
    fn provider_names_round_trip() {
        for p in Provider::ALL {
            assert_eq!(p.as_str().parse::<Provider>(), Ok(p));
        }
        assert_eq!(KNOWN_PROVIDERS.len(), Provider::ALL.len());
        assert!("managed".parse::<Provider>().is_err());
    }

    #[test]
    fn terminal_states_never_move() {
        for from in AttemptStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in AttemptStatus::ALL {
                assert!(!from.can_move_to(to), "{from} -> {to} must be refused");
            }
        }
    }

    #[test]
    fn status_strings_round_trip() {
        for s in AttemptStatus::ALL {
            assert_eq!(AttemptStatus::parse(s.as_str()), Some(s));
        }
        for c in FailureClass::ALL {
            assert_eq!(FailureClass::parse(c.as_str()), c);
            assert!(!c.remedy().is_empty());
        }
        assert_eq!(FailureClass::parse("nonsense"), FailureClass::Internal);
    }

    #[test]
    fn session_statuses_and_outcomes_round_trip() {
        for s in SessionStatus::ALL {
            assert_eq!(SessionStatus::parse(s.as_str()), Some(s));
        }
        for o in InputOutcome::ALL {
            assert_eq!(InputOutcome::parse(o.as_str()), Some(o));
        }
        assert_eq!(SessionStatus::parse("nonsense"), None);
        // Finishing an input never accepts the Issue; the other outcomes show as they are.
        assert_eq!(
            InputOutcome::Completed.session_status(),
            SessionStatus::CompletedAwaitingAcceptance
        );
        for o in &InputOutcome::ALL[1..] {
            assert_eq!(o.session_status().as_str(), o.as_str());
        }
    }

    #[test]
    fn retry_backoff_doubles_and_stops_at_the_maximum() {
        let p = RetryPolicy {
            max_attempts: 4,
            backoff_base_ms: 100,
            backoff_max_ms: 250,
        };
        assert_eq!(p.delay_before(2), Some(100));
        assert_eq!(p.delay_before(3), Some(200));
        assert_eq!(p.delay_before(4), Some(250));
        assert_eq!(p.delay_before(5), None);
    }

    #[test]
    fn tokens_have_prefixes_and_stable_hashes() {
        let t = new_token(TokenKind::Host);
        assert!(t.starts_with("agh_"));
        assert_eq!(hash_token(&t), hash_token(&t));
        assert_ne!(hash_token(&t), hash_token(&new_token(TokenKind::Host)));
    }

    #[test]
    fn task_status_follows_the_newest_attempt() {
        assert_eq!(task_status(None), "queued");
        assert_eq!(task_status(Some(AttemptStatus::Lost)), "failed");
        assert_eq!(task_status(Some(AttemptStatus::Running)), "running");
    }
}
