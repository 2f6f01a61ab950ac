//! What a session runs with: its pinned agent version (instructions, model, tools, policy,
//! limits), its Environment, Worker or E2B sandbox, resolved once when a replica takes it over.

use super::{Runner, Stop};
use crate::env::{Environment, Limits};
use crate::model::{self, ModelConfig};
use crate::policy::{Decision, Policy};
use crate::tools::{self, ToolError};
use std::path::PathBuf;
use std::time::Duration;
use uuid::Uuid;

/// What a session runs with, resolved once from its pinned agent version.
pub(super) struct Pinned {
    pub(super) workspace_id: Uuid,
    pub(super) instructions: String,
    pub(super) model: String,
    pub(super) enabled: Vec<String>,
    pub(super) policy: Policy,
    pub(super) max_iters: u32,
    pub(super) env: Environment,
    /// `self_hosted`: the Worker that runs the file and shell tools.
    pub(super) worker: Option<crate::worker::WorkerLink>,
    /// `sandbox` on the E2B backend.
    pub(super) e2b: bool,
    /// The definition's files, written into the session directory when it is new.
    pub(super) files: Vec<(String, String)>,
    /// Why this replica refuses to run the session's tools (`environment_not_allowed: ...`).
    pub(super) refused: Option<String>,
}

impl Runner {
    pub(super) async fn pinned(&self, session_id: Uuid) -> Result<Pinned, Stop> {
        let row = sqlx::query!(
            "SELECT s.workspace_id, s.environment, v.instructions, v.model, v.tools, v.policy, v.max_iters, v.capability_files, s.worker
             FROM sessions s JOIN agent_versions v ON v.id = s.agent_version_id WHERE s.id = $1",
            session_id,
        )
        .fetch_one(&self.db)
        .await?;
        let (
            workspace_id,
            environment,
            instructions,
            model,
            tools,
            policy,
            max_iters,
            files,
            worker,
        ) = (
            row.workspace_id,
            row.environment,
            row.instructions,
            row.model,
            row.tools,
            row.policy,
            row.max_iters,
            row.capability_files,
            row.worker,
        );
        let base = match (environment.as_str(), self.config.remote_dir.as_str()) {
            ("remote", "") => PathBuf::from(&self.config.sessions_dir).join("remote"),
            ("remote", shared) => PathBuf::from(shared),
            _ => PathBuf::from(&self.config.sessions_dir),
        };
        // `local` and `remote` run tools unsandboxed on this machine: only when enabled.
        let refused = (["local", "remote"].contains(&environment.as_str())
            && !self.config.allow_local_environment)
            .then(|| {
                ToolError::EnvironmentNotAllowed.message(format!(
                    "the `{environment}` environment runs tools unsandboxed on the dataplane's machine and this deployment does not enable it (AGENTSCOPE_ALLOW_LOCAL_ENVIRONMENT); use `sandbox`"
                ))
            });
        let (root, identity) = if refused.is_some() {
            (base.join(session_id.to_string()), None)
        } else {
            let uids = self.uids;
            let b = base.clone();
            match tokio::task::spawn_blocking(move || {
                crate::env::prepare_session_dir(&b, session_id, uids)
            })
            .await
            {
                Ok(Ok(prepared)) => prepared,
                Ok(Err(e)) => {
                    tracing::error!(%session_id, error = %e, "session directory");
                    return Err(Stop::Db(sqlx::Error::Io(std::io::Error::other(
                        e.to_string(),
                    ))));
                }
                Err(e) => return Err(Stop::Db(sqlx::Error::Io(std::io::Error::other(e)))),
            }
        };
        let env = match environment.as_str() {
            "sandbox" => Environment::Sandbox {
                root,
                identity,
                spec: self.sandbox.clone(),
            },
            _ => Environment::Local { root, identity },
        };
        let worker = worker.map(|name| crate::worker::WorkerLink {
            nats: self.nats.clone(),
            workers: self.workers.clone(),
            worker_id: crate::worker::worker_id(&workspace_id.to_string(), &name),
            name,
            ttl: Duration::from_millis(self.config.worker_ttl_ms),
        });
        Ok(Pinned {
            refused,
            e2b: environment == "sandbox" && self.e2b.is_some(),
            worker,
            files: files
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| v.as_str().map(|t| (k.clone(), t.to_string())))
                .collect(),
            workspace_id,
            instructions,
            model: model
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| self.config.model_default.clone()),
            enabled: tools
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect(),
            policy: Policy::from_json(&policy).unwrap_or_else(|e| {
                tracing::warn!(%session_id, error = %e, "invalid policy; denying every tool");
                Policy {
                    default: Decision::Deny,
                    ..Policy::default()
                }
            }),
            max_iters: max_iters.unwrap_or(20).max(1) as u32,
            env,
        })
    }

    pub(super) fn limits(&self) -> Limits {
        Limits {
            timeout: Duration::from_secs(self.config.shell_timeout_secs),
            max_output: tools::MAX_OUTPUT,
            max_file: 4 * 1024 * 1024,
            memory_bytes: Some(self.config.session_memory_mb * 1024 * 1024),
            max_processes: Some(self.config.session_max_processes),
            cpu_secs: (self.config.session_cpu_secs > 0).then_some(self.config.session_cpu_secs),
        }
    }

    pub(super) fn model_config(&self, model: &str) -> ModelConfig {
        ModelConfig {
            api: match self.config.model_api.as_str() {
                "openai_chat" => model::Api::OpenaiChat,
                "openai_responses" => model::Api::OpenaiResponses,
                _ => model::Api::Anthropic,
            },
            base_url: self.config.model_base_url.clone(),
            api_key: self.config.model_api_key.0.clone(),
            model: model.to_string(),
            max_tokens: 4096,
            stream: self.config.model_stream,
            max_retries: self.config.model_max_retries,
            retry_base_ms: 200,
        }
    }
}
