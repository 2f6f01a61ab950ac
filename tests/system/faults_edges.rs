//! Provider edges (issue 10, item 8), with the real CLIs against the scripted model server:
//! Codex under its default profile (`workspace-write` sandbox, commands through `bash -lc`)
//! reaches the platform through its MCP tool and is told the CLI's absolute path; a deny's
//! reason reaches the model's next request for every provider whose protocol can carry it
//! (Claude Code natively, Codex by steering it into the turn, opencode in a follow-up prompt);
//! a turn that ended because its tool was denied is `failed` with the class `tool_denied`, and
//! explain says why.

use crate::agents::{modelsim, openai_host, provider_agent, provider_env};
use crate::approvals::first_pending;
use agentscope_system_tests::*;
use serde_json::{Value, json};
use std::time::Duration;

fn requests(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_with_its_default_profile_comments_through_the_platform_tool() {
    let stack = Stack::start("edges-codex-comment", StackOptions::default())
        .await
        .unwrap();
    let body = "hi from codex under workspace-write";
    let script = json!({
        "turns": [{"say": "Commenting.", "tool": "mcp:post_comment", "args": {"body": body}, "expect": "agent:"}],
        "final": "Commented."
    });
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    // The default profile: no parameters at all (sandbox workspace-write, no approvals).
    let agent = provider_agent(&stack, "codex-default", "codex", json!({}), json!({})).await;
    let _host = openai_host(&stack, "codex", &url).await;
    let issue = stack
        .api
        .post(
            "/v1/issues",
            json!({"title": "Say hi", "body": "Comment hi.", "assignee_agent_id": agent}),
        )
        .await
        .unwrap();
    let task = issue["task_id"].as_str().unwrap();
    if let Err(e) = stack
        .wait_task(task, "succeeded", Duration::from_secs(120))
        .await
    {
        panic!("{e}\nhost log:\n{}", stack.log("host-h"));
    }
    let comments = stack
        .api
        .get(&format!(
            "/v1/issues/{}/comments",
            issue["id"].as_str().unwrap()
        ))
        .await
        .unwrap();
    let c = comments["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["body"] == body)
        .unwrap_or_else(|| panic!("the comment landed on the Issue: {comments}"));
    assert!(
        c["author"]
            .as_str()
            .is_some_and(|a| a.starts_with("agent:")),
        "written with the task credential: {c}"
    );
    // The translated instructions name the CLI by an absolute path that exists.
    let reqs = requests(&log);
    let first = reqs
        .iter()
        .find(|r| r["turn"] == 0)
        .expect("a first turn request")["body"]
        .to_string();
    let at = first
        .find(" task comment TEXT")
        .expect("the CLI's comment command is named");
    let cli = &first[first[..at].rfind('`').unwrap() + 1..at];
    assert!(
        cli.starts_with('/') && std::path::Path::new(cli).is_file(),
        "an absolute path to the CLI: {cli}"
    );
    assert!(
        !reqs
            .iter()
            .any(|r| r["outcome"] == "expectation_failed" || r["outcome"] == "tool_missing"),
        "the script ran as written"
    );
}

/// A host offering Claude Code, Codex and opencode, each with `approvals: ask`: one task per
/// provider, each shell request denied with its own reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_reason_reaches_the_model_and_the_denied_turn_is_tool_denied() {
    let stack = Stack::start("edges-deny", StackOptions::default())
        .await
        .unwrap();
    let script = json!({
        "turns": [{"say": "Running the build.", "tool": "shell", "args": {"command": "echo denied-work > ran.txt"}}],
        "final": "Finished."
    });
    let (_sim, url, log) = modelsim(&stack.dir.path, &script).await;
    let base = format!("{url}/v1");
    let providers = [
        ("claude-code", "Bash"),
        ("codex", "shell"),
        ("opencode", "bash"),
    ];
    let mut env = provider_env();
    env.extend(
        [
            ("AGENTSCOPE_PROVIDERS", "claude-code,codex,opencode"),
            ("ANTHROPIC_BASE_URL", url.as_str()),
            ("ANTHROPIC_API_KEY", "sk-modelsim"),
            ("OPENAI_BASE_URL", base.as_str()),
            ("OPENAI_API_KEY", "sk-modelsim"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let _host = stack
        .spawn_host("h", "agents", 3, &stack.dir.path.join("hs"), &extra)
        .unwrap();
    let mut tasks = vec![];
    for (provider, _) in providers {
        let agent = provider_agent(
            &stack,
            provider,
            provider,
            json!({"approvals": "ask"}),
            json!({}),
        )
        .await;
        if tasks.is_empty() {
            stack.wait_host_ready("h").await.unwrap();
        }
        tasks.push(stack.submit(json!({"agent_id": agent})).await.unwrap());
    }
    for ((provider, tool), task) in providers.iter().zip(&tasks) {
        let ap = first_pending(&stack, &format!("task_id={task}")).await;
        assert_eq!(ap["tool_name"], *tool, "{ap}");
        let reason = format!("no builds on Fridays ({provider})");
        let (st, v) = stack
            .api
            .send(
                reqwest::Method::POST,
                &format!("/v1/approvals/{}/deny", ap["id"].as_str().unwrap()),
                Some(json!({"reason": reason})),
            )
            .await
            .unwrap();
        assert_eq!(st, 200, "{v}");
    }
    for ((provider, _), task) in providers.iter().zip(&tasks) {
        let reason = format!("no builds on Fridays ({provider})");
        let t = match stack
            .wait_task(task, "failed", Duration::from_secs(120))
            .await
        {
            Ok(t) => t,
            Err(e) => panic!("{provider}: {e}\nhost log:\n{}", stack.log("host-h")),
        };
        let a = &t["attempts"][0];
        assert_eq!(a["failure_class"], "tool_denied", "{provider}: {t:#}");
        assert!(
            a["failure_detail"]
                .as_str()
                .is_some_and(|d| d.contains(&reason)),
            "{provider}: the outcome names the reason: {t:#}"
        );
        let e = stack
            .api
            .get(&format!("/v1/tasks/{task}/explain"))
            .await
            .unwrap();
        assert_eq!(e["failure"]["class"], "tool_denied", "{e:#}");
        assert!(
            e["failure"]["remedy"]
                .as_str()
                .is_some_and(|r| r.contains("denied")),
            "{e:#}"
        );
        let events = stack
            .events(&format!(
                "/v1/attempts/{}/events",
                a["id"].as_str().unwrap()
            ))
            .await
            .unwrap();
        assert!(
            !events.iter().any(|e| e["kind"] == "tool_result"
                && e["payload"]["is_error"] == false
                && e["payload"]["output"].to_string().contains("denied-work")),
            "{provider}: the denied command did not run"
        );
        // The model's next request after the denied call carries the reason.
        let reqs: Vec<Value> = requests(&log)
            .into_iter()
            .filter(|r| {
                r["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(model_path(provider)))
            })
            .collect();
        let asked = reqs
            .iter()
            .position(|r| r["outcome"] == "tool")
            .unwrap_or_else(|| panic!("{provider}: the model asked for the shell"));
        let next = reqs[asked + 1..]
            .iter()
            .find(|r| r["outcome"] != "no_tools")
            .unwrap_or_else(|| panic!("{provider}: the model was asked again after the deny"));
        assert!(
            next["body"].to_string().contains(&reason),
            "{provider}: the reason reached the model's next request: {}",
            next["body"]
        );
    }
}

/// The model endpoint each provider calls (one task per provider, so its requests are its own).
fn model_path(provider: &str) -> &'static str {
    match provider {
        "claude-code" => "/v1/messages",
        "codex" => "/v1/responses",
        _ => "/v1/chat/completions",
    }
}
