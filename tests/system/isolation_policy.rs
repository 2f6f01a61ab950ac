//! Issue 9, policy part: attacks an agent would run against the tool policy, secret redaction
//! and the API's idempotency and authorship, each refused.

use crate::agents::modelsim;
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::Duration;

/// A stack whose dataplane talks to a scripted model server running `script`; also the model
/// server, its request log and its directory.
async fn policy_stack(
    label: &str,
    script: &Value,
) -> (Stack, kit::Proc, std::path::PathBuf, kit::TempDir) {
    let simdir = kit::TempDir::new(&format!("{label}-model"));
    let (sim, url, log) = modelsim(&simdir.path, script).await;
    let stack = Stack::start(
        label,
        StackOptions {
            dataplane_env: vec![
                ("AGENTSCOPE_MODEL_API".into(), "anthropic".into()),
                ("AGENTSCOPE_MODEL_BASE_URL".into(), url),
                ("AGENTSCOPE_MODEL_API_KEY".into(), "sk-modelsim".into()),
            ],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    (stack, sim, log, simdir)
}

async fn managed_agent(stack: &Stack, name: &str, extra: Value) -> String {
    let mut body =
        json!({"name": name, "provider": "managed", "instructions": format!("You are {name}.")});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    let a = stack.api.post("/v1/agents", body).await.unwrap();
    a["id"].as_str().unwrap().to_string()
}

async fn start_session(stack: &Stack, agent: &str, input: &str) -> String {
    stack
        .api
        .post(
            "/v1/sessions",
            json!({"agent_id": agent, "environment": "sandbox", "input": input}),
        )
        .await
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Waits until every input of the session has an outcome; returns the session.
async fn wait_outcomes(stack: &Stack, id: &str, n: usize) -> Value {
    let api = stack.api.clone();
    let path = format!("/v1/sessions/{id}");
    kit::wait_for("the session's outcomes", Duration::from_secs(90), || {
        let api = api.clone();
        let path = path.clone();
        async move {
            let s = api.get(&path).await.ok()?;
            let inputs = s["inputs"].as_array()?;
            (inputs.len() >= n && inputs.iter().all(|i| !i["outcome"].is_null())).then_some(s)
        }
    })
    .await
    .unwrap()
}

async fn session_events(stack: &Stack, id: &str) -> Vec<Value> {
    stack
        .api
        .get(&format!("/v1/sessions/{id}/events"))
        .await
        .unwrap()["items"]
        .as_array()
        .unwrap()
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_command_hidden_in_a_longer_line_is_still_denied() {
    let attacks = [
        "cd . && rm -rf x",
        "/bin/rm -rf x",
        "echo $(rm -rf x)",
        "sh -c \"rm -rf x\"",
        "true; r\"\"m -rf x",
        "env FOO=1 \\rm -rf x",
        "echo x | xargs rm -rf",
        "eval 'rm -rf x'",
    ];
    let mut turns: Vec<Value> = attacks
        .iter()
        .map(|c| json!({"tool": "shell", "args": {"command": c}, "expect": "tool_denied"}))
        .collect();
    turns.push(json!({"tool": "shell", "args": {"command": "cat x"}, "expect": "still-here"}));
    let script = json!({"turns": turns, "final": "Tried."});
    let (stack, _sim, log, _simdir) = policy_stack("iso-policy-rules", &script).await;
    let agent = managed_agent(
        &stack,
        "careful",
        json!({
            "policy": {"rules": [{"tool": "shell", "match": "rm *", "decision": "deny"}]},
            "capability_files": {"x": "still-here"}
        }),
    )
    .await;
    let id = start_session(&stack, &agent, "Clean up.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(
        !requests.contains(EXPECTATION_FAILED),
        "every expectation held (each attack denied, the file still there): {requests}"
    );
    let events = session_events(&stack, &id).await;
    let denied: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "tool_denied")
        .filter_map(|e| e["payload"]["input"]["command"].as_str())
        .collect();
    assert_eq!(denied, attacks, "each attack was denied: {events:#?}");
    let ran: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "tool_call")
        .filter_map(|e| e["payload"]["input"]["command"].as_str())
        .collect();
    assert_eq!(ran, ["cat x"], "only the harmless command ran");
    let last = events.iter().rfind(|e| e["kind"] == "tool_result").unwrap();
    assert!(
        last["payload"]["output"]
            .as_str()
            .is_some_and(|o| o.contains("still-here")),
        "the file still exists: {last}"
    );
    assert_eq!(s["inputs"][0]["outcome"]["status"], "tool_denied", "{s:#}");
}

/// What the model server answers when a turn's expectation failed (agentscope-modelsim).
const EXPECTATION_FAILED: &str = "SCRIPT EXPECTATION FAILED";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vault_secret_printed_encoded_reaches_no_event_nor_model_request() {
    // Spaces and a slash: its URL-encoding differs from the value.
    const SECRET: &str = "Vault s3cret/7f3a9c never shown";
    let command = [
        "printf '%s' \"$TOK\" | base64 -w0; echo",
        "printf '%s' \"$TOK\" | base64 -w0 | tr '+/' '-_' | tr -d '='; echo",
        "echo \"x$TOK\" | base64 -w0; echo",
        "echo \"xy$TOK\" | base64 -w0; echo",
        "printf '%s' \"$TOK\" | od -An -v -tx1 | tr -d ' \\n'; echo",
        "printf '%s' \"$TOK\" | od -An -v -tx1 | tr -d ' \\n' | tr a-f A-F; echo",
        "printf '%s' \"$TOK\" | sed 's/ /%20/g; s#/#%2F#g'; echo",
        "printf '%s' \"$TOK\" | sed 's/ /+/g; s#/#%2F#g'; echo",
        "echo printed-all",
    ]
    .join("; ");
    let script = json!({
        "turns": [
            {"tool": "shell", "args": {"command": command}, "expect": "printed-all"},
        ],
        "final": "Printed."
    });
    let (stack, _sim, log, _simdir) = policy_stack("iso-policy-redact", &script).await;
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            "/v1/secrets",
            Some(json!({"name": "TOK", "value": SECRET})),
        )
        .await
        .unwrap();
    assert_eq!(st, 201, "{v}");
    let agent = managed_agent(&stack, "printer", json!({"policy": {"secrets": ["TOK"]}})).await;
    let id = start_session(&stack, &agent, "Print it.").await;
    let s = wait_outcomes(&stack, &id, 1).await;
    assert_eq!(s["inputs"][0]["outcome"]["status"], "completed", "{s:#}");

    // The forms, computed independently of the redaction (by PostgreSQL).
    let (b64, b64x, b64xy, hex): (String, String, String, String) = sqlx::query_as(
        "SELECT encode(convert_to($1, 'UTF8'), 'base64'),
                encode(convert_to('x' || $1 || E'\\n', 'UTF8'), 'base64'),
                encode(convert_to('xy' || $1 || E'\\n', 'UTF8'), 'base64'),
                encode(convert_to($1, 'UTF8'), 'hex')",
    )
    .bind(SECRET)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    let b64 = b64.replace('\n', "");
    let inner = |s: String| -> String {
        // The characters that carry only the secret's bits.
        let s = s.replace('\n', "");
        s[3..s.len() - 4].to_string()
    };
    let forms = [
        SECRET.to_string(),
        b64.trim_end_matches('=').to_string(),
        b64.trim_end_matches('=')
            .replace('+', "-")
            .replace('/', "_"),
        inner(b64x),
        inner(b64xy),
        hex.clone(),
        hex.to_uppercase(),
        SECRET.replace(' ', "%20").replace('/', "%2F"),
        SECRET.replace(' ', "+").replace('/', "%2F"),
    ];
    let events = serde_json::to_string(&session_events(&stack, &id).await).unwrap();
    let stored: (String,) = sqlx::query_as(
        "SELECT (SELECT COALESCE(string_agg(payload::text, ''), '') FROM session_events)
             || (SELECT COALESCE(string_agg(message::text, ''), '') FROM session_messages)
             || (SELECT COALESCE(string_agg(COALESCE(output, ''), ''), '') FROM session_tool_calls)",
    )
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    let requests = std::fs::read_to_string(&log).unwrap();
    assert!(requests.contains("printed-all"), "the tool ran");
    assert!(
        requests.matches("[REDACTED:TOK]").count() >= 8,
        "each printed form was redacted: {requests}"
    );
    for form in &forms {
        assert!(form.len() >= 8, "{form}");
        assert!(!events.contains(form.as_str()), "events hold {form}");
        assert!(!stored.0.contains(form.as_str()), "records hold {form}");
        assert!(
            !requests.contains(form.as_str()),
            "a model request holds {form}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_reused_with_another_request_is_a_conflict() {
    let script = json!({"turns": [], "final": "Done."});
    let (stack, _sim, _log, _simdir) = policy_stack("iso-policy-idem", &script).await;
    let api = &stack.api;
    let post = |path: String, body: Value| async move {
        api.send(reqwest::Method::POST, &path, Some(body))
            .await
            .unwrap()
    };
    let code = |v: &Value| v["error"]["code"].as_str().unwrap_or("").to_string();

    // Hosted task submission.
    let (agent, _) = stack
        .command_agent("hosted", "pool", &["true"], None)
        .await
        .unwrap();
    let body = json!({"agent_id": agent, "input": "first", "idempotency_key": "t1"});
    let (a, b) = tokio::join!(
        post("/v1/tasks".into(), body.clone()),
        post("/v1/tasks".into(), body.clone())
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 201], "concurrent duplicates: {a:?} {b:?}");
    assert_eq!(a.1["id"], b.1["id"]);
    let (st, again) = post("/v1/tasks".into(), body).await;
    assert_eq!(
        (st, &again["id"]),
        (200, &a.1["id"]),
        "the same request again"
    );
    for other in [
        json!({"agent_id": agent, "input": "second", "idempotency_key": "t1"}),
        json!({"agent_id": agent, "input": "first", "timeout_secs": 5, "idempotency_key": "t1"}),
    ] {
        let (st, v) = post("/v1/tasks".into(), other.clone()).await;
        assert_eq!(
            (st, code(&v)),
            (409, "idempotency_conflict".into()),
            "{other}: {v}"
        );
    }
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM tasks WHERE idempotency_key = 't1'")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    assert_eq!(n, 1);

    // Managed session creation.
    let managed = managed_agent(&stack, "managed", json!({})).await;
    let body = json!({"agent_id": managed, "environment": "sandbox", "input": "Once.", "idempotency_key": "s1"});
    let (a, b) = tokio::join!(
        post("/v1/sessions".into(), body.clone()),
        post("/v1/sessions".into(), body.clone())
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 201], "{a:?} {b:?}");
    assert_eq!(a.1["id"], b.1["id"]);
    let session = a.1["id"].as_str().unwrap().to_string();
    for other in [
        json!({"agent_id": managed, "environment": "sandbox", "input": "Twice.", "idempotency_key": "s1"}),
        // A body that differs by one character is another request (`remote` itself would be
        // refused before the key is looked at, unless the deployment enables it).
        json!({"agent_id": managed, "environment": "sandbox", "input": "Once. ", "idempotency_key": "s1"}),
    ] {
        let (st, v) = post("/v1/sessions".into(), other.clone()).await;
        assert_eq!(
            (st, code(&v)),
            (409, "idempotency_conflict".into()),
            "{other}: {v}"
        );
    }

    // Session inputs.
    let inputs = format!("/v1/sessions/{session}/inputs");
    let body =
        json!({"text": "More.", "idempotency_key": "i1", "when_awaiting_approval": "enqueue"});
    let (st, first) = post(inputs.clone(), body.clone()).await;
    assert_eq!(st, 202, "{first}");
    let (st, again) = post(inputs.clone(), body).await;
    assert_eq!((st, &again["id"]), (200, &first["id"]));
    for other in [
        json!({"text": "Something else.", "idempotency_key": "i1", "when_awaiting_approval": "enqueue"}),
        json!({"text": "More.", "idempotency_key": "i1", "when_awaiting_approval": "interrupt"}),
    ] {
        let (st, v) = post(inputs.clone(), other.clone()).await;
        assert_eq!(
            (st, code(&v)),
            (409, "idempotency_conflict".into()),
            "{other}: {v}"
        );
    }
    let (n,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM session_inputs WHERE session_id = $1::uuid")
            .bind(&session)
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    assert_eq!(n, 2, "the first input and one more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_comment_is_recorded_with_the_credential_author_not_the_body_one() {
    let script = json!({"turns": [], "final": "Done."});
    let (stack, _sim, _log, _simdir) = policy_stack("iso-policy-author", &script).await;
    let (agent, _) = stack
        .command_agent("victim", "pool", &["true"], None)
        .await
        .unwrap();
    let issue = stack
        .api
        .post("/v1/issues", json!({"title": "Forge"}))
        .await
        .unwrap();
    let issue_id = issue["id"].as_str().unwrap();
    let forged = format!("agent:{agent}");
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            &format!("/v1/issues/{issue_id}/comments"),
            Some(json!({"body": "I am the agent", "author": forged})),
        )
        .await
        .unwrap();
    assert_eq!(st, 201, "{v}");
    let (token_id,): (uuid::Uuid,) = sqlx::query_as(
        "SELECT t.id FROM api_tokens t JOIN issues i ON i.workspace_id = t.workspace_id
         WHERE i.id = $1::uuid AND t.kind = 'api'",
    )
    .bind(issue_id)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    let expected = format!("token:{token_id}");
    assert_eq!(v["author"], expected.as_str(), "{v}");
    let listed = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap();
    let authors: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["author"].as_str())
        .collect();
    assert_eq!(authors, [expected.as_str()], "{listed}");
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM comments WHERE author LIKE 'agent:%'")
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    assert_eq!(n, 0, "no comment reads as the agent's");
    // A malformed author is still refused with its stable code.
    let (st, v) = stack
        .api
        .send(
            reqwest::Method::POST,
            &format!("/v1/issues/{issue_id}/comments"),
            Some(json!({"body": "x", "author": ""})),
        )
        .await
        .unwrap();
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (400, Some("invalid_field")),
        "{v}"
    );
}
