//! `agentscope agents`: agents and their versions.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum AgentsCmd {
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

pub(crate) async fn agents(api: &Api, cmd: AgentsCmd, json: bool) -> Result<()> {
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
