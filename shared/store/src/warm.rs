//! Connections a hot path keeps warm and takes back without a round trip.
//!
//! sqlx's pool checks every connection given back to it with a round trip to the server (a
//! `Sync`, answered by `ReadyForQuery`) before another caller may take it. On a path of one
//! statement after another (a submission, a recorded batch of events) that is a second round
//! trip per statement, a wake-up of the backend and of a task of the service, and, while it is in
//! flight, a connection nobody can take: the next statement takes another one, or opens one, so
//! the path spreads over more backends than it needs, each planning its statements anew. At low
//! load it cost the stack about half a millisecond of CPU per task and W1 low 0.15 ms at p50
//! (docs/BENCHMARKS.md, session 33).
//!
//! A [`Warm`] pool gives a connection back to its next caller as it was left, when the caller
//! said it is clean ([`Conn::release`]: its statements all completed, no transaction left open).
//! A connection given back otherwise (an error, a transaction not committed, a caller that
//! stopped waiting halfway through a statement) is checked with that round trip when it is taken
//! next, and dropped if it is broken: a connection that failed a statement is never simply
//! handed to the next caller. (What the server still had to say, and the `ROLLBACK` a dropped
//! transaction queued, sqlx's connection deals with itself before its next statement, checked
//! or not.) As in the services' other pools ([`crate::connect`]), a connection left idle for
//! more than a second is checked too (a restarted server has closed it). The most recently used
//! connection is taken first, so that a path at low load keeps to one warm backend.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgQueryResult, PgRow, PgStatement, PgTypeInfo, Postgres,
};
use sqlx::{Connection, Describe, Either, Execute, Executor};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long [`Warm::acquire`] waits for a connection, as the other pools do.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool of at most `max_connections` connections with `options` (see the module).
#[derive(Clone)]
pub struct Warm(Arc<Inner>);

struct Inner {
    options: PgConnectOptions,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: PgConnection,
    since: Instant,
    clean: bool,
}

impl std::fmt::Debug for Warm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warm")
            .field("available", &self.0.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl Warm {
    /// Opens its connections when first needed.
    pub fn new(options: PgConnectOptions, max_connections: u32) -> Warm {
        Warm(Arc::new(Inner {
            options,
            permits: Arc::new(Semaphore::new(max_connections.max(1) as usize)),
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// A connection: an idle one (checked first if it was not given back clean, or has been
    /// idle for more than a second), or a new one. `PoolTimedOut` after ten seconds.
    pub async fn acquire(&self) -> Result<Conn, sqlx::Error> {
        tokio::time::timeout(ACQUIRE_TIMEOUT, self.take())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    async fn take(&self) -> Result<Conn, sqlx::Error> {
        let permit = self
            .0
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let idle = self.0.idle.lock().expect("warm pool").pop();
            let Some(mut i) = idle else {
                let conn = PgConnection::connect_with(&self.0.options).await?;
                return Ok(self.conn(conn, permit));
            };
            if (!i.clean || i.since.elapsed() > crate::IDLE_CHECK) && i.conn.ping().await.is_err() {
                // Broken: dropped, and the next one tried.
                continue;
            }
            return Ok(self.conn(i.conn, permit));
        }
    }

    fn conn(&self, conn: PgConnection, permit: OwnedSemaphorePermit) -> Conn {
        Conn {
            conn: Some(conn),
            home: self.0.clone(),
            clean: false,
            _permit: permit,
        }
    }

    /// Connections open and idle.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.0.idle.lock().expect("warm pool").len()
    }
}

/// A connection of a [`Warm`] pool, given back when dropped: as it is after
/// [`Conn::release`], to be checked before its next use otherwise.
pub struct Conn {
    conn: Option<PgConnection>,
    home: Arc<Inner>,
    clean: bool,
    // Given up after the connection is back among the idle ones (fields drop after `drop`).
    _permit: OwnedSemaphorePermit,
}

impl Conn {
    /// Gives the connection back as it is: the caller's statements all completed and no
    /// transaction is open.
    pub fn release(mut self) {
        self.clean = true;
    }
}

impl std::ops::Deref for Conn {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("a taken connection")
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a taken connection")
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.home.idle.lock().expect("warm pool").push(Idle {
                conn,
                since: Instant::now(),
                clean: self.clean,
            });
        }
    }
}

/// A statement on the pool: a connection taken for it and given back clean once the statement
/// completed. `fetch_many` reads the whole result before it yields it (the hot paths this pool
/// serves read a few rows).
impl<'p> Executor<'p> for &'_ Warm {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        futures::stream::once(async move {
            let mut conn = pool.acquire().await?;
            let all: Vec<_> = conn.fetch_many(query).try_collect().await?;
            conn.release();
            Ok::<_, sqlx::Error>(futures::stream::iter(all.into_iter().map(Ok)))
        })
        .try_flatten()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let row = conn.fetch_optional(query).await?;
            conn.release();
            Ok(row)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>> {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let statement = conn.prepare_with(sql, parameters).await?;
            conn.release();
            Ok(statement)
        })
    }

    #[doc(hidden)]
    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>> {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let described = conn.describe(sql).await?;
            conn.release();
            Ok(described)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Warm;
    use sqlx::Connection as _;
    use std::time::Duration;

    async fn warm(max: u32) -> (agentscope_testkit::TestDb, sqlx::PgPool, Warm) {
        let db = agentscope_testkit::TestDb::create().await.unwrap();
        let pool = crate::connect(&db.url(), 2).await.unwrap();
        let warm = crate::warm_sibling(&pool, max);
        (db, pool, warm)
    }

    async fn backend(w: &Warm) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(w)
            .await
            .unwrap()
    }

    /// Statements one after another keep to one backend: a connection given back clean is the
    /// next one taken, with what its session set still set.
    #[tokio::test]
    async fn statements_in_a_row_keep_to_one_warm_backend() {
        let (_db, _pool, w) = warm(4).await;
        let first = backend(&w).await;
        for _ in 0..5 {
            assert_eq!(backend(&w).await, first);
        }
        let mut c = w.acquire().await.unwrap();
        sqlx::query("SET application_name = 'kept'")
            .execute(&mut *c)
            .await
            .unwrap();
        c.release();
        let name: String = sqlx::query_scalar("SHOW application_name")
            .fetch_one(&w)
            .await
            .unwrap();
        assert_eq!(name, "kept");
        assert_eq!(w.idle(), 1);
    }

    /// A transaction given back without its commit is rolled back before the connection
    /// serves anyone else, and the connection serves on.
    #[tokio::test]
    async fn a_transaction_given_back_open_is_rolled_back_first() {
        let (_db, pool, w) = warm(1).await;
        sqlx::query("CREATE TABLE t (v int)")
            .execute(&pool)
            .await
            .unwrap();
        let pid = {
            let mut c = w.acquire().await.unwrap();
            let mut tx = c.begin().await.unwrap();
            sqlx::query("INSERT INTO t VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            drop(tx);
            pid
            // `c` is dropped here, not released.
        };
        let mut c = w.acquire().await.unwrap();
        // Outside any transaction: the insert's transaction id is gone with it.
        let (same, xid): (i32, Option<i64>) =
            sqlx::query_as("SELECT pg_backend_pid(), txid_current_if_assigned()")
                .fetch_one(&mut *c)
                .await
                .unwrap();
        assert_eq!(same, pid, "the same connection, checked and kept");
        assert_eq!(xid, None);
        c.release();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 0, "the insert was rolled back");
    }

    /// A caller that stops waiting in the middle of a statement leaves its answer unread: the
    /// next caller of that connection gets its own statement's answer, never the old one.
    #[tokio::test]
    async fn an_abandoned_statement_never_answers_the_next_caller() {
        let (_db, pool, w) = warm(1).await;
        // The statement waits on a lock held here until its caller is gone.
        let mut holder = pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_advisory_lock(33)")
            .execute(&mut *holder)
            .await
            .unwrap();
        let abandoned = tokio::spawn({
            let w = w.clone();
            async move {
                sqlx::query_scalar::<_, i32>("SELECT 7 FROM pg_advisory_lock(33) AS waits")
                    .fetch_one(&w)
                    .await
            }
        });
        agentscope_testkit::wait_for_lock(&pool, "AS waits")
            .await
            .unwrap();
        abandoned.abort();
        assert!(abandoned.await.unwrap_err().is_cancelled());
        sqlx::query("SELECT pg_advisory_unlock(33)")
            .execute(&mut *holder)
            .await
            .unwrap();
        let v: i32 = sqlx::query_scalar("SELECT 42").fetch_one(&w).await.unwrap();
        assert_eq!(v, 42);
        assert_eq!(w.idle(), 1);
    }

    /// A connection whose backend went away (a restarted server) is found out: a clean one
    /// fails the statement that uses it within the second (as a connection of the other pools
    /// does), and the pool then opens another; a connection given back unclean is checked and
    /// replaced before anyone uses it.
    #[tokio::test]
    async fn a_connection_whose_server_went_away_is_replaced() {
        let (_db, pool, w) = warm(1).await;
        let terminate = |pid: i32| {
            let pool = pool.clone();
            async move {
                let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                    .bind(pid)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert!(done);
            }
        };
        let first = backend(&w).await;
        terminate(first).await;
        assert!(
            sqlx::query("SELECT 1").execute(&w).await.is_err(),
            "a clean connection is used as it is"
        );
        let second = backend(&w).await;
        assert_ne!(second, first);

        // Given back unclean, then its backend ends: checked, dropped, and another opened.
        let mut c = w.acquire().await.unwrap();
        sqlx::query("SELECT 1").execute(&mut *c).await.unwrap();
        drop(c);
        terminate(second).await;
        let third = backend(&w).await;
        assert!(third != second && third != first);
    }

    /// At most `max_connections` are out at once: a caller waits for one to come back.
    #[tokio::test]
    async fn callers_beyond_the_limit_wait_for_a_connection() {
        let (_db, _pool, w) = warm(1).await;
        let held = w.acquire().await.unwrap();
        let mut waiting = tokio::spawn({
            let w = w.clone();
            async move { backend(&w).await }
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut waiting)
                .await
                .is_err(),
            "a second caller got a connection while the only one was out"
        );
        let pid: i32 = {
            let mut held = held;
            let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *held)
                .await
                .unwrap();
            held.release();
            pid
        };
        assert_eq!(waiting.await.unwrap(), pid);
    }
}
