//! Claims: a host asks for work; the scheduler leases it eligible queued Attempts within every
//! concurrency limit (host capacity, per agent, per pool, per workspace), atomically.
//!
//! No workspace-wide lock: candidates are taken with `FOR UPDATE SKIP LOCKED`, and each limit
//! is a row of `attempt_counts` (kept by a trigger on `attempts`, in the same transaction as
//! every status change, whoever makes it) that the claim locks and reads before it decides.
//! One claim takes as many attempts as the host has free slots, and its reply says how many
//! more are waiting.

use crate::{Ctx, Error};
use agentscope_bus::{Endpoint, Request, SCHEDULER_QUEUE, lease_key, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{AttemptAssignment, ClaimOffer, ClaimRequest, LeaseRecord, TaskSpec};
use agentscope_store::first_attempt::{DEFAULT_TIMEOUT_SOURCE, fill_default_timeout};
use std::collections::HashMap;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// "lease exists … skipping" warnings: one line per interval.
static LEASE_SKIP_WARNING: agentscope_telemetry::Throttle =
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

struct Candidate {
    id: Uuid,
    task_id: Uuid,
    number: i32,
    agent_id: Uuid,
    spec: serde_json::Value,
    agent_limit: Option<i32>,
}

/// Locks the counters of the given scopes, in the order given (workspace, pool, agents by id,
/// host: the order the attempts trigger uses), creating missing ones at zero, and returns their
/// values. The row locks make the check-then-claim exact across concurrent claims and
/// schedulers: whoever changes one of these counters waits for this transaction.
async fn lock_counters(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    keys: &[(&'static str, Uuid)],
) -> Result<HashMap<(String, Uuid), i64>, Error> {
    let scopes: Vec<&str> = keys.iter().map(|k| k.0).collect();
    let ids: Vec<Uuid> = keys.iter().map(|k| k.1).collect();
    let rows = sqlx::query!(
        "INSERT INTO attempt_counts (scope, id, active)
         SELECT s, i, 0 FROM unnest($1::text[], $2::uuid[]) WITH ORDINALITY AS k(s, i, n) ORDER BY n
         ON CONFLICT (scope, id) DO UPDATE SET active = attempt_counts.active
         RETURNING scope, id, active",
        // The scopes are static names; text[] takes them as &str (the check expects String).
        &scopes as &[&str],
        &ids,
    )
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ((r.scope, r.id), r.active as i64))
        .collect())
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
    let mut tx = ctx.db.begin().await?;
    // The host's row, its pool's and workspace's limits, its active count and how many of those
    // the host says already ended (unlocked: a first look), whether attempts claimed for it are
    // missing from what it holds (a lost claim reply), and how many queued attempts it could run
    // now (up to 100).
    let Some(plan) = sqlx::query!(
        r#"
    WITH h AS (
        SELECT h.id, h.workspace_id, h.pool_id, h.capacity, h.capabilities,
               p.max_concurrency AS pool_limit, w.max_concurrency AS workspace_limit,
               ARRAY(SELECT e->>'name' FROM jsonb_array_elements(h.providers) e
                     WHERE e->'installed' = 'true'::jsonb AND e->'logged_in' = 'true'::jsonb) AS ready
        FROM hosts h JOIN workspaces w ON w.id = h.workspace_id LEFT JOIN pools p ON p.id = h.pool_id
        WHERE h.id = $1 AND h.workspace_id = $2
    )
    SELECT h.pool_id, h.capacity, h.capabilities, h.pool_limit, h.workspace_limit, h.ready,
           COALESCE((SELECT c.active FROM attempt_counts c WHERE c.scope = 'host' AND c.id = h.id), 0)::bigint
               AS host_active,
           ARRAY(SELECT a.id::text FROM attempts a WHERE a.host_id = h.id
                   AND a.status IN ('claimed', 'running') AND a.id::text = ANY($4)) AS ended_active,
           EXISTS (SELECT 1 FROM attempts a WHERE a.host_id = h.id AND a.status = 'claimed'
                   AND NOT (a.id::text = ANY($3))) AS lost_offers,
           (SELECT count(*) FROM (
                SELECT 1 FROM attempts a
                WHERE a.status = 'queued' AND a.workspace_id = h.workspace_id AND a.pool_id = h.pool_id
                  AND a.not_before <= now() AND a.required_capabilities <@ h.capabilities
                  AND a.provider = ANY(h.ready)
                LIMIT 100) q) AS waiting
    FROM h
"#,
        host_id,
        workspace_id,
        &req.held_attempts,
        &req.ended_attempts,
    )
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(refused("not_registered", "register before claiming"));
    };
    let Some(pool_id) = plan.pool_id else {
        return Ok(ClaimOffer::default());
    };
    let capacity = plan.capacity as i64;
    let capabilities: Vec<String> = plan.capabilities;
    let pool_limit: Option<i32> = plan.pool_limit;
    let workspace_limit: Option<i32> = plan.workspace_limit;
    // Computed columns that are never NULL (ARRAY(...), count(*), EXISTS, COALESCE), though
    // Postgres reports them nullable; the statement's text stays as it is, so no `!` override.
    let ready: Vec<String> = plan.ready.unwrap_or_default();
    let waiting_before: i64 = plan.waiting.unwrap_or(0);
    let lost_offers: bool = plan.lost_offers.unwrap_or(false);
    let host_active: i64 = plan.host_active.unwrap_or(0);

    // Attempts leased to this host whose claim reply never arrived: offer them again, under
    // the same lease, instead of letting the lease lapse into a retry.
    let mut assignments = if lost_offers {
        reoffer(ctx, &mut tx, host_id, workspace_id, &req.held_attempts).await?
    } else {
        Vec::new()
    };
    // The host's capacity counts what runs there: not the attempts it says ended whose ends
    // are not recorded yet (its free slots already say so).
    let unrecorded: Vec<String> = plan.ended_active.unwrap_or_default();
    let ended_first_look = unrecorded.len() as i64;
    // The others' ends are recorded (an ended attempt never becomes active again): the host
    // stops listing them, so its requests stay as small as what it actually holds.
    let recorded_ends: Vec<String> = {
        let mut ids: Vec<String> = req
            .ended_attempts
            .iter()
            .filter(|id| !unrecorded.contains(id))
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        ids
    };
    let host_active = host_active - ended_first_look;
    let want = (req.free_slots as i64 - assignments.len() as i64).min(capacity - host_active);
    if want <= 0 || waiting_before == 0 {
        tx.commit().await?;
        if assignments.is_empty() {
            let reason = if waiting_before == 0 {
                "no_work"
            } else {
                "host_full"
            };
            ctx.metrics
                .inc("agentscope_claim_empty_total", &[("reason", reason)]);
        }
        let waiting = waiting_before as u32;
        note_waiting(pool_id, waiting);
        return Ok(ClaimOffer {
            assignments,
            waiting,
            recorded_ends,
            ..Default::default()
        });
    }

    // Candidates, locked: concurrent claims skip them and take the next ones. A few more than
    // wanted, for those an agent limit turns down.
    let candidates = sqlx::query_as!(
        Candidate,
        r#"
        SELECT a.id, a.task_id, a.number, a.agent_id, a.spec, b.max_concurrency AS agent_limit
        FROM attempts a LEFT JOIN bindings b ON b.id = a.binding_id
        WHERE a.status = 'queued' AND a.workspace_id = $1 AND a.pool_id = $2
          AND a.not_before <= now() AND a.required_capabilities <@ $3 AND a.provider = ANY($4)
        ORDER BY a.not_before, a.created_at
        LIMIT $5
        FOR UPDATE OF a SKIP LOCKED
        "#,
        workspace_id,
        pool_id,
        &capabilities,
        &ready,
        (want + 8).min(64),
    )
    .fetch_all(&mut *tx)
    .await?;
    if candidates.is_empty() {
        tx.commit().await?;
        note_waiting(pool_id, 0);
        if assignments.is_empty() {
            ctx.metrics
                .inc("agentscope_claim_empty_total", &[("reason", "no_work")]);
        }
        return Ok(ClaimOffer {
            assignments,
            recorded_ends,
            ..Default::default()
        });
    }

    // The counters of every limit that applies, locked in the trigger's order.
    let mut keys: Vec<(&'static str, Uuid)> = Vec::new();
    if workspace_limit.is_some() {
        keys.push(("workspace", workspace_id));
    }
    if pool_limit.is_some() {
        keys.push(("pool", pool_id));
    }
    let mut limited_agents: Vec<Uuid> = candidates
        .iter()
        .filter(|c| c.agent_limit.is_some())
        .map(|c| c.agent_id)
        .collect();
    limited_agents.sort();
    limited_agents.dedup();
    keys.extend(limited_agents.iter().map(|a| ("agent", *a)));
    keys.push(("host", host_id));
    let counts = lock_counters(&mut tx, &keys).await?;
    let count = |scope: &str, id: Uuid| -> i64 {
        counts.get(&(scope.to_string(), id)).copied().unwrap_or(0)
    };
    // Exact now that the host's counter is locked: an end the recorder committed before the
    // lock is out of both the counter and this count; one it is committing waits on the lock
    // and is still in both. An ended attempt never becomes active again, so when the first look
    // found none there is none now.
    let ended_active = if ended_first_look == 0 {
        0
    } else {
        sqlx::query_scalar!(
            r#"SELECT count(*) AS "n!" FROM attempts a WHERE a.host_id = $1
               AND a.status IN ('claimed', 'running') AND a.id::text = ANY($2)"#,
            host_id,
            &req.ended_attempts,
        )
        .fetch_one(&mut *tx)
        .await?
    };
    let mut slots = want.min(capacity - (count("host", host_id) - ended_active));
    let mut in_workspace = count("workspace", workspace_id);
    let mut in_pool = count("pool", pool_id);
    let mut per_agent: HashMap<Uuid, i64> = limited_agents
        .iter()
        .map(|a| (*a, count("agent", *a)))
        .collect();

    let over = |limit: Option<i32>, n: i64| limit.is_some_and(|l| n >= l as i64);
    let mut taken = Vec::new();
    for c in candidates {
        if slots <= 0 {
            break;
        }
        let agent_n = per_agent.get(&c.agent_id).copied().unwrap_or(0);
        if over(c.agent_limit, agent_n)
            || over(pool_limit, in_pool)
            || over(workspace_limit, in_workspace)
        {
            continue;
        }
        *per_agent.entry(c.agent_id).or_default() += 1;
        in_pool += 1;
        in_workspace += 1;
        slots -= 1;
        taken.push(c);
    }

    // Lease first, then record: a lease whose row never commits just expires. The leases of
    // one claim are created concurrently (one round trip, not one per attempt).
    let host = host_id.to_string();
    let leases = futures::future::join_all(taken.iter().map(|c| {
        let key = lease_key(&host, &c.id.to_string());
        let now = agentscope_bus::now_ms();
        let record = LeaseRecord {
            attempt_id: c.id.to_string(),
            host_id: host.clone(),
            token: 0,
            acquired_at_ms: now,
            renewed_at_ms: now,
        };
        async move {
            let res = ctx.leases.create(&key, record.encode_to_vec().into()).await;
            (key, res)
        }
    }))
    .await;
    let mut created_keys = Vec::new();
    let (mut ids, mut revisions, mut hashes) = (Vec::new(), Vec::new(), Vec::new());
    let mut offered = Vec::new();
    for (c, (key, res)) in taken.iter().zip(leases) {
        let revision = match res {
            Ok(r) => r,
            Err(e) => {
                // After a scheduler restart, many leases of the old one still exist: one line
                // per interval.
                if let Some(more) = LEASE_SKIP_WARNING.check() {
                    tracing::warn!(error = ?e, attempt_id = %c.id, "lease exists or cannot be created; skipping{more}");
                }
                continue;
            }
        };
        created_keys.push(key.clone());
        let task_token = agentscope_domain::new_token(agentscope_domain::TokenKind::Task);
        ids.push(c.id);
        revisions.push(revision as i64);
        hashes.push(agentscope_domain::hash_token(&task_token));
        // The deployment's run timeout, for a spec that sets none (the UPDATE below stores it).
        let mut spec = c.spec.clone();
        fill_default_timeout(&mut spec, ctx.config.run_timeout_secs);
        offered.push(AttemptAssignment {
            attempt_id: c.id.to_string(),
            task_id: c.task_id.to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: c.number as u32,
            lease_key: key,
            lease_token: revision,
            lease_revision: revision,
            spec: Some(spec_from_json(&spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        });
    }
    let recorded = async {
        if !ids.is_empty() {
            // One statement for the whole batch; the trigger on `attempts` moves the counters
            // locked above. A spec without a run timeout of its own gets the deployment's
            // (as `fill_default_timeout` did to the offer).
            sqlx::query!(
                r#"UPDATE attempts a SET status = 'claimed', host_id = $2, lease_token = x.token,
                     claimed_at = clock_timestamp(), task_token_hash = x.hash,
                     spec = CASE WHEN jsonb_typeof(a.spec->'timeout_secs') = 'number'
                                      AND a.spec->'timeout_secs' > '0'::jsonb THEN a.spec
                                 ELSE a.spec || jsonb_build_object('timeout_secs', $5::bigint,
                                                                   'timeout_source', $6::text) END
                 FROM unnest($1::uuid[], $3::bigint[], $4::text[]) AS x(id, token, hash)
                 WHERE a.id = x.id AND a.status = 'queued'"#,
                &ids,
                host_id,
                &revisions,
                &hashes,
                ctx.config.run_timeout_secs as i64,
                DEFAULT_TIMEOUT_SOURCE,
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }
    .await;
    if let Err(e) = recorded {
        for key in created_keys {
            let _ = ctx.leases.purge(&key).await;
        }
        return Err(e.into());
    }
    let waiting = (waiting_before - offered.len() as i64).max(0) as u32;
    note_waiting(pool_id, waiting);
    if offered.is_empty() && assignments.is_empty() {
        ctx.metrics
            .inc("agentscope_claim_empty_total", &[("reason", "limits")]);
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

fn note_waiting(pool_id: Uuid, waiting: u32) {
    crate::attempts::set_waiting(pool_id, waiting);
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
         WHERE host_id = $1 AND status = 'claimed' AND NOT (id::text = ANY($2)) FOR UPDATE",
        host_id,
        // A slice of the request's ids: text[] (the check expects an owned Vec<String>).
        held as &[String],
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
        let Ok(Some(entry)) = ctx.leases.entry(&key).await else {
            continue;
        };
        if entry.operation != async_nats::jetstream::kv::Operation::Put {
            continue;
        }
        let holder = LeaseRecord::decode(entry.value.as_ref())
            .map(|l| l.host_id)
            .unwrap_or_default();
        if holder != host_id.to_string() {
            continue;
        }
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
            lease_revision: entry.revision,
            spec: Some(spec_from_json(&spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        });
    }
    Ok(out)
}

fn spec_from_json(v: &serde_json::Value) -> TaskSpec {
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    TaskSpec {
        provider: s("provider"),
        repository: s("repository"),
        branch: s("branch"),
        input: s("input"),
        instructions: s("instructions"),
        params: v["params"]
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default(),
        issue_title: s("issue_title"),
        issue_body: s("issue_body"),
        command: v["command"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| {
                        x.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| x.to_string())
                    })
                    .collect()
            })
            .unwrap_or_default(),
        agent_id: s("agent_id"),
        agent_version_id: s("agent_version_id"),
        timeout_secs: v["timeout_secs"].as_u64().unwrap_or(0) as u32,
        issue_id: s("issue_id"),
        resume_session_id: s("resume_session_id"),
        resume_from_attempt_id: s("resume_from_attempt_id"),
        timeout_source: s("timeout_source"),
    }
}
