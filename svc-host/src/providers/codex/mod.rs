//! Codex: the adapter (`codex exec --json`, or `codex app-server` for approvals) and its stream
//! parsers. Recipe: docs/providers.md.

pub mod app_server;
pub mod parser;

use crate::provider::{
    Adapter, CONTINUE, Launch, LaunchCtx, Refusal, approval_params, base_env, binary, check_params,
    descriptor, extra_args, instructions, openai_base, pass_through, prompt, rel,
};
use crate::providers::{self, StreamParser};
use agentscope_domain::Provider;
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;
use std::path::Path;

pub struct Codex;

/// `initialize`, `initialized` and `thread/start` (or `thread/resume`) for `codex app-server`;
/// the parser sends `turn/start` once the thread is open.
fn codex_app_handshake(ctx: &LaunchCtx, sandbox: &str, resume: Option<&str>) -> String {
    let cwd = ctx.dir.workdir().to_string_lossy().into_owned();
    let thread = match resume {
        None => {
            json!({"id": app_server::THREAD_REQUEST_ID, "method": "thread/start", "params": {
            "cwd": cwd, "approvalPolicy": "untrusted", "sandbox": sandbox}})
        }
        Some(id) => {
            json!({"id": app_server::THREAD_REQUEST_ID, "method": "thread/resume", "params": {
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
        parser::is_connection_retry(line)
    }

    fn model_endpoint(&self) -> String {
        openai_base()
    }

    fn provider(&self) -> Provider {
        Provider::Codex
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
        Box::new(parser::CodexParser::new())
    }

    fn parser_for(&self, launch: &Launch) -> Box<dyn StreamParser> {
        if launch.argv.get(1).is_some_and(|a| a == "app-server") {
            Box::new(app_server::CodexAppParser::new(launch.prompt.clone()))
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
        if !app_server::APPROVAL_METHODS.contains(&method) || v.get("id").is_none() {
            return None;
        }
        let params = v["params"].as_object()?;
        let (tool_name, input) = if method.starts_with("item/commandExecution") {
            (
                "shell",
                json!({"command": app_server::command_of(params), "cwd": params.get("cwd"), "reason": params.get("reason")}),
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
