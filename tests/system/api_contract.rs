//! The API keeps the contract its OpenAPI document states: request bodies are typed (a body
//! that is not an object, an unknown field, a field of the wrong type are refused with 422 and
//! a stable code naming the field), every route documents its request body, success and error
//! bodies and its query parameters, and schemathesis, fuzzing the served document, finds no
//! server error and no answer that breaks the document.

use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

async fn post_raw(api: &Api, path: &str, body: &str) -> (u16, Value) {
    let res = api
        .client
        .post(format!("{}{path}", api.base))
        .bearer_auth(&api.token)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
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

/// Found by schemathesis: a number near f64's limit stored in a version's JSON reads back from
/// PostgreSQL's exact decimal as out of range, and every later read of the agent's versions
/// failed with a 500. Such versions are refused; the agent stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_whose_json_would_not_read_back_is_refused_and_the_agent_stays_readable() {
    let stack = Stack::start("jsonnumbers", StackOptions::default())
        .await
        .unwrap();
    let api = &stack.api;
    let agent = api
        .post(
            "/v1/agents",
            json!({"name": "a", "provider": "command", "instructions": "x"}),
        )
        .await
        .unwrap();
    let id = agent["id"].as_str().unwrap().to_string();
    let path = format!("/v1/agents/{id}/versions");
    for body in [
        r#"{"instructions":"x","provider":"command","capability_files":{"a":1.7976931348623157e308}}"#,
        r#"{"instructions":"x","provider":"command","capability_files":{"a":{"b":"c"}}}"#,
        r#"{"instructions":"x","provider":"command","policy":{"x":[1.7976931348623157e308]}}"#,
    ] {
        let (st, v) = post_raw(api, &path, body).await;
        assert_eq!((st, code(&v)), (400, "invalid_field"), "{body}: {v}");
    }
    let versions = api.get(&path).await.unwrap();
    assert_eq!(versions["items"].as_array().unwrap().len(), 1, "{versions}");

    // Any body, not only a version's: a runtime profile's params (schemathesis found this one).
    let (st, v) = post_raw(
        api,
        "/v1/runtime-profiles",
        r#"{"name":"p","provider":"command","params":{"command":["true"],"n":-1.7976931348623157e308}}"#,
    )
    .await;
    assert_eq!((st, code(&v)), (400, "invalid_field"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("params.n"),
        "{v}"
    );
    let profiles = api.get("/v1/runtime-profiles").await.unwrap();
    assert_eq!(profiles["items"], json!([]), "{profiles}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_do_not_fit_their_type_are_refused_with_422_naming_the_field() {
    let stack = Stack::start("typedbody", StackOptions::default())
        .await
        .unwrap();
    let api = &stack.api;

    // A JSON array is not a pool (serde would read a struct from a sequence).
    for body in [r#"["x", 2]"#, r#"["x"]"#, r#""x""#, "3", "null"] {
        let (st, v) = post_raw(api, "/v1/pools", body).await;
        assert_eq!((st, code(&v)), (422, "invalid_body"), "{body}: {v}");
    }
    let pools = api.get("/v1/pools").await.unwrap();
    assert_eq!(pools["items"], json!([]), "no pool was created: {pools}");

    // An unknown field is named.
    let (st, v) = post_raw(api, "/v1/pools", r#"{"name":"p","colour":"blue"}"#).await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("colour"),
        "{v}"
    );

    // A wrong type is named by its path, nested ones too.
    let (st, v) = post_raw(api, "/v1/pools", r#"{"name":"p","max_concurrency":"two"}"#).await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_concurrency"),
        "{v}"
    );
    let (st, v) = post_raw(
        api,
        "/v1/bindings",
        r#"{"agent_id":"00000000-0000-0000-0000-000000000000","pool_id":"00000000-0000-0000-0000-000000000000","required_capabilities":["gpu", 7]}"#,
    )
    .await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("required_capabilities[1]"),
        "{v}"
    );

    // The optional bodies (cancel, approve, deny) are typed the same way.
    let (st, v) = post_raw(
        api,
        "/v1/tasks/00000000-0000-0000-0000-000000000000/cancel",
        r#"{"reason": 5}"#,
    )
    .await;
    assert_eq!((st, code(&v)), (422, "invalid_field"), "{v}");
    let (st, v) = post_raw(
        api,
        "/v1/approvals/00000000-0000-0000-0000-000000000000/approve",
        "[]",
    )
    .await;
    assert_eq!((st, code(&v)), (422, "invalid_body"), "{v}");

    // Malformed JSON stays 400.
    let (st, v) = post_raw(api, "/v1/pools", "{not json").await;
    assert_eq!((st, code(&v)), (400, "malformed_json"), "{v}");

    // A body that fits is accepted, and its answer reads into the API's type.
    let (st, v) = post_raw(api, "/v1/pools", r#"{"name":"p","max_concurrency":2}"#).await;
    assert_eq!(st, 201, "{v}");
    let pool: agentscope_api::Pool = serde_json::from_value(v).unwrap();
    assert_eq!((pool.name.as_str(), pool.max_concurrency), ("p", Some(2)));
}

fn resolve<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v["$ref"].as_str() {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            &doc["components"]["schemas"][name]
        }
        None => v,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_states_bodies_answers_errors_and_query_parameters_of_every_route() {
    let stack = Stack::start("openapidoc", StackOptions::default())
        .await
        .unwrap();
    let doc = stack.api.get("/v1/openapi.json").await.unwrap();
    let mut operations = 0;
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            operations += 1;
            let at = format!("{method} {path}");
            let responses = op["responses"].as_object().unwrap();
            let (success, answer) = responses
                .iter()
                .find(|(s, _)| s.starts_with('2'))
                .unwrap_or_else(|| panic!("{at}: no success response"));
            let content = answer["content"].as_object().unwrap();
            if path != "/v1/artifacts/{id}/content" {
                let schema = resolve(&doc, &content["application/json"]["schema"]);
                assert_eq!(schema["type"], "object", "{at} {success}: {schema}");
                assert!(schema["properties"].is_object(), "{at}: {schema}");
            }
            // Every error a route can answer is documented with the error body.
            let mut errors: Vec<&str> = vec!["401", "422", "503"];
            if path.contains("{id}") {
                errors.extend(["400", "404"]);
            }
            if method == "post" {
                errors.push("409");
            }
            for status in errors {
                let e = &responses
                    .get(status)
                    .unwrap_or_else(|| panic!("{at}: no {status}"))["content"]["application/json"]
                    ["schema"];
                let e = resolve(&doc, e);
                assert!(e["properties"]["error"].is_object(), "{at} {status}: {e}");
            }
            // Request bodies are typed objects that refuse unknown fields.
            if method == "post" && path != "/v1/secrets/rotate" {
                let body = &op["requestBody"]["content"];
                if path == "/v1/task/artifacts" {
                    assert_eq!(body["*/*"]["schema"]["format"], "binary", "{at}");
                } else {
                    let schema = resolve(&doc, &body["application/json"]["schema"]);
                    assert_eq!(schema["type"], "object", "{at}: {schema}");
                    assert_eq!(schema["additionalProperties"], false, "{at}: {schema}");
                }
            }
            assert!(
                op["security"].as_array().is_some_and(|s| !s.is_empty()),
                "{at}"
            );
        }
    }
    assert!(operations >= 49, "{operations}");
    // Rotation reads no body, and says so.
    assert!(doc["paths"]["/v1/secrets/rotate"]["post"]["requestBody"].is_null());
    // Query parameters are documented where routes read them.
    let query = |path: &str| -> Vec<String> {
        doc["paths"][path]["get"]["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["in"] == "query")
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(query("/v1/tasks"), ["status", "limit"]);
    assert_eq!(query("/v1/approvals"), ["status", "task_id", "session_id"]);
    assert_eq!(query("/v1/tasks/{id}/events"), ["after", "limit", "follow"]);
    assert_eq!(
        query("/v1/attempts/{id}/events"),
        ["after", "limit", "follow"]
    );
    let upload = doc["paths"]["/v1/task/artifacts"]["post"]["parameters"][0].clone();
    assert_eq!(
        (&upload["name"], &upload["required"]),
        (&json!("name"), &json!(true))
    );
    // The three security schemes.
    let schemes = doc["components"]["securitySchemes"].as_object().unwrap();
    for s in ["bearer", "task", "admin"] {
        assert!(schemes.contains_key(s), "{s}");
    }
}

/// The pinned schemathesis, installed on first use by scripts/install-schemathesis.sh.
fn schemathesis() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install-schemathesis.sh");
    let out = std::process::Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let st = stdout
        .lines()
        .find_map(|l| l.strip_prefix("SCHEMATHESIS="))
        .unwrap_or_else(|| panic!("no SCHEMATHESIS= line in {stdout}"));
    PathBuf::from(st)
}

/// Runs schemathesis against the served document with `token`, on the operations `include`
/// selects; returns its exit status and output.
async fn fuzz(stack: &Stack, token: &str, args: &[&str]) -> (bool, String) {
    let st = schemathesis();
    let seed = std::env::var("AGENTSCOPE_FUZZ_SEED").unwrap_or_else(|_| "20261130".into());
    let mut cmd = tokio::process::Command::new(st);
    cmd.current_dir(&stack.dir.path)
        .arg("run")
        .arg(format!("{}/v1/openapi.json", stack.api.base))
        .args(["--url", &stack.api.base])
        .args(["--header", &format!("Authorization: Bearer {token}")])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,negative_data_rejection,ignored_auth",
        ])
        .args(["--seed", &seed])
        .args(["--workers", "2"])
        .args(["--request-timeout", "10"])
        .args(["--suppress-health-check", "all"])
        .args(["--no-color"])
        .args(args)
        .env("SCHEMATHESIS_TELEMETRY", "false")
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(240), cmd.output())
        .await
        .expect("schemathesis ran past its time budget")
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The end of a long log.
fn tail(s: &str) -> &str {
    let mut at = s.len().saturating_sub(20_000);
    while !s.is_char_boundary(at) {
        at += 1;
    }
    &s[at..]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_failure_against_the_served_document() {
    let stack = Stack::start("fuzz", StackOptions::default()).await.unwrap();
    // Everything a workspace token reaches (the admin and executor routes answer it 401, as
    // documented), bounded in examples and time.
    let (ok, out) = fuzz(
        &stack,
        &stack.api.token,
        &["--max-examples", "20", "--max-time", "100"],
    )
    .await;
    assert!(
        ok,
        "schemathesis (workspace token) failed:\n{out}\n{}",
        tail(&stack.log("gateway"))
    );
    // Workspace creation with the admin token.
    let (ok, out) = fuzz(
        &stack,
        ADMIN_TOKEN,
        &[
            "--include-path",
            "/v1/workspaces",
            "--max-examples",
            "20",
            "--max-time",
            "30",
        ],
    )
    .await;
    assert!(
        ok,
        "schemathesis (admin token) failed:\n{out}\n{}",
        tail(&stack.log("gateway"))
    );
    // The gateway stayed healthy and logged no internal error.
    let log = stack.log("gateway");
    assert!(!log.contains("request failed"), "{}", tail(&log));
    assert!(!log.contains("does not fit its API type"), "{}", tail(&log));
}
