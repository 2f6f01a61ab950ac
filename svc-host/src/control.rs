//! Commands for this host: cancels and approval decisions from its durable consumer on
//! AGENTSCOPE_CONTROL.

use crate::Ctx;
use agentscope_bus::{Consume, subjects};
use agentscope_schemas::v1::{HostCommand, host_command};
use async_nats::jetstream::{self, AckKind, consumer::pull};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Commands for this host (cancels, approval decisions) from its durable consumer on
/// AGENTSCOPE_CONTROL, through the bus's consumer loop; returns once `cancel` fires.
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
    let messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let ctx = &ctx;
    // One command after another, in delivery order; every one is acked once handled, and a
    // malformed one (logged by the loop) is acked too: dropped.
    agentscope_bus::consume_decoded(
        messages,
        Consume {
            name: "control",
            concurrency: 1,
        },
        cancel,
        |_, cmd: HostCommand| async move {
            handle(ctx, cmd).await;
            AckKind::Ack
        },
        |_, _| async { AckKind::Ack },
    )
    .await;
    Ok(())
}

/// One command: a decision goes to its attempt's approvals, a cancel fires its cancel stop.
async fn handle(ctx: &Ctx, cmd: HostCommand) {
    match cmd {
        HostCommand {
            command: Some(host_command::Command::ApprovalDecision(d)),
            ..
        } => {
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
        HostCommand {
            command: Some(host_command::Command::Cancel(c)),
            ..
        } => {
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
        _ => tracing::debug!("control command ignored"),
    }
}
