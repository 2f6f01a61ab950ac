//! The E2B backend of the `sandbox` environment, on E2B's documented API:
//!
//! - create: `POST {api}/sandboxes {"templateID", "timeout"}` with `X-API-Key`, answering
//!   `sandboxID` (and `envdAccessToken` for secured sandboxes);
//! - files: envd at `https://49983-{sandboxID}.{domain}`, `GET /files?path=&username=user` and
//!   `POST /files?path=&username=user` (multipart field `file`);
//! - commands: envd's Connect RPC `process.Process/Start` (server stream, `application/connect+json`
//!   envelopes: one flag byte, a big-endian u32 length, JSON), events `start`, `data`
//!   (`stdout`/`stderr` in base64), `end` (`exitCode`);
//! - authentication to envd: `Authorization: Basic base64("user:")`, plus `X-Access-Token`.
//!
//! Session files live in `/home/user/session` inside the sandbox. One sandbox per session and
//! replica; a replica that takes a session over starts a fresh one (the files of the old one
//! stay there until E2B's timeout ends it).

use crate::env::Limits;
use crate::tools::{ToolError, ToolOutput};
use base64::Engine as _;
use serde_json::{Value, json};
use std::time::Duration;

const ROOT: &str = "/home/user/session";

#[derive(Debug, Clone)]
pub struct E2b {
    pub http: reqwest::Client,
    /// E.g. https://api.e2b.app
    pub api_url: String,
    pub api_key: String,
    pub template: String,
    /// E.g. e2b.app: envd is at https://49983-<sandbox>.<domain>.
    pub domain: String,
}

#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    envd: String,
    token: Option<String>,
}

fn unavailable(what: impl std::fmt::Display) -> ToolOutput {
    ToolError::SandboxUnavailable.output(what)
}

impl E2b {
    /// A new sandbox from the configured template, living at most `timeout`.
    pub async fn create(&self, timeout: Duration) -> Result<Sandbox, ToolOutput> {
        let url = format!("{}/sandboxes", self.api_url.trim_end_matches('/'));
        let res = self
            .http
            .post(&url)
            .header("X-API-Key", &self.api_key)
            .json(&json!({"templateID": self.template, "timeout": timeout.as_secs().max(60)}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|e| unavailable(format!("cannot reach E2B at {}: {e}", self.api_url)))?;
        let status = res.status();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(unavailable(format!(
                "E2B refused to create a sandbox ({status}): {}",
                body.get("message").and_then(Value::as_str).unwrap_or("")
            )));
        }
        let id = body
            .get("sandboxID")
            .and_then(Value::as_str)
            .ok_or_else(|| unavailable("E2B answered without a sandboxID"))?;
        let domain = body
            .get("domain")
            .and_then(Value::as_str)
            .filter(|d| !d.is_empty())
            .unwrap_or(&self.domain);
        Ok(Sandbox {
            id: id.to_string(),
            envd: format!("https://49983-{id}.{domain}"),
            token: body
                .get("envdAccessToken")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }
}

/// A path relative to the session directory, checked: no absolute path, no `..`.
pub fn session_path(path: &str) -> Result<String, ToolOutput> {
    let rel = path.trim_start_matches("./");
    if rel.starts_with('/') || rel.split('/').any(|c| c == "..") || rel.contains('\0') {
        return Err(
            ToolError::PathEscape.output(format!("`{path}` is outside the session directory"))
        );
    }
    Ok(if rel.is_empty() || rel == "." {
        ROOT.to_string()
    } else {
        format!("{ROOT}/{rel}")
    })
}

/// One Connect envelope: flags, big-endian length, JSON.
pub fn envelope(flags: u8, msg: &Value) -> Vec<u8> {
    let body = msg.to_string().into_bytes();
    let mut out = Vec::with_capacity(body.len() + 5);
    out.push(flags);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Splits complete envelopes off the front of `buf`: (flags, JSON) each.
pub fn take_envelopes(buf: &mut Vec<u8>) -> Vec<(u8, Value)> {
    let mut out = vec![];
    while buf.len() >= 5 {
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if buf.len() < 5 + len {
            break;
        }
        let flags = buf[0];
        let v = serde_json::from_slice(&buf[5..5 + len]).unwrap_or(Value::Null);
        buf.drain(..5 + len);
        out.push((flags, v));
    }
    out
}

/// What a `process.Process/Start` stream said: output in order, and the exit code.
#[derive(Debug, Default, PartialEq)]
pub struct Run {
    pub output: String,
    pub exit_code: Option<i64>,
    pub error: Option<String>,
}

impl Run {
    /// Folds one envelope into the run.
    pub fn apply(&mut self, flags: u8, v: &Value) {
        if flags & 0x02 != 0 {
            if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
                self.error = Some(format!(
                    "{}: {}",
                    e.get("code").and_then(Value::as_str).unwrap_or("unknown"),
                    e.get("message").and_then(Value::as_str).unwrap_or("")
                ));
            }
            return;
        }
        let Some(event) = v.get("event") else { return };
        if let Some(data) = event.get("data") {
            for stream in ["stdout", "stderr", "pty"] {
                if let Some(b) = data.get(stream).and_then(Value::as_str)
                    && let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(b)
                {
                    self.output.push_str(&String::from_utf8_lossy(&bytes));
                }
            }
        }
        if let Some(end) = event.get("end") {
            self.exit_code = Some(end.get("exitCode").and_then(Value::as_i64).unwrap_or(0));
            if let Some(e) = end
                .get("error")
                .and_then(Value::as_str)
                .filter(|e| !e.is_empty())
            {
                self.error = Some(e.to_string());
            }
        }
    }
}

/// A multipart/form-data body with one file field.
pub fn multipart(boundary: &str, content: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"file\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    out.extend_from_slice(content);
    out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    out
}

impl Sandbox {
    /// envd's `/files?path=...&username=user`.
    fn files_url(&self, path: &str) -> Result<reqwest::Url, ToolOutput> {
        let mut url = reqwest::Url::parse(&format!("{}/files", self.envd))
            .map_err(|e| unavailable(format!("bad envd address {}: {e}", self.envd)))?;
        url.query_pairs_mut()
            .append_pair("path", path)
            .append_pair("username", "user");
        Ok(url)
    }

    fn auth(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let basic = base64::engine::general_purpose::STANDARD.encode("user:");
        let req = req.header("Authorization", format!("Basic {basic}"));
        match &self.token {
            Some(t) => req.header("X-Access-Token", t),
            None => req,
        }
    }

    /// Runs one file or shell tool in the sandbox.
    pub async fn run(
        &self,
        http: &reqwest::Client,
        tool: &str,
        input: &Value,
        env: &[(String, String)],
        limits: &Limits,
    ) -> ToolOutput {
        let arg = |k: &str| {
            input
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let r: Result<ToolOutput, ToolOutput> = async {
            match tool {
                "read_file" => {
                    let path = session_path(&arg("path"))?;
                    self.read(http, &path).await
                }
                "write_file" => {
                    let path = session_path(&arg("path"))?;
                    let content = arg("content");
                    self.write(http, &path, content.as_bytes()).await?;
                    Ok(ToolOutput {
                        output: format!("wrote {} bytes to {}", content.len(), arg("path")),
                        is_error: false,
                    })
                }
                "edit_file" => {
                    let path = session_path(&arg("path"))?;
                    let text = self.read(http, &path).await?;
                    if text.is_error {
                        return Ok(text);
                    }
                    let old = arg("old_text");
                    let n = if old.is_empty() {
                        0
                    } else {
                        text.output.matches(&old).count()
                    };
                    if n != 1 {
                        let code = if n == 0 {
                            "no_match"
                        } else {
                            "ambiguous_match"
                        };
                        return Ok(ToolOutput {
                            output: format!("{code}: `old_text` occurs {n} times"),
                            is_error: true,
                        });
                    }
                    let new = text.output.replacen(&old, &arg("new_text"), 1);
                    self.write(http, &path, new.as_bytes()).await?;
                    Ok(ToolOutput {
                        output: format!("edited {}", arg("path")),
                        is_error: false,
                    })
                }
                "list_files" => {
                    let path = session_path(&arg("path"))?;
                    self.shell(
                        http,
                        &format!("ls -1Ap -- '{}'", path.replace('\'', "'\\''")),
                        &[],
                        limits,
                    )
                    .await
                }
                "shell" => self.shell(http, &arg("command"), env, limits).await,
                other => Ok(ToolError::UnknownTool.output(format!("no tool named `{other}`"))),
            }
        }
        .await;
        r.unwrap_or_else(|e| e)
    }

    async fn read(&self, http: &reqwest::Client, path: &str) -> Result<ToolOutput, ToolOutput> {
        let res = self
            .auth(http.get(self.files_url(path)?))
            .send()
            .await
            .map_err(|e| unavailable(format!("envd of sandbox {}: {e}", self.id)))?;
        let status = res.status();
        let text = res.text().await.unwrap_or_default();
        Ok(if status.is_success() {
            ToolOutput {
                output: text,
                is_error: false,
            }
        } else if status == reqwest::StatusCode::NOT_FOUND {
            ToolError::NotFound.output(path)
        } else {
            ToolError::Io.output(format!("reading {path}: {status}"))
        })
    }

    async fn write(
        &self,
        http: &reqwest::Client,
        path: &str,
        content: &[u8],
    ) -> Result<(), ToolOutput> {
        let boundary = format!("agentscope{}", uuid::Uuid::new_v4().simple());
        let res = self
            .auth(http.post(self.files_url(path)?))
            .header(
                "Content-Type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(multipart(&boundary, content))
            .send()
            .await
            .map_err(|e| unavailable(format!("envd of sandbox {}: {e}", self.id)))?;
        if res.status().is_success() {
            Ok(())
        } else {
            Err(ToolError::Io.output(format!("writing {path}: {}", res.status())))
        }
    }

    async fn shell(
        &self,
        http: &reqwest::Client,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
    ) -> Result<ToolOutput, ToolOutput> {
        let envs: serde_json::Map<String, Value> = env
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        let start = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command],
            "envs": envs, "cwd": ROOT}});
        let res = self
            .auth(http.post(format!("{}/process.Process/Start", self.envd)))
            .header("Content-Type", "application/connect+json")
            .header("Connect-Protocol-Version", "1")
            .timeout(limits.timeout + Duration::from_secs(10))
            .body(envelope(0, &start))
            .send()
            .await
            .map_err(|e| unavailable(format!("envd of sandbox {}: {e}", self.id)))?;
        if !res.status().is_success() {
            return Err(unavailable(format!(
                "envd refused the command: {}",
                res.status()
            )));
        }
        let mut run = Run::default();
        let mut buf = vec![];
        let mut stream = res.bytes_stream();
        use futures::StreamExt;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| unavailable(format!("the command's stream broke: {e}")))?;
            buf.extend_from_slice(&chunk);
            for (flags, v) in take_envelopes(&mut buf) {
                run.apply(flags, &v);
            }
            if run.output.len() > limits.max_output {
                run.output.truncate(limits.max_output);
            }
        }
        let status = match (run.exit_code, &run.error) {
            (_, Some(e)) => format!("error: {e}"),
            (Some(c), None) => format!("exit code {c}"),
            (None, None) => "the stream ended without an exit code".into(),
        };
        Ok(ToolOutput {
            is_error: run.exit_code != Some(0) || run.error.is_some(),
            output: format!("{}\n[{status}]", run.output),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_in_the_session_directory() {
        assert_eq!(
            session_path("a/b.txt").unwrap(),
            "/home/user/session/a/b.txt"
        );
        assert_eq!(session_path("").unwrap(), ROOT);
        assert_eq!(session_path("./x").unwrap(), "/home/user/session/x");
        for bad in ["/etc/passwd", "../x", "a/../../x", ".."] {
            assert!(
                session_path(bad)
                    .unwrap_err()
                    .output
                    .starts_with("path_escape"),
                "{bad}"
            );
        }
    }

    #[test]
    fn envelopes_round_trip_across_arbitrary_chunking() {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let mut wire = envelope(0, &json!({"event": {"start": {"pid": 7}}}));
        wire.extend(envelope(
            0,
            &json!({"event": {"data": {"stdout": b64("hello ")}}}),
        ));
        wire.extend(envelope(0, &json!({"event": {"keepalive": {}}})));
        wire.extend(envelope(
            0,
            &json!({"event": {"data": {"stderr": b64("world\n")}}}),
        ));
        wire.extend(envelope(
            0,
            &json!({"event": {"end": {"exitCode": 3, "exited": true}}}),
        ));
        wire.extend(envelope(2, &json!({})));
        for cut in 1..wire.len() {
            let mut run = Run::default();
            let mut buf = vec![];
            for part in [&wire[..cut], &wire[cut..]] {
                buf.extend_from_slice(part);
                for (f, v) in take_envelopes(&mut buf) {
                    run.apply(f, &v);
                }
            }
            assert!(buf.is_empty());
            assert_eq!(
                run,
                Run {
                    output: "hello world\n".into(),
                    exit_code: Some(3),
                    error: None
                },
                "cut {cut}"
            );
        }
    }

    #[test]
    fn an_end_of_stream_error_is_kept() {
        let mut run = Run::default();
        run.apply(
            2,
            &json!({"error": {"code": "deadline_exceeded", "message": "too slow"}}),
        );
        assert_eq!(run.error.as_deref(), Some("deadline_exceeded: too slow"));
    }

    #[test]
    fn file_urls_encode_the_path() {
        let s = Sandbox {
            id: "sb1".into(),
            envd: "https://49983-sb1.e2b.app".into(),
            token: None,
        };
        let url = s.files_url("/home/user/session/a b&c.txt").unwrap();
        assert_eq!(
            url.as_str(),
            "https://49983-sb1.e2b.app/files?path=%2Fhome%2Fuser%2Fsession%2Fa+b%26c.txt&username=user"
        );
    }

    #[test]
    fn multipart_carries_the_file_between_boundaries() {
        let body = String::from_utf8(multipart("B", b"content")).unwrap();
        assert!(body.starts_with("--B\r\nContent-Disposition: form-data; name=\"file\""));
        assert!(body.contains("\r\n\r\ncontent\r\n--B--\r\n"));
    }
}
