//! `agentscope`: the command-line client of the agentscope API, the executor's commands
//! (`task`, `mcp`), the self-hosted Worker (`worker`) and the installation's NATS credentials
//! (`nats-auth`).
//!
//! Every API command is one or a few HTTP calls to the gateway's `/v1` API. Human output is the
//! default; `--json` prints the API's responses as they are. Any API error is printed as
//! `error: <code>: <message>` on stderr with exit status 1.
//!
//! One module per command (group); `api` is the HTTP client, `output` the human formatting.

mod agents;
mod api;
mod approvals;
mod bindings;
mod health;
mod hosts;
mod issues;
mod mcp;
mod nats_auth;
mod output;
mod pools;
mod profiles;
mod runtime;
mod task;
mod tasks;
mod worker;
mod workspace;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

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
        cmd: workspace::WorkspaceCmd,
    },
    /// Create host registration tokens.
    HostToken {
        #[command(subcommand)]
        cmd: workspace::HostTokenCmd,
    },
    /// Agents and their versions.
    Agents {
        #[command(subcommand)]
        cmd: agents::AgentsCmd,
    },
    /// Runtime profiles (how a provider is launched on a host).
    Profiles {
        #[command(subcommand)]
        cmd: profiles::ProfilesCmd,
    },
    /// Pools of hosts.
    Pools {
        #[command(subcommand)]
        cmd: pools::PoolsCmd,
    },
    /// Bindings of agents to pools and runtime profiles.
    Bindings {
        #[command(subcommand)]
        cmd: bindings::BindingsCmd,
    },
    /// Hosts and their three checks (default: list).
    Hosts {
        #[command(subcommand)]
        cmd: Option<hosts::HostsCmd>,
    },
    /// Issues and their comments.
    Issues {
        #[command(subcommand)]
        cmd: issues::IssuesCmd,
    },
    /// Tasks and their attempts.
    Tasks {
        #[command(subcommand)]
        cmd: tasks::TasksCmd,
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
        cmd: runtime::RuntimeCmd,
    },
    /// Check the gateway's readiness (GET /readyz); exits 1 when not ready.
    Health,
    /// Executor commands, with the task-scoped credential in AGENTSCOPE_TASK_TOKEN.
    Task {
        #[command(subcommand)]
        cmd: task::TaskCmd,
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

async fn run(cli: Cli) -> Result<ExitCode> {
    let api = api::Api::new(&cli.api, cli.token)?;
    let json = cli.json;
    match cli.command {
        Command::Workspace { cmd } => workspace::workspace(&api, cmd, json).await?,
        Command::HostToken { cmd } => workspace::host_token(&api, cmd, json).await?,
        Command::Agents { cmd } => agents::agents(&api, cmd, json).await?,
        Command::Profiles { cmd } => profiles::profiles(&api, cmd, json).await?,
        Command::Pools { cmd } => pools::pools(&api, cmd, json).await?,
        Command::Bindings { cmd } => bindings::bindings(&api, cmd, json).await?,
        Command::Hosts { cmd } => {
            hosts::hosts(&api, cmd.unwrap_or(hosts::HostsCmd::List), json).await?
        }
        Command::Issues { cmd } => issues::issues(&api, cmd, json).await?,
        Command::Tasks { cmd } => tasks::tasks(&api, cmd, json).await?,
        Command::Cancel { task_id, reason } => tasks::cancel(&api, &task_id, reason, json).await?,
        Command::Explain { task_id } => tasks::explain(&api, &task_id, json).await?,
        Command::Approvals { status } => approvals::list(&api, status, json).await?,
        Command::Approve {
            approval_id,
            always_for_task,
        } => approvals::approve(&api, &approval_id, always_for_task, json).await?,
        Command::Deny {
            approval_id,
            reason,
        } => approvals::deny(&api, &approval_id, reason, json).await?,
        Command::Runtime {
            cmd: runtime::RuntimeCmd::Logs { follow, id },
        } => runtime::logs(&api, &id, follow, json).await?,
        Command::Health => return health::health(&api, json).await,
        Command::Task { cmd } => task::run(&cli.api, cmd).await?,
        Command::Mcp => mcp::serve_mcp(task::TaskApi::from_env(&cli.api)?).await?,
        Command::NatsAuth { dir } => nats_auth::nats_auth(&dir)?,
        Command::Worker {
            name,
            dir,
            nats_url,
        } => worker::run(&name, dir, &nats_url).await?,
    }
    Ok(ExitCode::SUCCESS)
}
