//! Outages, bad text and poison messages (issue 10): a dependency outage answers `503
//! unavailable` with `Retry-After`; a NUL character in any text field of the API is refused with
//! `422 invalid_field` naming the field, and on the bus it is refused or stored escaped without
//! stopping a consumer; a message that never succeeds reaches `rejected_messages` after
//! `max_deliver`; an offline host shows nothing from its last heartbeat.

use agentscope_schemas::v1::{
    DecideApproval, DecideApprovalReply, ExecutionEvent, Output, TaskSubmitted, ToolRequest,
    execution_event::Body,
};
use agentscope_system_tests::*;
use prost::Message;
use serde_json::{Value, json};
use std::time::Duration;

async fn send(
    api: &Api,
    method: &str,
    path: &str,
    token: &str,
    body: Option<Vec<u8>>,
) -> (u16, Option<String>, Value) {
    let mut req = api
        .client
        .request(method.parse().unwrap(), format!("{}{path}", api.base))
        .bearer_auth(token);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let res = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e:?}"));
    let st = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let text = res.text().await.unwrap();
    (
        st,
        retry_after,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<no error code>")
}

async fn admin_sql(sql: &str) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&kit::TestDb::admin_url())
        .await
        .unwrap();
    sqlx::query(sql).execute(&mut c).await.unwrap();
}

/// Refuses new connections to the test database and ends the open ones.
async fn block_database(name: &str) {
    admin_sql(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false")).await;
    admin_sql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_and_bus_outages_answer_503_with_retry_after() {
    let mut stack = Stack::start("outage503", StackOptions::default())
        .await
        .unwrap();
    let api = stack.api.clone();
    let token = api.token.clone();
    let (agent, _) = stack
        .command_agent("outage", "outage-pool", &["true"], None)
        .await
        .unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();

    // PostgreSQL refuses connections: reads, writes and the auth lookup answer 503.
    block_database(&stack.db.name).await;
    let create_issue = serde_json::to_vec(&json!({"title": "during the outage"})).unwrap();
    for (method, path, body) in [
        ("GET", "/v1/pools".to_string(), None),
        ("GET", format!("/v1/tasks/{task_id}"), None),
        ("POST", "/v1/issues".to_string(), Some(create_issue.clone())),
    ] {
        let (st, retry_after, v) = send(&api, method, &path, &token, body).await;
        assert_eq!((st, code(&v)), (503, "unavailable"), "{method} {path}: {v}");
        let secs: u64 = retry_after
            .as_deref()
            .unwrap_or_else(|| panic!("{method} {path}: no Retry-After"))
            .parse()
            .unwrap();
        assert!(secs >= 1, "Retry-After {secs}");
    }
    let ready = api
        .client
        .get(format!("{}/readyz", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 503, "readiness reports the outage");

    // Restored: the same requests succeed again, with nothing to clean up.
    admin_sql(&format!(
        "ALTER DATABASE {} ALLOW_CONNECTIONS true",
        stack.db.name
    ))
    .await;
    kit::wait_for("the API back", Duration::from_secs(30), || {
        let api = api.clone();
        async move { api.get("/v1/pools").await.ok() }
    })
    .await
    .unwrap();
    let (st, _, v) = send(&api, "POST", "/v1/issues", &token, Some(create_issue)).await;
    assert_eq!(st, 201, "{v}");

    // NATS is down: a route that must publish (a cancellation) answers 503, not 500.
    stack.nats.kill();
    let (st, retry_after, v) = send(
        &api,
        "POST",
        &format!("/v1/tasks/{task_id}/cancel"),
        &token,
        None,
    )
    .await;
    assert_eq!((st, code(&v)), (503, "unavailable"), "{v}");
    assert!(retry_after.is_some(), "no Retry-After");
    stack.nats.restart().await.unwrap();
    let api2 = api.clone();
    let path = format!("/v1/tasks/{task_id}/cancel");
    kit::wait_for(
        "cancel accepted once NATS is back",
        Duration::from_secs(30),
        || {
            let api = api2.clone();
            let path = path.clone();
            async move {
                let (st, _) = api
                    .send(reqwest::Method::POST, &path, Some(json!({})))
                    .await
                    .ok()?;
                (st == 202).then_some(())
            }
        },
    )
    .await
    .unwrap();
}

/// A command that prints a NUL, leaves its task credential in `shared/token`, and runs until
/// `shared/go` exists.
fn waiting_command(shared: &std::path::Path) -> String {
    let s = shared.display();
    format!(
        "printf 'nul:a\\000b\\n'; echo \"$AGENTSCOPE_TASK_TOKEN\" > {s}/token.tmp; mv {s}/token.tmp {s}/token; \
         while [ ! -e {s}/go ]; do sleep 0.1; done"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_character_is_refused_on_every_route_and_handled_on_the_bus() {
    let stack = Stack::start("nul", StackOptions::default()).await.unwrap();
    let api = stack.api.clone();
    let token = api.token.clone();
    let cmd = waiting_command(&stack.shared);
    let (agent, _) = stack
        .command_agent("nul", "nul-pool", &["sh", "-c", &cmd], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("nul-host", "nul-pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let token_file = stack.shared.join("token");
    let task_token = kit::wait_for("the task credential", Duration::from_secs(30), || {
        let f = token_file.clone();
        async move {
            let t = std::fs::read_to_string(&f).ok()?;
            let t = t.trim().to_string();
            (!t.is_empty()).then_some(t)
        }
    })
    .await
    .unwrap();

    // Every route of the OpenAPI document: a JSON body with a NUL (in a value, deep in a list,
    // in a key) is refused naming the JSON path; a query parameter with one names the parameter.
    let doc = api.get("/v1/openapi.json").await.unwrap();
    let some_id = uuid::Uuid::new_v4().to_string();
    let mut json_routes = 0;
    for (path, ops) in doc["paths"].as_object().unwrap() {
        let path = path.replace("{id}", &some_id);
        for (method, op) in ops.as_object().unwrap() {
            let auth = match op["security"][0].as_object().and_then(|o| o.keys().next()) {
                Some(k) if k == "admin" => ADMIN_TOKEN.to_string(),
                Some(k) if k == "task" => task_token.clone(),
                _ => token.clone(),
            };
            let m = method.to_uppercase();
            let (st, _, v) = send(&api, &m, &format!("{path}?status=x%00y"), &auth, None).await;
            assert_eq!((st, code(&v)), (422, "invalid_field"), "{m} {path}?: {v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("`status`"),
                "{m} {path}: {v}"
            );
            if op["requestBody"]["content"]["application/json"].is_null() {
                continue;
            }
            json_routes += 1;
            for (body, field) in [
                (json!({"name": "a\u{0}b"}), "`name`"),
                (
                    json!({"params": {"command": ["ok", "x\u{0}"]}}),
                    "`params.command[1]`",
                ),
                (json!({"params": {"k\u{0}": "v"}}), "`params.k\\u0000`"),
            ] {
                let (st, _, v) = send(
                    &api,
                    &m,
                    &path,
                    &auth,
                    Some(serde_json::to_vec(&body).unwrap()),
                )
                .await;
                assert_eq!((st, code(&v)), (422, "invalid_field"), "{m} {path}: {v}");
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(msg.contains(field), "{m} {path}: {msg} should name {field}");
            }
        }
    }
    assert!(json_routes >= 15, "only {json_routes} JSON routes");

    // The real fields of the main routes, each named.
    let issue = api.post("/v1/issues", json!({"title": "t"})).await.unwrap();
    let issue_id = issue["id"].as_str().unwrap();
    let cases: Vec<(&str, String, Value, &str)> = vec![
        (
            "POST",
            "/v1/issues".into(),
            json!({"title": "t\u{0}"}),
            "title",
        ),
        (
            "POST",
            "/v1/issues".into(),
            json!({"title": "t", "body": "b\u{0}"}),
            "body",
        ),
        (
            "POST",
            format!("/v1/issues/{issue_id}/comments"),
            json!({"body": "\u{0}"}),
            "body",
        ),
        (
            "POST",
            "/v1/tasks".into(),
            json!({"agent_id": agent, "input": "i\u{0}"}),
            "input",
        ),
        (
            "POST",
            "/v1/agents".into(),
            json!({"name": "n", "provider": "command", "instructions": "x\u{0}"}),
            "instructions",
        ),
        (
            "POST",
            "/v1/runtime-profiles".into(),
            json!({"name": "p", "provider": "command", "params": {"command": ["a\u{0}"]}}),
            "params.command[0]",
        ),
        (
            "POST",
            format!("/v1/tasks/{task_id}/cancel"),
            json!({"reason": "r\u{0}"}),
            "reason",
        ),
        (
            "POST",
            format!("/v1/approvals/{some_id}/deny"),
            json!({"reason": "no\u{0}"}),
            "reason",
        ),
        (
            "POST",
            "/v1/sessions".into(),
            json!({"agent_id": agent, "input": "s\u{0}"}),
            "input",
        ),
        (
            "POST",
            format!("/v1/sessions/{some_id}/inputs"),
            json!({"text": "s\u{0}"}),
            "text",
        ),
    ];
    for (m, path, body, field) in cases {
        let (st, _, v) = send(
            &api,
            m,
            &path,
            &token,
            Some(serde_json::to_vec(&body).unwrap()),
        )
        .await;
        assert_eq!((st, code(&v)), (422, "invalid_field"), "{m} {path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("`{field}`")),
            "{m} {path}: {v}"
        );
    }
    let (st, _, v) = send(
        &api,
        "POST",
        "/v1/task/comments",
        &task_token,
        Some(serde_json::to_vec(&json!({"body": "hi\u{0}"})).unwrap()),
    )
    .await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");
    let (st, _, v) = send(
        &api,
        "POST",
        "/v1/task/artifacts?name=a%00b",
        &task_token,
        None,
    )
    .await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");

    // The bus, with the gateway's own credentials.
    let nats = stack.nats.service_client("gateway").await.unwrap();
    // A decision whose reason carries NUL is refused with a stable code, not "retry".
    let d = DecideApproval {
        approval_id: some_id.clone(),
        workspace_id: stack.workspace_id.clone(),
        allow: false,
        reason: "no\u{0}".into(),
        decided_by: "api".into(),
        always_for_task: false,
    };
    let reply = nats
        .request("agentscope.approvals.decide", d.encode_to_vec().into())
        .await
        .unwrap();
    let r = DecideApprovalReply::decode(reply.payload.as_ref()).unwrap();
    assert_eq!(
        (r.ok, r.error_code.as_str()),
        (false, "invalid_field"),
        "{r:?}"
    );
    assert!(r.message.contains("`reason`"), "{r:?}");
    // A submission and a tool request with NUL in an identifier are rejected and recorded.
    let js = async_nats::jetstream::new(nats.clone());
    let sub = TaskSubmitted {
        task_id: "not\u{0}an-id".into(),
        ..Default::default()
    };
    js.publish("agentscope.tasks.submitted", sub.encode_to_vec().into())
        .await
        .unwrap()
        .await
        .unwrap();
    let host = uuid::Uuid::new_v4();
    let attempt = uuid::Uuid::new_v4();
    let req = ToolRequest {
        attempt_id: attempt.to_string(),
        request_id: "r\u{0}1".into(),
        tool_name: "Bash".into(),
        ..Default::default()
    };
    js.publish(
        format!("agentscope.approvals.requested.host.{host}.{attempt}"),
        req.encode_to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let pg = stack.pg.clone();
    let rejected: Vec<(String, String)> =
        kit::wait_for("two rejected messages", Duration::from_secs(30), || {
            let pg = pg.clone();
            async move {
                let r: Vec<(String, String)> = sqlx::query_as(
                    "SELECT consumer, reason FROM rejected_messages ORDER BY consumer",
                )
                .fetch_all(&pg)
                .await
                .ok()?;
                (r.len() >= 2).then_some(r)
            }
        })
        .await
        .unwrap();
    assert_eq!(rejected[0].0, "scheduler-approvals", "{rejected:?}");
    assert!(rejected[0].1.contains("request_id"), "{rejected:?}");
    assert_eq!(rejected[1].0, "scheduler-intake", "{rejected:?}");
    assert!(rejected[1].1.contains("invalid id"), "{rejected:?}");

    // The provider printed a NUL: the event is stored with U+FFFD and the task goes on; a new
    // task after the rejected messages runs too (the consumers keep going).
    std::fs::write(stack.shared.join("go"), "").unwrap();
    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(30))
        .await
        .unwrap();
    let events = stack
        .events(&format!("/v1/tasks/{task_id}/events"))
        .await
        .unwrap();
    assert!(
        events.iter().any(|e| e["kind"] == "output"
            && e["payload"]["text"]
                .as_str()
                .unwrap_or("")
                .contains("nul:a\u{FFFD}b")),
        "{events:?}"
    );
    let next = stack.submit(json!({"agent_id": agent})).await.unwrap();
    stack
        .wait_task(&next, "succeeded", Duration::from_secs(30))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_is_rejected_after_max_deliver_and_an_offline_host_shows_no_stale_state() {
    let stack = Stack::start(
        "poison",
        StackOptions {
            scheduler_env: vec![("AGENTSCOPE_MAX_DELIVER".into(), "4".into())],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let api = stack.api.clone();
    let cmd = waiting_command(&stack.shared);
    let (agent, _) = stack
        .command_agent("poison", "poison-pool", &["sh", "-c", &cmd], None)
        .await
        .unwrap();
    let (mut host, _) = stack.host("poison-host", "poison-pool", 2).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let a = stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    let attempt_id = a["id"].as_str().unwrap().to_string();
    let (host_id, lease_token, last_seq): (uuid::Uuid, i64, i64) =
        sqlx::query_as("SELECT host_id, lease_token, last_seq FROM attempts WHERE id = $1::uuid")
            .bind(&attempt_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();

    // An event after a gap that never fills: redelivered with backoff, then rejected.
    let nats = stack.nats.service_client("gateway").await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let ev = ExecutionEvent {
        attempt_id: attempt_id.clone(),
        seq: last_seq as u64 + 1000,
        lease_token: lease_token as u64,
        host_id: host_id.to_string(),
        at_ms: 0,
        body: Some(Body::Output(Output {
            stream: "stdout".into(),
            text: "from beyond a gap".into(),
            truncated: false,
        })),
    };
    js.publish(
        format!("agentscope.events.{host_id}.{attempt_id}"),
        ev.encode_to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let pg = stack.pg.clone();
    let reason: String =
        kit::wait_for("the poison event rejected", Duration::from_secs(30), || {
            let pg = pg.clone();
            async move {
                sqlx::query_scalar(
                    "SELECT reason FROM rejected_messages WHERE consumer = 'recorder'",
                )
                .fetch_optional(&pg)
                .await
                .ok()?
            }
        })
        .await
        .unwrap();
    assert!(reason.contains("gave up after 4 deliveries"), "{reason}");

    // While online, the listing shows the running count the host reports.
    let h = kit::wait_for("running 1 reported", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let hosts = api.get("/v1/hosts").await.ok()?;
            let h = hosts["items"][0].clone();
            (h["running"] == 1).then_some(h)
        }
    })
    .await
    .unwrap();
    assert_eq!(h["online"], true);

    // The recorder kept going: the attempt's own events are recorded and it ends.
    std::fs::write(stack.shared.join("go"), "").unwrap();
    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(30))
        .await
        .unwrap();

    // A second task running when the host dies: offline, its listing shows no running count
    // and no readiness from its last heartbeat.
    std::fs::remove_file(stack.shared.join("go")).unwrap();
    std::fs::remove_file(stack.shared.join("token")).unwrap();
    let second = stack.submit(json!({"agent_id": agent})).await.unwrap();
    stack
        .wait_attempt(&second, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    kit::wait_for("running 1 reported again", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let hosts = api.get("/v1/hosts").await.ok()?;
            (hosts["items"][0]["running"] == 1).then_some(())
        }
    })
    .await
    .unwrap();
    host.kill9();
    let h = kit::wait_for("the host offline", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let hosts = api.get("/v1/hosts").await.ok()?;
            let h = hosts["items"][0].clone();
            (h["online"] == false).then_some(h)
        }
    })
    .await
    .unwrap();
    assert_eq!(h["running"], Value::Null, "{h}");
    let dispatch = &h["checks"]["dispatch_readiness"];
    assert_eq!(dispatch["ok"], false, "{h}");
    assert!(
        dispatch["detail"].as_str().unwrap().starts_with("offline"),
        "{h}"
    );
    assert_eq!(h["checks"]["connectivity"]["ok"], false, "{h}");
    // Lets the orphaned command end.
    std::fs::write(stack.shared.join("go"), "").unwrap();
}
