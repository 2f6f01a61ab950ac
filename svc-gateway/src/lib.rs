//! svc-gateway: the HTTP API, live event streams and the OpenAPI document.
//!
//! Architecture invariant: the gateway writes only the tables it owns (workspaces, api_tokens,
//! agents, agent_versions, runtime_profiles, pools, bindings, issues, comments, artifacts,
//! tasks); everything it asks of the scheduler goes over the bus.

pub mod api;
mod config;
mod error;
mod extract;
mod issue_writes;

pub use config::Config;

use agentscope_bus::Topology;
use agentscope_schemas::Message;
use agentscope_telemetry::health::{self, Metrics};
use anyhow::Context as _;
use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Clone)]
pub struct AppState {
    pub db: sqlx::PgPool,
    pub nats: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub config: Arc<Config>,
    pub metrics: Metrics,
    /// (attempt id, task id) of every event the recorder committed: wakes live streams.
    pub recorded: broadcast::Sender<(Uuid, Uuid)>,
    /// Live readers of followed attempts and tasks, shared by their SSE clients.
    pub feeds: api::events::Feeds,
    /// Fired when the gateway stops: live streams end (clients resume with `Last-Event-ID`).
    pub shutdown: CancellationToken,
}

pub struct App {
    state: AppState,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let db = agentscope_store::connect(&config.database_url, config.db_max_connections)
            .await
            .context("start svc-gateway")?;
        agentscope_store::migrate(&db).await?;
        let nats = config.nats.connect(&config.nats_url, "svc-gateway").await?;
        let js = async_nats::jetstream::new(nats.clone());
        Topology::tasks(&js).await?;
        let listener = tokio::net::TcpListener::bind(&config.http_addr)
            .await
            .with_context(|| format!("bind {}", config.http_addr))?;
        let addr = listener.local_addr()?;
        let (recorded, _) = broadcast::channel(4096);
        tracing::info!(%addr, "svc-gateway listening");
        Ok(App {
            state: AppState {
                db,
                nats,
                js,
                config: Arc::new(config),
                metrics: Metrics::default(),
                recorded,
                feeds: Default::default(),
                shutdown: CancellationToken::new(),
            },
            listener,
            addr,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let cancel = CancellationToken::new();
        let fanout = tokio::spawn(fan_out_recorded(self.state.clone(), cancel.clone()));
        let writes = tokio::spawn(issue_writes::serve(self.state.clone(), cancel.clone()));
        let app = router(self.state.clone());
        let c2 = cancel.clone();
        let streams = self.state.shutdown.clone();
        axum::serve(self.listener, app)
            .with_graceful_shutdown(async move {
                shutdown.await;
                // Live streams end now, so the graceful shutdown does not wait on them.
                streams.cancel();
                c2.cancel();
            })
            .await?;
        cancel.cancel();
        let _ = fanout.await;
        let _ = writes.await;
        let _ = self.state.nats.flush().await;
        tracing::info!("svc-gateway stopped");
        Ok(())
    }
}

/// Relays the recorder's commit notices to live SSE streams.
async fn fan_out_recorded(s: AppState, cancel: CancellationToken) {
    let mut sub = match s
        .nats
        .subscribe(agentscope_bus::subjects::RECORDED_ALL)
        .await
    {
        Ok(sub) => sub,
        Err(e) => {
            tracing::error!(error = %e, "subscribe to recorded notices; live streams fall back to polling");
            return;
        }
    };
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = sub.next() => match m { Some(m) => m, None => return },
        };
        if let Ok(n) = agentscope_schemas::v1::Recorded::decode(msg.payload.as_ref())
            && let (Ok(a), Ok(t)) = (Uuid::parse_str(&n.attempt_id), Uuid::parse_str(&n.task_id))
        {
            let _ = s.recorded.send((a, t));
        }
    }
}

pub fn router(state: AppState) -> Router {
    let routes = api::routes(&state.config);
    let doc = Arc::new(api::openapi(&routes));
    let mut r: Router<AppState> = Router::new();
    for route in routes {
        r = r.route(route.path, route.handler);
    }
    let probe_state = state.clone();
    let probe: health::Probe = Arc::new(move || {
        let s = probe_state.clone();
        Box::pin(async move {
            if s.nats.connection_state() != async_nats::connection::State::Connected {
                return Err("nats: not connected".into());
            }
            sqlx::query_scalar!("SELECT 1 AS one")
                .fetch_one(&s.db)
                .await
                .map_err(|e| format!("postgres: {e}"))?;
            Ok(())
        })
    });
    let metrics = state.metrics.clone();
    r.route(
        "/v1/openapi.json",
        axum::routing::get(move || {
            let doc = doc.clone();
            async move { axum::Json((*doc).clone()) }
        }),
    )
    .fallback(not_found)
    .method_not_allowed_fallback(method_not_allowed)
    .layer(axum::extract::DefaultBodyLimit::max(
        state.config.max_body_bytes,
    ))
    .layer(axum::middleware::from_fn(extract::refuse_nul_in_query))
    .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
    .with_state(state)
    .merge(health::router("svc-gateway", probe, metrics))
}

async fn not_found() -> Response {
    error::ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        "not_found",
        "no such route",
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    error::ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not accept that method",
    )
    .into_response()
}

/// A span per request and request counters by route and status.
async fn observe(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let span = tracing::info_span!("http", %method, %route, workspace_id = tracing::field::Empty);
    let started = std::time::Instant::now();
    let res = tracing::Instrument::instrument(next.run(req), span.clone()).await;
    let status = res.status().as_u16().to_string();
    s.metrics.inc(
        "agentscope_http_requests_total",
        &[("method", &method), ("route", &route), ("status", &status)],
    );
    s.metrics.add(
        "agentscope_http_request_duration_ms_total",
        &[("route", &route)],
        started.elapsed().as_millis() as u64,
    );
    span.in_scope(|| tracing::debug!(%status, "request done"));
    res
}
