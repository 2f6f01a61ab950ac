//! Commands for this host: cancels and approval decisions from its durable consumer on
//! AGENTSCOPE_CONTROL.

use crate::Ctx;
use agentscope_bus::subjects;
use agentscope_schemas::Message;
use agentscope_schemas::v1::{HostCommand, host_command};
use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::StreamExt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Commands for this host (cancel) from its durable consumer on AGENTSCOPE_CONTROL.
pub(crate) async fn control(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let stream = loop {
        match ctx.js.get_stream(agentscope_bus::STREAM_CONTROL).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!(error = %e, "control stream not there yet");
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
    };
    let durable = format!("host-{}", ctx.host_id);
    let consumer = stream
        .get_or_create_consumer(
            &durable,
            pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: subjects::control(&ctx.host_id.to_string()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                // Every command is acked once handled (a malformed one is dropped); only a host
                // that dies before acking sees a redelivery, and never forever.
                max_deliver: 100,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("create control consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            m = messages.next() => match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => { tracing::warn!(error = %e, "control consumer"); continue }
                None => return Ok(()),
            },
        };
        match HostCommand::decode(msg.payload.as_ref()) {
            Ok(HostCommand {
                command: Some(host_command::Command::ApprovalDecision(d)),
                ..
            }) => {
                let to = ctx
                    .state
                    .lock()
                    .expect("host state")
                    .decisions
                    .get(&d.attempt_id)
                    .cloned();
                match to {
                    Some(tx) => {
                        tracing::info!(attempt_id = %d.attempt_id, request_id = %d.request_id, allow = d.allow, "approval decision");
                        let _ = tx.send(d).await;
                    }
                    None => {
                        tracing::debug!(attempt_id = %d.attempt_id, "decision for an attempt not running here")
                    }
                }
            }
            Ok(HostCommand {
                command: Some(host_command::Command::Cancel(c)),
                ..
            }) => {
                let stops = ctx
                    .state
                    .lock()
                    .expect("host state")
                    .running
                    .get(&c.attempt_id)
                    .cloned();
                match stops {
                    Some(s) => {
                        tracing::info!(attempt_id = %c.attempt_id, "cancel requested");
                        s.cancel.cancel();
                    }
                    None => {
                        tracing::debug!(attempt_id = %c.attempt_id, "cancel for an attempt not running here")
                    }
                }
            }
            Ok(_) => tracing::debug!("control command ignored"),
            Err(_) => tracing::warn!("malformed control command dropped"),
        }
        let _ = msg.ack_with(AckKind::Ack).await;
    }
}
