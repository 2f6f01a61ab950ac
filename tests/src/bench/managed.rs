//! W3 (the managed loop) and W4 (approval decision → tool start), against the scripted model
//! server run inside the benchmark, timed per request.

use crate::cpu::Probe;
use crate::setup::{self, now_ms};
use crate::stats::{num, summary};
use agentscope_system_tests::{Stack, StackOptions};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sqlx::Row;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct LoopArgs {
    /// Model/tool iterations of the one input.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Tool calls per model turn after the first: `read_file` of the small file, then
    /// `list_files` and `read_file` alternately, all asked for at once (parallel tool use).
    #[arg(long, default_value_t = 1)]
    pub reads_per_turn: usize,
    /// Each iteration's tool is `shell` running a stamp instead (`glibc` or `bare`, as
    /// `approvals --stamp`): a call with effects, journaled `started` with its turn and run once
    /// that commits, as most of a coding agent's calls are.
    #[arg(long, value_enum)]
    pub shell: Option<crate::setup::Stamp>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ApprovalArgs {
    /// Tool calls, each asking for an approval.
    #[arg(long, default_value_t = 50)]
    pub approvals: usize,
    /// The tool: `glibc` (an ordinary program, its own loading included) or `bare` (no libc:
    /// started at its `execve`).
    #[arg(long, value_enum, default_value_t)]
    pub stamp: crate::setup::Stamp,
}

/// (arrival in ms since the epoch, time to answer in ms) of each model request, in order.
type Timings = Arc<Mutex<Vec<(f64, f64)>>>;

/// The scripted model server on a free port, each request timed from its arrival to its
/// response. Returns its base URL.
async fn model_server(script: Value, timings: Timings) -> Result<String> {
    let script = agentscope_modelsim::Script::from_json(&script.to_string())?;
    let app = agentscope_modelsim::router(script, None)
        .await?
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let timings = timings.clone();
                async move {
                    let at = now_ms();
                    let t = Instant::now();
                    let res = next.run(req).await;
                    let took = t.elapsed().as_secs_f64() * 1000.0;
                    timings.lock().unwrap().push((at, took));
                    res
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(agentscope_telemetry::health::no_delay(listener), app).await;
    });
    Ok(format!("http://{addr}"))
}

/// A stack whose dataplane talks to the model server at `url`, with the `local` environment.
async fn managed_stack(label: &str, url: &str) -> Result<Stack> {
    let allow_local = (
        "AGENTSCOPE_ALLOW_LOCAL_ENVIRONMENT".to_string(),
        "true".to_string(),
    );
    let opts = StackOptions {
        dataplane_env: vec![
            ("AGENTSCOPE_MODEL_API".into(), "anthropic".into()),
            ("AGENTSCOPE_MODEL_BASE_URL".into(), url.into()),
            ("AGENTSCOPE_MODEL_API_KEY".into(), "sk-modelsim".into()),
            allow_local.clone(),
        ],
        gateway_env: vec![allow_local],
        ..setup::bench_options()
    };
    setup::stack(label, opts).await
}

async fn managed_agent(stack: &Stack, name: &str, extra: Value) -> Result<String> {
    let mut body =
        json!({"name": name, "provider": "managed", "instructions": format!("You are {name}.")});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    let a = stack.api.post("/v1/agents", body).await?;
    Ok(a["id"].as_str().context("agent id")?.to_string())
}

async fn start_session(stack: &Stack, agent: &str, input: &str) -> Result<String> {
    let s = stack
        .api
        .post(
            "/v1/sessions",
            json!({"agent_id": agent, "environment": "local", "input": input}),
        )
        .await?;
    Ok(s["id"].as_str().context("session id")?.to_string())
}

/// Waits (one read every 100 ms) until every input of the session has an outcome.
async fn wait_outcome(pg: &sqlx::PgPool, session: uuid::Uuid, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM session_inputs i WHERE i.session_id = $1
             AND NOT EXISTS (SELECT 1 FROM session_outcomes o WHERE o.input_id = i.id)",
        )
        .bind(session)
        .fetch_one(pg)
        .await?;
        if open == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("session {session} did not finish within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const SESSION_TABLES: [&str; 6] = [
    "session_inputs",
    "session_state",
    "session_outcomes",
    "session_messages",
    "session_tool_calls",
    "session_events",
];

async fn relation_bytes(pg: &sqlx::PgPool) -> Result<i64> {
    let mut total = 0;
    for t in SESSION_TABLES {
        let b: i64 = sqlx::query_scalar(&format!("SELECT pg_total_relation_size('{t}')"))
            .fetch_one(pg)
            .await?;
        total += b;
    }
    Ok(total)
}

/// Bytes of the session's rows, per table (`pg_column_size` of each whole row).
async fn row_bytes(
    pg: &sqlx::PgPool,
    session: uuid::Uuid,
) -> Result<serde_json::Map<String, Value>> {
    let mut out = serde_json::Map::new();
    let mut total = 0i64;
    for t in SESSION_TABLES {
        let b: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT sum(pg_column_size(x.*))::int8 FROM {t} x WHERE x.session_id = $1"
        ))
        .bind(session)
        .fetch_one(pg)
        .await?;
        total += b.unwrap_or(0);
        out.insert(t.to_string(), json!(b.unwrap_or(0)));
    }
    out.insert("total".into(), json!(total));
    Ok(out)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// A new directory (0755) for a stamp any session's uid may run.
fn stamp_dir() -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!(
        "agentscope-bench-stamp-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

/// One input whose model calls an instant tool (`read_file` of a small file, `local`
/// environment) `iterations` times, then answers. An iteration is the time between two model
/// requests' arrivals; its platform overhead is that minus the model server's own time.
pub async fn managed_loop(args: &LoopArgs) -> Result<Value> {
    let n = args.iterations.max(2);
    let per_turn = args.reads_per_turn.max(1);
    let mut turns =
        vec![json!({"tool": "write_file", "args": {"path": "note.txt", "content": "x"}})];
    let stamp_dir = match args.shell {
        Some(kind) => {
            let dir = stamp_dir()?;
            let cmd = crate::setup::stamp_in(&dir, kind)?
                .to_string_lossy()
                .to_string();
            turns.extend((1..n).map(|_| json!({"tool": "shell", "args": {"command": cmd}})));
            Some(dir)
        }
        None => None,
    };
    for _ in (1..n).filter(|_| stamp_dir.is_none()) {
        let also: Vec<Value> = (1..per_turn)
            .map(|k| match k % 2 {
                1 => json!({"tool": "list_files", "args": {"path": "."}}),
                _ => json!({"tool": "read_file", "args": {"path": "note.txt"}}),
            })
            .collect();
        turns.push(json!({"tool": "read_file", "args": {"path": "note.txt"}, "also": also}));
    }
    let timings: Timings = Arc::default();
    let url = model_server(json!({"turns": turns, "final": "Done."}), timings.clone()).await?;
    let stack = managed_stack("bench-w3", &url).await?;
    let pg = setup::bench_pool(&stack).await?;
    let agent = managed_agent(&stack, "looper", json!({"max_iters": n as i32 + 10})).await?;
    // Warm-up, unmeasured: a session of the same script stopped after 5 iterations.
    let warm = managed_agent(&stack, "warmup", json!({"max_iters": 5})).await?;
    let warm_id = start_session(&stack, &warm, "Warm up.").await?;
    wait_outcome(
        &pg,
        uuid::Uuid::parse_str(&warm_id)?,
        Duration::from_secs(300),
    )
    .await?;
    timings.lock().unwrap().clear();
    let rel0 = relation_bytes(&pg).await?;
    let xid0 = setup::next_xid(&pg).await?;
    let probe = Probe::start(&pg, &stack.db.name).await;
    let t0 = now_ms();
    let id = start_session(&stack, &agent, "Loop.").await?;
    let session = uuid::Uuid::parse_str(&id)?;
    wait_outcome(&pg, session, Duration::from_secs(1800)).await?;
    let cpu = probe.stop().await;
    let writes = setup::next_xid(&pg).await? - xid0;
    let rel1 = relation_bytes(&pg).await?;
    let r = sqlx::query(
        "SELECT o.status, o.iterations,
                EXTRACT(EPOCH FROM i.created_at)::float8 * 1000 AS created,
                EXTRACT(EPOCH FROM o.finished_at)::float8 * 1000 AS finished
         FROM session_inputs i JOIN session_outcomes o ON o.input_id = i.id WHERE i.session_id = $1",
    )
    .bind(session)
    .fetch_one(&pg)
    .await?;
    let status: String = r.try_get("status")?;
    let iterations: i32 = r.try_get("iterations")?;
    let created: f64 = r.try_get("created")?;
    let finished: f64 = r.try_get("finished")?;
    let calls: Vec<(String, String)> =
        sqlx::query_as("SELECT status, tool FROM session_tool_calls WHERE session_id = $1")
            .bind(session)
            .fetch_all(&pg)
            .await?;
    let completed = calls.iter().filter(|c| c.0 == "completed").count();
    let expected_calls = if stamp_dir.is_some() {
        n
    } else {
        1 + (n - 1) * per_turn
    };
    if let Some(dir) = stamp_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let t = timings.lock().unwrap().clone();
    if t.len() < n + 1 {
        bail!("{} model requests for {n} iterations", t.len());
    }
    // Iteration k: from model request k's arrival to request k+1's.
    let mut overhead = Vec::new();
    let mut model = Vec::new();
    for k in 0..n {
        overhead.push(t[k + 1].0 - t[k].0 - t[k].1);
        model.push(t[k].1);
    }
    let model_total: f64 = t.iter().map(|x| x.1).sum();
    let total_ms = finished - created;
    let rows = row_bytes(&pg, session).await?;
    let first = &overhead[..20.min(n)];
    let last = &overhead[n.saturating_sub(20)..];
    Ok(json!({
        "iterations": n,
        "outcome": status,
        "reads_per_turn": per_turn,
        "tool": if args.shell.is_some() { "shell" } else { "read_file" },
        "complete": status == "completed" && completed == expected_calls && iterations as usize >= n,
        "session_ms": num(total_ms),
        "submit_to_first_model_request_ms": num(t[0].0 - t0),
        "last_model_answer_to_outcome_ms": num(finished - (t[n].0 + t[n].1)),
        "overhead_per_iteration_ms": num((total_ms - model_total) / n as f64),
        "overhead_ms": summary(&overhead),
        "overhead_first20_ms": num(mean(first)),
        "overhead_last20_ms": num(mean(last)),
        "model_server_first20_ms": num(mean(&model[..20.min(n)])),
        "model_server_last20_ms": num(mean(&model[n.saturating_sub(20)..])),
        "iteration_first20_ms": num(mean(first) + mean(&model[..20.min(n)])),
        "iteration_last20_ms": num(mean(last) + mean(&model[n.saturating_sub(20)..])),
        "write_transactions_per_iteration": num(writes as f64 / n as f64),
        "stored_row_bytes": rows,
        "stored_mb_per_200_iterations": num(rows["total"].as_f64().unwrap_or(0.0) / 1e6 * 200.0 / n as f64),
        "relation_growth_bytes": rel1 - rel0,
        "cpu_per_iteration_ms": crate::w1::cpu_per(&cpu, n as f64),
    }))
}

/// One input whose model calls `shell` (policy `ask`) `approvals` times; each request is approved
/// as soon as it is pending. The tool is `agentscope-bench-stamp`, which reads the wall clock
/// first thing: decision (just before `POST approve`) → tool started.
pub async fn approvals(args: &ApprovalArgs) -> Result<Value> {
    let timings: Timings = Arc::default();
    // The script names the tool's command before the stack exists: a copy any uid may run.
    let dir = stamp_dir()?;
    let link = crate::setup::stamp_in(&dir, args.stamp)?;
    let cmd = link.to_string_lossy().to_string();
    let turns: Vec<Value> = (0..args.approvals)
        .map(|_| json!({"tool": "shell", "args": {"command": cmd}}))
        .collect();
    let url = model_server(json!({"turns": turns, "final": "Done."}), timings.clone()).await?;
    let stack = managed_stack("bench-w4", &url).await?;
    let pg = setup::bench_pool(&stack).await?;
    let agent = managed_agent(
        &stack,
        "asker",
        json!({"policy": {"tools": {"shell": "ask"}}, "max_iters": args.approvals as i32 + 10}),
    )
    .await?;
    let id = start_session(&stack, &agent, "Stamp.").await?;
    let session = uuid::Uuid::parse_str(&id)?;
    let mut decided: Vec<(String, f64, f64)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while decided.len() < args.approvals {
        let page = stack
            .api
            .get(&format!("/v1/approvals?session_id={id}&status=pending"))
            .await?;
        let pending = page["items"]
            .as_array()
            .and_then(|a| a.first())
            .filter(|a| !seen.contains(a["id"].as_str().unwrap_or("")))
            .cloned();
        let Some(ap) = pending else {
            if Instant::now() > deadline {
                bail!("approval {} did not come", decided.len() + 1);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let ap_id = ap["id"].as_str().context("approval id")?.to_string();
        let request = ap["request_id"].as_str().context("request id")?.to_string();
        let t0 = now_ms();
        let c = Instant::now();
        stack
            .api
            .post(&format!("/v1/approvals/{ap_id}/approve"), json!({}))
            .await?;
        decided.push((request, t0, c.elapsed().as_secs_f64() * 1000.0));
        seen.insert(ap_id);
    }
    wait_outcome(&pg, session, Duration::from_secs(600)).await?;
    let _ = std::fs::remove_dir_all(&dir);
    let calls: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT call_id, status, output FROM session_tool_calls WHERE session_id = $1",
    )
    .bind(session)
    .fetch_all(&pg)
    .await?;
    let mut to_start = Vec::new();
    let mut approve_call = Vec::new();
    let mut ran = 0;
    for (request, t0, call_ms) in &decided {
        approve_call.push(*call_ms);
        let Some(c) = calls.iter().find(|c| &c.0 == request) else {
            continue;
        };
        let stamps = c.2.as_deref().unwrap_or("").matches("stamp ").count();
        if c.1 == "completed" && stamps == 1 {
            ran += 1;
        }
        if let Some(s) = c.2.as_deref().and_then(setup::stamp_ms) {
            to_start.push(s - t0);
        }
    }
    Ok(json!({
        "approvals": args.approvals,
        "every_approved_tool_ran_once": ran == args.approvals && calls.len() == args.approvals,
        "decision_to_tool_started_ms": summary(&to_start),
        "approve_call_ms": summary(&approve_call),
        "model_requests": timings.lock().unwrap().len(),
    }))
}
