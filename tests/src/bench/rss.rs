//! Idle memory of each service after start-up.

use crate::cpu;
use crate::setup;
use crate::stats::num;
use anyhow::Result;
use serde_json::{Value, json};
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
pub struct RssArgs {
    /// How long the stack idles after start-up before it is measured.
    #[arg(long, default_value_t = 3)]
    pub settle_s: u64,
}

/// Starts the stack and one host, lets them idle, and reads each process's VmRSS (and of it the
/// anonymous part) and threads.
pub async fn idle(args: &RssArgs) -> Result<Value> {
    let stack = setup::stack("bench-rss", setup::bench_options()).await?;
    // The host's pool must exist for it to be ready.
    stack
        .command_agent("noop", "bench", &["true"], None)
        .await?;
    let host = stack.host("rss-0", "bench", 32).await?;
    tokio::time::sleep(Duration::from_secs(args.settle_s)).await;
    let mut out = serde_json::Map::new();
    for (pid, name) in cpu::children() {
        let key = if out.contains_key(&name) {
            format!("{name}-{pid}")
        } else {
            name
        };
        out.insert(
            key,
            json!({
                "rss_mib": num(cpu::rss_mib(pid).unwrap_or(f64::NAN)),
                "rss_anon_mib": num(cpu::rss_anon_mib(pid).unwrap_or(f64::NAN)),
                "threads": cpu::threads(pid),
            }),
        );
    }
    drop(host);
    Ok(json!({"target_mib": 30, "processes": out}))
}
