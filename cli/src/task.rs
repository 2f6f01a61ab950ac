//! `agentscope task ...`: what an executor (a provider running on a host) may do with its
//! task-scoped credential (`mcp.rs` serves the same operations as an MCP server).

use crate::output::print_json;
use anyhow::{Context, Result, anyhow, bail};
use clap::Subcommand;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The executor's view of the API: its task, through its task credential.
#[derive(Clone)]
pub struct TaskApi {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl TaskApi {
    pub fn from_env(base: &str) -> Result<TaskApi> {
        let token = std::env::var("AGENTSCOPE_TASK_TOKEN")
            .ok()
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| anyhow!("no task credential: AGENTSCOPE_TASK_TOKEN is not set (it is given to executors by the host)"))?;
        Ok(TaskApi {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()?,
            base: base.trim_end_matches('/').to_string(),
            token,
        })
    }

    async fn send(&self, rb: reqwest::RequestBuilder) -> Result<Value> {
        let res = rb
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("reach the agentscope API at {}", self.base))?;
        let status = res.status();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let e = &body["error"];
            bail!(
                "{}: {}",
                e["code"].as_str().unwrap_or("error"),
                e["message"].as_str().unwrap_or(status.as_str())
            );
        }
        Ok(body)
    }

    pub async fn context(&self) -> Result<Value> {
        self.send(self.http.get(format!("{}/v1/task", self.base)))
            .await
    }

    pub async fn comment(&self, body: &str) -> Result<Value> {
        self.send(
            self.http
                .post(format!("{}/v1/task/comments", self.base))
                .json(&json!({"body": body})),
        )
        .await
    }

    pub async fn upload(&self, name: &str, content_type: &str, bytes: Vec<u8>) -> Result<Value> {
        self.send(
            self.http
                .post(format!(
                    "{}/v1/task/artifacts?name={}",
                    self.base,
                    percent(name)
                ))
                .header("content-type", content_type)
                .body(bytes),
        )
        .await
    }
}

/// Percent-encodes a query value.
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A file inside the current directory (the task directory), never outside it.
pub fn local_file(path: &str) -> Result<PathBuf> {
    let cwd = std::env::current_dir()?.canonicalize()?;
    let p = cwd
        .join(path)
        .canonicalize()
        .with_context(|| format!("open {path}"))?;
    if !p.starts_with(&cwd) {
        bail!("{path} is outside the task directory");
    }
    Ok(p)
}

pub fn guess_content_type(name: &str) -> &'static str {
    match Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
    {
        "md" => "text/markdown",
        "txt" | "log" => "text/plain",
        "json" => "application/json",
        "html" => "text/html",
        "csv" => "text/csv",
        "patch" | "diff" => "text/x-diff",
        "png" => "image/png",
        _ => "application/octet-stream",
    }
}

#[derive(Subcommand)]
pub(crate) enum TaskCmd {
    /// The task, its Issue, comments, input material and Artifacts.
    Show,
    /// Comment on the task's Issue.
    Comment { body: String },
    /// Upload a file of the task directory as an Artifact.
    Upload {
        file: String,
        /// Artifact name (default: the file's name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        content_type: Option<String>,
    },
}

pub(crate) async fn run(base: &str, cmd: TaskCmd) -> Result<()> {
    let task = TaskApi::from_env(base)?;
    let v = match cmd {
        TaskCmd::Show => task.context().await?,
        TaskCmd::Comment { body } => task.comment(&body).await?,
        TaskCmd::Upload {
            file,
            name,
            content_type,
        } => {
            let path = local_file(&file)?;
            let name = name.unwrap_or_else(|| {
                path.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| file.clone())
            });
            let ct = content_type.unwrap_or_else(|| guess_content_type(&name).to_string());
            let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
            task.upload(&name, &ct, bytes).await?
        }
    };
    print_json(&v);
    Ok(())
}
