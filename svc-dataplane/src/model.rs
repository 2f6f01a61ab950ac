//! Model clients of the Harness: one model turn ([`complete`]) against the Anthropic Messages,
//! OpenAI Chat Completions or OpenAI Responses API, streaming (SSE) or not.
//!
//! # `base_url` convention
//!
//! [`ModelConfig::base_url`] is the server root WITHOUT `/v1`, the same for all three APIs
//! (e.g. `http://127.0.0.1:8080`, `https://api.anthropic.com`); the client appends
//! `/v1/messages` (Anthropic), `/v1/chat/completions` (OpenAI Chat) or `/v1/responses`
//! (OpenAI Responses). A trailing `/` is ignored, and so is a trailing `/v1`, so the OpenAI
//! SDK style `https://api.openai.com/v1` works too.
//!
//! # Mapping of the durable conversation
//!
//! - Anthropic: `system` top-level; consecutive messages of the same role are merged into one
//!   message (so consecutive [`Message::ToolResult`]s become ONE user message holding several
//!   `tool_result` blocks); empty text blocks are left out.
//! - OpenAI Chat: a `system` message first; assistant `tool_calls` with JSON-string arguments;
//!   one `tool` message per result (Chat has no error flag: `is_error` is not sent).
//! - OpenAI Responses: `instructions` = system; `function_call` / `function_call_output`
//!   items (no error flag either); `store: false`; tools declared with `strict: false`.
//!
//! Tool-call input that arrives as a JSON string is parsed; empty means `{}`, invalid JSON is
//! kept as `{"_raw": "..."}` (and sent back to OpenAI APIs as the raw string).
//!
//! [`Turn::stop_reason`] is the provider's own value: Anthropic `stop_reason` (`end_turn`,
//! `tool_use`, `max_tokens`, ...), Chat `finish_reason` (`stop`, `tool_calls`, `length`, ...),
//! Responses `status` (`completed`), or the `incomplete_details.reason` of an incomplete
//! response (`max_output_tokens`, ...). Anthropic input tokens include cache reads/writes.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    Anthropic,
    OpenaiChat,
    OpenaiResponses,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub api: Api,
    /// Server root without `/v1` (see the module doc).
    pub base_url: String,
    pub api_key: String,
    pub model: String,
    pub max_tokens: u32,
    pub stream: bool,
    pub max_retries: u32,
    pub retry_base_ms: u64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON schema of the input object.
    pub schema: Value,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCallReq {
    pub id: String,
    pub name: String,
    pub input: Value,
}

/// The conversation as stored durably (serde JSON, tagged by "role").
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    User {
        text: String,
    },
    Assistant {
        text: String,
        tool_calls: Vec<ToolCallReq>,
    },
    ToolResult {
        call_id: String,
        output: String,
        is_error: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Turn {
    pub text: String,
    pub tool_calls: Vec<ToolCallReq>,
    pub stop_reason: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model endpoint could not be reached (connection refused/reset, DNS, timeout) even after retries.
    #[error("model connection failed: {0}")]
    Connection(String),
    /// The endpoint answered with an error that retrying will not fix (400, 401, 403, 404, malformed body).
    #[error("model request failed: {0}")]
    Rejected(String),
}

/// Longest backoff between two attempts.
const MAX_BACKOFF_MS: u64 = 10_000;
/// Characters of an error body quoted in errors.
const EXCERPT_CHARS: usize = 500;

/// A hosted model API reached without a key cannot answer: say that no model is configured
/// instead of retrying it (a self-hosted server without authentication needs no key).
pub fn unconfigured(cfg: &ModelConfig) -> Option<String> {
    let hosted = ["api.anthropic.com", "api.openai.com"]
        .iter()
        .any(|h| cfg.base_url.contains(h));
    (cfg.api_key.trim().is_empty() && hosted).then(|| {
        format!(
            "no model is configured: {} needs an API key (set AGENTSCOPE_MODEL_API_KEY, or AGENTSCOPE_MODEL_BASE_URL to your own model server)",
            cfg.base_url
        )
    })
}

/// One model turn: sends system prompt + history + tools, returns the assistant's text and tool calls.
/// Transient failures (connect errors, timeouts, HTTP 408/429/5xx, a stream cut short) are retried with
/// exponential backoff (retry_base_ms * 2^n, capped at 10 s) up to max_retries; then Connection (or
/// Rejected for HTTP errors). Non-transient HTTP errors are Rejected at once, with status and body excerpt.
///
/// A loop of turns keeps a [`Prompt`] and a [`Conversation`] instead and calls [`complete_turn`]:
/// nothing of the history is converted again.
pub async fn complete(
    http: &reqwest::Client,
    cfg: &ModelConfig,
    system: &str,
    history: &[Message],
    tools: &[ToolSpec],
) -> Result<Turn, ModelError> {
    let prompt = Prompt::new(cfg, system, tools);
    let mut conversation = Conversation::new(cfg.api);
    for m in history {
        conversation.push(m);
    }
    complete_turn(http, cfg, &prompt, &conversation).await
}

/// One model turn of `conversation` (see [`complete`] for retries and errors).
pub async fn complete_turn(
    http: &reqwest::Client,
    cfg: &ModelConfig,
    prompt: &Prompt,
    conversation: &Conversation,
) -> Result<Turn, ModelError> {
    if let Some(why) = unconfigured(cfg) {
        return Err(ModelError::Rejected(why));
    }
    let body = bytes::Bytes::from(prompt.body(conversation));
    let mut attempt: u32 = 0;
    loop {
        match attempt_once(http, cfg, &prompt.url, &body).await {
            Ok(turn) => return Ok(turn),
            Err(Fail::Fatal(msg)) => return Err(ModelError::Rejected(msg)),
            Err(Fail::Transient { conn, msg }) => {
                if attempt >= cfg.max_retries {
                    let msg = if attempt > 0 {
                        format!("{msg} (after {} attempts)", attempt + 1)
                    } else {
                        msg
                    };
                    return Err(if conn {
                        ModelError::Connection(msg)
                    } else {
                        ModelError::Rejected(msg)
                    });
                }
                let delay = backoff_ms(cfg.retry_base_ms, attempt);
                tracing::warn!(
                    api = ?cfg.api,
                    attempt = attempt + 1,
                    delay_ms = delay,
                    "model request failed, retrying: {msg}"
                );
                tokio::time::sleep(Duration::from_millis(delay)).await;
                attempt += 1;
            }
        }
    }
}

/// What every request of a session's loop carries besides the conversation (model, limits,
/// system prompt, tools), serialized once.
#[derive(Debug, Clone)]
pub struct Prompt {
    api: Api,
    url: String,
    /// The request object without its closing brace and without the conversation.
    head: String,
    /// Chat Completions: the system message, first in `messages`.
    lead: String,
}

impl Prompt {
    pub fn new(cfg: &ModelConfig, system: &str, tools: &[ToolSpec]) -> Prompt {
        let head = match cfg.api {
            Api::Anthropic => anthropic_head(cfg, system, tools),
            Api::OpenaiChat => chat_head(cfg, tools),
            Api::OpenaiResponses => responses_head(cfg, system, tools),
        };
        let mut head = head.to_string();
        head.pop(); // the closing brace: the conversation follows
        let lead = if cfg.api == Api::OpenaiChat && !system.is_empty() {
            json!({"role": "system", "content": system}).to_string()
        } else {
            String::new()
        };
        Prompt {
            api: cfg.api,
            url: endpoint(cfg),
            head,
            lead,
        }
    }

    /// The request body: the head, then the conversation's bytes as they are.
    fn body(&self, conversation: &Conversation) -> Vec<u8> {
        debug_assert_eq!(self.api, conversation.api);
        let key = match self.api {
            Api::OpenaiResponses => "input",
            Api::Anthropic | Api::OpenaiChat => "messages",
        };
        let mut out = String::with_capacity(
            self.head.len() + self.lead.len() + conversation.len() + key.len() + 8,
        );
        out.push_str(&self.head);
        if out.len() > 1 {
            out.push(',');
        }
        out.push('"');
        out.push_str(key);
        out.push_str("\":[");
        out.push_str(&self.lead);
        if !self.lead.is_empty() && conversation.len() > 0 {
            out.push(',');
        }
        conversation.write(&mut out);
        out.push_str("]}");
        out.into_bytes()
    }
}

/// The conversation in one API's wire format, kept incrementally: a message is converted and
/// serialized once, when it is pushed, and a request copies the bytes (no rebuild of the history
/// per turn). Anthropic merges consecutive messages of the same role, so its last message stays
/// open for more blocks until a message of the other role arrives.
#[derive(Debug, Clone)]
pub struct Conversation {
    api: Api,
    /// Serialized wire messages (Responses: items), comma-separated, without brackets.
    closed: String,
    /// Anthropic: the last message's role and its serialized blocks, comma-separated.
    open: Option<(&'static str, String)>,
}

impl Conversation {
    pub fn new(api: Api) -> Conversation {
        Conversation {
            api,
            closed: String::new(),
            open: None,
        }
    }

    pub fn push(&mut self, m: &Message) {
        match self.api {
            Api::Anthropic => {
                let (role, blocks) = anthropic_blocks(m);
                if blocks.is_empty() {
                    return;
                }
                let mut text = String::new();
                for b in &blocks {
                    if !text.is_empty() {
                        text.push(',');
                    }
                    text.push_str(&b.to_string());
                }
                match &mut self.open {
                    Some((r, open)) if *r == role => {
                        open.push(',');
                        open.push_str(&text);
                    }
                    _ => {
                        self.close();
                        self.open = Some((role, text));
                    }
                }
            }
            Api::OpenaiChat => {
                let v = chat_message(m);
                self.append(&v.to_string());
            }
            Api::OpenaiResponses => {
                for item in responses_items(m) {
                    self.append(&item.to_string());
                }
            }
        }
    }

    fn append(&mut self, item: &str) {
        if !self.closed.is_empty() {
            self.closed.push(',');
        }
        self.closed.push_str(item);
    }

    /// Anthropic: the open message becomes final.
    fn close(&mut self) {
        if let Some((role, blocks)) = self.open.take() {
            let mut item = String::with_capacity(blocks.len() + 32);
            item.push_str("{\"role\":\"");
            item.push_str(role);
            item.push_str("\",\"content\":[");
            item.push_str(&blocks);
            item.push_str("]}");
            self.append(&item);
        }
    }

    /// Bytes of the serialized conversation (an upper bound of what [`Self::write`] adds).
    fn len(&self) -> usize {
        self.closed.len() + self.open.as_ref().map_or(0, |(_, b)| b.len() + 32)
    }

    fn write(&self, out: &mut String) {
        out.push_str(&self.closed);
        if let Some((role, blocks)) = &self.open {
            if !self.closed.is_empty() {
                out.push(',');
            }
            out.push_str("{\"role\":\"");
            out.push_str(role);
            out.push_str("\",\"content\":[");
            out.push_str(blocks);
            out.push_str("]}");
        }
    }
}

/// Why one attempt failed.
#[derive(Debug)]
enum Fail {
    /// Worth retrying. `conn`: the endpoint was not reached or its answer was cut short (ends as
    /// [`ModelError::Connection`]); otherwise an HTTP/API error (ends as `Rejected`).
    Transient { conn: bool, msg: String },
    /// Retrying will not help.
    Fatal(String),
}

fn backoff_ms(base: u64, n: u32) -> u64 {
    let factor = 1u64.checked_shl(n).unwrap_or(u64::MAX);
    base.saturating_mul(factor).min(MAX_BACKOFF_MS)
}

fn endpoint(cfg: &ModelConfig) -> String {
    let base = cfg.base_url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    let path = match cfg.api {
        Api::Anthropic => "/v1/messages",
        Api::OpenaiChat => "/v1/chat/completions",
        Api::OpenaiResponses => "/v1/responses",
    };
    format!("{base}{path}")
}

/// An error and its causes, one line (reqwest hides the useful part in `source()`).
fn err_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

fn excerpt(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(EXCERPT_CHARS) {
        Some((end, _)) => format!("{}...", &s[..end]),
        None => s.to_string(),
    }
}

async fn attempt_once(
    http: &reqwest::Client,
    cfg: &ModelConfig,
    url: &str,
    body: &bytes::Bytes,
) -> Result<Turn, Fail> {
    let mut req = http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.clone());
    req = match cfg.api {
        Api::Anthropic => req
            .header("x-api-key", &cfg.api_key)
            .header("anthropic-version", "2023-06-01"),
        Api::OpenaiChat | Api::OpenaiResponses => req.bearer_auth(&cfg.api_key),
    };
    if cfg.stream {
        req = req.header(reqwest::header::ACCEPT, "text/event-stream");
    }
    let resp = req.send().await.map_err(|e| {
        let msg = format!("POST {url}: {}", err_chain(&e));
        if e.is_builder() {
            Fail::Fatal(msg)
        } else {
            Fail::Transient { conn: true, msg }
        }
    })?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let msg = format!("HTTP {status} from POST {url}: {}", excerpt(&text));
        let code = status.as_u16();
        return Err(if code == 408 || code == 429 || status.is_server_error() {
            Fail::Transient { conn: false, msg }
        } else {
            Fail::Fatal(msg)
        });
    }
    let is_json = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.trim_start().starts_with("application/json"));
    if cfg.stream && !is_json {
        return match cfg.api {
            Api::Anthropic => read_stream(resp, AnthropicAcc::default()).await,
            Api::OpenaiChat => read_stream(resp, ChatAcc::default()).await,
            Api::OpenaiResponses => read_stream(resp, ResponsesAcc::default()).await,
        };
    }
    let bytes = resp.bytes().await.map_err(|e| Fail::Transient {
        conn: true,
        msg: format!("reading the answer of POST {url}: {}", err_chain(&e)),
    })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        Fail::Fatal(format!(
            "malformed answer from POST {url} ({e}): {}",
            excerpt(&String::from_utf8_lossy(&bytes))
        ))
    })?;
    match cfg.api {
        Api::Anthropic => anthropic_turn(&v),
        Api::OpenaiChat => chat_turn(&v),
        Api::OpenaiResponses => responses_turn(&v),
    }
}

// ---------------------------------------------------------------------------------------------
// Shared helpers

/// Tool-call arguments that arrived as a JSON string.
fn parse_args(s: &str) -> Value {
    if s.trim().is_empty() {
        return json!({});
    }
    serde_json::from_str(s).unwrap_or_else(|_| json!({ "_raw": s }))
}

/// Tool-call input in whatever shape it came (object, JSON string, nothing).
fn input_value(v: Option<&Value>) -> Value {
    match v {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => parse_args(s),
        Some(other) => other.clone(),
    }
}

/// Tool-call input as the JSON string the OpenAI APIs carry (a `{"_raw": s}` input goes back as `s`).
fn args_string(input: &Value) -> String {
    if let Some(obj) = input.as_object()
        && obj.len() == 1
        && let Some(Value::String(raw)) = obj.get("_raw")
    {
        return raw.clone();
    }
    input.to_string()
}

fn str_of(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// Text of a content value: a string, or parts with `text`.
fn text_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

fn parse_event_json(data: &str) -> Result<Value, Fail> {
    serde_json::from_str(data)
        .map_err(|e| Fail::Fatal(format!("malformed stream event ({e}): {}", excerpt(data))))
}

/// An error the API reported inside a 200 answer or a stream: transient when the provider says
/// it is overloaded, rate limited or failed internally.
fn api_error(err: &Value) -> Fail {
    let kind = format!("{} {}", str_of(err, "type"), str_of(err, "code"));
    let message = match err.get("message").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => err.to_string(),
    };
    let msg = format!("model API error {}: {message}", kind.trim());
    let transient = [
        "overloaded",
        "rate_limit",
        "server_error",
        "api_error",
        "timeout",
    ]
    .iter()
    .any(|k| kind.contains(k));
    if transient {
        Fail::Transient { conn: false, msg }
    } else {
        Fail::Fatal(msg)
    }
}

fn cut_short(what: &str) -> Fail {
    Fail::Transient {
        conn: true,
        msg: format!("answer stream ended before {what}"),
    }
}

// ---------------------------------------------------------------------------------------------
// SSE

#[derive(Debug, Clone, PartialEq, Default)]
struct SseEvent {
    /// `event:` field, empty when absent.
    event: String,
    /// `data:` lines joined by `\n`.
    data: String,
}

/// Incremental SSE parser: bytes in (split anywhere), complete events out.
#[derive(Debug, Default)]
struct SseParser {
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
}

impl SseParser {
    fn push(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..pos]);
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, out);
            rest = &rest[pos + 1..];
        }
        self.line.extend_from_slice(rest);
    }

    /// End of the body: a last line without newline and a last event without blank line.
    fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, out);
        }
        self.line_done(b"", out);
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if self.has_data {
                out.push(SseEvent {
                    event: std::mem::take(&mut self.event),
                    data: std::mem::take(&mut self.data),
                });
            }
            self.event.clear();
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line.starts_with(b":") {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.find(':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (&line[..], ""),
        };
        match field {
            "event" => self.event = value.to_string(),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            _ => {}
        }
    }
}

/// Builds a [`Turn`] from the events of one API's stream.
trait StreamAcc {
    /// Takes one event; `Some(turn)` once the answer is complete.
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail>;
    /// The body ended before the final event.
    fn eof(&mut self) -> Result<Turn, Fail>;
}

async fn read_stream(resp: reqwest::Response, mut acc: impl StreamAcc) -> Result<Turn, Fail> {
    let mut parser = SseParser::default();
    let mut body = resp.bytes_stream();
    let mut events = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| Fail::Transient {
            conn: true,
            msg: format!("answer stream broke: {}", err_chain(&e)),
        })?;
        parser.push(&chunk, &mut events);
        for ev in events.drain(..) {
            if let Some(turn) = acc.event(&ev)? {
                return Ok(turn);
            }
        }
    }
    parser.finish(&mut events);
    for ev in events.drain(..) {
        if let Some(turn) = acc.event(&ev)? {
            return Ok(turn);
        }
    }
    acc.eof()
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages

/// One message's role and content blocks (none: the message is left out).
fn anthropic_blocks(m: &Message) -> (&'static str, Vec<Value>) {
    match m {
        Message::User { text } => {
            let blocks = if text.is_empty() {
                vec![]
            } else {
                vec![json!({"type": "text", "text": text})]
            };
            ("user", blocks)
        }
        Message::Assistant { text, tool_calls } => {
            let mut blocks = Vec::new();
            if !text.is_empty() {
                blocks.push(json!({"type": "text", "text": text}));
            }
            for c in tool_calls {
                blocks.push(json!({
                    "type": "tool_use",
                    "id": c.id,
                    "name": c.name,
                    "input": if c.input.is_object() { c.input.clone() } else { json!({"_raw": c.input}) },
                }));
            }
            ("assistant", blocks)
        }
        Message::ToolResult {
            call_id,
            output,
            is_error,
        } => {
            let mut block = json!({
                "type": "tool_result",
                "tool_use_id": call_id,
                "content": output,
            });
            if *is_error {
                block["is_error"] = json!(true);
            }
            ("user", vec![block])
        }
    }
}

/// The request without its messages.
fn anthropic_head(cfg: &ModelConfig, system: &str, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "stream": cfg.stream,
    });
    if !system.is_empty() {
        body["system"] = json!(system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(
                |t| json!({"name": t.name, "description": t.description, "input_schema": t.schema}),
            )
            .collect();
    }
    body
}

/// Sets the token counts from an Anthropic `usage` object (input includes cache reads/writes).
fn anthropic_usage(u: &Value, turn: &mut Turn) {
    if let Some(input) = u64_of(u, "input_tokens") {
        turn.input_tokens = input
            + u64_of(u, "cache_creation_input_tokens").unwrap_or(0)
            + u64_of(u, "cache_read_input_tokens").unwrap_or(0);
    }
    if let Some(output) = u64_of(u, "output_tokens") {
        turn.output_tokens = output;
    }
}

fn anthropic_turn(v: &Value) -> Result<Turn, Fail> {
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Err(api_error(v.get("error").unwrap_or(v)));
    }
    let Some(content) = v.get("content").and_then(Value::as_array) else {
        return Err(Fail::Fatal(format!(
            "answer has no content: {}",
            excerpt(&v.to_string())
        )));
    };
    let mut turn = Turn {
        stop_reason: str_of(v, "stop_reason"),
        ..Turn::default()
    };
    for block in content {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => turn.text.push_str(&str_of(block, "text")),
            Some("tool_use") => turn.tool_calls.push(ToolCallReq {
                id: str_of(block, "id"),
                name: str_of(block, "name"),
                input: input_value(block.get("input")),
            }),
            _ => {}
        }
    }
    if let Some(u) = v.get("usage") {
        anthropic_usage(u, &mut turn);
    }
    Ok(turn)
}

#[derive(Debug)]
enum AnthropicBlock {
    Text(String),
    Tool {
        id: String,
        name: String,
        json: String,
        start_input: Value,
    },
    Other,
}

#[derive(Debug, Default)]
struct AnthropicAcc {
    blocks: BTreeMap<u64, AnthropicBlock>,
    turn: Turn,
}

impl AnthropicAcc {
    fn build(&mut self) -> Turn {
        let mut turn = std::mem::take(&mut self.turn);
        for block in std::mem::take(&mut self.blocks).into_values() {
            match block {
                AnthropicBlock::Text(t) => turn.text.push_str(&t),
                AnthropicBlock::Tool {
                    id,
                    name,
                    json,
                    start_input,
                } => {
                    let input = if json.trim().is_empty() {
                        input_value(Some(&start_input))
                    } else {
                        parse_args(&json)
                    };
                    turn.tool_calls.push(ToolCallReq { id, name, input });
                }
                AnthropicBlock::Other => {}
            }
        }
        turn
    }
}

impl StreamAcc for AnthropicAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        let v = parse_event_json(&ev.data)?;
        let ty = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(ev.event.as_str());
        let index = u64_of(&v, "index").unwrap_or(0);
        match ty {
            "message_start" => {
                if let Some(u) = v.get("message").and_then(|m| m.get("usage")) {
                    anthropic_usage(u, &mut self.turn);
                }
            }
            "content_block_start" => {
                let cb = v.get("content_block").unwrap_or(&Value::Null);
                let block = match cb.get("type").and_then(Value::as_str) {
                    Some("text") => AnthropicBlock::Text(str_of(cb, "text")),
                    Some("tool_use") => AnthropicBlock::Tool {
                        id: str_of(cb, "id"),
                        name: str_of(cb, "name"),
                        json: String::new(),
                        start_input: cb.get("input").cloned().unwrap_or(Value::Null),
                    },
                    _ => AnthropicBlock::Other,
                };
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                match (
                    delta.get("type").and_then(Value::as_str),
                    self.blocks.get_mut(&index),
                ) {
                    (Some("text_delta"), Some(AnthropicBlock::Text(t))) => {
                        t.push_str(delta.get("text").and_then(Value::as_str).unwrap_or(""));
                    }
                    (Some("text_delta"), None) => {
                        self.blocks
                            .insert(index, AnthropicBlock::Text(str_of(delta, "text")));
                    }
                    (Some("input_json_delta"), Some(AnthropicBlock::Tool { json, .. })) => {
                        json.push_str(
                            delta
                                .get("partial_json")
                                .and_then(Value::as_str)
                                .unwrap_or(""),
                        );
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = v
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.turn.stop_reason = reason.to_string();
                }
                if let Some(u) = v.get("usage") {
                    anthropic_usage(u, &mut self.turn);
                }
            }
            "message_stop" => return Ok(Some(self.build())),
            "error" => return Err(api_error(v.get("error").unwrap_or(&v))),
            _ => {}
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        Err(cut_short("message_stop"))
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI Chat Completions

fn chat_message(m: &Message) -> Value {
    match m {
        Message::User { text } => json!({"role": "user", "content": text}),
        Message::Assistant { text, tool_calls } => {
            let mut msg = json!({"role": "assistant"});
            msg["content"] = if text.is_empty() && !tool_calls.is_empty() {
                Value::Null
            } else {
                json!(text)
            };
            if !tool_calls.is_empty() {
                msg["tool_calls"] = tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": args_string(&c.input)},
                        })
                    })
                    .collect();
            }
            msg
        }
        Message::ToolResult {
            call_id, output, ..
        } => json!({"role": "tool", "tool_call_id": call_id, "content": output}),
    }
}

/// The request without its messages (the system message is the first of them).
fn chat_head(cfg: &ModelConfig, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_completion_tokens": cfg.max_tokens,
        "stream": cfg.stream,
    });
    if cfg.stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.schema,
                }})
            })
            .collect();
    }
    body
}

fn chat_usage(u: &Value, turn: &mut Turn) {
    if let Some(n) = u64_of(u, "prompt_tokens") {
        turn.input_tokens = n;
    }
    if let Some(n) = u64_of(u, "completion_tokens") {
        turn.output_tokens = n;
    }
}

fn chat_turn(v: &Value) -> Result<Turn, Fail> {
    let Some(choice) = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(api_error(err));
        }
        return Err(Fail::Fatal(format!(
            "answer has no choices: {}",
            excerpt(&v.to_string())
        )));
    };
    let msg = choice.get("message").unwrap_or(&Value::Null);
    let mut turn = Turn {
        text: text_of(msg.get("content")),
        stop_reason: str_of(choice, "finish_reason"),
        ..Turn::default()
    };
    for (i, call) in msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let f = call.get("function").unwrap_or(&Value::Null);
        let id = match call.get("id").and_then(Value::as_str) {
            Some(id) if !id.is_empty() => id.to_string(),
            _ => format!("call_{i}"),
        };
        turn.tool_calls.push(ToolCallReq {
            id,
            name: str_of(f, "name"),
            input: input_value(f.get("arguments")),
        });
    }
    if let Some(u) = v.get("usage") {
        chat_usage(u, &mut turn);
    }
    Ok(turn)
}

#[derive(Debug, Default)]
struct ChatCall {
    id: String,
    name: String,
    args: String,
}

#[derive(Debug, Default)]
struct ChatAcc {
    turn: Turn,
    calls: BTreeMap<u64, ChatCall>,
    finished: bool,
}

impl ChatAcc {
    fn build(&mut self) -> Turn {
        let mut turn = std::mem::take(&mut self.turn);
        for (i, c) in std::mem::take(&mut self.calls) {
            turn.tool_calls.push(ToolCallReq {
                id: if c.id.is_empty() {
                    format!("call_{i}")
                } else {
                    c.id
                },
                name: c.name,
                input: parse_args(&c.args),
            });
        }
        turn
    }
}

impl StreamAcc for ChatAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        if ev.data.trim() == "[DONE]" {
            return Ok(Some(self.build()));
        }
        let v = parse_event_json(&ev.data)?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(api_error(err));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            chat_usage(u, &mut self.turn);
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return Ok(None);
        };
        let delta = choice.get("delta").unwrap_or(&Value::Null);
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            self.turn.text.push_str(text);
        }
        for (pos, tc) in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = u64_of(tc, "index").unwrap_or(pos as u64);
            let call = self.calls.entry(index).or_default();
            if let Some(id) = tc.get("id").and_then(Value::as_str)
                && !id.is_empty()
            {
                call.id = id.to_string();
            }
            let f = tc.get("function").unwrap_or(&Value::Null);
            if let Some(name) = f.get("name").and_then(Value::as_str)
                && name != call.name
            {
                call.name.push_str(name);
            }
            match f.get("arguments") {
                Some(Value::String(a)) => call.args.push_str(a),
                Some(obj @ Value::Object(_)) => call.args = obj.to_string(),
                _ => {}
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.turn.stop_reason = reason.to_string();
            self.finished = true;
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        // Some compatible servers omit `[DONE]`; a finish_reason is enough.
        if self.finished {
            Ok(self.build())
        } else {
            Err(cut_short("[DONE]"))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI Responses

fn responses_items(m: &Message) -> Vec<Value> {
    match m {
        Message::User { text } => vec![json!({"role": "user", "content": text})],
        Message::Assistant { text, tool_calls } => {
            let mut items = Vec::new();
            if !text.is_empty() {
                items.push(json!({"role": "assistant", "content": text}));
            }
            for c in tool_calls {
                items.push(json!({
                    "type": "function_call",
                    "call_id": c.id,
                    "name": c.name,
                    "arguments": args_string(&c.input),
                }));
            }
            items
        }
        Message::ToolResult {
            call_id, output, ..
        } => vec![json!({
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
        })],
    }
}

/// The request without its input items.
fn responses_head(cfg: &ModelConfig, system: &str, tools: &[ToolSpec]) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "max_output_tokens": cfg.max_tokens,
        "stream": cfg.stream,
        "store": false,
    });
    if !system.is_empty() {
        body["instructions"] = json!(system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "name": t.name, "description": t.description,
                    "parameters": t.schema, "strict": false})
            })
            .collect();
    }
    body
}

#[derive(Debug)]
enum ResponsesItem {
    Message(String),
    Call {
        call_id: String,
        name: String,
        args: String,
    },
    Other,
}

fn responses_item(item: &Value) -> ResponsesItem {
    match item.get("type").and_then(Value::as_str) {
        Some("message") => ResponsesItem::Message(
            item.get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("output_text") | Some("text") => p.get("text").and_then(Value::as_str),
                    Some("refusal") => p.get("refusal").and_then(Value::as_str),
                    _ => None,
                })
                .collect(),
        ),
        Some("function_call") => ResponsesItem::Call {
            call_id: match item.get("call_id").and_then(Value::as_str) {
                Some(id) if !id.is_empty() => id.to_string(),
                _ => str_of(item, "id"),
            },
            name: str_of(item, "name"),
            args: match item.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            },
        },
        _ => ResponsesItem::Other,
    }
}

fn responses_build<'a>(items: impl IntoIterator<Item = &'a ResponsesItem>, turn: &mut Turn) {
    for item in items {
        match item {
            ResponsesItem::Message(t) => turn.text.push_str(t),
            ResponsesItem::Call {
                call_id,
                name,
                args,
            } => turn.tool_calls.push(ToolCallReq {
                id: call_id.clone(),
                name: name.clone(),
                input: parse_args(args),
            }),
            ResponsesItem::Other => {}
        }
    }
}

/// Stop reason and usage of a finished response object.
fn responses_finish(resp: &Value, turn: &mut Turn) {
    let status = str_of(resp, "status");
    turn.stop_reason = match resp
        .get("incomplete_details")
        .and_then(|d| d.get("reason"))
        .and_then(Value::as_str)
    {
        Some(reason) if status == "incomplete" => reason.to_string(),
        _ => status,
    };
    if let Some(u) = resp.get("usage").filter(|u| u.is_object()) {
        turn.input_tokens = u64_of(u, "input_tokens").unwrap_or(0);
        turn.output_tokens = u64_of(u, "output_tokens").unwrap_or(0);
    }
}

fn responses_turn(v: &Value) -> Result<Turn, Fail> {
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(api_error(err));
    }
    let Some(output) = v.get("output").and_then(Value::as_array) else {
        return Err(Fail::Fatal(format!(
            "answer has no output: {}",
            excerpt(&v.to_string())
        )));
    };
    let items: Vec<ResponsesItem> = output.iter().map(responses_item).collect();
    let mut turn = Turn::default();
    responses_build(&items, &mut turn);
    responses_finish(v, &mut turn);
    Ok(turn)
}

#[derive(Debug, Default)]
struct ResponsesAcc {
    items: BTreeMap<u64, ResponsesItem>,
}

impl StreamAcc for ResponsesAcc {
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail> {
        let v = parse_event_json(&ev.data)?;
        let ty = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(ev.event.as_str());
        let index = u64_of(&v, "output_index").unwrap_or(0);
        let delta = v.get("delta").and_then(Value::as_str).unwrap_or("");
        match ty {
            "response.output_item.added" => {
                let item = responses_item(v.get("item").unwrap_or(&Value::Null));
                self.items.insert(index, item);
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                match self
                    .items
                    .entry(index)
                    .or_insert_with(|| ResponsesItem::Message(String::new()))
                {
                    ResponsesItem::Message(t) => t.push_str(delta),
                    other => *other = ResponsesItem::Message(delta.to_string()),
                }
            }
            "response.function_call_arguments.delta" => {
                if let Some(ResponsesItem::Call { args, .. }) = self.items.get_mut(&index) {
                    args.push_str(delta);
                }
            }
            "response.output_item.done" => {
                let item = responses_item(v.get("item").unwrap_or(&Value::Null));
                // The final item is authoritative, unless it lost the streamed text.
                let keep_streamed = matches!(&item, ResponsesItem::Message(t) if t.is_empty());
                if !keep_streamed || !self.items.contains_key(&index) {
                    self.items.insert(index, item);
                }
            }
            "response.completed" | "response.incomplete" => {
                let resp = v.get("response").unwrap_or(&Value::Null);
                let mut turn = Turn::default();
                if self.items.is_empty() {
                    let items: Vec<ResponsesItem> = resp
                        .get("output")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .map(responses_item)
                        .collect();
                    responses_build(&items, &mut turn);
                } else {
                    responses_build(self.items.values(), &mut turn);
                }
                responses_finish(resp, &mut turn);
                return Ok(Some(turn));
            }
            "response.failed" => {
                let resp = v.get("response").unwrap_or(&Value::Null);
                return Err(api_error(
                    resp.get("error")
                        .filter(|e| !e.is_null())
                        .unwrap_or(&json!({"type": "server_error", "message": "response failed"})),
                ));
            }
            "error" => return Err(api_error(v.get("error").unwrap_or(&v))),
            _ => {}
        }
        Ok(None)
    }

    fn eof(&mut self) -> Result<Turn, Fail> {
        Err(cut_short("response.completed"))
    }
}

#[cfg(test)]
mod tests {
    fn test_http() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    use super::*;
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const APIS: [Api; 3] = [Api::Anthropic, Api::OpenaiChat, Api::OpenaiResponses];

    fn cfg(api: Api, base_url: String, stream: bool) -> ModelConfig {
        ModelConfig {
            api,
            base_url,
            api_key: "sk-test".into(),
            model: "modelsim".into(),
            max_tokens: 1024,
            stream,
            max_retries: 2,
            retry_base_ms: 1,
        }
    }

    #[tokio::test]
    async fn a_hosted_api_without_a_key_is_reported_unconfigured_at_once() {
        let mut c = cfg(Api::Anthropic, "https://api.anthropic.com".into(), false);
        c.api_key = String::new();
        c.max_retries = 100;
        let started = std::time::Instant::now();
        let err = complete(&test_http(), &c, "s", &[], &[]).await.unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        match err {
            ModelError::Rejected(m) => assert!(m.contains("no model is configured"), "{m}"),
            other => panic!("{other:?}"),
        }
        // A self-hosted server needs no key; a hosted API with a key is configured.
        c.base_url = "http://127.0.0.1:9".into();
        assert!(unconfigured(&c).is_none());
        c.base_url = "https://api.openai.com/v1".into();
        c.api_key = "sk-x".into();
        assert!(unconfigured(&c).is_none());
    }

    fn read_file_tool() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "read_file".into(),
            description: "Read a file".into(),
            schema: json!({"type": "object", "properties": {"path": {"type": "string"}},
                "required": ["path"]}),
        }]
    }

    fn log_path(tag: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "svc-dataplane-model-{tag}-{}-{n}.jsonl",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn read_log(p: &Path) -> Vec<Value> {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("log line is JSON"))
            .collect()
    }

    async fn modelsim(script: &str, log: &Path) -> SocketAddr {
        let script = agentscope_modelsim::Script::from_json(script).expect("script");
        let (addr, _task) =
            agentscope_modelsim::spawn("127.0.0.1:0", script, Some(log.to_path_buf()))
                .await
                .expect("spawn modelsim");
        addr
    }

    async fn two_step(api: Api, stream: bool) {
        let log = log_path("two-step");
        let addr = modelsim(
            r#"{"turns":[{"tool":"read_file","args":{"path":"a.txt"},"say":"Reading."}],"final":"All done."}"#,
            &log,
        )
        .await;
        let http = test_http();
        let cfg = cfg(api, format!("http://{addr}"), stream);
        let tools = read_file_tool();
        let mut history = vec![Message::User {
            text: "Read a.txt".into(),
        }];
        let t1 = complete(&http, &cfg, "You are a test.", &history, &tools)
            .await
            .expect("first turn");
        assert_eq!(t1.text, "Reading.", "{api:?} stream={stream}");
        assert_eq!(t1.tool_calls.len(), 1, "{t1:?}");
        assert_eq!(t1.tool_calls[0].name, "read_file");
        assert_eq!(t1.tool_calls[0].input, json!({"path": "a.txt"}));
        assert!(!t1.tool_calls[0].id.is_empty());
        let expected_stop = match api {
            Api::Anthropic => "tool_use",
            Api::OpenaiChat => "tool_calls",
            Api::OpenaiResponses => "completed",
        };
        assert_eq!(t1.stop_reason, expected_stop);
        assert_eq!(
            (t1.input_tokens, t1.output_tokens),
            (
                agentscope_modelsim::INPUT_TOKENS,
                agentscope_modelsim::OUTPUT_TOKENS
            )
        );
        history.push(Message::Assistant {
            text: t1.text.clone(),
            tool_calls: t1.tool_calls.clone(),
        });
        history.push(Message::ToolResult {
            call_id: t1.tool_calls[0].id.clone(),
            output: "hello from a.txt".into(),
            is_error: false,
        });
        let t2 = complete(&http, &cfg, "You are a test.", &history, &tools)
            .await
            .expect("second turn");
        assert_eq!(t2.text, "All done.", "{api:?} stream={stream}");
        assert!(t2.tool_calls.is_empty());
        let lines = read_log(&log);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["outcome"], "tool");
        assert_eq!(lines[0]["stream"], json!(stream));
        assert_eq!(lines[0]["tools"], json!(["read_file"]));
        assert_eq!(lines[1]["outcome"], "final");
        assert_eq!(lines[1]["tool_results"], 1);
        let body = &lines[1]["body"];
        match api {
            Api::Anthropic => {
                assert_eq!(body["system"], "You are a test.");
                let msgs = body["messages"].as_array().unwrap();
                assert_eq!(msgs.len(), 3);
                assert_eq!(msgs[1]["content"][1]["type"], "tool_use");
                assert_eq!(msgs[2]["content"][0]["tool_use_id"], t1.tool_calls[0].id);
            }
            Api::OpenaiChat => {
                let msgs = body["messages"].as_array().unwrap();
                assert_eq!(msgs[0]["role"], "system");
                assert_eq!(
                    msgs[2]["tool_calls"][0]["function"]["arguments"],
                    json!({"path": "a.txt"}).to_string()
                );
                assert_eq!(msgs[3]["role"], "tool");
                if stream {
                    assert_eq!(body["stream_options"]["include_usage"], true);
                }
            }
            Api::OpenaiResponses => {
                assert_eq!(body["instructions"], "You are a test.");
                let input = body["input"].as_array().unwrap();
                assert_eq!(input[2]["type"], "function_call");
                assert_eq!(input[3]["type"], "function_call_output");
                assert_eq!(input[3]["call_id"], t1.tool_calls[0].id);
            }
        }
    }

    #[tokio::test]
    async fn anthropic_two_steps() {
        two_step(Api::Anthropic, false).await;
    }

    #[tokio::test]
    async fn anthropic_two_steps_streaming() {
        two_step(Api::Anthropic, true).await;
    }

    #[tokio::test]
    async fn chat_two_steps() {
        two_step(Api::OpenaiChat, false).await;
    }

    #[tokio::test]
    async fn chat_two_steps_streaming() {
        two_step(Api::OpenaiChat, true).await;
    }

    #[tokio::test]
    async fn responses_two_steps() {
        two_step(Api::OpenaiResponses, false).await;
    }

    #[tokio::test]
    async fn responses_two_steps_streaming() {
        two_step(Api::OpenaiResponses, true).await;
    }

    #[tokio::test]
    async fn consecutive_tool_results() {
        for api in APIS {
            for stream in [false, true] {
                let log = log_path("two-results");
                let addr = modelsim(
                    r#"{"turns":[{"tool":"read_file","args":{"path":"a.txt"}},
                        {"tool":"read_file","args":{"path":"b.txt"},"expect":"BBB"}],
                        "final":"Both read."}"#,
                    &log,
                )
                .await;
                let history = vec![
                    Message::User {
                        text: "Read both".into(),
                    },
                    Message::Assistant {
                        text: String::new(),
                        tool_calls: vec![
                            ToolCallReq {
                                id: "c1".into(),
                                name: "read_file".into(),
                                input: json!({"path": "a.txt"}),
                            },
                            ToolCallReq {
                                id: "c2".into(),
                                name: "read_file".into(),
                                input: json!({"path": "b.txt"}),
                            },
                        ],
                    },
                    Message::ToolResult {
                        call_id: "c1".into(),
                        output: "AAA".into(),
                        is_error: false,
                    },
                    Message::ToolResult {
                        call_id: "c2".into(),
                        output: "BBB".into(),
                        is_error: true,
                    },
                ];
                let turn = complete(
                    &test_http(),
                    &cfg(api, format!("http://{addr}/"), stream),
                    "",
                    &history,
                    &read_file_tool(),
                )
                .await
                .expect("turn");
                assert_eq!(turn.text, "Both read.", "{api:?} {stream}");
                assert!(turn.tool_calls.is_empty());
                let lines = read_log(&log);
                assert_eq!(lines[0]["tool_results"], 2);
                if api == Api::Anthropic {
                    let msgs = lines[0]["body"]["messages"].as_array().unwrap();
                    assert_eq!(msgs.len(), 3, "{msgs:?}");
                    assert!(lines[0]["body"].get("system").is_none());
                    let last = &msgs[2];
                    assert_eq!(last["role"], "user");
                    assert_eq!(
                        last["content"],
                        json!([
                            {"type": "tool_result", "tool_use_id": "c1", "content": "AAA"},
                            {"type": "tool_result", "tool_use_id": "c2", "content": "BBB",
                                "is_error": true},
                        ])
                    );
                    // The assistant message has only its two tool_use blocks.
                    assert_eq!(msgs[1]["content"].as_array().unwrap().len(), 2);
                }
            }
        }
    }

    // The whole-history construction the incremental [`Conversation`] replaced: the reference it
    // must match, request for request.
    mod reference {
        use super::super::*;

        fn anthropic_messages(history: &[Message]) -> Vec<Value> {
            let mut out: Vec<Value> = Vec::new();
            for m in history {
                let (role, blocks) = match m {
                    Message::User { text } => {
                        let blocks = if text.is_empty() {
                            vec![]
                        } else {
                            vec![json!({"type": "text", "text": text})]
                        };
                        ("user", blocks)
                    }
                    Message::Assistant { text, tool_calls } => {
                        let mut blocks = Vec::new();
                        if !text.is_empty() {
                            blocks.push(json!({"type": "text", "text": text}));
                        }
                        for c in tool_calls {
                            blocks.push(json!({
                                "type": "tool_use",
                                "id": c.id,
                                "name": c.name,
                                "input": if c.input.is_object() { c.input.clone() } else { json!({"_raw": c.input}) },
                            }));
                        }
                        ("assistant", blocks)
                    }
                    Message::ToolResult {
                        call_id,
                        output,
                        is_error,
                    } => {
                        let mut block = json!({
                            "type": "tool_result",
                            "tool_use_id": call_id,
                            "content": output,
                        });
                        if *is_error {
                            block["is_error"] = json!(true);
                        }
                        ("user", vec![block])
                    }
                };
                if blocks.is_empty() {
                    continue;
                }
                if let Some(last) = out.last_mut()
                    && last["role"] == role
                    && let Some(content) = last["content"].as_array_mut()
                {
                    content.extend(blocks);
                    continue;
                }
                out.push(json!({"role": role, "content": blocks}));
            }
            out
        }

        pub(super) fn anthropic_body(
            cfg: &ModelConfig,
            system: &str,
            history: &[Message],
            tools: &[ToolSpec],
        ) -> Value {
            let mut body = json!({
                "model": cfg.model,
                "max_tokens": cfg.max_tokens,
                "messages": anthropic_messages(history),
                "stream": cfg.stream,
            });
            if !system.is_empty() {
                body["system"] = json!(system);
            }
            if !tools.is_empty() {
                body["tools"] = tools
                    .iter()
                    .map(
                        |t| json!({"name": t.name, "description": t.description, "input_schema": t.schema}),
                    )
                    .collect();
            }
            body
        }

        pub(super) fn chat_body(
            cfg: &ModelConfig,
            system: &str,
            history: &[Message],
            tools: &[ToolSpec],
        ) -> Value {
            let mut messages = Vec::new();
            if !system.is_empty() {
                messages.push(json!({"role": "system", "content": system}));
            }
            for m in history {
                messages.push(match m {
                    Message::User { text } => json!({"role": "user", "content": text}),
                    Message::Assistant { text, tool_calls } => {
                        let mut msg = json!({"role": "assistant"});
                        msg["content"] = if text.is_empty() && !tool_calls.is_empty() {
                            Value::Null
                        } else {
                            json!(text)
                        };
                        if !tool_calls.is_empty() {
                            msg["tool_calls"] = tool_calls
                                .iter()
                                .map(|c| {
                                    json!({
                                        "id": c.id,
                                        "type": "function",
                                        "function": {"name": c.name, "arguments": args_string(&c.input)},
                                    })
                                })
                                .collect();
                        }
                        msg
                    }
                    Message::ToolResult {
                        call_id, output, ..
                    } => json!({"role": "tool", "tool_call_id": call_id, "content": output}),
                });
            }
            let mut body = json!({
                "model": cfg.model,
                "max_completion_tokens": cfg.max_tokens,
                "messages": messages,
                "stream": cfg.stream,
            });
            if cfg.stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            if !tools.is_empty() {
                body["tools"] = tools
                    .iter()
                    .map(|t| {
                        json!({"type": "function", "function": {
                            "name": t.name, "description": t.description, "parameters": t.schema,
                        }})
                    })
                    .collect();
            }
            body
        }

        pub(super) fn responses_body(
            cfg: &ModelConfig,
            system: &str,
            history: &[Message],
            tools: &[ToolSpec],
        ) -> Value {
            let mut input = Vec::new();
            for m in history {
                match m {
                    Message::User { text } => input.push(json!({"role": "user", "content": text})),
                    Message::Assistant { text, tool_calls } => {
                        if !text.is_empty() {
                            input.push(json!({"role": "assistant", "content": text}));
                        }
                        for c in tool_calls {
                            input.push(json!({
                                "type": "function_call",
                                "call_id": c.id,
                                "name": c.name,
                                "arguments": args_string(&c.input),
                            }));
                        }
                    }
                    Message::ToolResult {
                        call_id, output, ..
                    } => input.push(json!({
                        "type": "function_call_output",
                        "call_id": call_id,
                        "output": output,
                    })),
                }
            }
            let mut body = json!({
                "model": cfg.model,
                "max_output_tokens": cfg.max_tokens,
                "input": input,
                "stream": cfg.stream,
                "store": false,
            });
            if !system.is_empty() {
                body["instructions"] = json!(system);
            }
            if !tools.is_empty() {
                body["tools"] = tools
                    .iter()
                    .map(|t| {
                        json!({"type": "function", "name": t.name, "description": t.description,
                            "parameters": t.schema, "strict": false})
                    })
                    .collect();
            }
            body
        }
    }

    fn anthropic_messages(history: &[Message]) -> Vec<Value> {
        let c = cfg(Api::Anthropic, String::new(), false);
        let prompt = Prompt::new(&c, "", &[]);
        let mut conversation = Conversation::new(c.api);
        for m in history {
            conversation.push(m);
        }
        let body: Value = serde_json::from_slice(&prompt.body(&conversation)).unwrap();
        body["messages"].as_array().unwrap().clone()
    }

    fn arb_message() -> impl proptest::strategy::Strategy<Value = Message> {
        use proptest::prelude::*;
        let text = prop_oneof![Just(String::new()), "[a-z\"\\\\ é\n]{1,8}"];
        let input = prop_oneof![
            Just(json!({})),
            Just(json!({"path": "a.txt", "n": 1})),
            Just(json!({"_raw": "{oops"})),
            Just(json!("a string")),
        ];
        let call = ("[a-z0-9_]{1,6}", "[a-z_]{1,6}", input)
            .prop_map(|(id, name, input)| ToolCallReq { id, name, input });
        prop_oneof![
            text.clone().prop_map(|text| Message::User { text }),
            (text.clone(), proptest::collection::vec(call, 0..3))
                .prop_map(|(text, tool_calls)| Message::Assistant { text, tool_calls }),
            ("[a-z0-9_]{1,6}", text, any::<bool>()).prop_map(|(call_id, output, is_error)| {
                Message::ToolResult {
                    call_id,
                    output,
                    is_error,
                }
            }),
        ]
    }

    proptest::proptest! {
        /// Every request the incremental conversation sends equals the whole-history rebuild, for
        /// every prefix of any history, in each API, streaming or not, with or without a system
        /// prompt and tools.
        #[test]
        fn the_incremental_conversation_sends_what_a_rebuild_would(
            history in proptest::collection::vec(arb_message(), 0..12),
            system in proptest::prop_oneof![proptest::strategy::Just(String::new()), "[a-z ]{1,10}"],
            with_tools in proptest::bool::ANY,
            stream in proptest::bool::ANY,
        ) {
            let tools = if with_tools { read_file_tool() } else { vec![] };
            for api in APIS {
                let c = cfg(api, "http://h".into(), stream);
                let prompt = Prompt::new(&c, &system, &tools);
                let mut conversation = Conversation::new(api);
                for n in 0..=history.len() {
                    if n > 0 {
                        conversation.push(&history[n - 1]);
                    }
                    let body: Value = serde_json::from_slice(&prompt.body(&conversation)).unwrap();
                    let expected = match api {
                        Api::Anthropic => reference::anthropic_body(&c, &system, &history[..n], &tools),
                        Api::OpenaiChat => reference::chat_body(&c, &system, &history[..n], &tools),
                        Api::OpenaiResponses => reference::responses_body(&c, &system, &history[..n], &tools),
                    };
                    proptest::prop_assert_eq!(body, expected, "{:?} after {} messages", api, n);
                }
            }
        }
    }

    #[test]
    fn anthropic_merges_user_text_after_results() {
        let msgs = anthropic_messages(&[
            Message::User { text: "hi".into() },
            Message::Assistant {
                text: "x".into(),
                tool_calls: vec![ToolCallReq {
                    id: "c1".into(),
                    name: "t".into(),
                    input: json!({}),
                }],
            },
            Message::ToolResult {
                call_id: "c1".into(),
                output: "out".into(),
                is_error: false,
            },
            Message::User {
                text: "more".into(),
            },
        ]);
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[2]["content"][0]["type"], "tool_result");
        assert_eq!(
            msgs[2]["content"][1],
            json!({"type": "text", "text": "more"})
        );
    }

    #[tokio::test]
    async fn connection_refused_is_connection_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        for api in APIS {
            let mut c = cfg(api, format!("http://127.0.0.1:{port}"), true);
            c.max_retries = 3;
            let err = complete(&test_http(), &c, "", &[], &read_file_tool())
                .await
                .unwrap_err();
            match err {
                ModelError::Connection(msg) => assert!(msg.contains("4 attempts"), "{msg}"),
                other => panic!("expected Connection, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn rejected_key_is_not_retried() {
        for api in APIS {
            let log = log_path("401");
            let addr = modelsim(r#"{"turns":[],"final":"x"}"#, &log).await;
            let mut c = cfg(api, format!("http://{addr}/v1"), false);
            c.api_key = agentscope_modelsim::REJECTED_KEY.into();
            c.max_retries = 5;
            let history = [Message::User { text: "hi".into() }];
            let err = complete(&test_http(), &c, "", &history, &read_file_tool())
                .await
                .unwrap_err();
            match err {
                ModelError::Rejected(msg) => {
                    assert!(msg.contains("401"), "{msg}");
                    assert!(msg.to_lowercase().contains("key"), "{msg}");
                }
                other => panic!("expected Rejected, got {other:?}"),
            }
            let lines = read_log(&log);
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert_eq!(lines[0]["outcome"], "unauthorized");
        }
    }

    /// A server answering from `plan` in order (the last entry repeats); counts the requests.
    async fn plan_server(plan: Vec<(u16, &'static str, String)>) -> (String, Arc<AtomicUsize>) {
        let hits = Arc::new(AtomicUsize::new(0));
        let plan = Arc::new(plan);
        let counter = hits.clone();
        let app = axum::Router::new().fallback(move || {
            let plan = plan.clone();
            let counter = counter.clone();
            async move {
                let i = counter.fetch_add(1, Ordering::SeqCst);
                let (status, ctype, body) = plan[i.min(plan.len() - 1)].clone();
                axum::response::Response::builder()
                    .status(status)
                    .header("content-type", ctype)
                    .body(axum::body::Body::from(body))
                    .unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}"), hits)
    }

    fn ok_anthropic() -> String {
        json!({"type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 4}})
        .to_string()
    }

    fn server_error() -> (u16, &'static str, String) {
        (
            500,
            "application/json",
            r#"{"type":"error","error":{"type":"api_error","message":"boom"}}"#.into(),
        )
    }

    #[tokio::test]
    async fn server_errors_are_retried() {
        let (base, hits) = plan_server(vec![
            server_error(),
            server_error(),
            (200, "application/json", ok_anthropic()),
        ])
        .await;
        let c = cfg(Api::Anthropic, base, false);
        let turn = complete(&test_http(), &c, "", &[], &[])
            .await
            .expect("third attempt succeeds");
        assert_eq!(turn.text, "ok");
        assert_eq!((turn.input_tokens, turn.output_tokens), (3, 4));
        assert_eq!(hits.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn server_errors_exhaust_retries() {
        let (base, hits) = plan_server(vec![server_error()]).await;
        let mut c = cfg(Api::OpenaiChat, base, false);
        c.max_retries = 1;
        let err = complete(&test_http(), &c, "", &[], &[]).await.unwrap_err();
        match err {
            ModelError::Rejected(msg) => assert!(msg.contains("500") && msg.contains("boom")),
            other => panic!("expected Rejected, got {other:?}"),
        }
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn bad_request_is_rejected_at_once() {
        let (base, hits) = plan_server(vec![(
            400,
            "application/json",
            r#"{"error":{"message":"bad field"}}"#.into(),
        )])
        .await;
        let mut c = cfg(Api::OpenaiResponses, base, true);
        c.max_retries = 4;
        let err = complete(&test_http(), &c, "", &[], &[]).await.unwrap_err();
        match err {
            ModelError::Rejected(msg) => assert!(msg.contains("400") && msg.contains("bad field")),
            other => panic!("expected Rejected, got {other:?}"),
        }
        assert_eq!(hits.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn malformed_body_is_rejected() {
        let (base, hits) = plan_server(vec![(200, "application/json", "not json".into())]).await;
        let err = complete(
            &test_http(),
            &cfg(Api::Anthropic, base, false),
            "",
            &[],
            &[],
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ModelError::Rejected(_)), "{err:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn stream_cut_short_is_retried() {
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":\
            {\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
        let full = format!(
            "{start}event: content_block_start\ndata: {{\"type\":\"content_block_start\",\
            \"index\":0,\"content_block\":{{\"type\":\"tool_use\",\"id\":\"t1\",\"name\":\"x\",\
            \"input\":{{}}}}}}\n\n\
            event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\
            \"delta\":{{\"type\":\"input_json_delta\",\"partial_json\":\"{{not json\"}}}}\n\n\
            event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":0}}\n\n\
            event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":\
            {{\"stop_reason\":\"tool_use\"}},\"usage\":{{\"output_tokens\":7}}}}\n\n\
            event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
        );
        let (base, hits) = plan_server(vec![
            (200, "text/event-stream", start.to_string()),
            (200, "text/event-stream", full),
        ])
        .await;
        let turn = complete(&test_http(), &cfg(Api::Anthropic, base, true), "", &[], &[])
            .await
            .expect("second attempt succeeds");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        assert_eq!(turn.tool_calls.len(), 1);
        assert_eq!(turn.tool_calls[0].input, json!({"_raw": "{not json"}));
        assert_eq!(turn.stop_reason, "tool_use");
        assert_eq!((turn.input_tokens, turn.output_tokens), (5, 7));
    }

    #[test]
    fn sse_parser_handles_any_split() {
        let text = "event: a\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\n: comment\n\ndata:héllo\n\nevent: b\ndata: last";
        let expected = vec![
            SseEvent {
                event: "a".into(),
                data: "{\"x\":\n1}".into(),
            },
            SseEvent {
                event: String::new(),
                data: "héllo".into(),
            },
            SseEvent {
                event: "b".into(),
                data: "last".into(),
            },
        ];
        let bytes = text.as_bytes();
        for split in 0..=bytes.len() {
            for split2 in split..=bytes.len() {
                let mut p = SseParser::default();
                let mut out = Vec::new();
                p.push(&bytes[..split], &mut out);
                p.push(&bytes[split..split2], &mut out);
                p.push(&bytes[split2..], &mut out);
                p.finish(&mut out);
                assert_eq!(out, expected, "split at {split}/{split2}");
            }
        }
    }

    #[test]
    fn args_and_backoff() {
        assert_eq!(parse_args(""), json!({}));
        assert_eq!(parse_args("{\"a\":1}"), json!({"a": 1}));
        assert_eq!(parse_args("{oops"), json!({"_raw": "{oops"}));
        assert_eq!(args_string(&json!({"_raw": "{oops"})), "{oops");
        assert_eq!(backoff_ms(100, 0), 100);
        assert_eq!(backoff_ms(100, 3), 800);
        assert_eq!(backoff_ms(100, 10), MAX_BACKOFF_MS);
        assert_eq!(backoff_ms(u64::MAX, 200), MAX_BACKOFF_MS);
        let c = cfg(Api::OpenaiChat, "http://h:1/v1/".into(), false);
        assert_eq!(endpoint(&c), "http://h:1/v1/chat/completions");
    }
}
