//! Providers: how a task's work is started, and how its output becomes normalized events.
//! Architecture invariant: only svc-host spawns provider processes, always in their own process
//! group, so that cancellation reaches the whole tree.

use crate::providers::StreamParser;
use agentscope_domain::FailureClass;
use agentscope_schemas::v1::{Output, ProviderDescriptor, TaskSpec, execution_event::Body};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// How to start a provider process.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// The provider's whole environment besides the platform's own variables: the host's
    /// environment is not inherited (it holds the host token).
    pub env: Vec<(String, String)>,
    /// Files to write before starting (config, translated instructions), relative to the task
    /// directory's root or absolute inside it.
    pub files: Vec<(PathBuf, String)>,
    /// Written to the provider's stdin, which is then closed; None: stdin is /dev/null.
    pub stdin: Option<String>,
    /// Keep stdin open after `stdin` (the provider is driven over it, e.g. approvals).
    pub keep_stdin_open: bool,
    /// How long a tool request may wait for a decision before it is denied.
    pub approval_timeout_ms: u32,
    /// The text the provider is asked to work on (protocol-driven providers send it themselves
    /// once their session is open).
    pub prompt: String,
    /// The provider session this launch continues, if any.
    pub resume_session: Option<String>,
    /// The provider's `Result` event decides success, not its exit status (servers driven over
    /// stdin exit 0 whenever stdin closes).
    pub result_decides: bool,
}

/// A provider asking whether it may use a tool.
#[derive(Debug, Clone)]
pub struct ControlRequest {
    /// Unique within the attempt, across provider restarts (the Approval's key).
    pub request_id: String,
    /// The JSON-RPC id to answer, for providers that ask with a JSON-RPC request.
    pub rpc_id: Option<serde_json::Value>,
    /// What the adapter needs to answer (e.g. ACP's option ids), never shown to anyone.
    pub meta: serde_json::Value,
    pub tool_name: String,
    pub input: serde_json::Value,
}

/// A failure found before anything ran, with its class and the offending field.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub class: FailureClass,
    pub detail: String,
}

impl Refusal {
    pub fn bad_parameter(detail: impl Into<String>) -> Self {
        Refusal {
            class: FailureClass::BadParameters,
            detail: detail.into(),
        }
    }
}

/// What an adapter needs to know to start its provider for one Attempt.
pub struct LaunchCtx<'a> {
    pub spec: &'a TaskSpec,
    pub dir: &'a TaskDir,
    pub attempt_id: &'a str,
    /// The API and credential executors use for the platform's tools.
    pub api_url: &'a str,
    pub task_token: &'a str,
    /// The `agentscope` CLI (its `mcp` subcommand is the platform's MCP server).
    pub cli: PathBuf,
}

/// The interface every provider adapter implements.
pub trait Adapter: Send + Sync {
    fn name(&self) -> &'static str;
    /// Discovery: installed, version, logged in, streaming and resume support.
    fn discover(&self) -> ProviderDescriptor;
    /// Turns the task spec into a command line, environment and files in the task directory.
    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal>;
    /// A fresh parser of this provider's stdout for one run.
    fn parser(&self) -> Box<dyn StreamParser>;
    /// The parser for one particular launch (protocol-driven modes need its prompt and session).
    fn parser_for(&self, _launch: &Launch) -> Box<dyn StreamParser> {
        self.parser()
    }
    /// A stdout line that asks for an approval (providers with a control protocol).
    fn control_request(&self, _line: &str) -> Option<ControlRequest> {
        None
    }
    /// What to write to the provider's stdin to answer `req`.
    fn control_response(&self, _req: &ControlRequest, _allow: bool, _reason: &str) -> String {
        String::new()
    }
    /// A stdout line that means the run cannot succeed (e.g. the model provider refuses the
    /// credentials while the CLI keeps retrying): the provider is stopped and the attempt fails
    /// with this class and detail.
    fn fatal(&self, _line: &str) -> Option<(FailureClass, String)> {
        None
    }
    /// A stdout line saying the provider could not connect to its model endpoint and retries
    /// (no HTTP status: a refused connection, DNS, TLS). Repeated ones end the attempt as
    /// `model_unreachable` (see `attempt::ModelWatch`).
    fn model_connection_error(&self, _line: &str) -> bool {
        false
    }
    /// The model endpoint this provider uses on this host: the evidence of `model_unreachable`.
    fn model_endpoint(&self) -> String {
        String::new()
    }
    /// How to continue provider session `session_id` in the same task directory (H15), if the
    /// provider can.
    fn resume_launch(
        &self,
        _ctx: &LaunchCtx,
        _session_id: &str,
    ) -> Option<Result<Launch, Refusal>> {
        None
    }
    /// Whether an output line says the provider refused to resume its session.
    fn resume_rejected(&self, _line: &str) -> bool {
        false
    }
    /// Whether the provider's session still exists in this task directory.
    fn session_exists(&self, _dir: &TaskDir, _session_id: &str) -> bool {
        false
    }
    /// Longest stdout line read as one unit (agent CLIs put whole tool results on one line).
    fn max_line_bytes(&self) -> usize {
        4 * 1024 * 1024
    }
}

/// The prepared directory of one Attempt.
#[derive(Debug, Clone)]
pub struct TaskDir {
    pub root: PathBuf,
    /// The cloned repository, when the task names one.
    pub repo: Option<PathBuf>,
    pub input_dir: PathBuf,
    /// Per-task HOME and TMPDIR: tasks never share provider state.
    pub home: PathBuf,
    pub tmp: PathBuf,
}

impl TaskDir {
    pub fn workdir(&self) -> &Path {
        self.repo.as_deref().unwrap_or(&self.root)
    }
}

/// Environment every provider gets: a PATH, a locale, its own HOME and TMPDIR.
pub fn base_env(dir: &TaskDir) -> Vec<(String, String)> {
    let mut env = vec![
        ("HOME".to_string(), dir.home.to_string_lossy().into_owned()),
        ("TMPDIR".to_string(), dir.tmp.to_string_lossy().into_owned()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
    ];
    pass_through(&mut env, &["TERM", "TZ"]);
    env
}

/// Copies the named variables from the host's environment when set; only names of
/// [`crate::isolation::HOST_ENV_PASSED`] are ever copied.
pub fn pass_through(env: &mut Vec<(String, String)>, names: &[&str]) {
    for n in names {
        if !crate::isolation::HOST_ENV_PASSED.contains(n) {
            tracing::error!(
                name = n,
                "not in the environment allow-list; not passed to the provider"
            );
            continue;
        }
        if let Ok(v) = std::env::var(n) {
            env.push((n.to_string(), v));
        }
    }
}

/// `binary --version`'s first line, or why it could not run.
pub fn probe_version(bin: &Path) -> Result<String, String> {
    match std::process::Command::new(bin)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .output()
    {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()),
        Ok(out) => Err(format!(
            "`{} --version` failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("`{}` cannot run: {e}", bin.display())),
    }
}

/// A binary named by `env_var`, else found on PATH under `name`.
pub fn locate(env_var: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs a configured command line in the task directory; each output line is an event and the
/// exit status decides success.
pub struct CommandProvider;

struct CommandParser;

impl StreamParser for CommandParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        vec![Body::Output(Output {
            stream: "stdout".into(),
            text: line.to_string(),
            truncated,
        })]
    }
    fn finish(&mut self) -> Vec<Body> {
        vec![]
    }
    fn session_id(&self) -> Option<&str> {
        None
    }
}

impl Adapter for CommandProvider {
    fn name(&self) -> &'static str {
        "command"
    }

    fn discover(&self) -> ProviderDescriptor {
        ProviderDescriptor {
            name: "command".into(),
            installed: true,
            version: env!("CARGO_PKG_VERSION").into(),
            logged_in: true,
            detail: "runs the runtime profile's `command` argv".into(),
            live_stream: true,
            resume: false,
        }
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let spec = ctx.spec;
        if let Some(unknown) = spec
            .params
            .keys()
            .find(|k| !["timeout_secs"].contains(&k.as_str()))
        {
            return Err(Refusal::bad_parameter(format!(
                "unknown parameter `{unknown}` for provider command"
            )));
        }
        if spec.command.is_empty() || spec.command[0].is_empty() {
            return Err(Refusal::bad_parameter(
                "`command` is empty: set params.command to an argv array on the runtime profile",
            ));
        }
        Ok(Launch {
            argv: spec.command.clone(),
            cwd: ctx.dir.workdir().to_path_buf(),
            env: base_env(ctx.dir),
            ..Default::default()
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(CommandParser)
    }

    fn max_line_bytes(&self) -> usize {
        64 * 1024
    }
}

/// Reads one line of at most `max` bytes; the rest of a longer line is discarded and the line is
/// marked truncated. Invalid UTF-8 is replaced, never rejected. None at end of input.
pub async fn read_line_bounded<R: AsyncBufRead + Unpin>(
    r: &mut R,
    max: usize,
) -> std::io::Result<Option<(String, bool)>> {
    let mut buf = Vec::new();
    let mut truncated = false;
    let mut saw_any = false;
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            if !saw_any {
                return Ok(None);
            }
            break;
        }
        saw_any = true;
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        let room = max.saturating_sub(buf.len());
        if take > room {
            truncated = true;
        }
        buf.extend_from_slice(&chunk[..take.min(room)]);
        r.consume(if done { take + 1 } else { take });
        if done {
            break;
        }
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some((
        String::from_utf8_lossy(&buf).into_owned(),
        truncated,
    )))
}

/// Every process id in `/proc`.
pub fn proc_pids() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
}

/// Ids of live (non-zombie) processes in process group `pgid`, read from /proc.
pub fn group_members(pgid: i32) -> Vec<i32> {
    proc_pids()
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                return false;
            };
            let mut f = rest.split_whitespace();
            let state = f.next().unwrap_or("Z");
            let pgrp = f.nth(1).and_then(|s| s.parse::<i32>().ok());
            pgrp == Some(pgid) && state != "Z" && state != "X"
        })
        .collect()
}

/// Live processes whose environment carries `marker` (e.g. `AGENTSCOPE_ATTEMPT_ID=<id>`): a
/// provider's whole tree, including children that left its process group.
pub fn marked_processes(marker: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    proc_pids()
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.split_whitespace().next().unwrap_or("Z").to_string())
                })
                .is_some_and(|st| st != "Z" && st != "X");
            alive
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| env.split(|b| *b == 0).any(|kv| kv == marker.as_bytes()))
                    .unwrap_or(false)
        })
        .collect()
}

/// SIGKILLs every process carrying `marker` until none is left (or 10 s pass); the survivors.
pub async fn kill_marked(marker: &str) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = marker.to_string();
        let left = tokio::task::spawn_blocking(move || marked_processes(&m))
            .await
            .unwrap_or_default();
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return left;
        }
        for pid in &left {
            // SAFETY: plain signal to a process of this attempt.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops an attempt's provider tree whose sentinel leads process group `pgid`: the sentinel is
/// told to end whatever is left once the provider is gone; SIGTERM to the group, SIGKILL after
/// `grace` (at once without one); then whatever still carries the attempt's `marker` (a
/// sentinel killed by the group's SIGKILL leaves the orphans it adopted behind). The survivors.
pub async fn stop_tree(pgid: i32, grace: Option<Duration>, marker: &str) -> Vec<i32> {
    crate::isolation::end_rest(pgid);
    let mut left = match grace {
        Some(grace) => terminate_group(pgid, grace).await,
        None => kill_group(pgid).await,
    };
    left.extend(kill_marked(marker).await);
    left
}

/// Sends `signal` to every process of group `pgid`.
pub fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns once no process of the group is left (or after
/// a further 10 s, returning the survivors).
pub async fn terminate_group(pgid: i32, grace: Duration) -> Vec<i32> {
    signal_group(pgid, libc::SIGTERM);
    if wait_group_empty(pgid, grace).await {
        return vec![];
    }
    signal_group(pgid, libc::SIGKILL);
    if wait_group_empty(pgid, Duration::from_secs(10)).await {
        return vec![];
    }
    group_members(pgid)
}

/// Kills the whole group at once (lease lost: the work must stop now).
pub async fn kill_group(pgid: i32) -> Vec<i32> {
    signal_group(pgid, libc::SIGKILL);
    if wait_group_empty(pgid, Duration::from_secs(10)).await {
        return vec![];
    }
    group_members(pgid)
}

async fn wait_group_empty(pgid: i32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let empty = tokio::task::spawn_blocking(move || group_members(pgid).is_empty())
            .await
            .unwrap_or(false);
        if empty {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_lines_are_truncated_and_bad_utf8_is_replaced() {
        let mut input: Vec<u8> = vec![b'a'; 5000];
        input.push(b'\n');
        input.extend_from_slice(&[0xff, 0xfe, b'o', b'k', b'\n', b't', b'a', b'i', b'l']);
        let mut r = tokio::io::BufReader::with_capacity(64, &input[..]);
        let (l1, t1) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert_eq!((l1.len(), t1), (1024, true));
        let (l2, t2) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert!(l2.ends_with("ok") && !t2, "{l2:?}");
        let (l3, _) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert_eq!(l3, "tail");
        assert!(read_line_bounded(&mut r, 1024).await.unwrap().is_none());
    }

    #[test]
    fn command_provider_refuses_unknown_parameters_by_name() {
        let dir = TaskDir {
            root: "/tmp".into(),
            repo: None,
            input_dir: "/tmp".into(),
            home: "/tmp".into(),
            tmp: "/tmp".into(),
        };
        let mut spec = TaskSpec {
            command: vec!["true".into()],
            ..Default::default()
        };
        spec.params.insert("colour".into(), "blue".into());
        let ctx = LaunchCtx {
            spec: &spec,
            dir: &dir,
            attempt_id: "a",
            api_url: "http://x",
            task_token: "agt_x",
            cli: "/bin/agentscope".into(),
        };
        let err = CommandProvider.launch(&ctx).unwrap_err();
        assert_eq!(err.class, FailureClass::BadParameters);
        assert!(err.detail.contains("colour"));
    }
}

/// The unprivileged identity one attempt's provider runs as (see `isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}
