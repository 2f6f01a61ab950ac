//! `agentscope bindings`: bindings of agents to pools and runtime profiles.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum BindingsCmd {
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

pub(crate) async fn bindings(api: &Api, cmd: BindingsCmd, json: bool) -> Result<()> {
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
