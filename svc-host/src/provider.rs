//! The provider interface: the [`Adapter`] trait every provider implements (`providers/`), what
//! a launch is made of, and the helpers the agent CLIs' adapters share.
//! Architecture invariant: only svc-host spawns provider processes, always in their own process
//! group, so that cancellation reaches the whole tree.

use crate::attempt::Spec;
use crate::providers::StreamParser;
use agentscope_domain::{FailureClass, Provider};
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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
    pub spec: &'a Spec,
    pub dir: &'a TaskDir,
    pub attempt_id: &'a str,
    /// The API and credential executors use for the platform's tools.
    pub api_url: &'a str,
    pub task_token: &'a str,
    /// The `agentscope` CLI (its `mcp` subcommand is the platform's MCP server).
    pub cli: &'a Path,
}

/// The interface every provider adapter implements.
pub trait Adapter: Send + Sync {
    /// The provider this adapter runs.
    fn provider(&self) -> Provider;
    /// Its name, as in `Spec.provider`.
    fn name(&self) -> &'static str {
        self.provider().as_str()
    }
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
    /// How to continue provider session `session_id` in the same task directory, if the
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

/// The unprivileged identity one attempt's provider runs as (see `isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

// Shared by the agent CLIs' adapters (`providers/*/mod.rs`).

/// Parameters every agent CLI accepts.
pub const COMMON_PARAMS: [&str; 3] = ["model", "timeout_secs", "extra_args"];

pub fn check_params(
    provider: &str,
    params: &HashMap<String, String>,
    extra: &[&str],
) -> Result<(), Refusal> {
    if let Some(k) = params
        .keys()
        .find(|k| !COMMON_PARAMS.contains(&k.as_str()) && !extra.contains(&k.as_str()))
    {
        return Err(Refusal::bad_parameter(format!(
            "unknown parameter `{k}` for provider {provider} (accepted: {})",
            COMMON_PARAMS
                .iter()
                .chain(extra)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

pub fn extra_args(params: &HashMap<String, String>) -> Vec<String> {
    params
        .get("extra_args")
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// `approvals` (ask or native) and `approval_timeout_secs` of a runtime profile: whether tool
/// requests are forwarded as Approvals, and how long one may wait for a decision.
pub fn approval_params(p: &HashMap<String, String>) -> Result<(bool, u32), Refusal> {
    let ask = match p.get("approvals").map(String::as_str) {
        None | Some("native") => false,
        Some("ask") => true,
        Some(other) => {
            return Err(Refusal::bad_parameter(format!(
                "`approvals` must be ask or native, not `{other}`"
            )));
        }
    };
    let approval_timeout_ms = match p.get("approval_timeout_secs") {
        None => 600_000,
        Some(t) => t
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=86_400).contains(n))
            .map(|n| n * 1000)
            .ok_or_else(|| {
                Refusal::bad_parameter(format!(
                    "`approval_timeout_secs` must be 1 to 86400, not `{t}`"
                ))
            })?,
    };
    Ok((ask, approval_timeout_ms))
}

/// The task as a prompt: the Issue, the input material, and how to use the platform's tools.
pub fn prompt(ctx: &LaunchCtx) -> String {
    let s = ctx.spec;
    let mut p = String::new();
    if !s.issue_title.is_empty() {
        p.push_str(&format!(
            "You are working on the Issue \"{}\".\n\n{}\n\n",
            s.issue_title, s.issue_body
        ));
    }
    if !s.input.is_empty() {
        p.push_str(&format!("Input material:\n{}\n\n", s.input));
    }
    p.push_str(
        "The agentscope tools let you read the Issue and its comments (read_issue), read the task's \
         input (read_input), post a comment (post_comment) and upload deliverables as Artifacts \
         (upload_artifact). Files you leave in this directory are not shared; upload what others need.",
    );
    let cli = ctx.cli.to_string_lossy();
    p.push_str(&format!(
        "\n\nThe tools reach the platform from outside any sandbox: prefer them. The same operations \
         are a command line, always at this absolute path (a login shell may reset PATH): \
         `{cli} task show`, `{cli} task comment TEXT`, `{cli} task upload FILE`. The command \
         needs network access to the platform's API, which a sandbox may refuse."
    ));
    p
}

/// Instructions of the agent version, in Markdown.
pub fn instructions(ctx: &LaunchCtx) -> String {
    format!("# Agent instructions\n\n{}\n", ctx.spec.instructions)
}

pub fn mcp_env(ctx: &LaunchCtx) -> serde_json::Value {
    json!({"AGENTSCOPE_API": ctx.api_url, "AGENTSCOPE_TASK_TOKEN": ctx.task_token})
}

pub fn rel(ctx: &LaunchCtx, p: &Path) -> PathBuf {
    p.strip_prefix(&ctx.dir.root)
        .map(|r| r.to_path_buf())
        .unwrap_or_else(|_| p.to_path_buf())
}

pub fn descriptor(
    name: &str,
    env_var: &str,
    bin_name: &str,
    key_vars: &[&str],
    live_stream: bool,
    resume: bool,
) -> ProviderDescriptor {
    let mut d = ProviderDescriptor {
        name: name.into(),
        live_stream,
        resume,
        ..Default::default()
    };
    let Some(bin) = locate(env_var, bin_name) else {
        d.detail = format!(
            "`{bin_name}` not found: install it (scripts/install-providers.sh) or set {env_var}"
        );
        return d;
    };
    match probe_version(&bin) {
        Ok(v) => {
            d.installed = true;
            d.version = v;
        }
        Err(e) => {
            d.detail = e;
            return d;
        }
    }
    d.logged_in = key_vars
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()));
    d.detail = if d.logged_in {
        format!("{} at {}", bin_name, bin.display())
    } else {
        format!(
            "no credentials: set {} in the host's environment",
            key_vars.join(" or ")
        )
    };
    if !live_stream {
        d.detail
            .push_str("; no live event stream (one result at the end)");
    }
    if !resume {
        d.detail.push_str("; no session resume");
    }
    d
}

pub fn binary(env_var: &str, name: &str) -> Result<String, Refusal> {
    locate(env_var, name)
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| Refusal {
            class: agentscope_domain::FailureClass::ToolDependency,
            detail: format!("`{name}` is not installed on this host"),
        })
}

/// The OpenAI-compatible endpoint a host's providers use: OPENAI_BASE_URL, default OpenAI's.
pub fn openai_base() -> String {
    std::env::var("OPENAI_BASE_URL").unwrap_or_else(|_| "https://api.openai.com/v1".into())
}

/// What a resumed provider session is asked to do.
pub const CONTINUE: &str = "The Runtime Host restarted while you worked on this task. Continue where you left off and finish it.";
