//! Issue 9, managed execution: what an agent's tools can reach in svc-dataplane's environments.
//! Each test runs the attack as an agent would (shell commands and file tools driven by the
//! scripted model server) and asserts it is refused: another workspace's session, host files,
//! the dataplane's environment, the network, a fork bomb, a memory hog, symlinks turned against
//! the file tools, and `local` where the deployment does not enable it.

use crate::managed::{
    managed_agent, managed_stack_with, session_events, start_session, wait_outcomes,
};
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::os::unix::fs::MetadataExt as _;

/// The default session uid range of svc-dataplane.
const UIDS: std::ops::RangeInclusive<u32> = 700_000..=765_535;

/// Output of every tool result of a session, in order, with the tool's name.
async fn tool_results(stack: &Stack, id: &str) -> Vec<(String, String)> {
    tool_results_of(&session_events(stack, id).await)
}

/// [`tool_results`] of a session of another workspace, read with that workspace's `api`.
async fn tool_results_in(api: &Api, id: &str) -> Vec<(String, String)> {
    let events = api.get(&format!("/v1/sessions/{id}/events")).await.unwrap()["items"]
        .as_array()
        .unwrap()
        .clone();
    tool_results_of(&events)
}

fn tool_results_of(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .filter(|e| e["kind"] == "tool_result")
        .map(|e| {
            (
                e["payload"]["tool"].as_str().unwrap_or("").to_string(),
                e["payload"]["output"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// A new workspace with a managed agent of its own and one session of it in the default
/// environment, run to its first outcome: the workspace's API, the session's id, the session as
/// created and as it ended.
async fn session_of_another_workspace(
    stack: &Stack,
    workspace: &str,
    agent: &str,
    input: &str,
) -> (Api, String, Value, Value) {
    let admin = stack.api.with_token(ADMIN_TOKEN);
    let ws = admin
        .post("/v1/workspaces", json!({"name": workspace}))
        .await
        .unwrap();
    let api = stack.api.with_token(ws["api_token"].as_str().unwrap());
    let agent = api
        .post(
            "/v1/agents",
            json!({"name": agent, "provider": "managed", "instructions": "You are B."}),
        )
        .await
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let created = api
        .post("/v1/sessions", json!({"agent_id": agent, "input": input}))
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap().to_string();
    let ended = kit::wait_for("B's outcome", std::time::Duration::from_secs(90), || {
        let api = api.clone();
        let path = format!("/v1/sessions/{id}");
        async move {
            let s = api.get(&path).await.ok()?;
            (!s["inputs"][0]["outcome"].is_null()).then_some(s)
        }
    })
    .await
    .unwrap();
    (api, id, created, ended)
}

fn value_of(output: &str, key: &str) -> String {
    output
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {output}"))
        .to_string()
}

/// The probes a hostile agent runs from its shell; each prints a lowercase `*-refused` line
/// when it is refused and an upper-case line when it got through.
fn attack(port: u16) -> String {
    [
        "printf 'secret-of-%s' \"$(basename \"$PWD\")\" > tok.txt",
        "echo uid=$(id -u)",
        "echo whoami=$(id -un 2>/dev/null)",
        "cat ../*/tok.txt 2>/dev/null | grep -v \"$(cat tok.txt)\" | grep -q secret-of && echo SIBLING-READ || echo sibling-refused",
        "for f in \"$(dirname \"$PWD\")\"/*/tok.txt; do [ \"$f\" = \"$PWD/tok.txt\" ] || cat \"$f\"; done 2>/dev/null | grep -q secret-of && echo ABSOLUTE-READ || echo absolute-refused",
        "ls \"$(dirname \"$PWD\")\" 2>/dev/null | grep -v \"$(basename \"$PWD\")\" | grep -q . && echo SESSIONS-LISTED || echo sessions-list-refused",
        "cat /etc/shadow >/dev/null 2>&1 && echo SHADOW-READ || echo shadow-refused",
        "tr '\\0' '\\n' < /proc/1/environ 2>/dev/null | grep -q AGENTSCOPE_ && echo PID1-ENV || echo pid1-env-refused",
        "tr '\\0' '\\n' < /proc/$PPID/environ 2>/dev/null | grep -q AGENTSCOPE_ && echo PARENT-ENV || echo parent-env-refused",
        "for p in /proc/[0-9]*/environ; do tr '\\0' '\\n' < \"$p\"; done 2>/dev/null | grep -q 'AGENTSCOPE_VAULT_KEYS\\|AGENTSCOPE_MODEL_API_KEY\\|AGENTSCOPE_DATABASE_URL' && echo SERVICE-ENV || echo service-env-refused",
        "env | grep -q AGENTSCOPE_ && echo OWN-ENV || echo own-env-clean",
        "echo x > \"$(dirname \"$PWD\")/escape-$$\" 2>/dev/null && echo WROTE-SESSIONS || echo sessions-write-refused",
        "echo x > /etc/agentscope-escape 2>/dev/null && echo WROTE-ETC || echo etc-write-refused",
        "echo x > /usr/agentscope-escape 2>/dev/null && echo WROTE-USR || echo usr-write-refused",
        &format!(
            "bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' 2>/dev/null && echo NETWORK || echo network-refused"
        ),
        "true",
    ]
    .join("; ")
}

/// In the sandbox the session directory's parents are an empty private tmpfs (a write there is
/// checked on the host instead).
const REFUSED: [&str; 12] = [
    "sibling-refused",
    "absolute-refused",
    "sessions-list-refused",
    "shadow-refused",
    "pid1-env-refused",
    "parent-env-refused",
    "service-env-refused",
    "own-env-clean",
    "etc-write-refused",
    "usr-write-refused",
    "network-refused",
    "uid=",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_sessions_of_two_workspaces_reach_neither_each_other_nor_the_host() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": attack(port)}},
            // Symlinks planted by the agent, then used against the file tools.
            {"tool": "shell", "args": {"command": "ln -s /etc/shadow shadow; ln -s .. up; ln -s \"$(dirname \"$PWD\")\" sessions; ln -s /etc etc; mkdir -p d && ln -s ../.. d/out; ln /etc/passwd hard 2>/dev/null; echo planted"}, "expect": "planted"},
            {"tool": "read_file", "args": {"path": "shadow"}, "expect": "path_escape"},
            {"tool": "list_files", "args": {"path": "up"}, "expect": "path_escape"},
            {"tool": "list_files", "args": {"path": "sessions"}, "expect": "path_escape"},
            {"tool": "write_file", "args": {"path": "etc/agentscope-escape", "content": "x"}, "expect": "path_escape"},
            {"tool": "write_file", "args": {"path": "d/out/escape.txt", "content": "x"}, "expect": "path_escape"},
            {"tool": "read_file", "args": {"path": "hard"}, "expect": "not_found"},
            {"tool": "write_file", "args": {"path": "made/by/tool.txt", "content": "mine"}, "expect": "wrote"}
        ],
        "final": "Probed."
    });
    let (stack, _sim, log, _simdir, _second) =
        managed_stack_with("iso-sandbox-tenants", &script, &[]).await;
    let agent_a = managed_agent(&stack, "tenant-a", json!({})).await;
    let a = start_session(&stack, &agent_a, "sandbox", "Probe.").await;
    let sa = wait_outcomes(&stack, &a, 1).await;
    assert_eq!(sa["inputs"][0]["outcome"]["status"], "completed", "{sa:#}");

    // Workspace B, with the default environment.
    let (api_b, b, created, sb) =
        session_of_another_workspace(&stack, "ws-iso-b", "tenant-b", "Probe.").await;
    assert_eq!(
        created["environment"], "sandbox",
        "the default: {created:#}"
    );
    assert_eq!(sb["inputs"][0]["outcome"]["status"], "completed", "{sb:#}");

    let sessions = stack.dir.path.join("sessions");
    assert_eq!(
        std::fs::metadata(&sessions).unwrap().mode() & 0o7777,
        0o711,
        "the sessions root lets a session reach its own directory only"
    );
    let mut uids = vec![];
    for (id, api) in [(&a, &stack.api), (&b, &api_b)] {
        let outputs: Vec<String> = tool_results_in(api, id)
            .await
            .into_iter()
            .map(|(_, output)| output)
            .collect();
        let shell = &outputs[0];
        for refused in REFUSED {
            assert!(
                shell.contains(refused),
                "{id}: `{refused}` missing in {shell}"
            );
        }
        for leaked in [
            "SIBLING-READ",
            "ABSOLUTE-READ",
            "SESSIONS-LISTED",
            "SHADOW-READ",
            "PID1-ENV",
            "PARENT-ENV",
            "SERVICE-ENV",
            "OWN-ENV",
            "WROTE-ETC",
            "WROTE-USR",
            "NETWORK",
        ] {
            assert!(!shell.contains(leaked), "{id}: {leaked} in {shell}");
        }
        let uid: u32 = value_of(shell, "uid").parse().unwrap();
        assert!(UIDS.contains(&uid), "{id} ran as uid {uid}");
        assert_eq!(
            value_of(shell, "whoami"),
            "agent",
            "the generated /etc/passwd names the sandbox user"
        );
        uids.push(uid);
        let root = sessions.join(id);
        let meta = std::fs::metadata(&root).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (uid, 0o700), "{id}");
        assert_eq!(
            std::fs::metadata(root.join("made/by/tool.txt"))
                .unwrap()
                .uid(),
            uid,
            "files written by the file tools belong to the session"
        );
        assert_eq!(std::fs::metadata(root.join("made")).unwrap().uid(), uid);
        // Each symlink attack got its refusal (the scripted model checked each `expect`).
        let errors: Vec<&String> = outputs[2..8].iter().collect();
        assert!(
            errors[..5].iter().all(|o| o.starts_with("path_escape")),
            "{errors:#?}"
        );
        assert!(
            errors[5].starts_with("not_found"),
            "no hard link to a host file: {errors:#?}"
        );
    }
    assert_ne!(uids[0], uids[1], "one identity per session");
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains("SCRIPT EXPECTATION FAILED"),
        "every attack got the refusal the script expects"
    );
    assert!(!std::path::Path::new("/etc/agentscope-escape").exists());
    assert!(
        std::fs::read_dir(&sessions)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with("escape")),
        "nothing written next to the session directories"
    );
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("a sandbox reached the host's loopback: {other:?}"),
    }
}

/// The Memory Store is the workspace's: an agent of another workspace searching for what a
/// session of the first one wrote finds nothing, while a later session of the first one finds it.
/// Each session runs the same script: a search, then a note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workspaces_agent_finds_none_of_a_workspaces_memory() {
    let script = json!({
        "turns": [
            {"tool": "memory_search", "args": {"query": "release checklist"}},
            {"tool": "memory_write", "args": {"text": "The release checklist lives in notes.txt"}, "expect": "remembered"}
        ],
        "final": "Noted."
    });
    let (stack, _sim, _log, _simdir, _second) =
        managed_stack_with("iso-memory-tenants", &script, &[]).await;
    let agent_a = managed_agent(&stack, "memory-a", json!({})).await;
    let first = start_session(&stack, &agent_a, "sandbox", "Remember.").await;
    let s = wait_outcomes(&stack, &first, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let searched = |results: Vec<(String, String)>| {
        results
            .into_iter()
            .find(|(tool, _)| tool == "memory_search")
            .map(|(_, output)| output)
            .unwrap()
    };
    assert_eq!(
        searched(tool_results(&stack, &first).await),
        "no memory matches"
    );

    let (api_b, b, _, sb) =
        session_of_another_workspace(&stack, "ws-memory-b", "memory-b", "Look around.").await;
    assert_eq!(sb["inputs"][0]["outcome"]["status"], "completed", "{sb:#}");
    assert_eq!(
        searched(tool_results_in(&api_b, &b).await),
        "no memory matches",
        "A's note reached workspace B"
    );

    // A's own later session finds its note (and only it: B's stays in B).
    let again = start_session(&stack, &agent_a, "sandbox", "Remember again.").await;
    let s = wait_outcomes(&stack, &again, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    assert_eq!(
        searched(tool_results(&stack, &again).await),
        "- The release checklist lives in notes.txt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_and_a_memory_hog_are_stopped_by_the_session_limits() {
    const PIDS: u32 = 48;
    // Every bomb process forks forever (bash retries a failed fork and goes on), so they pile
    // up to the limit. The watcher counts live processes of its pid namespace (zombies and
    // reaped-but-not-yet-gone entries not counted) with builtins only, so it never forks; it
    // watches until the bomb holds 3/4 of the limit, then 100 samples more (the shell timeout
    // bounds the wait).
    let bomb = format!(
        "bash -c 'f() {{ while :; do f & done; }}; f' >/dev/null 2>&1 & max=0; n=0; \
         while [ $n -lt 100 ]; do c=0; for p in /proc/[0-9]*; do \
           read -r st 2>/dev/null < $p/stat || continue; \
           case $st in *') Z '*|*') X '*) ;; *) c=$((c+1));; esac; done; \
           [ $c -gt $max ] && max=$c; [ $max -ge {} ] && n=$((n+1)); done; \
         echo max-procs=$max",
        PIDS * 3 / 4
    );
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": bomb}, "expect": "max-procs="},
            {"tool": "shell", "args": {"command": "dd if=/dev/zero of=/dev/null bs=1G count=1 2>&1; echo dd-exit=$?"}, "expect": "dd-exit="},
            {"tool": "shell", "args": {"command": "echo still-alive; set -- /proc/[0-9]*; echo procs-now=$#"}, "expect": "still-alive"}
        ],
        "final": "Survived."
    });
    let pids = PIDS.to_string();
    let (stack, _sim, _log, _simdir, _second) = managed_stack_with(
        "iso-sandbox-limits",
        &script,
        &[
            ("AGENTSCOPE_SESSION_MAX_PROCESSES", pids.as_str()),
            ("AGENTSCOPE_SESSION_MEMORY_MB", "256"),
            ("AGENTSCOPE_SHELL_TIMEOUT_SECS", "120"),
        ],
    )
    .await;
    let agent = managed_agent(&stack, "bomber", json!({})).await;
    let id = start_session(&stack, &agent, "sandbox", "Bomb.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");
    let results = tool_results(&stack, &id).await;
    let max: u32 = value_of(&results[0].1, "max-procs").parse().unwrap();
    assert!(
        max <= PIDS,
        "the bomb reached {max} processes, above the limit {PIDS}"
    );
    assert!(
        max >= PIDS * 3 / 4,
        "the bomb ran (it reached {max} processes of {PIDS})"
    );
    let hog = &results[1].1;
    assert!(hog.contains("memory exhausted"), "{hog}");
    assert!(!hog.contains("dd-exit=0"), "{hog}");
    let after = &results[2].1;
    assert!(after.contains("still-alive"), "{after}");
    let now: u32 = value_of(after, "procs-now").parse().unwrap();
    assert!(now <= 4, "the bomb's processes are gone: {after}");
    let log = stack.log("dataplane");
    assert!(
        log.contains("session limits in force"),
        "the dataplane states its limits at start-up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enabled_local_session_runs_as_its_own_uid_without_the_dataplanes_environment() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = json!({
        "turns": [{"tool": "shell", "args": {"command": attack(port)}}],
        "final": "Probed."
    });
    let (stack, _sim, _log, _simdir, _second) =
        managed_stack_with("iso-sandbox-local", &script, &[]).await;
    let agent = managed_agent(&stack, "local", json!({})).await;
    let a = start_session(&stack, &agent, "local", "Probe.").await;
    wait_outcomes(&stack, &a, 1).await;
    let b = start_session(&stack, &agent, "local", "Probe.").await;
    wait_outcomes(&stack, &b, 1).await;
    let mut uids = vec![];
    for id in [&a, &b] {
        let shell = &tool_results(&stack, id).await[0].1;
        // Local is for a trusted single-user install: the network is reachable, but neither
        // the dataplane's environment, nor another session's files, nor root's.
        for refused in [
            "sibling-refused",
            "absolute-refused",
            "sessions-list-refused",
            "shadow-refused",
            "parent-env-refused",
            "service-env-refused",
            "own-env-clean",
            "sessions-write-refused",
            "etc-write-refused",
        ] {
            assert!(
                shell.contains(refused),
                "{id}: `{refused}` missing in {shell}"
            );
        }
        let uid: u32 = value_of(shell, "uid").parse().unwrap();
        assert!(UIDS.contains(&uid), "{id} ran as uid {uid}");
        uids.push(uid);
    }
    assert_ne!(uids[0], uids[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_and_remote_are_refused_unless_the_deployment_enables_them() {
    let script =
        json!({"turns": [{"tool": "shell", "args": {"command": "id -u"}}], "final": "Hi."});
    let simdir = kit::TempDir::new("iso-sandbox-refused-model");
    let (_sim, url, _log) = crate::agents::modelsim(&simdir.path, &script).await;
    let mut stack = Stack::start(
        "iso-sandbox-refused",
        StackOptions {
            dataplane_env: vec![
                ("AGENTSCOPE_MODEL_BASE_URL".into(), url),
                ("AGENTSCOPE_MODEL_API_KEY".into(), "sk-modelsim".into()),
            ],
            // Neither the gateway nor the dataplane enables local.
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let agent = managed_agent(&stack, "refused", json!({})).await;
    for environment in ["local", "remote"] {
        let (status, v) = stack
            .api
            .send(
                reqwest::Method::POST,
                "/v1/sessions",
                Some(json!({"agent_id": agent, "environment": environment, "input": "x"})),
            )
            .await
            .unwrap();
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (403, Some("environment_not_allowed")),
            "{environment}: {v}"
        );
    }
    // A session recorded as `local` anyway (e.g. before the upgrade) is refused by the
    // dataplane with the same code, and its tools never run.
    let sandboxed = start_session(&stack, &agent, "sandbox", "Hello.").await;
    wait_outcomes(&stack, &sandboxed, 1).await;
    // The replica that ran it is stopped first, so no runner still holds the session pinned to
    // `sandbox` when the record changes; a fresh replica reads it anew.
    stack
        .dataplane
        .terminate(std::time::Duration::from_secs(10));
    sqlx::query("UPDATE sessions SET environment = 'local' WHERE id = $1::uuid")
        .bind(&sandboxed)
        .execute(&stack.pg)
        .await
        .unwrap();
    stack
        .api
        .post(
            &format!("/v1/sessions/{sandboxed}/inputs"),
            json!({"text": "Again."}),
        )
        .await
        .unwrap();
    let _fresh = stack.spawn_dataplane("dp-fresh").await.unwrap();
    let s = kit::wait_for(
        "the dataplane's refusal",
        std::time::Duration::from_secs(60),
        || {
            let api = stack.api.clone();
            let path = format!("/v1/sessions/{sandboxed}");
            async move {
                let s = api.get(&path).await.ok()?;
                (s["status"] == "environment_not_allowed").then_some(s)
            }
        },
    )
    .await
    .unwrap();
    assert!(s["inputs"][1]["outcome"].is_null(), "{s:#}");
    let events = session_events(&stack, &sandboxed).await;
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "diagnostic" && e["payload"]["code"] == "environment_not_allowed"),
        "{events:#?}"
    );
    assert_eq!(
        events.iter().filter(|e| e["kind"] == "tool_call").count(),
        1,
        "only the sandboxed turn's tool ran"
    );
}
