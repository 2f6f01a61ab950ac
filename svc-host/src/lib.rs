//! svc-host: the Runtime Host daemon. Registers a stable identity, reports presence and its three
//! checks, claims work under KV leases, runs providers in fresh task directories and reports
//! their events. Architecture invariant: the host talks only to NATS, never to Postgres.

pub mod attempt;
mod config;
pub mod isolation;
pub mod journal;
pub mod process;
pub mod provider;
pub mod providers;

pub use config::Config;

use agentscope_bus::{Topology, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{
    ClaimOffer, ClaimRequest, ExecutionEvent, HostCheck, HostCommand, HostHeartbeat,
    HostRegistered, HostRegistration, Lifecycle, ProviderDescriptor, execution_event::Body,
    host_command,
};
use agentscope_telemetry::health::{self, Metrics};
use agentscope_telemetry::supervisor::{Policy, Supervisor, Work};
use anyhow::Context as _;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::{FutureExt, StreamExt};
use provider::Adapter;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Everything the host's tasks share. Cheap to clone.
#[derive(Clone)]
pub struct Ctx {
    pub host_id: Uuid,
    pub config: Arc<Config>,
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    pub leases: jetstream::kv::Store,
    pub journal: journal::Journal,
    pub tasks_dir: PathBuf,
    /// The uids attempts run under, when the host runs as root (None: providers run as the
    /// host's own user).
    pub identities: Option<Arc<isolation::Identities>>,
    adapters: Arc<Vec<Box<dyn Adapter>>>,
    lease_ttl_ms: Arc<AtomicU64>,
    state: Arc<Mutex<State>>,
    /// Sends a heartbeat at once (a provider's readiness changed).
    beat: Arc<tokio::sync::Notify>,
    /// An attempt ended and freed its slot (the claim loop rejoins its pool's queue group).
    slot_freed: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct State {
    registered: Option<HostRegistered>,
    providers: Vec<ProviderDescriptor>,
    running: HashMap<String, attempt::Stops>,
    /// Where approval decisions for a running attempt go.
    decisions: HashMap<String, tokio::sync::mpsc::Sender<agentscope_schemas::v1::ApprovalDecision>>,
    /// Attempts of a previous run of this host, already reported as interrupted.
    reported: Vec<String>,
    /// Attempts this run finished recently (bounded), so none is ever taken for a lost offer.
    finished: std::collections::VecDeque<String>,
    /// Providers whose login failed in an attempt, and when: not ready until a re-check passes.
    login_failed: HashMap<String, std::time::Instant>,
}

impl Ctx {
    pub fn adapter(&self, name: &str) -> Option<&dyn Adapter> {
        self.adapters
            .iter()
            .find(|a| a.name() == name)
            .map(|a| a.as_ref())
    }
    fn cli_dir(&self) -> PathBuf {
        if self.config.cli_dir.is_empty() {
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|p| p.to_path_buf()))
                .unwrap_or_default()
        } else {
            PathBuf::from(&self.config.cli_dir)
        }
    }

    /// The `agentscope` CLI executors use (and whose `mcp` subcommand serves MCP).
    pub fn cli_path(&self) -> PathBuf {
        // Absolute: the translated instructions name it, and a login shell resets PATH.
        let p = self.cli_dir().join("agentscope");
        std::path::absolute(&p).unwrap_or(p)
    }

    /// What discovery found out about a provider.
    pub fn descriptor(&self, name: &str) -> Option<ProviderDescriptor> {
        self.state
            .lock()
            .expect("host state")
            .providers
            .iter()
            .find(|p| p.name == name)
            .cloned()
    }

    /// PATH for executors: the `agentscope` CLI's directory first.
    pub fn executor_path(&self) -> std::ffi::OsString {
        let cli_dir = self.cli_dir();
        let rest = std::env::var_os("PATH").unwrap_or_default();
        std::env::join_paths(std::iter::once(cli_dir).chain(std::env::split_paths(&rest)))
            .unwrap_or(rest)
    }

    /// A provider whose login failed in an attempt (`provider_login`): not ready on this host
    /// (discovery, dispatch readiness, and so claims) until a re-check passes (`recheck`).
    pub fn provider_login_failed(&self, name: &str, detail: &str) {
        let mut st = self.state.lock().expect("host state");
        let Some(p) = st.providers.iter_mut().find(|p| p.name == name) else {
            return;
        };
        p.logged_in = false;
        p.detail = format!(
            "its login failed in an attempt ({detail}); checked again every {} s",
            self.config.provider_recheck_ms.div_ceil(1000)
        );
        st.login_failed
            .insert(name.to_string(), std::time::Instant::now());
        drop(st);
        tracing::warn!(
            provider = name,
            detail,
            "provider login failed; not ready until a re-check passes"
        );
        self.beat.notify_one();
    }

    pub fn lease_ttl_ms(&self) -> u64 {
        self.lease_ttl_ms.load(Ordering::Relaxed)
    }

    /// The three separate checks: connectivity, provider discovery, dispatch readiness.
    fn checks(&self) -> Vec<HostCheck> {
        let now = agentscope_bus::now_ms();
        let st = self.state.lock().expect("host state");
        let connected = self.nats.connection_state() == async_nats::connection::State::Connected;
        let reg = st.registered.as_ref();
        let connectivity = HostCheck {
            name: "connectivity".into(),
            ok: connected && reg.is_some(),
            detail: match (connected, reg) {
                (false, _) => "not connected to NATS".into(),
                (true, None) => "connected; registration pending".into(),
                (true, Some(_)) => "connected and registered".into(),
            },
            checked_at_ms: now,
        };
        let ready: Vec<&str> = st
            .providers
            .iter()
            .filter(|p| p.installed && p.logged_in)
            .map(|p| p.name.as_str())
            .collect();
        let problems: Vec<String> = st
            .providers
            .iter()
            .filter(|p| !(p.installed && p.logged_in))
            .map(|p| format!("{}: {}", p.name, p.detail))
            .collect();
        let discovery = HostCheck {
            name: "provider_discovery".into(),
            ok: !ready.is_empty(),
            detail: if problems.is_empty() {
                format!("ready: {}", ready.join(", "))
            } else {
                format!(
                    "ready: {}; not ready: {}",
                    ready.join(", "),
                    problems.join("; ")
                )
            },
            checked_at_ms: now,
        };
        let pool_ok = reg.is_some_and(|r| !r.pool_id.is_empty());
        let dispatch = HostCheck {
            name: "dispatch_readiness".into(),
            ok: connectivity.ok && discovery.ok && pool_ok,
            detail: if !connectivity.ok {
                "not registered".into()
            } else if !pool_ok {
                format!(
                    "pool `{}` does not exist in this host's workspace",
                    self.config.pool
                )
            } else if !discovery.ok {
                "no provider is installed and logged in".into()
            } else {
                format!("accepting work for: {}", ready.join(", "))
            },
            checked_at_ms: now,
        };
        vec![connectivity, discovery, dispatch]
    }
}

pub struct App {
    ctx: Ctx,
    health_addr: SocketAddr,
    cancel: CancellationToken,
    health_task: tokio::task::JoinHandle<()>,
}

impl App {
    pub async fn build(mut config: Config) -> anyhow::Result<App> {
        let state_dir = PathBuf::from(&config.state_dir);
        let host_id = journal::identity(&state_dir).context("load host identity")?;
        let journal = journal::Journal::open(&state_dir)?;
        let tasks_dir = state_dir.join("tasks");
        std::fs::create_dir_all(&tasks_dir)
            .with_context(|| format!("create {}", tasks_dir.display()))?;
        isolation::secure_state(&state_dir, &tasks_dir).context("secure the state directory")?;
        let identities = identities(&config, host_id)?;
        if identities.is_some() && config.cli_dir.is_empty() {
            // Executors run under their own uids: the CLI they call must be reachable by them
            // wherever svc-host is installed (a build directory under a 0700 home is not).
            if let Some(dir) = isolation::publish_cli(&state_dir)
                .context("publish the agentscope CLI for executors")?
            {
                config.cli_dir = dir.to_string_lossy().into_owned();
            }
        }
        let sentinel = isolation::sentinel_path();
        anyhow::ensure!(
            sentinel.is_file(),
            "{} is missing: svc-host starts every provider through it (install it next to svc-host)",
            sentinel.display()
        );
        let nats = agentscope_bus::connect(
            &config.nats_url,
            "svc-host",
            &agentscope_bus::Credentials::Host {
                host_id: host_id.to_string(),
                token: config.host_token.clone(),
            },
            config.nats_allow_open,
        )
        .await?;
        let js = jetstream::new(nats.clone());
        let leases = Topology::open_bucket(&js, agentscope_bus::BUCKET_LEASES).await?;
        let adapters: Vec<Box<dyn Adapter>> = config
            .provider_list()
            .iter()
            .filter_map(|p| agentscope_domain::Provider::parse(p))
            .map(providers::adapter)
            .collect();
        let ctx = Ctx {
            host_id,
            config: Arc::new(config),
            nats,
            js,
            leases,
            journal,
            tasks_dir,
            identities,
            adapters: Arc::new(adapters),
            lease_ttl_ms: Arc::new(AtomicU64::new(15_000)),
            state: Arc::new(Mutex::new(State::default())),
            beat: Arc::new(tokio::sync::Notify::new()),
            slot_freed: Arc::new(tokio::sync::Notify::new()),
        };
        discover(&ctx).await;
        let cancel = CancellationToken::new();
        let probe_ctx = ctx.clone();
        let probe: health::Probe = Arc::new(move || {
            let ctx = probe_ctx.clone();
            Box::pin(async move {
                let checks = ctx.checks();
                match checks.iter().find(|c| !c.ok) {
                    None => Ok(()),
                    Some(c) => Err(format!("{}: {}", c.name, c.detail)),
                }
            })
        });
        let (health_addr, health_task) = health::serve(
            &ctx.config.health_addr,
            "svc-host",
            probe,
            Metrics::default(),
            cancel.clone(),
        )
        .await
        .with_context(|| format!("bind health listener {}", ctx.config.health_addr))?;
        tracing::info!(%host_id, %health_addr, "svc-host started");
        Ok(App {
            ctx,
            health_addr,
            cancel,
            health_task,
        })
    }

    pub fn host_id(&self) -> Uuid {
        self.ctx.host_id
    }
    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let ctx = self.ctx.clone();
        let cancel = self.cancel.clone();
        let registered = register(&ctx, &cancel).await?;
        let resumed = recover(&ctx).await;
        let slots = Arc::new(Semaphore::new(ctx.config.capacity as usize));
        // Attempts are work: at shutdown each one's `shutdown` stop fires, it stops its provider
        // (the kill grace) and reports a retryable end before the host leaves.
        let mut sup = Supervisor::new(
            "svc-host",
            cancel.clone(),
            Duration::from_millis(ctx.config.kill_grace_ms + 10_000),
        );
        let attempts = sup.work();
        for (a, entry) in resumed {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => spawn_attempt(&ctx, &attempts, a, permit, Some(entry)),
                Err(_) => {
                    tracing::error!(attempt_id = %a.attempt_id, "no capacity left to resume; its lease will lapse")
                }
            }
        }
        // The host cannot do its job without any of these: the end of one stops the host.
        {
            let (ctx, slots) = (ctx.clone(), slots.clone());
            sup.spawn("heartbeat", Policy::Critical, move |stop| {
                heartbeat(ctx.clone(), slots.clone(), stop)
            });
        }
        {
            let ctx = ctx.clone();
            sup.spawn("control", Policy::Critical, move |stop| {
                control(ctx.clone(), stop)
            });
        }
        {
            let ctx = ctx.clone();
            sup.spawn("recheck", Policy::Critical, move |stop| {
                recheck(ctx.clone(), stop)
            });
        }
        {
            let (ctx, slots, attempts) = (ctx.clone(), slots.clone(), attempts.clone());
            let pool_id = registered.pool_id.clone();
            sup.spawn("claim_loop", Policy::Critical, move |stop| {
                claim_loop(
                    ctx.clone(),
                    pool_id.clone(),
                    slots.clone(),
                    attempts.clone(),
                    stop,
                )
            });
        }
        let result = sup.run(shutdown).await;
        let _ = ctx.nats.flush().await;
        let _ = self.health_task.await;
        tracing::info!("svc-host stopped");
        result
    }
}

/// Per-attempt uids when the host runs as root and `run_as` is `auto`; otherwise providers run
/// as the host's own user, which is said once at start-up.
fn identities(
    config: &Config,
    host_id: Uuid,
) -> anyhow::Result<Option<Arc<isolation::Identities>>> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if config.run_as == "none" {
        tracing::warn!(
            root,
            "run_as = none: providers run as the host's own user, with access to everything it can reach; tasks are not isolated from each other"
        );
        return Ok(None);
    }
    if !root {
        tracing::warn!(
            "the host does not run as root and cannot switch uid: providers run as the host's own user; tasks on this host are not isolated from each other"
        );
        return Ok(None);
    }
    let range = isolation::UidRange::parse(&config.run_as_uids).map_err(anyhow::Error::msg)?;
    let ids = isolation::Identities::open(
        range,
        std::path::Path::new(&config.run_as_lock_dir),
        host_id.as_u128() as u32,
    )
    .context("open the uid locks")?;
    tracing::info!(
        first = range.first,
        last = range.last,
        "each attempt runs under its own uid"
    );
    Ok(Some(Arc::new(ids)))
}

/// Provider discovery: each adapter probes its CLI (installed, version, credentials).
async fn discover(ctx: &Ctx) {
    let adapters = ctx.adapters.clone();
    let found = tokio::task::spawn_blocking(move || {
        adapters
            .iter()
            .map(|a| a.discover())
            .collect::<Vec<ProviderDescriptor>>()
    })
    .await
    .unwrap_or_default();
    for p in &found {
        tracing::info!(provider = %p.name, installed = p.installed, logged_in = p.logged_in, version = %p.version, detail = %p.detail, "provider discovered");
    }
    ctx.state.lock().expect("host state").providers = found;
}

fn registration(ctx: &Ctx) -> HostRegistration {
    let st = ctx.state.lock().expect("host state");
    let name = if ctx.config.name.is_empty() {
        std::fs::read_to_string("/etc/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "host".into())
    } else {
        ctx.config.name.clone()
    };
    HostRegistration {
        host_id: ctx.host_id.to_string(),
        host_token: ctx.config.host_token.clone(),
        name,
        pool: ctx.config.pool.clone(),
        providers: st.providers.clone(),
        capacity: ctx.config.capacity,
        capabilities: ctx.config.capability_list(),
        version: env!("CARGO_PKG_VERSION").into(),
        checks: vec![],
    }
}

/// Registers until the scheduler answers; a refusal (bad token, id conflict) is fatal.
async fn register(ctx: &Ctx, cancel: &CancellationToken) -> anyhow::Result<HostRegistered> {
    let mut delay = Duration::from_millis(200);
    loop {
        let mut reg = registration(ctx);
        reg.checks = ctx.checks();
        let res = tokio::time::timeout(
            Duration::from_secs(5),
            ctx.nats.request(
                subjects::host_register(&ctx.host_id.to_string()),
                reg.encode_to_vec().into(),
            ),
        )
        .await;
        match res {
            Ok(Ok(msg)) => {
                let r = HostRegistered::decode(msg.payload.as_ref())
                    .context("decode registration reply")?;
                if !r.ok {
                    anyhow::bail!("registration refused: {} ({})", r.message, r.error_code);
                }
                ctx.lease_ttl_ms
                    .store(r.lease_ttl_ms.max(1000), Ordering::Relaxed);
                tracing::info!(host_id = %ctx.host_id, workspace_id = %r.workspace_id, pool_id = %r.pool_id, "registered");
                ctx.state.lock().expect("host state").registered = Some(r.clone());
                return Ok(r);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "registration: no scheduler answered; retrying")
            }
            Err(_) => tracing::warn!("registration timed out; retrying"),
        }
        tokio::select! {
            _ = cancel.cancelled() => anyhow::bail!("stopped before registration"),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Attempts journaled by a previous run of this host whose process is gone: report them ended
/// with `host_restart`, under their old fencing token. If the lease is gone the recorder refuses
/// the report and nothing changes; if it still holds, the scheduler retries the task.
async fn recover(ctx: &Ctx) -> Vec<(attempt::Assignment, journal::Entry)> {
    let entries = match ctx.journal.entries() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = ?e, "read journal");
            return vec![];
        }
    };
    let mut resume = Vec::new();
    for mut e in entries {
        // The provider the previous run started may have outlived it.
        process::kill_marked(&format!("AGENTSCOPE_ATTEMPT_ID={}", e.attempt_id)).await;
        e.last_seq = e.last_seq.max(published_seq(ctx, &e.attempt_id).await);
        if let Some(a) = resumable(ctx, &e).await {
            tracing::warn!(attempt_id = %e.attempt_id, session = %e.provider_session_id, "attempt interrupted by a host restart; resuming its provider session");
            resume.push((a, e));
            continue;
        }
        tracing::warn!(attempt_id = %e.attempt_id, lease_token = e.lease_token, "attempt interrupted by a host restart; recovery conditions do not hold");
        let ev = ExecutionEvent {
            attempt_id: e.attempt_id.clone(),
            seq: e.last_seq + 1,
            lease_token: e.lease_token,
            host_id: ctx.host_id.to_string(),
            at_ms: agentscope_bus::now_ms(),
            body: Some(Body::Lifecycle(Lifecycle {
                state: attempt::wire_state(agentscope_domain::AttemptStatus::Failed) as i32,
                failure_class: agentscope_domain::FailureClass::HostRestart.as_str().into(),
                detail: "the host restarted while the attempt ran".into(),
                exit_code: 0,
                has_exit_code: false,
            })),
        };
        let msg_id = format!("{}:{}", e.attempt_id, ev.seq);
        let sent = async {
            ctx.js
                .publish_with_headers(
                    subjects::events(&ctx.host_id.to_string(), &e.attempt_id),
                    agentscope_bus::headers(&msg_id),
                    ev.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        ctx.state
            .lock()
            .expect("host state")
            .reported
            .push(e.attempt_id.clone());
        match sent {
            Ok(_) => {
                let _ = ctx.journal.remove(&e.attempt_id);
            }
            Err(err) => tracing::warn!(error = %err, "report interrupted attempt; kept in journal"),
        }
    }
    resume
}

/// Runs an attempt as work of the host's supervisor, holding `permit` (a capacity slot) until it
/// ends. Its `shutdown` stop fires when the host begins to stop.
fn spawn_attempt(
    ctx: &Ctx,
    attempts: &Work,
    a: attempt::Assignment,
    permit: tokio::sync::OwnedSemaphorePermit,
    resume: Option<journal::Entry>,
) {
    let stops = attempt::Stops {
        cancel: CancellationToken::new(),
        lease_lost: CancellationToken::new(),
        shutdown: attempts.stopping().child_token(),
    };
    let (dtx, drx) = tokio::sync::mpsc::channel(64);
    {
        let mut st = ctx.state.lock().expect("host state");
        st.running.insert(a.attempt_id.clone(), stops.clone());
        st.decisions.insert(a.attempt_id.clone(), dtx);
    }
    let ctx = ctx.clone();
    attempts.spawn(async move {
        let id = a.attempt_id.clone();
        attempt::run(ctx.clone(), a, stops, drx, resume).await;
        {
            let mut st = ctx.state.lock().expect("host state");
            st.running.remove(&id);
            st.decisions.remove(&id);
            st.finished.push_back(id);
            if st.finished.len() > 256 {
                st.finished.pop_front();
            }
        }
        drop(permit);
        // A slot is free: claim it at once if work waits (the claim lists this attempt as
        // ended, so the scheduler does not count it even before it records the end), and
        // listen for nudges again.
        ctx.slot_freed.notify_one();
    });
}

/// Whether a journaled attempt can resume here after a host restart: the provider resumes, its
/// session exists in the task directory, the lease is still this host's, and the restart is
/// within the window.
/// Returns the assignment with the lease's current revision.
async fn resumable(ctx: &Ctx, e: &journal::Entry) -> Option<attempt::Assignment> {
    let bytes = hex::decode(&e.assignment_hex).ok()?;
    let mut a: attempt::Assignment =
        agentscope_schemas::v1::AttemptAssignment::decode(bytes.as_slice())
            .ok()?
            .into();
    if e.provider_session_id.is_empty()
        || agentscope_bus::now_ms() - e.saved_at_ms > RESUME_WINDOW_MS
    {
        return None;
    }
    let adapter = ctx.adapter(&e.provider)?;
    if !ctx
        .descriptor(&e.provider)
        .is_some_and(|d| d.resume && d.installed && d.logged_in)
    {
        return None;
    }
    if !adapter.session_exists(&attempt::existing_task_dir(ctx, &a), &e.provider_session_id) {
        return None;
    }
    let lease = ctx.leases.entry(&e.lease_key).await.ok()??;
    if lease.operation != async_nats::jetstream::kv::Operation::Put {
        return None;
    }
    let holder = agentscope_schemas::v1::LeaseRecord::decode(lease.value.as_ref()).ok()?;
    // The scheduler writes token 0 at creation; renewals write the fencing token.
    if holder.host_id != ctx.host_id.to_string()
        || (holder.token != 0 && holder.token != e.lease_token)
    {
        return None;
    }
    a.lease_revision = lease.revision;
    Some(a)
}

/// How long after its last checkpoint an interrupted attempt may still resume.
const RESUME_WINDOW_MS: i64 = 10 * 60 * 1000;

/// The work nudges of a pool of this host's workspace.
fn nudge_subject(ctx: &Ctx, pool_id: &str) -> String {
    let ws = ctx
        .state
        .lock()
        .expect("host state")
        .registered
        .as_ref()
        .map(|r| r.workspace_id.clone())
        .unwrap_or_default();
    subjects::pool_work(&ws, pool_id)
}

/// The newest event seq of an attempt in the stream (the journal may lag it by one).
async fn published_seq(ctx: &Ctx, attempt_id: &str) -> u64 {
    let Ok(stream) = ctx.js.get_stream(agentscope_bus::STREAM_EVENTS).await else {
        return 0;
    };
    match stream
        .direct_get_last_for_subject(subjects::events(&ctx.host_id.to_string(), attempt_id))
        .await
    {
        Ok(m) => ExecutionEvent::decode(m.payload.as_ref())
            .map(|e| e.seq)
            .unwrap_or(0),
        Err(_) => 0,
    }
}

async fn heartbeat(
    ctx: Ctx,
    slots: Arc<Semaphore>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let presence = Topology::open_bucket(&ctx.js, agentscope_bus::BUCKET_PRESENCE).await?;
    let key = agentscope_bus::presence_key(&ctx.host_id.to_string());
    let every = Duration::from_millis(1000);
    loop {
        let providers = ctx.state.lock().expect("host state").providers.clone();
        let hb = HostHeartbeat {
            host_id: ctx.host_id.to_string(),
            running: ctx.config.capacity - slots.available_permits() as u32,
            capacity: ctx.config.capacity,
            checks: ctx.checks(),
            sent_at_ms: agentscope_bus::now_ms(),
            providers,
        };
        if let Err(e) = presence.put(&key, hb.encode_to_vec().into()).await {
            tracing::warn!(error = %e, "heartbeat");
        }
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = presence.purge(&key).await;
                return Ok(());
            }
            _ = tokio::time::sleep(every) => {}
            _ = ctx.beat.notified() => {}
        }
    }
}

/// Re-checks providers whose login failed, each `provider_recheck_ms` after its failure (or its
/// last re-check): discovery again (installed, version, credentials present). One that passes is
/// ready again; the next heartbeat says so.
async fn recheck(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let every = Duration::from_millis(ctx.config.provider_recheck_ms);
    let tick = every.min(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(tick) => {}
        }
        let due: Vec<String> = {
            let st = ctx.state.lock().expect("host state");
            st.login_failed
                .iter()
                .filter(|(_, at)| at.elapsed() >= every)
                .map(|(n, _)| n.clone())
                .collect()
        };
        for name in due {
            let adapters = ctx.adapters.clone();
            let wanted = name.clone();
            let found = tokio::task::spawn_blocking(move || {
                adapters
                    .iter()
                    .find(|a| a.name() == wanted)
                    .map(|a| a.discover())
            })
            .await
            .ok()
            .flatten();
            let Some(d) = found else { continue };
            let mut st = ctx.state.lock().expect("host state");
            if d.installed && d.logged_in {
                tracing::info!(provider = %name, "provider re-check passed; ready again");
                st.login_failed.remove(&name);
                if let Some(p) = st.providers.iter_mut().find(|p| p.name == name) {
                    *p = d;
                }
                drop(st);
                ctx.beat.notify_one();
            } else {
                tracing::warn!(provider = %name, detail = %d.detail, "provider re-check failed");
                st.login_failed
                    .insert(name.clone(), std::time::Instant::now());
                if let Some(p) = st.providers.iter_mut().find(|p| p.name == name) {
                    *p = d;
                }
            }
        }
    }
}

/// Commands for this host (cancel) from its durable consumer on AGENTSCOPE_CONTROL.
async fn control(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let stream = loop {
        match ctx.js.get_stream(agentscope_bus::STREAM_CONTROL).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!(error = %e, "control stream not there yet");
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
    };
    let durable = format!("host-{}", ctx.host_id);
    let consumer = stream
        .get_or_create_consumer(
            &durable,
            pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: subjects::control(&ctx.host_id.to_string()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                // Every command is acked once handled (a malformed one is dropped); only a host
                // that dies before acking sees a redelivery, and never forever.
                max_deliver: 100,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("create control consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            m = messages.next() => match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => { tracing::warn!(error = %e, "control consumer"); continue }
                None => return Ok(()),
            },
        };
        match HostCommand::decode(msg.payload.as_ref()) {
            Ok(HostCommand {
                command: Some(host_command::Command::ApprovalDecision(d)),
                ..
            }) => {
                let to = ctx
                    .state
                    .lock()
                    .expect("host state")
                    .decisions
                    .get(&d.attempt_id)
                    .cloned();
                match to {
                    Some(tx) => {
                        tracing::info!(attempt_id = %d.attempt_id, request_id = %d.request_id, allow = d.allow, "approval decision");
                        let _ = tx.send(d).await;
                    }
                    None => {
                        tracing::debug!(attempt_id = %d.attempt_id, "decision for an attempt not running here")
                    }
                }
            }
            Ok(HostCommand {
                command: Some(host_command::Command::Cancel(c)),
                ..
            }) => {
                let stops = ctx
                    .state
                    .lock()
                    .expect("host state")
                    .running
                    .get(&c.attempt_id)
                    .cloned();
                match stops {
                    Some(s) => {
                        tracing::info!(attempt_id = %c.attempt_id, "cancel requested");
                        s.cancel.cancel();
                    }
                    None => {
                        tracing::debug!(attempt_id = %c.attempt_id, "cancel for an attempt not running here")
                    }
                }
            }
            Ok(_) => tracing::debug!("control command ignored"),
            Err(_) => tracing::warn!("malformed control command dropped"),
        }
        let _ = msg.ack_with(AckKind::Ack).await;
    }
}

/// The queue group hosts with a free slot listen in for their pool's nudges: NATS hands each
/// nudge to one member, so one nudge wakes one host that can take work.
const FREE_HOSTS_QUEUE: &str = "free-hosts";

/// Asks for work: at start, on a nudge (while a slot is free, as a member of the pool's queue
/// group), every `poll_interval_ms` (the fallback: nothing depends on a nudge arriving), and at
/// once again after an offer that brought work while more is waiting and a slot is still free.
async fn claim_loop(
    ctx: Ctx,
    pool_id: String,
    slots: Arc<Semaphore>,
    attempts: Work,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let subject = (!pool_id.is_empty()).then(|| nudge_subject(&ctx, &pool_id));
    let mut nudges: Option<async_nats::Subscriber> = None;
    let poll = Duration::from_millis(ctx.config.poll_interval_ms);
    let mut next_poll = tokio::time::Instant::now();
    let mut claim_now = true;
    // The last claim's answer: more work waits than it could take.
    let mut work_waiting = false;
    loop {
        if claim_now && slots.available_permits() > 0 {
            next_poll = tokio::time::Instant::now() + poll;
            let (got, waiting) = claim_once(&ctx, &slots, &attempts).await;
            work_waiting = waiting > 0;
            if got > 0 && waiting > 0 && slots.available_permits() > 0 {
                continue;
            }
        }
        claim_now = false;
        // In the queue group exactly while a slot is free.
        let free = slots.available_permits() > 0;
        match (&subject, free, nudges.is_some()) {
            (Some(s), true, false) => {
                nudges = Some(
                    ctx.nats
                        .queue_subscribe(s.clone(), FREE_HOSTS_QUEUE.into())
                        .await?,
                );
            }
            (Some(s), false, true) => {
                let mut sub = nudges.take().expect("subscribed");
                let _ = sub.unsubscribe().await;
                // A nudge that reached this host after it filled up goes to a host with room.
                let mut missed = false;
                while let Some(Some(_)) = sub.next().now_or_never() {
                    missed = true;
                }
                if missed {
                    let _ = ctx.nats.publish(s.clone(), bytes::Bytes::new()).await;
                }
            }
            _ => {}
        }
        let nudge = async {
            match nudges.as_mut() {
                Some(n) => n.next().await.is_some(),
                None => futures::future::pending::<bool>().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            open = nudge => {
                if open {
                    // Several nudges queued up are one claim.
                    if let Some(n) = nudges.as_mut() {
                        while let Some(Some(_)) = n.next().now_or_never() {}
                    }
                    claim_now = true;
                } else {
                    // The subscription ended (reconnect): subscribe again.
                    nudges = None;
                }
            }
            // A slot freed while work waits: claim it now rather than wait for a nudge.
            _ = ctx.slot_freed.notified() => claim_now = work_waiting,
            _ = tokio::time::sleep_until(next_poll) => {
                claim_now = true;
                next_poll = tokio::time::Instant::now() + poll;
            }
        }
    }
}

/// One claim request; starts the attempts offered. Returns how many were started and how many
/// more the scheduler says are waiting.
async fn claim_once(ctx: &Ctx, slots: &Arc<Semaphore>, attempts: &Work) -> (usize, u32) {
    let free = slots.available_permits() as u32;
    let (held_attempts, ended_attempts) = {
        let st = ctx.state.lock().expect("host state");
        let ended: Vec<String> = st
            .reported
            .iter()
            .chain(st.finished.iter())
            .cloned()
            .collect();
        let held = st.running.keys().cloned().chain(ended.iter().cloned());
        (held.collect(), ended)
    };
    let req = ClaimRequest {
        host_id: ctx.host_id.to_string(),
        host_token: ctx.config.host_token.clone(),
        free_slots: free,
        held_attempts,
        ended_attempts,
    };
    // Well inside the lease TTL, so a lost reply is offered again before its lease lapses.
    let wait = Duration::from_millis((ctx.lease_ttl_ms() / 3).clamp(500, 5_000));
    let mut got = 0;
    match tokio::time::timeout(
        wait,
        ctx.nats.request(
            subjects::host_claim(&ctx.host_id.to_string()),
            req.encode_to_vec().into(),
        ),
    )
    .await
    {
        Ok(Ok(msg)) => match ClaimOffer::decode(msg.payload.as_ref()) {
            Ok(offer) if !offer.error_code.is_empty() => {
                tracing::warn!(code = %offer.error_code, message = %offer.message, "claim refused");
            }
            Ok(offer) => {
                for a in offer.assignments {
                    let permit = slots.clone().try_acquire_owned();
                    let Ok(permit) = permit else {
                        tracing::error!(attempt_id = %a.attempt_id, "offered more than free capacity; its lease will lapse");
                        continue;
                    };
                    got += 1;
                    spawn_attempt(ctx, attempts, a.into(), permit, None);
                }
                return (got, offer.waiting);
            }
            Err(_) => tracing::warn!("malformed claim offer"),
        },
        Ok(Err(e)) => tracing::warn!(error = %e, "claim request"),
        Err(_) => tracing::warn!("claim request timed out"),
    }
    (got, 0)
}
