//! One Attempt on this host: keep the lease, prepare the task directory, run the provider, report
//! every event in order, and stop at once when the lease is lost.

mod approvals;
mod assignment;
mod execute;
mod lease;
mod limits;
mod scope;
mod sink;
mod task_dir;
mod truncate;

pub use assignment::{Assignment, Spec};
pub use lease::keep_lease;
pub use limits::{ModelWatch, run_limit};
pub use scope::{scope_ids, scoped_id};
pub(crate) use sink::WINDOW as PUBLISH_WINDOW;
pub use sink::{EventSink, wire_state};
pub use task_dir::{Prepared, existing_task_dir};
pub(crate) use task_dir::{discard_prepared, prepare_ahead, prepared_until};
pub use truncate::shrink;

use crate::Ctx;
use crate::isolation;
use crate::journal::Entry;
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::Message;
use agentscope_schemas::v1::ApprovalDecision;
use execute::execute;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Why a running Attempt must stop before its provider finishes.
#[derive(Clone)]
pub struct Stops {
    /// The platform asked to cancel.
    pub cancel: CancellationToken,
    /// The lease is gone: nothing more may be reported.
    pub lease_lost: CancellationToken,
    /// The host is shutting down: stop, and let the scheduler retry elsewhere.
    pub shutdown: CancellationToken,
}

/// Runs one assignment to its end. The caller holds the capacity slot until this returns.
pub async fn run(
    ctx: Ctx,
    a: Assignment,
    stops: Stops,
    mut decisions: tokio::sync::mpsc::Receiver<ApprovalDecision>,
    resume: Option<Entry>,
) {
    let span = tracing::info_span!("attempt", workspace_id = %a.workspace_id, task_id = %a.task_id, attempt_id = %a.attempt_id, host_id = %ctx.host_id);
    agentscope_bus::set_parent(
        &span,
        Some(a.traceparent.as_str()).filter(|s| !s.is_empty()),
    );
    async move {
        let resuming = resume.as_ref().map(|e| e.provider_session_id.clone());
        let entry = resume.unwrap_or_else(|| Entry {
            attempt_id: a.attempt_id.clone(),
            task_id: a.task_id.clone(),
            lease_key: a.lease_key.clone(),
            lease_token: a.lease_token,
            last_seq: 0,
            state: AttemptStatus::Claimed,
            provider_session_id: String::new(),
            provider: a.spec.provider.clone(),
            assignment_hex: hex::encode(a.to_wire().encode_to_vec()),
            saved_at_ms: agentscope_bus::now_ms(),
        });
        let mut sink = EventSink::new(
            ctx.clone(),
            entry,
            stops.lease_lost.clone(),
            isolation::secrets_of_attempt(&a.task_token),
        );
        // Written while the uid and the task directory are prepared; the provider starts only
        // once it is (see `execute`), so a restarted host knows of every provider it started.
        if resuming.is_none() {
            sink.set_state_soon(AttemptStatus::Claimed).await;
        }
        let renew_done = CancellationToken::new();
        let renewer = tokio::spawn(keep_lease(
            ctx.clone(),
            a.clone(),
            stops.lease_lost.clone(),
            renew_done.clone(),
        ));

        // The directory and uid prepared on the gateway's early word, if they were.
        let prepared = match resuming {
            None => task_dir::take_prepared(&ctx, &a),
            Some(_) => None,
        };
        // Said in the attempt's last log line, not here: nothing is written before the start.
        let prepared_ahead = prepared.is_some();
        let (lease, ready) = match prepared {
            Some(p) => (Ok(p.lease), Some(p.dir)),
            None => (acquire_uid(&ctx).await, None),
        };
        // Whether the provider's whole tree is known to be gone (its sentinel ended by itself).
        let mut gone = false;
        let outcome = match &lease {
            Ok(l) => {
                execute(
                    &ctx,
                    &a,
                    &mut sink,
                    &stops,
                    &mut decisions,
                    resuming.as_deref(),
                    false,
                    ready,
                    l.as_ref().map(|l| l.who),
                    &mut gone,
                )
                .await
            }
            Err(e) => failed(FailureClass::Internal, format!("{e}")),
        };
        if let (Ok(Some(lease)), Some(ids)) = (lease, ctx.identities.clone()) {
            let uid = lease.who.uid;
            let root = ctx.tasks_dir.join(&a.attempt_id);
            let release = move || {
                // Unless the sentinel saw the whole tree end, whatever escaped it dies with the
                // uid (a /proc scan). Then the directory goes back to the host: its root (0700)
                // is enough to keep the uid's next holder out of everything below it.
                let left = ids.release(lease, gone);
                if let Err(e) = isolation::take_back(&root)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::error!(error = %e, "take the task directory back");
                }
                left
            };
            let left = if gone {
                release()
            } else {
                tokio::task::spawn_blocking(release)
                    .await
                    .unwrap_or_default()
            };
            if left.killed > 0 || !left.survivors.is_empty() {
                tracing::warn!(
                    uid,
                    killed = left.killed,
                    survivors = left.survivors.len(),
                    "processes of the attempt outlived its provider and were killed"
                )
            }
        }
        if outcome.1 == Some(FailureClass::ProviderLogin) {
            // Before the failure is reported (and the task moves on): the next claim must not
            // bring this provider's work here again.
            ctx.provider_login_failed(&a.spec.provider, &outcome.2);
        }
        if !stops.lease_lost.is_cancelled() {
            let (state, class, detail, exit) = outcome;
            sink.lifecycle(state, class, detail, exit).await;
            // Every event is in the stream before the lease and the journal entry go.
            sink.flush().await;
        }
        renew_done.cancel();
        let _ = renewer.await;
        if let Err(e) = ctx.journal.remove(&a.attempt_id) {
            tracing::error!(error = ?e, "remove journal entry");
        }
        tracing::info!(prepared_ahead, "attempt done on this host");
    }
    .instrument(span)
    .await
}

/// The attempt's own uid, held until its last process is gone (None: providers run as the
/// host's). A uid released clean is taken here; one that needs a scan for leftovers (or none
/// free) on a blocking thread.
async fn acquire_uid(ctx: &Ctx) -> Result<Option<isolation::Lease>, isolation::Error> {
    let Some(ids) = ctx.identities.clone() else {
        return Ok(None);
    };
    match ids.acquire_quick() {
        Ok(None) => tokio::task::spawn_blocking(move || ids.acquire().map(Some))
            .await
            .unwrap_or_else(|e| {
                Err(isolation::Error::Io {
                    action: "acquire a uid",
                    path: Default::default(),
                    source: std::io::Error::other(e),
                })
            }),
        quick => quick,
    }
}

type Outcome = (AttemptStatus, Option<FailureClass>, String, Option<i32>);

fn failed(class: FailureClass, detail: impl Into<String>) -> Outcome {
    (AttemptStatus::Failed, Some(class), detail.into(), None)
}
