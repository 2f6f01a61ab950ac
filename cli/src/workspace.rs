//! `agentscope workspace` and `agentscope host-token`: a new workspace (with the deployment's
//! admin token) and host registration tokens.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum WorkspaceCmd {
    /// Create a workspace; prints AGENTSCOPE_WORKSPACE_ID=... and AGENTSCOPE_TOKEN=... lines.
    Create {
        name: String,
        #[arg(long)]
        max_concurrency: Option<i32>,
        /// The deployment's admin token.
        #[arg(long, env = "AGENTSCOPE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum HostTokenCmd {
    /// Create a host registration token; prints an AGENTSCOPE_HOST_TOKEN=... line.
    Create { name: String },
}

pub(crate) async fn workspace(api: &Api, cmd: WorkspaceCmd, json: bool) -> Result<()> {
    let WorkspaceCmd::Create {
        name,
        max_concurrency,
        admin_token,
    } = cmd;
    let body = object(vec![
        ("name", Some(json!(name))),
        ("max_concurrency", opt(&max_concurrency)),
    ]);
    let v = api
        .call(
            Method::POST,
            "/v1/workspaces",
            Auth::Admin(&admin_token),
            Some(body),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        out(format!(
            "# created workspace {}",
            cell(&v["workspace"]["name"])
        ));
        out(format!(
            "AGENTSCOPE_WORKSPACE_ID={}",
            text(&v["workspace"]["id"])
        ));
        out(format!("AGENTSCOPE_TOKEN={}", text(&v["api_token"])));
    }
    Ok(())
}

pub(crate) async fn host_token(api: &Api, cmd: HostTokenCmd, json: bool) -> Result<()> {
    let HostTokenCmd::Create { name } = cmd;
    let v = api.post("/v1/host-tokens", json!({"name": name})).await?;
    if json {
        print_json(&v);
    } else {
        out(format!(
            "# host token {} ({})",
            cell(&v["name"]),
            cell(&v["id"])
        ));
        out(format!("AGENTSCOPE_HOST_TOKEN={}", text(&v["token"])));
    }
    Ok(())
}
