//! `agentscope`: the command-line client of the agentscope API.
//!
//! Every command is one or a few HTTP calls to the gateway's `/v1` API. Human output is the
//! default; `--json` prints the API's responses as they are. Any API error is printed as
//! `error: <code>: <message>` on stderr with exit status 1.

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use reqwest::{Method, RequestBuilder, StatusCode};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;
use uuid::Uuid;

#[path = "agentscope/executor.rs"]
mod executor;

#[derive(Parser)]
#[command(
    name = "agentscope",
    version,
    about = "Command-line client for the agentscope control plane"
)]
struct Cli {
    /// Base URL of the agentscope API.
    #[arg(
        long,
        global = true,
        env = "AGENTSCOPE_API",
        default_value = "http://127.0.0.1:8080"
    )]
    api: String,
    /// Workspace API token, sent as `Authorization: Bearer`.
    #[arg(long, global = true, env = "AGENTSCOPE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print the API's raw JSON responses instead of human-readable output.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create workspaces (needs the deployment's admin token).
    Workspace {
        #[command(subcommand)]
        cmd: WorkspaceCmd,
    },
    /// Create host registration tokens.
    HostToken {
        #[command(subcommand)]
        cmd: HostTokenCmd,
    },
    /// Agents and their versions.
    Agents {
        #[command(subcommand)]
        cmd: AgentsCmd,
    },
    /// Runtime profiles (how a provider is launched on a host).
    Profiles {
        #[command(subcommand)]
        cmd: ProfilesCmd,
    },
    /// Pools of hosts.
    Pools {
        #[command(subcommand)]
        cmd: PoolsCmd,
    },
    /// Bindings of agents to pools and runtime profiles.
    Bindings {
        #[command(subcommand)]
        cmd: BindingsCmd,
    },
    /// Hosts and their three checks (default: list).
    Hosts {
        #[command(subcommand)]
        cmd: Option<HostsCmd>,
    },
    /// Issues and their comments.
    Issues {
        #[command(subcommand)]
        cmd: IssuesCmd,
    },
    /// Tasks and their attempts.
    Tasks {
        #[command(subcommand)]
        cmd: TasksCmd,
    },
    /// Cancel a task.
    Cancel {
        task_id: String,
        /// Why the task is cancelled.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Why a task waits (each host's failing predicate) or failed (class, evidence, remedy).
    Explain { task_id: String },
    /// Tool requests waiting for a decision.
    Approvals {
        /// Only these (pending, allowed, denied, timed_out).
        #[arg(long)]
        status: Option<String>,
    },
    /// Allow a tool request (once).
    Approve {
        approval_id: String,
        /// Allow the same tool without asking for the rest of this task.
        #[arg(long)]
        always_for_task: bool,
    },
    /// Deny a tool request; the agent is told the reason.
    Deny {
        approval_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Execution events of tasks and attempts.
    Runtime {
        #[command(subcommand)]
        cmd: RuntimeCmd,
    },
    /// Check the gateway's readiness (GET /readyz); exits 1 when not ready.
    Health,
    /// Executor commands, with the task-scoped credential in AGENTSCOPE_TASK_TOKEN.
    Task {
        #[command(subcommand)]
        cmd: TaskCmd,
    },
    /// Serve the executor commands as an MCP server over stdio (AGENTSCOPE_TASK_TOKEN).
    Mcp,
    /// Run a self-hosted Worker: managed sessions' file and shell tools run here, in
    /// DIR/<session id>, while the model stays in the dataplane (AGENTSCOPE_WORKER_TOKEN).
    Worker {
        /// The Worker's name in the workspace (sessions name it).
        #[arg(long)]
        name: String,
        /// Where session directories are created.
        #[arg(long)]
        dir: std::path::PathBuf,
        /// NATS server of the platform.
        #[arg(
            long,
            env = "AGENTSCOPE_NATS_URL",
            default_value = "nats://127.0.0.1:4222"
        )]
        nats_url: String,
    },
    /// Generate NATS credentials for an installation into DIR (once: an existing DIR/auth.conf
    /// is kept): `auth.conf` for nats-server's configuration (`include auth.conf`), one password
    /// file per service (`gateway.password`, ...) and the auth callout's seed
    /// (`callout.seed`, for svc-scheduler), each 0600.
    NatsAuth {
        #[arg(long)]
        dir: std::path::PathBuf,
    },
}

#[derive(Subcommand)]
enum TaskCmd {
    /// The task, its Issue, comments, input material and Artifacts.
    Show,
    /// Comment on the task's Issue.
    Comment { body: String },
    /// Upload a file of the task directory as an Artifact.
    Upload {
        file: String,
        /// Artifact name (default: the file's name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        content_type: Option<String>,
    },
}

#[derive(Subcommand)]
enum WorkspaceCmd {
    /// Create a workspace; prints AGENTSCOPE_WORKSPACE_ID=... and AGENTSCOPE_TOKEN=... lines.
    Create {
        name: String,
        #[arg(long)]
        max_concurrency: Option<i32>,
        /// The deployment's admin token.
        #[arg(long, env = "AGENTSCOPE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
    },
}

#[derive(Subcommand)]
enum HostTokenCmd {
    /// Create a host registration token; prints an AGENTSCOPE_HOST_TOKEN=... line.
    Create { name: String },
}

#[derive(Subcommand)]
enum AgentsCmd {
    /// Create an agent with its first version; prints its id.
    Create {
        name: String,
        #[arg(long)]
        provider: String,
        #[arg(long)]
        instructions: Option<String>,
        #[arg(long)]
        model: Option<String>,
    },
    /// List agents.
    List,
    /// Show an agent (id or name) and its current version.
    Show { agent: String },
}

#[derive(Subcommand)]
enum ProfilesCmd {
    /// Create a runtime profile; prints its id.
    Create {
        name: String,
        #[arg(long)]
        provider: String,
        /// One element of params.command; repeat for each argument.
        #[arg(long = "command", value_name = "ARG", allow_hyphen_values = true)]
        command: Vec<String>,
        /// A string parameter; repeatable.
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_param)]
        params: Vec<(String, String)>,
    },
    /// List runtime profiles.
    List,
}

#[derive(Subcommand)]
enum PoolsCmd {
    /// Create a pool; prints its id.
    Create {
        name: String,
        #[arg(long)]
        max_concurrency: Option<i32>,
    },
    /// List pools.
    List,
}

#[derive(Subcommand)]
enum BindingsCmd {
    /// Bind an agent to a pool; prints the binding's id.
    Create {
        /// Agent id or name.
        #[arg(long)]
        agent: String,
        /// Pool id or name.
        #[arg(long)]
        pool: String,
        /// Runtime profile id or name.
        #[arg(long)]
        profile: Option<String>,
        /// A capability hosts must have; repeatable.
        #[arg(long = "capability", value_name = "C")]
        capabilities: Vec<String>,
        /// A provider to fall back to; repeatable.
        #[arg(long = "fallback-provider", value_name = "P")]
        fallback_providers: Vec<String>,
        #[arg(long)]
        max_concurrency: Option<i32>,
        #[arg(long)]
        max_attempts: Option<i32>,
        #[arg(long)]
        retry_backoff_ms: Option<i64>,
    },
    /// List bindings.
    List,
}

#[derive(Subcommand)]
enum HostsCmd {
    /// List hosts with their checks.
    List,
    /// Show one host (full id, short id or name).
    Show { id: String },
}

#[derive(Subcommand)]
enum IssuesCmd {
    /// Create an issue; prints its id (and `task <id>` when assigned).
    Create {
        title: String,
        #[arg(long)]
        body: Option<String>,
        /// Agent id or name; the issue becomes a task for it.
        #[arg(long)]
        assign: Option<String>,
        #[arg(long)]
        repo: Option<String>,
        #[arg(long)]
        branch: Option<String>,
        #[arg(long)]
        input: Option<String>,
    },
    /// List issues.
    List,
    /// Show an issue with its tasks and comments.
    Show { id: String },
    /// Comment on an issue (as this token); prints the comment's id.
    Comment { id: String, body: String },
}

#[derive(Subcommand)]
enum TasksCmd {
    /// Submit a task; prints its id.
    Create {
        /// Agent id or name.
        #[arg(long)]
        agent: String,
        #[arg(long)]
        issue: Option<String>,
        #[arg(long)]
        repo: Option<String>,
        #[arg(long)]
        branch: Option<String>,
        #[arg(long)]
        input: Option<String>,
        #[arg(long)]
        timeout_secs: Option<i32>,
        #[arg(long)]
        idempotency_key: Option<String>,
    },
    /// List tasks, newest first.
    List {
        /// Only tasks with this status (queued, running, succeeded, failed, cancelled).
        #[arg(long)]
        status: Option<String>,
    },
    /// Show a task and its attempts.
    Show { id: String },
}

#[derive(Subcommand)]
enum RuntimeCmd {
    /// Print the events of a task or an attempt.
    Logs {
        /// Follow the live stream until the work ends, reconnecting when the connection drops.
        #[arg(short = 'f', long)]
        follow: bool,
        /// A task id or an attempt id.
        id: String,
    },
}

fn parse_param(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    agentscope_telemetry::install_tls_provider();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

enum Auth<'a> {
    Workspace,
    Admin(&'a str),
    None,
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(base: &str, token: Option<String>) -> Result<Api> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .context("build the HTTP client")?;
        Ok(Api {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.trim().is_empty()),
        })
    }

    fn request(&self, method: Method, path: &str, auth: Auth) -> Result<RequestBuilder> {
        let rb = self.http.request(method, format!("{}{}", self.base, path));
        Ok(match auth {
            Auth::Workspace => {
                let token = self.token.as_deref().ok_or_else(|| {
                    anyhow!("no workspace API token: pass --token or set AGENTSCOPE_TOKEN")
                })?;
                rb.bearer_auth(token)
            }
            Auth::Admin(token) => rb.bearer_auth(token),
            Auth::None => rb,
        })
    }

    fn net_error(&self, e: reqwest::Error) -> anyhow::Error {
        let what = if e.is_timeout() {
            "timed out talking to"
        } else if e.is_connect() {
            "cannot connect to"
        } else {
            "request failed to"
        };
        let e = e.without_url();
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        anyhow!("{what} the agentscope API at {} ({msg})", self.base)
    }

    /// Sends a request and returns its status and body (JSON, or the text as a JSON string).
    async fn send(&self, rb: RequestBuilder) -> Result<(StatusCode, Value)> {
        let resp = rb.send().await.map_err(|e| self.net_error(e))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| self.net_error(e))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        Ok((status, body))
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        auth: Auth<'_>,
        body: Option<Value>,
    ) -> Result<Value> {
        let mut rb = self
            .request(method, path, auth)?
            .timeout(Duration::from_secs(60));
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let (status, v) = self.send(rb).await?;
        if !status.is_success() {
            return Err(api_error(status, &v));
        }
        Ok(v)
    }

    async fn get(&self, path: &str) -> Result<Value> {
        self.call(Method::GET, path, Auth::Workspace, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value> {
        self.call(Method::POST, path, Auth::Workspace, Some(body))
            .await
    }

    /// A GET whose 404 is `None`.
    async fn get_opt(&self, path: &str) -> Result<Option<Value>> {
        let rb = self
            .request(Method::GET, path, Auth::Workspace)?
            .timeout(Duration::from_secs(60));
        let (status, v) = self.send(rb).await?;
        match status {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => Ok(Some(v)),
            s => Err(api_error(s, &v)),
        }
    }

    /// The `items` of a list endpoint.
    async fn items(&self, path: &str) -> Result<Vec<Value>> {
        match self.get(path).await? {
            Value::Object(mut m) => match m.remove("items") {
                Some(Value::Array(a)) => Ok(a),
                _ => bail!("unexpected response from {path}: no `items` array"),
            },
            _ => bail!("unexpected response from {path}: not a JSON object"),
        }
    }
}

fn api_error(status: StatusCode, body: &Value) -> anyhow::Error {
    let err = &body["error"];
    if let (Some(code), Some(message)) = (err["code"].as_str(), err["message"].as_str()) {
        return anyhow!("{code}: {message}");
    }
    let detail = match body {
        Value::String(s) if !s.trim().is_empty() => s.trim().to_string(),
        Value::Null | Value::String(_) => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string(),
        other => other.to_string(),
    };
    anyhow!("http_{}: {detail}", status.as_u16())
}

/// Percent-encodes a query parameter value.
fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A JSON object of the fields that are present.
fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
    Value::Object(
        fields
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
            .collect::<Map<_, _>>(),
    )
}

fn opt<T: Serialize>(v: &Option<T>) -> Option<Value> {
    v.as_ref().map(|x| json!(x))
}

fn id_arg(what: &str, s: &str) -> Result<Uuid> {
    Uuid::parse_str(s.trim()).map_err(|_| anyhow!("`{s}` is not a {what} id (a UUID)"))
}

/// Resolves a UUID or a name through a list endpoint.
async fn resolve(api: &Api, what: &str, path: &str, arg: &str) -> Result<Uuid> {
    if let Ok(id) = Uuid::parse_str(arg.trim()) {
        return Ok(id);
    }
    let items = api.items(path).await?;
    let ids: Vec<&str> = items
        .iter()
        .filter(|i| i["name"].as_str() == Some(arg))
        .filter_map(|i| i["id"].as_str())
        .collect();
    match ids.as_slice() {
        [id] => id_arg(what, id),
        [] => bail!("no {what} named `{arg}` in this workspace"),
        _ => bail!("{} {what}s are named `{arg}`; use an id", ids.len()),
    }
}

/// id → name of a list endpoint's items.
async fn names(api: &Api, path: &str) -> Result<HashMap<String, String>> {
    Ok(api
        .items(path)
        .await?
        .iter()
        .filter_map(|i| {
            Some((
                i["id"].as_str()?.to_string(),
                i["name"].as_str()?.to_string(),
            ))
        })
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Output

/// Prints a line; a closed stdout (e.g. `| head`) ends the program quietly.
/// A JSON value on one line, cut to 80 characters.
fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

fn out(line: impl std::fmt::Display) {
    if writeln!(std::io::stdout(), "{line}").is_err() {
        std::process::exit(0);
    }
}

fn print_json(v: &Value) {
    out(serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// A JSON value as a table cell: strings bare, null as `-`.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn when(v: &Value) -> String {
    v.as_str()
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map(|t| {
            t.with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string()
        })
        .unwrap_or_else(|| cell(v))
}

/// The last 8 hex digits of an id (the random part of a UUIDv7).
fn short(id: &str) -> String {
    let hex: String = id.chars().filter(|c| *c != '-').collect();
    hex[hex.len().saturating_sub(8)..].to_string()
}

fn name_of(names: &HashMap<String, String>, id: &Value) -> String {
    id.as_str()
        .and_then(|i| names.get(i).cloned())
        .unwrap_or_else(|| cell(id))
}

/// Aligned columns; the last column is not padded.
fn table_lines(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let fmt = |cells: Vec<&str>| {
        let n = cells.len();
        let mut line = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            line.push_str(c);
            if i + 1 < n {
                let pad = widths
                    .get(i)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(c.chars().count());
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        line
    };
    let mut lines = vec![fmt(header.to_vec())];
    lines.extend(
        rows.iter()
            .map(|r| fmt(r.iter().map(String::as_str).collect())),
    );
    lines
}

fn table(header: &[&str], rows: Vec<Vec<String>>) {
    if rows.is_empty() {
        out("(none)");
        return;
    }
    for l in table_lines(header, &rows) {
        out(l);
    }
}

const CHECKS: [&str; 3] = ["connectivity", "provider_discovery", "dispatch_readiness"];

/// One table row per host, each followed by its three checks.
fn print_hosts(hosts: &[Value]) {
    if hosts.is_empty() {
        out("(no hosts)");
        return;
    }
    let rows: Vec<Vec<String>> = hosts
        .iter()
        .map(|h| {
            vec![
                cell(&h["name"]),
                short(h["id"].as_str().unwrap_or("")),
                cell(&h["pool"]),
                if h["online"] == true { "yes" } else { "no" }.to_string(),
                format!("{}/{}", cell(&h["running"]), cell(&h["capacity"])),
            ]
        })
        .collect();
    let lines = table_lines(&["NAME", "ID", "POOL", "ONLINE", "RUNNING"], &rows);
    out(&lines[0]);
    for (h, line) in hosts.iter().zip(&lines[1..]) {
        out(line);
        for c in CHECKS {
            let check = &h["checks"][c];
            let ok = if check["ok"] == true { "ok" } else { "FAIL" };
            out(format!("    {c:<18}  {ok:<4}  {}", text(&check["detail"])));
        }
    }
}

/// One line per event: `[a<attempt_number> #<seq>] <kind> <summary>`.
fn event_line(ev: &Value) -> String {
    let kind = ev["kind"].as_str().unwrap_or("event");
    let p = &ev["payload"];
    let summary = match kind {
        "output" => {
            let t = text(&p["text"]);
            let t = t
                .trim_end_matches(['\n', '\r'])
                .replace("\r\n", "\\n")
                .replace('\n', "\\n");
            let trunc = if p["truncated"] == true {
                " [truncated]"
            } else {
                ""
            };
            format!("{}: {t}{trunc}", text(&p["stream"]))
        }
        "lifecycle" => {
            let mut s = text(&p["state"]);
            if let Some(c) = p["failure_class"].as_str().filter(|c| !c.is_empty()) {
                s.push_str(&format!(" class={c}"));
                if let Some(r) = p["remedy"].as_str().filter(|r| !r.is_empty()) {
                    s.push_str(&format!(" ({r})"));
                }
            }
            if !p["exit_code"].is_null() {
                s.push_str(&format!(" exit={}", p["exit_code"]));
            }
            let d = text(&p["detail"]);
            if !d.is_empty() {
                s.push_str(&format!(" - {}", d.replace('\n', "\\n")));
            }
            s
        }
        "diagnostic" => format!(
            "{} {}: {}",
            text(&p["level"]),
            text(&p["code"]),
            text(&p["message"]).replace('\n', "\\n")
        ),
        _ => p.to_string(),
    };
    format!(
        "[a{} #{}] {kind} {summary}",
        ev["attempt_number"], ev["seq"]
    )
}

fn print_event(ev: &Value, json: bool) {
    if json {
        out(ev.to_string())
    } else {
        out(event_line(ev))
    }
}

// ---------------------------------------------------------------------------------------------
// Commands

async fn run(cli: Cli) -> Result<ExitCode> {
    let cli_api = cli.api.clone();
    let api = Api::new(&cli.api, cli.token)?;
    let json = cli.json;
    match cli.command {
        Command::Workspace {
            cmd:
                WorkspaceCmd::Create {
                    name,
                    max_concurrency,
                    admin_token,
                },
        } => {
            let body = object(vec![
                ("name", Some(json!(name))),
                ("max_concurrency", opt(&max_concurrency)),
            ]);
            let v = api
                .call(
                    Method::POST,
                    "/v1/workspaces",
                    Auth::Admin(&admin_token),
                    Some(body),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                out(format!(
                    "# created workspace {}",
                    cell(&v["workspace"]["name"])
                ));
                out(format!(
                    "AGENTSCOPE_WORKSPACE_ID={}",
                    text(&v["workspace"]["id"])
                ));
                out(format!("AGENTSCOPE_TOKEN={}", text(&v["api_token"])));
            }
        }
        Command::HostToken {
            cmd: HostTokenCmd::Create { name },
        } => {
            let v = api.post("/v1/host-tokens", json!({"name": name})).await?;
            if json {
                print_json(&v);
            } else {
                out(format!(
                    "# host token {} ({})",
                    cell(&v["name"]),
                    cell(&v["id"])
                ));
                out(format!("AGENTSCOPE_HOST_TOKEN={}", text(&v["token"])));
            }
        }
        Command::Agents { cmd } => agents(&api, cmd, json).await?,
        Command::Profiles { cmd } => profiles(&api, cmd, json).await?,
        Command::Pools { cmd } => pools(&api, cmd, json).await?,
        Command::Bindings { cmd } => bindings(&api, cmd, json).await?,
        Command::Hosts { cmd } => hosts(&api, cmd.unwrap_or(HostsCmd::List), json).await?,
        Command::Issues { cmd } => issues(&api, cmd, json).await?,
        Command::Tasks { cmd } => tasks(&api, cmd, json).await?,
        Command::Cancel { task_id, reason } => {
            let id = id_arg("task", &task_id)?;
            let v = api
                .post(
                    &format!("/v1/tasks/{id}/cancel"),
                    object(vec![("reason", opt(&reason))]),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                out(format!(
                    "cancel requested for task {id} (status {})",
                    cell(&v["status"])
                ));
            }
        }
        Command::Explain { task_id } => explain(&api, &task_id, json).await?,
        Command::Approvals { status } => {
            let path = match &status {
                Some(st) => format!("/v1/approvals?status={}", enc(st)),
                None => "/v1/approvals".to_string(),
            };
            let v = api.get(&path).await?;
            if json {
                print_json(&v);
            } else {
                let rows = items_of(&v)
                    .iter()
                    .map(|a| {
                        vec![
                            cell(&a["id"]),
                            cell(&a["status"]),
                            cell(&a["tool_name"]),
                            compact(&a["input"]),
                            cell(&a["task_id"]),
                        ]
                    })
                    .collect();
                table(&["ID", "STATUS", "TOOL", "INPUT", "TASK"], rows);
            }
        }
        Command::Approve {
            approval_id,
            always_for_task,
        } => {
            let id = id_arg("approval", &approval_id)?;
            let v = api
                .post(
                    &format!("/v1/approvals/{id}/approve"),
                    json!({"always_for_task": always_for_task}),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                out(format!("approval {id} {}", cell(&v["status"])));
            }
        }
        Command::Deny {
            approval_id,
            reason,
        } => {
            let id = id_arg("approval", &approval_id)?;
            let v = api
                .post(
                    &format!("/v1/approvals/{id}/deny"),
                    object(vec![("reason", opt(&reason))]),
                )
                .await?;
            if json {
                print_json(&v);
            } else {
                out(format!("approval {id} {}", cell(&v["status"])));
            }
        }
        Command::Runtime {
            cmd: RuntimeCmd::Logs { follow, id },
        } => logs(&api, &id, follow, json).await?,
        Command::Health => return health(&api, json).await,
        Command::Task { cmd } => {
            let task = executor::TaskApi::from_env(&cli_api)?;
            let v = match cmd {
                TaskCmd::Show => task.context().await?,
                TaskCmd::Comment { body } => task.comment(&body).await?,
                TaskCmd::Upload {
                    file,
                    name,
                    content_type,
                } => {
                    let path = executor::local_file(&file)?;
                    let name = name.unwrap_or_else(|| {
                        path.file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_else(|| file.clone())
                    });
                    let ct = content_type
                        .unwrap_or_else(|| executor::guess_content_type(&name).to_string());
                    let bytes =
                        std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
                    task.upload(&name, &ct, bytes).await?
                }
            };
            print_json(&v);
        }
        Command::Mcp => executor::serve_mcp(executor::TaskApi::from_env(&cli_api)?).await?,
        Command::NatsAuth { dir } => nats_auth(&dir)?,
        Command::Worker {
            name,
            dir,
            nats_url,
        } => {
            let token = std::env::var("AGENTSCOPE_WORKER_TOKEN")
                .context("AGENTSCOPE_WORKER_TOKEN is not set (POST /v1/worker-tokens)")?;
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            let cancel = tokio_util::sync::CancellationToken::new();
            let stop = cancel.clone();
            tokio::spawn(async move {
                agentscope_telemetry::health::shutdown_signal().await;
                stop.cancel();
            });
            svc_dataplane::worker::run_worker(&nats_url, &token, &name, dir, cancel).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn agents(api: &Api, cmd: AgentsCmd, json: bool) -> Result<()> {
    match cmd {
        AgentsCmd::Create {
            name,
            provider,
            instructions,
            model,
        } => {
            let body = object(vec![
                ("name", Some(json!(name))),
                ("provider", Some(json!(provider))),
                ("instructions", opt(&instructions)),
                ("model", opt(&model)),
            ]);
            let v = api.post("/v1/agents", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        AgentsCmd::List => {
            let v = api.get("/v1/agents").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let rows = items_of(&v)
                .iter()
                .map(|a| {
                    let cv = &a["current_version"];
                    vec![
                        cell(&a["id"]),
                        cell(&a["name"]),
                        cell(&cv["version"]),
                        cell(&cv["provider"]),
                        cell(&cv["model"]),
                    ]
                })
                .collect();
            table(&["ID", "NAME", "VERSION", "PROVIDER", "MODEL"], rows);
        }
        AgentsCmd::Show { agent } => {
            let id = resolve(api, "agent", "/v1/agents", &agent).await?;
            let a = api.get(&format!("/v1/agents/{id}")).await?;
            if json {
                print_json(&a);
                return Ok(());
            }
            let cv = &a["current_version"];
            out(format!("agent {}", cell(&a["id"])));
            out(format!("  name          {}", cell(&a["name"])));
            out(format!(
                "  version       {} ({})",
                cell(&cv["version"]),
                cell(&cv["id"])
            ));
            out(format!("  provider      {}", cell(&cv["provider"])));
            out(format!("  model         {}", cell(&cv["model"])));
            out(format!("  created       {}", when(&a["created_at"])));
            out("  instructions:");
            for l in text(&cv["instructions"]).lines() {
                out(format!("    {l}"));
            }
        }
    }
    Ok(())
}

fn items_of(v: &Value) -> &[Value] {
    v["items"].as_array().map(Vec::as_slice).unwrap_or_default()
}

async fn profiles(api: &Api, cmd: ProfilesCmd, json: bool) -> Result<()> {
    match cmd {
        ProfilesCmd::Create {
            name,
            provider,
            command,
            params,
        } => {
            let mut p = Map::new();
            for (k, v) in params {
                p.insert(k, json!(v));
            }
            if !command.is_empty() {
                if p.contains_key("command") {
                    bail!(
                        "give the command either with --command or with --param command=..., not both"
                    );
                }
                p.insert("command".into(), json!(command));
            }
            let body = json!({"name": name, "provider": provider, "params": p});
            let v = api.post("/v1/runtime-profiles", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        ProfilesCmd::List => {
            let v = api.get("/v1/runtime-profiles").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let rows = items_of(&v)
                .iter()
                .map(|p| {
                    vec![
                        cell(&p["id"]),
                        cell(&p["name"]),
                        cell(&p["provider"]),
                        p["params"].to_string(),
                    ]
                })
                .collect();
            table(&["ID", "NAME", "PROVIDER", "PARAMS"], rows);
        }
    }
    Ok(())
}

async fn pools(api: &Api, cmd: PoolsCmd, json: bool) -> Result<()> {
    match cmd {
        PoolsCmd::Create {
            name,
            max_concurrency,
        } => {
            let body = object(vec![
                ("name", Some(json!(name))),
                ("max_concurrency", opt(&max_concurrency)),
            ]);
            let v = api.post("/v1/pools", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        PoolsCmd::List => {
            let v = api.get("/v1/pools").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let rows = items_of(&v)
                .iter()
                .map(|p| {
                    vec![
                        cell(&p["id"]),
                        cell(&p["name"]),
                        cell(&p["max_concurrency"]),
                    ]
                })
                .collect();
            table(&["ID", "NAME", "MAX_CONCURRENCY"], rows);
        }
    }
    Ok(())
}

async fn bindings(api: &Api, cmd: BindingsCmd, json: bool) -> Result<()> {
    match cmd {
        BindingsCmd::Create {
            agent,
            pool,
            profile,
            capabilities,
            fallback_providers,
            max_concurrency,
            max_attempts,
            retry_backoff_ms,
        } => {
            let agent = resolve(api, "agent", "/v1/agents", &agent).await?;
            let pool = resolve(api, "pool", "/v1/pools", &pool).await?;
            let profile = match profile {
                Some(p) => Some(resolve(api, "runtime profile", "/v1/runtime-profiles", &p).await?),
                None => None,
            };
            let body = object(vec![
                ("agent_id", Some(json!(agent))),
                ("pool_id", Some(json!(pool))),
                ("runtime_profile_id", opt(&profile)),
                ("required_capabilities", Some(json!(capabilities))),
                ("fallback_providers", Some(json!(fallback_providers))),
                ("max_concurrency", opt(&max_concurrency)),
                ("max_attempts", opt(&max_attempts)),
                ("retry_backoff_ms", opt(&retry_backoff_ms)),
            ]);
            let v = api.post("/v1/bindings", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        BindingsCmd::List => {
            let v = api.get("/v1/bindings").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let agents = names(api, "/v1/agents").await?;
            let pools = names(api, "/v1/pools").await?;
            let profiles = names(api, "/v1/runtime-profiles").await?;
            let rows = items_of(&v)
                .iter()
                .map(|b| {
                    let caps: Vec<String> = b["required_capabilities"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(text)
                        .collect();
                    vec![
                        cell(&b["id"]),
                        name_of(&agents, &b["agent_id"]),
                        name_of(&pools, &b["pool_id"]),
                        name_of(&profiles, &b["runtime_profile_id"]),
                        if caps.is_empty() {
                            "-".into()
                        } else {
                            caps.join(",")
                        },
                        cell(&b["max_concurrency"]),
                        cell(&b["max_attempts"]),
                        cell(&b["retry_backoff_ms"]),
                    ]
                })
                .collect();
            table(
                &[
                    "ID",
                    "AGENT",
                    "POOL",
                    "PROFILE",
                    "CAPABILITIES",
                    "MAX_CONCURRENCY",
                    "MAX_ATTEMPTS",
                    "BACKOFF_MS",
                ],
                rows,
            );
        }
    }
    Ok(())
}

async fn hosts(api: &Api, cmd: HostsCmd, json: bool) -> Result<()> {
    match cmd {
        HostsCmd::List => {
            let v = api.get("/v1/hosts").await?;
            if json {
                print_json(&v)
            } else {
                print_hosts(items_of(&v))
            }
        }
        HostsCmd::Show { id } => {
            let h = match Uuid::parse_str(id.trim()) {
                Ok(uuid) => api.get(&format!("/v1/hosts/{uuid}")).await?,
                Err(_) => {
                    let all = api.items("/v1/hosts").await?;
                    let mut found: Vec<Value> = all
                        .into_iter()
                        .filter(|h| {
                            h["name"].as_str() == Some(id.as_str())
                                || h["id"]
                                    .as_str()
                                    .is_some_and(|i| short(i) == id.to_lowercase())
                        })
                        .collect();
                    match found.len() {
                        1 => found.remove(0),
                        0 => bail!("no host with name or short id `{id}` in this workspace"),
                        n => bail!("{n} hosts match `{id}`; use the full id"),
                    }
                }
            };
            if json {
                print_json(&h);
                return Ok(());
            }
            print_hosts(std::slice::from_ref(&h));
            out(format!("  id            {}", cell(&h["id"])));
            out(format!("  version       {}", cell(&h["version"])));
            out(format!("  last seen     {}", when(&h["last_seen_at"])));
            let caps: Vec<String> = h["capabilities"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect();
            out(format!(
                "  capabilities  {}",
                if caps.is_empty() {
                    "-".into()
                } else {
                    caps.join(",")
                }
            ));
            out(format!("  providers     {}", h["providers"]));
        }
    }
    Ok(())
}

async fn issues(api: &Api, cmd: IssuesCmd, json: bool) -> Result<()> {
    match cmd {
        IssuesCmd::Create {
            title,
            body,
            assign,
            repo,
            branch,
            input,
        } => {
            let assignee = match assign {
                Some(a) => Some(resolve(api, "agent", "/v1/agents", &a).await?),
                None => None,
            };
            let req = object(vec![
                ("title", Some(json!(title))),
                ("body", opt(&body)),
                ("assignee_agent_id", opt(&assignee)),
                ("repository", opt(&repo)),
                ("branch", opt(&branch)),
                ("input", opt(&input)),
            ]);
            let v = api.post("/v1/issues", req).await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            out(text(&v["id"]));
            if let Some(t) = v["task_id"].as_str() {
                out(format!("task {t}"));
            }
        }
        IssuesCmd::List => {
            let v = api.get("/v1/issues").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let agents = names(api, "/v1/agents").await?;
            let rows = items_of(&v)
                .iter()
                .map(|i| {
                    vec![
                        cell(&i["id"]),
                        cell(&i["status"]),
                        name_of(&agents, &i["assignee_agent_id"]),
                        when(&i["created_at"]),
                        cell(&i["title"]),
                    ]
                })
                .collect();
            table(&["ID", "STATUS", "ASSIGNEE", "CREATED", "TITLE"], rows);
        }
        IssuesCmd::Show { id } => {
            let id = id_arg("issue", &id)?;
            let i = api.get(&format!("/v1/issues/{id}")).await?;
            let comments = api.get(&format!("/v1/issues/{id}/comments")).await?;
            if json {
                print_json(&json!({"issue": i, "comments": comments["items"]}));
                return Ok(());
            }
            out(format!("issue {} {}", cell(&i["id"]), cell(&i["status"])));
            out(format!("  title     {}", cell(&i["title"])));
            out(format!("  assignee  {}", cell(&i["assignee_agent_id"])));
            out(format!("  created   {}", when(&i["created_at"])));
            let tasks: Vec<String> = i["tasks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect();
            out(format!(
                "  tasks     {}",
                if tasks.is_empty() {
                    "-".into()
                } else {
                    tasks.join(" ")
                }
            ));
            for l in text(&i["body"]).lines() {
                out(format!("  | {l}"));
            }
            for c in items_of(&comments) {
                out(format!(
                    "comment {} by {} at {}",
                    cell(&c["id"]),
                    cell(&c["author"]),
                    when(&c["created_at"])
                ));
                for l in text(&c["body"]).lines() {
                    out(format!("  | {l}"));
                }
            }
        }
        IssuesCmd::Comment { id, body } => {
            let id = id_arg("issue", &id)?;
            let req = object(vec![("body", Some(json!(body)))]);
            let v = api.post(&format!("/v1/issues/{id}/comments"), req).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
    }
    Ok(())
}

async fn tasks(api: &Api, cmd: TasksCmd, json: bool) -> Result<()> {
    match cmd {
        TasksCmd::Create {
            agent,
            issue,
            repo,
            branch,
            input,
            timeout_secs,
            idempotency_key,
        } => {
            let agent = resolve(api, "agent", "/v1/agents", &agent).await?;
            let issue = issue.map(|i| id_arg("issue", &i)).transpose()?;
            let body = object(vec![
                ("agent_id", Some(json!(agent))),
                ("issue_id", opt(&issue)),
                ("repository", opt(&repo)),
                ("branch", opt(&branch)),
                ("input", opt(&input)),
                ("timeout_secs", opt(&timeout_secs)),
                ("idempotency_key", opt(&idempotency_key)),
            ]);
            let v = api.post("/v1/tasks", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        TasksCmd::List { status } => {
            let path = match &status {
                Some(s) => format!("/v1/tasks?status={}", enc(s)),
                None => "/v1/tasks".to_string(),
            };
            let v = api.get(&path).await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let agents = names(api, "/v1/agents").await?;
            let rows = items_of(&v)
                .iter()
                .map(|t| {
                    vec![
                        cell(&t["id"]),
                        cell(&t["status"]),
                        cell(&t["newest_attempt"]),
                        name_of(&agents, &t["agent_id"]),
                        when(&t["created_at"]),
                        cell(&t["failure_class"]),
                    ]
                })
                .collect();
            table(
                &["ID", "STATUS", "ATTEMPT", "AGENT", "CREATED", "FAILURE"],
                rows,
            );
        }
        TasksCmd::Show { id } => {
            let id = id_arg("task", &id)?;
            let t = api.get(&format!("/v1/tasks/{id}")).await?;
            if json {
                print_json(&t);
                return Ok(());
            }
            out(format!("task {} {}", cell(&t["id"]), cell(&t["status"])));
            out(format!(
                "  agent {}  issue {}  repository {}  branch {}  created {}",
                cell(&t["agent_id"]),
                cell(&t["issue_id"]),
                cell(&t["repository"]),
                cell(&t["branch"]),
                when(&t["created_at"])
            ));
            if !t["cancel_requested_at"].is_null() {
                out(format!(
                    "  cancel requested at {}",
                    when(&t["cancel_requested_at"])
                ));
            }
            for a in t["attempts"].as_array().into_iter().flatten() {
                out(attempt_line(a));
            }
        }
    }
    Ok(())
}

/// `GET /v1/tasks/{id}/explain`: the summary, then task-level reasons and one block per host
/// (`eligible`, or each failing predicate), or the failure with its evidence.
async fn explain(api: &Api, raw_id: &str, json: bool) -> Result<()> {
    let id = id_arg("task", raw_id)?;
    let v = api.get(&format!("/v1/tasks/{id}/explain")).await?;
    if json {
        print_json(&v);
        return Ok(());
    }
    out(format!(
        "task {} {}",
        cell(&v["task_id"]),
        cell(&v["status"])
    ));
    out(format!("  {}", text(&v["summary"])));
    if v["timeout"].is_object() {
        out(format!(
            "  run timeout: {} ({})",
            text(&v["timeout"]["detail"]),
            cell(&v["timeout"]["source"])
        ));
    }
    for a in v["attempts"].as_array().into_iter().flatten() {
        out(format!("  {}", attempt_line(a)));
    }
    if v["waiting"] == true {
        let t = &v["target"];
        out(format!(
            "  needs pool {}  provider {}  capabilities [{}]",
            cell(&t["pool"]),
            cell(&t["provider"]),
            t["required_capabilities"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let reasons = v["reasons"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if !reasons.is_empty() {
            out("reasons:");
            for r in reasons {
                out(format!(
                    "  {:<16}  {}",
                    text(&r["predicate"]),
                    text(&r["detail"])
                ));
            }
        }
        let hosts = v["hosts"].as_array().map(Vec::as_slice).unwrap_or_default();
        out(format!("hosts ({}):", hosts.len()));
        for h in hosts {
            let id = short(h["host_id"].as_str().unwrap_or(""));
            let verdict = if h["eligible"] == true {
                "eligible"
            } else {
                "blocked"
            };
            out(format!(
                "  {} ({id}) pool {}: {verdict}",
                cell(&h["name"]),
                cell(&h["pool"])
            ));
            for f in h["failing"].as_array().into_iter().flatten() {
                out(format!(
                    "    {:<16}  {}",
                    text(&f["predicate"]),
                    text(&f["detail"])
                ));
            }
        }
    } else if v["failure"].is_object() {
        let f = &v["failure"];
        out(format!("failure class {}", cell(&f["class"])));
        out(format!("  remedy  {}", text(&f["remedy"])));
        if !f["detail"].is_null() {
            out(format!(
                "  detail  {}",
                text(&f["detail"]).replace('\n', "\\n")
            ));
        }
        if !f["exit_code"].is_null() {
            out(format!("  exit    {}", f["exit_code"]));
        }
        out("evidence (last events):");
        for ev in f["evidence"].as_array().into_iter().flatten() {
            let mut ev = ev.clone();
            ev["attempt_number"] = f["attempt_number"].clone();
            out(format!("  {}", event_line(&ev)));
        }
    } else if v["host"].is_object() {
        let h = &v["host"];
        out(format!(
            "  on host {} ({}) pool {}",
            cell(&h["name"]),
            cell(&h["host_id"]),
            cell(&h["pool"])
        ));
    }
    Ok(())
}

/// `attempt <n> <status> host=<id> [class=<c> (<remedy>)] [exit=<code>] id=<attempt id>`
fn attempt_line(a: &Value) -> String {
    let mut s = format!(
        "attempt {} {} host={}",
        cell(&a["number"]),
        cell(&a["status"]),
        cell(&a["host_id"])
    );
    if let Some(c) = a["failure_class"].as_str().filter(|c| !c.is_empty()) {
        s.push_str(&format!(" class={c}"));
        if let Some(r) = a["remedy"].as_str().filter(|r| !r.is_empty()) {
            s.push_str(&format!(" ({r})"));
        }
    }
    if !a["exit_code"].is_null() {
        s.push_str(&format!(" exit={}", a["exit_code"]));
    }
    s.push_str(&format!(" id={}", cell(&a["id"])));
    s
}

async fn health(api: &Api, json: bool) -> Result<ExitCode> {
    let rb = api
        .request(Method::GET, "/readyz", Auth::None)?
        .timeout(Duration::from_secs(15));
    let (status, v) = api.send(rb).await?;
    if json {
        print_json(&v);
    } else if v.is_object() {
        let detail = v["detail"]
            .as_str()
            .map(|d| format!(": {d}"))
            .unwrap_or_default();
        out(format!(
            "{} {}{detail}",
            cell(&v["service"]),
            cell(&v["status"])
        ));
    } else {
        out(format!("HTTP {status} {}", text(&v).trim()));
    }
    Ok(if status == StatusCode::OK {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

// ---------------------------------------------------------------------------------------------
// Events

async fn logs(api: &Api, raw_id: &str, follow: bool, json: bool) -> Result<()> {
    let id = id_arg("task or attempt", raw_id)?;
    let scope = if api.get_opt(&format!("/v1/tasks/{id}")).await?.is_some() {
        "task"
    } else if api.get_opt(&format!("/v1/attempts/{id}")).await?.is_some() {
        "attempt"
    } else {
        bail!("not_found: no task or attempt with id {id}");
    };
    let path = format!("/v1/{scope}s/{id}/events");
    if follow {
        return follow_events(api, scope, &path, json).await;
    }
    let mut after: Option<String> = None;
    loop {
        let url = match &after {
            Some(a) => format!("{path}?after={}", enc(a)),
            None => path.clone(),
        };
        let page = api.get(&url).await?;
        let items = items_of(&page);
        if items.is_empty() {
            return Ok(());
        }
        for ev in items {
            print_event(ev, json);
        }
        let next = page["next"]
            .as_str()
            .ok_or_else(|| anyhow!("event page without a `next` cursor"))?;
        if after.as_deref() == Some(next) {
            return Ok(());
        }
        after = Some(next.to_string());
    }
}

/// One parsed server-sent event.
struct SseEvent {
    id: Option<String>,
    event: String,
    data: String,
}

/// An incremental `text/event-stream` parser.
#[derive(Default)]
struct SseParser {
    buf: Vec<u8>,
    id: Option<String>,
    event: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let raw: Vec<u8> = self.buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&raw);
            if let Some(ev) = self.line(line.trim_end_matches(['\n', '\r'])) {
                events.push(ev);
            }
        }
        events
    }

    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let data = std::mem::take(&mut self.data);
            let event = self.event.take();
            let id = self.id.take();
            if data.is_empty() && event.is_none() {
                return None;
            }
            return Some(SseEvent {
                id,
                event: event.unwrap_or_else(|| "message".into()),
                data: data.join("\n"),
            });
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "id" => self.id = Some(value.to_string()),
            "event" => self.event = Some(value.to_string()),
            "data" => self.data.push(value.to_string()),
            _ => {}
        }
        None
    }
}

/// How one connection of a followed stream ended.
enum Ended {
    /// The `end` event arrived with this data.
    End(Value),
    /// The connection dropped; reconnect.
    Dropped(String),
}

/// Where the stream is: the last event id and (attempt number, seq) printed.
#[derive(Default)]
struct Position {
    last_id: Option<String>,
    printed: Option<(i64, i64)>,
    progressed: bool,
}

async fn follow_events(api: &Api, scope: &str, path: &str, json: bool) -> Result<()> {
    const RETRIES: u32 = 30;
    let mut pos = Position::default();
    let mut failures = 0;
    loop {
        pos.progressed = false;
        let mut rb = api
            .request(Method::GET, &format!("{path}?follow=true"), Auth::Workspace)?
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = &pos.last_id {
            rb = rb.header("Last-Event-ID", id);
        }
        let why = match stream_once(api, rb, &mut pos, json).await? {
            Ended::End(data) => {
                if json {
                    out(json!({"end": data}).to_string());
                } else {
                    out(format!("-- {scope} {}", cell(&data["status"])));
                }
                return Ok(());
            }
            Ended::Dropped(why) => why,
        };
        if pos.progressed {
            failures = 0;
        }
        failures += 1;
        if failures > RETRIES {
            bail!(
                "lost the event stream from {} ({why}); gave up after {RETRIES} reconnects",
                api.base
            );
        }
        eprintln!("-- stream interrupted ({why}); reconnecting ({failures}/{RETRIES})");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Reads one SSE connection; `Err` only for failures that reconnecting cannot fix.
async fn stream_once(
    api: &Api,
    rb: RequestBuilder,
    pos: &mut Position,
    json: bool,
) -> Result<Ended> {
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return Ok(Ended::Dropped(format!("{:#}", api.net_error(e)))),
    };
    let status = resp.status();
    if !status.is_success() {
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            return Ok(Ended::Dropped(format!("HTTP {status}")));
        }
        let body = resp.bytes().await.unwrap_or_default();
        let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
        return Err(api_error(status, &v));
    }
    let mut stream = resp.bytes_stream();
    let mut parser = SseParser::default();
    loop {
        // The server sends a keep-alive every 15 s; silence for longer means a dead connection.
        let chunk = match tokio::time::timeout(Duration::from_secs(45), stream.next()).await {
            Err(_) => return Ok(Ended::Dropped("no data for 45 s".into())),
            Ok(None) => return Ok(Ended::Dropped("connection closed".into())),
            Ok(Some(Err(e))) => return Ok(Ended::Dropped(format!("{:#}", api.net_error(e)))),
            Ok(Some(Ok(c))) => c,
        };
        for ev in parser.feed(&chunk) {
            match ev.event.as_str() {
                "end" => {
                    return Ok(Ended::End(
                        serde_json::from_str(&ev.data).unwrap_or(Value::Null),
                    ));
                }
                // The server's own failure notice carries no id; execution events always do.
                "error" if ev.id.is_none() => {
                    return Ok(Ended::Dropped(format!("server error {}", ev.data)));
                }
                _ => {}
            }
            let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                eprintln!("-- skipped an unreadable event: {}", ev.data);
                continue;
            };
            let at = (
                v["attempt_number"].as_i64().unwrap_or(0),
                v["seq"].as_i64().unwrap_or(0),
            );
            if ev.id.is_some() {
                pos.last_id = ev.id;
            }
            pos.progressed = true;
            if pos.printed.is_some_and(|p| at <= p) {
                continue; // already printed before a reconnect
            }
            pos.printed = Some(at);
            print_event(&v, json);
        }
    }
}

fn nats_auth(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    if dir.join("auth.conf").exists() {
        println!("{} already holds NATS credentials; kept", dir.display());
        return Ok(());
    }
    let setup = agentscope_bus::auth::Setup::generate();
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let path = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("create {}", path.display()))?;
        f.write_all(text.as_bytes())?;
        Ok(())
    };
    for (user, password) in &setup.passwords {
        write(&format!("{user}.password"), password)?;
    }
    write("callout.seed", &setup.issuer.seed())?;
    // Last: its presence says the directory is complete.
    write("auth.conf", &setup.server_config())?;
    println!("NATS credentials written to {}", dir.display());
    Ok(())
}
