//! `agentscope-bench`: the project's performance record (issue 12's workloads), through the
//! whole system as users drive it: the public HTTP API, real services, hosts, nats-server and
//! PostgreSQL (the test harness's `Stack`), with the database read only for timestamps.
//!
//!     cargo build --release --workspace --bins
//!     AGENTSCOPE_BIN_DIR=$CARGO_TARGET_DIR/release $CARGO_TARGET_DIR/release/agentscope-bench \
//!         --rounds 3 all > bench.json
//!
//! Workloads (subcommands): `low` and `bulk` (W1 dispatch), `ingest` and `sse` (W2 events),
//! `loop` (W3 managed loop), `approvals` (W4), `rss` (idle memory), `all` (each in turn, rounds
//! interleaved). JSON on stdout (each figure per round and its median across rounds), a summary
//! on stderr. docs/BENCHMARKS.md says what each figure measures.

mod cpu;
mod machine;
mod managed;
mod rss;
mod setup;
mod stats;
mod targets;
mod w1;
mod w2;

use anyhow::Result;
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    name = "agentscope-bench",
    about = "The performance record of agentscope"
)]
struct Args {
    /// Rounds of each workload (a fresh stack each); figures are medians across rounds.
    #[arg(long, global = true, default_value_t = 1)]
    rounds: usize,
    #[command(subcommand)]
    workload: Workload,
}

#[derive(Subcommand)]
enum Workload {
    /// W1 low load: one task at a time, submit → provider started.
    Low(w1::LowArgs),
    /// W1 bulk: many no-op tasks, many submitters, hosts × slots.
    Bulk(w1::BulkArgs),
    /// W2 ingest: one attempt printing many lines, until all are recorded.
    Ingest(w2::IngestArgs),
    /// W2 followers: SSE clients of one task, delivery latency and completeness.
    Sse(w2::SseArgs),
    /// W3: a managed session's loop with an instant model and tool.
    Loop(managed::LoopArgs),
    /// W4: approval decision → tool started.
    Approvals(managed::ApprovalArgs),
    /// Idle memory of each service after start-up.
    Rss(rss::RssArgs),
    /// Every workload, rounds interleaved.
    All(AllArgs),
}

#[derive(clap::Args, Clone, Debug)]
struct AllArgs {
    #[arg(long, default_value_t = 200)]
    low_tasks: usize,
    #[arg(long, default_value_t = 5000)]
    bulk_tasks: usize,
    #[arg(long, default_value_t = 100_000)]
    ingest_lines: u64,
    #[arg(long, default_value_t = 100)]
    followers: usize,
    #[arg(long, default_value_t = 5000)]
    sse_lines: u64,
    #[arg(long, default_value_t = 200)]
    iterations: usize,
    #[arg(long, default_value_t = 50)]
    approvals: usize,
    /// Workloads to leave out (comma-separated names: low,bulk,ingest,sse,loop,approvals,rss).
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
}

enum One {
    Low(w1::LowArgs),
    Bulk(w1::BulkArgs),
    Ingest(w2::IngestArgs),
    Sse(w2::SseArgs),
    Loop(managed::LoopArgs),
    Approvals(managed::ApprovalArgs),
    Rss(rss::RssArgs),
}

impl One {
    fn name(&self) -> &'static str {
        match self {
            One::Low(_) => "w1_low",
            One::Bulk(_) => "w1_bulk",
            One::Ingest(_) => "w2_ingest",
            One::Sse(_) => "w2_sse",
            One::Loop(_) => "w3_loop",
            One::Approvals(_) => "w4_approvals",
            One::Rss(_) => "idle_rss",
        }
    }

    async fn run(&self) -> Result<Value> {
        match self {
            One::Low(a) => w1::low(a).await,
            One::Bulk(a) => w1::bulk(a).await,
            One::Ingest(a) => w2::ingest(a).await,
            One::Sse(a) => w2::sse(a).await,
            One::Loop(a) => managed::managed_loop(a).await,
            One::Approvals(a) => managed::approvals(a).await,
            One::Rss(a) => rss::idle(a).await,
        }
    }

    fn params(&self) -> String {
        match self {
            One::Low(a) => format!("{a:?}"),
            One::Bulk(a) => format!("{a:?}"),
            One::Ingest(a) => format!("{a:?}"),
            One::Sse(a) => format!("{a:?}"),
            One::Loop(a) => format!("{a:?}"),
            One::Approvals(a) => format!("{a:?}"),
            One::Rss(a) => format!("{a:?}"),
        }
    }
}

/// The figures worth a line on stderr, by workload.
fn headline(name: &str, v: &Value) -> String {
    let g = |path: &str| -> String {
        let mut cur = v;
        for k in path.split('.') {
            cur = &cur[k];
        }
        match cur {
            Value::Null => "-".into(),
            other => other.to_string(),
        }
    };
    let figures = match name {
        "w1_low" => format!(
            "submit→provider started p50 {} p99 {} ms; committed {}; claims/task {}; CPU/task {} ms",
            g("submit_to_provider_started_ms.p50"),
            g("submit_to_provider_started_ms.p99"),
            g("all_state_changes_committed"),
            g("claim_requests.per_task"),
            g("cpu_per_task.total_ms")
        ),
        "w1_bulk" => format!(
            "{} attempts/s; submit→started p50 {} p99 {} ms; CPU/attempt {} ms ({} beyond the provider's own start); claims/task {} ({} empty); committed {}",
            g("attempts_per_s"),
            g("submit_to_host_running_event_ms.p50"),
            g("submit_to_host_running_event_ms.p99"),
            g("cpu_per_attempt.total_ms"),
            g("cpu_per_attempt.beyond_provider_start_ms"),
            g("claim_requests.per_task"),
            g("claim_requests.empty_share"),
            g("all_state_changes_committed")
        ),
        "w2_ingest" => format!(
            "{} events/s recorded durably ({} s for {} lines; host emitted {}/s); complete {}",
            g("events_per_s"),
            g("provider_start_to_all_recorded_s"),
            g("lines"),
            g("host_events_per_s"),
            g("complete")
        ),
        "w2_sse" => format!(
            "burst: delivery after emission p50 {} p99 {} ms, after commit p50 {} p99 {} ms; steady {}/s: after emission p50 {} p99 {} ms; every follower complete and in order: {} {}",
            g("delivery_after_host_emitted_ms.p50"),
            g("delivery_after_host_emitted_ms.p99"),
            g("delivery_after_commit_ms.p50"),
            g("delivery_after_commit_ms.p99"),
            g("steady.lines_per_s"),
            g("steady.delivery_after_host_emitted_ms.p50"),
            g("steady.delivery_after_host_emitted_ms.p99"),
            g("every_follower_got_every_event_once_in_order"),
            g("steady.every_follower_got_every_event_once_in_order")
        ),
        "w3_loop" => format!(
            "overhead {} ms/iter (first 20 {} → last 20 {}); model server {} → {} ms; {} MB per 200 iterations; complete {}",
            g("overhead_per_iteration_ms"),
            g("overhead_first20_ms"),
            g("overhead_last20_ms"),
            g("model_server_first20_ms"),
            g("model_server_last20_ms"),
            g("stored_mb_per_200_iterations"),
            g("complete")
        ),
        "w4_approvals" => format!(
            "decision→tool started p50 {} p99 {} ms (approve call p50 {} ms); every tool ran once {}",
            g("decision_to_tool_started_ms.p50"),
            g("decision_to_tool_started_ms.p99"),
            g("approve_call_ms.p50"),
            g("every_approved_tool_ran_once")
        ),
        "idle_rss" => v["processes"]
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, p)| format!("{k} {} MiB ({} anon)", p["rss_mib"], p["rss_anon_mib"]))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default(),
        _ => String::new(),
    };
    let m = &v["machine"];
    match (&m["wakeup_round_trip_us"], &m["fdatasync_us"]) {
        (Value::Object(w), Value::Object(f)) => format!(
            "{figures}; machine: wake-up round trip p50 {} µs, fdatasync p50 {} µs, CPU pass {} ms, syscall pair {} µs, `true` started p50 {} µs of CPU ({} µs), stolen during the round {} % ({} ms)",
            w["p50"],
            f["p50"],
            m["cpu_hash_ms"],
            m["syscall_pair_us"],
            m["program_start_us"]["cpu"]["p50"],
            m["program_start_us"]["wall"]["p50"],
            m["steal_during_round"]["share"]
                .as_f64()
                .map_or("-".into(), |s| format!("{:.2}", s * 100.0)),
            m["steal_during_round"]["ms"]
        ),
        _ => figures,
    }
}

/// W1 bulk with `true` as its provider: the stack's CPU per attempt beside the price of starting
/// `true` itself on this machine at the time (the machine's `program_start_us`), which no part of
/// the stack can lower: `cpu_per_attempt.beyond_provider_start_ms`.
fn beyond_provider_start(v: &mut Value) {
    if v["provider"] != "true" {
        return;
    }
    let (Some(total), Some(start_us)) = (
        v["cpu_per_attempt"]["total_ms"].as_f64(),
        v["machine"]["program_start_us"]["cpu"]["p50"].as_f64(),
    ) else {
        return;
    };
    v["cpu_per_attempt"]["beyond_provider_start_ms"] = stats::num(total - start_us / 1000.0);
}

fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let plan: Vec<One> = match args.workload {
        Workload::Low(a) => vec![One::Low(a)],
        Workload::Bulk(a) => vec![One::Bulk(a)],
        Workload::Ingest(a) => vec![One::Ingest(a)],
        Workload::Sse(a) => vec![One::Sse(a)],
        Workload::Loop(a) => vec![One::Loop(a)],
        Workload::Approvals(a) => vec![One::Approvals(a)],
        Workload::Rss(a) => vec![One::Rss(a)],
        Workload::All(a) => vec![
            One::Rss(rss::RssArgs { settle_s: 3 }),
            One::Low(w1::LowArgs {
                tasks: a.low_tasks,
                warmup: 10,
                hosts: 1,
                capacity: 4,
                stamp: setup::Stamp::Glibc,
                gap_ms: 0,
            }),
            One::Bulk(w1::BulkArgs {
                tasks: a.bulk_tasks,
                hosts: 4,
                capacity: 32,
                submitters: 32,
                provider: w1::NoOp::True,
            }),
            One::Ingest(w2::IngestArgs {
                lines: a.ingest_lines,
            }),
            One::Sse(w2::SseArgs {
                followers: a.followers,
                lines: a.sse_lines,
                steady_lines: 2000,
                steady_rate: 1000,
            }),
            One::Loop(managed::LoopArgs {
                iterations: a.iterations,
                reads_per_turn: 1,
                shell: None,
            }),
            One::Approvals(managed::ApprovalArgs {
                approvals: a.approvals,
                stamp: setup::Stamp::Glibc,
            }),
        ]
        .into_iter()
        .filter(|w| {
            !a.skip.iter().any(|s| {
                w.name()
                    .trim_start_matches(|c| c != '_')
                    .trim_start_matches('_')
                    == s
            })
        })
        .collect(),
    };
    let build = if cfg!(debug_assertions) {
        eprintln!("warning: a debug build of the benchmark; figures are for release builds");
        "debug"
    } else {
        "release"
    };
    let mut rounds: Vec<Vec<Value>> = plan.iter().map(|_| Vec::new()).collect();
    let mut errors: Vec<Vec<String>> = plan.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds.max(1) {
        for (i, w) in plan.iter().enumerate() {
            eprintln!("[{round}/{}] {} {}", args.rounds, w.name(), w.params());
            // The machine's prices just before the round, to read its figures by, and what the
            // hypervisor took from it during the round.
            let machine = machine::probe().await;
            let steal = machine::Steal::start();
            match w.run().await {
                Ok(mut v) => {
                    if let (Ok(mut m), Some(o)) = (machine, v.as_object_mut()) {
                        m["steal_during_round"] = steal.finish();
                        o.insert("machine".into(), m);
                    }
                    beyond_provider_start(&mut v);
                    eprintln!("    {}", headline(w.name(), &v));
                    rounds[i].push(v);
                }
                Err(e) => {
                    eprintln!("    failed: {e:#}");
                    errors[i].push(format!("round {round}: {e:#}"));
                }
            }
        }
    }
    let mut workloads = serde_json::Map::new();
    eprintln!("medians over {} round(s):", args.rounds);
    for (i, w) in plan.iter().enumerate() {
        let median = stats::median(&rounds[i]);
        eprintln!("  {}: {}", w.name(), headline(w.name(), &median));
        workloads.insert(
            w.name().into(),
            json!({"params": w.params(), "median": median, "rounds": rounds[i], "errors": errors[i]}),
        );
    }
    // Issue 12's targets against these medians.
    let targets = targets::evaluate(&workloads);
    let met = targets.iter().filter(|t| t["met"] == true).count();
    eprintln!(
        "issue 12's targets in these medians: {met} of {} met",
        targets.len()
    );
    for t in &targets {
        eprintln!("  {}", targets::line(t));
    }
    let out = json!({
        "benchmark": "agentscope-bench",
        "build": build,
        "commit": git_commit(),
        "at": chrono::Utc::now().to_rfc3339(),
        "rounds": args.rounds,
        "workloads": workloads,
        "targets": {"met": met, "of": targets.len(), "each": targets},
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    if errors.iter().any(|e| !e.is_empty()) {
        std::process::exit(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// With `true` as the provider, the stack's CPU per attempt beyond the price of starting
    /// `true` is the total less that price; with the bare provider, or without the price, there
    /// is no such figure.
    #[test]
    fn the_cpu_beyond_the_providers_own_start_is_read_against_the_machines_price() {
        let round = |provider: &str, start: serde_json::Value| {
            json!({
                "provider": provider,
                "cpu_per_attempt": {"total_ms": 1.9},
                "machine": {"program_start_us": {"cpu": {"p50": start}}},
            })
        };
        let mut v = round("true", json!(700.0));
        super::beyond_provider_start(&mut v);
        assert_eq!(v["cpu_per_attempt"]["beyond_provider_start_ms"], json!(1.2));
        for mut v in [round("bare", json!(700.0)), round("true", json!(null))] {
            super::beyond_provider_start(&mut v);
            assert!(
                v["cpu_per_attempt"]
                    .get("beyond_provider_start_ms")
                    .is_none(),
                "{v}"
            );
        }
    }
}
