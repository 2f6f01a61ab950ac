//! Self-hosted sessions on one Worker: each session's commands run under its own identity in the
//! Worker's sandbox, so one session cannot read another's directory on that machine.

use crate::managed::{
    managed_agent, managed_stack_with, session_events, spawn_worker, start_on_worker, wait_outcomes,
};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_on_one_worker_cannot_read_each_others_files() {
    // Every session writes a secret named after its own directory, then looks for the others'.
    let probe = "echo \"secret-$(basename \"$PWD\")\" > mine.txt; \
                 echo me=$(id -u); \
                 for f in ../*/mine.txt; do [ -r \"$f\" ] && echo \"READ $f: $(cat \"$f\")\"; done; \
                 echo siblings: $(ls -A .. 2>&1 | tr '\\n' ' '); echo probe-done";
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": probe}, "expect": "probe-done"}
        ],
        "final": "Done."
    });
    let (stack, _sim, _log, _simdir, _second) =
        managed_stack_with("iso-worker", &script, &[]).await;
    let agent = managed_agent(&stack, "prober", json!({})).await;
    let worker_dir = stack.dir.path.join("worker-shared");
    let _worker = spawn_worker(&stack, "shared", &worker_dir).await;
    let a = start_on_worker(&stack, &agent, "shared", "Probe.").await;
    wait_outcomes(&stack, &a, 1).await;
    let b = start_on_worker(&stack, &agent, "shared", "Probe.").await;
    let s = wait_outcomes(&stack, &b, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let output = |events: &[serde_json::Value]| -> String {
        events
            .iter()
            .filter(|e| e["kind"] == "tool_result")
            .map(|e| e["payload"].to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let out_a = output(&session_events(&stack, &a).await);
    let out_b = output(&session_events(&stack, &b).await);
    assert!(out_b.contains("probe-done"), "{out_b}");
    assert!(
        !out_b.contains(&format!("secret-{a}")),
        "session B read session A's file: {out_b}"
    );
    assert!(
        !out_b.contains(&a),
        "session B can see session A's directory: {out_b}"
    );
    assert!(!out_a.contains(&b), "{out_a}");
    // Each ran as its own non-root uid.
    let uid = |out: &str| -> String {
        out.split("me=")
            .nth(1)
            .map(|r| r.chars().take_while(|c| c.is_ascii_digit()).collect())
            .unwrap_or_default()
    };
    let (ua, ub) = (uid(&out_a), uid(&out_b));
    assert!(!ua.is_empty() && !ub.is_empty(), "{out_a}\n{out_b}");
    assert_ne!(ua, ub, "two sessions share a uid");
    assert_ne!(ua, "0", "a session's commands run as root");
    // The secrets are there on the Worker's disk, each in its own directory.
    let a_secret = std::fs::read_to_string(worker_dir.join(&a).join("mine.txt")).unwrap();
    assert_eq!(a_secret.trim(), format!("secret-{a}"));
}
