//! Recovery of a previous run's attempts: each journaled one either resumes its provider
//! session or is reported ended with `host_restart`.

use crate::{Ctx, attempt, journal, process};
use agentscope_bus::subjects;
use agentscope_schemas::Message;
use agentscope_schemas::v1::{Diagnostic, ExecutionEvent, Lifecycle, execution_event::Body};

/// Attempts journaled by a previous run of this host whose process is gone: report them ended
/// with `host_restart`, under their old fencing token. If the lease is gone the recorder refuses
/// the report and nothing changes; if it still holds, the scheduler retries the task.
pub(crate) async fn recover(ctx: &Ctx) -> Vec<(attempt::Assignment, journal::Entry)> {
    let entries = match ctx.journal.entries() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = ?e, "read journal");
            return vec![];
        }
    };
    let mut resume = Vec::new();
    for mut e in entries {
        // The provider the previous run started may have outlived it.
        process::kill_marked(&format!("AGENTSCOPE_ATTEMPT_ID={}", e.attempt_id)).await;
        // The journal's `last_seq` was acknowledged with every event before it; the stream may
        // hold later ones. A gap between the two (an event lost across a reconnect while a later
        // one was stored) would stop the recorder at it for good: fill it (see `fill_gaps`).
        // This host's publisher keeps one message in flight and so leaves no gap; a stream
        // whose newest message is a batch was written that way (and the seqs inside a batch
        // have no `Nats-Msg-Id` of their own that would keep a fill from landing beside them).
        let (newest_first, published) = published_seqs(ctx, &e.attempt_id).await;
        if newest_first == published && published > e.last_seq + 1 {
            // Only seqs the publisher had in flight can be missing: its window, and what it
            // handed over before the last checkpoint. Anything wider is not a lost publish.
            if published - e.last_seq <= 2 * attempt::PUBLISH_WINDOW as u64 {
                fill_gaps(ctx, &e, e.last_seq + 1, published).await;
            } else {
                tracing::error!(attempt_id = %e.attempt_id, journaled = e.last_seq, published, "the stream is far ahead of the journal; no gap filled");
            }
        }
        e.last_seq = e.last_seq.max(published);
        if let Some(a) = resumable(ctx, &e).await {
            tracing::warn!(attempt_id = %e.attempt_id, session = %e.provider_session_id, "attempt interrupted by a host restart; resuming its provider session");
            resume.push((a, e));
            continue;
        }
        tracing::warn!(attempt_id = %e.attempt_id, lease_token = e.lease_token, "attempt interrupted by a host restart; recovery conditions do not hold");
        let ev = ExecutionEvent {
            attempt_id: e.attempt_id.clone(),
            seq: e.last_seq + 1,
            lease_token: e.lease_token,
            host_id: ctx.host_id.to_string(),
            at_ms: agentscope_bus::now_ms(),
            body: Some(Body::Lifecycle(Lifecycle {
                state: attempt::wire_state(agentscope_domain::AttemptStatus::Failed) as i32,
                failure_class: agentscope_domain::FailureClass::HostRestart.as_str().into(),
                detail: "the host restarted while the attempt ran".into(),
                exit_code: 0,
                has_exit_code: false,
            })),
        };
        let msg_id = format!("{}:{}", e.attempt_id, ev.seq);
        let sent = async {
            ctx.js
                .publish_with_headers(
                    subjects::events(&ctx.host_id.to_string(), &e.attempt_id),
                    agentscope_bus::headers(&msg_id),
                    ev.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        ctx.state
            .lock()
            .expect("host state")
            .reported
            .push(e.attempt_id.clone());
        match sent {
            Ok(_) => {
                let _ = ctx.journal.remove(&e.attempt_id);
            }
            Err(err) => tracing::warn!(error = %err, "report interrupted attempt; kept in journal"),
        }
    }
    resume
}

/// Whether a journaled attempt can resume here after a host restart: the provider resumes, its
/// session exists in the task directory, the lease is still this host's, and the restart is
/// within the window.
/// Returns the assignment with the lease's current revision.
async fn resumable(ctx: &Ctx, e: &journal::Entry) -> Option<attempt::Assignment> {
    let bytes = hex::decode(&e.assignment_hex).ok()?;
    let mut a: attempt::Assignment =
        agentscope_schemas::v1::AttemptAssignment::decode(bytes.as_slice())
            .ok()?
            .into();
    if e.provider_session_id.is_empty()
        || agentscope_bus::now_ms() - e.saved_at_ms > RESUME_WINDOW_MS
    {
        return None;
    }
    let adapter = ctx.adapter(&e.provider)?;
    if !ctx
        .descriptor(&e.provider)
        .is_some_and(|d| d.resume && d.installed && d.logged_in)
    {
        return None;
    }
    if !adapter.session_exists(&attempt::existing_task_dir(ctx, &a), &e.provider_session_id) {
        return None;
    }
    let lease = ctx.leases.entry(&e.lease_key).await.ok()??;
    if lease.operation != async_nats::jetstream::kv::Operation::Put {
        return None;
    }
    let holder = agentscope_schemas::v1::LeaseRecord::decode(lease.value.as_ref()).ok()?;
    // The scheduler writes token 0 at creation; renewals write the fencing token.
    if holder.host_id != ctx.host_id.to_string()
        || (holder.token != 0 && holder.token != e.lease_token)
    {
        return None;
    }
    a.lease_revision = lease.revision;
    Some(a)
}

/// How long after its last checkpoint an interrupted attempt may still resume.
const RESUME_WINDOW_MS: i64 = 10 * 60 * 1000;

/// Publishes an `event_lost` diagnostic for every seq in `from..to` under the event's own
/// `Nats-Msg-Id`: the stream drops it where the event is stored (within its duplicate window;
/// after that, the recorder takes the first of a seq and drops the second), so only a seq the
/// stream never got is filled, and the recorder can go past it.
async fn fill_gaps(ctx: &Ctx, e: &journal::Entry, from: u64, to: u64) {
    let subject = subjects::events(&ctx.host_id.to_string(), &e.attempt_id);
    let mut acks = Vec::new();
    for seq in from..to {
        let ev = ExecutionEvent {
            attempt_id: e.attempt_id.clone(),
            seq,
            lease_token: e.lease_token,
            host_id: ctx.host_id.to_string(),
            at_ms: agentscope_bus::now_ms(),
            body: Some(Body::Diagnostic(Diagnostic {
                level: "warn".into(),
                code: "event_lost".into(),
                message: "an event of this seq was not stored before the host restarted".into(),
            })),
        };
        let msg_id = format!("{}:{seq}", e.attempt_id);
        match ctx
            .js
            .publish_with_headers(
                subject.clone(),
                agentscope_bus::headers(&msg_id),
                ev.encode_to_vec().into(),
            )
            .await
        {
            Ok(ack) => acks.push(ack),
            Err(err) => {
                tracing::warn!(attempt_id = %e.attempt_id, seq, error = %err, "fill an event gap");
                return;
            }
        }
    }
    let mut filled = 0;
    for ack in acks {
        match ack.await {
            Ok(a) if !a.duplicate => filled += 1,
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(attempt_id = %e.attempt_id, error = %err, "fill an event gap")
            }
        }
    }
    if filled > 0 {
        tracing::warn!(attempt_id = %e.attempt_id, filled, "events lost before the restart were marked lost");
    }
}

/// The first and last seq of the newest message of the attempt in the stream (one event, or a
/// batch); zeros when there is none.
async fn published_seqs(ctx: &Ctx, attempt_id: &str) -> (u64, u64) {
    let Ok(stream) = ctx.js.get_stream(agentscope_bus::STREAM_EVENTS).await else {
        return (0, 0);
    };
    match stream
        .direct_get_last_for_subject(subjects::events(&ctx.host_id.to_string(), attempt_id))
        .await
    {
        Ok(m) => match agentscope_schemas::decode_events(m.payload.as_ref()) {
            Ok(events) => (
                events.first().map(|e| e.seq).unwrap_or(0),
                events.last().map(|e| e.seq).unwrap_or(0),
            ),
            Err(_) => (0, 0),
        },
        Err(_) => (0, 0),
    }
}
