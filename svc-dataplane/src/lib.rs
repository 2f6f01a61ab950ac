//! svc-dataplane: runs managed sessions, the model/tool loop itself (`session`), with file and
//! shell tools on an Environment, an E2B sandbox or a self-hosted Worker. `App` wires the core
//! tasks (Worker registrations, session nudges, the sweep, the health listener) and the sessions
//! to one supervisor.

mod config;
pub mod e2b;
/// The Environments, shared with self-hosted Workers (`agentscope_tools::env`).
pub use agentscope_tools::env;
pub mod model;
pub mod policy;
pub mod session;
pub mod tools;
pub mod worker;

pub use config::Config;

use agentscope_telemetry::health::{self, Metrics};
use agentscope_telemetry::supervisor::{Policy, Supervisor};
use anyhow::Context as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub struct App {
    nats: async_nats::Client,
    health_addr: SocketAddr,
    /// The core tasks (worker registrations, session nudges, the sweep, the health listener)
    /// and the sessions, as work.
    sup: Supervisor,
}

/// Decides how session limits are enforced and states at start-up what is in force: the uid
/// range, cgroup v2 or rlimits, and whether `local` is enabled. A configured cgroup that cannot
/// be used is an error, never a silently weaker sandbox.
fn startup_isolation(config: &Config) -> anyhow::Result<env::LimitMode> {
    let (mode, why) = env::detect_limit_mode(&config.sandbox_cgroup).map_err(anyhow::Error::msg)?;
    let root = running_as_root();
    let limits = format!(
        "pids {}, memory {} MiB, cpu {}",
        config.session_max_processes,
        config.session_memory_mb,
        if config.session_cpu_secs == 0 {
            "unlimited".to_string()
        } else {
            format!("{} s per process", config.session_cpu_secs)
        }
    );
    match &mode {
        env::LimitMode::Cgroup(dir) => tracing::info!(
            cgroup = %dir.display(),
            "session limits in force: cgroup v2 (pids.max, memory.max, cpu.max) per shell call: {limits}"
        ),
        env::LimitMode::Rlimits if root => tracing::info!(
            cgroup_unusable = %why,
            "session limits in force: rlimits of each session's own uid (RLIMIT_NPROC, RLIMIT_AS, RLIMIT_CPU), set before exec: {limits}"
        ),
        env::LimitMode::Rlimits => tracing::warn!(
            cgroup_unusable = %why,
            "not running as root: sessions share the dataplane's uid, so RLIMIT_NPROC is not applied and sessions are not isolated from each other; limits in force: RLIMIT_AS, RLIMIT_CPU"
        ),
    }
    tracing::info!(
        session_uids = %config.session_uids,
        allow_local_environment = config.allow_local_environment,
        bwrap = %config.bwrap_path,
        "session isolation: one uid per session; local and remote environments {}",
        if config.allow_local_environment { "enabled" } else { "refused" }
    );
    Ok(mode)
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// How long sessions get at shutdown to stop and hand their leases back (another replica then
/// continues them at once instead of after the lease's TTL).
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The core tasks whose end is a lost subscription: started again a second after a failure.
const RESTART_BACKOFF: Policy = Policy::Restart {
    backoff: Duration::from_secs(1),
};

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        // Migrations, Worker registrations, the health probe and the sweep's sibling; sessions
        // have a pool of their own (`session::Runner::db`, `db_max_connections`).
        let db = agentscope_store::connect(&config.database_url, 2)
            .await
            .context("start svc-dataplane")?;
        agentscope_store::migrate(&db).await?;
        agentscope_telemetry::install_tls_provider();
        let nats = config
            .nats
            .connect(&config.nats_url, "svc-dataplane")
            .await?;
        let mut sup = Supervisor::new("svc-dataplane", CancellationToken::new(), STOP_GRACE);
        let js = async_nats::jetstream::new(nats.clone());
        let leases = agentscope_bus::Topology::session_leases(
            &js,
            Duration::from_millis(config.session_lease_ttl_ms),
        )
        .await?;
        let replica = if config.replica_id.is_empty() {
            format!(
                "{}-{}",
                std::fs::read_to_string("/etc/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_else(|_| "dataplane".into()),
                std::process::id()
            )
        } else {
            config.replica_id.clone()
        };
        let workers =
            agentscope_bus::Topology::workers(&js, Duration::from_millis(config.worker_ttl_ms))
                .await?;
        {
            let (db, nats) = (db.clone(), nats.clone());
            let heartbeat_ms = (config.worker_ttl_ms / 3).max(100) as u32;
            sup.spawn("worker-registrations", RESTART_BACKOFF, move |stop| {
                worker::serve_registrations(db.clone(), nats.clone(), heartbeat_ms, stop)
            });
        }
        let limit_mode = startup_isolation(&config)?;
        let runner = session::Runner::new(
            db.clone(),
            nats.clone(),
            workers,
            js.clone(),
            leases,
            Arc::new(config.clone()),
            replica.clone(),
            limit_mode,
            sup.work(),
        );
        tracing::info!(%replica, "svc-dataplane replica ready for sessions");
        // New work is announced on a core subject; a sweep finds what a lost nudge or a dead
        // replica left behind. The first subscription is made here, so that a nudge sent once
        // the dataplane is up is not missed; a restart of the task subscribes again.
        let nudges = Mutex::new(Some(subscribe_nudges(&nats).await?));
        {
            let (runner, nats) = (runner.clone(), nats.clone());
            sup.spawn("session-nudges", RESTART_BACKOFF, move |stop| {
                let first = nudges.lock().unwrap_or_else(|e| e.into_inner()).take();
                let (runner, nats) = (runner.clone(), nats.clone());
                async move {
                    let sub = match first {
                        Some(sub) => sub,
                        None => subscribe_nudges(&nats).await?,
                    };
                    follow_nudges(&runner, sub, stop).await
                }
            });
        }
        {
            let runner = runner.clone();
            let every = Duration::from_millis(config.sweep_interval_ms.max(50));
            sup.spawn("session-sweep", Policy::Critical, move |stop| {
                sweep(runner.clone(), every, stop)
            });
        }
        let probe = health::nats_and_postgres(nats.clone(), db.clone());
        let (health_addr, health_task) = health::serve(
            &config.health_addr,
            "svc-dataplane",
            probe,
            Metrics::default(),
            sup.token(),
        )
        .await
        .with_context(|| format!("bind health listener {}", config.health_addr))?;
        // The listener is bound above (its address is known before `build` returns); the
        // supervisor owns the task serving it.
        sup.spawn_once("health", move |_stop| async move {
            health_task.await.context("health listener")
        });
        tracing::info!(%health_addr, "svc-dataplane listening for health checks");
        Ok(App {
            nats,
            health_addr,
            sup,
        })
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    /// Runs until `shutdown` resolves (or a critical task ends), then stops: sessions stop at
    /// their next await point and hand their leases back, within the grace period.
    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let res = self.sup.run(shutdown).await;
        if let Err(e) = self.nats.flush().await {
            tracing::warn!(error = %e, "flush NATS at shutdown");
        }
        tracing::info!("svc-dataplane stopped");
        res
    }
}

async fn subscribe_nudges(nats: &async_nats::Client) -> anyhow::Result<async_nats::Subscriber> {
    nats.subscribe(agentscope_bus::subjects::SESSIONS_NUDGE)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "subscribe {}: {e}",
                agentscope_bus::subjects::SESSIONS_NUDGE
            )
        })
}

/// Offers each nudged session to the runner.
async fn follow_nudges(
    runner: &Arc<session::Runner>,
    mut nudges: async_nats::Subscriber,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            m = nudges.next() => {
                let Some(m) = m else { anyhow::bail!("the subscription to session nudges ended") };
                if let Ok(id) = std::str::from_utf8(&m.payload).unwrap_or("").parse::<uuid::Uuid>() {
                    runner.nudge(id);
                }
            }
        }
    }
}

/// Offers every session with an unanswered input to the runner, every `every`.
async fn sweep(
    runner: Arc<session::Runner>,
    every: Duration,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        match runner.sessions_with_work().await {
            Ok(ids) => ids.into_iter().for_each(|id| runner.offer(id)),
            Err(e) => tracing::warn!(error = %e, "look for sessions with work"),
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}
