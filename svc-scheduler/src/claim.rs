//! Claims: a host asks for work; the scheduler leases it eligible queued Attempts within every
//! concurrency limit (host capacity, per agent, per pool, per workspace), atomically.

use crate::{Ctx, Error};
use agentscope_bus::{SCHEDULER_QUEUE, lease_key, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{AttemptAssignment, ClaimOffer, ClaimRequest, LeaseRecord, TaskSpec};
use futures::StreamExt;
use sqlx::Row;
use std::collections::HashMap;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// "lease exists … skipping" warnings: one line per interval.
static LEASE_SKIP_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(std::time::Duration::from_secs(5));

pub(crate) async fn serve(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let sub = ctx
        .nats
        .queue_subscribe(subjects::HOST_CLAIM_ALL, SCHEDULER_QUEUE.into())
        .await
        .map_err(Error::bus)?;
    // Claims run concurrently; those of one workspace serialize on its advisory lock.
    sub.take_until(cancel.cancelled_owned())
        .for_each_concurrent(16, |msg| {
            let ctx = ctx.clone();
            async move {
                let Some(reply) = msg.reply.clone() else {
                    return;
                };
                let offer = match ClaimRequest::decode(msg.payload.as_ref()) {
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
                let _ = ctx.nats.publish(reply, offer.encode_to_vec().into()).await;
            }
        })
        .await;
    Ok(())
}

fn refused(code: &str, message: &str) -> ClaimOffer {
    ClaimOffer {
        assignments: vec![],
        error_code: code.into(),
        message: message.into(),
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
    let host = sqlx::query(
        "SELECT pool_id, capacity, capabilities, providers FROM hosts WHERE id = $1 AND workspace_id = $2",
    )
    .bind(host_id)
    .bind(workspace_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(host) = host else {
        return Ok(refused("not_registered", "register before claiming"));
    };
    let Some(pool_id) = host.try_get::<Option<Uuid>, _>("pool_id")? else {
        return Ok(ClaimOffer::default());
    };
    let capacity: i32 = host.try_get("capacity")?;
    let capabilities: Vec<String> = host.try_get("capabilities")?;
    let providers: serde_json::Value = host.try_get("providers")?;
    let ready: Vec<String> = providers
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["installed"] == true && p["logged_in"] == true)
        .filter_map(|p| p["name"].as_str().map(str::to_string))
        .collect();

    // Claims in one workspace are serialized so that concurrent schedulers cannot both take
    // the last slot of a limit.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("claim:{workspace_id}"))
        .execute(&mut *tx)
        .await?;

    // Attempts leased to this host whose claim reply never arrived: offer them again, under
    // the same lease, instead of letting the lease lapse into a retry.
    let mut assignments = reoffer(ctx, &mut tx, host_id, workspace_id, &req.held_attempts).await?;

    let host_active: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts WHERE host_id = $1 AND status IN ('claimed','running')",
    )
    .bind(host_id)
    .fetch_one(&mut *tx)
    .await?;
    let mut slots =
        (capacity as i64 - host_active).min(req.free_slots as i64 - assignments.len() as i64);
    if slots <= 0 {
        tx.commit().await?;
        return Ok(ClaimOffer {
            assignments,
            ..Default::default()
        });
    }

    let rows = sqlx::query(
        r#"
        SELECT a.id, a.task_id, a.number, a.agent_id, a.spec, b.max_concurrency AS agent_limit
        FROM attempts a LEFT JOIN bindings b ON b.id = a.binding_id
        WHERE a.status = 'queued' AND a.workspace_id = $1 AND a.pool_id = $2
          AND a.not_before <= now() AND a.required_capabilities <@ $3 AND a.provider = ANY($4)
        ORDER BY a.not_before, a.created_at
        LIMIT 64
        FOR UPDATE OF a SKIP LOCKED
        "#,
    )
    .bind(workspace_id)
    .bind(pool_id)
    .bind(&capabilities)
    .bind(&ready)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(ClaimOffer {
            assignments,
            ..Default::default()
        });
    }
    let candidates = rows
        .iter()
        .map(|r| {
            Ok(Candidate {
                id: r.try_get("id")?,
                task_id: r.try_get("task_id")?,
                number: r.try_get("number")?,
                agent_id: r.try_get("agent_id")?,
                spec: r.try_get("spec")?,
                agent_limit: r.try_get("agent_limit")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;

    let (pool_limit, workspace_limit): (Option<i32>, Option<i32>) = sqlx::query_as(
        "SELECT p.max_concurrency, w.max_concurrency FROM pools p JOIN workspaces w ON w.id = p.workspace_id WHERE p.id = $1",
    )
    .bind(pool_id)
    .fetch_one(&mut *tx)
    .await?;
    let mut per_agent: HashMap<Uuid, i64> = sqlx::query_as::<_, (Uuid, i64)>(
        "SELECT agent_id, count(*) FROM attempts WHERE workspace_id = $1 AND status IN ('claimed','running') GROUP BY agent_id",
    )
    .bind(workspace_id)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    let mut in_pool: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts WHERE pool_id = $1 AND status IN ('claimed','running')",
    )
    .bind(pool_id)
    .fetch_one(&mut *tx)
    .await?;
    let mut in_workspace: i64 = per_agent.values().sum();

    let mut taken = Vec::new();
    for c in candidates {
        if slots == 0 {
            break;
        }
        let agent_n = per_agent.get(&c.agent_id).copied().unwrap_or(0);
        let over = |limit: Option<i32>, n: i64| limit.is_some_and(|l| n >= l as i64);
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

    // Lease first, then record: a lease whose row never commits just expires.
    let mut created_keys = Vec::new();
    for c in &taken {
        let key = lease_key(&host_id.to_string(), &c.id.to_string());
        let now = agentscope_bus::now_ms();
        let record = LeaseRecord {
            attempt_id: c.id.to_string(),
            host_id: host_id.to_string(),
            token: 0,
            acquired_at_ms: now,
            renewed_at_ms: now,
        };
        let revision = match ctx.leases.create(&key, record.encode_to_vec().into()).await {
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
        sqlx::query(
            "UPDATE attempts SET status = 'claimed', host_id = $2, lease_token = $3, claimed_at = clock_timestamp(),
                task_token_hash = $4 WHERE id = $1 AND status = 'queued'",
        )
        .bind(c.id)
        .bind(host_id)
        .bind(revision as i64)
        .bind(agentscope_domain::hash_token(&task_token))
        .execute(&mut *tx)
        .await?;
        assignments.push(AttemptAssignment {
            attempt_id: c.id.to_string(),
            task_id: c.task_id.to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: c.number as u32,
            lease_key: key,
            lease_token: revision,
            lease_revision: revision,
            spec: Some(spec_from_json(&c.spec)),
            traceparent: agentscope_bus::current_traceparent().unwrap_or_default(),
            task_token,
        });
    }
    if let Err(e) = tx.commit().await {
        for key in created_keys {
            let _ = ctx.leases.purge(&key).await;
        }
        return Err(e.into());
    }
    for a in &assignments {
        ctx.metrics.inc("agentscope_attempts_claimed_total", &[]);
        tracing::info!(attempt_id = %a.attempt_id, task_id = %a.task_id, %host_id, lease_token = a.lease_token, "attempt claimed");
    }
    Ok(ClaimOffer {
        assignments,
        ..Default::default()
    })
}

async fn reoffer(
    ctx: &Ctx,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    host_id: Uuid,
    workspace_id: Uuid,
    held: &[String],
) -> Result<Vec<AttemptAssignment>, Error> {
    let rows = sqlx::query(
        "SELECT id, task_id, number, spec, lease_token FROM attempts
         WHERE host_id = $1 AND status = 'claimed' AND NOT (id::text = ANY($2)) FOR UPDATE",
    )
    .bind(host_id)
    .bind(held)
    .fetch_all(&mut **tx)
    .await?;
    let mut out = Vec::new();
    for r in rows {
        let id: Uuid = r.try_get("id")?;
        let token: Option<i64> = r.try_get("lease_token")?;
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
        sqlx::query("UPDATE attempts SET task_token_hash = $2 WHERE id = $1")
            .bind(id)
            .bind(agentscope_domain::hash_token(&task_token))
            .execute(&mut **tx)
            .await?;
        let spec: serde_json::Value = r.try_get("spec")?;
        out.push(AttemptAssignment {
            attempt_id: id.to_string(),
            task_id: r.try_get::<Uuid, _>("task_id")?.to_string(),
            workspace_id: workspace_id.to_string(),
            attempt_number: r.try_get::<i32, _>("number")? as u32,
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
