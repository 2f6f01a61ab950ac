//! One lease type for everything that holds work under a KV lease: hosted attempts (the scheduler
//! creates the key, the host keeps it) and managed sessions (the dataplane replica creates and
//! keeps it).
//!
//! A lease is a KV key whose creation revision is the fencing token; its value names the holder
//! and never changes while it is held. The holder renews it by compare-and-set on the last
//! revision it saw. Two rules make a lease survive what a network does to it:
//!
//! - **A renewal whose answer was lost is still ours.** NATS may apply a renewal whose reply never
//!   arrived (a timeout across a reconnect); the next compare-and-set then fails on the revision.
//!   On such a conflict the keeper reads the key: if it still holds the holder's own value, the
//!   keeper adopts the new revision and goes on. Only another value, a delete or a purge means
//!   the lease is gone.
//! - **A holder that cannot renew stops before anyone else can start.** The keeper declares the
//!   lease lost once no renewal succeeded for `renew_deadline` (shorter than the TTL by a margin
//!   for stopping the work), so the work stops while the key still exists and no other host or
//!   replica can take it.

use async_nats::jetstream::kv;
use bytes::Bytes;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a lease ended for its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lost {
    /// The key is gone or holds another holder's value: someone else may run the work.
    Taken,
    /// No renewal succeeded for the renew deadline (NATS unreachable): stop before the TTL ends.
    Unrenewable(String),
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lost::Taken => write!(f, "the lease expired or was taken"),
            Lost::Unrenewable(e) => write!(f, "no renewal succeeded before the deadline ({e})"),
        }
    }
}

/// A held lease: the key, the holder's value and the last revision seen.
#[derive(Clone)]
pub struct Lease {
    store: kv::Store,
    key: String,
    value: Bytes,
    revision: u64,
    ttl: Duration,
}

impl Lease {
    /// Creates the key (nobody holds it yet). Returns None when another holder has it.
    pub async fn acquire(
        store: &kv::Store,
        key: &str,
        value: Bytes,
        ttl: Duration,
    ) -> Result<Option<Lease>, kv::CreateError> {
        match store.create(key, value.clone()).await {
            Ok(revision) => Ok(Some(Lease {
                store: store.clone(),
                key: key.to_string(),
                value,
                revision,
                ttl,
            })),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A lease created elsewhere (the scheduler creates attempt leases for hosts) at `revision`,
    /// whose key holds `value`.
    pub fn held(store: &kv::Store, key: &str, value: Bytes, revision: u64, ttl: Duration) -> Lease {
        Lease {
            store: store.clone(),
            key: key.to_string(),
            value,
            revision,
            ttl,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token when the lease was created by this holder (its creation revision).
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// How long to go without a successful renewal before giving the lease up: the TTL less a
    /// margin to stop the work (a fifth of the TTL, at least 500 ms).
    pub fn renew_deadline(&self) -> Duration {
        let margin = (self.ttl / 5).max(Duration::from_millis(500));
        self.ttl.saturating_sub(margin)
    }

    /// How often to renew: often enough for several tries within the deadline.
    pub fn renew_every(&self) -> Duration {
        (self.ttl / 5).max(Duration::from_millis(100))
    }

    /// One renewal. `Ok(())` when the key holds our value at a new revision, `Err(Some(Taken))`
    /// when it is someone else's or gone, `Err(None)` with the error when the bus did not answer.
    pub async fn renew(&mut self) -> Result<(), Result<Lost, String>> {
        match self
            .store
            .update(&self.key, self.value.clone(), self.revision)
            .await
        {
            Ok(rev) => {
                self.revision = rev;
                Ok(())
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // Perhaps our own renewal, applied while its reply was lost: read the key.
                match self.store.entry(&self.key).await {
                    Ok(Some(entry))
                        if entry.operation == kv::Operation::Put && entry.value == self.value =>
                    {
                        self.revision = entry.revision;
                        Ok(())
                    }
                    Ok(_) => Err(Ok(Lost::Taken)),
                    Err(e) => Err(Err(e.to_string())),
                }
            }
            Err(e) => Err(Err(e.to_string())),
        }
    }

    /// Renews until `done` fires (returns None) or the lease is lost (returns why). A holder
    /// stops its work as soon as this returns `Some`.
    pub async fn keep(mut self, done: CancellationToken) -> Option<Lost> {
        let deadline = self.renew_deadline();
        let mut last_ok = tokio::time::Instant::now();
        let mut last_error = String::new();
        let mut failures = 0u32;
        loop {
            // After a failure, try again sooner: the bus may be back.
            let wait = if failures == 0 {
                self.renew_every()
            } else {
                (self.renew_every() / 8).max(Duration::from_millis(50))
            };
            let until_deadline = deadline.saturating_sub(last_ok.elapsed());
            tokio::select! {
                _ = done.cancelled() => return None,
                _ = tokio::time::sleep(wait.min(until_deadline)) => {}
            }
            if last_ok.elapsed() >= deadline {
                return Some(Lost::Unrenewable(last_error));
            }
            // One try is short: a request lost across a reconnect must not hold the next try
            // back until the deadline (the client's own request timeout is seconds). Nor may a
            // try outlive the deadline.
            let left = deadline.saturating_sub(last_ok.elapsed());
            let try_for = (self.renew_every() / 4)
                .max(Duration::from_millis(250))
                .min(left);
            match tokio::time::timeout(try_for, self.renew()).await {
                Ok(Ok(())) => {
                    if failures > 0 {
                        tracing::info!(key = %self.key, failures, "lease renewed again");
                    }
                    failures = 0;
                    last_ok = tokio::time::Instant::now();
                }
                Ok(Err(Ok(lost))) => return Some(lost),
                Ok(Err(Err(e))) => {
                    if failures == 0 {
                        tracing::warn!(key = %self.key, error = %e, "lease renewal failed; retrying until the renew deadline");
                    }
                    failures += 1;
                    last_error = e;
                }
                Err(_) => {
                    if failures == 0 {
                        tracing::warn!(key = %self.key, "lease renewal did not answer; retrying until the renew deadline");
                    }
                    failures += 1;
                    last_error = "no renewal answered before the deadline".into();
                }
            }
        }
    }

    /// Gives the lease up (the work is over): removes the key, if it still holds our value.
    pub async fn release(self) {
        if let Ok(Some(entry)) = self.store.entry(&self.key).await
            && entry.operation == kv::Operation::Put
            && entry.value == self.value
        {
            let _ = self.store.purge(&self.key).await;
        }
    }
}
