//! Claude Code: the adapter (`claude -p`, stream-json over stdin for approvals) and its
//! stream parser. Recipe: docs/providers.md.

pub mod parser;

use crate::provider::{
    Adapter, CONTINUE, Launch, LaunchCtx, Refusal, approval_params, base_env, binary, check_params,
    descriptor, extra_args, instructions, mcp_env, pass_through, prompt, rel,
};
use crate::providers::StreamParser;
use agentscope_domain::Provider;
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;

pub struct ClaudeCode;

impl Adapter for ClaudeCode {
    fn provider(&self) -> Provider {
        Provider::ClaudeCode
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
        Box::new(parser::ClaudeParser::new())
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
        parser::is_connection_retry(line)
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
