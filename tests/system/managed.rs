//! Managed execution: svc-dataplane runs the model/tool loop itself against the scripted model
//! server (Anthropic Messages, streaming), in the `local` and `sandbox` (bubblewrap)
//! environments, with a journal that survives a replica's death.

use crate::agents::modelsim;
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::Duration;

/// A stack with two dataplane replicas (`dp-0`, the stack's, and `dp-1`, returned last) that talk
/// to a scripted model server running `script`; also the model server, its request log and dir.
type Managed = (
    Stack,
    kit::Proc,
    std::path::PathBuf,
    kit::TempDir,
    kit::Proc,
);

async fn managed_stack(label: &str, script: &Value) -> Managed {
    managed_stack_with(label, script, &[]).await
}

/// [`managed_stack`] with more dataplane settings (later ones win). The `local` and `remote`
/// environments are enabled (gateway and dataplane): some tests use them on purpose (a tool
/// waiting on a host file, shared storage); the rest use the default, `sandbox`.
pub(crate) async fn managed_stack_with(
    label: &str,
    script: &Value,
    extra: &[(&str, &str)],
) -> Managed {
    let simdir = kit::TempDir::new(&format!("{label}-model"));
    let (sim, url, log) = modelsim(&simdir.path, script).await;
    let allow_local = (
        "AGENTSCOPE_ALLOW_LOCAL_ENVIRONMENT".to_string(),
        "true".to_string(),
    );
    let mut dataplane_env: Vec<(String, String)> = vec![
        ("AGENTSCOPE_MODEL_API".into(), "anthropic".into()),
        ("AGENTSCOPE_MODEL_BASE_URL".into(), url),
        ("AGENTSCOPE_MODEL_API_KEY".into(), "sk-modelsim".into()),
        allow_local.clone(),
    ];
    dataplane_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let stack = Stack::start(
        label,
        StackOptions {
            dataplane_env,
            gateway_env: vec![allow_local],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let second = stack.spawn_dataplane("dp-1").await.unwrap();
    (stack, sim, log, simdir, second)
}

/// Kills (SIGKILL) the dataplane replica named `holder`: the stack's own (`dp-0`) or `other`.
pub(crate) fn kill_replica(stack: &mut Stack, other: &mut kit::Proc, holder: &str) {
    if holder == "dp-0" {
        stack.dataplane.kill9();
    } else {
        other.kill9();
    }
}

/// After a takeover: the session's `events` are numbered without a gap or a repeat, and a
/// replica other than `holder` holds the session.
async fn finished_elsewhere(stack: &Stack, id: &str, holder: &str, events: &[Value]) {
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "no duplicated or missing events"
    );
    let state: (String,) =
        sqlx::query_as("SELECT replica FROM session_state WHERE session_id = $1::uuid")
            .bind(id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    assert_ne!(state.0, holder, "the other replica finished the session");
}

pub(crate) async fn managed_agent(stack: &Stack, name: &str, extra: Value) -> String {
    let mut body =
        json!({"name": name, "provider": "managed", "instructions": format!("You are {name}.")});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    let a = stack.api.post("/v1/agents", body).await.unwrap();
    a["id"].as_str().unwrap().to_string()
}

pub(crate) async fn start_session(
    stack: &Stack,
    agent: &str,
    environment: &str,
    input: &str,
) -> String {
    let s = stack
        .api
        .post(
            "/v1/sessions",
            json!({"agent_id": agent, "environment": environment, "input": input}),
        )
        .await
        .unwrap();
    s["id"].as_str().unwrap().to_string()
}

/// Waits until every input of the session has an outcome; returns the session.
pub(crate) async fn wait_outcomes(stack: &Stack, id: &str, n: usize) -> Value {
    let api = stack.api.clone();
    let path = format!("/v1/sessions/{id}");
    kit::wait_for("the session's outcomes", Duration::from_secs(90), || {
        let api = api.clone();
        let path = path.clone();
        async move {
            let s = api.get(&path).await.ok()?;
            let inputs = s["inputs"].as_array()?;
            (inputs.len() >= n && inputs.iter().all(|i| !i["outcome"].is_null())).then_some(s)
        }
    })
    .await
    .unwrap()
}

/// `agentscope worker --name NAME` with a fresh worker token, its sessions under `dir`; ready.
pub(crate) async fn spawn_worker(stack: &Stack, name: &str, dir: &std::path::Path) -> kit::Proc {
    let tok = stack
        .api
        .post("/v1/worker-tokens", json!({"name": name}))
        .await
        .unwrap();
    let w = kit::Proc::spawn(
        &format!("worker-{name}"),
        &kit::bin("agentscope").unwrap(),
        &["worker", "--name", name, "--dir", dir.to_str().unwrap()],
        &[
            (
                "AGENTSCOPE_WORKER_TOKEN".into(),
                tok["token"].as_str().unwrap().into(),
            ),
            ("AGENTSCOPE_NATS_URL".into(), stack.nats.url()),
        ],
        &stack.dir.path,
    )
    .unwrap();
    let log = w.log.clone();
    let ready = format!("worker {name} ready");
    kit::wait_for("the worker to register", Duration::from_secs(30), || {
        let log = log.clone();
        let ready = ready.clone();
        async move {
            std::fs::read_to_string(&log)
                .ok()?
                .contains(&ready)
                .then_some(())
        }
    })
    .await
    .unwrap();
    w
}

pub(crate) async fn start_on_worker(
    stack: &Stack,
    agent: &str,
    worker: &str,
    input: &str,
) -> String {
    let s = stack
        .api
        .post(
            "/v1/sessions",
            json!({"agent_id": agent, "environment": "self_hosted", "worker": worker, "input": input}),
        )
        .await
        .unwrap();
    s["id"].as_str().unwrap().to_string()
}

pub(crate) async fn session_events(stack: &Stack, id: &str) -> Vec<Value> {
    stack
        .api
        .get(&format!("/v1/sessions/{id}/events"))
        .await
        .unwrap()["items"]
        .as_array()
        .unwrap()
        .clone()
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e["kind"].as_str().unwrap() {
            k @ ("tool_call" | "tool_result" | "tool_denied") => {
                format!("{k}:{}", e["payload"]["tool"].as_str().unwrap_or(""))
            }
            k => k.to_string(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_step_session_completes_alike_in_local_sandbox_and_self_hosted() {
    let script = json!({
        "turns": [
            {"say": "Reading the notes.", "tool": "read_file", "args": {"path": "notes.txt"}, "expect": "hello"},
            {"tool": "edit_file", "args": {"path": "notes.txt", "old_text": "hello", "new_text": "hello, world"}, "expect": "edited"},
            {"tool": "shell", "args": {"command": "cat notes.txt && ls"}, "expect": "hello, world"},
            {"tool": "memory_write", "args": {"text": "The release checklist lives in notes.txt"}, "expect": "remembered"},
            {"tool": "memory_search", "args": {"query": "release checklist"}, "expect": "notes.txt"},
            {"tool": "list_files", "args": {"path": ""}, "expect": "notes.txt"},
            {"tool": "comment", "args": {"text": "Notes updated."}, "expect": "written on the Issue"},
            {"tool": "upload_artifact", "args": {"path": "notes.txt", "name": "notes.md"}, "expect": "written on the Issue"}
        ],
        "final": "All steps done."
    });
    let (stack, _sim, log, _simdir, _second) = managed_stack("managed-steps", &script).await;
    let agent = managed_agent(
        &stack,
        "steps",
        json!({"capability_files": {"notes.txt": "hello"}}),
    )
    .await;
    let worker_dir = stack.dir.path.join("worker-laptop");
    let _worker = spawn_worker(&stack, "laptop", &worker_dir).await;
    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": "Update the notes", "body": "Say hello to the world."}),
        )
        .await
        .unwrap();
    let issue_id = issue["id"].as_str().unwrap();
    let mut sequences = vec![];
    for environment in ["local", "sandbox", "self_hosted"] {
        let mut body = json!({"agent_id": agent, "environment": environment, "issue_id": issue_id, "input": "Update the notes."});
        if environment == "self_hosted" {
            body["worker"] = json!("laptop");
        }
        let id = stack.api.post("/v1/sessions", body).await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let s = wait_outcomes(&stack, &id, 1).await;
        let outcome = &s["inputs"][0]["outcome"];
        assert_eq!(outcome["status"], "completed", "{environment}: {s:#}");
        assert_eq!(
            s["status"], "completed_awaiting_acceptance",
            "finishing a turn is not accepting the Issue"
        );
        // The outcome's statement marked its input answered: the sweep for sessions with work
        // reads unanswered inputs only.
        let unanswered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM session_inputs WHERE session_id = $1::uuid AND NOT answered",
        )
        .bind(&id)
        .fetch_one(&stack.pg)
        .await
        .unwrap();
        assert_eq!(unanswered, 0, "{environment}");
        let root = if environment == "self_hosted" {
            worker_dir.join(&id)
        } else {
            stack.dir.path.join("sessions").join(&id)
        };
        let notes = std::fs::read_to_string(root.join("notes.txt")).unwrap();
        assert_eq!(notes, "hello, world", "{environment}");
        let events = session_events(&stack, &id).await;
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "assistant_message"
                    && e["payload"]["text"] == "All steps done."),
            "{events:#?}"
        );
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
        sequences.push(kinds(&events));
    }
    assert_eq!(
        sequences[0], sequences[1],
        "the same event sequence in local and sandbox"
    );
    assert_eq!(
        sequences[0], sequences[2],
        "the same event sequence in local and self_hosted"
    );
    let comments = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap();
    let bodies: Vec<&str> = comments["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["body"].as_str())
        .collect();
    assert_eq!(bodies, ["Notes updated."; 3], "{comments:#}");
    let artifacts = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/artifacts"))
        .await
        .unwrap();
    let items = artifacts["items"].as_array().unwrap();
    assert_eq!(items.len(), 3, "{artifacts:#}");
    for a in items {
        assert_eq!(a["name"], "notes.md");
        let body = stack
            .api
            .artifact_content(a["id"].as_str().unwrap())
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(body, "hello, world");
    }
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains("SCRIPT EXPECTATION FAILED"),
        "every step saw what it expected"
    );
    assert!(
        requests.contains("You are steps."),
        "the agent's instructions reached the model"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_iters_stops_a_looping_model_and_a_denied_tool_is_reported() {
    let mut turns = vec![json!({"tool": "shell", "args": {"command": "rm -rf precious"}})];
    for _ in 0..6 {
        turns.push(json!({"tool": "shell", "args": {"command": "echo again"}}));
    }
    let script = json!({"turns": turns, "final": "Stopped looping."});
    let (stack, _sim, log, _simdir, _second) = managed_stack("managed-limits", &script).await;
    let looping = managed_agent(&stack, "looper", json!({"max_iters": 3})).await;
    let careful = managed_agent(
        &stack,
        "careful",
        json!({"policy": {"rules": [{"tool": "shell", "match": "rm *", "decision": "deny"}]}}),
    )
    .await;

    let id = start_session(&stack, &looping, "sandbox", "Loop.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    let o = &s["inputs"][0]["outcome"];
    assert_eq!(
        (o["status"].as_str(), o["iterations"].as_i64()),
        (Some("max_iterations"), Some(3)),
        "{s:#}"
    );
    assert_eq!(s["status"], "max_iterations");

    let id = start_session(&stack, &careful, "sandbox", "Clean up.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "tool_denied", "{s:#}");
    let events = session_events(&stack, &id).await;
    let denied: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "tool_denied")
        .collect();
    assert_eq!(denied.len(), 1, "{events:#?}");
    assert_eq!(denied[0]["payload"]["input"]["command"], "rm -rf precious");
    assert!(
        events.iter().filter(|e| e["kind"] == "tool_result").count() >= 6,
        "the other commands ran"
    );
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests.contains("tool_denied: the agent's tool policy denies this call"),
        "the model was told"
    );
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT status FROM session_tool_calls WHERE session_id = $1::uuid AND tool = 'shell' AND input->>'command' LIKE 'rm%'",
    )
    .bind(&id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert_eq!(rows, [("denied".to_string(),)], "recorded as denied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saving_the_agent_does_not_change_a_running_session() {
    let simdir = kit::TempDir::new("managed-pin-gate");
    let release = simdir.path.join("release");
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": format!("while [ ! -e {} ]; do sleep 0.05; done; echo released", release.display())}, "expect": "released"}],
        "final": "Done."
    });
    let (stack, _sim, log, _simdir, _second) = managed_stack("managed-pin", &script).await;
    let agent = managed_agent(
        &stack,
        "pinned",
        json!({"instructions": "Version one instructions."}),
    )
    .await;
    let id = start_session(&stack, &agent, "local", "Wait for it.").await;
    let pg = stack.pg.clone();
    let sid = id.clone();
    kit::wait_for("the blocking tool to start", Duration::from_secs(60), || {
        let pg = pg.clone();
        let sid = sid.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM session_tool_calls WHERE session_id = $1::uuid AND status = 'started'")
                .bind(&sid)
                .fetch_one(&pg)
                .await
                .ok()?;
            (n == 1).then_some(())
        }
    })
    .await
    .unwrap();
    let v2 = stack
        .api
        .post(
            &format!("/v1/agents/{agent}/versions"),
            json!({"provider": "managed", "instructions": "Version two instructions."}),
        )
        .await
        .unwrap();
    assert_eq!(v2["version"], 2);
    std::fs::write(&release, "go").unwrap();
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    assert_eq!(
        s["agent_version"]["version"], 1,
        "pinned to the version it started with"
    );
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests.contains("Version one instructions.")
            && !requests.contains("Version two instructions.")
    );
    // A new session starts on the saved version.
    let id2 = start_session(&stack, &agent, "local", "Again.").await;
    let s2 = stack.api.get(&format!("/v1/sessions/{id2}")).await.unwrap();
    assert_eq!(s2["agent_version"]["version"], 2);
    wait_outcomes(&stack, &id2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_session_is_taken_over_without_rerunning_completed_tools() {
    let simdir = kit::TempDir::new("managed-takeover-gate");
    let release = simdir.path.join("release");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo step-one >> journal.txt"}},
            {"tool": "shell", "args": {"command": format!("while [ ! -e {} ]; do sleep 0.05; done; echo never-seen", release.display())}},
            {"tool": "shell", "args": {"command": "echo step-three >> journal.txt"}}
        ],
        "final": "Finished after the takeover."
    });
    // Both replicas mount the same shared storage (`remote` sessions).
    let (mut stack, _sim, _log, _simdir, mut other) =
        managed_stack("managed-takeover", &script).await;
    let agent = managed_agent(&stack, "worker", json!({})).await;
    let id = start_session(&stack, &agent, "remote", "Do the three steps.").await;
    let pg = stack.pg.clone();
    let sid = id.clone();
    let holder: String = kit::wait_for("the blocking tool to start", Duration::from_secs(60), || {
        let pg = pg.clone();
        let sid = sid.clone();
        async move {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT st.replica FROM session_state st JOIN session_tool_calls c ON c.session_id = st.session_id
                 WHERE st.session_id = $1::uuid AND c.status = 'started' AND c.input->>'command' LIKE 'while%'",
            )
            .bind(&sid)
            .fetch_optional(&pg)
            .await
            .ok()?;
            row.map(|r| r.0)
        }
    })
    .await
    .unwrap();
    kill_replica(&mut stack, &mut other, &holder);
    let s = wait_outcomes(&stack, &id, 1).await;
    // The orphaned command of the dead replica may now end.
    std::fs::write(&release, "go").unwrap();
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let journal = std::fs::read_to_string(
        stack
            .dir
            .path
            .join("shared-storage")
            .join(&id)
            .join("journal.txt"),
    )
    .unwrap();
    assert_eq!(
        journal, "step-one\nstep-three\n",
        "no completed tool call ran twice"
    );
    let events = session_events(&stack, &id).await;
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "diagnostic" && e["payload"]["code"] == "taken_over"),
        "{events:#?}"
    );
    let interrupted: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "tool_interrupted")
        .collect();
    assert_eq!(
        interrupted.len(),
        1,
        "the in-flight call is reported, not repeated: {events:#?}"
    );
    finished_elsewhere(&stack, &id, &holder, &events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_with_parallel_calls_runs_them_in_order_and_the_model_gets_every_result() {
    let script = json!({
        "turns": [
            // A write and a read of what it wrote: in the order the model gave them.
            {"say": "Two at once.", "tool": "write_file", "args": {"path": "note.txt", "content": "the note"},
             "also": [{"tool": "read_file", "args": {"path": "note.txt"}}], "expect": "the note"},
            // Three reads: all start with their turn's write and run together meanwhile.
            {"tool": "read_file", "args": {"path": "note.txt"},
             "also": [{"tool": "list_files", "args": {"path": "."}},
                      {"tool": "read_file", "args": {"path": "missing.txt"}}], "expect": "missing.txt"}
        ],
        "final": "Read in parallel."
    });
    let (stack, _sim, log, _simdir, _second) = managed_stack("managed-parallel", &script).await;
    let agent = managed_agent(&stack, "parallel", json!({})).await;
    for environment in ["local", "sandbox"] {
        let id = start_session(&stack, &agent, environment, "Use tools in parallel.").await;
        let s = wait_outcomes(&stack, &id, 1).await;
        assert_eq!(
            s["inputs"][0]["outcome"]["status"], "completed",
            "{environment}: {s:#}"
        );
        let events = session_events(&stack, &id).await;
        assert_eq!(
            kinds(&events)
                .into_iter()
                .filter(|k| k.starts_with("tool_"))
                .collect::<Vec<_>>(),
            [
                // A write first: the read after it waits for it.
                "tool_call:write_file",
                "tool_result:write_file",
                "tool_call:read_file",
                "tool_result:read_file",
                // Reads only: started together with their turn, ended together after.
                "tool_call:read_file",
                "tool_call:list_files",
                "tool_call:read_file",
                "tool_result:read_file",
                "tool_result:list_files",
                "tool_result:read_file",
            ],
            "{environment}: {events:#?}"
        );
        let results: Vec<(&str, bool)> = events
            .iter()
            .filter(|e| e["kind"] == "tool_result")
            .map(|e| {
                (
                    e["payload"]["output"].as_str().unwrap_or(""),
                    e["payload"]["is_error"].as_bool().unwrap_or(false),
                )
            })
            .collect();
        assert!(results[1].0.contains("the note"), "{results:?}");
        assert!(results[2].0.contains("the note"), "{results:?}");
        assert!(results[3].0.contains("note.txt"), "{results:?}");
        assert!(
            results[4].1,
            "a missing file is an error result: {results:?}"
        );
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "assistant_message"
                    && e["payload"]["text"] == "Read in parallel."),
            "the model got every result (each turn's `expect`): {events:#?}"
        );
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
        let calls: Vec<(String, String)> = sqlx::query_as(
            "SELECT tool, status FROM session_tool_calls WHERE session_id = $1::uuid ORDER BY started_at, call_id",
        )
        .bind(&id)
        .fetch_all(&stack.pg)
        .await
        .unwrap();
        assert_eq!(calls.len(), 5, "{calls:?}");
        assert!(calls.iter().all(|(_, st)| st == "completed"), "{calls:?}");
        // The read after the write needed no `started` row: its row went in whole, with its
        // result, in the next write; the write's was started before it ran.
        // (Every other row was started in one write and ended in a later one.)
        let whole: Vec<(String, String)> = sqlx::query_as(
            "SELECT tool, input->>'path' FROM session_tool_calls
             WHERE session_id = $1::uuid AND started_at = finished_at",
        )
        .bind(&id)
        .fetch_all(&stack.pg)
        .await
        .unwrap();
        let all: Vec<(String, String, Option<String>, String)> = sqlx::query_as(
            "SELECT tool, started_at::text, finished_at::text, call_id FROM session_tool_calls WHERE session_id = $1::uuid ORDER BY started_at",
        )
        .bind(&id)
        .fetch_all(&stack.pg)
        .await
        .unwrap();
        assert_eq!(
            whole,
            [("read_file".to_string(), "note.txt".to_string())],
            "{environment}: {all:#?}"
        );
    }
    // Each request answered a whole turn: none saw a turn's results in part.
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains("only 1 have results") && !requests.contains("only 2 have results"),
        "{requests}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_asking_for_many_reads_gets_them_all_in_bounded_writes() {
    let reads = 40;
    let also: Vec<Value> = (1..reads)
        .map(|_| json!({"tool": "read_file", "args": {"path": "note.txt"}}))
        .collect();
    let script = json!({
        "turns": [
            {"tool": "write_file", "args": {"path": "note.txt", "content": "the note"}},
            {"tool": "read_file", "args": {"path": "note.txt"}, "also": also, "expect": "the note"}
        ],
        "final": "Read them all."
    });
    let (stack, _sim, _log, _simdir, _second) = managed_stack("managed-many-reads", &script).await;
    let agent = managed_agent(&stack, "greedy", json!({})).await;
    let id = start_session(&stack, &agent, "local", "Read it forty times.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    let outputs: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "tool_result" && e["payload"]["tool"] == "read_file")
        .map(|e| e["payload"]["output"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(outputs.len(), reads, "{events:#?}");
    assert!(
        outputs.iter().all(|o| o.contains("the note")),
        "{outputs:?}"
    );
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    // Each write carries the results of 16 reads at most: 40 end in at least three writes.
    let (rows, writes): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT finished_at) FROM session_tool_calls
         WHERE session_id = $1::uuid AND tool = 'read_file' AND status = 'completed'",
    )
    .bind(&id)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(rows, reads as i64);
    assert!(writes >= 3, "{writes} writes ended {reads} reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_repeating_a_call_id_in_one_turn_never_runs_a_tool_twice() {
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo once >> ledger.txt"},
             "also": [{"tool": "shell", "args": {"command": "echo twice >> ledger.txt"}, "repeat_id": true}]},
            {"tool": "read_file", "args": {"path": "ledger.txt"},
             "also": [{"tool": "read_file", "args": {"path": "ledger.txt"}, "repeat_id": true},
                      {"tool": "list_files", "args": {"path": "."}}], "expect": "ledger.txt"},
            {"tool": "write_file", "args": {"path": "w.txt", "content": "w"},
             "also": [{"tool": "shell", "args": {"command": "echo third >> ledger.txt"}},
                      {"tool": "shell", "args": {"command": "echo fourth >> ledger.txt"}, "repeat_id": true}]}
        ],
        "final": "Repeated ids survived."
    });
    let (stack, _sim, _log, _simdir, _second) = managed_stack("managed-repeat-ids", &script).await;
    let agent = managed_agent(&stack, "repeater", json!({})).await;
    let id = start_session(&stack, &agent, "local", "Repeat yourself.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let root = stack.dir.path.join("sessions").join(&id);
    assert_eq!(
        std::fs::read_to_string(root.join("ledger.txt")).unwrap(),
        "once\nthird\n",
        "a call id seen before is answered from the journal, never run again"
    );
    let events = session_events(&stack, &id).await;
    assert_eq!(
        events.iter().filter(|e| e["kind"] == "tool_result").count(),
        8,
        "every call the model made has its result: {events:#?}"
    );
    assert!(
        events.iter().any(|e| e["kind"] == "assistant_message"
            && e["payload"]["text"] == "Repeated ids survived."),
        "{events:#?}"
    );
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    let calls: Vec<(String, String)> =
        sqlx::query_as("SELECT tool, status FROM session_tool_calls WHERE session_id = $1::uuid")
            .bind(&id)
            .fetch_all(&stack.pg)
            .await
            .unwrap();
    assert_eq!(calls.len(), 5, "one journal row per distinct id: {calls:?}");
    assert!(calls.iter().all(|(_, st)| st == "completed"), "{calls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_end_was_not_written_is_read_again_on_takeover() {
    let simdir = kit::TempDir::new("managed-reread-gate");
    let release = simdir.path.join("release");
    let script = json!({
        "turns": [
            {"tool": "write_file", "args": {"path": "note.txt", "content": "the note"}},
            {"tool": "read_file", "args": {"path": "note.txt"}, "expect": "the note"},
            // Asked for with the read's output: the model thinks until the test releases it.
            {"tool": "list_files", "args": {"path": "."}, "expect": "note.txt",
             "hold_until": release.display().to_string()}
        ],
        "final": "Read it."
    });
    let (mut stack, _sim, log, _simdir, mut other) = managed_stack("managed-reread", &script).await;
    let agent = managed_agent(&stack, "reader", json!({})).await;
    let id = start_session(&stack, &agent, "remote", "Read the note.").await;
    let pg = stack.pg.clone();
    let sid = id.clone();
    // The read ran and the model has its output, but its end is not written: it goes with the
    // next turn's write, which waits for the model.
    let (holder, call): (String, String) = kit::wait_for(
        "the read's output to reach the model",
        Duration::from_secs(60),
        || {
            let pg = pg.clone();
            let sid = sid.clone();
            let log = log.clone();
            async move {
                let asked = std::fs::read_to_string(&log).ok()?.contains("\"turn\":2");
                let row: Option<(String, String, String)> = sqlx::query_as(
                    "SELECT st.replica, c.call_id, c.status FROM session_state st
                     JOIN session_tool_calls c ON c.session_id = st.session_id
                     WHERE st.session_id = $1::uuid AND c.tool = 'read_file'",
                )
                .bind(&sid)
                .fetch_optional(&pg)
                .await
                .ok()?;
                let (replica, call, status) = row?;
                assert_eq!(status, "started", "a read's end waits for the next write");
                asked.then_some((replica, call))
            }
        },
    )
    .await
    .unwrap();
    kill_replica(&mut stack, &mut other, &holder);
    std::fs::write(&release, "go").unwrap();
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    assert!(
        !events.iter().any(|e| e["kind"] == "tool_interrupted"),
        "a read is read again, not reported interrupted: {events:#?}"
    );
    let results: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "tool_result" && e["payload"]["call_id"] == call.as_str())
        .collect();
    assert_eq!(results.len(), 1, "{events:#?}");
    assert!(
        results[0]["payload"]["output"]
            .as_str()
            .is_some_and(|o| o.contains("the note")),
        "{results:#?}"
    );
    // The model got the read's output again (its `expect`), then the list (the final answer).
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "assistant_message" && e["payload"]["text"] == "Read it."),
        "{events:#?}"
    );
    let statuses: Vec<(String, String)> = sqlx::query_as(
        "SELECT tool, status FROM session_tool_calls WHERE session_id = $1::uuid ORDER BY started_at",
    )
    .bind(&id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert!(
        statuses.iter().all(|(_, st)| st == "completed"),
        "{statuses:?}"
    );
    finished_elsewhere(&stack, &id, &holder, &events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_tool_cannot_write_outside_its_directory_nor_reach_the_network() {
    let outside = kit::TempDir::new("managed-outside");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let escape = outside.path.join("escaped.txt");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": format!(
                "echo inside > inside.txt; echo x > {} 2>&1; echo y > /etc/agentscope-escape 2>&1; \
                 (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo NETWORK-REACHED || echo no-network; true",
                escape.display())}, "expect": "no-network"},
            {"tool": "write_file", "args": {"path": "../escape.txt", "content": "x"}, "expect": "path_escape"}
        ],
        "final": "Checked."
    });
    let (stack, _sim, log, _simdir, _second) = managed_stack("managed-sandbox", &script).await;
    let agent = managed_agent(&stack, "boxed", json!({})).await;
    let id = start_session(&stack, &agent, "sandbox", "Try to escape.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let root = stack.dir.path.join("sessions").join(&id);
    assert_eq!(
        std::fs::read_to_string(root.join("inside.txt")).unwrap(),
        "inside\n"
    );
    assert!(
        !escape.exists(),
        "nothing was written outside the session directory"
    );
    assert!(!std::path::Path::new("/etc/agentscope-escape").exists());
    assert!(!stack.dir.path.join("sessions").join("escape.txt").exists());
    assert!(
        listener.accept().is_err(),
        "no connection reached the listener"
    );
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains("SCRIPT EXPECTATION FAILED"),
        "no-network and path_escape were seen"
    );
}

async fn pending_session_approval(stack: &Stack, session: &str) -> Value {
    crate::approvals::first_pending(stack, &format!("session_id={session}")).await
}

/// The Approval `id` as the API shows it.
async fn approval(stack: &Stack, id: &str) -> Value {
    stack.api.get(&format!("/v1/approvals/{id}")).await.unwrap()
}

/// A stack whose model makes one turn calling `shell` with `command`, then answers `final_text`,
/// and an agent whose policy asks before `shell`.
async fn asking(label: &str, command: &str, final_text: &str) -> (Managed, String) {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": command}}],
        "final": final_text
    });
    let managed = managed_stack(label, &script).await;
    let agent = managed_agent(
        &managed.0,
        "asker",
        json!({"policy": {"tools": {"shell": "ask"}}}),
    )
    .await;
    (managed, agent)
}

/// The gateway nudges the session's replica before its decision commits; the replica's read of
/// the decision waits for that transaction and sees it (it does not read the Approval as still
/// pending and sleep until its next poll), and the call then runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_still_committing_is_waited_for_and_then_runs_the_call_once() {
    decision_still_committing(false).await;
}

/// [`a_decision_still_committing_is_waited_for_and_then_runs_the_call_once`] for a session on a
/// Worker, whose call waits for the Worker (the decision is read on its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_still_committing_is_waited_for_on_a_worker_too() {
    decision_still_committing(true).await;
}

async fn decision_still_committing(on_worker: bool) {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo decided >> ask.txt"}}],
        "final": "Done."
    });
    let label = if on_worker {
        "managed-ask-open-w"
    } else {
        "managed-ask-open"
    };
    let (stack, _sim, _log, _simdir, _second) = managed_stack(label, &script).await;
    let agent = managed_agent(
        &stack,
        "asker",
        json!({"policy": {"tools": {"shell": "ask"}}}),
    )
    .await;
    let worker_dir = stack.dir.path.join("worker-ask");
    let (_worker, id) = if on_worker {
        let w = spawn_worker(&stack, "asks", &worker_dir).await;
        let id = start_on_worker(&stack, &agent, "asks", "Write the file.").await;
        (Some(w), id)
    } else {
        let id = start_session(&stack, &agent, "sandbox", "Write the file.").await;
        (None, id)
    };
    let ap = pending_session_approval(&stack, &id).await;
    let ap_id = ap["id"].as_str().unwrap().to_string();

    // Another workspace cannot decide it, nor wake the session into reading a decision.
    let other = stack
        .api
        .with_token(ADMIN_TOKEN)
        .post("/v1/workspaces", json!({"name": "intruder"}))
        .await
        .unwrap();
    let other = stack.api.with_token(other["api_token"].as_str().unwrap());
    for verb in ["approve", "deny"] {
        let (st, v) = other
            .send(
                reqwest::Method::POST,
                &format!("/v1/approvals/{ap_id}/{verb}"),
                Some(json!({})),
            )
            .await
            .unwrap();
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (404, Some("not_found")),
            "{v}"
        );
    }
    let still = approval(&stack, &ap_id).await;
    assert_eq!(still["status"], "pending", "{still}");

    // A decision written and not yet committed, and the nudge that goes with it.
    let mut tx = stack.pg.begin().await.unwrap();
    sqlx::query("UPDATE approvals SET status = 'allowed', decided_at = now(), decided_by = 'api' WHERE id = $1::uuid")
        .bind(&ap_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let nc = stack.nats.service_client("gateway").await.unwrap();
    nc.publish(agentscope_bus::subjects::SESSIONS_NUDGE, id.clone().into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    // The replica's read of the decision waits for its transaction.
    kit::wait_for_lock(&stack.pg, "FROM approvals WHERE session_id")
        .await
        .unwrap();
    let s = stack.api.get(&format!("/v1/sessions/{id}")).await.unwrap();
    assert_eq!(
        s["status"], "awaiting_approval",
        "nothing ran before the commit: {s:#}"
    );
    tx.commit().await.unwrap();

    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let root = if on_worker {
        worker_dir.join(&id)
    } else {
        stack.dir.path.join("sessions").join(&id)
    };
    let written = std::fs::read_to_string(root.join("ask.txt")).unwrap();
    assert_eq!(written, "decided\n", "the call ran once");
    let events = session_events(&stack, &id).await;
    let decided: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "approval_decided")
        .collect();
    assert_eq!(decided.len(), 1, "{events:#?}");
    assert_eq!(decided[0]["payload"]["allow"], true, "{events:#?}");
}

/// The replica whose session waits for an Approval listens for its decision (under the Approval's
/// id, derived from the session and the call): a decision brought
/// there (as the gateway brings one) is recorded and the allowed call started by the replica's
/// one statement, and the call runs once. A decision in another workspace's name, or one it
/// cannot read, does not apply and leaves the Approval pending; a second one does not apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_brought_to_the_waiting_replica_is_recorded_and_started_there_once() {
    use agentscope_schemas::Message as _;
    use agentscope_schemas::v1::{DecideApproval, DecideApprovalReply};
    let ((stack, _sim, _log, _simdir, _second), agent) =
        asking("managed-ask-brought", "echo brought >> ask.txt", "Done.").await;
    let id = start_session(&stack, &agent, "sandbox", "Write the file.").await;
    let ap = pending_session_approval(&stack, &id).await;
    let ap_id = ap["id"].as_str().unwrap().to_string();
    // Its id is the session's and the call's, which the replica knew before it was recorded.
    let derived = agentscope_domain::session_approval_id(
        id.parse().unwrap(),
        ap["request_id"].as_str().unwrap(),
    );
    assert_eq!(ap_id, derived.to_string(), "{ap}");
    let subject = agentscope_bus::subjects::session_decide(&ap_id);
    let nc = stack.nats.service_client("gateway").await.unwrap();
    let decision = |workspace: &str| DecideApproval {
        approval_id: ap_id.clone(),
        workspace_id: workspace.into(),
        allow: true,
        reason: "fine".into(),
        decided_by: "a-test".into(),
        always_for_task: false,
    };
    let ask = |payload: Vec<u8>| {
        let nc = nc.clone();
        let subject = subject.clone();
        async move {
            let m = nc.request(subject, payload.into()).await?;
            Ok::<_, async_nats::RequestError>(
                DecideApprovalReply::decode(m.payload.as_ref()).unwrap(),
            )
        }
    };

    // The replica subscribed before it asked for the Approval to be recorded (on the same
    // connection, so nats-server had its subscription first): it answers now. Another
    // workspace's decision is refused.
    let other = uuid::Uuid::new_v4().to_string();
    let refused = ask(decision(&other).encode_to_vec()).await.unwrap();
    assert!(!refused.ok, "{refused:?}");
    let unreadable = ask(b"\xff\x00 not a decision".to_vec()).await.unwrap();
    assert_eq!(
        (unreadable.ok, unreadable.error_code.as_str()),
        (false, "invalid")
    );
    let still = approval(&stack, &ap_id).await;
    assert_eq!(still["status"], "pending", "{still}");

    let applied = ask(decision(&stack.workspace_id).encode_to_vec())
        .await
        .unwrap();
    assert_eq!(
        (applied.ok, applied.status.as_str()),
        (true, "allowed"),
        "{applied:?}"
    );
    // Once decided, a decision does not apply again (the replica left its wait, or refuses it).
    match ask(decision(&stack.workspace_id).encode_to_vec()).await {
        Ok(again) => assert!(!again.ok, "{again:?}"),
        Err(e) => assert_eq!(e.kind(), async_nats::RequestErrorKind::NoResponders, "{e}"),
    }

    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let written =
        std::fs::read_to_string(stack.dir.path.join("sessions").join(&id).join("ask.txt")).unwrap();
    assert_eq!(written, "brought\n", "the call ran once");
    let decided = approval(&stack, &ap_id).await;
    assert_eq!(
        (
            decided["status"].as_str(),
            decided["decided_by"].as_str(),
            decided["reason"].as_str()
        ),
        (Some("allowed"), Some("a-test"), Some("fine")),
        "{decided}"
    );
    let events = session_events(&stack, &id).await;
    let at: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e["kind"] == "approval_decided")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "{events:#?}");
    assert_eq!(
        events[at[0]]["payload"],
        json!({"call_id": ap["request_id"], "allow": true, "status": "allowed", "reason": "fine", "decided_by": "a-test"}),
        "{events:#?}"
    );
    assert_eq!(events[at[0] + 1]["kind"], "tool_call", "{events:#?}");
}

/// A call that waits for a Worker does not listen for its decision (nothing answers on its
/// subject): the gateway decides it by the record and nudges the replica, which runs the call
/// on the Worker once; the answer is the Approval as recorded. So does a listener that never
/// answers, after the gateway's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_nobody_listens_for_is_decided_by_the_record() {
    let ((stack, _sim, _log, _simdir, _second), agent) =
        asking("managed-ask-record", "echo by-record >> ask.txt", "Done.").await;
    let worker_dir = stack.dir.path.join("worker-record");
    let _worker = spawn_worker(&stack, "records", &worker_dir).await;
    let id = start_on_worker(&stack, &agent, "records", "Write the file.").await;
    let ap = pending_session_approval(&stack, &id).await;
    let ap_id = ap["id"].as_str().unwrap().to_string();
    let nc = stack.nats.service_client("gateway").await.unwrap();
    let nobody = nc
        .request(agentscope_bus::subjects::session_decide(&ap_id), "x".into())
        .await
        .unwrap_err();
    assert_eq!(nobody.kind(), async_nats::RequestErrorKind::NoResponders);

    // A listener that never answers (a replica stuck, or gone after it got the request) only
    // delays the decision by the gateway's wait: it is then decided by the record.
    let mut silent = nc
        .subscribe(agentscope_bus::subjects::session_decide(&ap_id))
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            &format!("/v1/approvals/{ap_id}/approve"),
            Some(json!({"reason": "ok"})),
        )
        .await
        .unwrap();
    assert_eq!((st, v["status"].as_str()), (200, Some("allowed")), "{v}");
    let heard = futures::StreamExt::next(&mut silent).await.unwrap();
    assert!(heard.reply.is_some(), "the gateway asked first");
    let recorded = approval(&stack, &ap_id).await;
    assert_eq!(v, recorded);
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let written = std::fs::read_to_string(worker_dir.join(&id).join("ask.txt")).unwrap();
    assert_eq!(written, "by-record\n", "the call ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_tool_waits_for_one_approval_and_resubmission_follows_its_policy() {
    let ((stack, _sim, log, _simdir, _second), agent) = asking(
        "managed-ask",
        "echo approved-once >> ask.txt",
        "Done asking.",
    )
    .await;
    let id = start_session(&stack, &agent, "sandbox", "Write the file.").await;
    let ap = pending_session_approval(&stack, &id).await;
    assert_eq!(
        (ap["tool_name"].as_str(), ap["session_id"].as_str()),
        (Some("shell"), Some(id.as_str())),
        "{ap}"
    );
    let s = stack.api.get(&format!("/v1/sessions/{id}")).await.unwrap();
    assert_eq!(s["status"], "awaiting_approval", "visibly waiting: {s:#}");

    // Resubmission: reject by default, naming the Approval; enqueue once per idempotency key.
    let inputs = format!("/v1/sessions/{id}/inputs");
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            &inputs,
            Some(json!({"text": "Something else."})),
        )
        .await
        .unwrap();
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (409, Some("awaiting_approval")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains(ap["id"].as_str().unwrap()),
        "{v}"
    );
    let body = json!({"text": "And then summarize.", "idempotency_key": "k1", "when_awaiting_approval": "enqueue"});
    let (st, first) = stack
        .api
        .send(reqwest::Method::POST, &inputs, Some(body.clone()))
        .await
        .unwrap();
    assert_eq!(st, 202, "{first}");
    let (st, again) = stack
        .api
        .send(reqwest::Method::POST, &inputs, Some(body))
        .await
        .unwrap();
    assert_eq!(
        (st, &again["id"]),
        (200, &first["id"]),
        "the same request is one input"
    );

    // Approving twice runs the tool once. The answer is the Approval as recorded (the first
    // one as the replica's statement read it back).
    let approve = format!("/v1/approvals/{}/approve", ap["id"].as_str().unwrap());
    let mut answers = Vec::new();
    for _ in 0..2 {
        let (st, v) = stack
            .api
            .send(reqwest::Method::POST, &approve, Some(json!({})))
            .await
            .unwrap();
        assert_eq!((st, v["status"].as_str()), (200, Some("allowed")), "{v}");
        answers.push(v);
    }
    let recorded = approval(&stack, ap["id"].as_str().unwrap()).await;
    assert_eq!(answers[0], recorded);
    assert_eq!(answers[1], recorded);
    let s = wait_outcomes(&stack, &id, 2).await;
    let statuses: Vec<&str> = s["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["outcome"]["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["completed", "completed"], "{s:#}");
    let written =
        std::fs::read_to_string(stack.dir.path.join("sessions").join(&id).join("ask.txt")).unwrap();
    assert_eq!(
        written, "approved-once\n",
        "the approved tool ran exactly once"
    );
    let events = session_events(&stack, &id).await;
    assert_eq!(
        events
            .iter()
            .filter(|e| e["kind"] == "approval_decided")
            .count(),
        1,
        "{events:#?}"
    );
    // The decision as recorded, then the call's start, in that order.
    let at = events
        .iter()
        .position(|e| e["kind"] == "approval_decided")
        .unwrap();
    let call_id = ap["request_id"].as_str().unwrap();
    assert_eq!(
        events[at]["payload"],
        json!({"call_id": call_id, "allow": true, "status": "allowed", "reason": null, "decided_by": "api"}),
        "{events:#?}"
    );
    assert_eq!(
        (
            events[at + 1]["kind"].as_str(),
            events[at + 1]["payload"]["call_id"].as_str(),
            events[at + 1]["payload"]["tool"].as_str(),
        ),
        (Some("tool_call"), Some(call_id), Some("shell")),
        "{events:#?}"
    );
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("And then summarize."),
        "the enqueued input ran after"
    );

    // Interrupt: the pending request is denied, the model is told, then the new input runs.
    let id2 = start_session(&stack, &agent, "sandbox", "Write the file again.").await;
    let ap2 = pending_session_approval(&stack, &id2).await;
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id2}/inputs"),
            Some(json!({"text": "Stop that.", "when_awaiting_approval": "interrupt"})),
        )
        .await
        .unwrap();
    assert_eq!(st, 202, "{v}");
    let s = wait_outcomes(&stack, &id2, 2).await;
    let statuses: Vec<&str> = s["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["outcome"]["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["tool_denied", "completed"], "{s:#}");
    let after = stack
        .api
        .get(&format!("/v1/approvals/{}", ap2["id"].as_str().unwrap()))
        .await
        .unwrap();
    assert_eq!(
        (after["status"].as_str(), after["decided_by"].as_str()),
        (Some("denied"), Some("interrupt")),
        "{after}"
    );
    assert!(
        !stack
            .dir
            .path
            .join("sessions")
            .join(&id2)
            .join("ask.txt")
            .exists(),
        "the denied tool never ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vault_secret_used_by_a_tool_reaches_no_event_log_or_model_request() {
    const SECRET: &str = "vault-s3cret-7f3a9c-never-shown";
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": "echo \"token=$DEPLOY_TOKEN\"; test \"$DEPLOY_TOKEN\" = \"$(cat expected.txt)\" && echo token-matches; echo $DEPLOY_TOKEN > copy.txt"}, "expect": "token-matches"},
            {"tool": "read_file", "args": {"path": "copy.txt"}, "expect": "REDACTED"},
            {"tool": "upload_artifact", "args": {"path": "copy.txt"}, "expect": "written on the Issue"}
        ],
        "final": "Deployed."
    });
    let (stack, _sim, log, simdir, _second) = managed_stack("managed-vault", &script).await;
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            "/v1/secrets",
            Some(json!({"name": "DEPLOY_TOKEN", "value": SECRET})),
        )
        .await
        .unwrap();
    assert_eq!((st, v["name"].as_str()), (201, Some("DEPLOY_TOKEN")), "{v}");
    assert!(!v.to_string().contains(SECRET));
    let listed = stack.api.get("/v1/secrets").await.unwrap();
    assert_eq!(listed["items"][0]["name"], "DEPLOY_TOKEN");
    assert!(
        !listed.to_string().contains(SECRET),
        "values are never returned"
    );
    let agent = managed_agent(
        &stack,
        "deployer",
        json!({"policy": {"secrets": ["DEPLOY_TOKEN"]}, "capability_files": {"expected.txt": SECRET}}),
    )
    .await;
    let issue = stack
        .api
        .post("/v1/issues", json!({"title": "Deploy"}))
        .await
        .unwrap();
    let id = stack
        .api
        .post(
            "/v1/sessions",
            json!({"agent_id": agent, "environment": "sandbox", "issue_id": issue["id"], "input": "Deploy."}),
        )
        .await
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");

    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests.contains("token-matches"),
        "the tool had the secret"
    );
    assert!(
        requests.contains("[REDACTED:DEPLOY_TOKEN]"),
        "and the model saw it redacted"
    );
    // Everything the platform keeps: events, messages, the journal, the Vault row, the logs.
    let dumped: (String,) = sqlx::query_as(
        "SELECT (SELECT COALESCE(string_agg(payload::text, ''), '') FROM session_events)
             || (SELECT COALESCE(string_agg(message::text, ''), '') FROM session_messages)
             || (SELECT COALESCE(string_agg(input::text || COALESCE(output, ''), ''), '') FROM session_tool_calls)
             || (SELECT COALESCE(string_agg(encode(ciphertext, 'escape'), ''), '') FROM vault_secrets)
             || (SELECT COALESCE(string_agg(encode(content, 'escape'), ''), '') FROM artifacts)",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert!(
        !dumped.0.contains(SECRET),
        "no stored record holds the secret"
    );
    assert!(dumped.0.contains("[REDACTED:DEPLOY_TOKEN]"));
    assert!(
        !requests.contains(SECRET),
        "no model request holds the secret"
    );
    for dir in [&stack.dir.path, &simdir.path] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&p).unwrap();
                assert!(!text.contains(SECRET), "{} holds the secret", p.display());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_shows_worker_offline_until_its_worker_beats() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo on-the-worker > where.txt && cat where.txt"}, "expect": "on-the-worker"}],
        "final": "Ran remotely."
    });
    let (stack, _sim, _log, _simdir, _second) = managed_stack("managed-worker", &script).await;
    let agent = managed_agent(&stack, "remote", json!({})).await;
    let id = start_on_worker(&stack, &agent, "desk", "Run it on my machine.").await;
    let api = stack.api.clone();
    let path = format!("/v1/sessions/{id}");
    let s = kit::wait_for("worker_offline", Duration::from_secs(30), || {
        let api = api.clone();
        let path = path.clone();
        async move {
            let s = api.get(&path).await.ok()?;
            (s["status"] == "worker_offline").then_some(s)
        }
    })
    .await
    .unwrap();
    assert!(s["detail"].as_str().unwrap().contains("desk"), "{s:#}");
    let dir = stack.dir.path.join("worker-desk");
    let mut worker = spawn_worker(&stack, "desk", &dir).await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    assert_eq!(
        std::fs::read_to_string(dir.join(&id).join("where.txt")).unwrap(),
        "on-the-worker\n"
    );
    let codes: Vec<String> = session_events(&stack, &id)
        .await
        .iter()
        .filter(|e| e["kind"] == "diagnostic")
        .map(|e| e["payload"]["code"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(codes, ["worker_offline", "worker_online"]);

    // A stopped Worker: the next session's operation is not delivered, so it waits, visibly,
    // and runs once the Worker is back.
    worker.kill9();
    let id2 = start_on_worker(&stack, &agent, "desk", "Again.").await;
    let path = format!("/v1/sessions/{id2}");
    kit::wait_for("worker_offline again", Duration::from_secs(30), || {
        let api = api.clone();
        let path = path.clone();
        async move { (api.get(&path).await.ok()?["status"] == "worker_offline").then_some(()) }
    })
    .await
    .unwrap();
    let _worker = spawn_worker(&stack, "desk", &dir).await;
    let s = wait_outcomes(&stack, &id2, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    assert_eq!(
        std::fs::read_to_string(dir.join(&id2).join("where.txt")).unwrap(),
        "on-the-worker\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_model_ends_the_turn_as_model_connection_with_evidence() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let (stack, _sim, _log, _simdir, _second) = managed_stack_with(
        "managed-nomodel",
        &json!({"turns": []}),
        &[("AGENTSCOPE_MODEL_BASE_URL", &base)],
    )
    .await;
    let agent = managed_agent(&stack, "cutoff", json!({})).await;
    let id = start_session(&stack, &agent, "sandbox", "Hello?").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    let o = &s["inputs"][0]["outcome"];
    assert_eq!(o["status"], "model_connection", "{s:#}");
    assert_eq!(s["status"], "model_connection");
    assert!(
        o["detail"].as_str().unwrap().contains(&port.to_string())
            || o["detail"].as_str().unwrap().contains("connect"),
        "the evidence names what failed: {o}"
    );
    let events = session_events(&stack, &id).await;
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "diagnostic" && e["payload"]["code"] == "model_connection")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_session_input_gets_stable_codes_and_workspaces_never_see_each_others_sessions() {
    let script = json!({"turns": [], "final": "Hi."});
    let (stack, _sim, _log, _simdir, _second) = managed_stack("managed-isolation", &script).await;
    let agent = managed_agent(&stack, "mine", json!({})).await;
    let hosted = stack
        .api
        .post(
            "/v1/agents",
            json!({"name": "hosted", "provider": "command"}),
        )
        .await
        .unwrap();
    let id = start_session(&stack, &agent, "sandbox", "Hello.").await;
    wait_outcomes(&stack, &id, 1).await;
    stack
        .api
        .post(
            "/v1/secrets",
            json!({"name": "MY_TOKEN", "value": "workspace-a-only"}),
        )
        .await
        .unwrap();

    let post = |path: &str, body: Value| {
        let api = stack.api.clone();
        let path = path.to_string();
        async move {
            api.send(reqwest::Method::POST, &path, Some(body))
                .await
                .unwrap()
        }
    };
    let inputs = format!("/v1/sessions/{id}/inputs");
    for (path, body, status, code) in [
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": "x", "colour": "blue"}),
            422,
            "invalid_field",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": ""}),
            400,
            "invalid_field",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": "x", "environment": "moon"}),
            400,
            "invalid_field",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": "x", "environment": "self_hosted"}),
            400,
            "invalid_field",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": "x", "worker": "w"}),
            400,
            "invalid_field",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": hosted["id"], "input": "x"}),
            400,
            "not_managed",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": "00000000-0000-0000-0000-000000000000", "input": "x"}),
            404,
            "not_found",
        ),
        (
            "/v1/sessions",
            json!({"agent_id": agent, "input": "x", "issue_id": "00000000-0000-0000-0000-000000000000"}),
            404,
            "not_found",
        ),
        (
            inputs.as_str(),
            json!({"text": "x", "when_awaiting_approval": "maybe"}),
            400,
            "invalid_field",
        ),
        (
            "/v1/secrets",
            json!({"name": "bad-name", "value": "long enough"}),
            400,
            "invalid_field",
        ),
        (
            "/v1/secrets",
            json!({"name": "SHORT", "value": "ab"}),
            400,
            "invalid_field",
        ),
    ] {
        let (st, v) = post(path, body.clone()).await;
        assert_eq!(
            (st, v["error"]["code"].as_str().unwrap_or("")),
            (status, code),
            "{path} {body}: {v}"
        );
    }

    // The same create request twice, even at once, is one session.
    let body = json!({"agent_id": agent, "input": "Once.", "idempotency_key": "create-1"});
    let (a, b) = tokio::join!(
        post("/v1/sessions", body.clone()),
        post("/v1/sessions", body.clone())
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 201], "{a:?} {b:?}");
    assert_eq!(a.1["id"], b.1["id"]);
    let (st, again) = post("/v1/sessions", body).await;
    assert_eq!((st, &again["id"]), (200, &a.1["id"]));

    let admin = stack.api.with_token(ADMIN_TOKEN);
    let other = admin
        .post("/v1/workspaces", json!({"name": "other"}))
        .await
        .unwrap();
    let other = stack.api.with_token(other["api_token"].as_str().unwrap());
    for path in [
        format!("/v1/sessions/{id}"),
        format!("/v1/sessions/{id}/events"),
    ] {
        let (st, v) = other.send(reqwest::Method::GET, &path, None).await.unwrap();
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (404, Some("not_found")),
            "{path}"
        );
    }
    let (st, _) = other
        .send(
            reqwest::Method::POST,
            &inputs,
            Some(json!({"text": "sneaky"})),
        )
        .await
        .unwrap();
    assert_eq!(st, 404, "no input reaches another workspace's session");
    let (st, _) = other
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"agent_id": agent, "input": "borrowed agent"})),
        )
        .await
        .unwrap();
    assert_eq!(st, 404, "another workspace's agent is not found");
    assert_eq!(other.get("/v1/secrets").await.unwrap()["items"], json!([]));
    let approvals = other
        .get(&format!("/v1/approvals?session_id={id}"))
        .await
        .unwrap();
    assert_eq!(approvals["items"], json!([]));
    let s = stack.api.get(&format!("/v1/sessions/{id}")).await.unwrap();
    assert_eq!(
        s["inputs"].as_array().unwrap().len(),
        1,
        "nothing was added: {s:#}"
    );
}

/// E2B cannot be reached from this network: the backend is exercised up to its first request,
/// and the model and the record get a clear `sandbox_unavailable` naming E2B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_sandbox_backend_reports_an_unreachable_e2b_clearly() {
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": "echo in-e2b > ran-here.txt"}, "expect": "sandbox_unavailable"}],
        "final": "E2B is out of reach."
    });
    let (stack, _sim, _log, _simdir, _second) = managed_stack_with(
        "managed-e2b",
        &script,
        &[
            ("AGENTSCOPE_SANDBOX_BACKEND", "e2b"),
            ("AGENTSCOPE_E2B_API_KEY", "e2b_not_a_real_key"),
        ],
    )
    .await;
    let agent = managed_agent(&stack, "cloudy", json!({})).await;
    let id = start_session(&stack, &agent, "sandbox", "Run it in E2B.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let events = session_events(&stack, &id).await;
    let result = events
        .iter()
        .find(|e| e["kind"] == "tool_result")
        .expect("a tool result");
    let out = result["payload"]["output"].as_str().unwrap();
    assert!(
        out.starts_with("sandbox_unavailable: cannot reach E2B at https://api.e2b.app"),
        "{out}"
    );
    assert_eq!(result["payload"]["is_error"], true);
    assert!(
        !stack
            .dir
            .path
            .join("sessions")
            .join(&id)
            .join("ran-here.txt")
            .exists(),
        "nothing ran locally instead"
    );
}

/// A replica woken for a session with nothing left to do leaves it alone (a nudge that comes
/// after the outcome, as when two replicas hear one nudge), and a session's next input, taken by
/// whichever replica is free, is not reported as a takeover: only continuing an input another
/// replica began is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nudges_after_an_outcome_change_nothing_and_a_next_input_is_no_takeover() {
    let script = json!({"turns": [], "final": "Nothing to do."});
    let (stack, _sim, _log, _simdir, _second) = managed_stack("managed-idle-nudge", &script).await;
    let agent = managed_agent(&stack, "idle", json!({})).await;
    let id = start_session(&stack, &agent, "sandbox", "Say hello.").await;
    wait_outcomes(&stack, &id, 1).await;
    let nc = stack.nats.service_client("gateway").await.unwrap();
    for _ in 0..5 {
        nc.publish(agentscope_bus::subjects::SESSIONS_NUDGE, id.clone().into())
            .await
            .unwrap();
    }
    nc.flush().await.unwrap();
    stack
        .api
        .post(
            &format!("/v1/sessions/{id}/inputs"),
            json!({"text": "Again."}),
        )
        .await
        .unwrap();
    let s = wait_outcomes(&stack, &id, 2).await;
    let events = session_events(&stack, &id).await;
    assert!(
        !events.iter().any(|e| e["kind"] == "diagnostic"),
        "no takeover was reported: {events:#?}"
    );
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert_ne!(s["status"], "running", "{s:#}");
}
