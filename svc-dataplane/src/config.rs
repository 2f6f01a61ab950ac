use serde::Deserialize;

/// svc-dataplane settings: defaults, then the file named by AGENTSCOPE_CONFIG, then AGENTSCOPE_*
/// environment variables (e.g. AGENTSCOPE_HEALTH_ADDR).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
    /// Its NATS user, password and whether an open NATS is accepted.
    #[serde(flatten)]
    pub nats: agentscope_bus::ServiceNats,
    pub database_url: String,
    /// Health, readiness and metrics listener; port 0 picks a free port.
    pub health_addr: String,
    pub db_max_connections: u32,
    #[serde(default)]
    pub log_format: String,
    /// This replica's name in session state and logs; empty: `<hostname>-<pid>`.
    pub replica_id: String,
    /// Where session directories live (`local` and `sandbox` environments).
    pub sessions_dir: String,
    /// Shared storage every replica mounts, for `remote` sessions; empty: `<sessions_dir>/remote`.
    pub remote_dir: String,
    /// A session lease vanishes this long after its holder's last renewal.
    pub session_lease_ttl_ms: u64,
    /// How often a replica looks for sessions with work and no live lease.
    pub sweep_interval_ms: u64,
    /// Model API of the Harness: anthropic, openai_chat or openai_responses.
    pub model_api: String,
    /// The model server's root URL (without /v1).
    pub model_base_url: String,
    /// Credential for the model server; never logged, never in an event.
    pub model_api_key: agentscope_domain::vault::SecretString,
    /// Vault keys (`id:hex32,...`), to open tool credentials when a tool runs.
    pub vault_keys: agentscope_domain::vault::SecretString,
    /// The model when the agent version names none.
    pub model_default: String,
    pub model_stream: bool,
    pub model_max_retries: u32,
    /// bubblewrap, for the `sandbox` environment.
    pub bwrap_path: String,
    /// The uids (and gids) of sessions, `first-last`: each session gets its own.
    pub session_uids: String,
    /// `local` and `remote` run tools unsandboxed on this machine: refused unless true (a
    /// trusted single-user install).
    pub allow_local_environment: bool,
    /// A delegated cgroup v2 directory for per-call limits; empty: detect; `off`: rlimits.
    pub sandbox_cgroup: String,
    /// Extra read-only directories in the sandbox (comma-separated absolute paths).
    pub sandbox_ro_paths: String,
    /// Process limit of a session's shell (pids.max or RLIMIT_NPROC of its uid).
    pub session_max_processes: u32,
    /// Memory limit of a session's shell in MiB (memory.max or RLIMIT_AS).
    pub session_memory_mb: u64,
    /// CPU seconds of each process of a session's shell (RLIMIT_CPU); 0: none.
    pub session_cpu_secs: u64,
    /// Backend of the `sandbox` environment: `bubblewrap` (local, no internet needed) or `e2b`.
    pub sandbox_backend: String,
    pub e2b_api_url: String,
    pub e2b_api_key: agentscope_domain::vault::SecretString,
    pub e2b_template: String,
    pub e2b_domain: String,
    pub shell_timeout_secs: u64,
    /// A self-hosted Worker without a heartbeat for this long is offline.
    pub worker_ttl_ms: u64,
}

impl Config {
    pub fn load() -> Result<Self, config::ConfigError> {
        let config: Config = agentscope_telemetry::config::load(&[
            ("nats_url", "nats://127.0.0.1:4222".into()),
            (
                "database_url",
                "postgres://postgres@127.0.0.1:5432/agentscope".into(),
            ),
            ("health_addr", "127.0.0.1:8082".into()),
            ("db_max_connections", 8.into()),
            ("log_format", "".into()),
            ("replica_id", "".into()),
            ("sessions_dir", "/var/lib/agentscope/sessions".into()),
            ("remote_dir", "".into()),
            ("session_lease_ttl_ms", 30_000.into()),
            ("sweep_interval_ms", 1_000.into()),
            ("model_api", "anthropic".into()),
            ("model_base_url", "https://api.anthropic.com".into()),
            ("model_api_key", "".into()),
            ("vault_keys", "".into()),
            ("model_default", "claude-sonnet-4-5".into()),
            ("model_stream", true.into()),
            ("model_max_retries", 3.into()),
            ("bwrap_path", "/usr/bin/bwrap".into()),
            ("session_uids", "700000-765535".into()),
            ("allow_local_environment", false.into()),
            ("sandbox_cgroup", "".into()),
            ("sandbox_ro_paths", "".into()),
            ("session_max_processes", 256.into()),
            ("session_memory_mb", 2048.into()),
            ("session_cpu_secs", 600.into()),
            ("sandbox_backend", "bubblewrap".into()),
            ("e2b_api_url", "https://api.e2b.app".into()),
            ("e2b_api_key", "".into()),
            ("e2b_template", "base".into()),
            ("e2b_domain", "e2b.app".into()),
            ("shell_timeout_secs", 300.into()),
            ("worker_ttl_ms", 3_000.into()),
        ])?;
        if !["anthropic", "openai_chat", "openai_responses"].contains(&config.model_api.as_str()) {
            return Err(config::ConfigError::Message(format!(
                "model_api must be anthropic, openai_chat or openai_responses, not `{}`",
                config.model_api
            )));
        }
        if let Err(e) = agentscope_domain::vault::Keyring::parse(&config.vault_keys.0) {
            return Err(config::ConfigError::Message(e.to_string()));
        }
        match (
            config.sandbox_backend.as_str(),
            config.e2b_api_key.0.is_empty(),
        ) {
            ("bubblewrap", _) | ("e2b", false) => {}
            ("e2b", true) => {
                return Err(config::ConfigError::Message(
                    "sandbox_backend e2b needs e2b_api_key".into(),
                ));
            }
            (other, _) => {
                return Err(config::ConfigError::Message(format!(
                    "sandbox_backend must be bubblewrap or e2b, not `{other}`"
                )));
            }
        }
        crate::env::UidRange::parse(&config.session_uids).map_err(config::ConfigError::Message)?;
        if config.session_max_processes < 8 || config.session_memory_mb < 16 {
            return Err(config::ConfigError::Message(
                "session_max_processes must be at least 8 and session_memory_mb at least 16".into(),
            ));
        }
        for path in config.ro_paths() {
            if !path.is_absolute() {
                return Err(config::ConfigError::Message(format!(
                    "sandbox_ro_paths entries must be absolute, not `{}`",
                    path.display()
                )));
            }
        }
        if config.session_lease_ttl_ms < 1_000 {
            return Err(config::ConfigError::Message(
                "session_lease_ttl_ms must be at least 1000".into(),
            ));
        }
        if config.db_max_connections == 0 {
            return Err(config::ConfigError::Message(
                "db_max_connections must be positive".into(),
            ));
        }
        Ok(config)
    }

    pub fn ro_paths(&self) -> Vec<std::path::PathBuf> {
        self.sandbox_ro_paths
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(std::path::PathBuf::from)
            .collect()
    }
}
