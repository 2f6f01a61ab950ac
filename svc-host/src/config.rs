use serde::Deserialize;

/// svc-host settings: defaults, then the file named by AGENTSCOPE_CONFIG, then AGENTSCOPE_*
/// environment variables (e.g. AGENTSCOPE_HOST_TOKEN, AGENTSCOPE_POOL, AGENTSCOPE_CAPACITY).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
    /// Accept a NATS server without authentication (a development install only). Otherwise the
    /// host connects as its host id with its host token, which the scheduler's auth callout
    /// checks.
    #[serde(default)]
    pub nats_allow_open: bool,
    /// Health listener (`/healthz`, `/readyz`, `/metrics`); port 0 picks a free port.
    pub health_addr: String,
    /// Identity, journal and task directories live here; keep it across restarts.
    pub state_dir: String,
    /// Registration secret from `POST /v1/host-tokens`.
    pub host_token: String,
    pub pool: String,
    /// Display name; defaults to the machine's hostname.
    #[serde(default)]
    pub name: String,
    pub capacity: u32,
    /// Comma-separated capabilities this host offers (e.g. "git,linux").
    #[serde(default)]
    pub capabilities: String,
    /// How often to ask for work when no nudge arrives.
    pub poll_interval_ms: u64,
    /// Grace between SIGTERM and SIGKILL on cancellation.
    pub kill_grace_ms: u64,
    /// Longest stdout/stderr line kept in one event; longer lines are truncated.
    pub max_line_bytes: usize,
    /// The API executors reach with their task credential (the gateway's address as seen from
    /// this host).
    pub api_url: String,
    /// How providers run: `auto` (each attempt under its own uid from `run_as_uids` when the
    /// host runs as root, else as the host's own user, with a warning at start-up) or `none`
    /// (never switch: providers run as the host's user, root included; a trusted single-user
    /// install only).
    pub run_as: String,
    /// The uids (and equal gids) attempts run under, `first-last`: at least `capacity` of them,
    /// used by nothing else on the machine.
    pub run_as_uids: String,
    /// Where hosts of this machine lock the uids they hand out (shared by every host of the
    /// machine, so that two hosts never give one uid to two running attempts).
    pub run_as_lock_dir: String,
    /// Comma-separated providers this host offers (each is discovered at start-up).
    pub providers: String,
    /// Directory holding the `agentscope` CLI executors use; default: next to svc-host.
    #[serde(default)]
    pub cli_dir: String,
    /// A provider's model connection errors in a row (its CLI retrying an endpoint that does not
    /// answer) that end the attempt as `model_unreachable`...
    pub model_retry_limit: u32,
    /// ...or the seconds since the first of them, whichever comes first.
    pub model_retry_secs: u64,
    /// How often a provider taken out of readiness (its login failed) is checked again.
    pub provider_recheck_ms: u64,
    /// How long an ended attempt's task directory is kept after its last change (a retry on
    /// this host continues the provider session from it) before the host removes it; at least 1.
    pub task_dir_retention_secs: u64,
    /// Threads of the host's async runtime: 1 (the default) runs its tasks on one thread, so an
    /// offer and the start of its provider never wait for a hand-over between threads (the
    /// journal's flushes, the /proc scans and the uid releases have threads of their own); 0 one
    /// per core.
    pub worker_threads: usize,
    /// How long an attempt's informational diagnostic (`preparing`, `cloned`, ...) waits for
    /// its next event to go out with it in one message (then one transaction of the recorder
    /// and one notice to live streams instead of two); 0 sends each at once.
    pub event_linger_ms: u64,
    #[serde(default)]
    pub log_format: String,
}

impl Config {
    pub fn load() -> Result<Self, config::ConfigError> {
        let config: Config = agentscope_telemetry::config::load(&[
            ("nats_url", "nats://127.0.0.1:4222".into()),
            ("health_addr", "127.0.0.1:8083".into()),
            ("state_dir", ".run/host".into()),
            ("host_token", "".into()),
            ("pool", "default".into()),
            ("capacity", 2.into()),
            ("poll_interval_ms", 2_000.into()),
            ("kill_grace_ms", 5_000.into()),
            ("max_line_bytes", (64 * 1024).into()),
            ("api_url", "http://127.0.0.1:8080".into()),
            (
                "providers",
                "command,claude-code,codex,opencode,openclaw".into(),
            ),
            ("run_as", "auto".into()),
            ("run_as_uids", crate::isolation::DEFAULT_UID_RANGE.into()),
            ("run_as_lock_dir", "/run/agentscope/uids".into()),
            ("model_retry_limit", 3.into()),
            ("model_retry_secs", 60.into()),
            ("provider_recheck_ms", 60_000.into()),
            ("task_dir_retention_secs", (3 * 24 * 3600).into()),
            ("worker_threads", 1.into()),
            ("event_linger_ms", 5.into()),
            ("log_format", "".into()),
        ])?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), config::ConfigError> {
        let bad = |m: &str| Err(config::ConfigError::Message(m.to_string()));
        if !self.host_token.starts_with("agh_") {
            return bad(
                "host_token (AGENTSCOPE_HOST_TOKEN) must be a host token from POST /v1/host-tokens",
            );
        }
        if self.pool.is_empty() {
            return bad("pool must not be empty");
        }
        if self.capacity == 0 || self.capacity > 1024 {
            return bad("capacity must be between 1 and 1024");
        }
        if self.poll_interval_ms == 0 {
            return bad("poll_interval_ms must be positive");
        }
        if self.task_dir_retention_secs == 0 {
            return bad("task_dir_retention_secs must be at least 1");
        }
        if self.worker_threads > 256 {
            return bad("worker_threads must be between 0 (one per core) and 256");
        }
        for p in self.provider_list() {
            if agentscope_domain::Provider::parse(&p).is_none() {
                return Err(config::ConfigError::Message(format!(
                    "providers: unknown provider `{p}` (known: {})",
                    agentscope_domain::KNOWN_PROVIDERS.join(", ")
                )));
            }
        }
        match self.run_as.as_str() {
            "auto" | "none" => {}
            other => {
                return Err(config::ConfigError::Message(format!(
                    "run_as must be auto or none, not `{other}` (a named user shared by every \
                     attempt is no longer supported: attempts get their own uid from run_as_uids)"
                )));
            }
        }
        let range = crate::isolation::UidRange::parse(&self.run_as_uids)
            .map_err(config::ConfigError::Message)?;
        if range.len() < self.capacity {
            return Err(config::ConfigError::Message(format!(
                "run_as_uids holds {} uids, fewer than capacity {}",
                range.len(),
                self.capacity
            )));
        }
        if self.model_retry_limit == 0 {
            return bad("model_retry_limit must be positive");
        }
        if self.provider_recheck_ms == 0 {
            return bad("provider_recheck_ms must be positive");
        }
        if self.max_line_bytes < 1024 {
            return bad("max_line_bytes must be at least 1024");
        }
        Ok(())
    }

    pub fn provider_list(&self) -> Vec<String> {
        self.providers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn capability_list(&self) -> Vec<String> {
        self.capabilities
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Config;

    fn config(worker_threads: usize) -> Config {
        serde_json::from_value(serde_json::json!({
            "nats_url": "nats://127.0.0.1:4222",
            "health_addr": "127.0.0.1:0",
            "state_dir": "/tmp/state",
            "host_token": "agh_x",
            "pool": "default",
            "capacity": 2,
            "poll_interval_ms": 2000,
            "kill_grace_ms": 5000,
            "max_line_bytes": 65536,
            "api_url": "http://127.0.0.1:8080",
            "run_as": "auto",
            "run_as_uids": crate::isolation::DEFAULT_UID_RANGE,
            "run_as_lock_dir": "/run/agentscope/uids",
            "providers": "command",
            "model_retry_limit": 3,
            "model_retry_secs": 60,
            "provider_recheck_ms": 60000,
            "task_dir_retention_secs": 60,
            "worker_threads": worker_threads,
            "event_linger_ms": 5,
        }))
        .unwrap()
    }

    #[test]
    fn worker_threads_run_from_zero_one_per_core_to_256() {
        for ok in [0, 1, 2, 256] {
            config(ok).validate().unwrap();
        }
        let e = config(257).validate().unwrap_err().to_string();
        assert!(e.contains("worker_threads"), "{e}");
    }
}
