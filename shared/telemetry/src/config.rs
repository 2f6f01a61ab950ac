//! One way every service reads its settings: its defaults, then the TOML file named by
//! `AGENTSCOPE_CONFIG`, then `AGENTSCOPE_*` environment variables (`AGENTSCOPE_LEASE_TTL_MS`
//! sets `lease_ttl_ms`; values are parsed as numbers and booleans where they look like one).

pub use config::{ConfigError, Value};

/// The prefix of every service's environment variables.
pub const ENV_PREFIX: &str = "AGENTSCOPE";

/// The settings `T` from `defaults` (setting name, value), the configuration file and the
/// environment, in that order of precedence (the environment wins).
pub fn load<T: serde::de::DeserializeOwned>(defaults: &[(&str, Value)]) -> Result<T, ConfigError> {
    let mut builder = config::Config::builder();
    for (key, value) in defaults {
        builder = builder.set_default(*key, value.clone())?;
    }
    if let Ok(path) = std::env::var("AGENTSCOPE_CONFIG") {
        builder = builder.add_source(config::File::with_name(&path));
    }
    builder
        .add_source(config::Environment::with_prefix(ENV_PREFIX).try_parsing(true))
        .build()?
        .try_deserialize()
}

/// One per core of this machine, within `min..=max` (`min` when the count is unknown): the
/// default size of a service's pool of concurrent batches, where batches beyond the cores that
/// run them only cut the same work into more, smaller transactions (docs/BENCHMARKS.md,
/// session 36).
pub fn per_core(min: usize, max: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(min, |n| n.get())
        .clamp(min, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Settings {
        name: String,
        count: u32,
        on: bool,
        #[serde(default)]
        extra: Option<String>,
    }

    #[test]
    fn defaults_fill_what_the_environment_does_not_set() {
        // The variables are unique to this test, so parallel tests do not see them.
        let s: Settings = load(&[
            ("name", "x".into()),
            ("count", 3.into()),
            ("on", false.into()),
        ])
        .expect("defaults alone");
        assert_eq!(
            (s.name.as_str(), s.count, s.on, s.extra),
            ("x", 3, false, None)
        );
    }

    #[test]
    fn per_core_stays_within_its_bounds() {
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(per_core(1, 1024), cores);
        assert_eq!(per_core(2048, 4096), 2048);
        assert_eq!(per_core(1, 1), 1);
    }
}
