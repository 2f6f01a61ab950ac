//! `/healthz`, `/readyz` and Prometheus `/metrics` for every service.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// A readiness probe: Ok, or the reason the service is not ready.
pub type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A probe from an async check.
pub fn probe<F, Fut>(check: F) -> Probe
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    Arc::new(move || Box::pin(check()))
}

/// The readiness of a service that needs NATS and PostgreSQL (the gateway, the scheduler, the
/// dataplane): its NATS connection is up and the database answers.
pub fn nats_and_postgres(nats: async_nats::Client, db: sqlx::PgPool) -> Probe {
    probe(move || {
        let (nats, db) = (nats.clone(), db.clone());
        async move {
            if nats.connection_state() != async_nats::connection::State::Connected {
                return Err("nats: not connected".into());
            }
            sqlx::query_scalar!("SELECT 1 AS one")
                .fetch_one(&db)
                .await
                .map_err(|e| format!("postgres: {e}"))?;
            Ok(())
        }
    })
}

/// Counters and gauges rendered in the Prometheus text format. Cheap to clone.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Mutex<BTreeMap<String, Arc<Metric>>>>,
}

#[derive(Default)]
struct Metric {
    counter: bool,
    value: AtomicU64,
    gauge: AtomicI64,
}

impl Metrics {
    fn get(&self, name: &str, labels: &[(&str, &str)], counter: bool) -> Arc<Metric> {
        let mut key = name.to_string();
        if !labels.is_empty() {
            key.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    key.push(',');
                }
                let v = v.replace('\\', "\\\\").replace('"', "\\\"");
                key.push_str(&format!("{k}=\"{v}\""));
            }
            key.push('}');
        }
        let mut map = self.inner.lock().expect("metrics lock");
        map.entry(key)
            .or_insert_with(|| {
                Arc::new(Metric {
                    counter,
                    ..Default::default()
                })
            })
            .clone()
    }

    pub fn inc(&self, name: &str, labels: &[(&str, &str)]) {
        self.add(name, labels, 1);
    }

    pub fn add(&self, name: &str, labels: &[(&str, &str)], n: u64) {
        self.get(name, labels, true)
            .value
            .fetch_add(n, Ordering::Relaxed);
    }

    pub fn set(&self, name: &str, labels: &[(&str, &str)], v: i64) {
        self.get(name, labels, false)
            .gauge
            .store(v, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let map = self.inner.lock().expect("metrics lock");
        let mut out = String::new();
        let mut typed = std::collections::BTreeSet::new();
        for (key, m) in map.iter() {
            let name = key.split('{').next().unwrap_or(key);
            if typed.insert(name.to_string()) {
                let kind = if m.counter { "counter" } else { "gauge" };
                out.push_str(&format!("# TYPE {name} {kind}\n"));
            }
            if m.counter {
                out.push_str(&format!("{key} {}\n", m.value.load(Ordering::Relaxed)));
            } else {
                out.push_str(&format!("{key} {}\n", m.gauge.load(Ordering::Relaxed)));
            }
        }
        out
    }
}

#[derive(Clone)]
struct HealthState {
    service: &'static str,
    probe: Probe,
    metrics: Metrics,
}

/// Routes for the health endpoints; the gateway merges them into its API router.
pub fn router<S: Clone + Send + Sync + 'static>(
    service: &'static str,
    probe: Probe,
    metrics: Metrics,
) -> Router<S> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(HealthState {
            service,
            probe,
            metrics,
        })
}

async fn healthz(State(s): State<HealthState>) -> impl IntoResponse {
    axum::Json(serde_json_lite(s.service, "ok", None))
}

async fn readyz(State(s): State<HealthState>) -> impl IntoResponse {
    match (s.probe)().await {
        Ok(()) => (
            StatusCode::OK,
            axum::Json(serde_json_lite(s.service, "ready", None)),
        ),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json_lite(s.service, "not_ready", Some(why))),
        ),
    }
}

async fn metrics_handler(State(s): State<HealthState>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

fn serde_json_lite(
    service: &str,
    status: &str,
    detail: Option<String>,
) -> std::collections::BTreeMap<&'static str, String> {
    let mut m = std::collections::BTreeMap::new();
    m.insert("service", service.to_string());
    m.insert("status", status.to_string());
    if let Some(d) = detail {
        m.insert("detail", d);
    }
    m
}

/// Bind `addr` (port 0 picks one) and serve the health routes until `cancel`.
pub async fn serve(
    addr: &str,
    service: &'static str,
    probe: Probe,
    metrics: Metrics,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app: Router = router(service, probe, metrics);
    let handle = tokio::spawn(async move {
        let _ = axum::serve(no_delay(listener), app)
            .with_graceful_shutdown(cancel.cancelled_owned())
            .await;
    });
    Ok((bound, handle))
}

/// `listener` with Nagle's algorithm off on every connection it accepts, so that a response, or
/// a frame of a live stream, leaves when it is written. With it on, a small write made while the
/// previous one is still unacknowledged waits for the peer's delayed acknowledgement (up to
/// 40 ms on Linux): a stream that writes an event every millisecond stalls for that long now and
/// then. axum's `serve` leaves the option as the socket has it (on).
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    fn set(tcp: &mut tokio::net::TcpStream) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "set TCP_NODELAY on an accepted connection");
        }
    }
    axum::serve::ListenerExt::tap_io(listener, set as fn(&mut tokio::net::TcpStream))
}

/// Resolves on the first SIGTERM or Ctrl-C; a second one exits the process at once.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown requested; a second signal exits at once");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        std::process::exit(130);
    });
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener as _;

    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = super::no_delay(listener);
        let client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, from) = listener.accept().await;
        assert_eq!(from, client.local_addr().unwrap());
        assert!(accepted.nodelay().unwrap(), "Nagle's algorithm is still on");
        // A plain listener leaves it on: the check above can fail.
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _c = tokio::net::TcpStream::connect(plain.local_addr().unwrap())
            .await
            .unwrap();
        let (s, _) = plain.accept().await.unwrap();
        assert!(!s.nodelay().unwrap());
    }
}
