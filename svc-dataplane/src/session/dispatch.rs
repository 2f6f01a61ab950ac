//! Where a tool runs: the session's Environment on this machine, its E2B sandbox, or its
//! self-hosted Worker (with the session's `worker_offline` status while it waits); comments and
//! Artifacts are written on the session's Issue by the gateway.

use super::pinned::Pinned;
use super::{Runner, Session, Stop};
use crate::env::Limits;
use crate::model::ToolCallReq;
use crate::tools::{self, ToolError, ToolOutput};
use agentscope_domain::SessionStatus;
use agentscope_schemas::v1::issue_write::What;
use serde_json::{Value, json};
use std::time::Duration;
use uuid::Uuid;

impl Runner {
    /// Asks the gateway to write a comment or an Artifact on the session's Issue.
    pub(super) async fn issue_write(&self, p: &Pinned, session_id: Uuid, what: What) -> ToolOutput {
        use agentscope_schemas::Message as _;
        let kind = match &what {
            What::Comment(_) => "comment",
            What::Artifact(_) => "artifact",
        };
        let req = agentscope_schemas::v1::IssueWrite {
            workspace_id: p.workspace_id.to_string(),
            session_id: session_id.to_string(),
            author: format!("session:{session_id}"),
            what: Some(what),
        };
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            self.nats.request(
                agentscope_bus::subjects::ISSUE_WRITE,
                req.encode_to_vec().into(),
            ),
        )
        .await;
        let r = match reply {
            Ok(Ok(m)) => agentscope_schemas::v1::IssueWriteReply::decode(m.payload.as_ref()).ok(),
            _ => None,
        };
        match r {
            Some(r) if r.ok => ToolOutput {
                output: format!("{kind} {} written on the Issue", r.id),
                is_error: false,
            },
            Some(r) => ToolOutput {
                output: format!("{}: {}", r.error_code, r.message),
                is_error: true,
            },
            None => ToolError::Unavailable.output(format!(
                "the gateway did not confirm the {kind}; it was not retried"
            )),
        }
    }
}

impl Session<'_> {
    /// The result of a `started` call that a previous replica sent to the session's Worker,
    /// asked for by its operation id (waiting while it still runs); `None` when there is no
    /// Worker, the call is not a Worker operation, or the Worker does not know it or is gone.
    pub(super) async fn recover(
        &self,
        p: &Pinned,
        call: &ToolCallReq,
    ) -> Result<Option<ToolOutput>, Stop> {
        let Some(link) = &p.worker else {
            return Ok(None);
        };
        if p.e2b
            || matches!(
                call.name.as_str(),
                "memory_search" | "memory_write" | "comment" | "upload_artifact"
            )
        {
            return Ok(None);
        }
        let operation_id = crate::worker::operation_id(self.id, &call.id, &call.name);
        match link
            .recover(self.id, &operation_id, self.r.limits().timeout)
            .await
        {
            Ok(mut out) => {
                tracing::info!(session_id = %self.id, call_id = %call.id, %operation_id, "result of an interrupted call recovered from the worker");
                if let Ok(values) = self.r.secrets(p.workspace_id, &p.policy.secrets).await? {
                    out.output =
                        agentscope_domain::vault::Redactor::new(&values).redact(&out.output);
                }
                Ok(Some(out))
            }
            Err(e) => {
                tracing::info!(session_id = %self.id, call_id = %call.id, %operation_id, error = ?e, "an interrupted call's result is not on the worker");
                Ok(None)
            }
        }
    }

    /// Writes the definition's files into a new session directory (through the Worker for
    /// `self_hosted`).
    pub(super) async fn materialize(&self, p: &Pinned) -> Result<(), Stop> {
        let limits = self.r.limits();
        for (name, text) in &p.files {
            let call = |tool: &str, input: Value| ToolCallReq {
                id: format!("materialize:{name}"),
                name: tool.into(),
                input,
            };
            let read = self
                .run_tool(
                    p,
                    &limits,
                    &call("read_file", json!({"path": name})),
                    &[],
                    None,
                )
                .await?;
            if !read.is_error {
                continue;
            }
            let write = call("write_file", json!({"path": name, "content": text}));
            let out = self.run_tool(p, &limits, &write, &[], None).await?;
            if out.is_error {
                tracing::warn!(session_id = %self.id, file = %name, error = %out.output, "capability file not written");
            }
        }
        Ok(())
    }

    /// Returns once the session's Worker beats; meanwhile the session shows `worker_offline`.
    pub(super) async fn wait_worker(&self, link: &crate::worker::WorkerLink) -> Result<(), Stop> {
        let mut reported = false;
        while !link.online().await {
            self.report_offline(link, &mut reported).await?;
            self.r.wait_for_news(Duration::from_millis(500)).await;
        }
        self.report_online(link, reported).await
    }

    pub(super) async fn report_offline(
        &self,
        link: &crate::worker::WorkerLink,
        reported: &mut bool,
    ) -> Result<(), Stop> {
        if !*reported {
            let detail = format!("worker `{}` is not answering; waiting for it", link.name);
            self.set_status(SessionStatus::WorkerOffline, &detail)
                .await?;
            self.event(
                "diagnostic",
                json!({"code": "worker_offline", "message": detail}),
            )
            .await?;
            *reported = true;
        }
        Ok(())
    }

    pub(super) async fn report_online(
        &self,
        link: &crate::worker::WorkerLink,
        reported: bool,
    ) -> Result<(), Stop> {
        if reported {
            self.set_status(SessionStatus::Running, "").await?;
            self.event("diagnostic", json!({"code": "worker_online", "message": format!("worker `{}` is back", link.name)}))
                .await?;
        }
        Ok(())
    }

    /// upload_artifact: the file's text (read where the session's files are), redacted of the
    /// agent's secrets, becomes an Artifact of the session's Issue.
    pub(super) async fn upload(
        &self,
        p: &Pinned,
        limits: &Limits,
        call: &ToolCallReq,
        secrets: &[(String, String)],
    ) -> Result<ToolOutput, Stop> {
        let Some(path) = call.input.get("path").and_then(Value::as_str) else {
            return Ok(ToolError::BadArguments.output("`path` (a string) is required"));
        };
        let read = ToolCallReq {
            id: call.id.clone(),
            name: "read_file".into(),
            input: json!({"path": path}),
        };
        let content = self.run_tool(p, limits, &read, &[], None).await?;
        if content.is_error {
            return Ok(content);
        }
        let name = call
            .input
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| path.rsplit('/').next().unwrap_or(path).to_string());
        let text = agentscope_domain::vault::redact(&content.output, secrets);
        let content_type = if name.ends_with(".md") {
            "text/markdown"
        } else if name.ends_with(".json") {
            "application/json"
        } else {
            "text/plain"
        };
        Ok(self
            .r
            .issue_write(
                p,
                self.id,
                What::Artifact(agentscope_schemas::v1::ArtifactUpload {
                    name,
                    content_type: content_type.into(),
                    content: text.into_bytes(),
                }),
            )
            .await)
    }

    /// A file or shell tool in this session's E2B sandbox (created on first use).
    pub(super) async fn run_in_e2b(
        &self,
        limits: &Limits,
        call: &ToolCallReq,
        env: &[(String, String)],
    ) -> ToolOutput {
        let Some(e2b) = &self.r.e2b else {
            return ToolError::SandboxUnavailable.output("no E2B backend is configured");
        };
        let sandbox = {
            let mut boxes = self.r.sandboxes.lock().await;
            match boxes.get(&self.id) {
                Some(s) => s.clone(),
                None => match e2b.create(Duration::from_secs(3600)).await {
                    Ok(s) => {
                        tracing::info!(session_id = %self.id, sandbox = %s.id, "E2B sandbox created");
                        boxes.insert(self.id, s.clone());
                        s
                    }
                    Err(out) => return out,
                },
            }
        };
        sandbox
            .run(&e2b.http, &call.name, &call.input, env, limits)
            .await
    }

    /// A file or shell tool, here or on the session's Worker. An operation that certainly did
    /// not reach the Worker waits for it and is sent again; one that may have run is reported,
    /// never repeated.
    pub(super) async fn run_tool(
        &self,
        p: &Pinned,
        limits: &Limits,
        call: &ToolCallReq,
        env: &[(String, String)],
        gate: Option<tools::Gate>,
    ) -> Result<ToolOutput, Stop> {
        if p.e2b {
            return Ok(self.run_in_e2b(limits, call, env).await);
        }
        let Some(link) = &p.worker else {
            return Ok(tools::run_after(&p.env, limits, &call.name, &call.input, env, gate).await);
        };
        let operation_id = crate::worker::operation_id(self.id, &call.id, &call.name);
        let mut reported = false;
        loop {
            match link
                .run(
                    self.id,
                    &operation_id,
                    &call.name,
                    &call.input,
                    env,
                    limits.timeout,
                )
                .await
            {
                Ok(out) => {
                    self.report_online(link, reported).await?;
                    return Ok(out);
                }
                Err(crate::worker::LinkError::Offline) => {
                    self.report_offline(link, &mut reported).await?;
                    self.r.wait_for_news(Duration::from_millis(500)).await;
                }
                Err(crate::worker::LinkError::Unknown) => {
                    unreachable!("only a query is answered `unknown`")
                }
                Err(crate::worker::LinkError::Lost(e)) => {
                    self.report_online(link, reported).await?;
                    tracing::warn!(session_id = %self.id, worker = %link.name, %operation_id, error = %e, "worker operation lost");
                    return Ok(ToolError::WorkerOffline.output(format!(
                        "worker `{}` stopped answering during this call ({e}); it was not retried, its effects are unknown",
                        link.name
                    )));
                }
            }
        }
    }
}
