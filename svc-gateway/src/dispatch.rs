//! Direct dispatch: when the gateway stores a task with its attempt 1, the same statement
//! (`submit_task`, migration 0007) stores the attempt claimed for an idle host of its pool, within
//! every limit, unless older work of the pool waits for that host; the gateway then creates the
//! lease and, at the same time, offers it to that host (`agentscope.host.<id>.offer`). It answers
//! once the host has answered (a host that took the attempt does not wait for its lease: the
//! lease exists before the host's first renewal reads it, a fifth of a TTL later; one that
//! declined waits for the lease, to remove it). The usual path (a nudge, the host's
//! claim to the scheduler, the scheduler's claim and lease, the reply) costs two more hops
//! through the broker, two more wake-ups and a second transaction. Only an idle host (nothing
//! active) gets work this way, and one pool's dispatches of a gateway go one at a time: once
//! hosts are busy, their own claims take work in batches, which costs less per attempt than a
//! claim and an offer each.
//!
//! The host the pool's last dispatch went to is told of the attempt before the statement runs
//! (the early word, [`tell_early`]), and the statement prefers it among the idle hosts: while
//! PostgreSQL executes and flushes the statement, that host prepares the task directory, and the
//! offer that follows the commit starts the provider at once. The word claims nothing: a host
//! starts only what an offer or a claim brings, and removes a preparation nothing brings.
//!
//! Everything the scheduler's claims guarantee holds: the same counters, locked in the same
//! order, decide, the lease is created after the commit with the claim's fencing
//! token, and an attempt nobody got is never left to lapse:
//! - no host answers (it is gone: no responders), or the host declines (no free slot,
//!   stopping): the lease key is removed and the attempt goes back to the queue
//!   (`UPDATE ... WHERE lease_token = <the claim's>`), then the pool is nudged; so does an
//!   attempt whose lease could not be created and that nobody took;
//! - the host took it and its lease could not be created: the host's first renewal finds no
//!   lease and stops the provider, and the attempt, claimed without a lease, is lost after a
//!   lease TTL (`sweeper`) and retried;
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
use async_nats::jetstream::kv;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

/// How long the gateway waits for the host's answer to an offer.
const OFFER_WAIT: Duration = Duration::from_secs(2);

static WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

/// The pools this gateway is dispatching to now, and the host each pool's last direct dispatch
/// went to.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlight(Arc<Mutex<Pools>>);

#[derive(Debug, Default)]
struct Pools {
    turns: HashSet<Uuid>,
    last_host: HashMap<Uuid, Uuid>,
}

/// What a submission needs to dispatch directly: the settings, this gateway's pools under way
/// and its NATS connection (for the early word).
#[derive(Clone, Copy)]
pub(crate) struct Dispatching<'a> {
    pub(crate) pools: &'a InFlight,
    pub(crate) config: &'a crate::Config,
    pub(crate) nats: &'a async_nats::Client,
}

/// A pool's turn to dispatch; ends when dropped.
pub(crate) struct Turn {
    pools: InFlight,
    pool: Uuid,
    /// The host the pool's last direct dispatch went to: the one likely idle now (at low load,
    /// the one that ran the previous task), which the statement prefers and which prepares the
    /// attempt while it runs.
    pub(crate) last_host: Option<Uuid>,
}

impl InFlight {
    pub(crate) fn enter(&self, pool: Uuid) -> Option<Turn> {
        let mut p = self.0.lock().expect("dispatching pools");
        p.turns.insert(pool).then(|| Turn {
            pools: self.clone(),
            pool,
            last_host: p.last_host.get(&pool).copied(),
        })
    }
}

impl Turn {
    /// Records where the statement put the pool's attempt: claimed for `host`, or queued (None;
    /// the pool is busy: no early word goes out until a dispatch finds an idle host again).
    pub(crate) fn went_to(&self, host: Option<Uuid>) {
        let mut p = self.pools.0.lock().expect("dispatching pools");
        match host {
            Some(h) => p.last_host.insert(self.pool, h),
            None => p.last_host.remove(&self.pool),
        };
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.pools
            .0
            .lock()
            .expect("dispatching pools")
            .turns
            .remove(&self.pool);
    }
}

/// Tells `host` of an attempt the statement now running may claim for it
/// (`ClaimOffer.prepare_only`): an idle host prepares its task directory meanwhile, so that the
/// offer, once the statement has committed, starts the provider at once. Only a word: nothing
/// is claimed and nothing starts, and a host that does not hear it, or is not chosen, loses
/// nothing (it removes a preparation nothing brings). Published, not awaited.
pub(crate) async fn tell_early(
    nats: &async_nats::Client,
    host: Uuid,
    workspace_id: Uuid,
    task_id: Uuid,
    attempt_id: Uuid,
    spec: &serde_json::Value,
) {
    let word = ClaimOffer {
        assignments: vec![AttemptAssignment {
            attempt_id: attempt_id.to_string(),
            task_id: task_id.to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: 1,
            spec: Some(spec_from_json(spec)),
            ..Default::default()
        }],
        prepare_only: true,
        ..Default::default()
    };
    let _ = nats
        .publish(
            subjects::host_offer(&host.to_string()),
            word.encode_to_vec().into(),
        )
        .await;
}

/// What direct dispatch did for the attempt the gateway just stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dispatched {
    /// It was claimed for `host_id` under `lease_token` and offered there (the host took it, or
    /// its answer did not come).
    Claimed { host_id: Uuid, lease_token: i64 },
    /// It is still queued: the pool's hosts must hear of it.
    Queued,
}

/// A submission's attempt 1 as the statement that stored it claimed it for an idle host.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    pub(crate) host: Uuid,
    pub(crate) id: Uuid,
    pub(crate) task_id: Uuid,
    pub(crate) spec: serde_json::Value,
    pub(crate) token: i64,
}

/// Offers `claim` (a submission's attempt in `workspace_id`, stored claimed with the hash of
/// `task_token`) to its host.
pub(crate) async fn offer(
    s: &AppState,
    workspace_id: Uuid,
    claim: Claim,
    task_token: String,
) -> Dispatched {
    let (host, id) = (claim.host, claim.id);
    match try_offer(s, workspace_id, claim, task_token).await {
        Ok(d) => d,
        Err(e) => {
            if let Some(more) = WARNING.check() {
                tracing::warn!(error = %e, attempt_id = %id, host_id = %host, "direct dispatch failed; the pool's hosts are nudged instead{more}");
            }
            s.metrics
                .inc("agentscope_dispatch_total", &[("result", "error")]);
            Dispatched::Queued
        }
    }
}

async fn try_offer(
    s: &AppState,
    workspace_id: Uuid,
    c: Claim,
    task_token: String,
) -> anyhow::Result<Dispatched> {
    let (host, id, token) = (c.host, c.id, c.token);
    let key = lease_key(&host.to_string(), &id.to_string());
    let leases = match s
        .leases
        .get_or_try_init(|| s.js.get_key_value(BUCKET_LEASES))
        .await
    {
        Ok(l) => l,
        Err(e) => {
            requeue(s, None, &key, id, token).await;
            return Err(e.into());
        }
    };
    // The lease is created while the offer travels: the host takes the lease's revision from
    // its first renewal (a renewal at an unknown revision reads the key and finds its own
    // value), which comes a fifth of a TTL later, so neither waits for the other.
    let record = new_lease(&host.to_string(), &id.to_string(), token);
    let offer = ClaimOffer {
        assignments: vec![AttemptAssignment {
            attempt_id: id.to_string(),
            task_id: c.task_id.to_string(),
            // The new attempt's pool, so its workspace.
            workspace_id: workspace_id.to_string(),
            attempt_number: 1,
            lease_key: key.clone(),
            lease_token: token as u64,
            lease_revision: 0,
            spec: Some(spec_from_json(&c.spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        }],
        ..Default::default()
    };
    let request = async_nats::Request::new()
        .payload(offer.encode_to_vec().into())
        .timeout(Some(OFFER_WAIT));
    let creating = {
        let (leases, key) = (leases.clone(), key.clone());
        tokio::spawn(async move {
            leases.create(&key, record.encode_to_vec().into()).await?;
            anyhow::Ok(())
        })
    };
    let created = |h: tokio::task::JoinHandle<anyhow::Result<()>>| async move { h.await? };
    let answer = s
        .nats
        .send_request(subjects::host_offer(&host.to_string()), request)
        .await;
    let taken = match answer {
        Ok(msg) => match OfferReply::decode(msg.payload.as_ref()) {
            Ok(r) => r.accepted.iter().any(|a| *a == id.to_string()),
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
    if taken {
        // The host has it: the answer does not wait for the lease, which exists before the
        // host's first renewal needs it (a fifth of a TTL later). Taken without a lease: that
        // renewal finds none and stops the provider, and the sweeper, finding no lease a TTL
        // after the claim, ends the attempt lost (and retries it).
        s.metrics
            .inc("agentscope_dispatch_total", &[("result", "offered")]);
        let (metrics, task_id) = (s.metrics.clone(), c.task_id);
        tokio::spawn(async move {
            match created(creating).await {
                Ok(()) => {
                    tracing::info!(attempt_id = %id, %task_id, host_id = %host, lease_token = token, "attempt claimed and offered by the gateway");
                }
                Err(e) => {
                    metrics.inc("agentscope_dispatch_total", &[("result", "error")]);
                    if let Some(more) = WARNING.check() {
                        tracing::warn!(error = %e, attempt_id = %id, host_id = %host, "the host took an offer whose lease could not be created; the attempt is lost once a lease TTL has passed, and retried{more}");
                    }
                }
            }
        });
        return Ok(Dispatched::Claimed {
            host_id: host,
            lease_token: token,
        });
    }
    if let Err(e) = created(creating).await {
        // Nobody has it and no lease was made.
        requeue(s, None, &key, id, token).await;
        return Err(e);
    }
    requeue(s, Some(leases), &key, id, token).await;
    s.metrics
        .inc("agentscope_dispatch_total", &[("result", "declined")]);
    Ok(Dispatched::Queued)
}

/// Puts an attempt the gateway claimed and nobody got back in the queue: first its lease key
/// (if `leased` holds it) goes, so that a later claim for the same host can create it again; if that fails
/// the attempt stays claimed, and the host's next claim or the sweeper deals with it.
async fn requeue(s: &AppState, leased: Option<&kv::Store>, key: &str, id: Uuid, token: i64) {
    if let Some(leases) = leased
        && let Err(e) = leases.purge(key).await
    {
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
