//! Host registration (request/reply) and presence (KV watch).

use crate::{Ctx, Error};
use agentscope_bus::{Endpoint, Request, SCHEDULER_QUEUE, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{HostHeartbeat, HostRegistered, HostRegistration};
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long a verified host token is trusted without asking the database again: a revoked
/// token stops working for claims within this time (new connections are refused at once by the
/// auth callout, which does not use this cache).
const TOKEN_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// The workspace a host token belongs to, if the token is valid. Valid answers are cached per
/// token hash for [`TOKEN_CACHE_TTL`]; refusals are not cached.
pub(crate) async fn verify_host_token(ctx: &Ctx, token: &str) -> Result<Option<Uuid>, Error> {
    static CACHE: std::sync::LazyLock<agentscope_domain::TrustCache<Uuid>> =
        std::sync::LazyLock::new(|| agentscope_domain::TrustCache::new(TOKEN_CACHE_TTL));
    if !token.starts_with("agh_") {
        return Ok(None);
    }
    let hash = agentscope_domain::hash_token(token);
    if let Some(ws) = CACHE.get(&hash) {
        return Ok(Some(ws));
    }
    let ws = sqlx::query_scalar!(
        "SELECT workspace_id FROM api_tokens WHERE token_hash = $1 AND kind = 'host' AND revoked_at IS NULL",
        &hash,
    )
    .fetch_optional(&ctx.db)
    .await?;
    CACHE.set(hash, ws);
    Ok(ws)
}

/// Answers host registrations, one at a time.
pub(crate) async fn serve_register(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let at = Endpoint {
        subject: subjects::HOST_REGISTER_ALL,
        queue_group: SCHEDULER_QUEUE,
        concurrency: 1,
    };
    agentscope_bus::serve(&ctx.nats, at, cancel, |msg: Request<HostRegistration>| {
        let ctx = ctx.clone();
        async move {
            match msg.body {
                Ok(reg) if subjects::token(&msg.subject, 2) != Some(reg.host_id.as_str()) => {
                    refused(
                        "forbidden",
                        "host_id does not match the registration subject",
                    )
                }
                Ok(reg) => register(&ctx, reg).await.unwrap_or_else(|e| {
                    tracing::error!(error = ?e, "host registration failed");
                    refused("internal", "registration failed; retry")
                }),
                Err(_) => refused("malformed", "HostRegistration payload does not decode"),
            }
        }
    })
    .await
    .map_err(Error::bus)?;
    Ok(())
}

fn refused(code: &str, message: &str) -> HostRegistered {
    HostRegistered {
        ok: false,
        error_code: code.into(),
        message: message.into(),
        ..Default::default()
    }
}

async fn register(ctx: &Ctx, reg: HostRegistration) -> Result<HostRegistered, Error> {
    let Some(workspace_id) = verify_host_token(ctx, &reg.host_token).await? else {
        return Ok(refused("unauthorized", "host token is unknown or revoked"));
    };
    let Ok(host_id) = Uuid::parse_str(&reg.host_id) else {
        return Ok(refused("invalid_host_id", "host_id must be a UUID"));
    };
    let pool_id = sqlx::query_scalar!(
        "SELECT id FROM pools WHERE workspace_id = $1 AND name = $2",
        workspace_id,
        &reg.pool,
    )
    .fetch_optional(&ctx.db)
    .await?;
    let providers = providers_json(&reg.providers);
    let checks = checks_json(&reg.checks);
    // A host id belongs to the workspace that first registered it; another token cannot take it.
    let row = sqlx::query_scalar!(
        r#"
        INSERT INTO hosts (id, workspace_id, pool_id, pool_name, name, capacity, providers,
            capabilities, checks, version, last_seen_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now())
        ON CONFLICT (id) DO UPDATE SET pool_id = EXCLUDED.pool_id, pool_name = EXCLUDED.pool_name,
            name = EXCLUDED.name, capacity = EXCLUDED.capacity, providers = EXCLUDED.providers,
            capabilities = EXCLUDED.capabilities, checks = EXCLUDED.checks,
            version = EXCLUDED.version, last_seen_at = now(), registered_at = now()
        WHERE hosts.workspace_id = EXCLUDED.workspace_id
        RETURNING id
        "#,
        host_id,
        workspace_id,
        pool_id,
        &reg.pool,
        &reg.name,
        reg.capacity as i32,
        providers,
        &reg.capabilities,
        checks,
        &reg.version,
    )
    .fetch_optional(&ctx.db)
    .await?;
    if row.is_none() {
        return Ok(refused(
            "host_id_conflict",
            "this host id is registered in another workspace",
        ));
    }
    ctx.metrics.inc("agentscope_host_registrations_total", &[]);
    tracing::info!(%host_id, %workspace_id, pool = %reg.pool, capacity = reg.capacity, "host registered");
    Ok(HostRegistered {
        ok: true,
        workspace_id: workspace_id.to_string(),
        pool_id: pool_id.map(|p| p.to_string()).unwrap_or_default(),
        lease_ttl_ms: ctx.config.lease_ttl_ms,
        heartbeat_ttl_ms: ctx.config.heartbeat_ttl_ms,
        ..Default::default()
    })
}

fn providers_json(p: &[agentscope_schemas::v1::ProviderDescriptor]) -> serde_json::Value {
    json!(
        p.iter()
            .map(|d| json!({
                "name": d.name, "installed": d.installed, "version": d.version,
                "logged_in": d.logged_in, "detail": d.detail,
                "live_stream": d.live_stream, "resume": d.resume,
            }))
            .collect::<Vec<_>>()
    )
}

fn checks_json(c: &[agentscope_schemas::v1::HostCheck]) -> serde_json::Value {
    json!(c
        .iter()
        .map(|c| json!({"name": c.name, "ok": c.ok, "detail": c.detail, "checked_at_ms": c.checked_at_ms}))
        .collect::<Vec<_>>())
}

/// Mirrors host heartbeats from the presence bucket into `hosts` (last_seen_at, checks, load).
pub(crate) async fn watch_presence(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let js = &ctx.js;
    let presence =
        agentscope_bus::Topology::open_bucket(js, agentscope_bus::BUCKET_PRESENCE).await?;
    let mut watch = presence.watch_all().await.map_err(Error::bus)?;
    loop {
        let entry = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            e = watch.next() => match e {
                Some(Ok(e)) => e,
                Some(Err(e)) => { tracing::warn!(error = ?e, "presence watch"); continue }
                // Only the stop ends it; the supervisor starts it again.
                None => anyhow::bail!("the presence watch ended"),
            },
        };
        if entry.operation != async_nats::jetstream::kv::Operation::Put {
            continue;
        }
        let Ok(hb) = HostHeartbeat::decode(entry.value.as_ref()) else {
            tracing::warn!(key = %entry.key, "malformed heartbeat ignored");
            continue;
        };
        let Ok(host_id) = Uuid::parse_str(&hb.host_id) else {
            continue;
        };
        let res = sqlx::query!(
            "UPDATE hosts SET last_seen_at = now(), running = $2, checks = $3, providers = $4 WHERE id = $1",
            host_id,
            hb.running as i32,
            checks_json(&hb.checks),
            providers_json(&hb.providers),
        )
        .execute(&ctx.db)
        .await;
        if let Err(e) = res {
            tracing::warn!(error = ?e, %host_id, "record heartbeat");
        }
    }
}
