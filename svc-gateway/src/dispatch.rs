//! Direct dispatch: when the gateway has stored a task with its attempt 1, it claims queued
//! work of the attempt's pool for one idle host (`dispatch_attempt`, migration 0007, which is
//! `claim_attempts` for one slot), creates the lease and offers it to that host
//! (`agentscope.host.<id>.offer`), all before it answers. The usual path (a nudge, the host's
//! claim to the scheduler, the scheduler's claim and lease, the reply) costs two more hops
//! through the broker, two more wake-ups and a second transaction. Only an idle host (nothing
//! active) gets work this way: once hosts are busy, their own claims take it in batches, which
//! costs less per attempt than a claim and an offer each.
//!
//! Everything the scheduler's claims guarantee holds: the same statement under the same
//! counters' locks decides, the lease is created after the commit with the claim's fencing
//! token, and an attempt nobody got is never left to lapse:
//! - the lease cannot be created, no host answers (it is gone: no responders), or the host
//!   declines (no free slot, stopping): the lease key is removed and the attempt goes back to
//!   the queue (`UPDATE ... WHERE lease_token = <the claim's>`), then the pool is nudged;
//! - the offer's answer does not come: the host may have it, so the attempt stays claimed; a
//!   host that did not get it is offered it again on its next claim that does not list it, and
//!   one that is gone loses it when the lease's TTL has passed (`sweeper`), as with a lost claim
//!   reply;
//! - the gateway dies after the claim's commit: the same two ways out.

use crate::AppState;
use agentscope_bus::dispatch::{new_lease, spec_from_json};
use agentscope_bus::{BUCKET_LEASES, lease_key, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{AttemptAssignment, ClaimOffer, OfferReply};
use agentscope_store::first_attempt::DEFAULT_TIMEOUT_SOURCE;
use async_nats::jetstream::kv;
use std::time::Duration;
use uuid::Uuid;

/// How long the gateway waits for the host's answer to an offer.
const OFFER_WAIT: Duration = Duration::from_secs(2);

static WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

/// What direct dispatch did for the attempt the gateway just stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dispatched {
    /// It was claimed for `host_id` under `lease_token` and offered there (the host took it, or
    /// its answer did not come).
    Claimed { host_id: Uuid, lease_token: i64 },
    /// It is still queued: the pool's hosts must hear of it.
    Queued,
}

/// Tries to hand `attempt_id` (queued, just stored in `workspace_id`, with an idle host in its
/// pool a moment ago) to an idle host of its pool.
pub(crate) async fn dispatch(s: &AppState, workspace_id: Uuid, attempt_id: Uuid) -> Dispatched {
    match try_dispatch(s, workspace_id, attempt_id).await {
        Ok(d) => d,
        Err(e) => {
            if let Some(more) = WARNING.check() {
                tracing::warn!(error = %e, %attempt_id, "direct dispatch failed; the pool's hosts are nudged instead{more}");
            }
            s.metrics
                .inc("agentscope_dispatch_total", &[("result", "error")]);
            Dispatched::Queued
        }
    }
}

async fn try_dispatch(
    s: &AppState,
    workspace_id: Uuid,
    attempt_id: Uuid,
) -> anyhow::Result<Dispatched> {
    let leases = s
        .leases
        .get_or_try_init(|| s.js.get_key_value(BUCKET_LEASES))
        .await?;
    let task_token = agentscope_domain::new_token(agentscope_domain::TokenKind::Task);
    let claim = sqlx::query!(
        r#"SELECT r_host AS "host!", r_ids AS "ids!", r_task_ids AS "task_ids!",
                  r_numbers AS "numbers!", r_specs AS "specs!", r_tokens AS "tokens!"
           FROM dispatch_attempt($1, $2, $3, $4, $5)"#,
        attempt_id,
        s.config.host_offline_after_ms.min(i64::MAX as u64) as i64,
        agentscope_domain::hash_token(&task_token),
        s.config.run_timeout_secs as i64,
        DEFAULT_TIMEOUT_SOURCE,
    )
    .fetch_optional(&s.submit_db)
    .await?;
    let Some(c) = claim else {
        s.metrics
            .inc("agentscope_dispatch_total", &[("result", "no_idle_host")]);
        return Ok(Dispatched::Queued);
    };
    let (Some(id), Some(task_id), Some(number), Some(spec), Some(token)) = (
        c.ids.first(),
        c.task_ids.first(),
        c.numbers.first(),
        c.specs.first(),
        c.tokens.first(),
    ) else {
        anyhow::bail!("dispatch_attempt returned an empty claim");
    };
    let (host, id, token) = (c.host, *id, *token);
    let key = lease_key(&host.to_string(), &id.to_string());
    let record = new_lease(&host.to_string(), &id.to_string(), token);
    let revision = match leases.create(&key, record.encode_to_vec().into()).await {
        Ok(r) => r,
        Err(e) => {
            // Nobody was offered it.
            requeue(s, leases, &key, id, token, false).await;
            s.metrics
                .inc("agentscope_dispatch_total", &[("result", "unleased")]);
            return Err(e.into());
        }
    };
    let offer = ClaimOffer {
        assignments: vec![AttemptAssignment {
            attempt_id: id.to_string(),
            task_id: task_id.to_string(),
            // The new attempt's pool, so its workspace.
            workspace_id: workspace_id.to_string(),
            attempt_number: *number as u32,
            lease_key: key.clone(),
            lease_token: token as u64,
            lease_revision: revision,
            spec: Some(spec_from_json(spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        }],
        ..Default::default()
    };
    let request = async_nats::Request::new()
        .payload(offer.encode_to_vec().into())
        .timeout(Some(OFFER_WAIT));
    let answer = s
        .nats
        .send_request(subjects::host_offer(&host.to_string()), request)
        .await;
    let taken = match answer {
        Ok(msg) => match OfferReply::decode(msg.payload.as_ref()) {
            Ok(r) if r.accepted.iter().any(|a| *a == id.to_string()) => true,
            Ok(_) => false,
            Err(_) => {
                tracing::warn!(host_id = %host, "malformed answer to an offer; the attempt stays claimed for the host");
                true
            }
        },
        Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => false,
        Err(e) => {
            // It may have arrived: the host gets it again on its next claim if not.
            tracing::warn!(error = %e, host_id = %host, attempt_id = %id, "no answer to an offer; the attempt stays claimed for the host");
            true
        }
    };
    if !taken {
        requeue(s, leases, &key, id, token, true).await;
        s.metrics
            .inc("agentscope_dispatch_total", &[("result", "declined")]);
        return Ok(Dispatched::Queued);
    }
    s.metrics
        .inc("agentscope_dispatch_total", &[("result", "offered")]);
    tracing::info!(attempt_id = %id, task_id = %task_id, host_id = %host, lease_token = token, "attempt claimed and offered by the gateway");
    if id != attempt_id {
        // An older attempt of the pool went first: the new one still waits.
        return Ok(Dispatched::Queued);
    }
    Ok(Dispatched::Claimed {
        host_id: host,
        lease_token: token,
    })
}

/// Puts an attempt the gateway claimed and nobody got back in the queue: first its lease key
/// (`leased`) goes, so that a later claim for the same host can create it again; if that fails
/// the attempt stays claimed, and the host's next claim or the sweeper deals with it.
async fn requeue(s: &AppState, leases: &kv::Store, key: &str, id: Uuid, token: i64, leased: bool) {
    if leased && let Err(e) = leases.purge(key).await {
        tracing::warn!(error = %e, attempt_id = %id, "offer not taken and its lease not removed; the attempt stays claimed until its lease lapses");
        return;
    }
    let done = sqlx::query!(
        "UPDATE attempts SET status = 'queued', host_id = NULL, lease_token = NULL,
                claimed_at = NULL, task_token_hash = NULL
         WHERE id = $1 AND status = 'claimed' AND lease_token = $2",
        id,
        token,
    )
    .execute(&s.submit_db)
    .await;
    if let Err(e) = done {
        tracing::warn!(error = %e, attempt_id = %id, "offer not taken and the attempt not put back; the sweeper retries it once its lease lapses");
    }
}
