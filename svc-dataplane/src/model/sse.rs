//! Server-sent events: an incremental parser, and the loop that feeds one API's accumulator
//! until its answer is complete.

use super::{Fail, Turn, err_chain};
use futures::StreamExt as _;

#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct SseEvent {
    /// `event:` field, empty when absent.
    pub(super) event: String,
    /// `data:` lines joined by `\n`.
    pub(super) data: String,
}

/// Incremental SSE parser: bytes in (split anywhere), complete events out.
#[derive(Debug, Default)]
pub(super) struct SseParser {
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
}

impl SseParser {
    pub(super) fn push(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
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
    pub(super) fn finish(&mut self, out: &mut Vec<SseEvent>) {
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
pub(super) trait StreamAcc {
    /// Takes one event; `Some(turn)` once the answer is complete.
    fn event(&mut self, ev: &SseEvent) -> Result<Option<Turn>, Fail>;
    /// The body ended before the final event.
    fn eof(&mut self) -> Result<Turn, Fail>;
}

pub(super) async fn read_stream(
    resp: reqwest::Response,
    mut acc: impl StreamAcc,
) -> Result<Turn, Fail> {
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
