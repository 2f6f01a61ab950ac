//! svc-dataplane: runs the managed model/tool loop (issue 5). Today it starts, connects to NATS
//! and Postgres, and reports health; the Harness, Environments, Memory and Vault build on this.

mod config;

pub use config::Config;

use agentscope_telemetry::health::{self, Metrics};
use anyhow::Context as _;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct App {
    nats: async_nats::Client,
    health_addr: SocketAddr,
    cancel: CancellationToken,
    health_task: tokio::task::JoinHandle<()>,
}

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let db = agentscope_store::connect(&config.database_url, config.db_max_connections)
            .await
            .context("start svc-dataplane")?;
        agentscope_store::migrate(&db).await?;
        let nats = agentscope_bus::connect(&config.nats_url, "svc-dataplane").await?;
        let cancel = CancellationToken::new();
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
        let _ = self.health_task.await;
        let _ = self.nats.flush().await;
        tracing::info!("svc-dataplane stopped");
        Ok(())
    }
}
