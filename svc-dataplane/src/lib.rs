//! svc-dataplane: runs the managed model/tool loop (issue 5). Today it starts, connects to NATS
//! and Postgres, and reports health; the Harness, Environments, Memory and Vault build on this.

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
use anyhow::Context as _;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct App {
    nats: async_nats::Client,
    runner: Arc<session::Runner>,
    health_addr: SocketAddr,
    cancel: CancellationToken,
    health_task: tokio::task::JoinHandle<()>,
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

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let db = agentscope_store::connect(&config.database_url, config.db_max_connections)
            .await
            .context("start svc-dataplane")?;
        agentscope_store::migrate(&db).await?;
        agentscope_telemetry::install_tls_provider();
        let nats = config
            .nats
            .connect(&config.nats_url, "svc-dataplane")
            .await?;
        let cancel = CancellationToken::new();
        let js = async_nats::jetstream::new(nats.clone());
        let leases = agentscope_bus::Topology::session_leases(
            &js,
            std::time::Duration::from_millis(config.session_lease_ttl_ms),
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
        let workers = agentscope_bus::Topology::workers(
            &js,
            std::time::Duration::from_millis(config.worker_ttl_ms),
        )
        .await?;
        tokio::spawn(worker::serve_registrations(
            db.clone(),
            nats.clone(),
            (config.worker_ttl_ms / 3).max(100) as u32,
            cancel.clone(),
        ));
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
        );
        tracing::info!(%replica, "svc-dataplane replica ready for sessions");
        // New work is announced on a core subject; a sweep finds what a lost nudge or a dead
        // replica left behind.
        let mut nudges = nats
            .subscribe(agentscope_bus::subjects::SESSIONS_NUDGE)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "subscribe {}: {e}",
                    agentscope_bus::subjects::SESSIONS_NUDGE
                )
            })?;
        {
            let runner = runner.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                use futures::StreamExt;
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        m = nudges.next() => {
                            let Some(m) = m else { return };
                            if let Ok(id) = std::str::from_utf8(&m.payload).unwrap_or("").parse::<uuid::Uuid>() {
                                runner.offer(id);
                            }
                        }
                    }
                }
            });
        }
        {
            let runner = runner.clone();
            let cancel = cancel.clone();
            let every = std::time::Duration::from_millis(config.sweep_interval_ms.max(50));
            tokio::spawn(async move {
                loop {
                    match runner.sessions_with_work().await {
                        Ok(ids) => ids.into_iter().for_each(|id| runner.offer(id)),
                        Err(e) => tracing::warn!(error = %e, "look for sessions with work"),
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                }
            });
        }
        let probe_nats = nats.clone();
        let probe: health::Probe = Arc::new(move || {
            let db = db.clone();
            let nats = probe_nats.clone();
            Box::pin(async move {
                if nats.connection_state() != async_nats::connection::State::Connected {
                    return Err("nats: not connected".into());
                }
                sqlx::query("SELECT 1")
                    .execute(&db)
                    .await
                    .map_err(|e| format!("postgres: {e}"))?;
                Ok(())
            })
        });
        let (health_addr, health_task) = health::serve(
            &config.health_addr,
            "svc-dataplane",
            probe,
            Metrics::default(),
            cancel.clone(),
        )
        .await
        .with_context(|| format!("bind health listener {}", config.health_addr))?;
        tracing::info!(%health_addr, "svc-dataplane listening for health checks");
        Ok(App {
            nats,
            runner,
            health_addr,
            cancel,
            health_task,
        })
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        shutdown.await;
        self.cancel.cancel();
        // Sessions stop at their next await point and hand their leases back, so another
        // replica continues them at once instead of after the lease's TTL.
        self.runner.stopping.cancel();
        self.runner.sessions.close();
        if tokio::time::timeout(
            std::time::Duration::from_secs(10),
            self.runner.sessions.wait(),
        )
        .await
        .is_err()
        {
            tracing::warn!("sessions did not stop within 10 s; their leases expire instead");
        }
        let _ = self.health_task.await;
        let _ = self.nats.flush().await;
        tracing::info!("svc-dataplane stopped");
        Ok(())
    }
}
