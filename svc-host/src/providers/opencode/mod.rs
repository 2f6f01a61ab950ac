//! opencode: the adapter (`opencode run --format json`, or `opencode acp` for approvals) and its
//! stream parser. Recipe: docs/providers.md.

pub mod parser;

use crate::provider::{
    Adapter, CONTINUE, Launch, LaunchCtx, Refusal, approval_params, base_env, binary, check_params,
    descriptor, extra_args, instructions, mcp_env, openai_base, prompt, rel,
};
use crate::providers::{self, StreamParser};
use agentscope_domain::Provider;
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;

pub struct Opencode;

impl Adapter for Opencode {
    fn provider(&self) -> Provider {
        Provider::Opencode
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
            stdin: ask.then(|| providers::acp::handshake(&workdir, None)),
            keep_stdin_open: ask,
            approval_timeout_ms,
            prompt: prompt(ctx),
            resume_session: None,
            result_decides: ask,
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(parser::OpencodeParser::new())
    }

    fn parser_for(&self, launch: &Launch) -> Box<dyn StreamParser> {
        if launch.argv.get(1).is_some_and(|a| a == "acp") {
            Box::new(providers::acp::AcpParser::new(
                Provider::Opencode.as_str(),
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
                l.stdin = Some(providers::acp::handshake(&workdir, Some(session_id)));
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
