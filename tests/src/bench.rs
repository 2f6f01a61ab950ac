//! Benchmark (not a test): submits N no-op tasks through the whole system (gateway → scheduler
//! → hosts → recorder) and prints attempts per second and submit-to-start latency percentiles.
//!
//!     cargo run -p agentscope-system-tests --bin agentscope-bench -- --tasks 200 --hosts 4 --capacity 8

use agentscope_system_tests::{Stack, StackOptions};
use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Number of no-op tasks to submit.
    #[arg(long, default_value_t = 200)]
    tasks: usize,
    /// Number of hosts in the pool.
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// Capacity of each host.
    #[arg(long, default_value_t = 8)]
    capacity: u32,
    /// Concurrent submitters.
    #[arg(long, default_value_t = 16)]
    submitters: usize,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    eprintln!("starting nats-server, postgres database and services...");
    let stack = Stack::start(
        "bench",
        StackOptions {
            lease_ttl_ms: 15_000,
            sweep_interval_ms: 1_000,
            heartbeat_ttl_ms: 10_000,
            ..Default::default()
        },
    )
    .await?;
    let (agent, _) = stack
        .command_agent("noop", "bench", &["true"], None)
        .await?;
    let mut hosts = Vec::new();
    for i in 0..args.hosts {
        hosts.push(
            stack
                .host(&format!("bench-{i}"), "bench", args.capacity)
                .await?,
        );
    }
    eprintln!(
        "submitting {} tasks to {} hosts of capacity {}...",
        args.tasks, args.hosts, args.capacity
    );
    let started = Instant::now();
    let api = stack.api.clone();
    let agent2 = agent.clone();
    let submit_ms: Vec<f64> = futures::stream::iter(0..args.tasks)
        .map(|i| {
            let api = api.clone();
            let agent = agent2.clone();
            async move {
                let t = Instant::now();
                api.post(
                    "/v1/tasks",
                    json!({"agent_id": agent, "input": format!("{i}")}),
                )
                .await?;
                Ok::<_, anyhow::Error>(t.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(args.submitters)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let submitted = started.elapsed();
    let pg = stack.pg.clone();
    let n = args.tasks as i64;
    agentscope_testkit::wait_for("every task to finish", Duration::from_secs(600), || {
        let pg = pg.clone();
        async move {
            let done: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status IN ('succeeded','failed','cancelled','lost')")
                .fetch_one(&pg)
                .await
                .ok()?;
            (done >= n).then_some(())
        }
    })
    .await?;
    let total = started.elapsed();
    let rows: Vec<(f64, f64, String)> = sqlx::query_as(
        "SELECT EXTRACT(EPOCH FROM (a.started_at - t.created_at))::float8 * 1000,
                EXTRACT(EPOCH FROM (a.claimed_at - t.created_at))::float8 * 1000, a.status
         FROM attempts a JOIN tasks t ON t.id = a.task_id",
    )
    .fetch_all(&stack.pg)
    .await
    .context("read attempts")?;
    let (window,): (f64,) = sqlx::query_as(
        "SELECT EXTRACT(EPOCH FROM (max(a.finished_at) - min(t.created_at)))::float8 FROM attempts a JOIN tasks t ON t.id = a.task_id",
    )
    .fetch_one(&stack.pg)
    .await?;
    let stages: (f64, f64, f64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM (a.started_at - a.claimed_at)) * 1000),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM (a.finished_at - a.started_at)) * 1000),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM (a.claimed_at - a.created_at)) * 1000)
         FROM attempts a",
    )
    .fetch_one(&stack.pg)
    .await?;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM execution_events")
        .fetch_one(&stack.pg)
        .await?;
    let succeeded = rows.iter().filter(|r| r.2 == "succeeded").count();
    let mut start: Vec<f64> = rows.iter().map(|r| r.0).collect();
    let mut claim: Vec<f64> = rows.iter().map(|r| r.1).collect();
    let mut submit = submit_ms;
    for v in [&mut start, &mut claim, &mut submit] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    println!("tasks                     {}", args.tasks);
    println!(
        "hosts x capacity          {} x {}",
        args.hosts, args.capacity
    );
    println!("succeeded                 {succeeded}");
    println!("events recorded           {events}");
    println!("submit phase              {:.2} s", submitted.as_secs_f64());
    println!("wall time                 {:.2} s", total.as_secs_f64());
    println!(
        "attempts per second       {:.1}",
        args.tasks as f64 / window
    );
    println!("events per second         {:.1}", events as f64 / window);
    println!(
        "POST /v1/tasks p50/p99    {:.1} / {:.1} ms",
        pct(&submit, 50.0),
        pct(&submit, 99.0)
    );
    println!(
        "submit-to-claim p50/p99   {:.1} / {:.1} ms",
        pct(&claim, 50.0),
        pct(&claim, 99.0)
    );
    println!(
        "stage p50: queued {:.1} ms, claim-to-start {:.1} ms, start-to-recorded-end {:.1} ms",
        stages.2, stages.0, stages.1
    );
    println!(
        "submit-to-start p50/p99   {:.1} / {:.1} ms",
        pct(&start, 50.0),
        pct(&start, 99.0)
    );
    Ok(())
}
