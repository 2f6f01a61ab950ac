//! `agentscope runtime logs`: a task's or an attempt's execution events, paged or followed live over SSE (reconnecting with `Last-Event-ID`).

use crate::api::*;
use crate::output::*;
use agentscope_api::sse::SseParser;
use anyhow::Result;
use anyhow::{anyhow, bail};
use clap::Subcommand;
use futures::StreamExt;
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::{Value, json};
use std::time::Duration;

#[derive(Subcommand)]
pub(crate) enum RuntimeCmd {
    /// Print the events of a task or an attempt.
    Logs {
        /// Follow the live stream until the work ends, reconnecting when the connection drops.
        #[arg(short = 'f', long)]
        follow: bool,
        /// A task id or an attempt id.
        id: String,
    },
}

pub(crate) async fn logs(api: &Api, raw_id: &str, follow: bool, json: bool) -> Result<()> {
    let id = id_arg("task or attempt", raw_id)?;
    let scope = if api.get_opt(&format!("/v1/tasks/{id}")).await?.is_some() {
        "task"
    } else if api.get_opt(&format!("/v1/attempts/{id}")).await?.is_some() {
        "attempt"
    } else {
        bail!("not_found: no task or attempt with id {id}");
    };
    let path = format!("/v1/{scope}s/{id}/events");
    if follow {
        return follow_events(api, scope, &path, json).await;
    }
    let mut after: Option<String> = None;
    loop {
        let url = match &after {
            Some(a) => format!("{path}?after={}", enc(a)),
            None => path.clone(),
        };
        let page = api.get(&url).await?;
        let items = items_of(&page);
        if items.is_empty() {
            return Ok(());
        }
        for ev in items {
            print_event(ev, json);
        }
        let next = page["next"]
            .as_str()
            .ok_or_else(|| anyhow!("event page without a `next` cursor"))?;
        if after.as_deref() == Some(next) {
            return Ok(());
        }
        after = Some(next.to_string());
    }
}

/// How one connection of a followed stream ended.
enum Ended {
    /// The `end` event arrived with this data.
    End(Value),
    /// The connection dropped; reconnect.
    Dropped(String),
}

/// Where the stream is: the last event id and (attempt number, seq) printed.
#[derive(Default)]
struct Position {
    last_id: Option<String>,
    printed: Option<(i64, i64)>,
    progressed: bool,
}

async fn follow_events(api: &Api, scope: &str, path: &str, json: bool) -> Result<()> {
    const RETRIES: u32 = 30;
    let mut pos = Position::default();
    let mut failures = 0;
    loop {
        pos.progressed = false;
        let mut rb = api
            .request(Method::GET, &format!("{path}?follow=true"), Auth::Workspace)?
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = &pos.last_id {
            rb = rb.header("Last-Event-ID", id);
        }
        let why = match stream_once(api, rb, &mut pos, json).await? {
            Ended::End(data) => {
                if json {
                    out(json!({"end": data}).to_string());
                } else {
                    out(format!("-- {scope} {}", cell(&data["status"])));
                }
                return Ok(());
            }
            Ended::Dropped(why) => why,
        };
        if pos.progressed {
            failures = 0;
        }
        failures += 1;
        if failures > RETRIES {
            bail!(
                "lost the event stream from {} ({why}); gave up after {RETRIES} reconnects",
                api.base
            );
        }
        eprintln!("-- stream interrupted ({why}); reconnecting ({failures}/{RETRIES})");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Reads one SSE connection; `Err` only for failures that reconnecting cannot fix.
async fn stream_once(
    api: &Api,
    rb: RequestBuilder,
    pos: &mut Position,
    json: bool,
) -> Result<Ended> {
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return Ok(Ended::Dropped(format!("{:#}", api.net_error(e)))),
    };
    let status = resp.status();
    if !status.is_success() {
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            return Ok(Ended::Dropped(format!("HTTP {status}")));
        }
        let body = resp.bytes().await.unwrap_or_default();
        let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
        return Err(api_error(status, &v));
    }
    let mut stream = resp.bytes_stream();
    let mut parser = SseParser::default();
    loop {
        // The server sends a keep-alive every 15 s; silence for longer means a dead connection.
        let chunk = match tokio::time::timeout(Duration::from_secs(45), stream.next()).await {
            Err(_) => return Ok(Ended::Dropped("no data for 45 s".into())),
            Ok(None) => return Ok(Ended::Dropped("connection closed".into())),
            Ok(Some(Err(e))) => return Ok(Ended::Dropped(format!("{:#}", api.net_error(e)))),
            Ok(Some(Ok(c))) => c,
        };
        for ev in parser.feed(&chunk) {
            match ev.event.as_str() {
                "end" => {
                    return Ok(Ended::End(
                        serde_json::from_str(&ev.data).unwrap_or(Value::Null),
                    ));
                }
                // The server's own failure notice carries no id; execution events always do.
                "error" if ev.id.is_none() => {
                    return Ok(Ended::Dropped(format!("server error {}", ev.data)));
                }
                _ => {}
            }
            let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                eprintln!("-- skipped an unreadable event: {}", ev.data);
                continue;
            };
            let at = (
                v["attempt_number"].as_i64().unwrap_or(0),
                v["seq"].as_i64().unwrap_or(0),
            );
            if ev.id.is_some() {
                pos.last_id = ev.id;
            }
            pos.progressed = true;
            if pos.printed.is_some_and(|p| at <= p) {
                continue; // already printed before a reconnect
            }
            pos.printed = Some(at);
            print_event(&v, json);
        }
    }
}
