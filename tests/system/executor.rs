//! The executor's reach: a task-scoped credential reads its own work, comments and uploads
//! Artifacts while its attempt runs, and nothing else; the same operations over MCP.

use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_comments_and_uploads_and_its_credential_reaches_nothing_else() {
    let stack = Stack::start(
        "executor",
        StackOptions {
            gateway_env: vec![("AGENTSCOPE_MAX_ARTIFACT_BYTES".into(), "4096".into())],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let token_file = stack.shared.join("token");
    let gate = stack.dir.path.join("gate");
    let script = format!(
        "set -e; agentscope task show > ctx.json; grep -q 'Make it better' ctx.json; \
         agentscope task comment \"progress from $AGENTSCOPE_ATTEMPT_ID\" >/dev/null; \
         printf '# Report\\nall good\\n' > report.md; agentscope task upload report.md >/dev/null; \
         echo \"$AGENTSCOPE_TASK_TOKEN\" > '{}'; while [ ! -e '{}' ]; do sleep 0.05; done; echo done",
        token_file.display(),
        gate.display()
    );
    let (agent, _) = stack
        .command_agent("exec", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": "Make it better", "body": "please", "assignee_agent_id": agent}),
        )
        .await
        .unwrap();
    let issue_id = issue["id"].as_str().unwrap().to_string();
    let task_id = issue["task_id"].as_str().unwrap().to_string();
    let tf = token_file.clone();
    let token = kit::wait_for("the executor's credential", Duration::from_secs(60), || {
        let tf = tf.clone();
        async move {
            std::fs::read_to_string(&tf)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| s.starts_with("agt_"))
        }
    })
    .await
    .unwrap();
    let exec = stack.api.with_token(&token);

    // Its own work: yes.
    let ctx = exec.get("/v1/task").await.unwrap();
    assert_eq!(ctx["task_id"], task_id.as_str());
    assert_eq!(ctx["issue"]["title"], "Make it better");
    // Anything outside read work / comment / upload: no.
    for path in [
        "/v1/tasks",
        &format!("/v1/tasks/{task_id}"),
        &format!("/v1/issues/{issue_id}"),
        "/v1/hosts",
        "/v1/agents",
    ] {
        let (st, v) = exec.send(reqwest::Method::GET, path, None).await.unwrap();
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (401, Some("unauthorized")),
            "{path}"
        );
    }
    let (st, _) = exec
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{task_id}/cancel"),
            Some(json!({})),
        )
        .await
        .unwrap();
    assert_eq!(st, 401);
    // A workspace token is not a task credential.
    let (st, _) = stack
        .api
        .send(reqwest::Method::GET, "/v1/task", None)
        .await
        .unwrap();
    assert_eq!(st, 401);
    // Path tricks and oversized uploads are refused with stable codes.
    for name in [
        "..%2F..%2Fetc%2Fpasswd",
        "a%2Fb.txt",
        "..",
        "x%07y",
        "a%5Cb",
    ] {
        let res = exec
            .client
            .post(format!("{}/v1/task/artifacts?name={name}", exec.base))
            .bearer_auth(&token)
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "{name:?}");
        let v: Value = res.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_field");
    }
    let res = exec
        .client
        .post(format!("{}/v1/task/artifacts?name=big.bin", exec.base))
        .bearer_auth(&token)
        .body(vec![0u8; 8192])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 413);

    // Comment and Artifact are visible to people through the API.
    let comments = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap();
    let bodies: Vec<&str> = comments["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["body"].as_str())
        .collect();
    assert!(
        bodies.iter().any(|b| b.starts_with("progress from ")),
        "{bodies:?}"
    );
    let arts = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/artifacts"))
        .await
        .unwrap();
    let art = arts["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "report.md")
        .cloned()
        .expect("report.md uploaded");
    assert_eq!(art["content_type"], "text/markdown");
    let content = stack
        .api
        .artifact_content(art["id"].as_str().unwrap())
        .await
        .unwrap();
    assert_eq!(content.headers()["content-type"], "text/markdown");
    assert_eq!(content.text().await.unwrap(), "# Report\nall good\n");

    // Once the attempt has ended, the credential is dead.
    std::fs::write(&gate, "go").unwrap();
    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let (st, _) = exec
        .send(reqwest::Method::GET, "/v1/task", None)
        .await
        .unwrap();
    assert_eq!(st, 401, "the credential expires with its attempt");
    let (st, _) = exec
        .send(
            reqwest::Method::POST,
            "/v1/task/comments",
            Some(json!({"body": "late"})),
        )
        .await
        .unwrap();
    assert_eq!(st, 401);
    // And the credential never appears in the attempt's events.
    let events = stack
        .events(&format!("/v1/tasks/{task_id}/events"))
        .await
        .unwrap();
    assert!(!serde_json::to_string(&events).unwrap().contains(&token));
}

/// Speaks MCP (JSON-RPC over stdio) to `agentscope mcp` as a provider would.
struct McpClient {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
    next: u64,
}

impl McpClient {
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "{}",
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        )
        .unwrap();
        stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "MCP server closed stdout"
            );
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["id"] == id {
                return v;
            }
        }
    }
    fn notify(&mut self, method: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{}", json!({"jsonrpc": "2.0", "method": method})).unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for McpClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_server_offers_the_executor_tools() {
    let stack = Stack::start("mcp", StackOptions::default()).await.unwrap();
    let token_file = stack.shared.join("token");
    let gate = stack.dir.path.join("gate");
    let script = format!(
        "echo \"$AGENTSCOPE_TASK_TOKEN\" > '{}'; echo hello > notes.txt; pwd > '{}.dir'; while [ ! -e '{}' ]; do sleep 0.05; done",
        token_file.display(),
        token_file.display(),
        gate.display()
    );
    let (agent, _) = stack
        .command_agent("mcp", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let issue = stack
        .api
        .post("/v1/issues", json!({"title": "MCP issue", "body": "via mcp", "assignee_agent_id": agent, "input": "the input"}))
        .await
        .unwrap();
    let issue_id = issue["id"].as_str().unwrap().to_string();
    let tf = token_file.clone();
    // The script writes the working directory last, and its file exists (empty) before `pwd`
    // has written it: wait for the whole line.
    let (token, workdir) = kit::wait_for("the credential", Duration::from_secs(60), || {
        let tf = tf.clone();
        async move {
            let token = std::fs::read_to_string(&tf)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| s.starts_with("agt_"))?;
            let dir = std::fs::read_to_string(format!("{}.dir", tf.display()))
                .ok()
                .filter(|s| s.ends_with('\n'))?;
            Some((token, dir))
        }
    })
    .await
    .unwrap();

    let mut child = std::process::Command::new(kit::bin("agentscope").unwrap())
        .arg("mcp")
        .env("AGENTSCOPE_API", &stack.api.base)
        .env("AGENTSCOPE_TASK_TOKEN", &token)
        .current_dir(workdir.trim())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut mcp = McpClient {
        child,
        out,
        next: 0,
    };
    let init = mcp.call(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}),
    );
    assert!(
        init["result"]["capabilities"]["tools"].is_object(),
        "{init}"
    );
    mcp.notify("notifications/initialized");
    let tools = mcp.call("tools/list", json!({}));
    let mut names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "post_comment",
            "read_input",
            "read_issue",
            "upload_artifact"
        ]
    );

    let r = mcp.call("tools/call", json!({"name": "read_issue", "arguments": {}}));
    let text = r["result"]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.contains("MCP issue") && text.contains("via mcp"),
        "{r}"
    );
    let r = mcp.call("tools/call", json!({"name": "read_input", "arguments": {}}));
    assert!(
        r["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("the input")
    );
    let r = mcp.call(
        "tools/call",
        json!({"name": "post_comment", "arguments": {"body": "from mcp"}}),
    );
    assert_eq!(r["result"]["isError"], false, "{r}");
    let r = mcp.call(
        "tools/call",
        json!({"name": "upload_artifact", "arguments": {"name": "notes.txt", "path": "notes.txt"}}),
    );
    assert_eq!(r["result"]["isError"], false, "{r}");
    let r = mcp.call("tools/call", json!({"name": "upload_artifact", "arguments": {"name": "passwd", "path": "../../../../etc/passwd"}}));
    assert_eq!(
        r["result"]["isError"], true,
        "a path outside the task directory is refused: {r}"
    );

    let comments = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/comments"))
        .await
        .unwrap();
    assert!(
        comments["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["body"] == "from mcp")
    );
    let arts = stack
        .api
        .get(&format!("/v1/issues/{issue_id}/artifacts"))
        .await
        .unwrap();
    let names: Vec<&str> = arts["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["notes.txt"]);
    std::fs::write(&gate, "go").unwrap();
}
