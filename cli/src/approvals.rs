//! `agentscope approvals`, `approve` and `deny`: tool requests waiting for a decision.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use serde_json::json;

pub(crate) async fn list(api: &Api, status: Option<String>, json: bool) -> Result<()> {
    let path = match &status {
        Some(st) => format!("/v1/approvals?status={}", enc(st)),
        None => "/v1/approvals".to_string(),
    };
    let v = api.get(&path).await?;
    if json {
        print_json(&v);
    } else {
        let rows = items_of(&v)
            .iter()
            .map(|a| {
                vec![
                    cell(&a["id"]),
                    cell(&a["status"]),
                    cell(&a["tool_name"]),
                    compact(&a["input"]),
                    cell(&a["task_id"]),
                ]
            })
            .collect();
        table(&["ID", "STATUS", "TOOL", "INPUT", "TASK"], rows);
    }
    Ok(())
}

pub(crate) async fn approve(
    api: &Api,
    approval_id: &str,
    always_for_task: bool,
    json: bool,
) -> Result<()> {
    let id = id_arg("approval", approval_id)?;
    let v = api
        .post(
            &format!("/v1/approvals/{id}/approve"),
            json!({"always_for_task": always_for_task}),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        out(format!("approval {id} {}", cell(&v["status"])));
    }
    Ok(())
}

pub(crate) async fn deny(
    api: &Api,
    approval_id: &str,
    reason: Option<String>,
    json: bool,
) -> Result<()> {
    let id = id_arg("approval", approval_id)?;
    let v = api
        .post(
            &format!("/v1/approvals/{id}/deny"),
            object(vec![("reason", opt(&reason))]),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        out(format!("approval {id} {}", cell(&v["status"])));
    }
    Ok(())
}
