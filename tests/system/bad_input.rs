//! Bad input gets a 4xx JSON error with a stable code and breaks nothing; one workspace never
//! sees another's data; a malformed bus message is rejected and recorded and its consumer keeps
//! going; the OpenAPI document matches what is served.

use agentscope_schemas::v1::{ExecutionEvent, Output, execution_event::Body};
use agentscope_system_tests::*;
use prost::Message;
use serde_json::{Value, json};
use std::time::Duration;

async fn raw(
    api: &Api,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<(&str, Vec<u8>)>,
) -> (u16, Value) {
    let mut req = api
        .client
        .request(method.parse().unwrap(), format!("{}{path}", api.base));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some((ct, b)) = body {
        if !ct.is_empty() {
            req = req.header("content-type", ct);
        }
        req = req.body(b);
    }
    let res = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e:?}"));
    let st = res.status().as_u16();
    let text = res.text().await.unwrap();
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<no error code>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_stable_error_codes_and_workspaces_are_isolated() {
    let stack = Stack::start("badinput", StackOptions::default())
        .await
        .unwrap();
    let api = &stack.api;
    let t = Some(api.token.as_str());
    let json_ct = "application/json";

    type Case<'a> = (
        &'a str,
        &'a str,
        Option<&'a str>,
        Option<(&'a str, Vec<u8>)>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        ("POST", "/v1/pools", t, Some((json_ct, b"{not json".to_vec())), 400, "malformed_json"),
        ("POST", "/v1/pools", t, Some((json_ct, vec![b' '; 1024 * 1024 + 64 * 1024])), 413, "payload_too_large"),
        ("POST", "/v1/pools", t, Some(("", br#"{"name":"x"}"#.to_vec())), 415, "unsupported_media_type"),
        ("POST", "/v1/pools", t, Some((json_ct, br#"{"name":"x","colour":"blue"}"#.to_vec())), 422, "invalid_field"),
        ("POST", "/v1/pools", t, Some((json_ct, br#"{"name":""}"#.to_vec())), 400, "invalid_field"),
        ("POST", "/v1/pools", t, Some((json_ct, br#"{"name":"x","max_concurrency":0}"#.to_vec())), 400, "invalid_field"),
        ("GET", "/v1/pools", None, None, 401, "unauthorized"),
        ("GET", "/v1/pools", Some("ags_wrong"), None, 401, "unauthorized"),
        ("GET", "/v1/pools", Some(super::bad_input::ADMIN), None, 401, "unauthorized"),
        ("POST", "/v1/workspaces", t, Some((json_ct, br#"{"name":"sneaky"}"#.to_vec())), 401, "unauthorized"),
        ("GET", "/v1/tasks/not-a-uuid", t, None, 400, "invalid_id"),
        ("GET", "/v1/tasks/00000000-0000-0000-0000-000000000000", t, None, 404, "not_found"),
        ("GET", "/v1/nothing-here", t, None, 404, "not_found"),
        ("DELETE", "/v1/pools", t, None, 405, "method_not_allowed"),
        ("POST", "/v1/tasks", t, Some((json_ct, br#"{"agent_id":"00000000-0000-0000-0000-000000000000"}"#.to_vec())), 422, "invalid_reference"),
        ("POST", "/v1/tasks", t, Some((json_ct, br#"{"agent_id":"00000000-0000-0000-0000-000000000000","branch":"--upload-pack=x"}"#.to_vec())), 400, "invalid_field"),
        ("GET", "/v1/attempts/00000000-0000-0000-0000-000000000000/events?after=x", t, None, 404, "not_found"),
    ];
    for (method, path, token, body, status, want) in cases {
        let (st, v) = raw(api, method, path, token, body).await;
        assert_eq!((st, code(&v)), (status, want), "{method} {path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{method} {path}: {v}"
        );
    }
    let (st, v) = raw(
        api,
        "POST",
        "/v1/pools",
        t,
        Some((json_ct, br#"{"name":"dup"}"#.to_vec())),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    let (st, v) = raw(
        api,
        "POST",
        "/v1/pools",
        t,
        Some((json_ct, br#"{"name":"dup"}"#.to_vec())),
    )
    .await;
    assert_eq!((st, code(&v)), (409, "already_exists"));

    // Another workspace sees none of this one's data.
    let (agent, _) = stack
        .command_agent("mine", "pool", &["true"], None)
        .await
        .unwrap();
    let task = api
        .post(
            "/v1/tasks",
            json!({"agent_id": agent, "idempotency_key": "k1"}),
        )
        .await
        .unwrap();
    let task_id = task["id"].as_str().unwrap();
    let attempt_id = task["attempts"][0]["id"].as_str().unwrap();
    let admin = api.with_token(ADMIN_TOKEN);
    let other = admin
        .post("/v1/workspaces", json!({"name": "other"}))
        .await
        .unwrap();
    let other = api.with_token(other["api_token"].as_str().unwrap());
    for path in [
        format!("/v1/tasks/{task_id}"),
        format!("/v1/agents/{agent}"),
        format!("/v1/tasks/{task_id}/events"),
        // Live streams share one reader per task or attempt: it is not theirs to join.
        format!("/v1/tasks/{task_id}/events?follow=true"),
        format!("/v1/attempts/{attempt_id}/events?follow=true"),
        // A cursor it refuses does not tell it the stream exists.
        format!("/v1/tasks/{task_id}/events?after=x"),
        format!("/v1/attempts/{attempt_id}/events?follow=true&after=x"),
    ] {
        let (st, v) = other.send(reqwest::Method::GET, &path, None).await.unwrap();
        assert_eq!((st, code(&v)), (404, "not_found"), "{path}");
    }
    assert_eq!(
        other.get("/v1/tasks").await.unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    let (st, v) = other
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"agent_id": agent})),
        )
        .await
        .unwrap();
    assert_eq!(
        (st, code(&v)),
        (422, "invalid_reference"),
        "cannot run another workspace's agent"
    );
    let (st, _) = other
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{task_id}/cancel"),
            Some(json!({})),
        )
        .await
        .unwrap();
    assert_eq!(st, 404);

    // The same idempotency key twice is one task.
    let again = api
        .post(
            "/v1/tasks",
            json!({"agent_id": agent, "idempotency_key": "k1"}),
        )
        .await
        .unwrap();
    assert_eq!(again["id"], task["id"]);

    // Health, readiness and metrics.
    let (st, _) = raw(api, "GET", "/readyz", None, None).await;
    assert_eq!(st, 200);
    let metrics = api
        .client
        .get(format!("{}/metrics", api.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("agentscope_http_requests_total"),
        "{metrics}"
    );
}

pub const ADMIN: &str = ADMIN_TOKEN;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_route_is_served_and_authenticated() {
    let stack = Stack::start("openapi", StackOptions::default())
        .await
        .unwrap();
    let (st, doc) = raw(&stack.api, "GET", "/v1/openapi.json", None, None).await;
    assert_eq!(st, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 20, "{}", paths.len());
    let mut checked = 0;
    for (path, ops) in paths {
        for method in ops.as_object().unwrap().keys() {
            let concrete = path.replace("{id}", "00000000-0000-0000-0000-000000000000");
            let body = (method == "post").then(|| ("application/json", b"{}".to_vec()));
            let (st, v) = raw(&stack.api, &method.to_uppercase(), &concrete, None, body).await;
            // 401 proves the route exists (unknown routes are 404, wrong methods 405).
            assert_eq!((st, code(&v)), (401, "unauthorized"), "{method} {path}");
            checked += 1;
        }
    }
    assert!(checked >= 29, "{checked}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_bus_message_is_recorded_and_the_consumer_keeps_going() {
    let stack = Stack::start("poison", StackOptions::default())
        .await
        .unwrap();
    let nats = stack.nats.service_client("gateway").await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let ghost = uuid::Uuid::new_v4();
    let ghost_host = uuid::Uuid::new_v4();
    // Garbage bytes, and a well-formed event for an attempt that does not exist; then garbage for
    // the intake and the tool-request consumers.
    js.publish(
        format!("agentscope.events.{ghost_host}.{ghost}"),
        vec![0xff, 0x01, 0x02, 0x03].into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let ev = ExecutionEvent {
        attempt_id: ghost.to_string(),
        seq: 1,
        lease_token: 1,
        host_id: ghost_host.to_string(),
        at_ms: 0,
        body: Some(Body::Output(Output {
            stream: "stdout".into(),
            text: "x".into(),
            truncated: false,
        })),
    };
    js.publish(
        format!("agentscope.events.{ghost_host}.{ghost}"),
        ev.encode_to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    js.publish(
        "agentscope.tasks.submitted",
        b"not protobuf at all \xff".to_vec().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    js.publish(
        format!("agentscope.approvals.requested.session.{ghost}"),
        vec![0xff, 0xff, 0xff].into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let pg = stack.pg.clone();
    let reasons: Vec<String> =
        kit::wait_for("four rejected messages", Duration::from_secs(30), || {
            let pg = pg.clone();
            async move {
                let r: Vec<String> =
                    sqlx::query_scalar("SELECT reason FROM rejected_messages ORDER BY id")
                        .fetch_all(&pg)
                        .await
                        .ok()?;
                (r.len() >= 4).then_some(r)
            }
        })
        .await
        .unwrap();
    assert!(
        reasons.iter().any(|r| r.contains("malformed ToolRequest")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("malformed ExecutionEvent")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("unknown attempt")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("malformed TaskSubmitted")),
        "{reasons:?}"
    );

    // Both consumers still work.
    let (agent, _) = stack
        .command_agent("after", "pool", &["echo", "still-alive"], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let t = stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let events = stack
        .events(&format!(
            "/v1/attempts/{}/events",
            t["attempts"][0]["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    assert!(events.iter().any(|e| e["payload"]["text"] == "still-alive"));
}

/// A token revoked in the database stops working within the gateway's trust period (1 s), even
/// right after it was used and verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_api_token_stops_working_within_a_second() {
    let stack = Stack::start("revoke", StackOptions::default())
        .await
        .unwrap();
    let admin = stack.api.with_token(ADMIN_TOKEN);
    let ws = admin
        .post("/v1/workspaces", json!({"name": "short-lived"}))
        .await
        .unwrap();
    let token = ws["api_token"].as_str().unwrap().to_string();
    let (st, _) = raw(&stack.api, "GET", "/v1/tasks", Some(&token), None).await;
    assert_eq!(st, 200, "the new token works");
    sqlx::query("UPDATE api_tokens SET revoked_at = now() WHERE workspace_id = $1::uuid")
        .bind(ws["workspace"]["id"].as_str().unwrap())
        .execute(&stack.pg)
        .await
        .unwrap();
    let revoked = std::time::Instant::now();
    let api = stack.api.clone();
    let t = token.clone();
    kit::wait_for("the revoked token refused", Duration::from_secs(10), || {
        let (api, t) = (api.clone(), t.clone());
        async move {
            let (st, v) = raw(&api, "GET", "/v1/tasks", Some(&t), None).await;
            (st == 401).then_some(v)
        }
    })
    .await
    .unwrap();
    assert!(
        revoked.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        revoked.elapsed()
    );
    // And it stays refused (refusals are not cached as valid).
    let (st, v) = raw(&stack.api, "GET", "/v1/tasks", Some(&token), None).await;
    assert_eq!((st, code(&v)), (401, "unauthorized"));
}
