//! W1: dispatch. Low load (one task at a time) and bulk (many submitters, many hosts).

use crate::cpu::Probe;
use crate::setup::{self, now_ms};
use crate::stats::{num, summary};
use agentscope_system_tests::Stack;
use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde_json::{Value, json};
use sqlx::Row;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct LowArgs {
    /// Tasks measured, one at a time (after `warmup` unmeasured ones).
    #[arg(long, default_value_t = 200)]
    pub tasks: usize,
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Hosts in the pool, each with `capacity` slots.
    #[arg(long, default_value_t = 1)]
    pub hosts: usize,
    #[arg(long, default_value_t = 4)]
    pub capacity: u32,
    /// The provider: `glibc` (an ordinary program, its own loading included) or `bare` (no
    /// libc: started at its `execve`).
    #[arg(long, value_enum, default_value_t)]
    pub stamp: setup::Stamp,
    /// Idle time between one task's end and the next submission (sparse arrivals: the stack
    /// sits idle, its caches go cold, as between a team's tasks). 0: back to back.
    #[arg(long, default_value_t = 0)]
    pub gap_ms: u64,
}

#[derive(clap::Args, Clone, Debug)]
pub struct BulkArgs {
    /// No-op tasks submitted (the figure uses 5,000).
    #[arg(long, default_value_t = 5000)]
    pub tasks: usize,
    #[arg(long, default_value_t = 4)]
    pub hosts: usize,
    #[arg(long, default_value_t = 32)]
    pub capacity: u32,
    /// Concurrent submitters.
    #[arg(long, default_value_t = 32)]
    pub submitters: usize,
    /// The no-op provider: `true` (glibc's, as the figure; its own start-up included) or
    /// `bare` (the bare stamp's no-op mode: no libc, nothing loaded after its `execve`).
    #[arg(long, value_enum, default_value_t)]
    pub provider: NoOp,
}

/// W1 bulk's no-op provider.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NoOp {
    #[default]
    True,
    Bare,
}

/// Per-kind CPU in ms per unit of work, and the stack's total (the client apart).
pub fn cpu_per(cpu: &HashMap<String, f64>, units: f64) -> Value {
    let mut by = serde_json::Map::new();
    let mut total = 0.0;
    for (k, v) in cpu {
        if k != crate::cpu::CLIENT {
            total += v;
            by.insert(k.clone(), num(v * 1000.0 / units));
        }
    }
    let client = cpu.get(crate::cpu::CLIENT).copied().unwrap_or(f64::NAN);
    json!({"total_ms": num(total * 1000.0 / units), "by_process_ms": by, "client_ms": num(client * 1000.0 / units)})
}

/// The stack's CPU seconds (the client apart).
pub fn stack_cpu(cpu: &HashMap<String, f64>) -> f64 {
    cpu.iter()
        .filter(|(k, _)| k.as_str() != crate::cpu::CLIENT)
        .map(|(_, v)| v)
        .sum()
}

/// One task at a time: submit, wait for its end, next. The provider is
/// `agentscope-bench-stamp`, whose first instruction reads the wall clock: "provider started".
pub async fn low(args: &LowArgs) -> Result<Value> {
    let stack = setup::stack("bench-w1-low", setup::bench_options()).await?;
    let pg = setup::bench_pool(&stack).await?;
    let stamp = setup::stamp_in(&stack.shared, args.stamp)?;
    let (agent, _) = stack
        .command_agent("stamp", "bench", &[stamp.to_str().context("path")?], None)
        .await?;
    let mut hosts = Vec::new();
    for i in 0..args.hosts {
        hosts.push(
            stack
                .host(&format!("low-{i}"), "bench", args.capacity)
                .await?,
        );
    }
    for i in 0..args.warmup {
        let id = setup::submit(&stack, &agent, &format!("warmup {i}")).await?;
        end_of(&stack, &id).await?;
    }
    let claims0 = setup::claim_requests(&stack).await;
    let commits0 = setup::commits(&pg, &stack.db.name).await?;
    let probe = Probe::start(&pg, &stack.db.name).await;
    let mut runs: Vec<(String, f64, f64)> = Vec::new();
    for i in 0..args.tasks {
        if args.gap_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.gap_ms)).await;
        }
        let t0 = now_ms();
        let clock = Instant::now();
        let id = setup::submit(&stack, &agent, &format!("{i}")).await?;
        let post_ms = clock.elapsed().as_secs_f64() * 1000.0;
        end_of(&stack, &id).await?;
        runs.push((id, t0, post_ms));
    }
    let cpu = probe.stop().await;
    let commits = setup::commits(&pg, &stack.db.name).await? - commits0;
    let claims1 = setup::claim_requests(&stack).await;
    let n = runs.len() as f64;

    let mut to_provider = Vec::new();
    let mut to_host_started = Vec::new();
    let mut post = Vec::new();
    let mut intake = Vec::new();
    let mut queued = Vec::new();
    let mut claim_to_provider = Vec::new();
    let mut provider_to_running = Vec::new();
    let mut exit_to_recorded = Vec::new();
    let mut problems = Vec::new();
    for (id, t0, post_ms) in &runs {
        let task = uuid::Uuid::parse_str(id)?;
        let rows = sqlx::query(
            "SELECT a.id, a.number, a.status, a.last_seq, a.exit_code,
                    EXTRACT(EPOCH FROM t.created_at)::float8 * 1000 AS task_created,
                    EXTRACT(EPOCH FROM a.created_at)::float8 * 1000 AS created,
                    EXTRACT(EPOCH FROM a.claimed_at)::float8 * 1000 AS claimed,
                    EXTRACT(EPOCH FROM a.started_at)::float8 * 1000 AS started,
                    EXTRACT(EPOCH FROM a.finished_at)::float8 * 1000 AS finished
             FROM attempts a JOIN tasks t ON t.id = a.task_id WHERE a.task_id = $1",
        )
        .bind(task)
        .fetch_all(&pg)
        .await?;
        if rows.len() != 1 {
            problems.push(format!("task {id}: {} attempts", rows.len()));
            continue;
        }
        let r = &rows[0];
        let attempt: uuid::Uuid = r.try_get("id")?;
        let status: String = r.try_get("status")?;
        let last_seq: i64 = r.try_get("last_seq")?;
        let exit: Option<i32> = r.try_get("exit_code")?;
        let ts = |c: &str| r.try_get::<Option<f64>, _>(c).ok().flatten();
        let (Some(task_created), Some(created), Some(claimed), Some(started), Some(_finished)) = (
            ts("task_created"),
            ts("created"),
            ts("claimed"),
            ts("started"),
            ts("finished"),
        ) else {
            problems.push(format!("attempt {attempt}: a state change is not recorded"));
            continue;
        };
        let events = sqlx::query(
            "SELECT seq, kind, payload, EXTRACT(EPOCH FROM at)::float8 * 1000 AS at,
                    EXTRACT(EPOCH FROM recorded_at)::float8 * 1000 AS recorded
             FROM execution_events WHERE attempt_id = $1 ORDER BY seq",
        )
        .bind(attempt)
        .fetch_all(&pg)
        .await?;
        let seqs: Vec<i64> = events
            .iter()
            .filter_map(|e| e.try_get("seq").ok())
            .collect();
        if status != "succeeded"
            || exit != Some(0)
            || seqs != (1..=last_seq).collect::<Vec<_>>()
            || last_seq == 0
        {
            problems.push(format!(
                "attempt {attempt}: {status}, exit {exit:?}, last_seq {last_seq}, events {seqs:?}"
            ));
            continue;
        }
        let stamp = events.iter().find_map(|e| {
            let p: Value = e.try_get("payload").ok()?;
            setup::stamp_ms(p["text"].as_str()?)
        });
        let Some(stamp) = stamp else {
            problems.push(format!("attempt {attempt}: no stamp line recorded"));
            continue;
        };
        let last = events.last().context("events")?;
        let exit_at: f64 = last.try_get("at")?;
        let recorded: f64 = last.try_get("recorded")?;
        to_provider.push(stamp - t0);
        to_host_started.push(started - t0);
        post.push(*post_ms);
        intake.push(created - task_created);
        queued.push(claimed - created);
        claim_to_provider.push(stamp - claimed);
        provider_to_running.push(started - stamp);
        exit_to_recorded.push(recorded - exit_at);
    }
    if !problems.is_empty() {
        bail!(
            "{} of {} tasks were not recorded completely: {}",
            problems.len(),
            runs.len(),
            problems.join("; ")
        );
    }
    let claims = match (claims0, claims1) {
        (Some(a), Some(b)) => {
            let (o, e) = (b.0 - a.0, b.1 - a.1);
            json!({"per_task": num((o + e) / n), "empty_share": num(e / (o + e).max(1.0))})
        }
        _ => json!({"per_task": null, "empty_share": null}),
    };
    drop(hosts);
    Ok(json!({
        "tasks": runs.len(),
        "all_state_changes_committed": true,
        "submit_to_provider_started_ms": summary(&to_provider),
        "submit_to_host_running_event_ms": summary(&to_host_started),
        "stages_ms": {
            "post": summary(&post),
            "task_created_to_attempt_created": summary(&intake),
            "attempt_created_to_claimed": summary(&queued),
            "claimed_to_provider_started": summary(&claim_to_provider),
            "provider_started_to_host_running_event": summary(&provider_to_running),
            "host_final_event_to_recorded": summary(&exit_to_recorded),
        },
        "claim_requests": claims,
        "transactions_per_task": num(commits as f64 / n),
        "cpu_per_task": cpu_per(&cpu, n),
    }))
}

/// Follows the task's SSE stream until its `end` event (the recorder's commit notification wakes
/// it; no polling).
async fn end_of(stack: &Stack, id: &str) -> Result<()> {
    let ev = agentscope_system_tests::sse_collect(
        &stack.api,
        &format!("/v1/tasks/{id}/events?follow=true"),
        None,
        None,
        Duration::from_secs(60),
    )
    .await?;
    match ev.last() {
        Some(e) if e.event == "end" => Ok(()),
        _ => bail!("the stream of task {id} stopped without its end"),
    }
}

/// Many no-op (`true`) tasks from many submitters to many hosts.
pub async fn bulk(args: &BulkArgs) -> Result<Value> {
    let stack = setup::stack("bench-w1-bulk", setup::bench_options()).await?;
    let pg = setup::bench_pool(&stack).await?;
    let bare;
    let command: Vec<&str> = match args.provider {
        NoOp::True => vec!["true"],
        NoOp::Bare => {
            bare = setup::stamp_in(&stack.shared, setup::Stamp::Bare)?;
            vec![bare.to_str().context("path")?, "quiet"]
        }
    };
    let (agent, _) = stack.command_agent("noop", "bench", &command, None).await?;
    let mut hosts = Vec::new();
    for i in 0..args.hosts {
        hosts.push(
            stack
                .host(&format!("bulk-{i}"), "bench", args.capacity)
                .await?,
        );
    }
    // Warm-up: one task per host slot, unmeasured.
    let warm: Vec<String> = futures::stream::iter(0..(args.hosts * args.capacity as usize).min(64))
        .map(|i| {
            let stack = &stack;
            let agent = &agent;
            async move { setup::submit(stack, agent, &format!("warmup {i}")).await }
        })
        .buffer_unordered(args.submitters)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    for id in &warm {
        setup::wait_task_end(
            &pg,
            id,
            Duration::from_millis(100),
            Duration::from_secs(120),
        )
        .await?;
    }
    let warm_ids: Vec<uuid::Uuid> = warm
        .iter()
        .map(|s| uuid::Uuid::parse_str(s))
        .collect::<Result<_, _>>()?;

    let claims0 = setup::claim_requests(&stack).await;
    let commits0 = setup::commits(&pg, &stack.db.name).await?;
    let probe = Probe::start(&pg, &stack.db.name).await;
    let started = Instant::now();
    let t_first = now_ms();
    let submitted: Vec<(String, f64, f64)> = futures::stream::iter(0..args.tasks)
        .map(|i| {
            let stack = &stack;
            let agent = &agent;
            async move {
                let t0 = now_ms();
                let c = Instant::now();
                let id = setup::submit(stack, agent, &format!("{i}")).await?;
                Ok::<_, anyhow::Error>((id, t0, c.elapsed().as_secs_f64() * 1000.0))
            }
        })
        .buffer_unordered(args.submitters)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let submit_phase = started.elapsed().as_secs_f64();
    // Done: every task has its attempt and none is unfinished. One read every 100 ms: the
    // unfinished ones through the partial indexes, the total only once they are none.
    let total = (args.tasks + warm.len()) as i64;
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM attempts WHERE status IN ('queued', 'claimed', 'running')",
        )
        .fetch_one(&pg)
        .await?;
        if open == 0 {
            let tasks_done: i64 =
                sqlx::query_scalar("SELECT count(DISTINCT task_id) FROM attempts")
                    .fetch_one(&pg)
                    .await?;
            if tasks_done >= total {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!("the bulk run did not finish in 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = probe.stop().await;
    let commits = setup::commits(&pg, &stack.db.name).await? - commits0;
    let claims1 = setup::claim_requests(&stack).await;
    let n = args.tasks as f64;

    let rows = sqlx::query(
        "SELECT t.id::text AS task, a.number, a.status, a.last_seq,
                EXTRACT(EPOCH FROM t.created_at)::float8 * 1000 AS task_created,
                EXTRACT(EPOCH FROM a.claimed_at)::float8 * 1000 AS claimed,
                EXTRACT(EPOCH FROM a.started_at)::float8 * 1000 AS started,
                EXTRACT(EPOCH FROM a.finished_at)::float8 * 1000 AS finished
         FROM attempts a JOIN tasks t ON t.id = a.task_id WHERE NOT (a.task_id = ANY($1))",
    )
    .bind(&warm_ids)
    .fetch_all(&pg)
    .await?;
    let t0: HashMap<&str, f64> = submitted.iter().map(|s| (s.0.as_str(), s.1)).collect();
    let mut to_started = Vec::new();
    let mut to_claimed = Vec::new();
    let mut claimed_to_started = Vec::new();
    let mut last_finish: f64 = 0.0;
    let mut succeeded = 0usize;
    let mut attempts = 0usize;
    let mut last_seq_sum = 0i64;
    for r in &rows {
        attempts += 1;
        let task: String = r.try_get("task")?;
        let status: String = r.try_get("status")?;
        last_seq_sum += r.try_get::<i64, _>("last_seq")?;
        let ts = |c: &str| r.try_get::<Option<f64>, _>(c).ok().flatten();
        if status == "succeeded" {
            succeeded += 1;
        }
        if let Some(f) = ts("finished") {
            last_finish = last_finish.max(f);
        }
        if let (Some(t), Some(c), Some(s)) = (t0.get(task.as_str()), ts("claimed"), ts("started")) {
            to_started.push(s - t);
            to_claimed.push(c - t);
            claimed_to_started.push(s - c);
        }
    }
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM execution_events e JOIN attempts a ON a.id = e.attempt_id WHERE NOT (a.task_id = ANY($1))",
    )
    .bind(&warm_ids)
    .fetch_one(&pg)
    .await?;
    let window_s = (last_finish - t_first) / 1000.0;
    let claims = match (claims0, claims1) {
        (Some(a), Some(b)) => {
            let (o, e) = (b.0 - a.0, b.1 - a.1);
            json!({"per_task": num((o + e) / n), "empty_share": num(e / (o + e).max(1.0))})
        }
        _ => json!({"per_task": null, "empty_share": null}),
    };
    drop(hosts);
    Ok(json!({
        "tasks": args.tasks,
        "hosts": args.hosts,
        "capacity": args.capacity,
        "submitters": args.submitters,
        "provider": match args.provider {
            NoOp::True => "true",
            NoOp::Bare => "bare",
        },
        "attempts": attempts,
        "succeeded": succeeded,
        "all_state_changes_committed": succeeded == args.tasks && attempts == args.tasks && events == last_seq_sum,
        "attempts_per_s": num(n / window_s),
        "window_s": num(window_s),
        "submit_phase_s": num(submit_phase),
        "wall_s": num(wall),
        "submit_to_claimed_ms": summary(&to_claimed),
        "submit_to_host_running_event_ms": summary(&to_started),
        "claimed_to_host_running_event_ms": summary(&claimed_to_started),
        "post_ms": summary(&submitted.iter().map(|s| s.2).collect::<Vec<_>>()),
        "events_per_task": num(events as f64 / n),
        "claim_requests": claims,
        "transactions_per_task": num(commits as f64 / n),
        "cpu_per_attempt": cpu_per(&cpu, n),
        "cpu_cores_busy": num(stack_cpu(&cpu) / wall),
    }))
}
