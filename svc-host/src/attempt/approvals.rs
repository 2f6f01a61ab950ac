//! A provider's tool requests: asked as Approvals, answered in the provider's own protocol.

use super::Assignment;
use super::sink::EventSink;
use crate::Ctx;
use crate::isolation;
use crate::provider;
use agentscope_bus::subjects;
use agentscope_domain::FailureClass;
use agentscope_schemas::Message;
use agentscope_schemas::v1::{ApprovalDecision, execution_event::Body};
use std::time::Duration;

/// Publishes a provider's tool request for a decision and records it as an event.
pub(super) async fn request_approval(
    ctx: &Ctx,
    a: &Assignment,
    sink: &mut EventSink,
    req: &provider::ControlRequest,
    key: &str,
    timeout_ms: u32,
) {
    let input_json = isolation::redact_text(&req.input.to_string(), &sink.secrets);
    sink.emit(Body::ApprovalRequested(
        agentscope_schemas::v1::ApprovalRequested {
            request_id: key.to_string(),
            tool_name: req.tool_name.clone(),
            input_json: input_json.clone(),
            timeout_ms,
        },
    ))
    .await;
    // The request's event is in the stream before the request itself.
    sink.flush().await;
    let tr = agentscope_schemas::v1::ToolRequest {
        request_id: key.to_string(),
        attempt_id: a.attempt_id.clone(),
        session_id: String::new(),
        tool_name: req.tool_name.clone(),
        input_json,
        lease_token: a.lease_token,
        requested_at_ms: agentscope_bus::now_ms(),
        timeout_ms,
    };
    let msg_id = format!("approval:{}:{key}", a.attempt_id);
    let mut delay = Duration::from_millis(100);
    for _ in 0..20 {
        let sent = async {
            ctx.js
                .publish_with_headers(
                    subjects::approval_requested(&ctx.host_id.to_string(), &a.attempt_id),
                    agentscope_bus::headers(&msg_id),
                    tr.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        match sent {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "publish tool request; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Writes protocol lines to the provider's stdin (when it is still open).
pub(super) async fn write_lines(
    stdin: &mut Option<tokio::net::unix::pipe::Sender>,
    lines: Vec<String>,
) {
    use tokio::io::AsyncWriteExt;
    let Some(pipe) = stdin.as_mut() else { return };
    for l in lines {
        let _ = pipe.write_all(l.as_bytes()).await;
    }
    let _ = pipe.flush().await;
}

/// Tells the provider the decision and records it.
#[allow(clippy::too_many_arguments)]
pub(super) async fn answer(
    stdin: &mut Option<tokio::net::unix::pipe::Sender>,
    adapter: &dyn provider::Adapter,
    sink: &mut EventSink,
    req: &provider::ControlRequest,
    key: &str,
    allow: bool,
    reason: &str,
    decided_by: &str,
    class: &str,
) {
    use tokio::io::AsyncWriteExt;
    if let Some(pipe) = stdin.as_mut() {
        let text = adapter.control_response(req, allow, reason);
        let _ = pipe.write_all(text.as_bytes()).await;
        let _ = pipe.flush().await;
    }
    sink.emit(Body::ApprovalDecided(
        agentscope_schemas::v1::ApprovalDecided {
            request_id: key.to_string(),
            allow,
            reason: reason.to_string(),
            decided_by: decided_by.to_string(),
            failure_class: class.to_string(),
        },
    ))
    .await;
}

/// The denial a turn that ends now ended with: a deny replaces it, an allow clears it.
pub(super) fn denied_outcome(
    req: &provider::ControlRequest,
    d: &ApprovalDecision,
) -> Option<(FailureClass, String)> {
    if d.allow {
        return None;
    }
    let (class, by) = if d.decided_by == "policy" {
        (
            FailureClass::ApprovalTimeout,
            "nobody decided before the approval timeout".to_string(),
        )
    } else {
        (
            FailureClass::ToolDenied,
            format!("denied by {}", d.decided_by),
        )
    };
    let reason = match d.reason.trim() {
        "" => String::new(),
        r => format!(": {r}"),
    };
    Some((
        class,
        format!(
            "the agent's turn ended after its `{}` request was refused ({by}{reason})",
            req.tool_name
        ),
    ))
}
