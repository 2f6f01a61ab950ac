//! `agentscope pools`: pools of hosts.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum PoolsCmd {
    /// Create a pool; prints its id.
    Create {
        name: String,
        #[arg(long)]
        max_concurrency: Option<i32>,
    },
    /// List pools.
    List,
}

pub(crate) async fn pools(api: &Api, cmd: PoolsCmd, json: bool) -> Result<()> {
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
