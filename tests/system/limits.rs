//! 40 tasks against hosts of capacity 2 with a per-agent limit of 3: no limit is ever exceeded
//! (checked from the recorded start and end of every attempt) and every task finishes.

use agentscope_system_tests::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

/// The largest number of intervals open at once.
fn max_overlap(intervals: &[(f64, f64)]) -> usize {
    let mut points: Vec<(f64, i32)> = intervals
        .iter()
        .flat_map(|&(s, e)| [(s, 1), (e, -1)])
        .collect();
    // Ends sort before starts at the same instant: [s, e) intervals.
    points.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap().then(a.1.cmp(&b.1)));
    let (mut cur, mut max) = (0i32, 0i32);
    for (_, d) in points {
        cur += d;
        max = max.max(cur);
    }
    max as usize
}

#[test]
fn overlap_counts_half_open_intervals() {
    assert_eq!(max_overlap(&[(0.0, 1.0), (1.0, 2.0)]), 1);
    assert_eq!(max_overlap(&[(0.0, 2.0), (1.0, 3.0), (1.5, 1.7)]), 3);
}

/// Each host's attempts as the host itself reported them: from its first event to its last
/// (the host's clock). A host is the authority on its own capacity: it claims a freed slot
/// before the scheduler has recorded the end that freed it, so the recorded `claimed_at` and
/// `finished_at` of one host may overlap by more than its capacity while the host never ran
/// more at once.
async fn host_intervals(stack: &Stack) -> HashMap<String, Vec<(f64, f64)>> {
    let rows: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT a.host_id::text, EXTRACT(EPOCH FROM min(e.at))::float8, EXTRACT(EPOCH FROM max(e.at))::float8
         FROM attempts a JOIN execution_events e ON e.attempt_id = a.id
         WHERE a.workspace_id = $1::uuid GROUP BY a.id, a.host_id",
    )
    .bind(&stack.workspace_id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    let mut per_host: HashMap<String, Vec<(f64, f64)>> = HashMap::new();
    for (h, s, e) in rows {
        per_host.entry(h).or_default().push((s, e));
    }
    per_host
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limits_hold_across_forty_tasks() {
    let stack = Stack::start("limits", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("busy", "pool", &["sh", "-c", "sleep 0.3"], Some(3))
        .await
        .unwrap();
    let mut hosts = Vec::new();
    for name in ["h1", "h2", "h3"] {
        hosts.push(stack.host(name, "pool", 2).await.unwrap());
    }
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(
            stack
                .submit(json!({"agent_id": agent, "input": format!("task {i}")}))
                .await
                .unwrap(),
        );
    }
    for id in &ids {
        stack
            .wait_task(id, "succeeded", Duration::from_secs(180))
            .await
            .unwrap();
    }
    let rows: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT host_id::text, EXTRACT(EPOCH FROM claimed_at)::float8, EXTRACT(EPOCH FROM finished_at)::float8
         FROM attempts WHERE workspace_id = $1::uuid",
    )
    .bind(&stack.workspace_id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert_eq!(rows.len(), 40, "one attempt per task");
    let mut per_host: HashMap<String, Vec<(f64, f64)>> = HashMap::new();
    for (h, s, e) in &rows {
        assert!(e > s);
        per_host.entry(h.clone()).or_default().push((*s, *e));
    }
    for (h, iv) in &host_intervals(&stack).await {
        let m = max_overlap(iv);
        assert!(m <= 2, "host {h} ran {m} attempts at once (capacity 2)");
    }
    let all: Vec<(f64, f64)> = rows.iter().map(|(_, s, e)| (*s, *e)).collect();
    let agent_max = max_overlap(&all);
    assert!(
        agent_max <= 3,
        "the agent ran {agent_max} attempts at once (limit 3)"
    );
    assert!(agent_max >= 2, "work ran in parallel (max {agent_max})");
    assert!(
        per_host.len() >= 2,
        "work spread over hosts: {:?}",
        per_host.keys()
    );
}

/// The claims a scheduler answered, by result, from its `/metrics`.
async fn claims_answered(health: &str) -> HashMap<String, u64> {
    let text = kit::http_client()
        .get(format!("{health}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("agentscope_claim_requests_total{result=\""))
        .filter_map(|l| {
            let (result, rest) = l.split_once('"')?;
            let n = rest.trim_start_matches('}').trim().parse().ok()?;
            Some((result.to_string(), n))
        })
        .collect()
}

/// Two schedulers answer the claims of three hosts (capacity 3) for two agents (limit 3 each)
/// in a pool limited to 4: the limits are counters both schedulers check under row locks, so
/// none is exceeded, while work still runs in parallel and both schedulers serve claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_with_two_schedulers() {
    let stack = Stack::start("limits-two", StackOptions::default())
        .await
        .unwrap();
    let (_second, second_health) = stack.spawn_scheduler("second").await.unwrap();
    let pool = stack
        .api
        .post("/v1/pools", json!({"name": "capped", "max_concurrency": 4}))
        .await
        .unwrap();
    let pool_id = pool["id"].as_str().unwrap().to_string();
    let mut agents = Vec::new();
    for name in ["a1", "a2"] {
        let (agent, p) = stack
            .command_agent(name, "capped", &["sh", "-c", "sleep 0.2"], Some(3))
            .await
            .unwrap();
        assert_eq!(p, pool_id);
        agents.push(agent);
    }
    let mut hosts = Vec::new();
    for name in ["h1", "h2", "h3"] {
        hosts.push(stack.host(name, "capped", 3).await.unwrap());
    }
    let mut ids = Vec::new();
    for i in 0..48 {
        ids.push(
            stack
                .submit(json!({"agent_id": agents[i % 2], "input": format!("task {i}")}))
                .await
                .unwrap(),
        );
    }
    for id in &ids {
        stack
            .wait_task(id, "succeeded", Duration::from_secs(180))
            .await
            .unwrap();
    }
    let rows: Vec<(String, String, f64, f64)> = sqlx::query_as(
        "SELECT host_id::text, agent_id::text, EXTRACT(EPOCH FROM claimed_at)::float8,
                EXTRACT(EPOCH FROM finished_at)::float8
         FROM attempts WHERE workspace_id = $1::uuid",
    )
    .bind(&stack.workspace_id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert_eq!(rows.len(), 48, "one attempt per task");
    let mut per_agent: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for (_, a, s, e) in &rows {
        assert!(e > s);
        per_agent.entry(a).or_default().push((*s, *e));
    }
    for (h, iv) in &host_intervals(&stack).await {
        let m = max_overlap(iv);
        assert!(m <= 3, "host {h} ran {m} attempts at once (capacity 3)");
    }
    for (a, iv) in &per_agent {
        let m = max_overlap(iv);
        assert!(m <= 3, "agent {a} ran {m} attempts at once (limit 3)");
    }
    let all: Vec<(f64, f64)> = rows.iter().map(|(_, _, s, e)| (*s, *e)).collect();
    let pool_max = max_overlap(&all);
    assert!(
        pool_max <= 4,
        "the pool ran {pool_max} attempts at once (limit 4)"
    );
    assert!(pool_max >= 3, "work ran in parallel (max {pool_max})");
    // Nothing is left counted once everything ended.
    let left: Vec<(String, i32)> =
        sqlx::query_as("SELECT scope, active FROM attempt_counts_now WHERE active <> 0")
            .fetch_all(&stack.pg)
            .await
            .unwrap();
    assert!(
        left.is_empty(),
        "counters left after every attempt ended: {left:?}"
    );
    // Claims and recorder batches lock the counters in one global order: PostgreSQL never had
    // to break a deadlock between them (it would after a second, and a batch would replay).
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(deadlocks, 0, "deadlocks in the database");
    // Both schedulers took part.
    for health in [stack.scheduler_health.clone(), second_health] {
        let answered = claims_answered(&health).await;
        assert!(
            answered.get("offered").copied().unwrap_or(0) > 0,
            "scheduler {health} offered work: {answered:?}"
        );
    }
}

/// A host's capacity counts what runs there. An attempt the host says has ended frees its slot
/// at once, before the recorder has recorded its end. Only the host's own attempts count that
/// way: listing another host's attempt, or one that still counts, gains nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_attempt_ended_is_claimed_before_the_end_is_recorded() {
    let stack = Stack::start(
        "limits-ended",
        StackOptions {
            // Nothing renews the leases below: they must outlive the test.
            lease_ttl_ms: 60_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent("ender", "pool", &["true"], None)
        .await
        .unwrap();
    // Two raw hosts of capacity 1 that never run anything: no event of theirs reaches the
    // recorder, so every attempt they take stays active in the database.
    let mut hosts = Vec::new();
    for name in ["me", "other"] {
        hosts.push(raw_host(&stack, name, 1).await);
    }
    for i in 0..4 {
        stack
            .api
            .post(
                "/v1/tasks",
                json!({"agent_id": agent, "input": format!("task {i}")}),
            )
            .await
            .unwrap();
    }
    // The scheduler creates the attempts asynchronously: wait until all four are queued.
    kit::wait_for("four queued attempts", Duration::from_secs(30), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status = 'queued'")
            .fetch_one(&stack.pg)
            .await
            .unwrap();
        (n == 4).then_some(())
    })
    .await
    .unwrap();

    let a = raw_claim(&stack, &hosts[0], &[], &[]).await;
    assert_eq!(a.assignments.len(), 1);
    let a = a.assignments[0].attempt_id.clone();
    let c = raw_claim(&stack, &hosts[1], &[], &[]).await;
    assert_eq!(c.assignments.len(), 1);
    let c = c.assignments[0].attempt_id.clone();

    // Full while its attempt counts, even naming another host's attempt as ended.
    let full = raw_claim(&stack, &hosts[0], &[&a], &[]).await;
    assert!(full.assignments.is_empty());
    assert_eq!(full.waiting, 2);
    let foreign = raw_claim(&stack, &hosts[0], &[&a, &c], &[&c]).await;
    assert!(foreign.assignments.is_empty());
    // Not one of this host's active attempts: nothing it needs to list again.
    assert_eq!(foreign.recorded_ends, vec![c.clone()]);

    // Once it says the attempt ended, the slot is offered work although the end is unrecorded.
    let b = raw_claim(&stack, &hosts[0], &[&a], &[&a]).await;
    assert_eq!(b.assignments.len(), 1, "the ended attempt's slot is free");
    let b = b.assignments[0].attempt_id.clone();
    let status: String = sqlx::query_scalar("SELECT status FROM attempts WHERE id = $1::uuid")
        .bind(&a)
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    assert_eq!(
        status, "claimed",
        "the first attempt's end was never recorded"
    );

    // The new attempt counts: with only the old one listed as ended, the host is full again.
    let again = raw_claim(&stack, &hosts[0], &[&a, &b], &[&a]).await;
    assert!(again.assignments.is_empty());
    assert_eq!(again.waiting, 1);
    // Its end is not recorded: the host must keep listing it.
    assert!(again.recorded_ends.is_empty(), "{:?}", again.recorded_ends);

    // Once the end is recorded, the reply says so, and the slot is still the host's own.
    sqlx::query("UPDATE attempts SET status = 'failed', finished_at = now() WHERE id = $1::uuid")
        .bind(&a)
        .execute(&stack.pg)
        .await
        .unwrap();
    let recorded = raw_claim(&stack, &hosts[0], &[&a, &b], &[&a]).await;
    assert_eq!(recorded.recorded_ends, vec![a.clone()]);
    assert!(recorded.assignments.is_empty(), "b still runs there");
}

/// A host lists an ended attempt in its claims only until a reply says its end is recorded: a
/// busy host's requests stay as small as what it actually holds (they once carried its last 256
/// attempts, 9 KB, on every claim). The gateway's direct dispatch is off, so that every task
/// comes through a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_stops_listing_ends_once_they_are_recorded() {
    use agentscope_schemas::v1::ClaimRequest;
    use futures::StreamExt as _;
    use prost::Message as _;
    let stack = Stack::start(
        "limits-listed",
        StackOptions {
            gateway_env: vec![("AGENTSCOPE_DIRECT_DISPATCH".into(), "false".into())],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent("quick", "pool", &["true"], None)
        .await
        .unwrap();
    let _host = stack.host("h1", "pool", 1).await.unwrap();
    // Every claim request, as the scheduler's queue group gets it.
    let nc = stack.nats.service_client("scheduler").await.unwrap();
    let mut claims = nc
        .subscribe(agentscope_bus::subjects::HOST_CLAIM_ALL)
        .await
        .unwrap();
    nc.flush().await.unwrap();
    for i in 0..8 {
        let task_id = stack
            .submit(json!({"agent_id": agent, "input": format!("task {i}")}))
            .await
            .unwrap();
        stack
            .wait_task(&task_id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
    }
    // The claims of the last tasks list only the few ends still unrecorded when they were sent.
    let mut seen = Vec::new();
    while seen.len() < 500
        && let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), claims.next()).await
    {
        let req = ClaimRequest::decode(m.payload.as_ref()).unwrap();
        seen.push((req.held_attempts.len(), req.ended_attempts.len()));
    }
    assert!(seen.len() >= 8, "a claim per task at least: {seen:?}");
    let (held, ended) = seen
        .iter()
        .rev()
        .take(3)
        .fold((0, 0), |(h, e), (h2, e2)| (h.max(*h2), e.max(*e2)));
    assert!(
        held <= 3 && ended <= 3,
        "the last claims list {held} held and {ended} ended attempts of 8 run: {seen:?}"
    );
}

/// Registers a host that never runs anything, over its own NATS connection: what it claims stays
/// claimed until the test says otherwise.
async fn raw_host(stack: &Stack, name: &str, capacity: u32) -> (String, async_nats::Client) {
    use agentscope_schemas::v1::{HostRegistered, HostRegistration};
    use prost::Message as _;
    let id = uuid::Uuid::new_v4().to_string();
    let nc = async_nats::ConnectOptions::new()
        .user_and_password(id.clone(), stack.host_token.clone())
        .custom_inbox_prefix(agentscope_bus::auth::host_inbox(&id))
        .connect(stack.nats.url())
        .await
        .unwrap();
    let reg = HostRegistration {
        host_id: id.clone(),
        host_token: stack.host_token.clone(),
        name: name.into(),
        pool: "pool".into(),
        capacity,
        providers: vec![agentscope_schemas::v1::ProviderDescriptor {
            name: "command".into(),
            installed: true,
            logged_in: true,
            ..Default::default()
        }],
        ..Default::default()
    };
    let answer = nc
        .request(
            agentscope_bus::subjects::host_register(&id),
            reg.encode_to_vec().into(),
        )
        .await
        .unwrap();
    let answer = HostRegistered::decode(answer.payload.as_ref()).unwrap();
    assert!(answer.ok, "{}", answer.message);
    (id, nc)
}

/// The lease bucket, read as the scheduler reads it.
async fn lease_bucket(stack: &Stack) -> async_nats::jetstream::kv::Store {
    let service = stack.nats.service_client("scheduler").await.unwrap();
    async_nats::jetstream::new(service)
        .get_key_value(agentscope_bus::BUCKET_LEASES)
        .await
        .unwrap()
}

/// One claim of a raw host for one slot, listing `held` and `ended`; refusals fail the test.
async fn raw_claim(
    stack: &Stack,
    (id, nc): &(String, async_nats::Client),
    held: &[&str],
    ended: &[&str],
) -> agentscope_schemas::v1::ClaimOffer {
    use agentscope_schemas::v1::{ClaimOffer, ClaimRequest};
    use prost::Message as _;
    let req = ClaimRequest {
        host_id: id.clone(),
        host_token: stack.host_token.clone(),
        free_slots: 1,
        held_attempts: held.iter().map(|s| s.to_string()).collect(),
        ended_attempts: ended.iter().map(|s| s.to_string()).collect(),
    };
    let reply = nc
        .request(
            agentscope_bus::subjects::host_claim(id),
            req.encode_to_vec().into(),
        )
        .await
        .unwrap();
    let offer = ClaimOffer::decode(reply.payload.as_ref()).unwrap();
    assert!(offer.error_code.is_empty(), "{}", offer.message);
    offer
}

/// How long after its claim attempt `id` ended, and how (waits for its end).
async fn ended_after_claim(stack: &Stack, id: &str) -> (f64, String) {
    kit::wait_for(
        "the unleased attempt to be lost",
        Duration::from_secs(30),
        || async {
            sqlx::query_as::<_, (f64, String)>(
                "SELECT extract(epoch FROM finished_at - claimed_at)::float8, status
                 FROM attempts WHERE id = $1::uuid AND finished_at IS NOT NULL",
            )
            .bind(id)
            .fetch_optional(&stack.pg)
            .await
            .unwrap()
        },
    )
    .await
    .unwrap()
}

/// A claim commits its attempts first and creates their leases after. An attempt whose lease
/// cannot be created goes back to the queue (nobody was offered it) and is claimed later; one
/// left claimed without a lease (its scheduler died between the two) is retried, but only once a
/// lease TTL has passed since its claim; so is one its host already reports running (a direct
/// dispatch's host may start before the lease created beside the offer exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_without_its_lease_is_requeued_or_retried_after_a_lease_ttl() {
    use agentscope_schemas::v1::LeaseRecord;
    use prost::Message as _;
    let stack = Stack::start(
        "limits-unleased",
        StackOptions {
            lease_ttl_ms: 3_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (agent, _) = stack
        .command_agent("unleased", "pool", &["true"], None)
        .await
        .unwrap();
    let raw = raw_host(&stack, "raw", 2).await;
    let host = raw.0.clone();
    let claim = || raw_claim(&stack, &raw, &[], &[]);
    let attempt_of =
        |task: serde_json::Value| task["attempts"][0]["id"].as_str().unwrap().to_string();
    let first = attempt_of(
        stack
            .api
            .post("/v1/tasks", json!({"agent_id": agent, "input": "one"}))
            .await
            .unwrap(),
    );
    let row = |id: String| {
        let pg = stack.pg.clone();
        async move {
            sqlx::query_as::<_, (String, Option<String>, Option<i64>)>(
                "SELECT status, host_id::text, lease_token FROM attempts WHERE id = $1::uuid",
            )
            .bind(&id)
            .fetch_one(&pg)
            .await
            .unwrap()
        }
    };

    // Someone else holds the attempt's lease key: the claim commits, cannot create the lease,
    // and puts the attempt back.
    let leases = lease_bucket(&stack).await;
    let key = agentscope_bus::lease_key(&host, &first);
    leases.create(&key, "squatter".into()).await.unwrap();
    let offer = claim().await;
    assert!(offer.assignments.is_empty(), "{:?}", offer.assignments);
    assert_eq!(offer.waiting, 1, "the attempt waits again");
    assert_eq!(row(first.clone()).await, ("queued".into(), None, None));

    // Without the squatter it is claimed, under a fencing token the lease record carries.
    leases.purge(&key).await.unwrap();
    let offer = claim().await;
    assert_eq!(offer.assignments.len(), 1);
    let a = &offer.assignments[0];
    assert_eq!(a.attempt_id, first);
    let (status, holder, token) = row(first.clone()).await;
    assert_eq!(
        (status.as_str(), holder.as_deref()),
        ("claimed", Some(host.as_str()))
    );
    assert_eq!(token, Some(a.lease_token as i64));
    let entry = leases.entry(&key).await.unwrap().expect("the lease exists");
    assert_eq!(entry.revision, a.lease_revision);
    let record = LeaseRecord::decode(entry.value.as_ref()).unwrap();
    assert_eq!(
        (record.token, record.host_id.as_str()),
        (a.lease_token, host.as_str())
    );

    // A claim whose scheduler died after its commit, before its lease: claimed, no lease key.
    let second = attempt_of(
        stack
            .api
            .post("/v1/tasks", json!({"agent_id": agent, "input": "two"}))
            .await
            .unwrap(),
    );
    sqlx::query(
        "UPDATE attempts SET status = 'claimed', host_id = $2::uuid,
                lease_token = nextval('lease_tokens'), claimed_at = clock_timestamp()
         WHERE id = $1::uuid",
    )
    .bind(&second)
    .bind(&host)
    .execute(&stack.pg)
    .await
    .unwrap();
    // The same for an attempt its host already reports running (a direct dispatch's host may,
    // before the lease the gateway creates meanwhile exists).
    let third = attempt_of(
        stack
            .api
            .post("/v1/tasks", json!({"agent_id": agent, "input": "three"}))
            .await
            .unwrap(),
    );
    sqlx::query(
        "UPDATE attempts SET status = 'running', host_id = $2::uuid,
                lease_token = nextval('lease_tokens'), claimed_at = clock_timestamp(),
                started_at = clock_timestamp()
         WHERE id = $1::uuid",
    )
    .bind(&third)
    .bind(&host)
    .execute(&stack.pg)
    .await
    .unwrap();
    let (ended_after, status) = ended_after_claim(&stack, &third).await;
    assert_eq!(status, "lost");
    assert!(
        ended_after >= 3.0,
        "running, lost {ended_after} s after its claim, before a lease TTL (3 s)"
    );

    let (ended_after, status) = ended_after_claim(&stack, &second).await;
    assert_eq!(status, "lost");
    assert!(
        ended_after >= 3.0,
        "lost {ended_after} s after its claim, before a lease TTL (3 s)"
    );
    let retried: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts a JOIN attempts b ON b.task_id = a.task_id
         WHERE a.id = $1::uuid AND b.number = 2",
    )
    .bind(&second)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(retried, 1, "a new attempt is scheduled");
}

/// A claim whose scheduler died between its commit and the lease (so nobody was offered the
/// attempt) is offered again to its host when that host next asks for work without listing it,
/// under the claim's fencing token and with the lease created then: the attempt runs once, as
/// attempt 1, instead of being lost and retried. Not while the claim is younger than half a
/// host's claim wait (an offer may still be on its way: the gateway's, crossing the host's
/// claim), since a second offer would carry a second task token and void the first; nor does
/// such a young claim keep the host's claim from taking new work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_committed_without_its_lease_is_offered_again_to_its_host() {
    use agentscope_schemas::v1::LeaseRecord;
    use prost::Message as _;
    let stack = Stack::start("limits-reoffer", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("reoffer", "pool", &["true"], None)
        .await
        .unwrap();
    let raw = raw_host(&stack, "raw", 2).await;
    let host = raw.0.clone();
    let task = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "one"}))
        .await
        .unwrap();
    let attempt = task["attempts"][0]["id"].as_str().unwrap().to_string();
    // Taken before the claim's commit: no sooner than its age allows, whatever the steps below
    // take on a busy machine.
    let claimed = std::time::Instant::now();
    let token: i64 = sqlx::query_scalar(
        "UPDATE attempts SET status = 'claimed', host_id = $2::uuid,
                lease_token = nextval('lease_tokens'), claimed_at = clock_timestamp()
         WHERE id = $1::uuid RETURNING lease_token",
    )
    .bind(&attempt)
    .bind(&host)
    .fetch_one(&stack.pg)
    .await
    .unwrap();

    // Young, it neither comes again nor keeps the host from taking new work.
    let two = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "two"}))
        .await
        .unwrap();
    let two = two["attempts"][0]["id"].as_str().unwrap().to_string();
    let young = raw_claim(&stack, &raw, &[], &[]).await;
    let got: Vec<&str> = young
        .assignments
        .iter()
        .map(|a| a.attempt_id.as_str())
        .collect();
    assert_eq!(got, [two.as_str()]);
    // Half of a host's claim wait (a third of the 3 s lease TTL), then it is offered again.
    let offer = kit::wait_for("the claim offered again", Duration::from_secs(10), || {
        let raw = &raw;
        let stack = &stack;
        let two = &two;
        async move {
            let offer = raw_claim(stack, raw, &[two.as_str()], &[]).await;
            (!offer.assignments.is_empty()).then_some(offer)
        }
    })
    .await
    .unwrap();
    assert!(
        claimed.elapsed() >= Duration::from_millis(500),
        "offered again {:?} after its claim",
        claimed.elapsed()
    );
    assert_eq!(offer.assignments.len(), 1, "{:?}", offer.assignments);
    let a = &offer.assignments[0];
    assert_eq!(
        (a.attempt_id.as_str(), a.lease_token),
        (attempt.as_str(), token as u64)
    );
    let leases = lease_bucket(&stack).await;
    let entry = leases
        .entry(agentscope_bus::lease_key(&host, &attempt))
        .await
        .unwrap()
        .expect("the lease is created with the offer");
    assert_eq!(entry.revision, a.lease_revision);
    let record = LeaseRecord::decode(entry.value.as_ref()).unwrap();
    assert_eq!(
        (record.token, record.host_id.as_str()),
        (token as u64, host.as_str())
    );
    let (status, number): (String, i64) = sqlx::query_as(
        "SELECT a.status, (SELECT count(*) FROM attempts b WHERE b.task_id = a.task_id)
         FROM attempts a WHERE a.id = $1::uuid",
    )
    .bind(&attempt)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!((status.as_str(), number), ("claimed", 1));
}

/// status, failure_class, started_at (ms), exit_code, finished at or after its start, last_seq.
type EndRow = (String, Option<String>, Option<i64>, Option<i32>, bool, i64);

/// Attempts that end in one recorder batch end in one statement: an attempt whose `running` and
/// end come together gets its start time from the `running` event, a task whose cancellation
/// was requested ends `cancelled` whatever its failure, an attempt that only started is
/// `running`, and the host's counter counts the one still active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_ending_in_one_batch_end_together_with_their_start_times() {
    use agentscope_schemas::v1::{AttemptState, ExecutionEvent, Lifecycle, execution_event::Body};
    use prost::Message as _;
    let mut stack = Stack::start("limits-batch-end", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("batch-end", "pool", &["true"], None)
        .await
        .unwrap();
    let raw = raw_host(&stack, "raw", 3).await;
    let host = raw.0.clone();
    let mut claimed: Vec<(String, String, u64)> = Vec::new();
    for input in ["ok", "cancelled", "running"] {
        let task = stack
            .api
            .post("/v1/tasks", json!({"agent_id": agent, "input": input}))
            .await
            .unwrap();
        let held: Vec<&str> = claimed.iter().map(|(_, a, _)| a.as_str()).collect();
        let offer = raw_claim(&stack, &raw, &held, &[]).await;
        assert_eq!(offer.assignments.len(), 1, "{input}");
        let a = &offer.assignments[0];
        assert_eq!(a.attempt_id, task["attempts"][0]["id"].as_str().unwrap());
        claimed.push((
            task["id"].as_str().unwrap().to_string(),
            a.attempt_id.clone(),
            a.lease_token,
        ));
    }
    sqlx::query("UPDATE tasks SET cancel_requested_at = now() WHERE id = $1::uuid")
        .bind(&claimed[1].0)
        .execute(&stack.pg)
        .await
        .unwrap();

    let started_ms = agentscope_bus::now_ms() - 5_000;
    let event = |(_, attempt, token): &(String, String, u64), seq: u64, state: AttemptState| {
        ExecutionEvent {
            attempt_id: attempt.clone(),
            seq,
            lease_token: *token,
            host_id: host.clone(),
            at_ms: started_ms + seq as i64,
            body: Some(Body::Lifecycle(Lifecycle {
                state: state as i32,
                failure_class: if state == AttemptState::Failed {
                    "provider_error".into()
                } else {
                    String::new()
                },
                detail: String::new(),
                exit_code: if state == AttemptState::Failed { 3 } else { 0 },
                has_exit_code: state != AttemptState::Running,
            })),
        }
        .encode_to_vec()
    };
    // Published while no scheduler runs, so that the recorder finds them together.
    stack.scheduler.terminate(Duration::from_secs(20));
    let js = async_nats::jetstream::new(stack.nats.service_client("scheduler").await.unwrap());
    let events = [
        (0, event(&claimed[0], 1, AttemptState::Running)),
        (1, event(&claimed[1], 1, AttemptState::Running)),
        (2, event(&claimed[2], 1, AttemptState::Running)),
        (0, event(&claimed[0], 2, AttemptState::Succeeded)),
        (1, event(&claimed[1], 2, AttemptState::Failed)),
    ];
    for (i, payload) in events {
        let subject = agentscope_bus::subjects::events(&host, &claimed[i].1);
        js.publish(subject, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    stack.restart_scheduler(false).await.unwrap();

    let rows = kit::wait_for("the batch recorded", Duration::from_secs(30), || async {
        let rows: Vec<EndRow> = sqlx::query_as(
            "SELECT status, failure_class,
                        (extract(epoch FROM started_at) * 1000)::int8, exit_code,
                        finished_at IS NOT NULL AND finished_at >= started_at, last_seq
                 FROM attempts WHERE id = ANY($1::uuid[]) ORDER BY array_position($1::uuid[], id)",
        )
        .bind(claimed.iter().map(|c| c.1.clone()).collect::<Vec<_>>())
        .fetch_all(&stack.pg)
        .await
        .unwrap();
        (rows.iter().map(|r| r.5).sum::<i64>() == 5).then_some(rows)
    })
    .await
    .unwrap();
    let s = Some(started_ms + 1);
    assert_eq!(
        rows,
        vec![
            ("succeeded".into(), None, s, Some(0), true, 2),
            (
                "cancelled".into(),
                Some("cancelled".into()),
                s,
                Some(3),
                true,
                2
            ),
            ("running".into(), None, s, None, false, 1),
        ]
    );
    let active: i32 = sqlx::query_scalar(
        "SELECT active FROM attempt_counts_now WHERE scope = 'host' AND id = $1::uuid",
    )
    .bind(&host)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(
        active, 1,
        "the running attempt is the host's only active one"
    );
    // Neither ended attempt is retried: a success, and a task whose cancellation was requested.
    let attempts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE task_id = ANY($1::uuid[])")
            .bind(claimed.iter().map(|c| c.0.clone()).collect::<Vec<_>>())
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    assert_eq!(attempts, 3);
}

/// One of the gateway's metrics, by its `result` label, from its `/metrics`.
async fn dispatches(stack: &Stack, result: &str) -> u64 {
    let series = format!("agentscope_dispatch_total{{result=\"{result}\"}}");
    metric(&stack.api.base, &series).await.unwrap() as u64
}

/// A task whose pool has an idle host is claimed for that host and offered to it by the
/// gateway, in the request that stores it: the answer already says `claimed` on that host, and
/// the attempt runs without a nudge or a claim through the scheduler (the host polls only every
/// ten minutes here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_for_an_idle_host_is_claimed_and_offered_by_the_gateway() {
    let stack = Stack::start("dispatch-direct", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("direct", "pool", &["true"], None)
        .await
        .unwrap();
    let state = stack.dir.path.join("host-h1-state");
    let _h1 = stack
        .spawn_host(
            "h1",
            "pool",
            2,
            &state,
            &[("AGENTSCOPE_POLL_INTERVAL_MS", "600000")],
        )
        .unwrap();
    stack.wait_host_ready("h1").await.unwrap();
    let host: String = sqlx::query_scalar("SELECT id::text FROM hosts WHERE name = 'h1'")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    for i in 0..3 {
        let t = stack
            .api
            .post(
                "/v1/tasks",
                json!({"agent_id": agent, "input": format!("direct {i}")}),
            )
            .await
            .unwrap();
        assert_eq!(t["status"], "running", "{t:#}");
        assert_eq!(t["attempts"][0]["status"], "claimed", "{t:#}");
        assert_eq!(t["attempts"][0]["host_id"], host.as_str(), "{t:#}");
        let id = t["id"].as_str().unwrap();
        stack
            .wait_task(id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
    }
    // The offer goes out while the gateway creates the lease: the host learns its revision on
    // its first renewal, and keeps it while its provider outlives the lease's TTL (3 s here).
    let (slow, _) = stack
        .command_agent("slow", "pool", &["sleep", "4"], None)
        .await
        .unwrap();
    let t = stack
        .api
        .post("/v1/tasks", json!({"agent_id": slow, "input": "slow"}))
        .await
        .unwrap();
    assert_eq!(t["attempts"][0]["status"], "claimed", "{t:#}");
    let (id, attempt) = (
        t["id"].as_str().unwrap(),
        t["attempts"][0]["id"].as_str().unwrap(),
    );
    let leases = lease_bucket(&stack).await;
    let key = agentscope_bus::lease_key(&host, attempt);
    // The POST answers once the host took the offer; the lease it created meanwhile is there
    // before the host's first renewal (a fifth of the TTL later).
    let created = kit::wait_for("the lease created", Duration::from_secs(3), || {
        let (leases, key) = (&leases, &key);
        async move { leases.entry(key).await.unwrap().map(|e| e.revision) }
    })
    .await
    .unwrap();
    kit::wait_for("the lease renewed", Duration::from_secs(10), || {
        let (leases, key) = (&leases, &key);
        async move {
            let e = leases.entry(key).await.unwrap()?;
            (e.operation == async_nats::jetstream::kv::Operation::Put && e.revision > created)
                .then_some(())
        }
    })
    .await
    .unwrap();
    // The dispatched attempt counts on the host's counter once (the statement that dispatched it
    // and the trigger on `attempts` do not both count it), and its end takes it off again.
    let host_active = || async {
        sqlx::query_scalar::<_, i32>(
            "SELECT active FROM attempt_counts_now WHERE scope = 'host' AND id = $1::uuid",
        )
        .bind(&host)
        .fetch_one(&stack.pg)
        .await
        .unwrap()
    };
    assert_eq!(host_active().await, 1, "the running attempt counts once");
    let done = stack
        .wait_task(id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done["attempts"].as_array().unwrap().len(), 1, "{done:#}");
    assert_eq!(host_active().await, 0, "the ended attempt counts no more");

    assert_eq!(dispatches(&stack, "offered").await, 4);
    let claims = claims_answered(&stack.scheduler_health).await;
    assert_eq!(claims.get("offered"), None, "{claims:?}");
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    assert_eq!(attempts, 4, "one attempt per task");
}

/// A host whose uids are its own: a directory is prepared ahead only with a uid free at once,
/// and hosts of other tests on this machine, killed holding uids of the shared range, leave
/// uids that need a scan first.
async fn private_uids_host(
    stack: &Stack,
    name: &str,
    capacity: u32,
    first_uid: u32,
) -> (kit::Proc, std::path::PathBuf) {
    let state = stack.dir.path.join(format!("host-{name}-state"));
    let locks = stack.dir.path.join(format!("host-{name}-uids"));
    let uids = format!("{first_uid}-{}", first_uid + 15);
    let p = stack
        .spawn_host(
            name,
            "pool",
            capacity,
            &state,
            &[
                ("AGENTSCOPE_RUN_AS_UIDS", uids.as_str()),
                ("AGENTSCOPE_RUN_AS_LOCK_DIR", locks.to_str().unwrap()),
            ],
        )
        .unwrap();
    stack.wait_host_ready(name).await.unwrap();
    (p, state)
}

/// The gateway's early word (`ClaimOffer.prepare_only`, published while its statement may claim
/// the attempt for the host) only has an idle host prepare the attempt's task directory, given
/// to the uid it holds for it: nothing starts, nothing is recorded, and what nothing brings goes
/// after a few seconds, its uid free again. A word with an id that is no plain UUID, or for a
/// task with a repository to clone, prepares nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_word_prepares_an_idle_hosts_directory_and_starts_nothing() {
    use agentscope_schemas::v1::{AttemptAssignment, ClaimOffer, TaskSpec};
    use prost::Message as _;
    use std::os::unix::fs::MetadataExt as _;
    let stack = Stack::start("dispatch-early-word", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("after", "pool", &["true"], None)
        .await
        .unwrap();
    let (_h1, state) = private_uids_host(&stack, "h1", 1, 1_900_100_000).await;
    let host: String = sqlx::query_scalar("SELECT id::text FROM hosts WHERE name = 'h1'")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    let service = stack.nats.service_client("gateway").await.unwrap();
    let word = |attempt: &str, input: &str, repository: &str| ClaimOffer {
        assignments: vec![AttemptAssignment {
            attempt_id: attempt.into(),
            task_id: uuid::Uuid::now_v7().to_string(),
            workspace_id: uuid::Uuid::now_v7().to_string(),
            attempt_number: 1,
            spec: Some(TaskSpec {
                provider: "command".into(),
                command: vec!["true".into()],
                input: input.into(),
                repository: repository.into(),
                ..Default::default()
            }),
            ..Default::default()
        }],
        prepare_only: true,
        ..Default::default()
    };
    let say = |w: ClaimOffer| {
        let (service, subject) = (service.clone(), agentscope_bus::subjects::host_offer(&host));
        async move {
            service
                .publish(subject, w.encode_to_vec().into())
                .await
                .unwrap();
            service.flush().await.unwrap();
        }
    };
    let tasks = state.join("tasks");
    let cloned = uuid::Uuid::now_v7().to_string();
    say(word("../../escaped", "tricked", "")).await;
    say(word(&cloned, "to clone", "/nonexistent/repo")).await;
    let attempt = uuid::Uuid::now_v7().to_string();
    say(word(&attempt, "early input", "")).await;
    // The host takes its offers in order: once the last word's directory is there, the two
    // before it were handled.
    let input = tasks.join(&attempt).join("input").join("INPUT.md");
    let written = kit::wait_for("the directory prepared", Duration::from_secs(10), || {
        let input = input.clone();
        async move { std::fs::read_to_string(&input).ok() }
    })
    .await
    .unwrap();
    assert_eq!(written, "early input");
    let root = std::fs::metadata(tasks.join(&attempt)).unwrap();
    assert_ne!(root.uid(), 0, "the directory is given to the attempt's uid");
    assert_eq!(root.mode() & 0o777, 0o700);
    for entry in ["home", "tmp", "input", "input/INPUT.md", "input/ISSUE.md"] {
        let m = std::fs::metadata(tasks.join(&attempt).join(entry)).unwrap();
        assert_eq!(m.uid(), root.uid(), "{entry} is the attempt's");
    }
    assert!(
        !tasks.join(&cloned).exists(),
        "a clone is not prepared ahead"
    );
    assert!(!state.join("escaped").exists() && !stack.dir.path.join("escaped").exists());
    let names: Vec<String> = std::fs::read_dir(&tasks)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![attempt.clone()], "only the prepared directory");
    // Nothing nobody brought goes; nothing ran, nothing was recorded.
    kit::wait_for("the preparation removed", Duration::from_secs(10), || {
        let root = tasks.join(&attempt);
        async move { (!root.exists()).then_some(()) }
    })
    .await
    .unwrap();
    let recorded: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM attempts) + (SELECT count(*) FROM execution_events)",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(recorded, 0);
    // Its uid is free again: the host's one slot runs a task.
    let t = stack
        .submit(json!({"agent_id": agent, "input": "after"}))
        .await
        .unwrap();
    stack
        .wait_task(&t, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
}

/// A task directly dispatched to the host that ran the pool's previous one is prepared there
/// while the gateway's statement runs (the early word) and starts in that directory, with its
/// own input, given to its uid; the next task, with other input, gets a directory of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatched_attempt_starts_in_the_directory_prepared_for_it() {
    let stack = Stack::start("dispatch-prepared", StackOptions::default())
        .await
        .unwrap();
    let script = r#"stat -c '%u %a' "$AGENTSCOPE_TASK_DIR"; id -u; cat "$AGENTSCOPE_INPUT_DIR/INPUT.md"; echo"#;
    let (agent, _) = stack
        .command_agent("prepared", "pool", &["sh", "-c", script], None)
        .await
        .unwrap();
    // Two slots: the word finds one free even while the previous attempt's end is still
    // being handled on the host after it was recorded.
    let _h1 = private_uids_host(&stack, "h1", 2, 1_900_100_100).await;
    let mut attempts = Vec::new();
    for i in 0..3 {
        let t = stack
            .api
            .post(
                "/v1/tasks",
                json!({"agent_id": agent, "input": format!("input {i}")}),
            )
            .await
            .unwrap();
        assert_eq!(t["attempts"][0]["status"], "claimed", "{t:#}");
        let id = t["id"].as_str().unwrap();
        let done = stack
            .wait_task(id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
        let attempt = done["attempts"][0]["id"].as_str().unwrap().to_string();
        let texts: Vec<String> = stack
            .events(&format!("/v1/attempts/{attempt}/events"))
            .await
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "output")
            .map(|e| e["payload"]["text"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(texts.len(), 3, "{texts:?}");
        let uid = texts[1].clone();
        assert_ne!(uid, "0");
        assert_eq!(
            texts[0],
            format!("{uid} 700"),
            "the directory is the attempt's own"
        );
        assert_eq!(texts[2], format!("input {i}"));
        attempts.push(attempt);
    }
    // The first had no host to tell early; the others were prepared ahead (as each attempt's
    // last log line on the host says).
    let log = stack.log("host-h1");
    let ahead: Vec<&String> = attempts
        .iter()
        .filter(|a| {
            log.lines().any(|l| {
                l.contains("attempt done on this host")
                    && l.contains(a.as_str())
                    && (l.contains("prepared_ahead=true") || l.contains("\"prepared_ahead\":true"))
            })
        })
        .collect();
    assert_eq!(ahead, vec![&attempts[1], &attempts[2]], "host log:\n{log}");
}

/// An offer nobody takes goes back to the queue before the answer: a host that is not listening
/// (no responders) and one that declines (no free slot) leave the attempt queued, without a host,
/// a fencing token or a lease key, and the host's counter where it was; one that accepts has it
/// claimed under the offer's token and lease, which its next claim does not offer again. No offer
/// while older work of the pool waits (the hosts' claims take the oldest first), nor to a host
/// with work active (a busy pool is left to the hosts' claims). The early words go only to the
/// host the pool's last dispatch was stored for, ask no answer and carry no credential.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_nobody_takes_goes_back_to_the_queue() {
    use agentscope_schemas::v1::{ClaimOffer, OfferReply};
    use futures::StreamExt;
    use prost::Message as _;
    let stack = Stack::start("dispatch-declined", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("declined", "pool", &["true"], None)
        .await
        .unwrap();
    let raw = raw_host(&stack, "raw", 2).await;
    let host = raw.0.clone();
    let leases = lease_bucket(&stack).await;
    let submit = |input: &'static str| {
        let api = stack.api.clone();
        let agent = agent.clone();
        let pg = stack.pg.clone();
        let host = host.clone();
        async move {
            // Its heartbeat, as the scheduler mirrors it (a raw host does not beat).
            sqlx::query("UPDATE hosts SET last_seen_at = now() WHERE id = $1::uuid")
                .bind(&host)
                .execute(&pg)
                .await
                .unwrap();
            api.post("/v1/tasks", json!({"agent_id": agent, "input": input}))
                .await
                .unwrap()
        }
    };
    let queued_again = |t: serde_json::Value| {
        let pg = stack.pg.clone();
        let leases = leases.clone();
        let host = host.clone();
        async move {
            assert_eq!(t["attempts"][0]["status"], "queued", "{t:#}");
            let attempt = t["attempts"][0]["id"].as_str().unwrap().to_string();
            let row: (String, Option<String>, Option<i64>, i64) = sqlx::query_as(
                "SELECT status, host_id::text, lease_token,
                        COALESCE((SELECT active FROM attempt_counts_now WHERE scope = 'host' AND id = $2::uuid), 0)::bigint
                 FROM attempts WHERE id = $1::uuid",
            )
            .bind(&attempt)
            .bind(&host)
            .fetch_one(&pg)
            .await
            .unwrap();
            assert_eq!(row, ("queued".into(), None, None, 0));
            let key = agentscope_bus::lease_key(&host, &attempt);
            assert!(leases.get(&key).await.unwrap().is_none(), "no lease left");
            (t["id"].as_str().unwrap().to_string(), attempt)
        }
    };
    let cancel = |task: String| {
        let stack = &stack;
        async move {
            stack
                .api
                .post(&format!("/v1/tasks/{task}/cancel"), json!({}))
                .await
                .unwrap();
            stack
                .wait_attempt(&task, 1, "cancelled", Duration::from_secs(30))
                .await
                .unwrap();
        }
    };

    // Not listening: nobody responds.
    let (first, _) = queued_again(submit("first").await).await;
    assert_eq!(dispatches(&stack, "declined").await, 1);

    // Listening from now on: declining the next offer, accepting the one after.
    let mut offers = raw
        .1
        .subscribe(agentscope_bus::subjects::host_offer(&host))
        .await
        .unwrap();
    raw.1.flush().await.unwrap();
    let nc = raw.1.clone();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let (words_tx, mut words_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut answers = [false, true].into_iter();
        while let Some(msg) = offers.next().await {
            let offer = ClaimOffer::decode(msg.payload.as_ref()).unwrap();
            if offer.prepare_only {
                // The gateway's early word: no answer asked, nothing claimed, no credential.
                let a = &offer.assignments[0];
                assert!(msg.reply.is_none());
                assert!(a.task_token.is_empty() && a.lease_token == 0 && a.lease_key.is_empty());
                let _ = words_tx.send(a.attempt_id.clone());
                continue;
            }
            let accept = answers.next().expect("two offers");
            let ids: Vec<String> = offer
                .assignments
                .iter()
                .map(|a| a.attempt_id.clone())
                .collect();
            let reply = if accept {
                OfferReply {
                    accepted: ids,
                    ..Default::default()
                }
            } else {
                OfferReply {
                    declined: ids,
                    ..Default::default()
                }
            };
            nc.publish(msg.reply.unwrap(), reply.encode_to_vec().into())
                .await
                .unwrap();
            let _ = seen_tx.send(offer);
        }
    });
    // The offer answered before the submission's answer (handed over just after the reply).
    async fn next_offer(rx: &mut tokio::sync::mpsc::UnboundedReceiver<ClaimOffer>) -> ClaimOffer {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("an offer")
            .expect("the responder runs")
    }

    // The first task still waits: the host is idle, but older work goes first, by claims.
    let (second, second_attempt) = queued_again(submit("second").await).await;
    assert_eq!(dispatches(&stack, "declined").await, 1);
    assert!(
        seen_rx.try_recv().is_err(),
        "no offer while older work waits"
    );
    cancel(first).await;
    cancel(second).await;

    // Declined.
    let (third, third_attempt) = queued_again(submit("third").await).await;
    let declined = next_offer(&mut seen_rx).await;
    assert_eq!(declined.assignments[0].attempt_id, third_attempt);
    assert_eq!(dispatches(&stack, "declined").await, 2);
    cancel(third).await;

    // Accepted: claimed for the host under the offer's token and lease.
    let fourth = submit("fourth").await;
    assert_eq!(fourth["attempts"][0]["status"], "claimed", "{fourth:#}");
    assert_eq!(
        fourth["attempts"][0]["host_id"],
        host.as_str(),
        "{fourth:#}"
    );
    let fourth = fourth["attempts"][0]["id"].as_str().unwrap().to_string();
    let accepted = next_offer(&mut seen_rx).await;
    let a = &accepted.assignments[0];
    assert_eq!(a.attempt_id, fourth);
    assert_eq!(dispatches(&stack, "offered").await, 1);
    let (status, holder, token): (String, String, i64) = sqlx::query_as(
        "SELECT status, host_id::text, lease_token FROM attempts WHERE id = $1::uuid",
    )
    .bind(&fourth)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), holder.as_str()),
        ("claimed", host.as_str())
    );
    assert_eq!(token as u64, a.lease_token);
    let entry = leases
        .entry(agentscope_bus::lease_key(&host, &fourth))
        .await
        .unwrap()
        .expect("the offer's lease");
    // Created while the offer travelled: the host learns its revision when it first renews.
    assert_eq!(a.lease_revision, 0);
    assert!(entry.revision > 0);
    assert!(!a.task_token.is_empty());

    // A host with work active is not idle: no offer; its own claim, listing the fourth, gets
    // the fifth and not the fourth again.
    let fifth = submit("fifth").await;
    assert_eq!(fifth["attempts"][0]["status"], "queued", "{fifth:#}");
    let fifth = fifth["attempts"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(dispatches(&stack, "declined").await, 2);
    assert_eq!(dispatches(&stack, "offered").await, 1);
    let next = raw_claim(&stack, &raw, &[&fourth], &[]).await;
    let got: Vec<&str> = next
        .assignments
        .iter()
        .map(|a| a.attempt_id.as_str())
        .collect();
    assert_eq!(got, [fifth.as_str()]);
    // The early words: to the host the pool's last dispatch was stored for (the first's, then
    // the fourth's), none after a dispatch that stayed queued (the second's).
    let mut words = Vec::new();
    while words.len() < 3 {
        let w = tokio::time::timeout(Duration::from_secs(10), words_rx.recv())
            .await
            .expect("an early word");
        words.push(w.expect("the responder runs"));
    }
    assert_eq!(words, [second_attempt, fourth, fifth]);
    assert!(words_rx.try_recv().is_err());
}

/// An offer whose answer never comes (the host got it and its answer was lost, or it never got
/// it) leaves the attempt claimed for the host: the submission answers `claimed` once the wait is
/// over, and a host that does not have it gets it on its next claim that does not list it, under
/// the same fencing token and lease, and with a task token that works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_whose_answer_is_lost_comes_again_with_the_hosts_next_claim() {
    use agentscope_schemas::v1::ClaimOffer;
    use futures::StreamExt;
    use prost::Message as _;
    let stack = Stack::start("dispatch-lost", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("lost", "pool", &["true"], None)
        .await
        .unwrap();
    let raw = raw_host(&stack, "raw", 2).await;
    let host = raw.0.clone();
    // It hears offers and never answers.
    let mut offers = raw
        .1
        .subscribe(agentscope_bus::subjects::host_offer(&host))
        .await
        .unwrap();
    raw.1.flush().await.unwrap();
    let t = stack
        .api
        .post("/v1/tasks", json!({"agent_id": agent, "input": "lost"}))
        .await
        .unwrap();
    assert_eq!(t["attempts"][0]["status"], "claimed", "{t:#}");
    assert_eq!(t["attempts"][0]["host_id"], host.as_str(), "{t:#}");
    let attempt = t["attempts"][0]["id"].as_str().unwrap().to_string();
    let first = ClaimOffer::decode(offers.next().await.unwrap().payload.as_ref()).unwrap();
    let a = &first.assignments[0];
    assert_eq!(a.attempt_id, attempt);
    assert_eq!(dispatches(&stack, "offered").await, 1);

    let again = kit::wait_for("the attempt offered again", Duration::from_secs(10), || {
        let raw = &raw;
        let stack = &stack;
        async move {
            let offer = raw_claim(stack, raw, &[], &[]).await;
            (!offer.assignments.is_empty()).then_some(offer)
        }
    })
    .await
    .unwrap();
    let b = &again.assignments[0];
    assert_eq!(
        (b.attempt_id.as_str(), b.lease_token, b.lease_key.as_str()),
        (attempt.as_str(), a.lease_token, a.lease_key.as_str())
    );
    // The first offer's credential is void, the new one reads the task.
    let read = |token: String| {
        let base = stack.api.base.clone();
        async move {
            kit::http_client()
                .get(format!("{base}/v1/task"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(read(b.task_token.clone()).await, 200);
    assert_eq!(read(a.task_token.clone()).await, 401);
}

/// Direct dispatch keeps every limit: with an agent limit of 1, a second task finds an idle host
/// but is stored queued (not claimed) while the first runs, and runs after it, through a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_dispatch_keeps_the_agent_limit() {
    let stack = Stack::start("dispatch-limit", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("limited", "pool", &["sleep", "1"], Some(1))
        .await
        .unwrap();
    let _h1 = stack.host("h1", "pool", 1).await.unwrap();
    let _h2 = stack.host("h2", "pool", 1).await.unwrap();
    let post = |input: &'static str| {
        let api = stack.api.clone();
        let agent = agent.clone();
        async move {
            api.post("/v1/tasks", json!({"agent_id": agent, "input": input}))
                .await
                .unwrap()
        }
    };
    let first = post("first").await;
    assert_eq!(first["attempts"][0]["status"], "claimed", "{first:#}");
    let second = post("second").await;
    assert_eq!(second["attempts"][0]["status"], "queued", "{second:#}");
    assert!(second["attempts"][0]["host_id"].is_null(), "{second:#}");
    for t in [&first, &second] {
        stack
            .wait_task(
                t["id"].as_str().unwrap(),
                "succeeded",
                Duration::from_secs(60),
            )
            .await
            .unwrap();
    }
    let all: Vec<(f64, f64)> = host_intervals(&stack)
        .await
        .into_values()
        .flatten()
        .collect();
    assert_eq!(all.len(), 2);
    assert_eq!(max_overlap(&all), 1, "the agent ran two attempts at once");
}

/// An attempt's end takes no counter lock (migration 0013): with its host's counter row locked
/// (as a claim holds it from its check to its commit), the end is still recorded, the counter as
/// it stands (`attempt_counts_now`) already says the host is free, and the next claimer to lock
/// the row folds the pending delta into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_is_recorded_while_its_hosts_counter_is_locked() {
    let stack = Stack::start("limits-end-unlocked", StackOptions::default())
        .await
        .unwrap();
    let release = std::env::temp_dir().join(format!("agentscope-release-{}", uuid::Uuid::new_v4()));
    let wait = format!("until [ -e {} ]; do sleep 0.02; done", release.display());
    let (agent, _) = stack
        .command_agent("held", "pool", &["sh", "-c", &wait], None)
        .await
        .unwrap();
    let _host = stack.host("h1", "pool", 2).await.unwrap();
    let task = stack
        .submit(json!({"agent_id": agent, "input": "wait"}))
        .await
        .unwrap();
    let a = stack
        .wait_attempt(&task, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let host = a["host_id"].as_str().unwrap().to_string();
    let counter = |pg: sqlx::PgPool, view: &'static str| {
        let host = host.clone();
        async move {
            sqlx::query_scalar::<_, i32>(&format!(
                "SELECT active FROM {view} WHERE scope = 'host' AND id = $1::uuid"
            ))
            .bind(&host)
            .fetch_one(&pg)
            .await
            .unwrap()
        }
    };
    assert_eq!(counter(stack.pg.clone(), "attempt_counts_now").await, 1);

    let mut claim = stack.pg.begin().await.unwrap();
    sqlx::query(
        "SELECT active FROM attempt_counts WHERE scope = 'host' AND id = $1::uuid FOR UPDATE",
    )
    .bind(&host)
    .execute(&mut *claim)
    .await
    .unwrap();
    std::fs::write(&release, b"").unwrap();
    stack
        .wait_task(&task, "succeeded", Duration::from_secs(30))
        .await
        .unwrap();
    // Recorded with the row still locked: the end is a pending delta.
    assert_eq!(counter(stack.pg.clone(), "attempt_counts").await, 1);
    assert_eq!(counter(stack.pg.clone(), "attempt_counts_now").await, 0);
    claim.rollback().await.unwrap();
    let _ = std::fs::remove_file(&release);

    // A claimer's locked read folds it.
    let folded: i32 = sqlx::query_scalar(
        "INSERT INTO attempt_counts (scope, id, active) VALUES ('host', $1::uuid, 0)
         ON CONFLICT (scope, id) DO UPDATE SET active = attempt_counts.active RETURNING active",
    )
    .bind(&host)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(folded, 0);
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempt_count_deltas WHERE scope = 'host' AND id = $1::uuid",
    )
    .bind(&host)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(pending, 0);
    assert_eq!(counter(stack.pg.clone(), "attempt_counts").await, 0);
}

/// A claim and the sweeper's search for pools with ready work read the head of the queue, not
/// all of it: with 600 attempts queued and the planner's statistics taken while the queue was
/// empty (as they are during a burst, between two analyses), a claim for 4 slots takes the 4
/// oldest and reads few entries of the queue's index (its bounded count of waiting work, at
/// most 100, and the candidates it locks), where reading, joining and sorting the whole queue
/// would read every entry at least once; the sweep finds the pool from a few entries, and no
/// pool once its work is not due yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_the_ready_pools_sweep_read_the_head_of_a_long_queue() {
    let (stack, agent) =
        stack_with_stale_statistics("claim-queue-head", StackOptions::default()).await;
    // No host yet: every task stays queued.
    const QUEUED: usize = 600;
    let submitted = faults::submit(&stack, &agent, QUEUED).await;
    let (host, _nc) = raw_host(&stack, "reader", 4).await;
    let oldest: Vec<String> = sqlx::query_scalar(
        "SELECT id::text FROM attempts WHERE status = 'queued' ORDER BY not_before, created_at LIMIT 4",
    )
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    assert_eq!(submitted.len(), QUEUED);

    // The scheduler's claim statement, in a transaction of the test's own that is rolled back,
    // reading this backend's scan counters before and after it.
    let mut tx = stack.pg.begin().await.unwrap();
    let before = queue_entries_read(&mut tx).await;
    let taken: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(array_agg(x::text ORDER BY n), '{}') FROM claim_attempts($1::uuid, $2::uuid, 4,
             '{}', '{}', ARRAY['h1', 'h2', 'h3', 'h4'], 3600, 'deployment', 60000) c,
             unnest(c.r_ids) WITH ORDINALITY AS u(x, n)",
    )
    .bind(&host)
    .bind(&stack.workspace_id)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let read = queue_entries_read(&mut tx).await - before;
    tx.rollback().await.unwrap();
    assert_eq!(
        taken, oldest,
        "the claim takes the oldest attempts, in order"
    );
    assert!(
        read <= 150,
        "the claim read {read} entries of the queue's index for {QUEUED} queued attempts"
    );

    // The sweeper's pools with ready work (rolled back as well).
    let pool: String = sqlx::query_scalar("SELECT pool_id::text FROM hosts WHERE id = $1::uuid")
        .bind(&host)
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    let ready = "SELECT p::text FROM pools_with_ready_work() AS p";
    let mut tx = stack.pg.begin().await.unwrap();
    let before = queue_entries_read(&mut tx).await;
    let pools: Vec<String> = sqlx::query_scalar(ready).fetch_all(&mut *tx).await.unwrap();
    let read = queue_entries_read(&mut tx).await - before;
    assert_eq!(pools, vec![pool], "the pool has ready work");
    assert!(
        read <= 5,
        "the sweep read {read} entries of the queue's index for {QUEUED} queued attempts in one pool"
    );
    sqlx::query(
        "UPDATE attempts SET not_before = now() + interval '1 hour' WHERE status = 'queued'",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let later: Vec<String> = sqlx::query_scalar(ready).fetch_all(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(later.is_empty(), "no pool has work due: {later:?}");
}

/// Entries of `attempts_queued` this connection's scans returned and has not reported yet (the
/// statistics are kept per backend until reported: read before and after, on one connection).
async fn queue_entries_read(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> i64 {
    sqlx::query_scalar("SELECT pg_stat_get_xact_tuples_returned('attempts_queued'::regclass)")
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

/// The recorder reaches attempts by id whatever the statistics say: with the statistics of an
/// empty `attempts` kept while 200 tasks run on one host, the rows read by sequential scans of
/// `attempts` stay within a few whole-table reads (a restart's). The recorder's end statement,
/// planned on a young database, used to scan the whole table once per recorded batch (and kept
/// that plan as the table grew).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorder_reads_attempts_by_id_while_the_table_grows() {
    // The sweeps (each of which may read `attempts` whole, once per pass, while the statistics
    // say it is empty) kept out of the count: one pass a minute.
    let options = StackOptions {
        sweep_interval_ms: 60_000,
        lease_ttl_ms: 60_000,
        ..StackOptions::default()
    };
    let (mut stack, agent) = stack_with_stale_statistics("recorder-by-id", options).await;
    let state = stack.dir.path.join("host-h1-state");
    let _h1 = stack.spawn_host("h1", "pool", 8, &state, &[]).unwrap();
    stack.wait_host_ready("h1").await.unwrap();
    const TASKS: usize = 200;
    for id in faults::submit(&stack, &agent, TASKS).await {
        stack
            .wait_task(&id, "succeeded", Duration::from_secs(120))
            .await
            .unwrap();
    }
    // The scheduler's backends report their counts when they end.
    stack.restart_scheduler(false).await.unwrap();
    let read: i64 = sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'attempts'",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert!(
        // Without reads by id: about 92,000 here (a scan of the table per recorded batch).
        read < 10 * TASKS as i64,
        "sequential scans read {read} rows of attempts while {TASKS} tasks ran"
    );
}

/// The sweeper's passes read what they look for, not the queue or the tables: with 600
/// attempts queued, 20 of their tasks cancelled (requests the sweeper settles), 600 decided
/// approvals and the planner's statistics of an empty `attempts` and `approvals`, 20 passes read
/// fewer rows of `approvals`, `attempts` and `tasks` than the queue holds. Searches for rows that are usually absent (attempts without a binding,
/// queued attempts of cancelled tasks) used to read the whole queue or table on every pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeps_read_what_they_look_for_while_the_queue_is_long() {
    let (stack, agent) = stack_with_stale_statistics("sweeps-queue", StackOptions::default()).await;
    // No host: every task stays queued.
    const QUEUED: usize = 600;
    let submitted = faults::submit(&stack, &agent, QUEUED).await;
    // Decisions of the past, one per attempt, stored after the statistics of an empty table;
    // the rows this connection read meanwhile (the foreign keys' checks) reported at once.
    let mut conn = stack.pg.acquire().await.unwrap();
    for sql in [
        "ALTER TABLE approvals SET (autovacuum_enabled = off)",
        "ANALYZE approvals",
        "INSERT INTO approvals (id, workspace_id, attempt_id, request_id, tool_name, status,
                                decided_at, decided_by)
         SELECT gen_random_uuid(), workspace_id, id, 'earlier', 'shell', 'allowed', now(), 'api'
           FROM attempts",
        "SELECT pg_stat_force_next_flush()",
        "SELECT 1",
    ] {
        sqlx::query(sql).execute(&mut *conn).await.unwrap();
    }
    drop(conn);
    let cancelled = &submitted[..20];
    for id in cancelled {
        stack
            .api
            .post(&format!("/v1/tasks/{id}/cancel"), json!({}))
            .await
            .unwrap();
    }
    kit::wait_for(
        "the cancellations settled",
        Duration::from_secs(60),
        || async {
            // By index, so that the test's own reads stay out of the count below.
            let mut tx = stack.pg.begin().await.ok()?;
            sqlx::query("SET LOCAL enable_seqscan = off")
                .execute(&mut *tx)
                .await
                .ok()?;
            let open: i64 = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM tasks WHERE cancel_pending)
                      + (SELECT count(*) FROM attempts
                          WHERE task_id = ANY($1::uuid[]) AND status <> 'cancelled')",
            )
            .bind(cancelled)
            .fetch_one(&mut *tx)
            .await
            .ok()?;
            (open == 0).then_some(())
        },
    )
    .await
    .unwrap();

    // Rows read, as the backends report them (each at most a second late): counted over 20
    // passes, from 8 passes on, once every earlier read has been reported.
    let (health, passes) = (
        &stack.scheduler_health,
        r#"agentscope_sweeps_total{result="ok"}"#,
    );
    let after = |n: f64| async move {
        let start = metric(health, passes).await.unwrap();
        kit::wait_for(&format!("{n} sweeps"), Duration::from_secs(60), || async {
            let now = metric(health, passes).await?;
            (now - start >= n).then_some(())
        })
        .await
        .unwrap();
    };
    let rows_read = || async {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT relname::text, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_user_tables WHERE relname IN ('approvals', 'attempts', 'tasks')
              ORDER BY relname",
        )
        .fetch_all(&stack.pg)
        .await
        .unwrap()
    };
    after(8.0).await;
    let before = rows_read().await;
    after(20.0).await;
    let read: Vec<(String, i64)> = rows_read()
        .await
        .into_iter()
        .zip(before)
        .map(|((table, n), (_, m))| (table, n - m))
        .collect();
    let total: i64 = read.iter().map(|(_, n)| n).sum();
    assert!(
        // One read of the queue per pass: 12,000.
        total < QUEUED as i64,
        "20 sweeps read {read:?} rows with {QUEUED} attempts queued"
    );
}

/// The dataplane's sweep for sessions with unanswered input reads those inputs, not the
/// session history: with 2,000 answered inputs stored after the planner's statistics were taken
/// (as in a young database), 40 scans of `session_inputs` (20 sweeps) read fewer rows than the
/// table holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_sweep_reads_unanswered_inputs_not_the_history() {
    let stack = Stack::start("session-sweep", StackOptions::default())
        .await
        .unwrap();
    let agent = crate::managed::managed_agent(&stack, "quiet", json!({})).await;
    let session = crate::managed::start_session(&stack, &agent, "sandbox", "hello").await;
    crate::managed::wait_outcomes(&stack, &session, 1).await;
    const HISTORY: i64 = 2_000;
    for sql in [
        "ALTER TABLE session_inputs SET (autovacuum_enabled = off)",
        "ANALYZE session_inputs",
    ] {
        sqlx::query(sql).execute(&stack.pg).await.unwrap();
    }
    sqlx::query(
        "INSERT INTO session_inputs (id, session_id, workspace_id, text, answered)
         SELECT gen_random_uuid(), s.id, s.workspace_id, 'earlier input ' || n, true
           FROM sessions s, generate_series(1, $2) n WHERE s.id = $1::uuid",
    )
    .bind(&session)
    .bind(HISTORY)
    .execute(&stack.pg)
    .await
    .unwrap();
    // Scans and rows read, as the backends report them (each at most a second late).
    let counts = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0),
                    coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_user_tables WHERE relname = 'session_inputs'",
        )
        .fetch_one(&stack.pg)
        .await
        .unwrap()
    };
    let scans_after = |n: i64| async move {
        let (start, _) = counts().await;
        kit::wait_for(&format!("{n} scans"), Duration::from_secs(60), || async {
            let (scans, read) = counts().await;
            (scans - start >= n).then_some((scans, read))
        })
        .await
        .unwrap()
    };
    let (from_scans, from_read) = scans_after(8).await;
    let (to_scans, to_read) = scans_after(40).await;
    let read = to_read - from_read;
    assert!(
        read < HISTORY,
        "{} scans of session_inputs read {read} rows with {HISTORY} answered inputs stored",
        to_scans - from_scans
    );
}

/// The sweeper reads a long-running attempt's lease about once a TTL (when the lease it last
/// saw would have expired), not on each pass: with 4 attempts running for longer than a TTL,
/// its lease reads stay under half of one per attempt and pass, where one per attempt and pass
/// is what reading every active lease each second costs (a NATS round trip each). Lost leases
/// are still found: `faults_host` kills hosts under the same sweeper.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_running_attempts_leases_are_read_once_a_ttl_not_once_a_pass() {
    let stack = Stack::start("lease-reads", StackOptions::default())
        .await
        .unwrap();
    let (agent, _) = stack
        .command_agent("sleeper", "pool", &["sleep", "300"], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 4).await.unwrap();
    const RUNNING: usize = 4;
    let ids = faults::submit(&stack, &agent, RUNNING).await;
    faults::wait_all_running(&stack, &ids).await;
    let health = stack.scheduler_health.clone();
    let passes = r#"agentscope_sweeps_total{result="ok"}"#;
    let reads = "agentscope_lease_reads_total";
    // Once every attempt is older than a TTL (3 s; the sweep reads leases of those only), 24
    // passes (6 s, two TTLs).
    let after = |from: f64, n: f64| {
        let health = health.clone();
        async move {
            kit::wait_for(&format!("{n} sweeps"), Duration::from_secs(60), || async {
                let now = metric(&health, passes).await?;
                (now - from >= n).then_some(now)
            })
            .await
            .unwrap()
        }
    };
    let start = after(0.0, 0.0).await;
    let from = after(start, 16.0).await;
    let reads_from = metric(&health, reads).await.unwrap();
    let to = after(from, 24.0).await;
    let read = metric(&health, reads).await.unwrap() - reads_from;
    let per_attempt_and_pass = read / ((to - from) * RUNNING as f64);
    assert!(
        read >= RUNNING as f64,
        "every lease is read at least once in two TTLs ({read} reads)"
    );
    assert!(
        per_attempt_and_pass < 0.5,
        "{read} lease reads in {} passes for {RUNNING} running attempts",
        to - from
    );
}

/// A stack with an agent running `true` in pool `pool`, whose database keeps the planner's
/// statistics of an empty `attempts` (analyzed now, never again automatically): a table that
/// grows faster than it is analyzed.
async fn stack_with_stale_statistics(name: &str, options: StackOptions) -> (Stack, String) {
    let stack = Stack::start(name, options).await.unwrap();
    let (agent, _) = stack
        .command_agent("quick", "pool", &["true"], None)
        .await
        .unwrap();
    for sql in [
        "ALTER TABLE attempts SET (autovacuum_enabled = off)",
        "ANALYZE attempts",
    ] {
        sqlx::query(sql).execute(&stack.pg).await.unwrap();
    }
    (stack, agent)
}
