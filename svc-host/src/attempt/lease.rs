//! The lease keeper of a running attempt.

use super::Assignment;
use crate::Ctx;
use agentscope_schemas::Message;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Keeps the lease alive (`agentscope_bus::lease`): a renewal applied while its reply was lost
/// is still ours, and a lease that cannot be renewed is given up before its TTL ends, so the
/// provider stops before any other host may start the same work. Fires `lost` when it ends.
pub async fn keep_lease(ctx: Ctx, a: Assignment, lost: CancellationToken, done: CancellationToken) {
    let ttl = Duration::from_millis(ctx.lease_ttl_ms());
    // The value never changes while the lease is held: equal value means "still ours". It is
    // the one its creator wrote, so that a lease whose revision the offer did not carry (created
    // while the offer travelled) is found ours on the first renewal.
    let record = agentscope_bus::dispatch::new_lease(
        &ctx.host_id.to_string(),
        &a.attempt_id,
        a.lease_token as i64,
    );
    let lease = agentscope_bus::lease::Lease::held(
        &ctx.leases,
        &a.lease_key,
        record.encode_to_vec().into(),
        a.lease_revision,
        ttl,
    );
    if let Some(why) = lease.keep(done).await {
        tracing::warn!(attempt_id = %a.attempt_id, reason = %why, "lease lost; stopping the provider");
        lost.cancel();
    }
}
