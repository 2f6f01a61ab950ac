//! One supervisor for every service: named tasks, each with a failure policy, and one shutdown
//! with a grace period.
//!
//! A service has two kinds of tasks:
//! - **Core tasks** (the recorder, the claim server, the host's claim loop, the HTTP server) run
//!   for the life of the service. Their [`Policy`] says what their end means: a `Critical` task
//!   that ends, well or not, stops the service; a `Restart` task that fails is started again
//!   after a backoff.
//! - **Work** (a hosted attempt, a managed session, an SSE stream) is spawned on a [`Work`]
//!   handle and ends by itself. At shutdown it sees the supervisor's token cancelled and gets
//!   the grace period to finish (hand a lease back, report a retryable end, close a stream)
//!   before the service returns.
//!
//! [`Supervisor::run`] returns once the shutdown future resolves or a critical task ends, after
//! every core task and all work stopped or the grace period passed; its error names the first
//! critical task that failed.

use std::future::Future;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What a core task's end means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The service cannot go on without it: its end, with or without an error, stops the service.
    Critical,
    /// A failure is logged and the task is started again after `backoff`; ending with `Ok`
    /// (it saw the shutdown) ends it.
    Restart { backoff: Duration },
}

type Outcome = (&'static str, anyhow::Result<()>);

/// The tasks of one service; see the module documentation.
pub struct Supervisor {
    service: &'static str,
    cancel: CancellationToken,
    core: JoinSet<Outcome>,
    work: Work,
    grace: Duration,
}

/// A handle for spawning work the service waits for at shutdown. Cheap to clone.
#[derive(Clone)]
pub struct Work {
    tracker: TaskTracker,
    cancel: CancellationToken,
}

impl Work {
    /// Spawns one unit of work. It should watch [`Work::stopping`] (or a child of it) and end
    /// soon after it fires.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut)
    }

    /// Fires when the service begins to stop.
    pub fn stopping(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// How many units of work are running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }
}

impl Supervisor {
    /// A supervisor whose tasks stop when `cancel` fires (the service's own token, which its
    /// health listener may share) and get `grace` to finish at shutdown.
    pub fn new(service: &'static str, cancel: CancellationToken, grace: Duration) -> Supervisor {
        Supervisor {
            service,
            cancel: cancel.clone(),
            core: JoinSet::new(),
            work: Work {
                tracker: TaskTracker::new(),
                cancel,
            },
            grace,
        }
    }

    /// The token every task watches: cancelled when the service stops.
    pub fn token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// The handle for work (attempts, sessions, streams).
    pub fn work(&self) -> Work {
        self.work.clone()
    }

    /// Starts a core task. `make` is given the stop token and returns the task's future; a
    /// `Restart` task calls `make` again after each failure.
    pub fn spawn<M, F>(&mut self, name: &'static str, policy: Policy, make: M)
    where
        M: Fn(CancellationToken) -> F + Send + 'static,
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let cancel = self.cancel.clone();
        let service = self.service;
        self.core.spawn(async move {
            loop {
                let res = make(cancel.clone()).await;
                match (&res, policy) {
                    (Ok(()), _) => {
                        tracing::debug!(service, task = name, "task stopped");
                        return (name, res);
                    }
                    (Err(e), Policy::Critical) => {
                        tracing::error!(service, task = name, error = ?e, "task failed");
                        return (name, res);
                    }
                    (Err(e), Policy::Restart { backoff }) => {
                        if cancel.is_cancelled() {
                            return (name, res);
                        }
                        tracing::warn!(service, task = name, error = ?e, ?backoff, "task failed; restarting");
                        tokio::select! {
                            _ = cancel.cancelled() => return (name, Ok(())),
                            _ = tokio::time::sleep(backoff) => {}
                        }
                    }
                }
            }
        });
    }

    /// Starts a [`Policy::Critical`] core task that runs once: `make` may move in what cannot
    /// be made again (a bound listener, a subscription).
    pub fn spawn_once<M, F>(&mut self, name: &'static str, make: M)
    where
        M: FnOnce(CancellationToken) -> F + Send + 'static,
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let make = std::sync::Mutex::new(Some(make));
        self.spawn(name, Policy::Critical, move |stop| {
            let make = make.lock().expect("spawn_once").take();
            async move {
                match make {
                    Some(make) => make(stop).await,
                    None => Err(anyhow::anyhow!("a task spawned once was started again")),
                }
            }
        });
    }

    /// Runs until `shutdown` resolves or a critical task ends, then stops everything: cancels
    /// the token, waits up to the grace period for core tasks and work, and returns the first
    /// critical failure, if any.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let mut failure: Option<anyhow::Error> = None;
        tokio::select! {
            _ = shutdown => {}
            Some(joined) = self.core.join_next() => {
                let (name, res) = flatten(joined);
                // A core task that ends before shutdown leaves the service unable to do its job.
                failure = Some(match res {
                    Ok(()) => anyhow::anyhow!("{} task {name} ended on its own", self.service),
                    Err(e) => e.context(format!("{} task {name}", self.service)),
                });
                tracing::error!(service = self.service, task = name, "a core task ended; stopping");
            }
        }
        self.cancel.cancel();
        self.work.tracker.close();
        let service = self.service;
        let core = &mut self.core;
        let tracker = &self.work.tracker;
        let drained = tokio::time::timeout(self.grace, async {
            while let Some(joined) = core.join_next().await {
                let (name, res) = flatten(joined);
                if let Err(e) = res {
                    tracing::warn!(service, task = name, error = ?e, "task failed while stopping");
                }
            }
            tracker.wait().await;
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                service,
                core = self.core.len(),
                work = self.work.len(),
                grace = ?self.grace,
                "tasks did not stop within the grace period"
            );
            self.core.abort_all();
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn flatten(joined: Result<Outcome, tokio::task::JoinError>) -> Outcome {
    match joined {
        Ok(outcome) => outcome,
        Err(e) => (
            "?",
            Err(anyhow::anyhow!("task panicked or was aborted: {e}")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn shutdown_waits_for_work_and_core_tasks() {
        let mut sup = Supervisor::new("test", CancellationToken::new(), Duration::from_secs(5));
        let finished = Arc::new(AtomicUsize::new(0));
        let f = finished.clone();
        sup.spawn("core", Policy::Critical, move |stop| {
            let f = f.clone();
            async move {
                stop.cancelled().await;
                f.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        });
        let work = sup.work();
        let f = finished.clone();
        let stopping = work.stopping();
        work.spawn(async move {
            stopping.cancelled().await;
            tokio::task::yield_now().await;
            f.fetch_add(1, Ordering::SeqCst);
        });
        sup.run(async {}).await.expect("clean stop");
        assert_eq!(finished.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_critical_task_that_fails_stops_the_service_with_its_error() {
        let mut sup = Supervisor::new("test", CancellationToken::new(), Duration::from_secs(5));
        let stop = sup.token();
        sup.spawn("broken", Policy::Critical, |_| async {
            Err(anyhow::anyhow!("boom"))
        });
        let err = sup
            .run(std::future::pending())
            .await
            .expect_err("the failure ends the run");
        assert!(format!("{err:#}").contains("broken"), "{err:#}");
        assert!(format!("{err:#}").contains("boom"), "{err:#}");
        assert!(stop.is_cancelled());
    }

    #[tokio::test]
    async fn a_restart_task_is_started_again_after_a_failure() {
        let mut sup = Supervisor::new("test", CancellationToken::new(), Duration::from_secs(5));
        let starts = Arc::new(AtomicUsize::new(0));
        let s = starts.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let tx = std::sync::Mutex::new(Some(tx));
        sup.spawn(
            "flaky",
            Policy::Restart {
                backoff: Duration::from_millis(1),
            },
            move |stop| {
                let n = s.fetch_add(1, Ordering::SeqCst);
                let tx = if n == 2 {
                    tx.lock().unwrap().take()
                } else {
                    None
                };
                async move {
                    if n < 2 {
                        return Err(anyhow::anyhow!("failure {n}"));
                    }
                    if let Some(tx) = tx {
                        let _ = tx.send(());
                    }
                    stop.cancelled().await;
                    Ok(())
                }
            },
        );
        sup.run(async {
            rx.await.expect("third start");
        })
        .await
        .expect("restarts are not failures");
        assert_eq!(starts.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_task_spawned_once_owns_what_it_was_given_and_is_critical() {
        let mut sup = Supervisor::new("test", CancellationToken::new(), Duration::from_secs(5));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        sup.spawn_once("owner", move |_stop| async move {
            let _owned = listener;
            Err(anyhow::anyhow!("gave up"))
        });
        let err = sup
            .run(std::future::pending())
            .await
            .expect_err("its end stops the run");
        assert!(format!("{err:#}").contains("owner"), "{err:#}");
        assert!(format!("{err:#}").contains("gave up"), "{err:#}");
    }

    #[tokio::test]
    async fn work_that_ignores_the_stop_is_left_after_the_grace_period() {
        let sup = Supervisor::new("test", CancellationToken::new(), Duration::from_millis(50));
        sup.work().spawn(std::future::pending::<()>());
        let started = tokio::time::Instant::now();
        sup.run(async {}).await.expect("stops");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
