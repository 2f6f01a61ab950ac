//! PostgreSQL access shared by the services: connecting and migrating.
//! Queries live with the service that owns the table (ARCHITECTURE.md, "Data ownership"); the
//! one exception is [`first_attempt`], the resolution of a task's first attempt, which both the
//! gateway and the scheduler run.

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::str::FromStr;
use std::time::Duration;

pub use sqlx;

pub mod first_attempt;
pub mod warm;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid database url")]
    Url(#[source] sqlx::Error),
    #[error("connect to postgres")]
    Connect(#[source] sqlx::Error),
    #[error("run migrations")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How long a transaction may sit idle before the server ends it (see [`connect`]).
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);

/// How long a pooled connection may sit idle before it is checked (a ping) when taken again.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Connect with a bounded pool; fails fast (10 s) when Postgres is unreachable.
///
/// sqlx pings every connection when it goes back to the pool; by default it pings it again
/// when it is taken, one more round trip before every statement. Here only a connection idle
/// for longer than [`IDLE_CHECK`] is pinged when taken (a restarted server has closed it; it
/// is then dropped and another one taken or opened). A connection that breaks in between
/// fails its query like any outage in the middle of one.
///
/// A transaction left idle for [`IDLE_IN_TRANSACTION`] (a service frozen in the middle of one,
/// holding its row locks) is ended by the server, unless the URL's `options` set
/// `idle_in_transaction_session_timeout` themselves. The services' transactions wait on nothing
/// longer than a bounded NATS request inside them.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, Error> {
    let mut options = PgConnectOptions::from_str(url).map_err(Error::Url)?;
    if !options
        .get_options()
        .is_some_and(|o| o.contains("idle_in_transaction_session_timeout"))
    {
        options = options.options([(
            "idle_in_transaction_session_timeout",
            format!("{}ms", IDLE_IN_TRANSACTION.as_millis()),
        )]);
    }
    pool_options(max_connections)
        .connect_with(options)
        .await
        .map_err(Error::Connect)
}

/// A second pool to the database of `pool`, with the same settings and at most
/// `max_connections`, for a hot path that should keep to a few warm backends (a backend plans a
/// statement on its first runs; a path spread over a large pool keeps paying that). It opens its
/// connections when first used: `pool`, connected already, has shown the database reachable.
pub fn sibling(pool: &PgPool, max_connections: u32) -> PgPool {
    pool_options(max_connections).connect_lazy_with((*pool.connect_options()).clone())
}

/// A [`sibling`] whose connections plan no sequential scan where an index can serve
/// (`enable_seqscan = off`), for a hot path whose statements all reach their rows by key. A
/// connection plans each statement on its first runs and keeps the plan; planned while the
/// statistics still describe a small table (a young database, or a table that grew fast since
/// it was last analyzed), a join by key is kept as a scan of the whole table, and its cost then
/// grows with the table.
pub fn sibling_by_key(pool: &PgPool, max_connections: u32) -> PgPool {
    sibling_with(pool, max_connections, &[("enable_seqscan", "off")])
}

/// A [`sibling_by_key`] whose connections also plan each statement once and keep that plan
/// (`plan_cache_mode = force_generic_plan`), for a hot path of statements that take their rows
/// as arrays of keys (`UNNEST($1::uuid[], ...)`). PostgreSQL plans a prepared statement for its
/// values on its first five runs, then keeps a generic plan only if its estimate is no worse;
/// a generic plan reckons an array parameter at ten elements, the plans for the values at the
/// one or few given, so such a statement was planned again on every run: the recorder's
/// statement of attempts' ends spent 0.48 ms planning for 0.37 ms executing at low load
/// (`pg_stat_statements` with `track_planning`, docs/BENCHMARKS.md, session 32). Planned
/// without sequential scans, a generic plan reaches the rows by key as the value plans do.
pub fn sibling_by_key_planned_once(pool: &PgPool, max_connections: u32) -> PgPool {
    sibling_with(pool, max_connections, BY_KEY_PLANNED_ONCE)
}

/// The settings of [`sibling_by_key_planned_once`].
const BY_KEY_PLANNED_ONCE: &[(&str, &str)] = &[
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

/// A [`sibling`] whose connections start with `settings` as well.
fn sibling_with(pool: &PgPool, max_connections: u32, settings: &[(&str, &str)]) -> PgPool {
    pool_options(max_connections).connect_lazy_with(options_with(pool, settings))
}

/// The connection options of `pool`, with `settings` as well.
fn options_with(pool: &PgPool, settings: &[(&str, &str)]) -> PgConnectOptions {
    (*pool.connect_options())
        .clone()
        .options(settings.iter().copied())
}

/// A [`sibling`] that takes its connections back without a round trip ([`warm::Warm`]), for
/// a hot path of one statement after another.
pub fn warm_sibling(pool: &PgPool, max_connections: u32) -> warm::Warm {
    warm::Warm::new(options_with(pool, &[]), max_connections)
}

/// A [`sibling_by_key_planned_once`] that takes its connections back without a round trip
/// ([`warm::Warm`]).
pub fn warm_sibling_by_key_planned_once(pool: &PgPool, max_connections: u32) -> warm::Warm {
    warm::Warm::new(options_with(pool, BY_KEY_PLANNED_ONCE), max_connections)
}

fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > IDLE_CHECK {
                    use sqlx::Connection as _;
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}

/// Apply pending migrations. Safe to call from several services at once (sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    MIGRATOR.run(pool).await.map_err(Error::Migrate)?;
    tracing::info!("database schema is current");
    Ok(())
}

/// What a failed query says about the request that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// PostgreSQL is unreachable, refusing connections, overloaded, restarting, or the pool
    /// timed out: the same request later may succeed.
    Unavailable,
    /// A conflict between concurrent transactions (serialization failure, deadlock): retry.
    Conflict,
    /// The data itself is refused (SQLSTATE class 22, data exception: NUL characters,
    /// untranslatable text, out-of-range values; class 23, integrity constraint violation;
    /// values that do not encode or decode): the same request will fail the same way.
    BadData,
    /// Anything else (a bug, a missing row where one must be): not known to pass on a retry.
    Other,
}

/// Classifies a sqlx error; consumers retry `Unavailable` and `Conflict`, and never `BadData`.
pub fn fault(e: &sqlx::Error) -> Fault {
    use sqlx::Error as E;
    match e {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
            Fault::Unavailable
        }
        E::Protocol(_) => Fault::Unavailable,
        E::Database(d) => {
            let code = d.code().unwrap_or_default();
            match code.get(..2).unwrap_or_default() {
                // connection exception, insufficient resources, operator intervention
                // (admin shutdown, crash shutdown, cannot connect now), system error.
                "08" | "53" | "57" | "58" => Fault::Unavailable,
                // "database is not accepting connections" (ALLOW_CONNECTIONS false), and an
                // invalid catalog (the database is gone): both answer every connection.
                _ if code == "55000" || code == "3D000" => Fault::Unavailable,
                // transaction rollback: serialization failure, deadlock.
                "40" => Fault::Conflict,
                "22" | "23" => Fault::BadData,
                _ => Fault::Other,
            }
        }
        E::Encode(_) | E::Decode(_) | E::ColumnDecode { .. } | E::TypeNotFound { .. } => {
            Fault::BadData
        }
        _ => Fault::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    /// A service's connections end a transaction left idle (a process frozen in one, holding
    /// its locks): the server closes the connection after [`IDLE_IN_TRANSACTION`], or after the
    /// URL's own `idle_in_transaction_session_timeout`, which stands.
    #[tokio::test]
    async fn a_transaction_left_idle_is_ended_by_the_server() {
        let db = agentscope_testkit::TestDb::create().await.unwrap();
        let pool = connect(&db.url(), 1).await.unwrap();
        let set: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(set, "1min");

        let url = format!(
            "{}?options=-c%20idle_in_transaction_session_timeout%3D200",
            db.url()
        );
        let pool = connect(&url, 1).await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let watcher = db.pool().await.unwrap();
        agentscope_testkit::wait_for(
            "the server to end the idle transaction's connection",
            Duration::from_secs(30),
            || {
                let watcher = watcher.clone();
                async move {
                    let n: i64 =
                        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
                            .bind(pid)
                            .fetch_one(&watcher)
                            .await
                            .ok()?;
                    (n == 0).then_some(())
                }
            },
        )
        .await
        .unwrap();
        assert!(
            sqlx::query("SELECT 1").execute(&mut *tx).await.is_err(),
            "the transaction is gone"
        );
        watcher.close().await;
    }

    /// Every execution event belongs to an attempt (checked once per statement, migration
    /// 0011): an insert naming a missing attempt fails as a foreign key would, wholly; an
    /// attempt with events can be neither deleted nor re-keyed; an insert holds off a concurrent
    /// delete of its attempt, which then finds the events and fails.
    #[tokio::test]
    async fn every_event_belongs_to_an_attempt() {
        let db = agentscope_testkit::TestDb::create().await.unwrap();
        let pool = connect(&db.url(), 4).await.unwrap();
        migrate(&pool).await.unwrap();
        let (ws, agent, task, attempt, bare) = (
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
        );
        let setup = [
            "INSERT INTO workspaces (id, name) VALUES ($1, 'w')",
            "INSERT INTO agents (id, workspace_id, name) VALUES ($2, $1, 'a')",
            "INSERT INTO tasks (id, workspace_id, agent_id) VALUES ($3, $1, $2)",
            "INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id)
             VALUES ($4, $3, $1, 1, 'queued', $2), ($5, $3, $1, 2, 'queued', $2)",
        ];
        for sql in setup {
            sqlx::query(sql)
                .bind(ws)
                .bind(agent)
                .bind(task)
                .bind(attempt)
                .bind(bare)
                .execute(&pool)
                .await
                .unwrap();
        }
        let insert = "INSERT INTO execution_events (attempt_id, seq, kind, payload, at)
             SELECT u.a, u.s, 'output', '{}', now() FROM UNNEST($1::uuid[], $2::bigint[]) AS u(a, s)";
        let code = |e: sqlx::Error| {
            e.as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned())
        };
        let events = |a: Uuid| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM execution_events WHERE attempt_id = $1",
                )
                .bind(a)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };

        // One row of a missing attempt fails the whole statement; the good rows are not stored.
        let err = sqlx::query(insert)
            .bind(vec![attempt, attempt, Uuid::new_v4()])
            .bind(vec![1_i64, 2, 1])
            .execute(&pool)
            .await
            .unwrap_err();
        assert_eq!(code(err).as_deref(), Some("23503"));
        assert_eq!(events(attempt).await, 0);
        sqlx::query(insert)
            .bind(vec![attempt, attempt])
            .bind(vec![1_i64, 2])
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(events(attempt).await, 2);

        // Deleted or re-keyed, the attempt would leave its events behind.
        for sql in [
            "DELETE FROM attempts WHERE id = $1",
            "UPDATE attempts SET id = gen_random_uuid() WHERE id = $1",
        ] {
            let err = sqlx::query(sql)
                .bind(attempt)
                .execute(&pool)
                .await
                .unwrap_err();
            assert_eq!(code(err).as_deref(), Some("23503"), "{sql}");
        }
        // An attempt without events still can be (nothing else refers to it).
        let n = sqlx::query("UPDATE attempts SET status = 'running' WHERE id = $1")
            .bind(bare)
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(n, 1);

        // An open insert of `bare`'s events holds its key-share lock: a delete of `bare` waits
        // for it, then sees the committed events and fails.
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(insert)
            .bind(vec![bare])
            .bind(vec![1_i64])
            .execute(&mut *tx)
            .await
            .unwrap();
        let deleting = tokio::spawn({
            let pool = pool.clone();
            async move {
                sqlx::query("DELETE FROM attempts WHERE id = $1")
                    .bind(bare)
                    .execute(&pool)
                    .await
            }
        });
        agentscope_testkit::wait_for_lock(&pool, "DELETE FROM attempts")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let err = deleting.await.unwrap().unwrap_err();
        assert_eq!(code(err).as_deref(), Some("23503"));
        assert_eq!(events(bare).await, 1);

        // The other way round: an insert waits for an open delete of its attempt, then fails.
        let doomed = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id)
             VALUES ($1, $2, $3, 3, 'queued', $4)",
        )
        .bind(doomed)
        .bind(task)
        .bind(ws)
        .bind(agent)
        .execute(&pool)
        .await
        .unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("DELETE FROM attempts WHERE id = $1")
            .bind(doomed)
            .execute(&mut *tx)
            .await
            .unwrap();
        let inserting = tokio::spawn({
            let pool = pool.clone();
            async move {
                sqlx::query(insert)
                    .bind(vec![doomed])
                    .bind(vec![1_i64])
                    .execute(&pool)
                    .await
            }
        });
        agentscope_testkit::wait_for_lock(&pool, "INSERT INTO execution_events")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let err = inserting.await.unwrap().unwrap_err();
        assert_eq!(code(err).as_deref(), Some("23503"));
        assert_eq!(events(doomed).await, 0);
        pool.close().await;
    }

    #[test]
    fn transport_failures_are_outages() {
        assert_eq!(fault(&sqlx::Error::PoolTimedOut), Fault::Unavailable);
        assert_eq!(
            fault(&sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused
            ))),
            Fault::Unavailable
        );
        assert_eq!(fault(&sqlx::Error::RowNotFound), Fault::Other);
    }

    /// A [`sibling_by_key_planned_once`] connection plans a statement that takes its keys as
    /// arrays once and runs that plan every time (the recorder's statement of ends is such a
    /// statement), where a plain connection plans it for its values on every run, since the
    /// generic plan's estimate of ten array elements looks worse than the one element given.
    #[tokio::test]
    async fn a_planned_once_connection_plans_a_statement_by_key_arrays_once() {
        let db = agentscope_testkit::TestDb::create().await.unwrap();
        let pool = connect(&db.url(), 1).await.unwrap();
        migrate(&pool).await.unwrap();
        let (ws, agent, task, attempt) = (
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
        );
        for sql in [
            "INSERT INTO workspaces (id, name) VALUES ($1, 'w')",
            "INSERT INTO agents (id, workspace_id, name) VALUES ($2, $1, 'a')",
            "INSERT INTO tasks (id, workspace_id, agent_id) VALUES ($3, $1, $2)",
            "INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id)
             VALUES ($4, $3, $1, 1, 'queued', $2)",
        ] {
            sqlx::query(sql)
                .bind(ws)
                .bind(agent)
                .bind(task)
                .bind(attempt)
                .execute(&pool)
                .await
                .unwrap();
        }
        const RUNS: i64 = 8;
        let statement = "SELECT a.id, t.cancel_requested_at IS NOT NULL AS cancel_requested
             FROM UNNEST($1::uuid[], $2::text[]) AS f(id, status)
             JOIN attempts a ON a.id = f.id JOIN tasks t ON t.id = a.task_id";
        // (custom plans, generic plans) of the statement on a one-connection pool.
        let plans = |p: PgPool| async move {
            for _ in 0..RUNS {
                let found: Vec<(Uuid, bool)> = sqlx::query_as(statement)
                    .bind(vec![attempt])
                    .bind(vec!["succeeded"])
                    .fetch_all(&p)
                    .await
                    .unwrap();
                assert_eq!(found, vec![(attempt, false)]);
            }
            let counts: (i64, i64) = sqlx::query_as(
                "SELECT custom_plans, generic_plans FROM pg_prepared_statements
                  WHERE statement LIKE '%UNNEST($1::uuid[], $2::text[]) AS f(id, status)%'",
            )
            .fetch_one(&p)
            .await
            .unwrap();
            p.close().await;
            counts
        };
        assert_eq!(
            plans(sibling_by_key_planned_once(&pool, 1)).await,
            (0, RUNS),
            "planned once, that plan run every time"
        );
        let (custom, _) = plans(sibling(&pool, 1)).await;
        assert!(
            custom >= 5,
            "a plain connection plans for the values at least on the first five runs: {custom}"
        );
        pool.close().await;
    }
}
