//! Comments and Artifacts of managed sessions: the dataplane asks over NATS, the gateway (the
//! only writer of comments and Artifacts) writes them on the session's Issue.

use crate::AppState;
use agentscope_schemas::v1::{IssueWrite, IssueWriteReply, issue_write::What};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Largest Artifact a session may upload (it travels in one NATS message).
pub const MAX_SESSION_ARTIFACT: usize = 256 * 1024;

/// Answers the dataplane's issue writes, one at a time, until `cancel`.
pub async fn serve(s: AppState, cancel: CancellationToken) -> anyhow::Result<()> {
    let at = agentscope_bus::Endpoint {
        subject: agentscope_bus::subjects::ISSUE_WRITE,
        queue_group: "gateway",
        concurrency: 1,
    };
    let state = &s;
    agentscope_bus::serve(
        &s.nats,
        at,
        cancel,
        |req: agentscope_bus::Request<IssueWrite>| async move {
            match req.body {
                Ok(w) => write(state, w).await,
                Err(_) => refused("malformed", "malformed IssueWrite"),
            }
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!(e).context("subscribe to session issue writes"))
}

fn refused(code: &str, message: &str) -> IssueWriteReply {
    IssueWriteReply {
        ok: false,
        error_code: code.into(),
        message: message.into(),
        ..Default::default()
    }
}

async fn write(s: &AppState, w: IssueWrite) -> IssueWriteReply {
    let (Ok(ws), Ok(session)) = (w.workspace_id.parse::<Uuid>(), w.session_id.parse::<Uuid>())
    else {
        return refused("invalid_id", "workspace_id and session_id must be UUIDs");
    };
    let issue = sqlx::query_scalar!(
        "SELECT issue_id FROM sessions WHERE id = $1 AND workspace_id = $2",
        session,
        ws,
    )
    .fetch_optional(&s.db)
    .await;
    let issue = match issue {
        Ok(Some(Some(i))) => i,
        Ok(Some(None)) => return refused("no_issue", "this session works on no Issue"),
        Ok(None) => return refused("not_found", "session not found"),
        Err(e) => {
            tracing::warn!(error = %e, "session issue write");
            return refused(
                "unavailable",
                "the gateway could not read the session; retry",
            );
        }
    };
    // The author is the session the write is for (checked above to be of this workspace),
    // never the message's `author` field.
    let author = format!("session:{session}");
    let id = Uuid::now_v7();
    let done = match w.what {
        Some(What::Comment(body)) => {
            if body.trim().is_empty() || body.len() > 64 * 1024 {
                return refused("invalid_field", "a comment is 1 byte to 64 KiB");
            }
            if body.contains('\0') {
                return refused(
                    "invalid_field",
                    "`body` contains a NUL character (\\u0000), which no text field accepts",
                );
            }
            sqlx::query!(
                "INSERT INTO comments (id, workspace_id, issue_id, author, body) VALUES ($1, $2, $3, $4, $5)",
                id,
                ws,
                issue,
                &author,
                &body,
            )
            .execute(&s.db)
            .await
        }
        Some(What::Artifact(a)) => {
            let name_ok = !a.name.is_empty()
                && a.name.len() <= 255
                && !a.name.contains(['/', '\\'])
                && a.name != ".."
                && !a.name.chars().any(|c| c.is_control());
            if !name_ok {
                return refused("invalid_field", "an Artifact name is a plain file name");
            }
            if a.content_type.contains('\0') {
                return refused(
                    "invalid_field",
                    "`content_type` contains a NUL character (\\u0000)",
                );
            }
            if a.content.len() > MAX_SESSION_ARTIFACT {
                return refused(
                    "payload_too_large",
                    "a session's Artifact is at most 256 KiB",
                );
            }
            use sha2::Digest;
            let sha = hex::encode(sha2::Sha256::digest(&a.content));
            sqlx::query!(
                "INSERT INTO artifacts (id, workspace_id, issue_id, session_id, name, content_type, size_bytes, sha256, content, author)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                id,
                ws,
                issue,
                session,
                &a.name,
                &a.content_type,
                a.content.len() as i64,
                &sha,
                &a.content[..],
                &author,
            )
            .execute(&s.db)
            .await
        }
        None => return refused("malformed", "nothing to write"),
    };
    match done {
        Ok(_) => IssueWriteReply {
            ok: true,
            id: id.to_string(),
            ..Default::default()
        },
        // A value the database refuses fails the same way on every retry.
        Err(e) if agentscope_store::fault(&e) == agentscope_store::Fault::BadData => {
            tracing::warn!(error = %e, "session issue write refused by the database");
            refused("invalid_field", "a value of the write cannot be stored")
        }
        Err(e) => {
            tracing::warn!(error = %e, "session issue write");
            refused("unavailable", "the gateway could not write; retry")
        }
    }
}
