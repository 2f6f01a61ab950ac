//! `agentscope profiles`: runtime profiles (how a provider is launched on a host).

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use anyhow::bail;
use clap::Subcommand;
use serde_json::Map;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum ProfilesCmd {
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

fn parse_param(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

pub(crate) async fn profiles(api: &Api, cmd: ProfilesCmd, json: bool) -> Result<()> {
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
