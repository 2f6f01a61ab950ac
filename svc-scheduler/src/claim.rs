//! Claims: a host asks for work; the scheduler leases it eligible queued Attempts within every
//! concurrency limit (host capacity, per agent, per pool, per workspace), atomically.
//!
//! No workspace-wide lock: candidates are taken with `FOR UPDATE SKIP LOCKED`, and each limit
//! is a row of `attempt_counts` (kept by a trigger on `attempts`, in the same transaction as
//! every status change, whoever makes it) that the claim locks and reads before it decides.
//! An end does not lock it: it appends a delta that the next claim to lock the row folds in
//! (migration 0013), so the recorder's ends and the claims never wait for each other.
//! One claim takes as many attempts as the host has free slots, and its reply says how many
//! more are waiting.
//!
//! The whole decision is one statement (`claim_attempts`, migration 0006): one round trip to
//! Postgres instead of six. The attempts' leases are created once it has committed, each
//! recording the claim's fencing token; an attempt whose lease cannot be created is put back in
//! the queue, and one left claimed without a lease (a scheduler that died in between) is lost
//! once a lease TTL has passed (`sweeper`).

use crate::{Ctx, Error};
use agentscope_bus::dispatch::{new_lease, spec_from_json};
use agentscope_bus::{Endpoint, Request, SCHEDULER_QUEUE, lease_key, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{AttemptAssignment, ClaimOffer, ClaimRequest, LeaseRecord};
use agentscope_store::first_attempt::DEFAULT_TIMEOUT_SOURCE;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// "lease cannot be created" warnings: one line per interval.
static LEASE_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(std::time::Duration::from_secs(5));

pub(crate) async fn serve(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    // Claims run concurrently; they meet only on the counter rows of the limits they check
    // (held from the check to the commit) and skip each other's candidates.
    let at = Endpoint {
        subject: subjects::HOST_CLAIM_ALL,
        queue_group: SCHEDULER_QUEUE,
        concurrency: 16,
    };
    agentscope_bus::serve(&ctx.nats, at, cancel, |msg: Request<ClaimRequest>| {
        let ctx = ctx.clone();
        async move {
            let offer = match msg.body {
                // The subject's host id is the one NATS authorized: a host claims only as
                // itself.
                Ok(req) if subjects::token(&msg.subject, 2) != Some(req.host_id.as_str()) => {
                    refused("forbidden", "host_id does not match the claim subject")
                }
                Ok(req) => claim(&ctx, req).await.unwrap_or_else(|e| {
                    tracing::error!(error = ?e, "claim failed");
                    refused("internal", "claim failed; retry")
                }),
                Err(_) => refused("malformed", "ClaimRequest payload does not decode"),
            };
            let result = if !offer.error_code.is_empty() {
                "refused"
            } else if offer.assignments.is_empty() {
                "empty"
            } else {
                "offered"
            };
            ctx.metrics
                .inc("agentscope_claim_requests_total", &[("result", result)]);
            offer
        }
    })
    .await
    .map_err(Error::bus)?;
    Ok(())
}

fn refused(code: &str, message: &str) -> ClaimOffer {
    ClaimOffer {
        error_code: code.into(),
        message: message.into(),
        ..Default::default()
    }
}

async fn claim(ctx: &Ctx, req: ClaimRequest) -> Result<ClaimOffer, Error> {
    let Some(workspace_id) = crate::hosts::verify_host_token(ctx, &req.host_token).await? else {
        return Ok(refused("unauthorized", "host token is unknown or revoked"));
    };
    let Ok(host_id) = Uuid::parse_str(&req.host_id) else {
        return Ok(refused("invalid_host_id", "host_id must be a UUID"));
    };
    if req.free_slots == 0 {
        return Ok(ClaimOffer::default());
    }
    // A credential for each attempt this claim may take (at most 64: the candidates' cap);
    // only their hashes are stored.
    let tokens: Vec<String> = (0..req.free_slots.min(64))
        .map(|_| agentscope_domain::new_token(agentscope_domain::TokenKind::Task))
        .collect();
    let hashes: Vec<String> = tokens
        .iter()
        .map(|t| agentscope_domain::hash_token(t))
        .collect();
    // The whole claim, in one statement and its transaction (migration 0006): the plan,
    // candidates locked with SKIP LOCKED, the counters of every limit locked in the trigger's
    // order, the exact check and the attempts' UPDATE. No workspace-wide lock.
    let r = sqlx::query!(
        r#"SELECT r_registered AS "registered!", r_pool_id AS pool_id, r_waiting AS waiting,
                  r_recorded_ends AS recorded_ends, r_lost_offers AS lost_offers, r_reason AS reason,
                  r_ids AS ids, r_task_ids AS task_ids, r_numbers AS numbers, r_specs AS specs,
                  r_tokens AS tokens, r_slots AS slots
           FROM claim_attempts($1, $2, $3, $4, $5, $6, $7, $8, $9)"#,
        host_id,
        workspace_id,
        req.free_slots.min(i32::MAX as u32) as i32,
        &req.held_attempts,
        &req.ended_attempts,
        &hashes,
        ctx.config.run_timeout_secs as i64,
        DEFAULT_TIMEOUT_SOURCE,
        in_flight_ms(ctx.config.lease_ttl_ms) as i64,
    )
    .fetch_one(&ctx.claim_db)
    .await?;
    if !r.registered {
        return Ok(refused("not_registered", "register before claiming"));
    }
    let recorded_ends = r.recorded_ends.unwrap_or_default();
    let Some(pool_id) = r.pool_id else {
        return Ok(ClaimOffer {
            recorded_ends,
            ..Default::default()
        });
    };
    let mut waiting = r.waiting.unwrap_or(0).max(0) as u32;
    let reason = r.reason.unwrap_or_default();
    // Attempts leased to this host whose claim reply never arrived: offered again, under the
    // same lease, instead of letting the lease lapse into a retry (nothing new this time; the
    // host asks again at once while work waits).
    let mut assignments = if r.lost_offers.unwrap_or(false) {
        let mut tx = ctx.claim_db.begin().await?;
        let again = reoffer(ctx, &mut tx, host_id, workspace_id, &req.held_attempts).await?;
        tx.commit().await?;
        again
    } else {
        Vec::new()
    };

    let ids = r.ids.unwrap_or_default();
    let task_ids = r.task_ids.unwrap_or_default();
    let numbers = r.numbers.unwrap_or_default();
    let specs = r.specs.unwrap_or_default();
    let lease_tokens = r.tokens.unwrap_or_default();
    let slots = r.slots.unwrap_or_default();
    // The claims are committed; their leases now (one round trip for all of them). A claim
    // whose lease cannot be created is put back in the queue.
    let host = host_id.to_string();
    let leases = futures::future::join_all(ids.iter().zip(&lease_tokens).map(|(id, token)| {
        let key = lease_key(&host, &id.to_string());
        let record = new_lease(&host, &id.to_string(), *token);
        async move {
            let res = ctx.leases.create(&key, record.encode_to_vec().into()).await;
            (key, res)
        }
    }))
    .await;
    let mut offered = Vec::new();
    let mut unleased = Vec::new();
    for (i, (key, res)) in leases.into_iter().enumerate() {
        let revision = match res {
            Ok(r) => r,
            Err(e) => {
                if let Some(more) = LEASE_WARNING.check() {
                    tracing::warn!(error = ?e, attempt_id = %ids[i], "lease cannot be created; the attempt goes back to the queue{more}");
                }
                unleased.push((ids[i], lease_tokens[i]));
                continue;
            }
        };
        let Some(task_token) = usize::try_from(slots[i] - 1)
            .ok()
            .and_then(|at| tokens.get(at))
        else {
            // Not possible (the statement takes at most as many as it got hashes); the lease
            // lapses and the sweeper retries the attempt.
            tracing::error!(attempt_id = %ids[i], "claimed without a credential");
            continue;
        };
        offered.push(AttemptAssignment {
            attempt_id: ids[i].to_string(),
            task_id: task_ids[i].to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: numbers[i] as u32,
            lease_key: key,
            lease_token: lease_tokens[i] as u64,
            lease_revision: revision,
            spec: Some(spec_from_json(&specs[i])),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token: task_token.clone(),
        });
    }
    if !unleased.is_empty() {
        requeue(ctx, &unleased).await;
        waiting += unleased.len() as u32;
    }
    note_waiting(pool_id, waiting);
    if offered.is_empty() && assignments.is_empty() {
        let reason = if reason.is_empty() { "limits" } else { &reason };
        if reason != "lost_offers" && reason != "no_pool" {
            ctx.metrics
                .inc("agentscope_claim_empty_total", &[("reason", reason)]);
        }
    }
    for a in &offered {
        ctx.metrics.inc("agentscope_attempts_claimed_total", &[]);
        tracing::info!(attempt_id = %a.attempt_id, task_id = %a.task_id, %host_id, lease_token = a.lease_token, "attempt claimed");
    }
    assignments.extend(offered);
    Ok(ClaimOffer {
        assignments,
        waiting,
        recorded_ends,
        ..Default::default()
    })
}

/// Puts claimed attempts whose lease could not be created back in the queue (nobody was offered
/// them). If this fails too, the sweeper finds them claimed without a lease once a lease TTL has
/// passed, and retries them.
async fn requeue(ctx: &Ctx, unleased: &[(Uuid, i64)]) {
    let (ids, tokens): (Vec<Uuid>, Vec<i64>) = unleased.iter().copied().unzip();
    let done = sqlx::query!(
        "UPDATE attempts a SET status = 'queued', host_id = NULL, lease_token = NULL,
                claimed_at = NULL, task_token_hash = NULL
         FROM unnest($1::uuid[], $2::bigint[]) AS x(id, token)
         WHERE a.id = x.id AND a.status = 'claimed' AND a.lease_token = x.token",
        &ids,
        &tokens,
    )
    .execute(&ctx.db)
    .await;
    if let Err(e) = done {
        tracing::warn!(error = ?e, "claims without a lease not put back; the sweeper retries them");
    }
}

fn note_waiting(pool_id: Uuid, waiting: u32) {
    crate::attempts::set_waiting(pool_id, waiting);
}

/// How long after its claim an offer may still be on its way: half the time a host waits for
/// a claim reply (`lease_ttl_ms / 3`, within 0.5–5 s), so that a reply lost for good is offered
/// again on the host's first claim after its wait, but an attempt the gateway offered the host a
/// moment ago (`dispatch.rs` in svc-gateway) neither counts as a lost offer (which would keep
/// the host's claim from taking anything new) nor is offered twice (with a second task token,
/// which would void the first) while that offer crosses the host's claim.
fn in_flight_ms(lease_ttl_ms: u64) -> u64 {
    (lease_ttl_ms / 3).clamp(500, 5_000) / 2
}

async fn reoffer(
    ctx: &Ctx,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    host_id: Uuid,
    workspace_id: Uuid,
    held: &[String],
) -> Result<Vec<AttemptAssignment>, Error> {
    let rows = sqlx::query!(
        "SELECT id, task_id, number, spec, lease_token FROM attempts
         WHERE host_id = $1 AND status = 'claimed' AND NOT (id::text = ANY($2))
           AND claimed_at < clock_timestamp() - make_interval(secs => $3::bigint / 1000.0)
         FOR UPDATE",
        host_id,
        // A slice of the request's ids: text[] (the check expects an owned Vec<String>).
        held as &[String],
        in_flight_ms(ctx.config.lease_ttl_ms) as i64,
    )
    .fetch_all(&mut **tx)
    .await?;
    let mut out = Vec::new();
    for r in rows {
        let id: Uuid = r.id;
        let token: Option<i64> = r.lease_token;
        // The host got the first offer if it reported anything; never run an attempt twice.
        if crate::last_published(ctx, host_id, id).await?.is_some() {
            continue;
        }
        let key = lease_key(&host_id.to_string(), &id.to_string());
        let revision = match ctx.leases.entry(&key).await {
            Ok(Some(entry)) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                let holder = LeaseRecord::decode(entry.value.as_ref())
                    .map(|l| l.host_id)
                    .unwrap_or_default();
                if holder != host_id.to_string() {
                    continue;
                }
                entry.revision
            }
            // Missing or removed: never created (the claim's scheduler died between its commit
            // and the lease, so nobody was offered the attempt), expired unrenewed, or removed
            // when an earlier claim of the attempt was put back. Either way this host, which
            // does not hold the attempt and published nothing for it, gets it again under the
            // claim's fencing token, with the lease that scheduler would have created.
            Ok(_) => {
                let Some(token) = token else { continue };
                let record = new_lease(&host_id.to_string(), &id.to_string(), token);
                match ctx.leases.create(&key, record.encode_to_vec().into()).await {
                    Ok(revision) => revision,
                    Err(_) => continue,
                }
            }
            Err(_) => continue,
        };
        tracing::warn!(attempt_id = %id, %host_id, "claim reply was lost; offering the attempt again");
        // Only its hash is stored, so the re-offer carries a fresh credential.
        let task_token = agentscope_domain::new_token(agentscope_domain::TokenKind::Task);
        sqlx::query!(
            "UPDATE attempts SET task_token_hash = $2 WHERE id = $1",
            id,
            agentscope_domain::hash_token(&task_token),
        )
        .execute(&mut **tx)
        .await?;
        let spec: serde_json::Value = r.spec;
        out.push(AttemptAssignment {
            attempt_id: id.to_string(),
            task_id: r.task_id.to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: r.number as u32,
            lease_key: key,
            lease_token: token.unwrap_or_default() as u64,
            lease_revision: revision,
            spec: Some(spec_from_json(&spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        });
    }
    Ok(out)
}
