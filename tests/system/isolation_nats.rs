//! NATS as a hostile Runtime Host or Worker would use it: a raw client with a host's (or a
//! worker's) real credentials tries another host's subjects, other tenants' nudges, the
//! services' subjects and inboxes. Every attempt is refused by the server (a permissions
//! violation) and nothing reaches the streams; wrong or foreign credentials do not connect; the
//! services refuse to run against a NATS that lets anyone in.

use agentscope_system_tests::*;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A raw client with the given user and password, collecting the server's error reports.
async fn raw_client(
    url: &str,
    user: &str,
    password: &str,
    inbox: String,
) -> Result<(async_nats::Client, Arc<Mutex<Vec<String>>>), async_nats::ConnectError> {
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = errors.clone();
    let client = async_nats::ConnectOptions::new()
        .user_and_password(user.into(), password.into())
        .custom_inbox_prefix(inbox)
        .event_callback(move |event| {
            let sink = sink.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    sink.lock().unwrap().push(e.to_string().to_lowercase());
                }
            }
        })
        .connect(url)
        .await?;
    Ok((client, errors))
}

/// Waits until the server reported a permissions violation naming `subject`.
async fn refused(errors: &Arc<Mutex<Vec<String>>>, subject: &str) {
    let errors = errors.clone();
    let needle = subject.to_lowercase();
    kit::wait_for(
        &format!("a permissions violation for {subject}"),
        Duration::from_secs(10),
        || {
            let found = errors
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.contains("permissions violation") && e.contains(&needle));
            std::future::ready(found.then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: errors seen {:?}", errors.lock().unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_credential_reaches_only_its_own_subjects() {
    let stack = Stack::start("nats-host-perms", StackOptions::default())
        .await
        .unwrap();
    // A real host A of this workspace, with a running-capable registration.
    stack
        .api
        .post("/v1/pools", json!({"name": "pool"}))
        .await
        .unwrap();
    let (_a, state_a) = stack.host("a", "pool", 1).await.unwrap();
    let host_a = std::fs::read_to_string(state_a.join("host_id"))
        .unwrap()
        .trim()
        .to_string();
    let workspace = stack.workspace_id.clone();
    let pool_id: String = sqlx::query_scalar("SELECT pool_id::text FROM hosts WHERE id = $1::uuid")
        .bind(&host_a)
        .fetch_one(&stack.pg)
        .await
        .unwrap();

    // The attacker holds the workspace's host token and connects as a host of its own.
    let me = uuid::Uuid::new_v4().to_string();
    let (nc, errors) = raw_client(
        &stack.nats.url(),
        &me,
        &stack.host_token,
        agentscope_bus::auth::host_inbox(&me),
    )
    .await
    .unwrap();

    // Its own subjects work: registration answers.
    let reg = agentscope_schemas::v1::HostRegistration {
        host_id: me.clone(),
        host_token: stack.host_token.clone(),
        name: "intruder".into(),
        pool: "pool".into(),
        capacity: 1,
        ..Default::default()
    };
    use prost::Message as _;
    let answer = nc
        .request(
            agentscope_bus::subjects::host_register(&me),
            reg.encode_to_vec().into(),
        )
        .await
        .expect("a host may register itself");
    let answer = agentscope_schemas::v1::HostRegistered::decode(answer.payload.as_ref()).unwrap();
    assert!(answer.ok, "{}", answer.message);

    // Another host's events, approval requests, claims, registration, lease and presence.
    let fake_attempt = uuid::Uuid::new_v4().to_string();
    let forbidden_publishes = [
        agentscope_bus::subjects::events(&host_a, &fake_attempt),
        agentscope_bus::subjects::approval_requested(&host_a, &fake_attempt),
        agentscope_bus::subjects::session_approval_requested(&fake_attempt),
        agentscope_bus::subjects::host_claim(&host_a),
        agentscope_bus::subjects::host_register(&host_a),
        format!(
            "$KV.{}.{}",
            agentscope_bus::BUCKET_LEASES,
            agentscope_bus::lease_key(&host_a, &fake_attempt)
        ),
        format!(
            "$KV.{}.{}",
            agentscope_bus::BUCKET_PRESENCE,
            agentscope_bus::presence_key(&host_a)
        ),
        // The services' subjects: decisions, submissions, cancellations, issue writes.
        agentscope_bus::subjects::APPROVAL_DECIDE.to_string(),
        agentscope_bus::subjects::TASK_SUBMITTED.to_string(),
        agentscope_bus::subjects::TASK_CANCEL.to_string(),
        agentscope_bus::subjects::ISSUE_WRITE.to_string(),
        agentscope_bus::subjects::SESSIONS_NUDGE.to_string(),
        // A decision brought to a session's replica.
        agentscope_bus::subjects::session_decide(&uuid::Uuid::new_v4().to_string()),
        agentscope_bus::subjects::control(&host_a),
        // Commit notices: they carry stored events to live followers, so a forged one would
        // show followers events that were never recorded.
        agentscope_bus::subjects::recorded(&fake_attempt),
        // Offers: the gateway's to make, to any host, itself included.
        agentscope_bus::subjects::host_offer(&host_a),
        agentscope_bus::subjects::host_offer(&me),
        // Another workspace's pool nudges.
        agentscope_bus::subjects::pool_work(&uuid::Uuid::new_v4().to_string(), &pool_id),
        // Reading any message of the events stream, or a control consumer with a wide filter.
        format!("$JS.API.STREAM.MSG.GET.{}", agentscope_bus::STREAM_EVENTS),
        format!(
            "$JS.API.CONSUMER.CREATE.{}.host-{me}.agentscope.control.>",
            agentscope_bus::STREAM_CONTROL
        ),
        format!(
            "$JS.API.CONSUMER.DURABLE.CREATE.{}.host-{me}",
            agentscope_bus::STREAM_CONTROL
        ),
        "$SYS.REQ.USER.AUTH".to_string(),
    ];
    for subject in &forbidden_publishes {
        nc.publish(subject.clone(), "forged".into()).await.unwrap();
        nc.flush().await.unwrap();
        refused(&errors, subject).await;
    }

    // Another host's control messages and offers, every inbox, every event, the services'
    // request subjects and other workspaces' nudges cannot be heard.
    let forbidden_subscriptions = [
        agentscope_bus::subjects::control(&host_a),
        "agentscope.control.>".to_string(),
        "_INBOX.>".to_string(),
        format!("{}.>", agentscope_bus::auth::host_inbox(&host_a)),
        "agentscope.events.>".to_string(),
        agentscope_bus::subjects::HOST_CLAIM_ALL.to_string(),
        agentscope_bus::subjects::APPROVAL_DECIDE.to_string(),
        agentscope_bus::subjects::session_decide("*"),
        "agentscope.pool.*.*.work".to_string(),
        // Another host's offers (they carry its attempts' task credentials).
        agentscope_bus::subjects::host_offer(&host_a),
        "agentscope.host.*.offer".to_string(),
        // Commit notices (they carry every workspace's stored events).
        agentscope_bus::subjects::RECORDED_ALL.to_string(),
        ">".to_string(),
    ];
    for subject in &forbidden_subscriptions {
        let _sub = nc.subscribe(subject.clone()).await.unwrap();
        nc.flush().await.unwrap();
        refused(&errors, subject).await;
    }

    // Nothing forged reached the streams.
    let service = stack.nats.service_client("scheduler").await.unwrap();
    let js = async_nats::jetstream::new(service);
    let events = js.get_stream(agentscope_bus::STREAM_EVENTS).await.unwrap();
    assert!(
        events
            .direct_get_last_for_subject(agentscope_bus::subjects::events(&host_a, &fake_attempt))
            .await
            .is_err(),
        "a forged event of another host reached the stream"
    );
    let rejected: i64 = sqlx::query_scalar("SELECT count(*) FROM rejected_messages")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    assert_eq!(rejected, 0, "nothing forged was even delivered");
    // The pool's nudges of its own workspace are allowed.
    let own = agentscope_bus::subjects::pool_work(&workspace, &pool_id);
    let _own_nudges = nc.subscribe(own.clone()).await.unwrap();
    // Also in the queue group hosts with a free slot listen in (one nudge wakes one host).
    let _own_queue = nc
        .queue_subscribe(own.clone(), "free-hosts".into())
        .await
        .unwrap();
    nc.publish(own.clone(), "".into()).await.unwrap();
    nc.flush().await.unwrap();
    assert!(
        !errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains(&own.to_lowercase())),
        "own workspace nudges are allowed"
    );
    // Its own offers it may hear.
    let own_offers = agentscope_bus::subjects::host_offer(&me);
    let _offers = nc.subscribe(own_offers.clone()).await.unwrap();
    nc.flush().await.unwrap();
    assert!(
        !errors.lock().unwrap().iter().any(|e| e.contains(&format!(
            "subscription to \"{}\"",
            own_offers.to_lowercase()
        ))),
        "own offers are allowed: {:?}",
        errors.lock().unwrap()
    );

    // On its own subject, an event for host A's running attempt (its lease token guessed from the
    // API is not enough): the recorder refuses it and A's attempt records nothing forged.
    let (agent, _) = stack
        .command_agent("victim", "pool", &["sh", "-c", "echo mine; sleep 30"], None)
        .await
        .unwrap();
    let task = stack
        .submit(serde_json::json!({"agent_id": agent, "input": "x"}))
        .await
        .unwrap();
    let victim = stack
        .wait_attempt(&task, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let victim_id = victim["id"].as_str().unwrap().to_string();
    let forged = agentscope_schemas::v1::ExecutionEvent {
        attempt_id: victim_id.clone(),
        // Past anything recorded: a forged seq the recorder already holds is dropped as a
        // duplicate, this one must be judged.
        seq: 10_000,
        lease_token: victim["lease_token"].as_u64().unwrap_or(1),
        host_id: me.clone(),
        at_ms: 0,
        body: Some(agentscope_schemas::v1::execution_event::Body::Output(
            agentscope_schemas::v1::Output {
                stream: "stdout".into(),
                text: "forged by another host".into(),
                truncated: false,
            },
        )),
    };
    let subject = agentscope_bus::subjects::events(&me, &victim_id);
    // The same forgery alone, and as a batch of two (the form a busy host's events travel in).
    let later = |seq| {
        let mut e = forged.clone();
        e.seq = seq;
        e.encode_to_vec()
    };
    let batch = agentscope_schemas::encode_batch(
        [later(10_001), later(10_002)].iter().map(|e| e.as_slice()),
    );
    let js = async_nats::jetstream::new(nc.clone());
    for payload in [forged.encode_to_vec(), batch] {
        js.publish(subject.clone(), payload.into())
            .await
            .expect("its own subject is allowed")
            .await
            .expect("the stream takes it");
    }
    let pg = stack.pg.clone();
    let reasons: Vec<String> = kit::wait_for(
        "the forged messages to be refused",
        Duration::from_secs(30),
        || {
            let (pg, subject) = (pg.clone(), subject.clone());
            async move {
                let r: Vec<String> =
                    sqlx::query_scalar("SELECT reason FROM rejected_messages WHERE subject = $1")
                        .bind(subject)
                        .fetch_all(&pg)
                        .await
                        .ok()?;
                (r.len() >= 2).then_some(r)
            }
        },
    )
    .await
    .unwrap();
    assert!(reasons.iter().all(|r| r.contains("fenced")), "{reasons:?}");
    let events = stack
        .events(&format!("/v1/attempts/{victim_id}/events"))
        .await
        .unwrap();
    assert!(
        !events
            .iter()
            .any(|e| e.to_string().contains("forged by another host")),
        "{events:?}"
    );
    stack
        .cancel_task(&task, Duration::from_secs(30))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_foreign_credentials_do_not_connect() {
    let stack = Stack::start("nats-creds", StackOptions::default())
        .await
        .unwrap();
    stack
        .api
        .post("/v1/pools", json!({"name": "pool"}))
        .await
        .unwrap();
    let (_a, state_a) = stack.host("a", "pool", 1).await.unwrap();
    let host_a = std::fs::read_to_string(state_a.join("host_id"))
        .unwrap()
        .trim()
        .to_string();
    let url = stack.nats.url();
    let me = uuid::Uuid::new_v4().to_string();
    let inbox = agentscope_bus::auth::host_inbox(&me);

    // No credentials, a wrong token, a task token, an API token, a service name with a guess.
    let workspace_token = stack.api.token.clone();
    let attempts: Vec<(&str, String)> = vec![
        (me.as_str(), "agh_not-a-real-token".into()),
        (me.as_str(), workspace_token),
        ("gateway", "guessed-password".into()),
        ("scheduler", stack.host_token.clone()),
        ("not-a-uuid", stack.host_token.clone()),
    ];
    for (user, password) in attempts {
        let res = raw_client(&url, user, &password, inbox.clone()).await;
        assert!(res.is_err(), "{user} connected with a wrong credential");
    }
    assert!(
        async_nats::connect(&url).await.is_err(),
        "an anonymous client connected"
    );

    // Another workspace's host token cannot take host A's id.
    let admin = stack.api.with_token(ADMIN_TOKEN);
    let ws_b = admin
        .post("/v1/workspaces", json!({"name": "other-tenant"}))
        .await
        .unwrap();
    let api_b = stack.api.with_token(ws_b["api_token"].as_str().unwrap());
    let token_b = api_b
        .post("/v1/host-tokens", json!({"name": "b-hosts"}))
        .await
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_string();
    let res = raw_client(
        &url,
        &host_a,
        &token_b,
        agentscope_bus::auth::host_inbox(&host_a),
    )
    .await;
    assert!(res.is_err(), "a foreign workspace's token took host A's id");
    // With its own id it connects, and still cannot hear workspace A's nudges.
    let (nc, errors) = raw_client(&url, &me, &token_b, inbox).await.unwrap();
    let pool_a: String = sqlx::query_scalar("SELECT pool_id::text FROM hosts WHERE id = $1::uuid")
        .bind(&host_a)
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    let nudges_a = agentscope_bus::subjects::pool_work(&stack.workspace_id, &pool_a);
    let _s = nc.subscribe(nudges_a.clone()).await.unwrap();
    nc.flush().await.unwrap();
    refused(&errors, &nudges_a).await;
    // Nor take them from A's hosts through their queue group.
    errors.lock().unwrap().clear();
    let _q = nc
        .queue_subscribe(nudges_a.clone(), "free-hosts".into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    refused(&errors, &nudges_a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_credential_reaches_only_its_own_operations() {
    let stack = Stack::start("nats-worker-perms", StackOptions::default())
        .await
        .unwrap();
    let tok = stack
        .api
        .post("/v1/worker-tokens", json!({"name": "w"}))
        .await
        .unwrap();
    let token = tok["token"].as_str().unwrap().to_string();
    let (nc, errors) = raw_client(
        &stack.nats.url(),
        "laptop",
        &token,
        agentscope_bus::auth::worker_inbox(&token),
    )
    .await
    .unwrap();
    let mine = agentscope_domain::worker_id(&stack.workspace_id, "laptop");
    let other = agentscope_domain::worker_id(&stack.workspace_id, "desk");
    // Its own operations can be heard; another worker's, or any, cannot.
    let _own = nc
        .subscribe(agentscope_bus::subjects::worker_ops(&mine))
        .await
        .unwrap();
    for subject in [
        agentscope_bus::subjects::worker_ops(&other),
        "agentscope.worker.*.ops".to_string(),
        "_INBOX.>".to_string(),
        agentscope_bus::subjects::RECORDED_ALL.to_string(),
    ] {
        let _s = nc.subscribe(subject.clone()).await.unwrap();
        nc.flush().await.unwrap();
        refused(&errors, &subject).await;
    }
    for subject in [
        format!("$KV.{}.worker.{other}", agentscope_bus::BUCKET_WORKERS),
        agentscope_bus::subjects::worker_progress(&other, "0123456789abcdef"),
        agentscope_bus::subjects::events(&uuid::Uuid::new_v4().to_string(), "x"),
        agentscope_bus::subjects::ISSUE_WRITE.to_string(),
        agentscope_bus::subjects::SESSIONS_NUDGE.to_string(),
        agentscope_bus::subjects::session_decide(&uuid::Uuid::new_v4().to_string()),
        agentscope_bus::subjects::recorded(&uuid::Uuid::new_v4().to_string()),
    ] {
        nc.publish(subject.clone(), "forged".into()).await.unwrap();
        nc.flush().await.unwrap();
        refused(&errors, &subject).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_refuse_a_nats_that_lets_anyone_in() {
    let dir = kit::TempDir::new("open-nats");
    let open = kit::Nats::start_open(&dir.path).await.unwrap();
    let db = kit::TestDb::create().await.unwrap();
    let env = vec![
        ("AGENTSCOPE_NATS_URL".to_string(), open.url()),
        ("AGENTSCOPE_DATABASE_URL".to_string(), db.url()),
        ("AGENTSCOPE_HEALTH_ADDR".to_string(), "127.0.0.1:0".into()),
    ];
    let mut p = kit::Proc::spawn(
        "scheduler-open",
        &kit::bin("svc-scheduler").unwrap(),
        &[],
        &env,
        &dir.path,
    )
    .unwrap();
    let log = p.log.clone();
    kit::wait_for("the scheduler to refuse", Duration::from_secs(60), || {
        std::future::ready(p.exited().map(|_| ()))
    })
    .await
    .unwrap();
    drop(p);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("lets any client in"), "{text}");
    // Told that this is a development install, it runs.
    let mut dev = env.clone();
    dev.push(("AGENTSCOPE_NATS_ALLOW_OPEN".into(), "true".into()));
    let (_s, _port) = kit::spawn_on_free_port(
        "scheduler-dev",
        &kit::bin("svc-scheduler").unwrap(),
        |port| {
            let mut e = dev.clone();
            e.retain(|(k, _)| k != "AGENTSCOPE_HEALTH_ADDR");
            e.push(("AGENTSCOPE_HEALTH_ADDR".into(), format!("127.0.0.1:{port}")));
            e
        },
        "/readyz",
        &dir.path,
    )
    .await
    .unwrap();
}
