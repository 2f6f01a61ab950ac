//! Issue 12's targets, read against a run's medians: which of them this run met, on this machine,
//! at this time. Each target names a figure of one workload; a run without that workload, or a
//! figure the run could not take (null), leaves the target out. W1 low's figure is read as
//! measured: with `--stamp bare` it ends at the provider's `execve`, as docs/BENCHMARKS.md reads
//! the target; with the default glibc stamp it also holds the program's own loading.

use serde_json::{Value, json};

enum Limit {
    AtMost(f64),
    AtLeast(f64),
    True,
}

struct Target {
    workload: &'static str,
    what: &'static str,
    figure: &'static [&'static str],
    limit: Limit,
    unit: &'static str,
}

const fn t(
    workload: &'static str,
    what: &'static str,
    figure: &'static [&'static str],
    limit: Limit,
    unit: &'static str,
) -> Target {
    Target {
        workload,
        what,
        figure,
        limit,
        unit,
    }
}

/// 30 MB (the unit) in MiB (the benchmark's).
const RSS_LIMIT_MIB: f64 = 30.0e6 / 1_048_576.0;

const TARGETS: &[Target] = &[
    t(
        "w1_low",
        "submit → provider started p50",
        &["submit_to_provider_started_ms", "p50"],
        Limit::AtMost(2.0),
        "ms",
    ),
    t(
        "w1_low",
        "submit → provider started p99",
        &["submit_to_provider_started_ms", "p99"],
        Limit::AtMost(5.0),
        "ms",
    ),
    t(
        "w1_low",
        "every state change committed",
        &["all_state_changes_committed"],
        Limit::True,
        "",
    ),
    t(
        "w1_bulk",
        "attempts per second",
        &["attempts_per_s"],
        Limit::AtLeast(1000.0),
        "/s",
    ),
    t(
        "w1_bulk",
        "the stack's CPU per attempt",
        &["cpu_per_attempt", "total_ms"],
        Limit::AtMost(2.0),
        "ms",
    ),
    t(
        "w1_bulk",
        "claim requests per task",
        &["claim_requests", "per_task"],
        Limit::AtMost(1.5),
        "",
    ),
    t(
        "w1_bulk",
        "every state change committed",
        &["all_state_changes_committed"],
        Limit::True,
        "",
    ),
    t(
        "w2_ingest",
        "events recorded durably per second",
        &["events_per_s"],
        Limit::AtLeast(50_000.0),
        "/s",
    ),
    t(
        "w2_ingest",
        "every line recorded",
        &["complete"],
        Limit::True,
        "",
    ),
    t(
        "w2_sse",
        "100 followers, delivery after emission p99 (steady)",
        &["steady", "delivery_after_host_emitted_ms", "p99"],
        Limit::AtMost(10.0),
        "ms",
    ),
    t(
        "w2_sse",
        "every follower gets every event once, in order (burst)",
        &["every_follower_got_every_event_once_in_order"],
        Limit::True,
        "",
    ),
    t(
        "w2_sse",
        "every follower gets every event once, in order (steady)",
        &["steady", "every_follower_got_every_event_once_in_order"],
        Limit::True,
        "",
    ),
    t(
        "w3_loop",
        "platform overhead per iteration",
        &["overhead_per_iteration_ms"],
        Limit::AtMost(1.0),
        "ms",
    ),
    t(
        "w3_loop",
        "platform overhead, first 20 iterations",
        &["overhead_first20_ms"],
        Limit::AtMost(1.0),
        "ms",
    ),
    t(
        "w3_loop",
        "platform overhead, last 20 iterations",
        &["overhead_last20_ms"],
        Limit::AtMost(1.0),
        "ms",
    ),
    t(
        "w3_loop",
        "stored per 200 iterations",
        &["stored_mb_per_200_iterations"],
        Limit::AtMost(1.0),
        "MB",
    ),
    t(
        "w4_approvals",
        "approval decision → tool started p50",
        &["decision_to_tool_started_ms", "p50"],
        Limit::AtMost(2.0),
        "ms",
    ),
];

/// The targets `workloads` (workload name → `{"median": …}`) bear on, each with its value and
/// whether it was met; idle RSS is one target per service.
pub fn evaluate(workloads: &serde_json::Map<String, Value>) -> Vec<Value> {
    let mut out = Vec::new();
    for t in TARGETS {
        let Some(w) = workloads.get(t.workload) else {
            continue;
        };
        let v = t.figure.iter().fold(&w["median"], |v, k| &v[*k]);
        let (met, limit) = match (&t.limit, v) {
            (Limit::AtMost(l), Value::Number(n)) => (n.as_f64().map(|x| x <= *l), json!(l)),
            (Limit::AtLeast(l), Value::Number(n)) => (n.as_f64().map(|x| x >= *l), json!(l)),
            (Limit::True, Value::Bool(b)) => (Some(*b), json!(true)),
            _ => continue,
        };
        let Some(met) = met else { continue };
        let bound = match t.limit {
            Limit::AtMost(_) => "at most",
            Limit::AtLeast(_) => "at least",
            Limit::True => "",
        };
        out.push(json!({
            "workload": t.workload,
            "target": t.what,
            "value": v,
            "limit": limit,
            "bound": bound,
            "unit": t.unit,
            "met": met,
        }));
    }
    if let Some(Value::Object(ps)) = workloads.get("idle_rss").map(|w| &w["median"]["processes"]) {
        // The services' (the broker is not one of them).
        for (name, p) in ps.iter().filter(|(n, _)| n.starts_with("svc-")) {
            if let Some(mib) = p["rss_mib"].as_f64() {
                out.push(json!({
                    "workload": "idle_rss",
                    "target": format!("{name} resident when idle"),
                    "value": mib,
                    "limit": crate::stats::num(RSS_LIMIT_MIB),
                    "bound": "at most",
                    "unit": "MiB (30 MB)",
                    "met": mib <= RSS_LIMIT_MIB,
                }));
            }
        }
    }
    out
}

/// One line per target for stderr.
pub fn line(t: &Value) -> String {
    let mark = if t["met"] == true {
        "met    "
    } else {
        "not met"
    };
    let limit = match t["bound"].as_str() {
        Some("") | None => String::new(),
        Some(b) => format!(" ({b} {} {})", t["limit"], t["unit"].as_str().unwrap_or("")),
    };
    format!(
        "{mark} {}: {}: {}{limit}",
        t["workload"].as_str().unwrap_or(""),
        t["target"].as_str().unwrap_or(""),
        t["value"]
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// Each target of a workload in the run is read from its median and judged by its bound;
    /// a workload not run, or a figure not taken, leaves its targets out.
    #[test]
    fn targets_are_judged_from_the_medians_of_the_workloads_run() {
        let w = json!({
            "w1_low": {"median": {
                "submit_to_provider_started_ms": {"p50": 1.9, "p99": 5.2},
                "all_state_changes_committed": true,
            }},
            "w1_bulk": {"median": {
                "attempts_per_s": 1000.0,
                "cpu_per_attempt": {"total_ms": 2.5},
                "claim_requests": {"per_task": null},
                "all_state_changes_committed": false,
            }},
            "idle_rss": {"median": {"processes": {
                "svc-host": {"rss_mib": 10.4},
                "svc-gateway": {"rss_mib": 29.0},
                "nats-server": {"rss_mib": 40.0},
            }}},
        });
        let got = super::evaluate(w.as_object().unwrap());
        let met = |workload: &str, target: &str| {
            got.iter()
                .find(|t| t["workload"] == workload && t["target"] == target)
                .map(|t| t["met"].as_bool().unwrap())
        };
        assert_eq!(met("w1_low", "submit → provider started p50"), Some(true));
        assert_eq!(met("w1_low", "submit → provider started p99"), Some(false));
        assert_eq!(met("w1_low", "every state change committed"), Some(true));
        assert_eq!(met("w1_bulk", "attempts per second"), Some(true));
        assert_eq!(met("w1_bulk", "the stack's CPU per attempt"), Some(false));
        assert_eq!(met("w1_bulk", "claim requests per task"), None);
        assert_eq!(met("w1_bulk", "every state change committed"), Some(false));
        assert_eq!(met("idle_rss", "svc-host resident when idle"), Some(true));
        // 29 MiB is 30.4 MB.
        assert_eq!(
            met("idle_rss", "svc-gateway resident when idle"),
            Some(false)
        );
        assert!(got.iter().all(|t| t["workload"] != "w3_loop"), "{got:?}");
        assert_eq!(met("idle_rss", "nats-server resident when idle"), None);
        assert_eq!(got.len(), 8, "{got:?}");
        assert!(
            super::line(&got[1])
                .starts_with("not met w1_low: submit → provider started p99: 5.2 (at most 5.0 ms)"),
            "{}",
            super::line(&got[1])
        );
    }
}
