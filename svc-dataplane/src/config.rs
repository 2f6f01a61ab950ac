use serde::Deserialize;

/// svc-dataplane settings: defaults, then the file named by AGENTSCOPE_CONFIG, then AGENTSCOPE_*
/// environment variables (e.g. AGENTSCOPE_HEALTH_ADDR).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub nats_url: String,
    pub database_url: String,
    /// Health, readiness and metrics listener; port 0 picks a free port.
    pub health_addr: String,
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
            .set_default("health_addr", "127.0.0.1:8082")?
            .set_default("db_max_connections", 8)?
            .set_default("log_format", "")?;
        if let Ok(path) = std::env::var("AGENTSCOPE_CONFIG") {
            builder = builder.add_source(config::File::with_name(&path));
        }
        let config: Config = builder
            .add_source(config::Environment::with_prefix("AGENTSCOPE").try_parsing(true))
            .build()?
            .try_deserialize()?;
        if config.db_max_connections == 0 {
            return Err(config::ConfigError::Message(
                "db_max_connections must be positive".into(),
            ));
        }
        Ok(config)
    }
}
