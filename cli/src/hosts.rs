//! `agentscope hosts`: hosts and their three checks.

use crate::api::*;
use crate::output::*;
use anyhow::{Result, bail};
use clap::Subcommand;
use serde_json::Value;
use uuid::Uuid;

#[derive(Subcommand)]
pub(crate) enum HostsCmd {
    /// List hosts with their checks.
    List,
    /// Show one host (full id, short id or name).
    Show { id: String },
}

pub(crate) async fn hosts(api: &Api, cmd: HostsCmd, json: bool) -> Result<()> {
    match cmd {
        HostsCmd::List => {
            let v = api.get("/v1/hosts").await?;
            if json {
                print_json(&v)
            } else {
                print_hosts(items_of(&v))
            }
        }
        HostsCmd::Show { id } => {
            let h = match Uuid::parse_str(id.trim()) {
                Ok(uuid) => api.get(&format!("/v1/hosts/{uuid}")).await?,
                Err(_) => {
                    let all = api.items("/v1/hosts").await?;
                    let mut found: Vec<Value> = all
                        .into_iter()
                        .filter(|h| {
                            h["name"].as_str() == Some(id.as_str())
                                || h["id"]
                                    .as_str()
                                    .is_some_and(|i| short(i) == id.to_lowercase())
                        })
                        .collect();
                    match found.len() {
                        1 => found.remove(0),
                        0 => bail!("no host with name or short id `{id}` in this workspace"),
                        n => bail!("{n} hosts match `{id}`; use the full id"),
                    }
                }
            };
            if json {
                print_json(&h);
                return Ok(());
            }
            print_hosts(std::slice::from_ref(&h));
            out(format!("  id            {}", cell(&h["id"])));
            out(format!("  version       {}", cell(&h["version"])));
            out(format!("  last seen     {}", when(&h["last_seen_at"])));
            let caps: Vec<String> = h["capabilities"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect();
            out(format!(
                "  capabilities  {}",
                if caps.is_empty() {
                    "-".into()
                } else {
                    caps.join(",")
                }
            ));
            out(format!("  providers     {}", h["providers"]));
        }
    }
    Ok(())
}

const CHECKS: [&str; 3] = ["connectivity", "provider_discovery", "dispatch_readiness"];

/// One table row per host, each followed by its three checks.
fn print_hosts(hosts: &[Value]) {
    if hosts.is_empty() {
        out("(no hosts)");
        return;
    }
    let rows: Vec<Vec<String>> = hosts
        .iter()
        .map(|h| {
            vec![
                cell(&h["name"]),
                short(h["id"].as_str().unwrap_or("")),
                cell(&h["pool"]),
                if h["online"] == true { "yes" } else { "no" }.to_string(),
                format!("{}/{}", cell(&h["running"]), cell(&h["capacity"])),
            ]
        })
        .collect();
    let lines = table_lines(&["NAME", "ID", "POOL", "ONLINE", "RUNNING"], &rows);
    out(&lines[0]);
    for (h, line) in hosts.iter().zip(&lines[1..]) {
        out(line);
        for c in CHECKS {
            let check = &h["checks"][c];
            let ok = if check["ok"] == true { "ok" } else { "FAIL" };
            out(format!("    {c:<18}  {ok:<4}  {}", text(&check["detail"])));
        }
    }
}
