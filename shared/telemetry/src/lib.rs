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
