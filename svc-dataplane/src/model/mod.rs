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

use std::time::Duration;

use serde_json::{Value, json};

mod anthropic;
mod chat;
mod responses;
mod sse;
#[cfg(test)]
mod tests;
mod wire;

use anthropic::{AnthropicAcc, anthropic_blocks, anthropic_head, anthropic_turn};
use chat::{ChatAcc, chat_head, chat_message, chat_turn};
use responses::{ResponsesAcc, responses_head, responses_items, responses_turn};
use sse::read_stream;

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
