//! The HTTP client of the `/v1` API: bearer auth, errors as `<code>: <message>`, and the small
//! helpers every command uses to build bodies and resolve names.

use anyhow::{Context, Result, anyhow, bail};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

pub(crate) enum Auth<'a> {
    Workspace,
    Admin(&'a str),
    None,
}

pub(crate) struct Api {
    http: reqwest::Client,
    pub(crate) base: String,
    token: Option<String>,
}

impl Api {
    pub(crate) fn new(base: &str, token: Option<String>) -> Result<Api> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .context("build the HTTP client")?;
        Ok(Api {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.trim().is_empty()),
        })
    }

    pub(crate) fn request(&self, method: Method, path: &str, auth: Auth) -> Result<RequestBuilder> {
        let rb = self.http.request(method, format!("{}{}", self.base, path));
        Ok(match auth {
            Auth::Workspace => {
                let token = self.token.as_deref().ok_or_else(|| {
                    anyhow!("no workspace API token: pass --token or set AGENTSCOPE_TOKEN")
                })?;
                rb.bearer_auth(token)
            }
            Auth::Admin(token) => rb.bearer_auth(token),
            Auth::None => rb,
        })
    }

    pub(crate) fn net_error(&self, e: reqwest::Error) -> anyhow::Error {
        let what = if e.is_timeout() {
            "timed out talking to"
        } else if e.is_connect() {
            "cannot connect to"
        } else {
            "request failed to"
        };
        let e = e.without_url();
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        anyhow!("{what} the agentscope API at {} ({msg})", self.base)
    }

    /// Sends a request and returns its status and body (JSON, or the text as a JSON string).
    pub(crate) async fn send(&self, rb: RequestBuilder) -> Result<(StatusCode, Value)> {
        let resp = rb.send().await.map_err(|e| self.net_error(e))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| self.net_error(e))?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        Ok((status, body))
    }

    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        auth: Auth<'_>,
        body: Option<Value>,
    ) -> Result<Value> {
        let mut rb = self
            .request(method, path, auth)?
            .timeout(Duration::from_secs(60));
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let (status, v) = self.send(rb).await?;
        if !status.is_success() {
            return Err(api_error(status, &v));
        }
        Ok(v)
    }

    pub(crate) async fn get(&self, path: &str) -> Result<Value> {
        self.call(Method::GET, path, Auth::Workspace, None).await
    }

    pub(crate) async fn post(&self, path: &str, body: Value) -> Result<Value> {
        self.call(Method::POST, path, Auth::Workspace, Some(body))
            .await
    }

    /// A GET whose 404 is `None`.
    pub(crate) async fn get_opt(&self, path: &str) -> Result<Option<Value>> {
        let rb = self
            .request(Method::GET, path, Auth::Workspace)?
            .timeout(Duration::from_secs(60));
        let (status, v) = self.send(rb).await?;
        match status {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => Ok(Some(v)),
            s => Err(api_error(s, &v)),
        }
    }

    /// The `items` of a list endpoint.
    pub(crate) async fn items(&self, path: &str) -> Result<Vec<Value>> {
        match self.get(path).await? {
            Value::Object(mut m) => match m.remove("items") {
                Some(Value::Array(a)) => Ok(a),
                _ => bail!("unexpected response from {path}: no `items` array"),
            },
            _ => bail!("unexpected response from {path}: not a JSON object"),
        }
    }
}

pub(crate) fn api_error(status: StatusCode, body: &Value) -> anyhow::Error {
    let err = &body["error"];
    if let (Some(code), Some(message)) = (err["code"].as_str(), err["message"].as_str()) {
        return anyhow!("{code}: {message}");
    }
    let detail = match body {
        Value::String(s) if !s.trim().is_empty() => s.trim().to_string(),
        Value::Null | Value::String(_) => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string(),
        other => other.to_string(),
    };
    anyhow!("http_{}: {detail}", status.as_u16())
}

/// Percent-encodes a query parameter value.
pub(crate) fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A JSON object of the fields that are present.
pub(crate) fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
    Value::Object(
        fields
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
            .collect::<Map<_, _>>(),
    )
}

pub(crate) fn opt<T: Serialize>(v: &Option<T>) -> Option<Value> {
    v.as_ref().map(|x| json!(x))
}

pub(crate) fn id_arg(what: &str, s: &str) -> Result<Uuid> {
    Uuid::parse_str(s.trim()).map_err(|_| anyhow!("`{s}` is not a {what} id (a UUID)"))
}

/// Resolves a UUID or a name through a list endpoint.
pub(crate) async fn resolve(api: &Api, what: &str, path: &str, arg: &str) -> Result<Uuid> {
    if let Ok(id) = Uuid::parse_str(arg.trim()) {
        return Ok(id);
    }
    let items = api.items(path).await?;
    let ids: Vec<&str> = items
        .iter()
        .filter(|i| i["name"].as_str() == Some(arg))
        .filter_map(|i| i["id"].as_str())
        .collect();
    match ids.as_slice() {
        [id] => id_arg(what, id),
        [] => bail!("no {what} named `{arg}` in this workspace"),
        _ => bail!("{} {what}s are named `{arg}`; use an id", ids.len()),
    }
}

/// id → name of a list endpoint's items.
pub(crate) async fn names(api: &Api, path: &str) -> Result<HashMap<String, String>> {
    Ok(api
        .items(path)
        .await?
        .iter()
        .filter_map(|i| {
            Some((
                i["id"].as_str()?.to_string(),
                i["name"].as_str()?.to_string(),
            ))
        })
        .collect())
}

pub(crate) fn items_of(v: &Value) -> &[Value] {
    v["items"].as_array().map(Vec::as_slice).unwrap_or_default()
}
