//! Adapters for the real agent CLIs: Claude Code, Codex, opencode and OpenClaw.
//! Each turns a Runtime Profile into the CLI's own flags and config files, translates the agent's
//! instructions into the CLI's format, wires the platform's MCP server (`agentscope mcp`) with
//! the task credential, and switches off telemetry and update checks. Recipes:
//! docs/providers.md.

use crate::provider::{
    Adapter, Launch, LaunchCtx, Refusal, base_env, locate, pass_through, probe_version,
};
use crate::providers::{self, StreamParser};
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Parameters every agent CLI accepts.
const COMMON_PARAMS: [&str; 3] = ["model", "timeout_secs", "extra_args"];

fn check_params(
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

fn extra_args(params: &HashMap<String, String>) -> Vec<String> {
    params
        .get("extra_args")
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// `approvals` (ask or native) and `approval_timeout_secs` of a runtime profile: whether tool
/// requests are forwarded as Approvals, and how long one may wait for a decision.
fn approval_params(p: &HashMap<String, String>) -> Result<(bool, u32), Refusal> {
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
fn prompt(ctx: &LaunchCtx) -> String {
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
fn instructions(ctx: &LaunchCtx) -> String {
    format!("# Agent instructions\n\n{}\n", ctx.spec.instructions)
}

fn mcp_env(ctx: &LaunchCtx) -> serde_json::Value {
    json!({"AGENTSCOPE_API": ctx.api_url, "AGENTSCOPE_TASK_TOKEN": ctx.task_token})
}

fn rel(ctx: &LaunchCtx, p: &Path) -> PathBuf {
    p.strip_prefix(&ctx.dir.root)
        .map(|r| r.to_path_buf())
        .unwrap_or_else(|_| p.to_path_buf())
}

fn descriptor(
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

fn binary(env_var: &str, name: &str) -> Result<String, Refusal> {
    locate(env_var, name)
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| Refusal {
            class: agentscope_domain::FailureClass::ToolDependency,
            detail: format!("`{name}` is not installed on this host"),
        })
}

// ------------------------------------------------------------------------------------ Claude

pub struct ClaudeCode;

impl Adapter for ClaudeCode {
    fn name(&self) -> &'static str {
        providers::claude::PROVIDER
    }

    fn discover(&self) -> ProviderDescriptor {
        descriptor(
            self.name(),
            "AGENTSCOPE_CLAUDE_BIN",
            "claude",
            &["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"],
            true,
            true,
        )
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let p = &ctx.spec.params;
        check_params(
            self.name(),
            p,
            &[
                "permission_mode",
                "max_turns",
                "allowed_tools",
                "approvals",
                "approval_timeout_secs",
            ],
        )?;
        let (ask, approval_timeout_ms) = approval_params(p)?;
        let bin = binary("AGENTSCOPE_CLAUDE_BIN", "claude")?;
        let mcp_path = ctx.dir.root.join("claude-mcp.json");
        // With approvals, only reading and the platform's tools are pre-allowed; every other
        // tool use is forwarded as a tool request and waits for a decision.
        let pre_allowed = if ask {
            "Read,Glob,Grep,mcp__agentscope__*"
        } else {
            "Bash,Edit,Write,Read,Glob,Grep,mcp__agentscope__*"
        };
        let allowed = p
            .get("allowed_tools")
            .cloned()
            .unwrap_or_else(|| pre_allowed.into());
        let mut argv = vec![bin, "-p".into()];
        if ask {
            argv.extend([
                "--input-format".into(),
                "stream-json".into(),
                "--permission-prompt-tool".into(),
                "stdio".into(),
            ]);
        } else {
            argv.push(prompt(ctx));
        }
        argv.extend([
            "--output-format".into(),
            "stream-json".into(),
            "--verbose".into(),
            "--mcp-config".into(),
            mcp_path.to_string_lossy().into_owned(),
            "--strict-mcp-config".into(),
            "--allowedTools".into(),
            allowed,
        ]);
        if let Some(mode) = p.get("permission_mode") {
            if !["default", "acceptEdits", "plan", "bypassPermissions"].contains(&mode.as_str()) {
                return Err(Refusal::bad_parameter(format!(
                    "`permission_mode` must be default, acceptEdits, plan or bypassPermissions, not `{mode}`"
                )));
            }
            argv.extend(["--permission-mode".into(), mode.clone()]);
        }
        if let Some(t) = p.get("max_turns") {
            let n: u32 = t.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                Refusal::bad_parameter(format!("`max_turns` must be a positive integer, not `{t}`"))
            })?;
            argv.extend(["--max-turns".into(), n.to_string()]);
        }
        if let Some(m) = p.get("model") {
            argv.extend(["--model".into(), m.clone()]);
        }
        argv.extend(extra_args(p));
        let mut env = base_env(ctx.dir);
        pass_through(
            &mut env,
            &[
                "ANTHROPIC_API_KEY",
                "ANTHROPIC_AUTH_TOKEN",
                "ANTHROPIC_BASE_URL",
            ],
        );
        for (k, v) in [
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ("DISABLE_TELEMETRY", "1"),
            ("DISABLE_AUTOUPDATER", "1"),
            ("DISABLE_ERROR_REPORTING", "1"),
            // MCP tools declared directly instead of behind a tool search.
            ("ENABLE_TOOL_SEARCH", "false"),
        ] {
            env.push((k.into(), v.into()));
        }
        let mcp = json!({"mcpServers": {"agentscope": {
            "type": "stdio", "command": ctx.cli, "args": ["mcp"], "env": mcp_env(ctx)}}});
        // CLAUDE.md is read from the working directory and its parents: the task root holds
        // ours, so a repository's own CLAUDE.md is left as it is.
        let allow: Vec<&str> = pre_allowed.split(',').collect();
        let settings = json!({"permissions": {"allow": allow}, "includeCoAuthoredBy": false});
        Ok(Launch {
            argv,
            cwd: ctx.dir.workdir().to_path_buf(),
            env,
            files: vec![
                (rel(ctx, &mcp_path), mcp.to_string()),
                ("CLAUDE.md".into(), instructions(ctx)),
                (
                    rel(ctx, &ctx.dir.home.join(".claude/settings.json")),
                    settings.to_string(),
                ),
            ],
            stdin: ask.then(|| {
                json!({"type": "user", "message": {"role": "user", "content": [{"type": "text", "text": prompt(ctx)}]}})
                    .to_string()
                    + "\n"
            }),
            keep_stdin_open: ask,
            approval_timeout_ms,
            prompt: prompt(ctx),
            resume_session: None,
            result_decides: false,
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(providers::claude::ClaudeParser::new())
    }

    fn control_request(&self, line: &str) -> Option<crate::provider::ControlRequest> {
        if !line.contains("control_request") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        if v["type"] != "control_request" || v["request"]["subtype"] != "can_use_tool" {
            return None;
        }
        Some(crate::provider::ControlRequest {
            request_id: v["request_id"].as_str()?.to_string(),
            rpc_id: None,
            meta: serde_json::Value::Null,
            tool_name: v["request"]["tool_name"].as_str().unwrap_or("").to_string(),
            input: v["request"]["input"].clone(),
        })
    }

    fn control_response(
        &self,
        req: &crate::provider::ControlRequest,
        allow: bool,
        reason: &str,
    ) -> String {
        let response = if allow {
            json!({"behavior": "allow", "updatedInput": req.input})
        } else {
            json!({"behavior": "deny", "message": reason})
        };
        json!({"type": "control_response", "response": {"subtype": "success", "request_id": req.request_id, "response": response}})
            .to_string()
            + "\n"
    }

    fn resume_launch(&self, ctx: &LaunchCtx, session_id: &str) -> Option<Result<Launch, Refusal>> {
        Some(self.launch(ctx).map(|mut l| {
            l.resume_session = Some(session_id.to_string());
            l.prompt = CONTINUE.into();
            if l.keep_stdin_open {
                // Approvals: the prompt goes over stdin as a stream-json user message.
                l.stdin = Some(
                    json!({"type": "user", "message": {"role": "user", "content": [{"type": "text", "text": CONTINUE}]}})
                        .to_string()
                        + "\n",
                );
                l.argv.insert(1, session_id.to_string());
                l.argv.insert(1, "--resume".into());
                return l;
            }
            // [bin, -p, PROMPT, ...] -> [bin, --resume, ID, -p, CONTINUE, ...]
            l.argv[2] = CONTINUE.into();
            l.argv.insert(1, session_id.to_string());
            l.argv.insert(1, "--resume".into());
            l
        }))
    }

    fn resume_rejected(&self, line: &str) -> bool {
        line.contains("No conversation found")
    }

    fn session_exists(&self, dir: &crate::provider::TaskDir, session_id: &str) -> bool {
        // Sessions live in $HOME/.claude/projects/<cwd>/<id>.jsonl.
        let Ok(projects) = std::fs::read_dir(dir.home.join(".claude/projects")) else {
            return false;
        };
        projects
            .filter_map(|e| e.ok())
            .any(|p| p.path().join(format!("{session_id}.jsonl")).is_file())
    }

    fn model_connection_error(&self, line: &str) -> bool {
        providers::claude::is_connection_retry(line)
    }

    fn model_endpoint(&self) -> String {
        std::env::var("ANTHROPIC_BASE_URL").unwrap_or_else(|_| "https://api.anthropic.com".into())
    }

    fn fatal(&self, line: &str) -> Option<(agentscope_domain::FailureClass, String)> {
        if !line.contains("api_retry") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let status = v["error_status"].as_u64().unwrap_or(0);
        let refused = status == 401 || status == 403 || v["error"] == "authentication_failed";
        (v["type"] == "system" && v["subtype"] == "api_retry" && refused).then(|| {
            (
                agentscope_domain::FailureClass::ProviderLogin,
                format!(
                    "the model provider refused the credentials (HTTP {status}, {})",
                    v["error"].as_str().unwrap_or("authentication failed")
                ),
            )
        })
    }
}

// ------------------------------------------------------------------------------------- Codex

/// The OpenAI-compatible endpoint a host's providers use: OPENAI_BASE_URL, default OpenAI's.
fn openai_base() -> String {
    std::env::var("OPENAI_BASE_URL").unwrap_or_else(|_| "https://api.openai.com/v1".into())
}

pub struct Codex;

/// What a resumed provider session is asked to do.
const CONTINUE: &str = "The Runtime Host restarted while you worked on this task. Continue where you left off and finish it.";

/// `initialize` and `session/new` (or `session/resume`) for an ACP agent; the parser sends
/// `session/prompt` once the session is open.
fn acp_handshake(cwd: &str, resume: Option<&str>) -> String {
    let session = match resume {
        None => {
            json!({"jsonrpc": "2.0", "id": providers::acp::SESSION_REQUEST_ID, "method": "session/new",
            "params": {"cwd": cwd, "mcpServers": []}})
        }
        // `session/resume`, unlike `session/load`, does not replay the history as updates.
        Some(id) => {
            json!({"jsonrpc": "2.0", "id": providers::acp::SESSION_REQUEST_ID, "method": "session/resume",
            "params": {"sessionId": id, "cwd": cwd, "mcpServers": []}})
        }
    };
    [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1,
            "clientCapabilities": {"fs": {"readTextFile": false, "writeTextFile": false}, "terminal": false}}}),
        session,
    ]
    .iter()
    .map(|m| m.to_string() + "\n")
    .collect()
}

/// `initialize`, `initialized` and `thread/start` (or `thread/resume`) for `codex app-server`;
/// the parser sends `turn/start` once the thread is open.
fn codex_app_handshake(ctx: &LaunchCtx, sandbox: &str, resume: Option<&str>) -> String {
    let cwd = ctx.dir.workdir().to_string_lossy().into_owned();
    let thread = match resume {
        None => {
            json!({"id": providers::codex_app::THREAD_REQUEST_ID, "method": "thread/start", "params": {
            "cwd": cwd, "approvalPolicy": "untrusted", "sandbox": sandbox}})
        }
        Some(id) => {
            json!({"id": providers::codex_app::THREAD_REQUEST_ID, "method": "thread/resume", "params": {
            "threadId": id, "cwd": cwd, "approvalPolicy": "untrusted", "sandbox": sandbox, "excludeTurns": true}})
        }
    };
    [
        json!({"id": 1, "method": "initialize", "params": {
            "clientInfo": {"name": "agentscope", "title": "agentscope", "version": env!("CARGO_PKG_VERSION")},
            "capabilities": {"experimentalApi": false, "requestAttestation": false}}}),
        json!({"method": "initialized"}),
        thread,
    ]
    .iter()
    .map(|m| m.to_string() + "\n")
    .collect()
}

impl Adapter for Codex {
    fn model_connection_error(&self, line: &str) -> bool {
        providers::codex::is_connection_retry(line)
    }

    fn model_endpoint(&self) -> String {
        openai_base()
    }

    fn name(&self) -> &'static str {
        providers::codex::PROVIDER
    }

    fn discover(&self) -> ProviderDescriptor {
        descriptor(
            self.name(),
            "AGENTSCOPE_CODEX_BIN",
            "codex",
            &["OPENAI_API_KEY"],
            true,
            true,
        )
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let p = &ctx.spec.params;
        check_params(
            self.name(),
            p,
            &["sandbox", "approvals", "approval_timeout_secs"],
        )?;
        let (ask, approval_timeout_ms) = approval_params(p)?;
        let bin = binary("AGENTSCOPE_CODEX_BIN", "codex")?;
        let sandbox = p
            .get("sandbox")
            .map(String::as_str)
            .unwrap_or("workspace-write");
        if !["read-only", "workspace-write", "danger-full-access"].contains(&sandbox) {
            return Err(Refusal::bad_parameter(format!(
                "`sandbox` must be read-only, workspace-write or danger-full-access, not `{sandbox}`"
            )));
        }
        let model = p.get("model").cloned().unwrap_or_else(|| "gpt-5.5".into());
        let codex_home = ctx.dir.root.join("codex-home");
        let toml_str = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let config = format!(
            "model = {model}\nmodel_provider = \"agentscope\"\ncheck_for_update_on_startup = false\n\n\
             [model_providers.agentscope]\nname = \"agentscope\"\nbase_url = {base}\nwire_api = \"responses\"\nenv_key = \"OPENAI_API_KEY\"\n\n\
             [analytics]\nenabled = false\n\n[features]\nplugins = false\nremote_plugin = false\napps = false\n\n\
             [mcp_servers.agentscope]\ncommand = {cli}\nargs = [\"mcp\"]\ndefault_tools_approval_mode = \"approve\"\n\n\
             [mcp_servers.agentscope.env]\nAGENTSCOPE_API = {api}\nAGENTSCOPE_TASK_TOKEN = {token}\n",
            model = toml_str(&model),
            base = toml_str(&openai_base()),
            cli = toml_str(&ctx.cli.to_string_lossy()),
            api = toml_str(ctx.api_url),
            token = toml_str(ctx.task_token),
        );
        let mut env = base_env(ctx.dir);
        pass_through(&mut env, &["OPENAI_API_KEY"]);
        env.push((
            "CODEX_HOME".into(),
            codex_home.to_string_lossy().into_owned(),
        ));
        let files = vec![
            (rel(ctx, &codex_home.join("config.toml")), config),
            // Codex reads global instructions from $CODEX_HOME/AGENTS.md, besides the repo's.
            (rel(ctx, &codex_home.join("AGENTS.md")), instructions(ctx)),
        ];
        if ask {
            // `codex exec` never asks; `app-server` does, over JSON-RPC on stdio. `untrusted`
            // asks for every command (`on-request` runs sandboxed commands unasked).
            let mut argv = vec![bin, "app-server".into()];
            argv.extend(extra_args(p));
            return Ok(Launch {
                argv,
                cwd: ctx.dir.workdir().to_path_buf(),
                env,
                files,
                stdin: Some(codex_app_handshake(ctx, sandbox, None)),
                keep_stdin_open: true,
                approval_timeout_ms,
                prompt: prompt(ctx),
                resume_session: None,
                result_decides: true,
            });
        }
        let mut argv = vec![
            bin,
            "exec".into(),
            "--json".into(),
            "--skip-git-repo-check".into(),
            "-s".into(),
            sandbox.into(),
        ];
        argv.extend(extra_args(p));
        argv.push(prompt(ctx));
        Ok(Launch {
            argv,
            cwd: ctx.dir.workdir().to_path_buf(),
            env,
            files,
            ..Default::default()
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(providers::codex::CodexParser::new())
    }

    fn parser_for(&self, launch: &Launch) -> Box<dyn StreamParser> {
        if launch.argv.get(1).is_some_and(|a| a == "app-server") {
            Box::new(providers::codex_app::CodexAppParser::new(
                launch.prompt.clone(),
            ))
        } else {
            self.parser()
        }
    }

    fn control_request(&self, line: &str) -> Option<crate::provider::ControlRequest> {
        if !line.contains("requestApproval") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let method = v["method"].as_str()?;
        if !providers::codex_app::APPROVAL_METHODS.contains(&method) || v.get("id").is_none() {
            return None;
        }
        let params = v["params"].as_object()?;
        let (tool_name, input) = if method.starts_with("item/commandExecution") {
            (
                "shell",
                json!({"command": providers::codex_app::command_of(params), "cwd": params.get("cwd"), "reason": params.get("reason")}),
            )
        } else {
            (
                "apply_patch",
                json!({"reason": params.get("reason"), "grantRoot": params.get("grantRoot")}),
            )
        };
        // The item id is unique across restarts of the server; its JSON-RPC id is not.
        let request_id = params
            .get("itemId")
            .and_then(|i| i.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| format!("rpc-{}", v["id"]));
        Some(crate::provider::ControlRequest {
            request_id,
            rpc_id: Some(v["id"].clone()),
            // The turn a deny reason is steered into.
            meta: json!({"threadId": params.get("threadId"), "turnId": params.get("turnId")}),
            tool_name: tool_name.into(),
            input,
        })
    }

    fn control_response(
        &self,
        req: &crate::provider::ControlRequest,
        allow: bool,
        reason: &str,
    ) -> String {
        if allow {
            return json!({"id": req.rpc_id, "result": {"decision": "accept"}}).to_string() + "\n";
        }
        // `decline` carries no reason (the model reads "rejected by user"): the reason goes into
        // the running turn as steered user input first, so the model's next request holds both.
        let mut out = String::new();
        if let (Some(thread), Some(turn)) =
            (req.meta["threadId"].as_str(), req.meta["turnId"].as_str())
        {
            out.push_str(
                &(json!({"id": format!("agentscope-steer-{}", req.request_id), "method": "turn/steer", "params": {
                    "threadId": thread, "expectedTurnId": turn,
                    "input": [{"type": "text", "text": providers::denied_message(&req.tool_name, reason), "text_elements": []}]}})
                .to_string()
                    + "\n"),
            );
        }
        out.push_str(
            &(json!({"id": req.rpc_id, "result": {"decision": "decline"}}).to_string() + "\n"),
        );
        out
    }

    fn resume_rejected(&self, line: &str) -> bool {
        line.contains("no rollout found") || line.contains("invalid session id")
    }

    fn resume_launch(&self, ctx: &LaunchCtx, session_id: &str) -> Option<Result<Launch, Refusal>> {
        Some(self.launch(ctx).map(|mut l| {
            if l.argv[1] == "app-server" {
                let sandbox = ctx
                    .spec
                    .params
                    .get("sandbox")
                    .map(String::as_str)
                    .unwrap_or("workspace-write");
                l.stdin = Some(codex_app_handshake(ctx, sandbox, Some(session_id)));
                l.prompt = CONTINUE.into();
                l.resume_session = Some(session_id.to_string());
                return l;
            }
            // [bin, exec, --json, --skip-git-repo-check, -s, SANDBOX, extra.., PROMPT] ->
            // [bin, exec, resume, --json, --skip-git-repo-check, -c sandbox_mode="SANDBOX", extra.., ID, CONTINUE]
            // (`resume` has no -s; without the override its sandbox is read-only).
            let sandbox = l.argv[5].clone();
            let extra: Vec<String> = l.argv[6..l.argv.len() - 1].to_vec();
            let mut argv = vec![
                l.argv[0].clone(),
                "exec".into(),
                "resume".into(),
                "--json".into(),
                "--skip-git-repo-check".into(),
                "-c".into(),
                format!("sandbox_mode=\"{sandbox}\""),
            ];
            argv.extend(extra);
            argv.push(session_id.to_string());
            argv.push(CONTINUE.into());
            l.argv = argv;
            l
        }))
    }

    fn session_exists(&self, dir: &crate::provider::TaskDir, session_id: &str) -> bool {
        // Rollouts live in $CODEX_HOME/sessions/YYYY/MM/DD/rollout-...-<thread id>.jsonl.
        fn find(dir: &Path, id: &str, depth: u8) -> bool {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return false;
            };
            entries.filter_map(|e| e.ok()).any(|e| {
                let p = e.path();
                if p.is_dir() {
                    depth > 0 && find(&p, id, depth - 1)
                } else {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.contains(id) && n.ends_with(".jsonl"))
                }
            })
        }
        !session_id.is_empty() && find(&dir.root.join("codex-home/sessions"), session_id, 4)
    }
}

// ---------------------------------------------------------------------------------- opencode

pub struct Opencode;

impl Adapter for Opencode {
    fn name(&self) -> &'static str {
        providers::opencode::PROVIDER
    }

    fn discover(&self) -> ProviderDescriptor {
        descriptor(
            self.name(),
            "AGENTSCOPE_OPENCODE_BIN",
            "opencode",
            &["OPENAI_API_KEY"],
            true,
            true,
        )
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let p = &ctx.spec.params;
        check_params(self.name(), p, &["approvals", "approval_timeout_secs"])?;
        let (ask, approval_timeout_ms) = approval_params(p)?;
        // With approvals, edits and commands ask (through ACP); `opencode run` would reject them.
        let decide = if ask { "ask" } else { "allow" };
        let bin = binary("AGENTSCOPE_OPENCODE_BIN", "opencode")?;
        let model = p.get("model").cloned().unwrap_or_else(|| "gpt-5.5".into());
        let key = std::env::var("OPENAI_API_KEY").unwrap_or_default();
        let mut cmd = vec![ctx.cli.to_string_lossy().into_owned()];
        cmd.push("mcp".into());
        let config = json!({
            "autoupdate": false,
            "share": "disabled",
            "model": format!("agentscope/{model}"),
            "small_model": format!("agentscope/{model}"),
            "provider": {"agentscope": {
                "npm": "@ai-sdk/openai-compatible", "name": "agentscope",
                "options": {"baseURL": openai_base(), "apiKey": key},
                "models": {model.clone(): {"name": model, "tool_call": true}}}},
            "mcp": {"agentscope": {"type": "local", "command": cmd, "environment": mcp_env(ctx), "enabled": true}},
            "permission": {"edit": decide, "bash": decide, "webfetch": "deny"},
        });
        let workdir = ctx.dir.workdir().to_string_lossy().into_owned();
        let mut argv = if ask {
            vec![bin, "acp".into()]
        } else {
            vec![bin, "run".into(), "--format".into(), "json".into()]
        };
        argv.extend(extra_args(p));
        if !ask {
            argv.push(prompt(ctx));
        }
        let mut env = base_env(ctx.dir);
        // opencode takes its project directory from PWD.
        env.push(("PWD".into(), workdir.clone()));
        for (k, v) in [
            ("OPENCODE_DISABLE_MODELS_FETCH", "1"),
            ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
            // Its plugin install look-up goes nowhere instead of to a registry.
            ("npm_config_registry", "http://127.0.0.1:9/"),
        ] {
            env.push((k.into(), v.into()));
        }
        env.push(("OPENCODE_CONFIG_CONTENT".into(), config.to_string()));
        Ok(Launch {
            argv,
            cwd: ctx.dir.workdir().to_path_buf(),
            env,
            // opencode reads global rules from ~/.config/opencode/AGENTS.md.
            files: vec![(
                rel(ctx, &ctx.dir.home.join(".config/opencode/AGENTS.md")),
                instructions(ctx),
            )],
            stdin: ask.then(|| acp_handshake(&workdir, None)),
            keep_stdin_open: ask,
            approval_timeout_ms,
            prompt: prompt(ctx),
            resume_session: None,
            result_decides: ask,
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(providers::opencode::OpencodeParser::new())
    }

    fn parser_for(&self, launch: &Launch) -> Box<dyn StreamParser> {
        if launch.argv.get(1).is_some_and(|a| a == "acp") {
            Box::new(providers::acp::AcpParser::new(
                providers::opencode::PROVIDER,
                launch.prompt.clone(),
                launch.resume_session.clone(),
            ))
        } else {
            self.parser()
        }
    }

    fn control_request(&self, line: &str) -> Option<crate::provider::ControlRequest> {
        if !line.contains(providers::acp::PERMISSION_METHOD) {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        if v["method"] != providers::acp::PERMISSION_METHOD || v.get("id").is_none() {
            return None;
        }
        let call = &v["params"]["toolCall"];
        let option = |kind: &str| {
            v["params"]["options"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|o| o["kind"] == kind)
                .and_then(|o| o["optionId"].as_str())
                .map(str::to_string)
        };
        let tool_name = match call["kind"].as_str() {
            Some("execute") => "bash".to_string(),
            Some("edit") => "edit".to_string(),
            _ => call["title"].as_str().unwrap_or("").to_string(),
        };
        Some(crate::provider::ControlRequest {
            request_id: call["toolCallId"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("rpc-{}", v["id"])),
            rpc_id: Some(v["id"].clone()),
            // Never `allow_always`: "always" is the platform's decision, kept per task.
            meta: json!({"allow": option("allow_once"), "reject": option("reject_once")}),
            tool_name,
            input: call["rawInput"].clone(),
        })
    }

    fn control_response(
        &self,
        req: &crate::provider::ControlRequest,
        allow: bool,
        _reason: &str,
    ) -> String {
        let option = req.meta[if allow { "allow" } else { "reject" }].as_str();
        let outcome = match option {
            Some(id) => json!({"outcome": "selected", "optionId": id}),
            None => json!({"outcome": "cancelled"}),
        };
        json!({"jsonrpc": "2.0", "id": req.rpc_id, "result": {"outcome": outcome}}).to_string()
            + "\n"
    }

    fn resume_launch(&self, ctx: &LaunchCtx, session_id: &str) -> Option<Result<Launch, Refusal>> {
        Some(self.launch(ctx).map(|mut l| {
            let workdir = ctx.dir.workdir().to_string_lossy().into_owned();
            if l.argv[1] == "acp" {
                l.stdin = Some(acp_handshake(&workdir, Some(session_id)));
            } else {
                // [bin, run, --format, json, extra.., PROMPT] -> [.., --session ID --dir DIR CONTINUE]
                let last = l.argv.len() - 1;
                l.argv[last] = "--session".into();
                l.argv.extend([
                    session_id.to_string(),
                    "--dir".into(),
                    workdir,
                    CONTINUE.into(),
                ]);
            }
            l.prompt = CONTINUE.into();
            l.resume_session = Some(session_id.to_string());
            l
        }))
    }

    fn resume_rejected(&self, line: &str) -> bool {
        // `run --session`: "Error: Session not found"; ACP: an error answering the session request.
        line.contains("Session not found")
            || (line.contains("\"error\"")
                && serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| {
                    v["id"].as_u64() == Some(providers::acp::SESSION_REQUEST_ID)
                        && v["error"].is_object()
                }))
    }

    fn session_exists(&self, dir: &crate::provider::TaskDir, session_id: &str) -> bool {
        // Sessions are rows of $HOME/.local/share/opencode/opencode.db (SQLite, with its WAL).
        if session_id.is_empty() || !session_id.starts_with("ses_") {
            return false;
        }
        let db = dir.home.join(".local/share/opencode/opencode.db");
        ["", "-wal"].iter().any(|suffix| {
            let mut p = db.clone().into_os_string();
            p.push(suffix);
            std::fs::read(&p).is_ok_and(|bytes| {
                bytes
                    .windows(session_id.len())
                    .any(|w| w == session_id.as_bytes())
            })
        })
    }
}

// ---------------------------------------------------------------------------------- OpenClaw

pub struct Openclaw;

impl Adapter for Openclaw {
    fn name(&self) -> &'static str {
        providers::openclaw::PROVIDER
    }

    fn discover(&self) -> ProviderDescriptor {
        descriptor(
            self.name(),
            "AGENTSCOPE_OPENCLAW_BIN",
            "openclaw",
            &["OPENAI_API_KEY"],
            false,
            false,
        )
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let p = &ctx.spec.params;
        check_params(self.name(), p, &[])?;
        let bin = binary("AGENTSCOPE_OPENCLAW_BIN", "openclaw")?;
        let model = p.get("model").cloned().unwrap_or_else(|| "gpt-5.5".into());
        let work = ctx.dir.workdir().to_string_lossy().into_owned();
        let config = json!({
            "agents": {"defaults": {"model": {"primary": format!("agentscope/{model}")}, "workspace": work, "skipBootstrap": true}},
            "models": {"mode": "merge", "providers": {"agentscope": {
                "baseUrl": openai_base(), "apiKey": std::env::var("OPENAI_API_KEY").unwrap_or_default(),
                "api": "openai-completions",
                "models": [{"id": model, "name": model, "reasoning": false, "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": 128000, "maxTokens": 8192}]}}},
            "tools": {"toolSearch": false},
            "update": {"checkOnStart": false},
            "telemetry": {"enabled": false},
            "mcp": {"servers": {"agentscope": {"command": ctx.cli, "args": ["mcp"], "env": mcp_env(ctx)}}},
        });
        let mut argv = vec![
            bin,
            "agent".into(),
            "exec".into(),
            "--json".into(),
            "--cwd".into(),
            work,
        ];
        argv.extend(extra_args(p));
        argv.push(format!("{}\n\n{}", instructions(ctx), prompt(ctx)));
        let mut env = base_env(ctx.dir);
        env.push(("OPENCLAW_NO_AUTO_UPDATE".into(), "1".into()));
        env.push(("DO_NOT_TRACK".into(), "1".into()));
        Ok(Launch {
            argv,
            cwd: ctx.dir.workdir().to_path_buf(),
            env,
            files: vec![(
                rel(ctx, &ctx.dir.home.join(".openclaw/openclaw.json")),
                config.to_string(),
            )],
            ..Default::default()
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(providers::openclaw::OpenclawParser::new())
    }
}
