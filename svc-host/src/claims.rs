//! Claiming work: the claim loop (nudges in the pool's queue group while a slot is free, polling
//! as the fallback) and the start of each attempt offered as supervised work.

use crate::{Ctx, attempt, journal};
use agentscope_bus::subjects;
use agentscope_schemas::Message;
use agentscope_schemas::v1::{ClaimOffer, ClaimRequest, OfferReply};
use agentscope_telemetry::supervisor::Work;
use futures::{FutureExt, StreamExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The queue group hosts with a free slot listen in for their pool's nudges: NATS hands each
/// nudge to one member, so one nudge wakes one host that can take work.
const FREE_HOSTS_QUEUE: &str = "free-hosts";

/// Asks for work: at start, on a nudge (while a slot is free, as a member of the pool's queue
/// group), every `poll_interval_ms` (the fallback: nothing depends on a nudge arriving), and at
/// once again after an offer that brought work while more is waiting and a slot is still free.
pub(crate) async fn claim_loop(
    ctx: Ctx,
    pool_id: String,
    slots: Arc<Semaphore>,
    attempts: Work,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let subject = (!pool_id.is_empty()).then(|| nudge_subject(&ctx, &pool_id));
    let mut nudges: Option<async_nats::Subscriber> = None;
    let poll = Duration::from_millis(ctx.config.poll_interval_ms);
    let mut next_poll = tokio::time::Instant::now();
    let mut claim_now = true;
    // The last claim's answer: more work waits than it could take.
    let mut work_waiting = false;
    // Attempts the gateway claimed for this host when it stored their tasks.
    let mut offers = ctx
        .nats
        .subscribe(subjects::host_offer(&ctx.host_id.to_string()))
        .await?;
    loop {
        if claim_now && slots.available_permits() > 0 {
            next_poll = tokio::time::Instant::now() + poll;
            let (got, waiting) = claim_once(&ctx, &slots, &attempts).await;
            work_waiting = waiting > 0;
            if got > 0 && waiting > 0 && slots.available_permits() > 0 {
                continue;
            }
        }
        claim_now = false;
        // In the queue group exactly while a slot is free.
        let free = slots.available_permits() > 0;
        match (&subject, free, nudges.is_some()) {
            (Some(s), true, false) => {
                nudges = Some(
                    ctx.nats
                        .queue_subscribe(s.clone(), FREE_HOSTS_QUEUE.into())
                        .await?,
                );
            }
            (Some(s), false, true) => {
                let mut sub = nudges.take().expect("subscribed");
                let _ = sub.unsubscribe().await;
                // A nudge that reached this host after it filled up goes to a host with room.
                let mut missed = false;
                while let Some(Some(_)) = sub.next().now_or_never() {
                    missed = true;
                }
                if missed {
                    let _ = ctx.nats.publish(s.clone(), bytes::Bytes::new()).await;
                }
            }
            _ => {}
        }
        // When the directory prepared on the gateway's early word expires, if one is.
        let prepared_until = attempt::prepared_until(&ctx);
        let expiry = async {
            match prepared_until {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => futures::future::pending::<()>().await,
            }
        };
        let nudge = async {
            match nudges.as_mut() {
                Some(n) => n.next().await.is_some(),
                None => futures::future::pending::<bool>().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => {
                attempt::discard_prepared(&ctx, false);
                return Ok(());
            }
            // A directory prepared ahead that nothing brought goes.
            _ = expiry => attempt::discard_prepared(&ctx, true),
            offer = offers.next() => match offer {
                Some(msg) => take_offer(&ctx, &slots, &attempts, msg).await,
                None => {
                    offers = ctx
                        .nats
                        .subscribe(subjects::host_offer(&ctx.host_id.to_string()))
                        .await?;
                }
            },
            open = nudge => {
                if open {
                    // Several nudges queued up are one claim.
                    if let Some(n) = nudges.as_mut() {
                        while let Some(Some(_)) = n.next().now_or_never() {}
                    }
                    claim_now = true;
                } else {
                    // The subscription ended (reconnect): subscribe again.
                    nudges = None;
                }
            }
            // A slot freed while work waits: claim it now rather than wait for a nudge.
            _ = ctx.slot_freed.notified() => claim_now = work_waiting,
            _ = tokio::time::sleep_until(next_poll) => {
                claim_now = true;
                next_poll = tokio::time::Instant::now() + poll;
            }
        }
    }
}

/// One claim request; starts the attempts offered. Returns how many were started and how many
/// more the scheduler says are waiting.
async fn claim_once(ctx: &Ctx, slots: &Arc<Semaphore>, attempts: &Work) -> (usize, u32) {
    let free = slots.available_permits() as u32;
    let (held_attempts, ended_attempts) = {
        let st = ctx.state.lock().expect("host state");
        let ended: Vec<String> = st
            .reported
            .iter()
            .chain(st.finished.iter())
            .cloned()
            .collect();
        let held = st.running.keys().cloned().chain(ended.iter().cloned());
        (held.collect(), ended)
    };
    let req = ClaimRequest {
        host_id: ctx.host_id.to_string(),
        host_token: ctx.config.host_token.clone(),
        free_slots: free,
        held_attempts,
        ended_attempts,
    };
    // Well inside the lease TTL, so a lost reply is offered again before its lease lapses.
    let wait = Duration::from_millis((ctx.lease_ttl_ms() / 3).clamp(500, 5_000));
    let mut got = 0;
    match tokio::time::timeout(
        wait,
        ctx.nats.request(
            subjects::host_claim(&ctx.host_id.to_string()),
            req.encode_to_vec().into(),
        ),
    )
    .await
    {
        Ok(Ok(msg)) => match ClaimOffer::decode(msg.payload.as_ref()) {
            Ok(offer) if !offer.error_code.is_empty() => {
                tracing::warn!(code = %offer.error_code, message = %offer.message, "claim refused");
            }
            Ok(offer) => {
                if !offer.recorded_ends.is_empty() {
                    // Their ends are recorded: no claim needs to list them any more.
                    let recorded: std::collections::HashSet<&str> =
                        offer.recorded_ends.iter().map(String::as_str).collect();
                    let mut st = ctx.state.lock().expect("host state");
                    st.finished.retain(|id| !recorded.contains(id.as_str()));
                    st.reported.retain(|id| !recorded.contains(id.as_str()));
                }
                for a in offer.assignments {
                    if ctx
                        .state
                        .lock()
                        .expect("host state")
                        .running
                        .contains_key(&a.attempt_id)
                    {
                        // Already running here (offered by the gateway meanwhile).
                        continue;
                    }
                    let permit = slots.clone().try_acquire_owned();
                    let Ok(permit) = permit else {
                        tracing::error!(attempt_id = %a.attempt_id, "offered more than free capacity; its lease will lapse");
                        continue;
                    };
                    got += 1;
                    spawn_attempt(ctx, attempts, a.into(), permit, None);
                }
                return (got, offer.waiting);
            }
            Err(_) => tracing::warn!("malformed claim offer"),
        },
        Ok(Err(e)) => tracing::warn!(error = %e, "claim request"),
        Err(_) => tracing::warn!("claim request timed out"),
    }
    (got, 0)
}

/// An offer the gateway made: attempts it claimed for this host (`ClaimOffer`). The answer says
/// which are taken (also one this host already has: an offer is never run twice) and which are
/// declined (no free slot, or the host is stopping), which the gateway puts back in the queue.
/// The answer goes first, then the attempts start. The gateway's early word
/// (`prepare_only`, no answer) only has a host with a free slot prepare the first attempt's
/// directory.
async fn take_offer(ctx: &Ctx, slots: &Arc<Semaphore>, attempts: &Work, msg: async_nats::Message) {
    let Ok(offer) = ClaimOffer::decode(msg.payload.as_ref()) else {
        tracing::warn!("malformed offer");
        return;
    };
    if offer.prepare_only {
        tracing::debug!(attempts = offer.assignments.len(), "early word");
        let free = slots.available_permits() > 0 && !attempts.stopping().is_cancelled();
        if let Some(a) = offer.assignments.into_iter().next() {
            attempt::prepare_ahead(ctx, a.into(), free);
        }
        return;
    }
    let Some(reply) = msg.reply else { return };
    let mut answer = OfferReply::default();
    let mut start = Vec::new();
    for a in offer.assignments {
        let known = ctx.state.lock().expect("host state").knows(&a.attempt_id);
        if known {
            answer.accepted.push(a.attempt_id);
            continue;
        }
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) if !attempts.stopping().is_cancelled() => p,
            _ => {
                answer.declined.push(a.attempt_id);
                continue;
            }
        };
        answer.accepted.push(a.attempt_id.clone());
        start.push((a, permit));
    }
    let _ = ctx.nats.publish(reply, answer.encode_to_vec().into()).await;
    for (a, permit) in start {
        spawn_attempt(ctx, attempts, a.into(), permit, None);
    }
}

/// Runs an attempt as work of the host's supervisor, holding `permit` (a capacity slot) until it
/// ends. Its `shutdown` stop fires when the host begins to stop.
pub(crate) fn spawn_attempt(
    ctx: &Ctx,
    attempts: &Work,
    a: attempt::Assignment,
    permit: tokio::sync::OwnedSemaphorePermit,
    resume: Option<journal::Entry>,
) {
    let stops = attempt::Stops {
        cancel: CancellationToken::new(),
        lease_lost: CancellationToken::new(),
        shutdown: attempts.stopping().child_token(),
    };
    let (dtx, drx) = tokio::sync::mpsc::channel(64);
    {
        let mut st = ctx.state.lock().expect("host state");
        st.running.insert(a.attempt_id.clone(), stops.clone());
        st.decisions.insert(a.attempt_id.clone(), dtx);
    }
    let ctx = ctx.clone();
    attempts.spawn(async move {
        let id = a.attempt_id.clone();
        attempt::run(ctx.clone(), a, stops, drx, resume).await;
        {
            let mut st = ctx.state.lock().expect("host state");
            st.running.remove(&id);
            st.decisions.remove(&id);
            st.finished.push_back(id);
            if st.finished.len() > 256 {
                st.finished.pop_front();
            }
        }
        drop(permit);
        // A slot is free: claim it at once if work waits (the claim lists this attempt as
        // ended, so the scheduler does not count it even before it records the end), and
        // listen for nudges again.
        ctx.slot_freed.notify_one();
    });
}

/// The work nudges of a pool of this host's workspace.
fn nudge_subject(ctx: &Ctx, pool_id: &str) -> String {
    let ws = ctx
        .state
        .lock()
        .expect("host state")
        .registered
        .as_ref()
        .map(|r| r.workspace_id.clone())
        .unwrap_or_default();
    subjects::pool_work(&ws, pool_id)
}
