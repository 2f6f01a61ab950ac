//! `agentscope issues`: issues and their comments.

use crate::api::*;
use crate::output::*;
use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum IssuesCmd {
    /// Create an issue; prints its id (and `task <id>` when assigned).
    Create {
        title: String,
        #[arg(long)]
        body: Option<String>,
        /// Agent id or name; the issue becomes a task for it.
        #[arg(long)]
        assign: Option<String>,
        #[arg(long)]
        repo: Option<String>,
        #[arg(long)]
        branch: Option<String>,
        #[arg(long)]
        input: Option<String>,
    },
    /// List issues.
    List,
    /// Show an issue with its tasks and comments.
    Show { id: String },
    /// Comment on an issue (as this token); prints the comment's id.
    Comment { id: String, body: String },
}

pub(crate) async fn issues(api: &Api, cmd: IssuesCmd, json: bool) -> Result<()> {
    match cmd {
        IssuesCmd::Create {
            title,
            body,
            assign,
            repo,
            branch,
            input,
        } => {
            let assignee = match assign {
                Some(a) => Some(resolve(api, "agent", "/v1/agents", &a).await?),
                None => None,
            };
            let req = object(vec![
                ("title", Some(json!(title))),
                ("body", opt(&body)),
                ("assignee_agent_id", opt(&assignee)),
                ("repository", opt(&repo)),
                ("branch", opt(&branch)),
                ("input", opt(&input)),
            ]);
            let v = api.post("/v1/issues", req).await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            out(text(&v["id"]));
            if let Some(t) = v["task_id"].as_str() {
                out(format!("task {t}"));
            }
        }
        IssuesCmd::List => {
            let v = api.get("/v1/issues").await?;
            if json {
                print_json(&v);
                return Ok(());
            }
            let agents = names(api, "/v1/agents").await?;
            let rows = items_of(&v)
                .iter()
                .map(|i| {
                    vec![
                        cell(&i["id"]),
                        cell(&i["status"]),
                        name_of(&agents, &i["assignee_agent_id"]),
                        when(&i["created_at"]),
                        cell(&i["title"]),
                    ]
                })
                .collect();
            table(&["ID", "STATUS", "ASSIGNEE", "CREATED", "TITLE"], rows);
        }
        IssuesCmd::Show { id } => {
            let id = id_arg("issue", &id)?;
            let i = api.get(&format!("/v1/issues/{id}")).await?;
            let comments = api.get(&format!("/v1/issues/{id}/comments")).await?;
            if json {
                print_json(&json!({"issue": i, "comments": comments["items"]}));
                return Ok(());
            }
            out(format!("issue {} {}", cell(&i["id"]), cell(&i["status"])));
            out(format!("  title     {}", cell(&i["title"])));
            out(format!("  assignee  {}", cell(&i["assignee_agent_id"])));
            out(format!("  created   {}", when(&i["created_at"])));
            let tasks: Vec<String> = i["tasks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect();
            out(format!(
                "  tasks     {}",
                if tasks.is_empty() {
                    "-".into()
                } else {
                    tasks.join(" ")
                }
            ));
            for l in text(&i["body"]).lines() {
                out(format!("  | {l}"));
            }
            for c in items_of(&comments) {
                out(format!(
                    "comment {} by {} at {}",
                    cell(&c["id"]),
                    cell(&c["author"]),
                    when(&c["created_at"])
                ));
                for l in text(&c["body"]).lines() {
                    out(format!("  | {l}"));
                }
            }
        }
        IssuesCmd::Comment { id, body } => {
            let id = id_arg("issue", &id)?;
            let req = object(vec![("body", Some(json!(body)))]);
            let v = api.post(&format!("/v1/issues/{id}/comments"), req).await?;
            if json {
                print_json(&v)
            } else {
                out(text(&v["id"]))
            }
        }
    }
    Ok(())
}
