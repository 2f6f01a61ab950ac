//! Scripted model server: a stand-in for the model APIs that the provider CLIs (Claude Code,
//! Codex, opencode, OpenClaw) call, speaking their real wire formats (streaming included) and
//! answering from a small script instead of a language model.
//!
//! Endpoints:
//! - `POST /v1/messages` (Anthropic Messages; `?beta=true` too), SSE or JSON;
//!   `POST /v1/messages/count_tokens`.
//! - `POST /v1/responses` (OpenAI Responses), SSE or JSON.
//! - `POST /v1/chat/completions` (OpenAI Chat Completions), SSE or JSON.
//! - `GET /v1/models`; anything else answers 404 with a JSON error. Any API key is accepted.
//!
//! A [`Script`] is `{"turns": [TURN, ...], "final": "text"}` where a TURN is
//! `{"say": "optional text", "tool": "ABSTRACT_TOOL", "args": {...}, "expect": "substring",
//! "hold_until": "/path"}` (the last two optional; see [`Turn`]).
//! The server keeps no conversation state: the turn answered is the first whose calls have no
//! results in the request's history yet (one call per turn unless it has `also`; see
//! [`decide`]); past the last turn it answers `final`
//! (end of turn). Before turn i ≥ 1 (and before `final`), the most recent tool result must
//! contain turn i-1's `expect`, else the answer is text starting with [`EXPECTATION_FAILED`].
//! Requests that declare no tools (titles, side queries) get [`TOOLLESS_ANSWER`] and are not
//! turns.
//!
//! Abstract tools, resolved against the tools the request declares:
//! - `shell`: the CLI's shell tool (`Bash`, `exec_command`, `shell_command`, `shell`, `bash`,
//!   `exec`), its arguments shaped after the declared schema; script args `{"command": "..."}`.
//! - `mcp:NAME`: the declared tool whose name contains `agentscope` and ends with `NAME`
//!   (Claude `mcp__agentscope__NAME`, Codex namespace `mcp__agentscope` + `NAME`, opencode
//!   `agentscope_NAME`, OpenClaw `agentscope__NAME`). When the CLI defers MCP tools behind a
//!   tool search (Claude `ToolSearch`, Codex `tool_search`, OpenClaw `tool_search` +
//!   `tool_call`), the server first searches for the tool, then calls it; search results are
//!   not turns.
//! - anything else: a literal tool name.
//!
//! If the tool is not declared, the answer is text starting with [`TOOL_MISSING`].

mod anthropic;
mod chat;
mod responses;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

/// Token usage reported in every response.
pub const INPUT_TOKENS: u64 = 100;
/// Token usage reported in every response.
pub const OUTPUT_TOKENS: u64 = 20;

/// Plain answer to requests that declare no tools (title generation, side queries).
pub const TOOLLESS_ANSWER: &str = "Scripted task";

/// Prefix of the answer sent when a turn's `expect` was not met.
pub const EXPECTATION_FAILED: &str = "SCRIPT EXPECTATION FAILED";
/// Prefix of the answer sent when the tool a turn needs is not declared by the request.
pub const TOOL_MISSING: &str = "SCRIPT TOOL MISSING";

/// The script the server answers from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub turns: Vec<Turn>,
    /// Text of the last answer, sent once every turn has had its tool result.
    #[serde(rename = "final", default = "default_final")]
    pub final_text: String,
}

fn default_final() -> String {
    "Done.".to_string()
}

/// One tool-calling turn.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// Text sent before the tool call, in the same answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub say: Option<String>,
    /// `shell`, `mcp:NAME` or a literal tool name.
    pub tool: String,
    #[serde(default = "empty_object")]
    pub args: Value,
    /// Substring the result of this turn's tool call must contain before the next turn (or the
    /// final answer) is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<String>,
    /// A path: this turn is answered only once it exists (the model thinks until then, at most
    /// ten minutes), so a test can act while a request is in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_until: Option<String>,
    /// More tool calls in the same answer, after the turn's own (parallel tool use): the turn
    /// is answered once all its calls have results. Each is resolved as `tool` is, but never
    /// through a tool search.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<Call>,
}

/// One more tool call of a turn (see [`Turn::also`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Call {
    pub tool: String,
    #[serde(default = "empty_object")]
    pub args: Value,
    /// The call gets the id of the turn's first call, as a broken or hostile model might send.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub repeat_id: bool,
}

impl Turn {
    /// Tool calls the turn's answer makes: its own and [`Turn::also`].
    fn calls(&self) -> usize {
        1 + self.also.len()
    }
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

impl Script {
    pub fn from_json(text: &str) -> anyhow::Result<Script> {
        let script: Script = serde_json::from_str(text)?;
        for (i, t) in script.turns.iter().enumerate() {
            let calls = std::iter::once((&t.tool, &t.args))
                .chain(t.also.iter().map(|c| (&c.tool, &c.args)));
            for (tool, args) in calls {
                if !args.is_object() {
                    anyhow::bail!("turn {i}: args must be a JSON object");
                }
                if tool == "shell" && !args.get("command").is_some_and(Value::is_string) {
                    anyhow::bail!("turn {i}: the shell tool needs args {{\"command\": \"...\"}}");
                }
                if tool.is_empty() || tool == "mcp:" {
                    anyhow::bail!("turn {i}: empty tool name");
                }
            }
        }
        Ok(script)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Script> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading script {}: {e}", path.display()))?;
        Script::from_json(&text).map_err(|e| anyhow::anyhow!("script {}: {e}", path.display()))
    }
}

/// A tool the request declares: its name and its input JSON schema (`Null` when unknown).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDecl {
    /// Full name; for a tool inside a Responses `namespace` entry, namespace + name (Codex
    /// declares MCP tools as namespace `mcp__SERVER` holding the tool `NAME`).
    pub name: String,
    pub schema: Value,
    /// The Responses namespace the tool is declared in, if any.
    pub namespace: Option<String>,
    /// Responses tool type (`function`, `custom`, `tool_search`, ...); `function` elsewhere.
    pub kind: String,
}

/// What the server needs to know about a request, whatever its wire format.
#[derive(Debug, Clone, Default)]
pub struct RequestView {
    pub model: String,
    pub stream: bool,
    pub tools: Vec<ToolDecl>,
    /// Tool results already in the history.
    pub tool_results: usize,
    /// Text of the most recent tool result.
    pub last_tool_result: Option<String>,
    /// Tool-search results after the most recent counted tool result (guards against a loop
    /// of searches that never load the tool).
    pub searches_since_result: usize,
    /// Text of the search results (tool-search tools) after the most recent counted result.
    pub search_results: Option<String>,
    /// Names containing `agentscope` mentioned anywhere in the request: tools the CLI declares
    /// only lazily (Claude Code's deferred MCP tools, loaded through `ToolSearch`).
    pub mentioned: Vec<String>,
}

/// What the answer should contain.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Plain text, end of turn.
    Text(String),
    /// Optional text followed by one tool call, and `more` after it (parallel tool use).
    Tool {
        say: Option<String>,
        name: String,
        args: Value,
        more: Vec<More>,
    },
}

/// One more tool call of a [`Reply::Tool`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct More {
    pub name: String,
    pub args: Value,
    /// Sent with the id of the answer's first call.
    pub repeat_id: bool,
}

impl Reply {
    /// The answer's tool calls in order: id (`{prefix}_{id}`, then `_{k}` for the `k`th, or
    /// the first's when repeated), name, arguments.
    pub(crate) fn calls(&self, prefix: &str, id: u64) -> Vec<(String, &str, &Value)> {
        match self {
            Reply::Text(_) => vec![],
            Reply::Tool {
                name, args, more, ..
            } => std::iter::once((call_id(prefix, id, 0), name.as_str(), args))
                .chain(more.iter().enumerate().map(|(k, m)| {
                    let k = if m.repeat_id { 0 } else { k + 1 };
                    (call_id(prefix, id, k), m.name.as_str(), &m.args)
                }))
                .collect(),
        }
    }
}

/// Why a request got its answer; goes to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The request declared no tools: short plain answer, not a turn.
    NoTools,
    Tool,
    Final,
    ExpectationFailed,
    ToolMissing,
    /// The turn's MCP tool is deferred: the answer calls the CLI's tool-search tool to load it.
    /// Its result does not count as a turn.
    ToolSearch,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Turn index answered (`turns.len()` for the final answer); `None` for tool-less requests.
    pub turn: Option<usize>,
    pub outcome: Outcome,
    pub reply: Reply,
}

/// The id of an answer's `k`th tool call: `{prefix}_{id}`, then `{prefix}_{id}_{k}`.
fn call_id(prefix: &str, id: u64, k: usize) -> String {
    if k == 0 {
        format!("{prefix}_{id:06}")
    } else {
        format!("{prefix}_{id:06}_{k}")
    }
}

/// Chooses the answer for a request: turn index = number of tool results in the history.
pub fn decide(script: &Script, req: &RequestView) -> Decision {
    if req.tools.is_empty() {
        return Decision {
            turn: None,
            outcome: Outcome::NoTools,
            reply: Reply::Text(TOOLLESS_ANSWER.to_string()),
        };
    }
    // The turn whose calls come next: each turn before it has all its calls answered.
    let (mut i, mut answered) = (0, 0);
    while let Some(t) = script.turns.get(i)
        && answered + t.calls() <= req.tool_results
    {
        answered += t.calls();
        i += 1;
    }
    if answered < req.tool_results && i < script.turns.len() {
        return Decision {
            turn: Some(i),
            outcome: Outcome::ExpectationFailed,
            reply: Reply::Text(format!(
                "{EXPECTATION_FAILED}: turn {i} made {} tool calls and only {} have results",
                script.turns[i].calls(),
                req.tool_results - answered
            )),
        };
    }
    // Past the last turn, each further result counts as a turn (as with one call per turn).
    i += req.tool_results - answered;
    if i >= 1
        && let Some(prev) = script.turns.get(i - 1)
        && let Some(expect) = &prev.expect
    {
        let last = req.last_tool_result.as_deref().unwrap_or("");
        if !last.contains(expect.as_str()) {
            return Decision {
                turn: Some(i),
                outcome: Outcome::ExpectationFailed,
                reply: Reply::Text(format!(
                    "{EXPECTATION_FAILED}: before turn {i}: the result of turn {} ({}) should \
                     contain {expect:?} but was {:?}",
                    i - 1,
                    prev.tool,
                    truncate(last, 800)
                )),
            };
        }
    }
    let Some(turn) = script.turns.get(i) else {
        return Decision {
            turn: Some(i),
            outcome: Outcome::Final,
            reply: Reply::Text(script.final_text.clone()),
        };
    };
    match deferred(&turn.tool, &turn.args, req) {
        Some(Deferred::Search(name, args)) => {
            return Decision {
                turn: Some(i),
                outcome: Outcome::ToolSearch,
                reply: Reply::Tool {
                    // The turn's text goes with the real call, after the search.
                    say: None,
                    name,
                    args,
                    more: vec![],
                },
            };
        }
        Some(Deferred::Call(name, args)) => {
            return Decision {
                turn: Some(i),
                outcome: Outcome::Tool,
                reply: Reply::Tool {
                    say: turn.say.clone().filter(|s| !s.is_empty()),
                    name,
                    args,
                    more: vec![],
                },
            };
        }
        Some(Deferred::Exhausted) => {
            return Decision {
                turn: Some(i),
                outcome: Outcome::ToolMissing,
                reply: Reply::Text(format!(
                    "{TOOL_MISSING}: turn {i}: {} is still not callable after {} tool search(es)",
                    turn.tool, req.searches_since_result
                )),
            };
        }
        None => {}
    }
    let more: Result<Vec<More>, String> = turn
        .also
        .iter()
        .map(|c| {
            resolve_tool(&c.tool, &c.args, &req.tools).map(|(name, args)| More {
                name,
                args,
                repeat_id: c.repeat_id,
            })
        })
        .collect();
    match resolve_tool(&turn.tool, &turn.args, &req.tools).and_then(|first| Ok((first, more?))) {
        Ok(((name, args), more)) => Decision {
            turn: Some(i),
            outcome: Outcome::Tool,
            reply: Reply::Tool {
                say: turn.say.clone().filter(|s| !s.is_empty()),
                name,
                args,
                more,
            },
        },
        Err(msg) => Decision {
            turn: Some(i),
            outcome: Outcome::ToolMissing,
            reply: Reply::Text(format!("{TOOL_MISSING}: turn {i}: {msg}")),
        },
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Tools that search for deferred tool definitions (Claude Code's `ToolSearch`, Codex's
/// Responses `tool_search`, OpenClaw's `tool_search`).
pub const SEARCH_TOOLS: &[&str] = &["ToolSearch", "tool_search"];

/// Tools whose results are not turns: the search tools and OpenClaw's `tool_describe`.
pub const UNCOUNTED_TOOLS: &[&str] = &["ToolSearch", "tool_search", "tool_describe"];

/// OpenClaw's bridge that calls a tool found by `tool_search` by its result id.
pub const BRIDGE_CALL_TOOL: &str = "tool_call";

enum Deferred {
    /// Call the search tool to load / find the tool.
    Search(String, Value),
    /// Call the tool through a bridge (OpenClaw `tool_call {id, args}`).
    Call(String, Value),
    /// Searched already, still not callable.
    Exhausted,
}

/// For an `mcp:NAME` tool that is not declared directly: how to reach it through the CLI's
/// deferred-tool machinery, if it has one.
fn deferred(tool: &str, args: &Value, req: &RequestView) -> Option<Deferred> {
    let suffix = tool.strip_prefix("mcp:")?;
    if find_mcp(suffix, req.tools.iter().map(|t| t.name.as_str())).is_some() {
        return None;
    }
    // OpenClaw: a search result carries the id to pass to `tool_call`.
    if req.tools.iter().any(|t| t.name == BRIDGE_CALL_TOOL)
        && let Some(text) = &req.search_results
    {
        let ids: Vec<&str> = text
            .split(|c: char| {
                !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '/'))
            })
            .collect();
        if let Some(id) = find_mcp(suffix, ids.into_iter()) {
            return Some(Deferred::Call(
                BRIDGE_CALL_TOOL.to_string(),
                json!({"id": id, "args": args}),
            ));
        }
    }
    let search = req
        .tools
        .iter()
        .find(|t| SEARCH_TOOLS.contains(&t.name.as_str()))?;
    if req.searches_since_result > 0 {
        return Some(Deferred::Exhausted);
    }
    let props = search.schema.get("properties").and_then(Value::as_object);
    let args = match find_mcp(suffix, req.mentioned.iter().map(String::as_str)) {
        // Claude Code: exact selection by full name.
        Some(name)
            if search.name == "ToolSearch"
                || props.is_some_and(|p| p.contains_key("max_results")) =>
        {
            json!({"query": format!("select:{name}"), "max_results": 5})
        }
        Some(name) => json!({"query": name, "limit": 8}),
        // Codex lists only the namespace (`mcp__agentscope`): a keyword search.
        None => {
            let ns = req
                .mentioned
                .iter()
                .find(|m| m.to_ascii_lowercase().contains("agentscope"))
                .map(String::as_str)
                .unwrap_or("agentscope");
            json!({"query": format!("{ns} {suffix}"), "limit": 8})
        }
    };
    Some(Deferred::Search(search.name.clone(), args))
}

/// The name containing `agentscope` that ends with `suffix`.
fn find_mcp<'a>(suffix: &str, mut names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    names.find(|n| {
        n.to_ascii_lowercase().contains("agentscope")
            && n.ends_with(suffix)
            && n.len() > suffix.len()
    })
}

/// Identifiers containing `agentscope` in any string of a request body.
pub(crate) fn mentioned_names(body: &Value) -> Vec<String> {
    fn has_agentscope(text: &str) -> bool {
        text.as_bytes()
            .windows(b"agentscope".len())
            .any(|w| w.eq_ignore_ascii_case(b"agentscope"))
    }
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            // Most strings do not mention it at all: only those are split into words.
            Value::String(text) if has_agentscope(text) => out.extend(
                text.split(|c: char| {
                    !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
                })
                .filter(|w| has_agentscope(w))
                .map(str::to_string),
            ),
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            Value::Object(map) => map.values().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(body, &mut out);
    out.sort();
    out.dedup();
    out
}

/// Shell tools of the CLIs, most specific first.
const SHELL_TOOLS: &[&str] = &[
    "Bash",          // Claude Code
    "exec_command",  // Codex
    "shell_command", // Codex (other versions)
    "shell",         // Codex (older)
    "bash",          // opencode
    "exec",          // OpenClaw
    "run_shell_command",
];

/// Maps an abstract tool and its script args to a declared tool name and concrete arguments.
pub fn resolve_tool(
    tool: &str,
    args: &Value,
    declared: &[ToolDecl],
) -> Result<(String, Value), String> {
    let names = || {
        declared
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if tool == "shell" {
        let Some(decl) = SHELL_TOOLS
            .iter()
            .find_map(|n| declared.iter().find(|t| t.name == *n))
        else {
            return Err(format!(
                "no shell tool among the declared tools [{}]",
                names()
            ));
        };
        return Ok((decl.name.clone(), shell_args(args, &decl.schema)));
    }
    if let Some(suffix) = tool.strip_prefix("mcp:") {
        return match find_mcp(suffix, declared.iter().map(|t| t.name.as_str())) {
            Some(name) => Ok((name.to_string(), args.clone())),
            None => Err(format!(
                "no declared tool containing \"agentscope\" and ending with {suffix:?} among [{}]",
                names()
            )),
        };
    }
    match declared.iter().find(|t| t.name == tool) {
        Some(t) => Ok((t.name.clone(), args.clone())),
        None => Err(format!(
            "tool {tool:?} not declared; declared: [{}]",
            names()
        )),
    }
}

/// Shapes `{"command": "..."}` (plus any extra script args) after the shell tool's schema:
/// `cmd` (Codex `exec_command`), `command` as a string or an argv array, `description` when the
/// schema has one.
fn shell_args(args: &Value, schema: &Value) -> Value {
    let command = args
        .get("command")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let props = schema.get("properties").and_then(Value::as_object);
    let has = |p: &str| props.is_some_and(|m| m.contains_key(p));
    let mut out = Map::new();
    for (k, v) in args.as_object().into_iter().flatten() {
        if k != "command" {
            out.insert(k.clone(), v.clone());
        }
    }
    if has("cmd") && !has("command") {
        out.insert("cmd".into(), Value::String(command));
    } else if props
        .and_then(|m| m.get("command"))
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
        == Some("array")
    {
        out.insert("command".into(), json!(["bash", "-lc", command]));
    } else {
        out.insert("command".into(), Value::String(command));
    }
    if has("description") && !out.contains_key("description") {
        out.insert("description".into(), json!("Run a scripted shell command"));
    }
    Value::Object(out)
}

/// Concatenated text of a tool result in any of the wire shapes (string, content parts, ...).
pub(crate) fn text_of(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .map(text_of)
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Object(o) => {
            for key in ["text", "content", "output"] {
                if let Some(inner) = o.get(key) {
                    return text_of(inner);
                }
            }
            v.to_string()
        }
        other => other.to_string(),
    }
}

struct AppState {
    script: Script,
    log: Option<Mutex<tokio::fs::File>>,
    counter: AtomicU64,
}

impl AppState {
    fn next_id(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    /// Appends one JSON line to the request log, if there is one.
    async fn log_line(&self, line: &Value) {
        let Some(log) = &self.log else { return };
        let mut text = line.to_string();
        text.push('\n');
        let mut f = log.lock().await;
        if let Err(e) = f.write_all(text.as_bytes()).await {
            tracing::error!("writing request log: {e}");
        }
        let _ = f.flush().await;
    }
}

/// Serves the script on `listener` until the task is dropped or the listener fails. With `log`,
/// appends one JSON line per request to that file.
pub async fn serve(
    listener: tokio::net::TcpListener,
    script: Script,
    log: Option<PathBuf>,
) -> anyhow::Result<()> {
    let app = router(script, log).await?;
    axum::serve(agentscope_telemetry::health::no_delay(listener), app).await?;
    Ok(())
}

/// Binds `addr` (e.g. `127.0.0.1:0`), spawns the server and returns its address.
pub async fn spawn(
    addr: &str,
    script: Script,
    log: Option<PathBuf>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = router(script, log).await?;
    let handle = tokio::spawn(async move {
        axum::serve(agentscope_telemetry::health::no_delay(listener), app).await?;
        Ok(())
    });
    Ok((local, handle))
}

/// The axum router, for embedding.
pub async fn router(script: Script, log: Option<PathBuf>) -> anyhow::Result<Router> {
    let log = match log {
        Some(path) => Some(Mutex::new(
            tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .await
                .map_err(|e| anyhow::anyhow!("opening log {}: {e}", path.display()))?,
        )),
        None => None,
    };
    let state = Arc::new(AppState {
        script,
        log,
        counter: AtomicU64::new(1),
    });
    Ok(Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(256 * 1024 * 1024))
        .with_state(state))
}

#[derive(Clone, Copy)]
enum Api {
    Anthropic,
    Responses,
    Chat,
}

/// The API key that every endpoint refuses with a 401, as a real provider refuses a bad key.
pub const REJECTED_KEY: &str = "sk-rejected";

fn api_key(headers: &axum::http::HeaderMap) -> Option<String> {
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    h("x-api-key")
        .or_else(|| h("authorization").map(|a| a.trim_start_matches("Bearer ").to_string()))
}

/// The provider's own 401 for a refused key.
async fn refuse_key(st: &AppState, api: Api, path: String) -> Response {
    st.log_line(&json!({"path": path, "method": "POST", "outcome": "unauthorized"}))
        .await;
    let body = match api {
        Api::Anthropic => {
            json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}})
        }
        Api::Responses | Api::Chat => {
            json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}})
        }
    };
    (axum::http::StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
}

async fn messages(
    State(st): State<Arc<AppState>>,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if api_key(&headers).as_deref() == Some(REJECTED_KEY) {
        return refuse_key(&st, Api::Anthropic, uri.to_string()).await;
    }
    handle(st, Api::Anthropic, uri.to_string(), body).await
}

async fn responses(
    State(st): State<Arc<AppState>>,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if api_key(&headers).as_deref() == Some(REJECTED_KEY) {
        return refuse_key(&st, Api::Responses, uri.to_string()).await;
    }
    handle(st, Api::Responses, uri.to_string(), body).await
}

async fn chat(
    State(st): State<Arc<AppState>>,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if api_key(&headers).as_deref() == Some(REJECTED_KEY) {
        return refuse_key(&st, Api::Chat, uri.to_string()).await;
    }
    handle(st, Api::Chat, uri.to_string(), body).await
}

async fn count_tokens(State(st): State<Arc<AppState>>, uri: Uri) -> Response {
    st.log_line(&json!({"path": uri.to_string(), "method": "POST", "outcome": "count_tokens"}))
        .await;
    axum::Json(json!({"input_tokens": INPUT_TOKENS})).into_response()
}

async fn models(State(st): State<Arc<AppState>>, uri: Uri) -> Response {
    st.log_line(&json!({"path": uri.to_string(), "method": "GET", "outcome": "models"}))
        .await;
    let ids = ["modelsim", "claude-sonnet-4-5", "gpt-5-codex"];
    axum::Json(json!({
        "object": "list",
        "data": ids.iter().map(|id| json!({
            "id": id,
            "object": "model",
            "type": "model",
            "display_name": id,
            "created": 1_700_000_000,
            "created_at": "2025-01-01T00:00:00Z",
            "owned_by": "agentscope-modelsim",
        })).collect::<Vec<_>>(),
        "has_more": false,
        "first_id": ids[0],
        "last_id": ids[ids.len() - 1],
    }))
    .into_response()
}

async fn not_found(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    tracing::info!(%method, %uri, "no such endpoint");
    st.log_line(
        &json!({"path": uri.to_string(), "method": method.as_str(), "outcome": "not_found"}),
    )
    .await;
    error_response(
        StatusCode::NOT_FOUND,
        "not_found_error",
        &format!("modelsim has no endpoint {method} {}", uri.path()),
    )
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({
            "type": "error",
            "error": {"type": kind, "message": message, "code": kind},
        })),
    )
        .into_response()
}

async fn handle(st: Arc<AppState>, api: Api, uri: String, body: Bytes) -> Response {
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "body must be a JSON object",
            );
        }
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("body is not JSON: {e}"),
            );
        }
    };
    let mut view = match api {
        Api::Anthropic => anthropic::view(&req),
        Api::Responses => responses::view(&req),
        Api::Chat => chat::view(&req),
    };
    view.mentioned = mentioned_names(&req);
    let decision = decide(&st.script, &view);
    match decision.outcome {
        Outcome::ExpectationFailed | Outcome::ToolMissing => {
            if let Reply::Text(t) = &decision.reply {
                tracing::warn!(path = %uri, "{t}");
            }
        }
        _ => tracing::info!(
            path = %uri,
            model = %view.model,
            turn = ?decision.turn,
            outcome = ?decision.outcome,
            "request"
        ),
    }
    // The line holds a copy of the whole request: built only when there is a log to write it
    // to (a long conversation makes it the costliest step of a request).
    if st.log.is_some() {
        st.log_line(&json!({
            "path": uri,
            "method": "POST",
            "model": view.model,
            "stream": view.stream,
            "turn": decision.turn,
            "outcome": decision.outcome,
            "reply": match &decision.reply {
                Reply::Text(t) => json!({"text": t}),
                Reply::Tool {
                    say,
                    name,
                    args,
                    more,
                } => json!({"say": say, "tool": name, "args": args, "more": more}),
            },
            "tools": view.tools.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            "tool_results": view.tool_results,
            "body": req,
        }))
        .await;
    }
    if let Some(path) = decision
        .turn
        .and_then(|i| st.script.turns.get(i))
        .and_then(|t| t.hold_until.as_deref())
    {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
        while !std::path::Path::new(path).exists() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let id = st.next_id();
    let model = if view.model.is_empty() {
        "modelsim".to_string()
    } else {
        view.model.clone()
    };
    match (api, view.stream) {
        (Api::Anthropic, true) => sse(anthropic::stream(&model, id, &decision.reply)),
        (Api::Anthropic, false) => {
            axum::Json(anthropic::message(&model, id, &decision.reply)).into_response()
        }
        (Api::Responses, true) => sse(responses::stream(&model, id, &decision.reply, &view.tools)),
        (Api::Responses, false) => axum::Json(responses::response(
            &model,
            id,
            &decision.reply,
            &view.tools,
        ))
        .into_response(),
        (Api::Chat, true) => sse(chat::stream(
            &model,
            id,
            &decision.reply,
            chat::include_usage(&req),
        )),
        (Api::Chat, false) => {
            axum::Json(chat::completion(&model, id, &decision.reply)).into_response()
        }
    }
}

/// An SSE body sent as one chunk per event.
fn sse(events: Vec<String>) -> Response {
    let stream = futures::stream::iter(
        events
            .into_iter()
            .map(|e| Ok::<Bytes, std::convert::Infallible>(Bytes::from(e))),
    );
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// One SSE event: `event: NAME` (when given) and one `data:` line.
pub(crate) fn sse_event(name: Option<&str>, data: &Value) -> String {
    match name {
        Some(n) => format!("event: {n}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// Splits `s` into a few pieces (at char boundaries) so that deltas really stream.
pub(crate) fn pieces(s: &str) -> Vec<&str> {
    const PIECE: usize = 16;
    let mut out = Vec::new();
    let mut start = 0;
    while start < s.len() {
        let mut end = (start + PIECE).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        out.push(&s[start..end]);
        start = end;
    }
    out
}

/// Seconds since the epoch, for `created` fields.
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
