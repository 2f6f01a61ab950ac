//! `agentscope mcp`: the executor's operations (`task.rs`) as an MCP server over stdio, for
//! providers that speak MCP.

use crate::task::{TaskApi, guess_content_type, local_file};
use anyhow::{Context, Result, anyhow};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, ServerCapabilities, ServerConfig};
use rmcp::{
    ErrorData as McpError, ServerHandler, ServiceExt, schemars, tool, tool_handler, tool_router,
};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Clone)]
pub struct Tools {
    api: TaskApi,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
pub struct CommentArgs {
    /// The comment, in Markdown.
    body: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
pub struct UploadArgs {
    /// File name of the Artifact (no directories).
    name: String,
    /// The content as text; or give `path` instead.
    content: Option<String>,
    /// A file in the task directory to upload instead of `content`.
    path: Option<String>,
    /// Media type; guessed from the name when absent.
    content_type: Option<String>,
}

fn text_result(v: &Value) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(
        serde_json::to_string_pretty(v).unwrap_or_default(),
    )])
}

fn tool_error(e: anyhow::Error) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!("{e:#}"))])
}

#[tool_router]
impl Tools {
    pub fn new(api: TaskApi) -> Self {
        Tools { api }
    }

    #[tool(description = "Read the Issue this task works on, with its comments and Artifacts.")]
    async fn read_issue(&self) -> Result<CallToolResult, McpError> {
        Ok(match self.api.context().await {
            Ok(v) => text_result(
                &json!({"issue": v["issue"], "comments": v["comments"], "artifacts": v["artifacts"]}),
            ),
            Err(e) => tool_error(e),
        })
    }

    #[tool(
        description = "Read the task's input material and where its repository and branch come from."
    )]
    async fn read_input(&self) -> Result<CallToolResult, McpError> {
        Ok(match self.api.context().await {
            Ok(v) => text_result(
                &json!({"input": v["input"], "repository": v["repository"], "branch": v["branch"], "task_id": v["task_id"]}),
            ),
            Err(e) => tool_error(e),
        })
    }

    #[tool(description = "Post a comment on the task's Issue.")]
    async fn post_comment(
        &self,
        Parameters(args): Parameters<CommentArgs>,
    ) -> Result<CallToolResult, McpError> {
        Ok(match self.api.comment(&args.body).await {
            Ok(v) => text_result(&v),
            Err(e) => tool_error(e),
        })
    }

    #[tool(
        description = "Upload a deliverable as an Artifact of the task (text content, or a file in the task directory)."
    )]
    async fn upload_artifact(
        &self,
        Parameters(args): Parameters<UploadArgs>,
    ) -> Result<CallToolResult, McpError> {
        let bytes = match (&args.content, &args.path) {
            (Some(c), None) => Ok(c.clone().into_bytes()),
            (None, Some(p)) => local_file(p)
                .and_then(|p| std::fs::read(&p).with_context(|| format!("read {}", p.display()))),
            _ => Err(anyhow!("give exactly one of `content` and `path`")),
        };
        let ct = args
            .content_type
            .clone()
            .unwrap_or_else(|| guess_content_type(&args.name).to_string());
        Ok(match bytes {
            Ok(b) => match self.api.upload(&args.name, &ct, b).await {
                Ok(v) => text_result(&v),
                Err(e) => tool_error(e),
            },
            Err(e) => tool_error(e),
        })
    }
}

#[tool_handler]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions("agentscope: read the Issue you work on, post comments and upload deliverables as Artifacts.")
    }
}

/// Serves the tools over stdio until the client closes the connection.
pub async fn serve_mcp(api: TaskApi) -> Result<()> {
    let service = Tools::new(api)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| anyhow!("start the MCP server: {e}"))?;
    service
        .waiting()
        .await
        .map_err(|e| anyhow!("MCP server: {e}"))?;
    Ok(())
}
