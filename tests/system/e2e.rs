//! Issue → Task → Attempt → host claims, clones the named branch, runs the command provider →
//! `succeeded`, with every event stored once, in order, through the API, SSE and the CLI.

use agentscope_system_tests::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assigned_issue_runs_to_success_with_every_event_once_in_order() {
    let stack = Stack::start("e2e", StackOptions::default()).await.unwrap();
    let repo = git_fixture(&stack.dir.path).unwrap();
    let (agent, _) = stack
        .command_agent(
            "builder",
            "main-pool",
            &["sh", "-c", "echo start; cat FEATURE.txt; cat \"$AGENTSCOPE_INPUT_DIR/INPUT.md\"; echo; for i in 1 2 3 4 5; do echo line-$i; done; echo to-stderr >&2; echo uid=$(id -u)"],
            None,
        )
        .await
        .unwrap();
    let (_host, _) = stack.host("h1", "main-pool", 2).await.unwrap();

    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": "Fix the build", "body": "details", "assignee_agent_id": agent,
                   "repository": repo.to_string_lossy(), "branch": "feature", "input": "input-material-42"}),
        )
        .await
        .unwrap();
    let task_id = issue["task_id"]
        .as_str()
        .expect("an assigned issue becomes a task")
        .to_string();
    let task = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let attempts = task["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{task:#}");
    assert_eq!(attempts[0]["status"], "succeeded");
    assert_eq!(attempts[0]["exit_code"], 0);
    let attempt_id = attempts[0]["id"].as_str().unwrap().to_string();

    // Every event once, seq 1..=n in order.
    let events = stack
        .events(&format!("/v1/attempts/{attempt_id}/events"))
        .await
        .unwrap();
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "contiguous, ordered, no duplicates"
    );
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM execution_events WHERE attempt_id = $1::uuid")
            .bind(&attempt_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    assert_eq!(stored as usize, events.len());
    let texts: Vec<String> = events
        .iter()
        .filter(|e| e["kind"] == "output")
        .map(|e| e["payload"]["text"].as_str().unwrap().to_string())
        .collect();
    assert!(
        texts.contains(&"feature-branch-marker".to_string()),
        "the feature branch was cloned: {texts:?}"
    );
    assert!(
        texts.contains(&"input-material-42".to_string()),
        "input material was written: {texts:?}"
    );
    let line_order: Vec<&String> = texts.iter().filter(|t| t.starts_with("line-")).collect();
    assert_eq!(
        line_order,
        ["line-1", "line-2", "line-3", "line-4", "line-5"]
    );
    assert!(
        events
            .iter()
            .any(|e| e["payload"]["stream"] == "stderr" && e["payload"]["text"] == "to-stderr")
    );
    // A host running as root runs each attempt under its own uid from the default range.
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let uid: u32 = texts
        .iter()
        .find_map(|t| t.strip_prefix("uid="))
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("uid= in {texts:?}"));
    if euid == 0 {
        assert!((1_900_000_000..=1_900_004_095).contains(&uid), "{uid}");
    } else {
        assert_eq!(uid, euid);
    }
    let last = events.last().unwrap();
    assert_eq!(
        (last["kind"].as_str(), last["payload"]["state"].as_str()),
        (Some("lifecycle"), Some("succeeded"))
    );
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "lifecycle" && e["payload"]["state"] == "running")
    );

    // SSE: the whole stream, then a resume from the middle with no gap and no duplicate.
    let path = format!("/v1/attempts/{attempt_id}/events?follow=true");
    let all = sse_collect(&stack.api, &path, None, None, Duration::from_secs(20))
        .await
        .unwrap();
    let (end, data) = all.split_last().unwrap();
    assert_eq!(end.event, "end");
    let ids: Vec<String> = data.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, seqs.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    let mid = &ids[ids.len() / 2];
    let rest = sse_collect(&stack.api, &path, Some(mid), None, Duration::from_secs(20))
        .await
        .unwrap();
    let rest_ids: Vec<String> = rest
        .iter()
        .filter(|e| e.event != "end")
        .map(|e| e.id.clone())
        .collect();
    assert_eq!(
        rest_ids,
        ids[ids.len() / 2 + 1..].to_vec(),
        "resume after {mid}"
    );

    // Task-level SSE across attempts uses number:seq ids.
    let task_stream = sse_collect(
        &stack.api,
        &format!("/v1/tasks/{task_id}/events"),
        None,
        None,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert_eq!(task_stream.len(), events.len() + 1);
    assert_eq!(task_stream[0].id, "1:1");

    // The CLI follows the same events.
    let out = std::process::Command::new(kit::bin("agentscope").unwrap())
        .args([
            "--api",
            &stack.api.base,
            "--token",
            &stack.api.token,
            "runtime",
            "logs",
            "-f",
            &task_id,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "agentscope runtime logs failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("feature-branch-marker"), "{stdout}");
    assert!(stdout.contains("line-5"), "{stdout}");
    assert!(stdout.contains("succeeded"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_follower_sees_events_as_they_happen() {
    let stack = Stack::start("live", StackOptions::default()).await.unwrap();
    let gate = stack.dir.path.join("gate");
    let script = format!(
        "echo before; while [ ! -e '{}' ]; do sleep 0.05; done; echo after",
        gate.display()
    );
    let (agent, _) = stack
        .command_agent("live", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();

    // Follow from the start while the task is still running.
    let api = stack.api.clone();
    let path = format!("/v1/tasks/{task_id}/events");
    let follower =
        tokio::spawn(
            async move { sse_collect(&api, &path, None, None, Duration::from_secs(60)).await },
        );
    let api = stack.api.clone();
    let tid = task_id.clone();
    kit::wait_for("the 'before' line", Duration::from_secs(30), || {
        let api = api.clone();
        let tid = tid.clone();
        async move {
            let ev = api.get(&format!("/v1/tasks/{tid}/events")).await.ok()?;
            ev["items"]
                .as_array()?
                .iter()
                .any(|e| e["payload"]["text"] == "before")
                .then_some(())
        }
    })
    .await
    .unwrap();
    std::fs::write(&gate, "go").unwrap();
    let got = follower.await.unwrap().unwrap();
    let texts: Vec<String> = got
        .iter()
        .filter(|e| e.event == "output")
        .map(|e| {
            serde_json::from_str::<serde_json::Value>(&e.data).unwrap()["payload"]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(texts, ["before", "after"]);
    assert_eq!(got.last().unwrap().event, "end");
    assert!(got.last().unwrap().data.contains("succeeded"));
}

/// README's first command works: the demo starts everything and runs a task to success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_script_runs_a_task_end_to_end() {
    let dir = kit::TempDir::new("demo");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let out = tokio::process::Command::new(root.join("scripts/demo.sh"))
        .env("AGENTSCOPE_DEMO_DIR", dir.path.join("run"))
        // The binaries under test: the demo must not build (and swap them) under other tests.
        .env("AGENTSCOPE_BIN_DIR", kit::bin_dir())
        .env("AGENTSCOPE_DEMO_NATS_PORT", kit::free_port().to_string())
        .env("AGENTSCOPE_DEMO_API_PORT", kit::free_port().to_string())
        .env(
            "AGENTSCOPE_DEMO_DB",
            format!("agentscope_demo_{}", uuid::Uuid::new_v4().simple()),
        )
        .env_remove("AGENTSCOPE_TOKEN")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("only on the feature branch"), "{stdout}");
    assert!(stdout.contains("-- task succeeded"), "{stdout}");
}

/// A submitted task comes back with its first attempt, queued: the gateway stores both in one
/// statement, so the work exists before any scheduler has seen it, and runs once one is up. A
/// task stored without an attempt (as a gateway before this one did) gets one from the
/// scheduler, resolved the same way. The claim writes the deployment's run timeout into a spec
/// that sets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submitted_task_has_its_first_attempt_before_a_scheduler_sees_it() {
    let mut stack = Stack::start("firstattempt", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("w", "pool", &["sh", "-c", "echo ok"], None)
        .await
        .unwrap();
    stack.scheduler.kill9();
    let t = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "now"}))
        .await
        .unwrap();
    assert_eq!(t["status"], "queued", "{t}");
    let attempts = t["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{t}");
    assert_eq!(
        (
            attempts[0]["number"].as_i64(),
            attempts[0]["status"].as_str()
        ),
        (Some(1), Some("queued"))
    );
    let id = t["id"].as_str().unwrap().to_string();
    let got = stack.api.get(&format!("/v1/tasks/{id}")).await.unwrap();
    assert_eq!(got["attempts"][0]["id"], attempts[0]["id"], "{got}");
    let spec_of = |task: uuid::Uuid| {
        let pg = stack.pg.clone();
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(
                "SELECT spec FROM attempts WHERE task_id = $1 AND number = 1",
            )
            .bind(task)
            .fetch_one(&pg)
            .await
            .unwrap()
        }
    };
    let task = uuid::Uuid::parse_str(&id).unwrap();
    let spec = spec_of(task).await;
    assert_eq!(spec["provider"], "command", "{spec}");
    assert_eq!(spec["input"], "now", "{spec}");
    assert_eq!(spec["timeout_source"], "default", "{spec}");
    assert!(spec.get("timeout_secs").is_none(), "{spec}");

    // Tasks that can never have an attempt (stored by a tool under another workspace, naming
    // this one's agent), a whole sweep's page of them (200), older than the next: the sweep must
    // not stop at them on every tick.
    let other = stack
        .api
        .with_token(ADMIN_TOKEN)
        .post("/v1/workspaces", json!({"name": "other"}))
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO tasks (id, workspace_id, agent_id, input, created_at)
         SELECT gen_random_uuid(), $1, $2, 'stray', now() - interval '1 minute'
         FROM generate_series(1, 200)",
    )
    .bind(uuid::Uuid::parse_str(other["workspace"]["id"].as_str().unwrap()).unwrap())
    .bind(uuid::Uuid::parse_str(&agent).unwrap())
    .execute(&stack.pg)
    .await
    .unwrap();
    // A task without an attempt, with a timeout of its own.
    let bare = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tasks (id, workspace_id, agent_id, input, timeout_secs) VALUES ($1, $2, $3, 'bare', 42)",
    )
    .bind(bare)
    .bind(uuid::Uuid::parse_str(&stack.workspace_id).unwrap())
    .bind(uuid::Uuid::parse_str(&agent).unwrap())
    .execute(&stack.pg)
    .await
    .unwrap();
    // Its events: none yet, and a live stream that waits for its attempt and follows it to the
    // end (a task of the workspace without an attempt is still the workspace's to follow).
    let page = stack
        .api
        .get(&format!("/v1/tasks/{bare}/events"))
        .await
        .unwrap();
    assert_eq!(page["items"], json!([]), "{page}");
    let follower = {
        let api = stack.api.clone();
        tokio::spawn(async move {
            sse_collect(
                &api,
                &format!("/v1/tasks/{bare}/events?follow=true"),
                None,
                None,
                Duration::from_secs(60),
            )
            .await
        })
    };

    let (_scheduler, _) = stack.spawn_scheduler("again").await.unwrap();
    let _host = stack.host("h1", "pool", 2).await.unwrap();
    for task in [id, bare.to_string()] {
        let done = stack
            .wait_task(&task, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(done["attempts"].as_array().unwrap().len(), 1, "{done}");
    }
    let followed = follower.await.unwrap().unwrap();
    let ids: Vec<&str> = followed.iter().map(|e| e.id.as_str()).collect();
    let stored: Vec<String> = stack
        .events(&format!("/v1/tasks/{bare}/events"))
        .await
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!stored.is_empty());
    assert_eq!(ids[..ids.len() - 1], stored, "{followed:?}");
    let end = followed.last().unwrap();
    assert_eq!(
        (end.event.as_str(), end.data.as_str()),
        ("end", r#"{"status":"succeeded"}"#)
    );
    let spec = spec_of(task).await;
    assert_eq!(
        (
            spec["timeout_secs"].as_u64(),
            spec["timeout_source"].as_str()
        ),
        (Some(4 * 3600), Some("default")),
        "{spec}"
    );
    let spec = spec_of(bare).await;
    assert_eq!(
        (
            spec["timeout_secs"].as_u64(),
            spec["timeout_source"].as_str(),
            spec["input"].as_str()
        ),
        (Some(42), Some("task"), Some("bare")),
        "{spec}"
    );
    // The submitted task was stored knowing it has its attempt; the bare one was found by the
    // sweep (which reads only tasks not known to have one) and is marked once it has one.
    let known = |task: uuid::Uuid| {
        let pg = stack.pg.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT has_attempt FROM tasks WHERE id = $1")
                .bind(task)
                .fetch_one(&pg)
                .await
                .unwrap()
        }
    };
    assert!(known(task).await);
    kit::wait_for(
        "the sweep to mark the bare task",
        Duration::from_secs(30),
        || async { known(bare).await.then_some(()) },
    )
    .await
    .unwrap();
}

/// A submission's attempt is made of its agent's newest version and its binding as they are
/// when it is stored, though the gateway keeps each agent's plan from one submission to the next:
/// a version saved, or a first binding made, after a submission is in the next one's attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_submission_gets_the_agents_newest_version_and_binding() {
    let stack = Stack::start("newest-plan", StackOptions::default())
        .await
        .unwrap();
    let api = &stack.api;
    let (agent, _) = stack
        .command_agent("v", "pool", &["sh", "-c", "echo ok"], None)
        .await
        .unwrap();
    let attempt_of = |task: &serde_json::Value| {
        let pg = stack.pg.clone();
        let id = uuid::Uuid::parse_str(task["attempts"][0]["id"].as_str().unwrap()).unwrap();
        async move {
            sqlx::query_as::<_, (Option<uuid::Uuid>, Option<uuid::Uuid>, serde_json::Value)>(
                "SELECT agent_version_id, binding_id, spec FROM attempts WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pg)
            .await
            .unwrap()
        }
    };
    let submit = |agent: String, input: &'static str| async move {
        api.post("/v1/tasks", json!({"agent_id": agent, "input": input}))
            .await
            .unwrap()
    };
    let first = submit(agent.clone(), "one").await;
    let (v1, _, spec) = attempt_of(&first).await;
    assert_eq!(spec["instructions"], "run the command", "{spec}");
    let v2 = api
        .post(
            &format!("/v1/agents/{agent}/versions"),
            json!({"instructions": "the second version", "provider": "command"}),
        )
        .await
        .unwrap();
    let second = submit(agent.clone(), "two").await;
    let (version, _, spec) = attempt_of(&second).await;
    assert_ne!(version, v1);
    assert_eq!(
        version.map(|v| v.to_string()).as_deref(),
        v2["id"].as_str(),
        "{v2}"
    );
    assert_eq!(spec["instructions"], "the second version", "{spec}");
    assert_eq!(spec["input"], "two", "{spec}");
    assert_eq!(second["attempts"][0]["agent_version_id"], v2["id"]);

    // An agent without a binding, then bound.
    let unbound = api
        .post(
            "/v1/agents",
            json!({"name": "later", "provider": "command", "instructions": "x"}),
        )
        .await
        .unwrap();
    let unbound = unbound["id"].as_str().unwrap().to_string();
    let early = submit(unbound.clone(), "early").await;
    assert_eq!(attempt_of(&early).await.1, None);
    let profile = api
        .post(
            "/v1/runtime-profiles",
            json!({"name": "later-profile", "provider": "command",
                   "params": {"command": ["sh", "-c", "echo bound"]}}),
        )
        .await
        .unwrap();
    let pools = api.get("/v1/pools").await.unwrap();
    let pool = pools["items"][0]["id"].clone();
    let binding = api
        .post(
            "/v1/bindings",
            json!({"agent_id": unbound, "pool_id": pool, "runtime_profile_id": profile["id"]}),
        )
        .await
        .unwrap();
    let bound = submit(unbound.clone(), "bound").await;
    let (_, binding_id, spec) = attempt_of(&bound).await;
    assert_eq!(
        binding_id.map(|b| b.to_string()).as_deref(),
        binding["id"].as_str(),
        "{binding}"
    );
    assert_eq!(spec["command"], json!(["sh", "-c", "echo bound"]), "{spec}");

    // Both run where their binding says.
    let _host = stack.host("h1", "pool", 2).await.unwrap();
    for t in [&second, &bound] {
        let id = t["id"].as_str().unwrap();
        stack
            .wait_task(id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
    }
}
