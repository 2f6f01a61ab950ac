//! The tools a managed agent can call: files and shell through the session's Environment, and
//! the workspace's Memory Store in PostgreSQL (read live at every search).

use crate::model::ToolSpec;
use serde_json::{Value, json};
use uuid::Uuid;

/// The file and shell tools, shared with self-hosted Workers.
pub use agentscope_tools::{Gate, MAX_OUTPUT, ToolOutput, gate, run, run_after};

/// The stable code that starts the output of a tool error the dataplane itself produces
/// (`<code>: <message>`); the file and shell tools of `agentscope_tools` report their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolError {
    /// The call's input lacks a field or has one of the wrong shape.
    BadArguments,
    /// Not one of the agent's tools.
    UnknownTool,
    /// The policy or an Approval denied the call.
    ToolDenied,
    /// A replica stopped while the call ran; it is never run again.
    Interrupted,
    /// The session's environment is not enabled in this deployment.
    EnvironmentNotAllowed,
    /// The agent uses Vault secrets but the dataplane has no vault keys.
    VaultNotConfigured,
    /// The agent names a Vault secret the workspace does not have.
    SecretMissing,
    /// A Vault secret could not be opened.
    SecretUnavailable,
    /// The gateway did not confirm a comment or an Artifact.
    Unavailable,
    /// The E2B sandbox could not be had.
    SandboxUnavailable,
    /// The session's self-hosted Worker stopped answering during the call.
    WorkerOffline,
    /// E2B: no such file.
    NotFound,
    /// E2B: a path outside the session directory.
    PathEscape,
    /// E2B: a file could not be read or written.
    Io,
    /// The call's start could not be recorded, so it was not run.
    NotStarted,
}

impl ToolError {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadArguments => "bad_arguments",
            Self::NotStarted => "not_started",
            Self::UnknownTool => "unknown_tool",
            Self::ToolDenied => "tool_denied",
            Self::Interrupted => "interrupted",
            Self::EnvironmentNotAllowed => "environment_not_allowed",
            Self::VaultNotConfigured => "vault_not_configured",
            Self::SecretMissing => "secret_missing",
            Self::SecretUnavailable => "secret_unavailable",
            Self::Unavailable => "unavailable",
            Self::SandboxUnavailable => "sandbox_unavailable",
            Self::WorkerOffline => "worker_offline",
            Self::NotFound => "not_found",
            Self::PathEscape => "path_escape",
            Self::Io => "io",
        }
    }

    /// `<code>: <message>`.
    pub fn message(self, message: impl std::fmt::Display) -> String {
        format!("{}: {message}", self.as_str())
    }

    /// The error output `<code>: <message>`.
    pub fn output(self, message: impl std::fmt::Display) -> ToolOutput {
        ToolOutput {
            output: self.message(message),
            is_error: true,
        }
    }
}

/// The file and shell tools: run by the session's Environment (here, on E2B or on its Worker).
pub const LOCAL: [&str; 5] = [
    "read_file",
    "write_file",
    "edit_file",
    "list_files",
    "shell",
];

pub const ALL: [&str; 9] = [
    "read_file",
    "write_file",
    "edit_file",
    "list_files",
    "shell",
    "memory_search",
    "memory_write",
    "comment",
    "upload_artifact",
];

fn obj(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required})
}

/// The declarations of the tools `enabled` names (all when empty).
pub fn specs(enabled: &[String]) -> Vec<ToolSpec> {
    let s = |t: &str| json!({"type": "string", "description": t});
    let all = [
        (
            "read_file",
            "Read a text file of the session directory.",
            obj(
                json!({"path": s("path relative to the session directory")}),
                &["path"],
            ),
        ),
        (
            "write_file",
            "Write (create or replace) a text file in the session directory.",
            obj(
                json!({"path": s("path relative to the session directory"), "content": s("the whole new content")}),
                &["path", "content"],
            ),
        ),
        (
            "edit_file",
            "Replace exactly one occurrence of old_text with new_text in a file.",
            obj(
                json!({"path": s("path"), "old_text": s("text to replace, unique in the file"), "new_text": s("replacement")}),
                &["path", "old_text", "new_text"],
            ),
        ),
        (
            "list_files",
            "List a directory of the session directory (directories end with /).",
            obj(
                json!({"path": s("directory; empty for the session directory")}),
                &[],
            ),
        ),
        (
            "shell",
            "Run a shell command (sh -c) in the session directory; returns its output and exit code.",
            obj(json!({"command": s("the command line")}), &["command"]),
        ),
        (
            "memory_search",
            "Search the workspace's shared memory (full text).",
            obj(json!({"query": s("words to look for")}), &["query"]),
        ),
        (
            "memory_write",
            "Add a note to the workspace's shared memory.",
            obj(json!({"text": s("the note")}), &["text"]),
        ),
        (
            "comment",
            "Comment on the Issue this session works on.",
            obj(json!({"text": s("the comment (Markdown)")}), &["text"]),
        ),
        (
            "upload_artifact",
            "Upload a text file of the session directory as an Artifact of the Issue (at most 256 KiB).",
            obj(
                json!({"path": s("file in the session directory"), "name": s("Artifact name; default: the file's name")}),
                &["path"],
            ),
        ),
    ];
    all.into_iter()
        .filter(|(n, _, _)| enabled.is_empty() || enabled.iter().any(|e| e == n))
        .map(|(name, description, schema)| ToolSpec {
            name: name.into(),
            description: description.into(),
            schema,
        })
        .collect()
}

/// memory_write: the note checked and made, not stored; the caller stores it
/// ([`MemoryNote::insert`]) in the transaction that records the call's end.
pub fn memory_write(
    workspace_id: Uuid,
    session_id: Uuid,
    input: &Value,
) -> Result<(ToolOutput, MemoryNote), ToolOutput> {
    let Some(text) = input.get("text").and_then(Value::as_str) else {
        return Err(ToolError::BadArguments.output("`text` (a string) is required"));
    };
    if text.trim().is_empty() || text.len() > 16 * 1024 {
        return Err(ToolError::BadArguments.output("`text` must be 1 byte to 16 KiB"));
    }
    let note = MemoryNote {
        id: Uuid::now_v7(),
        workspace_id,
        session_id,
        text: text.to_string(),
    };
    Ok((
        ToolOutput::ok(format!("remembered (memory {})", note.id)),
        note,
    ))
}

/// A note `memory_write` keeps, stored in the transaction that records the call's end (so it is
/// never stored twice, nor without the call's end).
pub struct MemoryNote {
    id: Uuid,
    workspace_id: Uuid,
    session_id: Uuid,
    text: String,
}

impl MemoryNote {
    pub async fn insert(&self, conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query!(
            "INSERT INTO memory_entries (id, workspace_id, text, session_id) VALUES ($1, $2, $3, $4)",
            self.id,
            self.workspace_id,
            self.text,
            self.session_id,
        )
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// memory_search: the workspace's notes matching the query, best first (read live).
pub async fn memory_search(
    db: &agentscope_store::warm::Warm,
    workspace_id: Uuid,
    input: &Value,
) -> Result<ToolOutput, sqlx::Error> {
    let Some(query) = input.get("query").and_then(Value::as_str) else {
        return Ok(ToolError::BadArguments.output("`query` (a string) is required"));
    };
    let rows: Vec<String> = sqlx::query_scalar!(
        "SELECT text FROM memory_entries
         WHERE workspace_id = $1 AND tsv @@ websearch_to_tsquery('english', $2)
         ORDER BY ts_rank(tsv, websearch_to_tsquery('english', $2)) DESC, created_at DESC LIMIT 10",
        workspace_id,
        query,
    )
    .fetch_all(db)
    .await?;
    Ok(if rows.is_empty() {
        ToolOutput::ok("no memory matches")
    } else {
        ToolOutput::ok(
            rows.into_iter()
                .map(|r| format!("- {r}"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_filter_by_the_enabled_list() {
        assert_eq!(specs(&[]).len(), ALL.len());
        let only = specs(&["shell".into(), "read_file".into()]);
        let names: Vec<&str> = only.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["read_file", "shell"]);
    }
}
