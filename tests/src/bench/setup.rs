//! What every workload needs: a stack, the benchmark's own database pool, the stamp provider,
//! scheduler metrics and a few database reads.

use agentscope_system_tests::{Stack, StackOptions, kit};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, from the wall clock (the clock of `stamp` and of the
/// services' timestamps).
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// A stack with the settings of a long benchmark run (leases and heartbeats far from expiring).
pub async fn stack(label: &str, opts: StackOptions) -> Result<Stack> {
    Stack::start(label, opts).await
}

pub fn bench_options() -> StackOptions {
    StackOptions {
        lease_ttl_ms: 15_000,
        sweep_interval_ms: 1_000,
        heartbeat_ttl_ms: 10_000,
        ..Default::default()
    }
}

/// The benchmark's own connections to the run's database, named `agentscope-bench` so the CPU
/// probe leaves them out. Used read-only.
pub async fn bench_pool(stack: &Stack) -> Result<sqlx::PgPool> {
    let opts = sqlx::postgres::PgConnectOptions::from_str(&stack.db.url())?
        .application_name("agentscope-bench");
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect_with(opts)
        .await?)
}

/// `agentscope-bench-stamp`, copied where any attempt's or session's uid may run it.
pub fn stamp_bin(stack: &Stack) -> Result<PathBuf> {
    stamp_in(&stack.shared, Stamp::Glibc)
}

/// Which program stands for the provider or tool whose start is measured.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stamp {
    /// `agentscope-bench-stamp`: an ordinary program (glibc, dynamically linked), so "started"
    /// includes its own loading, as a real provider's would.
    #[default]
    Glibc,
    /// The same without libc (tests/stamp_bare): "started" is its first instruction after
    /// `execve`, which leaves the program's own loading out.
    Bare,
}

/// The `kind` stamp written into `dir` (mode 0755, where any attempt's or session's uid may run
/// it); its path.
pub fn stamp_in(dir: &std::path::Path, kind: Stamp) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dst = match kind {
        Stamp::Glibc => {
            let src = kit::bin("agentscope-bench-stamp")?;
            let dst = dir.join("agentscope-bench-stamp");
            std::fs::copy(&src, &dst).with_context(|| format!("copy {}", src.display()))?;
            dst
        }
        Stamp::Bare => {
            anyhow::ensure!(
                !agentscope_system_tests::BENCH_STAMP_BARE.is_empty(),
                "the bare stamp is built for x86_64 Linux only"
            );
            let dst = dir.join("agentscope-bench-stamp-bare");
            std::fs::write(&dst, agentscope_system_tests::BENCH_STAMP_BARE)
                .with_context(|| format!("write {}", dst.display()))?;
            dst
        }
    };
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755))?;
    Ok(dst)
}

/// The nanoseconds of the first `stamp <ns>` in `text`, as milliseconds since the epoch.
pub fn stamp_ms(text: &str) -> Option<f64> {
    let rest = &text[text.find("stamp ")? + 6..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some(digits.parse::<u128>().ok()? as f64 / 1e6)
}

/// Claim requests the scheduler answered so far, by result (`offered`, `empty`), from its
/// `/metrics`; None when the scheduler does not count them.
pub async fn claim_requests(stack: &Stack) -> Option<(f64, f64)> {
    let text = kit::http_client()
        .get(format!("{}/metrics", stack.scheduler_health))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let read = |result: &str| -> Option<f64> {
        let label = format!("result=\"{result}\"");
        let values: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("agentscope_claim_requests_total") && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    };
    Some((read("offered")?, read("empty")?))
}

/// `pg_stat_database.xact_commit` of the run's database: every committed transaction, reads
/// included (the benchmark's own reads too).
pub async fn commits(pg: &sqlx::PgPool, db: &str) -> Result<i64> {
    // The statistics snapshot is per transaction; a fresh one each call.
    Ok(
        sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
            .bind(db)
            .fetch_one(pg)
            .await?,
    )
}

/// The cluster's next transaction id: the difference of two readings counts the write
/// transactions in between (of every database; read-only ones take no id). Unlike
/// `pg_stat_database`, which a backend reports at most once a second, it is exact at once.
pub async fn next_xid(pg: &sqlx::PgPool) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8")
            .fetch_one(pg)
            .await?,
    )
}

/// Submits one task of `agent` with `input`; returns its id.
pub async fn submit(stack: &Stack, agent: &str, input: &str) -> Result<String> {
    stack
        .submit(serde_json::json!({"agent_id": agent, "input": input}))
        .await
}

/// Waits (one indexed read every `every`) until the task's newest attempt is terminal; returns
/// its status.
pub async fn wait_task_end(
    pg: &sqlx::PgPool,
    task: &str,
    every: Duration,
    within: Duration,
) -> Result<String> {
    let id = uuid::Uuid::parse_str(task)?;
    let deadline = std::time::Instant::now() + within;
    loop {
        let st: Option<String> = sqlx::query_scalar(
            "SELECT status FROM attempts WHERE task_id = $1 ORDER BY number DESC LIMIT 1",
        )
        .bind(id)
        .fetch_optional(pg)
        .await?;
        if let Some(s) = st
            && ["succeeded", "failed", "cancelled", "lost"].contains(&s.as_str())
        {
            return Ok(s);
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("task {task} did not end within {within:?}");
        }
        tokio::time::sleep(every).await;
    }
}
