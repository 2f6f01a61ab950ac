use serde::Deserialize;

/// svc-gateway settings: defaults, then the file named by AGENTSCOPE_CONFIG, then AGENTSCOPE_*
/// environment variables (e.g. AGENTSCOPE_HTTP_ADDR, AGENTSCOPE_ADMIN_TOKEN).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
    /// Its NATS user, password and whether an open NATS is accepted.
    #[serde(flatten)]
    pub nats: agentscope_bus::ServiceNats,
    pub database_url: String,
    /// API listener; port 0 picks a free port.
    pub http_addr: String,
    /// Secret for creating workspaces (`POST /v1/workspaces`). Empty disables that route.
    #[serde(default)]
    pub admin_token: String,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Largest Artifact an executor may upload.
    pub max_artifact_bytes: usize,
    /// A host whose last heartbeat is older than this shows as offline.
    pub host_offline_after_ms: u64,
    pub db_max_connections: u32,
    /// Connections of task submissions' own pool (besides `db_max_connections`): a backend
    /// plans each statement on its first runs, so the submission path, spread over the whole
    /// pool, would keep paying that warm-up.
    pub db_submit_connections: u32,
    /// Batches of queued submissions stored at once, at most (`batch.rs`); by default one per
    /// core of this machine, two to four: more batches than the cores that run them only cut the
    /// same submissions into more, smaller statements (docs/BENCHMARKS.md, session 36).
    pub submit_batches: usize,
    /// Direct dispatch: a stored task's attempt is claimed for an idle host of its pool and
    /// offered to it by the gateway itself (`dispatch.rs`); off, every new attempt waits for a
    /// host's claim through the scheduler.
    pub direct_dispatch: bool,
    /// The run timeout written into a spec that sets none when the attempt is claimed: the
    /// scheduler's `run_timeout_secs`, under the same name (`AGENTSCOPE_RUN_TIMEOUT_SECS`);
    /// give both services the same value.
    pub run_timeout_secs: u64,
    #[serde(default)]
    pub log_format: String,
    /// Vault keys, `id:hex32,...` (the first seals); empty: secrets cannot be stored.
    #[serde(default)]
    pub vault_keys: agentscope_domain::vault::SecretString,
    /// Managed sessions in the `local` and `remote` environments run tools unsandboxed on the
    /// dataplane's machine: refused (`environment_not_allowed`) unless true.
    #[serde(default)]
    pub allow_local_environment: bool,
}

impl Config {
    pub fn load() -> Result<Self, config::ConfigError> {
        let config: Config = agentscope_telemetry::config::load(&[
            ("nats_url", "nats://127.0.0.1:4222".into()),
            (
                "database_url",
                "postgres://postgres@127.0.0.1:5432/agentscope".into(),
            ),
            ("http_addr", "127.0.0.1:8080".into()),
            ("admin_token", "".into()),
            ("max_body_bytes", (1024 * 1024).into()),
            ("max_artifact_bytes", (10 * 1024 * 1024).into()),
            ("host_offline_after_ms", 10_000.into()),
            ("db_max_connections", 16.into()),
            ("db_submit_connections", 8.into()),
            (
                "submit_batches",
                (agentscope_telemetry::config::per_core(2, 4) as u64).into(),
            ),
            ("direct_dispatch", true.into()),
            (
                "run_timeout_secs",
                agentscope_store::first_attempt::DEFAULT_RUN_TIMEOUT_SECS.into(),
            ),
            ("log_format", "".into()),
            ("vault_keys", "".into()),
            ("allow_local_environment", false.into()),
        ])?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), config::ConfigError> {
        let bad = |m: &str| Err(config::ConfigError::Message(m.to_string()));
        if self.admin_token == "change-me-admin-token" {
            return Err(config::ConfigError::Message(
                "admin_token is the published default `change-me-admin-token`: set a random one"
                    .into(),
            ));
        }
        if !self.admin_token.is_empty() && self.admin_token.len() < 16 {
            return bad(
                "admin_token must be at least 16 characters (or empty to disable workspace creation)",
            );
        }
        if self.max_body_bytes < 1024 {
            return bad("max_body_bytes must be at least 1024");
        }
        if self.max_artifact_bytes < 1024 || self.max_artifact_bytes > 512 * 1024 * 1024 {
            return bad("max_artifact_bytes must be between 1024 and 536870912");
        }
        if self.db_max_connections == 0 || self.db_submit_connections == 0 {
            return bad("db_max_connections and db_submit_connections must be positive");
        }
        if self.submit_batches == 0 || self.submit_batches > 64 {
            return bad("submit_batches must be between 1 and 64");
        }
        if self.run_timeout_secs == 0 || self.run_timeout_secs > u32::MAX as u64 {
            return bad("run_timeout_secs must be between 1 and 4294967295");
        }
        if let Err(e) = agentscope_domain::vault::Keyring::parse(&self.vault_keys.0) {
            return bad(&e.to_string());
        }
        Ok(())
    }
}
