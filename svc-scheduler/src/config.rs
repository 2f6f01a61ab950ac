use serde::Deserialize;

/// svc-scheduler settings: defaults for one machine, then the file named by AGENTSCOPE_CONFIG,
/// then AGENTSCOPE_* environment variables (e.g. AGENTSCOPE_LEASE_TTL_MS).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
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
    #[serde(default)]
    pub log_format: String,
}

impl Config {
    pub fn load() -> Result<Self, config::ConfigError> {
        let mut builder = config::Config::builder()
            .set_default("nats_url", "nats://127.0.0.1:4222")?
            .set_default(
                "database_url",
                "postgres://postgres@127.0.0.1:5432/agentscope",
            )?
            .set_default("health_addr", "127.0.0.1:8081")?
            .set_default("lease_ttl_ms", 15_000)?
            .set_default("heartbeat_ttl_ms", 10_000)?
            .set_default("sweep_interval_ms", 1_000)?
            .set_default("db_max_connections", 16)?
            .set_default("log_format", "")?;
        if let Ok(path) = std::env::var("AGENTSCOPE_CONFIG") {
            builder = builder.add_source(config::File::with_name(&path));
        }
        let config: Config = builder
            .add_source(config::Environment::with_prefix("AGENTSCOPE").try_parsing(true))
            .build()?
            .try_deserialize()?;
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
        if self.db_max_connections == 0 {
            return bad("db_max_connections must be positive");
        }
        Ok(())
    }
}
