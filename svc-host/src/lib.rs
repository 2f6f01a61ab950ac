//! svc-host: the Runtime Host daemon. Registers a stable identity, reports presence and its three
//! checks, claims work under KV leases, runs providers in fresh task directories and reports
//! their events. Architecture invariant: the host talks only to NATS, never to Postgres.

pub mod attempt;
mod claims;
mod config;
mod control;
pub mod isolation;
pub mod journal;
pub mod process;
pub mod provider;
pub mod providers;
mod recovery;
mod registration;
mod retention;

pub use config::Config;

use agentscope_bus::Topology;
use agentscope_schemas::v1::{HostCheck, HostRegistered, ProviderDescriptor};
use agentscope_telemetry::health::{self, Metrics};
use agentscope_telemetry::supervisor::{Policy, Supervisor};
use anyhow::Context as _;
use async_nats::jetstream;
use claims::{claim_loop, spawn_attempt};
use control::control;
use provider::Adapter;
use recovery::recover;
use registration::{discover, heartbeat, identities, recheck, register};
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
    /// Worked out once at start: every attempt needs them, and neither the executable's place
    /// nor the host's PATH changes while it runs.
    paths: Arc<Paths>,
}

/// Where executors find the `agentscope` CLI.
struct Paths {
    /// The CLI itself, absolute: the translated instructions name it, and a login shell resets
    /// PATH.
    cli: PathBuf,
    /// PATH for executors: the CLI's directory first, then the host's own PATH.
    executors: std::ffi::OsString,
}

impl Paths {
    fn of(config: &Config) -> Paths {
        let cli_dir = if config.cli_dir.is_empty() {
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|p| p.to_path_buf()))
                .unwrap_or_default()
        } else {
            PathBuf::from(&config.cli_dir)
        };
        let p = cli_dir.join("agentscope");
        let cli = std::path::absolute(&p).unwrap_or(p);
        let rest = std::env::var_os("PATH").unwrap_or_default();
        let executors =
            std::env::join_paths(std::iter::once(cli_dir).chain(std::env::split_paths(&rest)))
                .unwrap_or(rest);
        Paths { cli, executors }
    }
}

#[derive(Default)]
struct State {
    registered: Option<HostRegistered>,
    providers: Vec<ProviderDescriptor>,
    running: HashMap<String, attempt::Stops>,
    /// Where approval decisions for a running attempt go.
    decisions: HashMap<String, tokio::sync::mpsc::Sender<agentscope_schemas::v1::ApprovalDecision>>,
    /// Attempts of a previous run of this host, already reported as interrupted, until a claim
    /// reply says their ends are recorded.
    reported: Vec<String>,
    /// Attempts this run finished, so none is ever taken for a lost offer, until a claim reply
    /// says their ends are recorded (`ClaimOffer.recorded_ends`; bounded as well).
    finished: std::collections::VecDeque<String>,
    /// Providers whose login failed in an attempt, and when: not ready until a re-check passes.
    login_failed: HashMap<String, std::time::Instant>,
    /// A task directory prepared on the gateway's early word, until its attempt comes or it
    /// expires (`attempt::prepare_ahead`).
    prepared: Option<attempt::Prepared>,
}

impl State {
    /// Whether `attempt_id` runs here, ran here, or was reported ended by a previous run of this
    /// host: an offer of it is never run again, nor prepared ahead.
    fn knows(&self, attempt_id: &str) -> bool {
        self.running.contains_key(attempt_id)
            || self.finished.iter().any(|id| id == attempt_id)
            || self.reported.iter().any(|id| id == attempt_id)
    }
}

impl Ctx {
    pub fn adapter(&self, name: &str) -> Option<&dyn Adapter> {
        self.adapters
            .iter()
            .find(|a| a.name() == name)
            .map(|a| a.as_ref())
    }
    /// The `agentscope` CLI executors use (and whose `mcp` subcommand serves MCP).
    pub fn cli_path(&self) -> &std::path::Path {
        &self.paths.cli
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
    pub fn executor_path(&self) -> &std::ffi::OsStr {
        &self.paths.executors
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
        // Every provider starts through the sentinel svc-host carries.
        isolation::publish_sentinel(&state_dir).context("write the sentinel")?;
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
        let paths = Arc::new(Paths::of(&config));
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
            paths,
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
        // Started after the resumed attempts are running: their directories are theirs.
        {
            let ctx = ctx.clone();
            sup.spawn(
                "task-dir-retention",
                Policy::Restart {
                    backoff: Duration::from_secs(5),
                },
                move |stop| retention::prune_task_dirs(ctx.clone(), stop),
            );
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
