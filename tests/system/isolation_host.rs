//! Hosted execution isolation, attacked as an agent would attack it: two tasks run at once on
//! one host, each under its own uid; the second one's shell tries to read the first one's task
//! directory, credential files and process environment, the host's environment and state, and
//! to use whatever it found against the API. Each attempt is refused. A provider printing its
//! environment records no credential.

use crate::agents::{modelsim, provider_agent, provider_env};
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The host's default uid range (svc-host `isolation::DEFAULT_UID_RANGE`).
const UIDS: std::ops::RangeInclusive<u32> = 1_900_000_000..=1_900_004_095;

fn mode(p: &Path) -> (u32, u32) {
    let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("stat {}: {e}", p.display()));
    (m.mode() & 0o7777, m.uid())
}

/// Live processes whose real uid is `uid`.
fn processes_of_uid(uid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                return false;
            };
            let live = s
                .lines()
                .find_map(|l| l.strip_prefix("State:"))
                .is_some_and(|st| !st.trim_start().starts_with(['Z', 'X']));
            let ours = s
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().next()?.parse::<u32>().ok())
                == Some(uid);
            live && ours
        })
        .collect()
}

async fn wait_file(path: &Path, within: Duration) -> String {
    let p = path.to_path_buf();
    kit::wait_for(&format!("{}", path.display()), within, || {
        let p = p.clone();
        async move { std::fs::read_to_string(&p).ok().filter(|s| !s.is_empty()) }
    })
    .await
    .unwrap()
}

async fn comments(stack: &Stack, issue_id: &str) -> String {
    stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap()
        .to_string()
}

async fn issue_for(stack: &Stack, agent: &str, title: &str) -> (String, String) {
    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": title, "body": "work", "assignee_agent_id": agent}),
        )
        .await
        .unwrap();
    (
        issue["id"].as_str().unwrap().to_string(),
        issue["task_id"].as_str().unwrap().to_string(),
    )
}

/// Every `REFUSED-<label>` is in `text`, and no `LEAK-`.
fn assert_refused(text: &str, labels: &[&str]) {
    for l in labels {
        assert!(
            text.contains(&format!("REFUSED-{l}")),
            "the attack `{l}` did not run or was not refused: {text}"
        );
    }
    assert!(!text.contains("LEAK-"), "an attack succeeded: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_reach_another_running_tasks_files_environment_or_the_hosts() {
    let stack = Stack::start("iso-host", StackOptions::default())
        .await
        .unwrap();
    let s = stack.shared.display().to_string();
    // The victim keeps its credential in its task directory and in its HOME, says where it is
    // (as an attacker might find out: its pid from /proc), and waits until the attacker is done.
    let victim = format!(
        "printf %s \"$AGENTSCOPE_TASK_TOKEN\" > \"$AGENTSCOPE_TASK_DIR/secret.txt\"; \
         mkdir -p \"$HOME/.config\"; printf %s \"$AGENTSCOPE_TASK_TOKEN\" > \"$HOME/.config/credentials\"; \
         read HOSTPID _ < /proc/self/stat; \
         echo \"$AGENTSCOPE_TASK_DIR $HOSTPID $(id -u)\" > {s}/a.tmp; chmod 644 {s}/a.tmp; mv {s}/a.tmp {s}/a.info; \
         i=0; while [ ! -e {s}/b.done ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done; echo victim-done"
    );
    let attack = format!(
        r#"S={s}
while [ ! -e $S/a.info ]; do sleep 0.05; done
read ADIR APID AUID < $S/a.info
STATE=$(dirname "$(dirname "$ADIR")")
echo "me $(id -u) groups $(id -G) victim $AUID"
try() {{ label=$1; shift; if out=$("$@" 2>/dev/null) && [ -n "$out" ]; then echo "LEAK-$label: $out"; else echo "REFUSED-$label"; fi; }}
try list-task-dir ls -A "$ADIR"
try task-secret cat "$ADIR/secret.txt"
try home-credentials cat "$ADIR/home/.config/credentials"
try input cat "$ADIR/input/ISSUE.md"
try victim-environ cat /proc/$APID/environ
try host-environ cat /proc/$PPID/environ
try list-tasks ls -A "$(dirname "$ADIR")"
try list-state ls -A "$STATE"
try host-id cat "$STATE/host_id"
try journal ls -A "$STATE/journal"
try write-victim touch "$ADIR/planted"
found=$(cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' '\n' | grep -o 'agt_[0-9a-f]\{{32,\}}' | grep -v "^$AGENTSCOPE_TASK_TOKEN\$" | sort -u)
if [ -n "$found" ]; then echo "LEAK-proc-scan: $found"; else echo "REFUSED-proc-scan"; fi
for t in $found $(cat "$ADIR/secret.txt" 2>/dev/null); do
  AGENTSCOPE_TASK_TOKEN=$t agentscope task comment "pwned by B" >/dev/null 2>&1 && echo "LEAK-api"
done
kill -9 $APID 2>/dev/null && echo LEAK-kill || echo REFUSED-kill
echo attack-done
touch $S/b.done
"#
    );
    std::fs::write(stack.shared.join("attack.sh"), attack).unwrap();
    let attack_path = stack.shared.join("attack.sh").display().to_string();
    let (victim_agent, _) = stack
        .command_agent("victim", "pool", &["sh", "-c", &victim], None)
        .await
        .unwrap();
    let (attacker_agent, _) = stack
        .command_agent("attacker", "pool", &["sh", &attack_path], None)
        .await
        .unwrap();
    let (_host, state) = stack.host("h", "pool", 2).await.unwrap();
    let (victim_issue, victim_task) = issue_for(&stack, &victim_agent, "victim work").await;
    let info = wait_file(&stack.shared.join("a.info"), Duration::from_secs(60)).await;
    let mut parts = info.split_whitespace();
    let adir = PathBuf::from(parts.next().unwrap());
    let _apid = parts.next().unwrap();
    let auid: u32 = parts.next().unwrap().parse().unwrap();
    let victim_token = std::fs::read_to_string(adir.join("secret.txt")).unwrap();
    assert!(victim_token.starts_with("agt_"), "{victim_token}");

    // What the filesystem says while the victim runs.
    assert!(UIDS.contains(&auid), "the victim runs under uid {auid}");
    assert_eq!(mode(&adir), (0o700, auid), "the task directory");
    assert_eq!(mode(&adir.join("input/INPUT.md")).0, 0o600);
    assert_eq!(mode(&adir.join("secret.txt")).0 & 0o077, 0, "umask 077");
    assert_eq!(mode(&state), (0o711, 0), "the state directory");
    assert_eq!(mode(&state.join("tasks")), (0o711, 0));
    assert_eq!(mode(&state.join("journal")), (0o700, 0));
    assert_eq!(mode(&state.join("host_id")), (0o600, 0));

    let (_, attacker_task) = issue_for(&stack, &attacker_agent, "attacker work").await;
    let attacker = stack
        .wait_task(&attacker_task, "succeeded", Duration::from_secs(90))
        .await
        .unwrap();
    stack
        .wait_task(&victim_task, "succeeded", Duration::from_secs(90))
        .await
        .unwrap();
    let events = serde_json::to_string(
        &stack
            .events(&format!("/v1/tasks/{attacker_task}/events"))
            .await
            .unwrap(),
    )
    .unwrap();
    assert!(events.contains("attack-done"), "{events}");
    assert_refused(
        &events,
        &[
            "list-task-dir",
            "task-secret",
            "home-credentials",
            "input",
            "victim-environ",
            "host-environ",
            "list-tasks",
            "list-state",
            "host-id",
            "journal",
            "write-victim",
            "proc-scan",
            "kill",
        ],
    );
    assert!(!events.contains(&victim_token), "the victim's token");
    assert!(!events.contains(&stack.host_token), "the host token");
    // Two attempts at once: two uids of the range, no supplementary group.
    let me = events
        .split("me ")
        .nth(1)
        .and_then(|r| r.split(" victim").next())
        .unwrap()
        .to_string();
    let buid: u32 = me.split_whitespace().next().unwrap().parse().unwrap();
    assert!(UIDS.contains(&buid) && buid != auid, "{me}");
    assert_eq!(me, format!("{buid} groups {buid}"));
    assert!(!comments(&stack, &victim_issue).await.contains("pwned"));
    assert!(!adir.join("planted").exists());
    // Once attempts end their uids have no process left, and the directory is the host's again.
    for uid in [auid, buid] {
        assert!(processes_of_uid(uid).is_empty(), "uid {uid} still runs");
    }
    assert_eq!(
        mode(&adir).1,
        0,
        "the ended attempt's directory is taken back"
    );
    assert_eq!(attacker["attempts"][0]["status"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_printing_its_environment_records_no_credential_and_leaves_no_process() {
    let stack = Stack::start("iso-env", StackOptions::default())
        .await
        .unwrap();
    let s = stack.shared.display().to_string();
    // `env` prints everything the provider got; a detached child leaves the process group and
    // clears its environment (the host's marker), and must still not outlive the attempt.
    let script = format!(
        "env; printf %s \"$AGENTSCOPE_TASK_TOKEN\" > {s}/tok; chmod 644 {s}/tok; id -u > {s}/uid; chmod 644 {s}/uid; \
         setsid env -i sleep 300 </dev/null >/dev/null 2>&1 & \
         while [ ! -e {s}/tok ]; do sleep 0.05; done; echo printed"
    );
    let (agent, _) = stack
        .command_agent("printer", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let state = stack.dir.path.join("host-env-state");
    let _host = stack
        .spawn_host(
            "h",
            "pool",
            1,
            &state,
            // Host settings and credentials that must not reach the command provider.
            &[
                ("OPENAI_API_KEY", "sk-host-canary-0123456789"),
                ("AGENTSCOPE_CAPABILITIES", "canary-capability"),
            ],
        )
        .unwrap();
    stack.wait_host_ready("h").await.unwrap();
    let (_, task) = issue_for(&stack, &agent, "print the environment").await;
    stack
        .wait_task(&task, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let token = std::fs::read_to_string(stack.shared.join("tok")).unwrap();
    let uid: u32 = std::fs::read_to_string(stack.shared.join("uid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let events = stack
        .events(&format!("/v1/tasks/{task}/events"))
        .await
        .unwrap();
    let text = serde_json::to_string(&events).unwrap();
    assert!(token.starts_with("agt_"));
    assert!(
        !text.contains(&token),
        "the task token was recorded: {text}"
    );
    assert!(
        text.contains("AGENTSCOPE_TASK_TOKEN=[REDACTED:TASK_TOKEN]"),
        "{text}"
    );
    for secret in [
        stack.host_token.as_str(),
        "sk-host-canary",
        "canary-capability",
        "AGENTSCOPE_HOST_TOKEN",
        "AGENTSCOPE_NATS_URL",
        "AGENTSCOPE_STATE_DIR",
    ] {
        assert!(!text.contains(secret), "{secret} reached the provider");
    }
    // Every variable the provider saw is on the documented allow-list (or set by `sh` itself).
    let allowed = [
        "HOME",
        "TMPDIR",
        "USER",
        "LOGNAME",
        "LANG",
        "PATH",
        "TERM",
        "TZ",
        "AGENTSCOPE_TASK_ID",
        "AGENTSCOPE_ATTEMPT_ID",
        "AGENTSCOPE_WORKSPACE_ID",
        "AGENTSCOPE_TASK_DIR",
        "AGENTSCOPE_INPUT_DIR",
        "AGENTSCOPE_API",
        "AGENTSCOPE_TASK_TOKEN",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    ];
    let names: Vec<String> = events
        .iter()
        .filter(|e| e["kind"] == "output")
        .filter_map(|e| e["payload"]["text"].as_str())
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_string()))
        .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    assert!(
        names.contains(&"AGENTSCOPE_TASK_TOKEN".to_string()),
        "{names:?}"
    );
    for n in &names {
        assert!(
            allowed.contains(&n.as_str()),
            "{n} is not on the allow-list"
        );
    }
    assert!(text.contains(&format!("USER=agentscope-{uid}")), "{text}");
    assert!(UIDS.contains(&uid), "{uid}");
    // The detached child is gone with the attempt's uid.
    assert!(
        processes_of_uid(uid).is_empty(),
        "a process of the ended attempt survives"
    );
}

fn step_script(s: &str) -> String {
    format!(
        r#"S={s}
if mkdir -m 755 "$S/victim.d" 2>/dev/null; then
  echo "$AGENTSCOPE_TASK_DIR" > "$S/victim.d/dir.tmp"; chmod 644 "$S/victim.d/dir.tmp"; mv "$S/victim.d/dir.tmp" "$S/victim.d/dir"
  i=0; while [ ! -e "$S/attack.done" ] && [ $i -lt 1800 ]; do sleep 0.05; i=$((i+1)); done
  echo "victim step-done"
else
  while [ ! -e "$S/victim.d/dir" ]; do sleep 0.05; done
  ADIR=$(cat "$S/victim.d/dir")
  for f in claude-mcp.json home/.claude/settings.json CLAUDE.md input/ISSUE.md; do
    if cat "$ADIR/$f" >/dev/null 2>&1; then echo "LEAK-$f: $(cat "$ADIR/$f")"; else echo "REFUSED-$f"; fi
  done
  found=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep -o 'agt_[0-9a-f]\{{32,\}}' | grep -v "^$AGENTSCOPE_TASK_TOKEN\$" | sort -u)
  if [ -n "$found" ]; then echo "LEAK-environ: $found"; else echo "REFUSED-environ"; fi
  tok=$(grep -o 'agt_[0-9a-f]\{{32,\}}' "$ADIR/claude-mcp.json" 2>/dev/null)
  for t in $found $tok; do
    AGENTSCOPE_TASK_TOKEN=$t agentscope task comment "pwned through claude" >/dev/null 2>&1 && echo LEAK-api
  done
  touch "$S/attack.done"
  echo "attacker step-done"
fi
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_running_a_shell_command_cannot_read_another_tasks_token() {
    let stack = Stack::start("iso-claude", StackOptions::default())
        .await
        .unwrap();
    let s = stack.shared.display().to_string();
    std::fs::write(stack.shared.join("step.sh"), step_script(&s)).unwrap();
    // Both sessions play the same script: the first to reach the shell step is the victim.
    let script = json!({
        "turns": [
            {"say": "Running the step.", "tool": "shell",
             "args": {"command": format!("sh {s}/step.sh")}, "expect": "step-done"}
        ],
        "final": "Done."
    });
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    let agent = provider_agent(&stack, "claude-iso", "claude-code", json!({}), json!({})).await;
    let mut env = provider_env();
    env.extend([
        (
            "AGENTSCOPE_PROVIDERS".to_string(),
            "claude-code".to_string(),
        ),
        ("ANTHROPIC_BASE_URL".to_string(), url.clone()),
        ("ANTHROPIC_API_KEY".to_string(), "sk-modelsim".to_string()),
    ]);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let state = stack.dir.path.join("host-claude-state");
    let _host = stack.spawn_host("hc", "agents", 2, &state, &extra).unwrap();
    stack.wait_host_ready("hc").await.unwrap();
    let (issue_a, task_a) = issue_for(&stack, &agent, "first").await;
    let (issue_b, task_b) = issue_for(&stack, &agent, "second").await;

    let adir = PathBuf::from(
        wait_file(&stack.shared.join("victim.d/dir"), Duration::from_secs(180))
            .await
            .trim(),
    );
    let mcp = adir.join("claude-mcp.json");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(&mcp).unwrap()).unwrap();
    let victim_token = config["mcpServers"]["agentscope"]["env"]["AGENTSCOPE_TASK_TOKEN"]
        .as_str()
        .unwrap()
        .to_string();
    let vuid = mode(&adir).1;
    assert!(UIDS.contains(&vuid), "the victim runs under uid {vuid}");
    assert_eq!(mode(&adir), (0o700, vuid));
    assert_eq!(mode(&mcp), (0o600, vuid), "claude-mcp.json");
    assert_eq!(
        mode(&adir.join("home/.claude/settings.json")),
        (0o600, vuid)
    );

    let mut attacker_events = String::new();
    let mut victim_issue = String::new();
    for (issue, task) in [(&issue_a, &task_a), (&issue_b, &task_b)] {
        let t = match stack
            .wait_task(task, "succeeded", Duration::from_secs(240))
            .await
        {
            Ok(t) => t,
            Err(e) => panic!("{e}\nhost log:\n{}", stack.log("host-hc")),
        };
        let attempt = t["attempts"][0]["id"].as_str().unwrap();
        let events = serde_json::to_string(
            &stack
                .events(&format!("/v1/attempts/{attempt}/events"))
                .await
                .unwrap(),
        )
        .unwrap();
        if adir.ends_with(attempt) {
            victim_issue = issue.clone();
        } else {
            attacker_events = events;
        }
    }
    assert!(!victim_issue.is_empty(), "the victim is one of the tasks");
    assert!(
        attacker_events.contains("attacker step-done"),
        "{attacker_events}"
    );
    assert_refused(
        &attacker_events,
        &[
            "claude-mcp.json",
            "home/.claude/settings.json",
            "CLAUDE.md",
            "input/ISSUE.md",
            "environ",
        ],
    );
    assert!(!attacker_events.contains(&victim_token));
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        requests.contains("REFUSED-claude-mcp.json"),
        "the attacker's tool result reached the model"
    );
    assert!(
        !requests.contains(&victim_token),
        "the victim's token reached the attacker's model"
    );
    assert!(!comments(&stack, &victim_issue).await.contains("pwned"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_ends_with_its_whole_process_tree_and_output() {
    let stack = Stack::start("iso-tree", StackOptions::default())
        .await
        .unwrap();
    let s = stack.shared.display().to_string();
    // A background child still printing after the provider exits (it holds the output pipe:
    // the attempt runs until it is done), and a daemon that left the process group, cleared its
    // environment, ignores SIGTERM and holds nothing: it must not outlive the attempt.
    let script = format!(
        "id -u > {s}/uid; chmod 644 {s}/uid; \
         (sleep 0.5; echo late-output) & \
         setsid sh -c 'trap \"\" TERM; exec env -i sleep 300' </dev/null >/dev/null 2>&1 & \
         echo early-output"
    );
    let (agent, _) = stack
        .command_agent("tree", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (missing, _) = stack
        .command_agent("missing", "pool", &["no-such-tool-7f3a"], None)
        .await
        .unwrap();
    let _host = stack.host("h", "pool", 2).await.unwrap();
    let (_, task) = issue_for(&stack, &agent, "a tree").await;
    stack
        .wait_task(&task, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let uid: u32 = std::fs::read_to_string(stack.shared.join("uid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(UIDS.contains(&uid), "{uid}");
    assert!(
        processes_of_uid(uid).is_empty(),
        "a process of the ended attempt survives"
    );
    let text = serde_json::to_string(
        &stack
            .events(&format!("/v1/tasks/{task}/events"))
            .await
            .unwrap(),
    )
    .unwrap();
    assert!(text.contains("early-output"), "{text}");
    assert!(
        text.contains("late-output"),
        "output after the provider's exit is kept: {text}"
    );

    // A program the host cannot find is the provider's missing tool, found before anything runs.
    let (_, task) = issue_for(&stack, &missing, "a missing tool").await;
    let t = stack
        .wait_task(&task, "failed", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        t["attempts"][0]["failure_class"], "tool_dependency",
        "{t:#}"
    );
}

/// Seconds since `p` last changed (modification or status change), or None once it is gone.
fn age_of(p: &Path) -> Option<f64> {
    let m = std::fs::symlink_metadata(p).ok()?;
    let at = |s: i64, ns: i64| s as f64 + ns as f64 / 1e9;
    let changed = at(m.mtime(), m.mtime_nsec()).max(at(m.ctime(), m.ctime_nsec()));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    Some(now - changed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_attempts_task_directory_goes_after_the_retention_and_a_running_ones_stays() {
    let stack = Stack::start("task-dir-retention", StackOptions::default())
        .await
        .unwrap();
    // A long attempt (it runs until its gate appears) and a short one, in the host's pool.
    let gate = stack.dir.path.join("keep-gate");
    let script = format!("while [ ! -e '{}' ]; do sleep 0.02; done", gate.display());
    let (long_agent, _) = stack
        .command_agent("long", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (short_agent, _) = stack
        .command_agent("short", "pool", &["true"], None)
        .await
        .unwrap();
    let state = stack.dir.path.join("host-keep-state");
    let _host = stack
        .spawn_host(
            "keep",
            "pool",
            2,
            &state,
            &[("AGENTSCOPE_TASK_DIR_RETENTION_SECS", "1")],
        )
        .unwrap();
    stack.wait_host_ready("keep").await.unwrap();
    let tasks = state.join("tasks");
    let long = stack.submit(json!({"agent_id": long_agent})).await.unwrap();
    let running = stack
        .wait_attempt(&long, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let long_dir = tasks.join(running["id"].as_str().unwrap());
    // Its directory becomes older than the retention while it runs.
    kit::wait_for(
        "the running attempt's directory to age",
        Duration::from_secs(30),
        || {
            let d = long_dir.clone();
            async move { (age_of(&d)? > 2.0).then_some(()) }
        },
    )
    .await
    .unwrap();

    // The short attempt ends; its directory goes once the retention has passed.
    let short = stack
        .submit(json!({"agent_id": short_agent}))
        .await
        .unwrap();
    let done = stack
        .wait_task(&short, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let short_dir = tasks.join(done["attempts"][0]["id"].as_str().unwrap());
    kit::wait_for(
        "the ended attempt's directory to go",
        Duration::from_secs(30),
        || {
            let d = short_dir.clone();
            async move { (!d.exists()).then_some(()) }
        },
    )
    .await
    .unwrap();
    // That pass saw the running attempt's directory past the retention too, and kept it.
    assert!(
        long_dir.join("home").is_dir(),
        "a running attempt's directory was removed"
    );

    std::fs::write(&gate, "go").unwrap();
    stack
        .wait_task(&long, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    kit::wait_for(
        "the long attempt's directory to go",
        Duration::from_secs(30),
        || {
            let d = long_dir.clone();
            async move { (!d.exists()).then_some(()) }
        },
    )
    .await
    .unwrap();
}
