//! OpenClaw: the adapter and its stream parser. Recipe: docs/providers.md.

pub mod parser;

use crate::provider::{
    Adapter, Launch, LaunchCtx, Refusal, base_env, binary, check_params, descriptor, extra_args,
    instructions, mcp_env, openai_base, prompt, rel,
};
use crate::providers::StreamParser;
use agentscope_domain::Provider;
use agentscope_schemas::v1::ProviderDescriptor;
use serde_json::json;

pub struct Openclaw;

impl Adapter for Openclaw {
    fn provider(&self) -> Provider {
        Provider::Openclaw
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
        Box::new(parser::OpenclawParser::new())
    }
}
