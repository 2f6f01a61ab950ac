//! W2: events. One attempt printing many lines (ingest), and many SSE followers of one task.

use crate::cpu::Probe;
use crate::setup::{self, now_ms};
use crate::stats::{num, summary};
use agentscope_system_tests::Api;
use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde_json::{Value, json};
use sqlx::Row;
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
pub struct IngestArgs {
    /// Lines the one attempt prints.
    #[arg(long, default_value_t = 100_000)]
    pub lines: u64,
}

#[derive(clap::Args, Clone, Debug)]
pub struct SseArgs {
    /// SSE followers of the one task.
    #[arg(long, default_value_t = 100)]
    pub followers: usize,
    /// Lines the task prints at once (a burst) once every follower is attached.
    #[arg(long, default_value_t = 5000)]
    pub lines: u64,
    /// Then a second task prints this many lines as a steady stream ...
    #[arg(long, default_value_t = 2000)]
    pub steady_lines: u64,
    /// ... at this many lines per second.
    #[arg(long, default_value_t = 1000)]
    pub steady_rate: u64,
}

/// One attempt prints `lines` lines (`seq 1 N`); the time from the provider's start (the host's
/// `running` event) until the last event is committed.
pub async fn ingest(args: &IngestArgs) -> Result<Value> {
    let stack = setup::stack("bench-w2-ingest", setup::bench_options()).await?;
    let pg = setup::bench_pool(&stack).await?;
    let lines = args.lines.to_string();
    let (agent, _) = stack
        .command_agent("printer", "bench", &["seq", "1", &lines], None)
        .await?;
    let host = stack.host("ingest-0", "bench", 1).await?;
    let commits0 = setup::commits(&pg, &stack.db.name).await?;
    let probe = Probe::start(&pg, &stack.db.name).await;
    let id = setup::submit(&stack, &agent, "print").await?;
    let status = setup::wait_task_end(
        &pg,
        &id,
        Duration::from_millis(100),
        Duration::from_secs(3600),
    )
    .await?;
    let cpu = probe.stop().await;
    let commits = setup::commits(&pg, &stack.db.name).await? - commits0;
    let task = uuid::Uuid::parse_str(&id)?;
    // The newest attempt's end; a lost attempt is retried, so lines may be recorded more than
    // once (by several attempts): `attempts` says how many ran.
    let (class, detail, attempts): (Option<String>, Option<String>, i32) = sqlx::query_as(
        "SELECT failure_class, failure_detail, number FROM attempts WHERE task_id = $1 ORDER BY number DESC LIMIT 1",
    )
    .bind(task)
    .fetch_one(&pg)
    .await?;
    let r = sqlx::query(
        "SELECT count(*) FILTER (WHERE e.kind = 'output') AS lines,
                count(*) AS events, max(e.seq) AS max_seq, min(a.last_seq) AS last_seq,
                EXTRACT(EPOCH FROM min(a.started_at))::float8 * 1000 AS started,
                EXTRACT(EPOCH FROM min(e.at) FILTER (WHERE e.kind = 'output'))::float8 * 1000 AS first_out,
                EXTRACT(EPOCH FROM max(e.at))::float8 * 1000 AS last_at,
                EXTRACT(EPOCH FROM max(e.recorded_at))::float8 * 1000 AS last_recorded
         FROM execution_events e JOIN attempts a ON a.id = e.attempt_id WHERE a.task_id = $1",
    )
    .bind(task)
    .fetch_one(&pg)
    .await?;
    let got: i64 = r.try_get("lines")?;
    let events: i64 = r.try_get("events")?;
    let max_seq: Option<i64> = r.try_get("max_seq")?;
    let last_seq: Option<i64> = r.try_get("last_seq")?;
    let f = |c: &str| -> Result<f64> {
        r.try_get::<Option<f64>, _>(c)?
            .with_context(|| format!("no {c}"))
    };
    let (started, first_out, last_at, last_recorded) = (
        f("started")?,
        f("first_out")?,
        f("last_at")?,
        f("last_recorded")?,
    );
    let durable_s = (last_recorded - started) / 1000.0;
    let emit_s = (last_at - first_out) / 1000.0;
    drop(host);
    Ok(json!({
        "lines": args.lines,
        "status": status,
        "failure_class": class,
        "failure_detail": detail,
        "attempts": attempts,
        "lines_recorded": got,
        "complete": status == "succeeded" && got as u64 == args.lines && max_seq == Some(events) && last_seq == Some(events),
        "provider_start_to_all_recorded_s": num(durable_s),
        "events_per_s": num(events as f64 / durable_s),
        "host_emit_s": num(emit_s),
        "host_events_per_s": num(got as f64 / emit_s.max(0.001)),
        "recorder_lag_at_end_ms": num(last_recorded - last_at),
        "transactions_per_event": num(commits as f64 / events as f64),
        "cpu_per_event_us": {
            "total": num(crate::w1::stack_cpu(&cpu) * 1e6 / events as f64),
            "by_process": cpu.iter().map(|(k, v)| (k.clone(), num(v * 1e6 / events as f64))).collect::<serde_json::Map<_, _>>(),
        },
    }))
}

/// One received SSE event: its id, the time it arrived, and the event's own `at`.
struct Got {
    id: String,
    recv_ms: f64,
    at_ms: Option<f64>,
}

/// Follows `path` until its `end` event: every event with its arrival time. `ready` is told once
/// the gateway has answered (its follower is attached).
async fn follow(
    api: Api,
    path: String,
    ready: tokio::sync::mpsc::Sender<()>,
    within: Duration,
) -> Result<(Vec<Got>, bool)> {
    let res = api
        .client
        .get(format!("{}{path}", api.base))
        .bearer_auth(&api.token)
        .header("accept", "text/event-stream")
        .send()
        .await?;
    if res.status() != 200 {
        bail!("SSE {path} -> {}", res.status());
    }
    let _ = ready.send(()).await;
    let mut body = res.bytes_stream();
    let mut parser = agentscope_api::sse::SseParser::default();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .context("the SSE stream did not end in time")?;
        let Some(chunk) = chunk else {
            return Ok((out, false));
        };
        let recv_ms = now_ms();
        for ev in parser.feed(&chunk?) {
            if ev.event == "end" {
                return Ok((out, true));
            }
            out.push(Got {
                id: ev.id.unwrap_or_default(),
                recv_ms,
                at_ms: at_of(&ev.data),
            });
        }
    }
}

/// The event's `at` (the host's emission time) from its JSON, in ms since the epoch.
fn at_of(data: &str) -> Option<f64> {
    let i = data.find("\"at\":\"")? + 6;
    let end = data[i..].find('"')? + i;
    let t = chrono::DateTime::parse_from_rfc3339(&data[i..end]).ok()?;
    Some(t.timestamp_micros() as f64 / 1000.0)
}

/// `followers` SSE clients follow one task that prints `lines` lines at once when all are
/// attached (a burst: the figure is mostly the time to deliver the whole burst), then another
/// that prints `steady_lines` at `steady_rate` per second (the pipeline's own latency).
pub async fn sse(args: &SseArgs) -> Result<Value> {
    let stack = setup::stack("bench-w2-sse", setup::bench_options()).await?;
    let pg = setup::bench_pool(&stack).await?;
    let stamp = setup::stamp_bin(&stack)?;
    let burst = agent(&stack, "burst", &format!("exec seq 1 {}", args.lines)).await?;
    let steady = format!(
        "exec {} lines {} {}",
        stamp.display(),
        args.steady_lines,
        1_000_000 / args.steady_rate.max(1)
    );
    let steady = agent(&stack, "steady", &steady).await?;
    let host = stack.host("sse-0", "bench", 1).await?;
    let mut out = follow_task(&stack, &pg, args.followers, &burst).await?;
    let steady = follow_task(&stack, &pg, args.followers, &steady).await?;
    drop(host);
    out["lines"] = json!(args.lines);
    out["steady"] = steady;
    out["steady"]["lines"] = json!(args.steady_lines);
    out["steady"]["lines_per_s"] = json!(args.steady_rate);
    Ok(out)
}

/// An agent whose command (`sh -c`) starts once the file `go-<name>` exists in the stack's
/// shared directory: its id and that file.
async fn agent(
    stack: &agentscope_system_tests::Stack,
    name: &str,
    command: &str,
) -> Result<(String, std::path::PathBuf)> {
    let go = stack.shared.join(format!("go-{name}"));
    let script = format!(
        "while [ ! -e {go} ]; do sleep 0.01; done; {command}",
        go = go.display()
    );
    let (agent, _) = stack
        .command_agent(name, "bench", &["sh", "-c", &script], None)
        .await?;
    Ok((agent, go))
}

/// `followers` SSE clients of one task of `agent`, whose command starts once all are attached.
async fn follow_task(
    stack: &agentscope_system_tests::Stack,
    pg: &sqlx::PgPool,
    followers: usize,
    (agent, go): &(String, std::path::PathBuf),
) -> Result<Value> {
    let id = setup::submit(stack, agent, "print").await?;
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(followers);
    let mut tasks = Vec::new();
    for _ in 0..followers {
        // A client of its own per follower: one connection each, as separate viewers have.
        let api = Api {
            client: agentscope_system_tests::kit::http_client(),
            ..stack.api.clone()
        };
        tasks.push(tokio::spawn(follow(
            api,
            format!("/v1/tasks/{id}/events?follow=true"),
            ready_tx.clone(),
            Duration::from_secs(1800),
        )));
    }
    drop(ready_tx);
    for _ in 0..followers {
        ready_rx
            .recv()
            .await
            .context("a follower failed to attach")?;
    }
    let probe = Probe::start(pg, &stack.db.name).await;
    std::fs::write(go, "go")?;
    let mut got = Vec::new();
    for f in tasks {
        got.push(f.await??);
    }
    let cpu = probe.stop().await;
    let rows = sqlx::query(
        "SELECT a.number || ':' || e.seq AS id, EXTRACT(EPOCH FROM e.recorded_at)::float8 * 1000 AS recorded
         FROM execution_events e JOIN attempts a ON a.id = e.attempt_id
         WHERE a.task_id = $1 ORDER BY a.number, e.seq",
    )
    .bind(uuid::Uuid::parse_str(&id)?)
    .fetch_all(pg)
    .await?;
    let expected: Vec<String> = rows
        .iter()
        .map(|r| r.try_get("id"))
        .collect::<Result<_, _>>()?;
    let recorded: std::collections::HashMap<String, f64> = rows
        .iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("recorded")?)))
        .collect::<Result<_, sqlx::Error>>()?;
    let mut complete = 0;
    let mut after_emit = Vec::new();
    let mut after_commit = Vec::new();
    for (events, ended) in &got {
        let ids: Vec<&str> = events.iter().map(|g| g.id.as_str()).collect();
        if *ended && ids == expected.iter().map(String::as_str).collect::<Vec<_>>() {
            complete += 1;
        }
        for g in events {
            if let Some(at) = g.at_ms {
                after_emit.push(g.recv_ms - at);
            }
            if let Some(r) = recorded.get(&g.id) {
                after_commit.push(g.recv_ms - r);
            }
        }
    }
    let lines_recorded = expected.len();
    Ok(json!({
        "followers": followers,
        "events": lines_recorded,
        "followers_complete_in_order": complete,
        "every_follower_got_every_event_once_in_order": complete == followers,
        "delivery_after_host_emitted_ms": summary(&after_emit),
        "delivery_after_commit_ms": summary(&after_commit),
        "cpu_per_delivered_event_us": num(crate::w1::stack_cpu(&cpu) * 1e6 / after_commit.len().max(1) as f64),
        "cpu_s": cpu.iter().map(|(k, v)| (k.clone(), num(*v))).collect::<serde_json::Map<_, _>>(),
    }))
}
