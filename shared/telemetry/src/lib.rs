//! One `init` for every service: EnvFilter, human or JSON logs, optional OTLP trace export driven
//! by the standard `OTEL_*` variables.

pub mod config;
pub mod health;
pub mod supervisor;
pub mod throttle;

pub use throttle::{Suppressed, Throttle};

use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct Options {
    /// "json" for machine-readable lines, anything else for human output.
    #[serde(default)]
    pub log_format: String,
}

/// Flushes spans on drop; keep it alive until the service has stopped.
pub struct Guard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs the process's TLS crypto provider (ring, which async-nats already uses). HTTPS
/// clients (E2B, OTLP) need one; every binary calls this first, through [`init`] or directly.
pub fn install_tls_provider() {
    // A second install is refused, harmlessly.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub fn init(service: &'static str, options: &Options) -> anyhow::Result<Guard> {
    install_tls_provider();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = if options.log_format == "json" {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .boxed()
    };

    let mut provider = None;
    let otel = if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
        let p = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let tracer = p.tracer(service);
        provider = Some(p);
        Some(tracing_opentelemetry::layer().with_tracer(tracer))
    } else {
        None
    };

    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()?;
    Ok(Guard { provider })
}

/// A service's tokio runtime with `worker_threads` threads for its tasks: 1 runs them all on
/// the thread that calls `block_on` (no hand-over between threads: a message that arrives and
/// the work it starts stay on one CPU), 0 one thread per core. Blocking work goes to tokio's
/// blocking pool either way.
pub fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    if worker_threads == 1 {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
    }
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if worker_threads > 1 {
        b.worker_threads(worker_threads);
    }
    b.enable_all().build()
}

#[cfg(test)]
mod tests {
    use tokio::runtime::RuntimeFlavor;

    #[test]
    fn one_worker_thread_is_a_current_thread_runtime_and_zero_one_per_core() {
        let flavor = |n| super::runtime(n).unwrap().handle().runtime_flavor();
        assert_eq!(flavor(1), RuntimeFlavor::CurrentThread);
        assert_eq!(flavor(0), RuntimeFlavor::MultiThread);
        let two = super::runtime(2).unwrap();
        assert_eq!(two.handle().runtime_flavor(), RuntimeFlavor::MultiThread);
        assert_eq!(two.metrics().num_workers(), 2);
    }
}
