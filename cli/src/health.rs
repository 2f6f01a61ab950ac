//! `agentscope health`: the gateway's readiness.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use reqwest::{Method, StatusCode};
use std::process::ExitCode;
use std::time::Duration;

pub(crate) async fn health(api: &Api, json: bool) -> Result<ExitCode> {
    let rb = api
        .request(Method::GET, "/readyz", Auth::None)?
        .timeout(Duration::from_secs(15));
    let (status, v) = api.send(rb).await?;
    if json {
        print_json(&v);
    } else if v.is_object() {
        let detail = v["detail"]
            .as_str()
            .map(|d| format!(": {d}"))
            .unwrap_or_default();
        out(format!(
            "{} {}{detail}",
            cell(&v["service"]),
            cell(&v["status"])
        ));
    } else {
        out(format!("HTTP {status} {}", text(&v).trim()));
    }
    Ok(if status == StatusCode::OK {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
