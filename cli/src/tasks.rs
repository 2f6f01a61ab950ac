//! `agentscope tasks`, `cancel` and `explain`: tasks, their attempts, and why they wait or failed.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum TasksCmd {
    /// Submit a task; prints its id.
    Create {
        /// Agent id or name.
        #[arg(long)]
        agent: String,
        #[arg(long)]
        issue: Option<String>,
        #[arg(long)]
        repo: Option<String>,
        #[arg(long)]
        branch: Option<String>,
        #[arg(long)]
        input: Option<String>,
        #[arg(long)]
        timeout_secs: Option<i32>,
        #[arg(long)]
        idempotency_key: Option<String>,
    },
    /// List tasks, newest first.
    List {
        /// Only tasks with this status (queued, running, succeeded, failed, cancelled).
        #[arg(long)]
        status: Option<String>,
    },
    /// Show a task and its attempts.
    Show { id: String },
}

pub(crate) async fn tasks(api: &Api, cmd: TasksCmd, json: bool) -> Result<()> {
    match cmd {
        TasksCmd::Create {
            agent,
            issue,
            repo,
            branch,
            input,
            timeout_secs,
            idempotency_key,
        } => {
            let agent = resolve(api, "agent", "/v1/agents", &agent).await?;
            let issue = issue.map(|i| id_arg("issue", &i)).transpose()?;
            let body = object(vec![
                ("agent_id", Some(json!(agent))),
                ("issue_id", opt(&issue)),
                ("repository", opt(&repo)),
                ("branch", opt(&branch)),
                ("input", opt(&input)),
                ("timeout_secs", opt(&timeout_secs)),
                ("idempotency_key", opt(&idempotency_key)),
            ]);
            let v = api.post("/v1/tasks", body).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
        TasksCmd::List { status } => {
            let path = match &status {
                Some(s) => format!("/v1/tasks?status={}", enc(s)),
                None => "/v1/tasks".to_string(),
            };
            let v = api.get(&path).await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let agents = names(api, "/v1/agents").await?;
            let rows = items_of(&v)
                .iter()
                .map(|t| {
                    vec![
                        cell(&t["id"]),
                        cell(&t["status"]),
                        cell(&t["newest_attempt"]),
                        name_of(&agents, &t["agent_id"]),
                        when(&t["created_at"]),
                        cell(&t["failure_class"]),
                    ]
                })
                .collect();
            table(
                &["ID", "STATUS", "ATTEMPT", "AGENT", "CREATED", "FAILURE"],
                rows,
            );
        }
        TasksCmd::Show { id } => {
            let id = id_arg("task", &id)?;
            let t = api.get(&format!("/v1/tasks/{id}")).await?;
            if json {
                print_json(&t);
                return Ok(());
            }
            out(format!("task {} {}", cell(&t["id"]), cell(&t["status"])));
            out(format!(
                "  agent {}  issue {}  repository {}  branch {}  created {}",
                cell(&t["agent_id"]),
                cell(&t["issue_id"]),
                cell(&t["repository"]),
                cell(&t["branch"]),
                when(&t["created_at"])
            ));
            if !t["cancel_requested_at"].is_null() {
                out(format!(
                    "  cancel requested at {}",
                    when(&t["cancel_requested_at"])
                ));
            }
            for a in t["attempts"].as_array().into_iter().flatten() {
                out(attempt_line(a));
            }
        }
    }
    Ok(())
}

/// `GET /v1/tasks/{id}/explain`: the summary, then task-level reasons and one block per host
/// (`eligible`, or each failing predicate), or the failure with its evidence.
pub(crate) async fn explain(api: &Api, raw_id: &str, json: bool) -> Result<()> {
    let id = id_arg("task", raw_id)?;
    let v = api.get(&format!("/v1/tasks/{id}/explain")).await?;
    if json {
        print_json(&v);
        return Ok(());
    }
    out(format!(
        "task {} {}",
        cell(&v["task_id"]),
        cell(&v["status"])
    ));
    out(format!("  {}", text(&v["summary"])));
    if v["timeout"].is_object() {
        out(format!(
            "  run timeout: {} ({})",
            text(&v["timeout"]["detail"]),
            cell(&v["timeout"]["source"])
        ));
    }
    for a in v["attempts"].as_array().into_iter().flatten() {
        out(format!("  {}", attempt_line(a)));
    }
    if v["waiting"] == true {
        let t = &v["target"];
        out(format!(
            "  needs pool {}  provider {}  capabilities [{}]",
            cell(&t["pool"]),
            cell(&t["provider"]),
            t["required_capabilities"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let reasons = v["reasons"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if !reasons.is_empty() {
            out("reasons:");
            for r in reasons {
                out(format!(
                    "  {:<16}  {}",
                    text(&r["predicate"]),
                    text(&r["detail"])
                ));
            }
        }
        let hosts = v["hosts"].as_array().map(Vec::as_slice).unwrap_or_default();
        out(format!("hosts ({}):", hosts.len()));
        for h in hosts {
            let id = short(h["host_id"].as_str().unwrap_or(""));
            let verdict = if h["eligible"] == true {
                "eligible"
            } else {
                "blocked"
            };
            out(format!(
                "  {} ({id}) pool {}: {verdict}",
                cell(&h["name"]),
                cell(&h["pool"])
            ));
            for f in h["failing"].as_array().into_iter().flatten() {
                out(format!(
                    "    {:<16}  {}",
                    text(&f["predicate"]),
                    text(&f["detail"])
                ));
            }
        }
    } else if v["failure"].is_object() {
        let f = &v["failure"];
        out(format!("failure class {}", cell(&f["class"])));
        out(format!("  remedy  {}", text(&f["remedy"])));
        if !f["detail"].is_null() {
            out(format!(
                "  detail  {}",
                text(&f["detail"]).replace('\n', "\\n")
            ));
        }
        if !f["exit_code"].is_null() {
            out(format!("  exit    {}", f["exit_code"]));
        }
        out("evidence (last events):");
        for ev in f["evidence"].as_array().into_iter().flatten() {
            let mut ev = ev.clone();
            ev["attempt_number"] = f["attempt_number"].clone();
            out(format!("  {}", event_line(&ev)));
        }
    } else if v["host"].is_object() {
        let h = &v["host"];
        out(format!(
            "  on host {} ({}) pool {}",
            cell(&h["name"]),
            cell(&h["host_id"]),
            cell(&h["pool"])
        ));
    }
    Ok(())
}

pub(crate) async fn cancel(
    api: &Api,
    task_id: &str,
    reason: Option<String>,
    json: bool,
) -> Result<()> {
    let id = id_arg("task", task_id)?;
    let v = api
        .post(
            &format!("/v1/tasks/{id}/cancel"),
            object(vec![("reason", opt(&reason))]),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        out(format!(
            "cancel requested for task {id} (status {})",
            cell(&v["status"])
        ));
    }
    Ok(())
}
