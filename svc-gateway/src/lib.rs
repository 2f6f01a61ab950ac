//! svc-gateway: the HTTP API, live event streams and the OpenAPI document.
//!
//! Architecture invariant: the gateway writes only the tables it owns (workspaces, api_tokens,
//! agents, agent_versions, runtime_profiles, pools, bindings, issues, comments, artifacts,
//! tasks); everything it asks of the scheduler goes over the bus.

pub mod api;
mod batch;
mod config;
mod dispatch;
mod error;
mod extract;
mod issue_writes;
mod plans;

pub use config::Config;

use agentscope_bus::Topology;
use agentscope_schemas::Message;
use agentscope_telemetry::health::{self, Metrics};
use agentscope_telemetry::supervisor::{Policy, Supervisor, Work};
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

#[derive(Clone)]
pub struct AppState {
    /// The API's connections (`Config::db_max_connections`), each taken back without a round
    /// trip when its caller is done with it ([`agentscope_store::warm`]).
    pub db: agentscope_store::warm::Warm,
    /// The health probe's connection (migrations ran on it).
    pub health_db: sqlx::PgPool,
    /// Task submissions' own connections (`Config::db_submit_connections`).
    pub submit_db: agentscope_store::warm::Warm,
    pub nats: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    /// The lease bucket (the scheduler creates it), opened on the first direct dispatch.
    pub leases: Arc<tokio::sync::OnceCell<async_nats::jetstream::kv::Store>>,
    /// The pools a direct dispatch of this gateway is under way for (one at a time each).
    pub(crate) dispatching: dispatch::InFlight,
    /// Attempt plans kept per agent for submissions (checked where they are stored).
    pub(crate) plans: plans::Plans,
    /// Submissions queued up behind each other, stored in batches.
    pub(crate) batches: batch::Batches,
    pub config: Arc<Config>,
    pub metrics: Metrics,
    /// Every commit notice of the recorder (and of the scheduler's own ends): wakes live
    /// streams, and brings them the events it carries.
    pub recorded: broadcast::Sender<Arc<api::events::Notice>>,
    /// Live readers of followed attempts and tasks, shared by their SSE clients.
    pub feeds: api::events::Feeds,
    /// Fired when the gateway stops: live streams end (clients resume with `Last-Event-ID`).
    pub shutdown: CancellationToken,
    /// Where per-request tasks (live streams and their feeds, publish acknowledgements) are
    /// spawned: the gateway ends and awaits them at shutdown, within its grace period.
    pub work: Work,
}

pub struct App {
    state: AppState,
    sup: Supervisor,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

/// How long requests, live streams and the gateway's bus loops get to finish at shutdown.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let pool = agentscope_store::connect(&config.database_url, 1)
            .await
            .context("start svc-gateway")?;
        agentscope_store::migrate(&pool).await?;
        let db = agentscope_store::warm_sibling(&pool, config.db_max_connections);
        let submit_db = agentscope_store::warm_sibling(&pool, config.db_submit_connections);
        let nats = config.nats.connect(&config.nats_url, "svc-gateway").await?;
        let js = async_nats::jetstream::new(nats.clone());
        Topology::tasks(&js).await?;
        let listener = tokio::net::TcpListener::bind(&config.http_addr)
            .await
            .with_context(|| format!("bind {}", config.http_addr))?;
        let addr = listener.local_addr()?;
        let (recorded, _) = broadcast::channel(4096);
        tracing::info!(%addr, "svc-gateway listening");
        let sup = Supervisor::new("svc-gateway", CancellationToken::new(), STOP_GRACE);
        Ok(App {
            state: AppState {
                db,
                health_db: pool,
                submit_db,
                nats,
                js,
                leases: Default::default(),
                dispatching: Default::default(),
                plans: Default::default(),
                batches: batch::Batches::new(config.submit_batches),
                config: Arc::new(config),
                metrics: Metrics::default(),
                recorded,
                feeds: Default::default(),
                shutdown: sup.token(),
                work: sup.work(),
            },
            sup,
            listener,
            addr,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown` resolves (or the HTTP server fails), then stops: live streams
    /// end with a `shutdown` event, requests in hand finish, and every per-request task is
    /// awaited, all within the grace period.
    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App {
            state,
            mut sup,
            listener,
            ..
        } = self;
        let app = router(state.clone());
        sup.spawn_once("http", move |stop| async move {
            axum::serve(health::no_delay(listener), app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .context("serve HTTP")
        });
        // Both are restarted after a failure: without the first, live streams fall back to
        // polling; without the second, sessions' comments and Artifacts wait.
        let backoff = Policy::Restart {
            backoff: std::time::Duration::from_secs(1),
        };
        let s = state.clone();
        sup.spawn("recorded-fanout", backoff, move |stop| {
            fan_out_recorded(s.clone(), stop)
        });
        let s = state.clone();
        sup.spawn("issue-writes", backoff, move |stop| {
            issue_writes::serve(s.clone(), stop)
        });
        let res = sup.run(shutdown).await;
        let _ = state.nats.flush().await;
        tracing::info!("svc-gateway stopped");
        res
    }
}

/// Relays the recorder's commit notices to live SSE streams.
async fn fan_out_recorded(s: AppState, cancel: CancellationToken) -> anyhow::Result<()> {
    let mut sub = s
        .nats
        .subscribe(agentscope_bus::subjects::RECORDED_ALL)
        .await
        .context("subscribe to recorded notices; live streams fall back to polling")?;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            m = sub.next() => match m {
                Some(m) => m,
                None => anyhow::bail!("the subscription to recorded notices ended"),
            },
        };
        // Nothing follows a stream here: nothing to wake (a stream subscribes before its first
        // read, so it misses no notice of a commit after that read).
        if s.recorded.receiver_count() == 0 {
            continue;
        }
        if let Ok(n) = agentscope_schemas::v1::Recorded::decode(msg.payload.as_ref())
            && let Some(n) = api::events::Notice::of(n)
        {
            let _ = s.recorded.send(Arc::new(n));
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
    let probe = health::nats_and_postgres(state.nats.clone(), state.health_db.clone());
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
