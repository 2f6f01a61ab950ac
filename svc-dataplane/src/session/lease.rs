//! Who works on a session: one replica at a time, by a lease in KV (the same lease type as hosted
//! attempts) whose creation revision is the session's fencing token; the lease is kept while the
//! session runs and handed back when it ends or the replica stops.

use super::{Runner, Stop};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub fn lease_key(session_id: Uuid) -> String {
    format!("session.{session_id}")
}

impl Runner {
    /// A nudge for `session_id` (news of it: a new input, a decided approval): offered, and, for
    /// a session this replica works on, noted for its wait (see [`Runner::take_nudge`]). The
    /// sweep's offers are not nudges.
    pub fn nudge(self: &Arc<Self>, session_id: Uuid) {
        let active = self
            .active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&session_id);
        if active {
            self.nudged
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(session_id);
        }
        self.offer(session_id);
    }

    /// Whether `session_id` was nudged since it last asked.
    pub(super) fn take_nudge(&self, session_id: Uuid) -> bool {
        self.nudged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&session_id)
    }

    /// Works on `session_id` if no replica holds its lease; returns at once otherwise.
    pub fn offer(self: &Arc<Self>, session_id: Uuid) {
        self.news.notify_waiters();
        if self.stopping.is_cancelled() {
            return;
        }
        {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            if !active.insert(session_id) {
                return;
            }
        }
        let me = self.clone();
        self.sessions.spawn(async move {
            me.hold_and_run(session_id).await;
            me.active
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&session_id);
            me.take_nudge(session_id);
        });
    }

    async fn hold_and_run(self: &Arc<Self>, session_id: Uuid) {
        use agentscope_bus::lease::Lease;
        let key = lease_key(session_id);
        let ttl = Duration::from_millis(self.config.session_lease_ttl_ms);
        // The same lease type as hosted attempts: a renewal applied while its reply was lost is
        // still ours; one that cannot be renewed is given up before the TTL ends.
        let lease = match Lease::acquire(&self.leases, &key, self.replica.clone().into(), ttl).await
        {
            Ok(Some(lease)) => lease,
            Ok(None) => return, // another replica holds it
            Err(e) => {
                tracing::warn!(%session_id, error = %e, "session lease could not be created");
                return;
            }
        };
        let token = lease.revision();
        let lost = CancellationToken::new();
        let done = CancellationToken::new();
        let keeper = {
            let lease = lease.clone();
            let lost = lost.clone();
            let done = done.clone();
            tokio::spawn(async move {
                if let Some(why) = lease.keep(done).await {
                    tracing::warn!(%session_id, reason = %why, "session lease lost");
                    lost.cancel();
                }
            })
        };
        let result = tokio::select! {
            r = self.run(session_id, token as i64) => r,
            _ = lost.cancelled() => Err(Stop::Lost),
            // A tool call interrupted here is journaled `started`: the replica that takes over
            // reports it interrupted to the model and never runs it again.
            _ = self.stopping.cancelled() => Err(Stop::Shutdown),
        };
        match result {
            Ok(()) => {}
            Err(Stop::Shutdown) => {
                tracing::info!(%session_id, replica = %self.replica, "replica stopping; session handed back");
            }
            Err(Stop::Fenced) | Err(Stop::Lost) => {
                tracing::warn!(%session_id, replica = %self.replica, "session taken over; stopping");
            }
            Err(Stop::Db(e)) => tracing::error!(%session_id, error = %e, "session stopped"),
        }
        done.cancel();
        if let Err(e) = keeper.await {
            tracing::error!(%session_id, error = %e, "session lease keeper panicked");
        }
        if !lost.is_cancelled() {
            lease.release().await;
        }
    }
}
