//! `agentscope worker`: a self-hosted Worker; managed sessions' file and shell tools run on this
//! machine (`agentscope_tools::worker`) while the model loop stays in the dataplane.

use anyhow::{Context, Result};
use std::path::PathBuf;

pub(crate) async fn run(name: &str, dir: PathBuf, nats_url: &str) -> Result<()> {
    let token = std::env::var("AGENTSCOPE_WORKER_TOKEN")
        .context("AGENTSCOPE_WORKER_TOKEN is not set (POST /v1/worker-tokens)")?;
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        agentscope_telemetry::health::shutdown_signal().await;
        stop.cancel();
    });
    agentscope_tools::worker::run_worker(nats_url, &token, name, dir, cancel).await?;
    Ok(())
}
