use serde::Deserialize;

/// svc-scheduler settings: defaults for one machine, then the file named by AGENTSCOPE_CONFIG,
/// then AGENTSCOPE_* environment variables (e.g. AGENTSCOPE_LEASE_TTL_MS).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
    /// Its NATS user, password and whether an open NATS is accepted.
    #[serde(flatten)]
    pub nats: agentscope_bus::ServiceNats,
    /// The auth callout issuer's account seed (`SA...`; AGENTSCOPE_NATS_CALLOUT_SEED or
    /// AGENTSCOPE_NATS_CALLOUT_SEED_FILE): when set, this scheduler lets hosts and workers into
    /// NATS with permissions for their own subjects only.
    #[serde(default)]
    pub nats_callout_seed: Option<String>,
    #[serde(default)]
    pub nats_callout_seed_file: Option<String>,
    pub database_url: String,
    /// Health, readiness and metrics listener; port 0 picks a free port.
    pub health_addr: String,
    /// A lease not renewed for this long expires and its Attempt is lost.
    pub lease_ttl_ms: u64,
    /// A host whose heartbeat is older than this is offline.
    pub heartbeat_ttl_ms: u64,
    /// How often expired leases and unscheduled tasks are swept.
    pub sweep_interval_ms: u64,
    pub db_max_connections: u32,
    /// Connections of the claims' own pool (besides `db_max_connections`). Each backend
    /// compiles the claim function and plans each statement on its first calls (3.6 ms, then
    /// about 1.2 ms for the next five, 0.6 ms after that, measured here): hot paths that spread
    /// over a large pool keep paying for that, and on colder caches.
    pub db_claim_connections: u32,
    /// Connections of the recorder's own pool: one per worker.
    pub db_recorder_connections: u32,
    /// The recorder's workers, each recording its share of the attempts (by subject) one batch
    /// per transaction; by default one per core of this machine, two to four: more workers than
    /// the cores that run them only cut the same events into more, smaller transactions
    /// (docs/BENCHMARKS.md, session 36).
    pub recorder_workers: usize,
    /// Deliveries of one stream message before a consumer gives up on it and records it in
    /// `rejected_messages` (also the consumers' JetStream `max_deliver`). Transient failures
    /// are redelivered after a delay that doubles up to `redelivery_max_ms`, so the default
    /// rides out an outage of well over an hour.
    pub max_deliver: i64,
    /// The longest delay between two deliveries of a message that failed transiently.
    pub redelivery_max_ms: u64,
    /// The run timeout of an attempt whose task and runtime profile set none (seconds).
    pub run_timeout_secs: u64,
    #[serde(default)]
    pub log_format: String,
}

impl Config {
    pub fn load() -> Result<Self, config::ConfigError> {
        let config: Config = agentscope_telemetry::config::load(&[
            ("nats_url", "nats://127.0.0.1:4222".into()),
            (
                "database_url",
                "postgres://postgres@127.0.0.1:5432/agentscope".into(),
            ),
            ("health_addr", "127.0.0.1:8081".into()),
            ("lease_ttl_ms", 30_000.into()),
            ("heartbeat_ttl_ms", 10_000.into()),
            ("sweep_interval_ms", 1_000.into()),
            ("db_max_connections", 16.into()),
            ("db_claim_connections", 8.into()),
            ("db_recorder_connections", 4.into()),
            (
                "recorder_workers",
                (agentscope_telemetry::config::per_core(2, 4) as u64).into(),
            ),
            ("max_deliver", 1_000.into()),
            ("redelivery_max_ms", 10_000.into()),
            (
                "run_timeout_secs",
                agentscope_store::first_attempt::DEFAULT_RUN_TIMEOUT_SECS.into(),
            ),
            ("log_format", "".into()),
        ])?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), config::ConfigError> {
        let bad = |m: &str| Err(config::ConfigError::Message(m.to_string()));
        if self.lease_ttl_ms < 1_000 {
            return bad("lease_ttl_ms must be at least 1000");
        }
        if self.heartbeat_ttl_ms < 1_000 {
            return bad("heartbeat_ttl_ms must be at least 1000");
        }
        if self.sweep_interval_ms == 0 || self.sweep_interval_ms > self.lease_ttl_ms {
            return bad("sweep_interval_ms must be between 1 and lease_ttl_ms");
        }
        if self.recorder_workers == 0 || self.recorder_workers > 64 {
            return bad("recorder_workers must be between 1 and 64");
        }
        if self.max_deliver < 2 {
            return bad("max_deliver must be at least 2");
        }
        if self.run_timeout_secs == 0 || self.run_timeout_secs > u32::MAX as u64 {
            return bad("run_timeout_secs must be between 1 and 4294967295");
        }
        if self.redelivery_max_ms == 0 {
            return bad("redelivery_max_ms must be positive");
        }
        if self.db_max_connections == 0 {
            return bad("db_max_connections must be positive");
        }
        if self.db_claim_connections == 0 || self.db_recorder_connections == 0 {
            return bad("db_claim_connections and db_recorder_connections must be positive");
        }
        Ok(())
    }
}
