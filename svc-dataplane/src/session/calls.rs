//! One tool call, journaled: the policy's decision (allow, ask, deny), the `started` row before
//! it runs and its end with the result message after; a call found `started` on takeover is
//! reported interrupted (or its Worker's result recovered), never run again, unless it only
//! reads.

use super::journal::{Batch, CallStatus, Ended};
use super::pinned::Pinned;
use super::{Runner, Session, Stop};
use crate::model::ToolCallReq;
use crate::policy::Decision;
use crate::tools::{self, ToolError, ToolOutput};
use agentscope_domain::SessionStatus;
use agentscope_schemas::v1::issue_write::What;
use serde_json::{Value, json};
use uuid::Uuid;

/// Whether `call` first waits for the session's Worker to beat (memory tools never do).
pub(super) fn waits_for_worker(p: &Pinned, call: &ToolCallReq) -> bool {
    p.worker.is_some() && !call.name.starts_with("memory_")
}

impl Runner {
    /// Opens the Vault secrets `names` of the workspace, now that a tool runs.
    pub(super) async fn secrets(
        &self,
        workspace_id: Uuid,
        names: &[String],
    ) -> Result<Result<Vec<(String, String)>, String>, sqlx::Error> {
        if names.is_empty() {
            return Ok(Ok(vec![]));
        }
        let Some(vault) = &self.vault else {
            return Ok(Err(ToolError::VaultNotConfigured.message(
                "this agent uses Vault secrets but the dataplane has no vault keys",
            )));
        };
        let rows = sqlx::query!(
            "SELECT name, key_id, nonce, ciphertext FROM vault_secrets WHERE workspace_id = $1 AND name = ANY($2)",
            workspace_id,
            names,
        )
        .fetch_all(&self.db)
        .await?;
        let mut out = vec![];
        for name in names {
            let Some(row) = rows.iter().find(|r| &r.name == name) else {
                return Ok(Err(
                    ToolError::SecretMissing.message(format!("no Vault secret named {name}"))
                ));
            };
            let sealed = agentscope_domain::vault::Sealed {
                key_id: row.key_id.clone(),
                nonce: row.nonce.clone(),
                ciphertext: row.ciphertext.clone(),
            };
            match vault.open(&workspace_id.to_string(), name, &sealed) {
                Ok(v) => out.push((name.clone(), String::from_utf8_lossy(&v).into_owned())),
                Err(e) => {
                    return Ok(Err(
                        ToolError::SecretUnavailable.message(format!("{name}: {e}"))
                    ));
                }
            }
        }
        Ok(Ok(out))
    }
}

impl Session<'_> {
    /// One tool call, journaled; returns its output and whether it was denied. `fresh`: the
    /// call's id is new to the session (first seen in the model turn just written), so it has
    /// no journal row to look for.
    pub(super) async fn call(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        fresh: bool,
    ) -> Result<(ToolOutput, bool), Stop> {
        let existing = if fresh {
            None
        } else {
            sqlx::query!(
                "SELECT status, output, is_error FROM session_tool_calls WHERE session_id = $1 AND call_id = $2",
                self.id,
                &call.id,
            )
            .fetch_optional(&self.r.db)
            .await?
            .map(|r| (CallStatus::parse(&r.status), r.output, r.is_error))
        };
        if existing
            .as_ref()
            .is_some_and(|e| e.0 == Some(CallStatus::AwaitingApproval))
        {
            return self.await_decision(p, input_id, call).await;
        }
        if let Some((status, output, is_error)) = existing {
            // Seen before this replica: a `started` call may have run; it is never run again,
            // unless it only reads (reading again changes nothing; its end may not have been
            // written yet, see `Session::work`). A Worker that ran it (or still runs it) is asked
            // for its result.
            let started = status == Some(CallStatus::Started);
            if started && super::turn::reads_only(p, call) {
                let (out, ended) = self.run_started(p, input_id, call, None).await?;
                self.commit(ended).await?;
                return Ok((out, false));
            }
            let recovered = if started {
                self.recover(p, call).await?
            } else {
                None
            };
            let (out, kind) = if let Some(out) = recovered {
                (out, "tool_result")
            } else if started {
                (
                    ToolError::Interrupted.output("the dataplane replica running this tool stopped before it reported; the tool was not run again, its effects (if any) are unknown"),
                    "tool_interrupted",
                )
            } else {
                (
                    ToolOutput {
                        output: output.unwrap_or_default(),
                        is_error,
                    },
                    "tool_result",
                )
            };
            let mut b = Batch::of(input_id);
            if started {
                let done = if kind == "tool_result" {
                    CallStatus::Completed
                } else {
                    CallStatus::Interrupted
                };
                b.ended
                    .push((call.id.clone(), done, out.output.clone(), out.is_error));
            }
            b.result(call, &out);
            b.event(
                kind,
                json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}),
            );
            self.write(b).await?;
            return Ok((out, status == Some(CallStatus::Denied)));
        }
        let (decision, why) = p.policy.decide(&call.name, &call.input);
        let known = tools::ALL.contains(&call.name.as_str())
            && (p.enabled.is_empty() || p.enabled.contains(&call.name));
        if known && decision == Decision::Ask {
            let mut b = Batch::of(input_id);
            b.journal(call, CallStatus::AwaitingApproval, None);
            b.status(
                SessionStatus::AwaitingApproval,
                &format!("tool `{}` waits for an approval", call.name),
            );
            b.event(
                "approval_requested",
                json!({"call_id": call.id, "tool": call.name, "input": call.input, "policy": why}),
            );
            self.write(b).await?;
            return self.await_decision(p, input_id, call).await;
        }
        if decision != Decision::Allow || !known {
            let out = if !known {
                ToolError::UnknownTool
                    .output(format!("`{}` is not one of this agent's tools", call.name))
            } else if decision == Decision::Deny {
                ToolError::ToolDenied
                    .output(format!("the agent's tool policy denies this call ({why})"))
            } else {
                unreachable!("ask is handled above")
            };
            let mut b = Batch::of(input_id);
            b.journal(call, CallStatus::Denied, Some(&out));
            b.result(call, &out);
            b.event(
                "tool_denied",
                json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output}),
            );
            self.write(b).await?;
            return Ok((out, known));
        }
        self.execute(p, input_id, call, None).await
    }

    /// Runs an allowed call: journaled `started` first (once committed, never run again), then
    /// `completed` with its result message in one write. `decided`: the call waited for an
    /// Approval, allowed with this decision, which commits with the start.
    pub(super) async fn execute(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        decided: Option<Value>,
    ) -> Result<(ToolOutput, bool), Stop> {
        let mut b = Batch::of(input_id);
        let approved = decided.is_some();
        if let Some(decided) = decided {
            b.event("approval_decided", decided);
            b.status(SessionStatus::Running, "");
        }
        if let Some(link) = &p.worker
            && waits_for_worker(p, call)
        {
            if approved {
                // The decision is recorded before the wait for the Worker is.
                self.write(std::mem::replace(&mut b, Batch::of(input_id)))
                    .await?;
            }
            self.wait_worker(link).await?;
        }
        if approved {
            b.started = Some(call.id.clone());
        } else {
            b.journal(call, CallStatus::Started, None);
        }
        b.event(
            "tool_call",
            json!({"call_id": call.id, "tool": call.name, "input": call.input}),
        );
        let (out, ended) = self.start_and_run(p, input_id, call, b).await?;
        self.commit(ended).await?;
        Ok((out, false))
    }

    /// Writes `start` (which journals `call` started) and runs the call (see
    /// [`Self::run_once_started`]).
    pub(super) async fn start_and_run(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        start: Batch,
    ) -> Result<(ToolOutput, Ended), Stop> {
        let (wrote, ran) = self
            .run_once_started(p, input_id, call, self.write(start), |_| true)
            .await;
        wrote?;
        ran
    }

    /// Runs `start`, a statement that journals `call` started when `started` says so of its
    /// result, and the call together: the call gets ready (a shell command's process created and
    /// held) while `start` commits, and runs only once `start` has started it; otherwise it
    /// never runs, and its result means nothing.
    pub(super) async fn run_once_started<T>(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        start: impl std::future::Future<Output = Result<T, Stop>>,
        started: impl FnOnce(&T) -> bool,
    ) -> (Result<T, Stop>, Result<(ToolOutput, Ended), Stop>) {
        let (key, gate) = tools::gate();
        let start = async move {
            let r = start.await;
            if r.as_ref().is_ok_and(started) {
                key.open();
            }
            r
        };
        tokio::join!(start, self.run_started(p, input_id, call, Some(gate)))
    }

    /// Runs a call journaled `started`; returns its output and its end (the journal row's
    /// `completed`, the result message and event, and a memory note), to be written together.
    /// `gate`: the call's start is being committed; nothing of the call takes effect before the
    /// gate opens (see [`Self::start_and_run`]).
    pub(super) async fn run_started(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        gate: Option<tools::Gate>,
    ) -> Result<(ToolOutput, Ended), Stop> {
        let limits = self.r.limits();
        // Secrets are opened only now, injected into the shell's environment, and redacted from
        // whatever any tool returns (the model, the events and the journal never hold them).
        let secrets = self.r.secrets(p.workspace_id, &p.policy.secrets).await?;
        // Only a file or shell tool run here takes the gate along (a shell command gets ready
        // meanwhile); anything else waits for it first.
        let here = !p.e2b && p.worker.is_none() && tools::LOCAL.contains(&call.name.as_str());
        let (gate, shut) = match gate {
            Some(g) if !here => (None, !g.opened().await),
            g => (g, false),
        };
        let out = match (&secrets, call.name.as_str()) {
            // Discarded: the caller reports the failed commit.
            _ if shut => ToolError::NotStarted.output("the call's start was not recorded"),
            (Err(e), _) => ToolOutput {
                output: e.clone(),
                is_error: true,
            },
            (Ok(_), "memory_search") => {
                tools::memory_search(&self.r.db, p.workspace_id, &call.input).await?
            }
            (Ok(_), "memory_write") => ToolOutput {
                output: String::new(),
                is_error: false,
            },
            (Ok(_), "comment") => match call.input.get("text").and_then(Value::as_str) {
                Some(text) => {
                    self.r
                        .issue_write(p, self.id, What::Comment(text.to_string()))
                        .await
                }
                None => ToolError::BadArguments.output("`text` (a string) is required"),
            },
            (Ok(values), "upload_artifact") => self.upload(p, &limits, call, values).await?,
            (Ok(env), name) => {
                let env: &[(String, String)] = if name == "shell" { env } else { &[] };
                self.run_tool(p, &limits, call, env, gate).await?
            }
        };
        // The note commits with the journal: never written twice.
        let mut note = None;
        let mut out = if call.name == "memory_write" && secrets.is_ok() && !shut {
            match tools::memory_write(p.workspace_id, self.id, &call.input) {
                Ok((out, n)) => {
                    note = Some(n);
                    out
                }
                Err(out) => out,
            }
        } else {
            out
        };
        if let Ok(values) = &secrets {
            out.output = agentscope_domain::vault::Redactor::new(values).redact(&out.output);
        }
        let mut b = Batch::of(input_id);
        b.ended.push((
            call.id.clone(),
            CallStatus::Completed,
            out.output.clone(),
            out.is_error,
        ));
        b.result(call, &out);
        b.event(
            "tool_result",
            json!({"call_id": call.id, "tool": call.name, "output": out.output, "is_error": out.is_error}),
        );
        Ok((out, Ended { batch: b, note }))
    }
}
