//! Who this host is and that it is there: the per-attempt uids, provider discovery, registration
//! with the scheduler, the presence heartbeat and the re-check of providers whose login failed.

use crate::{Config, Ctx, isolation};
use agentscope_bus::{Topology, subjects};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{HostHeartbeat, HostRegistered, HostRegistration, ProviderDescriptor};
use anyhow::Context as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Per-attempt uids when the host runs as root and `run_as` is `auto`; otherwise providers run
/// as the host's own user, which is said once at start-up.
pub(crate) fn identities(
    config: &Config,
    host_id: Uuid,
) -> anyhow::Result<Option<Arc<isolation::Identities>>> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if config.run_as == "none" {
        tracing::warn!(
            root,
            "run_as = none: providers run as the host's own user, with access to everything it can reach; tasks are not isolated from each other"
        );
        return Ok(None);
    }
    if !root {
        tracing::warn!(
            "the host does not run as root and cannot switch uid: providers run as the host's own user; tasks on this host are not isolated from each other"
        );
        return Ok(None);
    }
    let range = isolation::UidRange::parse(&config.run_as_uids).map_err(anyhow::Error::msg)?;
    let ids = isolation::Identities::open(
        range,
        std::path::Path::new(&config.run_as_lock_dir),
        host_id.as_u128() as u32,
    )
    .context("open the uid locks")?;
    tracing::info!(
        first = range.first,
        last = range.last,
        "each attempt runs under its own uid"
    );
    Ok(Some(Arc::new(ids)))
}

/// Provider discovery: each adapter probes its CLI (installed, version, credentials).
pub(crate) async fn discover(ctx: &Ctx) {
    let adapters = ctx.adapters.clone();
    let found = tokio::task::spawn_blocking(move || {
        adapters
            .iter()
            .map(|a| a.discover())
            .collect::<Vec<ProviderDescriptor>>()
    })
    .await
    .unwrap_or_default();
    for p in &found {
        tracing::info!(provider = %p.name, installed = p.installed, logged_in = p.logged_in, version = %p.version, detail = %p.detail, "provider discovered");
    }
    ctx.state.lock().expect("host state").providers = found;
}

fn registration(ctx: &Ctx) -> HostRegistration {
    let st = ctx.state.lock().expect("host state");
    let name = if ctx.config.name.is_empty() {
        std::fs::read_to_string("/etc/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "host".into())
    } else {
        ctx.config.name.clone()
    };
    HostRegistration {
        host_id: ctx.host_id.to_string(),
        host_token: ctx.config.host_token.clone(),
        name,
        pool: ctx.config.pool.clone(),
        providers: st.providers.clone(),
        capacity: ctx.config.capacity,
        capabilities: ctx.config.capability_list(),
        version: env!("CARGO_PKG_VERSION").into(),
        checks: vec![],
    }
}

/// Registers until the scheduler answers; a refusal (bad token, id conflict) is fatal.
pub(crate) async fn register(
    ctx: &Ctx,
    cancel: &CancellationToken,
) -> anyhow::Result<HostRegistered> {
    let mut delay = Duration::from_millis(200);
    loop {
        let mut reg = registration(ctx);
        reg.checks = ctx.checks();
        let res = tokio::time::timeout(
            Duration::from_secs(5),
            ctx.nats.request(
                subjects::host_register(&ctx.host_id.to_string()),
                reg.encode_to_vec().into(),
            ),
        )
        .await;
        match res {
            Ok(Ok(msg)) => {
                let r = HostRegistered::decode(msg.payload.as_ref())
                    .context("decode registration reply")?;
                if !r.ok {
                    anyhow::bail!("registration refused: {} ({})", r.message, r.error_code);
                }
                ctx.lease_ttl_ms
                    .store(r.lease_ttl_ms.max(1000), Ordering::Relaxed);
                tracing::info!(host_id = %ctx.host_id, workspace_id = %r.workspace_id, pool_id = %r.pool_id, "registered");
                ctx.state.lock().expect("host state").registered = Some(r.clone());
                return Ok(r);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "registration: no scheduler answered; retrying")
            }
            Err(_) => tracing::warn!("registration timed out; retrying"),
        }
        tokio::select! {
            _ = cancel.cancelled() => anyhow::bail!("stopped before registration"),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

pub(crate) async fn heartbeat(
    ctx: Ctx,
    slots: Arc<Semaphore>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let presence = Topology::open_bucket(&ctx.js, agentscope_bus::BUCKET_PRESENCE).await?;
    let key = agentscope_bus::presence_key(&ctx.host_id.to_string());
    let every = Duration::from_millis(1000);
    loop {
        let providers = ctx.state.lock().expect("host state").providers.clone();
        let hb = HostHeartbeat {
            host_id: ctx.host_id.to_string(),
            running: ctx.config.capacity - slots.available_permits() as u32,
            capacity: ctx.config.capacity,
            checks: ctx.checks(),
            sent_at_ms: agentscope_bus::now_ms(),
            providers,
        };
        if let Err(e) = presence.put(&key, hb.encode_to_vec().into()).await {
            tracing::warn!(error = %e, "heartbeat");
        }
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = presence.purge(&key).await;
                return Ok(());
            }
            _ = tokio::time::sleep(every) => {}
            _ = ctx.beat.notified() => {}
        }
    }
}

/// Re-checks providers whose login failed, each `provider_recheck_ms` after its failure (or its
/// last re-check): discovery again (installed, version, credentials present). One that passes is
/// ready again; the next heartbeat says so.
pub(crate) async fn recheck(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    let every = Duration::from_millis(ctx.config.provider_recheck_ms);
    let tick = every.min(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(tick) => {}
        }
        let due: Vec<String> = {
            let st = ctx.state.lock().expect("host state");
            st.login_failed
                .iter()
                .filter(|(_, at)| at.elapsed() >= every)
                .map(|(n, _)| n.clone())
                .collect()
        };
        for name in due {
            let adapters = ctx.adapters.clone();
            let wanted = name.clone();
            let found = tokio::task::spawn_blocking(move || {
                adapters
                    .iter()
                    .find(|a| a.name() == wanted)
                    .map(|a| a.discover())
            })
            .await
            .ok()
            .flatten();
            let Some(d) = found else { continue };
            let mut st = ctx.state.lock().expect("host state");
            if d.installed && d.logged_in {
                tracing::info!(provider = %name, "provider re-check passed; ready again");
                st.login_failed.remove(&name);
                if let Some(p) = st.providers.iter_mut().find(|p| p.name == name) {
                    *p = d;
                }
                drop(st);
                ctx.beat.notify_one();
            } else {
                tracing::warn!(provider = %name, detail = %d.detail, "provider re-check failed");
                st.login_failed
                    .insert(name.clone(), std::time::Instant::now());
                if let Some(p) = st.providers.iter_mut().find(|p| p.name == name) {
                    *p = d;
                }
            }
        }
    }
}
