//! The broker restarts, or the database refuses connections, while work runs: healthy attempts
//! keep their leases (a renewal applied while its reply was lost is still the host's), every
//! task ends exactly once with one attempt, no event is lost or duplicated, and no side effect
//! happens twice.

use agentscope_system_tests::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_attempts_survive_two_nats_restarts() {
    // A production-like lease: long enough to ride out a few seconds without the broker.
    let mut stack = Stack::start(
        "faults-nats",
        StackOptions {
            lease_ttl_ms: 20_000,
            heartbeat_ttl_ms: 12_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let effects = faults::effects_dir(&stack);
    let agent = faults::ticker(&stack, &effects, 24).await;
    let _h1 = stack.host("h1", "pool", 6).await.unwrap();
    let _h2 = stack.host("h2", "pool", 6).await.unwrap();
    let ids = faults::submit(&stack, &agent, 12).await;
    faults::wait_all_running(&stack, &ids).await;

    // Two outages of the broker, each a few seconds, on the same store.
    let failures = |stack: &Stack| -> Vec<usize> {
        ["host-h1", "host-h2"]
            .iter()
            .map(|h| stack.log(h).matches("retrying").count())
            .collect()
    };
    for _ in 0..2 {
        let before = failures(&stack);
        stack.nats.kill();
        // The broker stays down until every host has failed to reach it (a lease renewal or an
        // event that could not be sent): a few seconds, as a real restart would be.
        kit::wait_for(
            "every host to notice the broker is gone",
            Duration::from_secs(30),
            || {
                let now = failures(&stack);
                let all = now.iter().zip(&before).all(|(n, b)| n > b);
                std::future::ready(all.then_some(()))
            },
        )
        .await
        .unwrap();
        stack.nats.restart().await.unwrap();
        let api = stack.api.clone();
        kit::wait_for(
            "the hosts to be back online",
            Duration::from_secs(30),
            || {
                let api = api.clone();
                async move {
                    let hosts = api.get("/v1/hosts").await.ok()?;
                    let items = hosts["items"].as_array()?;
                    (items.len() == 2 && items.iter().all(|h| h["online"] == true)).then_some(())
                }
            },
        )
        .await
        .unwrap();
    }

    faults::assert_each_once(&stack, &ids, &effects, 24).await;
}

/// The lease keeper's two rules, against a real server: a renewal that was applied although its
/// reply was lost is still the holder's, and another holder's value (or none) is a lost lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewal_applied_without_its_reply_is_still_the_holders() {
    use agentscope_bus::lease::{Lease, Lost};
    let dir = kit::TempDir::new("lease");
    let nats = kit::Nats::start(&dir.path).await.unwrap();
    let client = nats.service_client("scheduler").await.unwrap();
    let js = async_nats::jetstream::new(client);
    let ttl = Duration::from_secs(10);
    let store = agentscope_bus::Topology::leases(&js, ttl).await.unwrap();
    let mut lease = Lease::acquire(&store, "attempt.h.a", "holder-1".into(), ttl)
        .await
        .unwrap()
        .expect("a free key");
    assert!(
        Lease::acquire(&store, "attempt.h.a", "holder-2".into(), ttl)
            .await
            .unwrap()
            .is_none(),
        "one holder at a time"
    );
    let token = lease.revision();
    // Our renewal went through but its answer never came back: the key moved on with our value.
    let applied = store
        .update("attempt.h.a", "holder-1".into(), token)
        .await
        .unwrap();
    lease.renew().await.expect("still ours");
    assert_eq!(lease.revision(), applied, "the keeper adopts the revision");
    lease.renew().await.expect("and renews on from there");
    // Someone else's value: lost.
    let mut stale = lease.clone();
    lease.renew().await.unwrap();
    store.put("attempt.h.a", "holder-2".into()).await.unwrap();
    assert_eq!(stale.renew().await, Err(Ok(Lost::Taken)));
    // Gone: lost.
    store.purge("attempt.h.a").await.unwrap();
    assert_eq!(lease.renew().await, Err(Ok(Lost::Taken)));
    assert!(
        lease.renew_deadline() < ttl,
        "the holder stops before the TTL ends"
    );
}

/// PostgreSQL refuses connections for longer than a lease: the hosts keep their leases (they live
/// in NATS), the recorder catches up once the database is back, and every task still ends once,
/// with one attempt, every event once and its side effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_attempts_survive_a_database_outage_longer_than_a_lease() {
    let stack = Stack::start(
        "faults-pg",
        StackOptions {
            lease_ttl_ms: 4_000,
            heartbeat_ttl_ms: 4_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let effects = faults::effects_dir(&stack);
    let agent = faults::ticker(&stack, &effects, 14).await;
    let _h1 = stack.host("h1", "pool", 6).await.unwrap();
    let _h2 = stack.host("h2", "pool", 6).await.unwrap();
    let ids = faults::submit(&stack, &agent, 12).await;
    faults::wait_all_running(&stack, &ids).await;

    // The database refuses every connection for longer than a lease: until every attempt's lease
    // has been renewed (through NATS) for more than its whole TTL without the database.
    let service = stack.nats.service_client("scheduler").await.unwrap();
    let leases = async_nats::jetstream::new(service)
        .get_key_value(agentscope_bus::BUCKET_LEASES)
        .await
        .unwrap();
    let mut keys = Vec::new();
    for id in &ids {
        let t = stack.task(id).await.unwrap();
        let a = &t["attempts"][0];
        keys.push(agentscope_bus::lease_key(
            a["host_id"].as_str().unwrap(),
            a["id"].as_str().unwrap(),
        ));
    }
    let all_held = |leases: async_nats::jetstream::kv::Store, keys: Vec<String>| async move {
        for k in &keys {
            let e = leases.entry(k).await.ok().flatten()?;
            if e.operation != async_nats::jetstream::kv::Operation::Put {
                return None;
            }
        }
        Some(())
    };
    let name = stack.db.name.clone();
    admin_sql(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false")).await;
    admin_sql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    ))
    .await;
    let blocked_at = std::time::Instant::now();
    kit::wait_for(
        "the outage to outlast twice the lease TTL with every lease still held",
        Duration::from_secs(60),
        || {
            let (leases, keys) = (leases.clone(), keys.clone());
            async move {
                if blocked_at.elapsed() < Duration::from_secs(8) {
                    return None;
                }
                all_held(leases, keys).await
            }
        },
    )
    .await
    .unwrap();
    admin_sql(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true")).await;

    faults::assert_each_once(&stack, &ids, &effects, 14).await;
}

async fn admin_sql(sql: &str) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&kit::TestDb::admin_url())
        .await
        .unwrap();
    sqlx::query(sql).execute(&mut c).await.unwrap();
}
