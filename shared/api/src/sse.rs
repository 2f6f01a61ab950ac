//! The gateway's event streams (`text/event-stream`, `follow=true` on the `/events` routes) read
//! back: an incremental parser of server-sent events for the API's clients (the CLI, the tests).
//!
//! A frame is `id:`, `event:` and `data:` lines ended by a blank line; several `data:` lines are
//! one value joined by newlines, lines starting with `:` are comments (the keep-alives), a field
//! without a colon has an empty value and unknown fields are ignored.

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// Its `id` (the gateway's resume cursor, sent back as `Last-Event-ID`), if it has one.
    pub id: Option<String>,
    /// Its `event` (the kind of event), `message` when it names none.
    pub event: String,
    /// Its `data` lines, joined by newlines.
    pub data: String,
}

/// Reads events out of a stream's chunks as they arrive; a chunk may end anywhere, even inside a
/// line or a UTF-8 character.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    id: Option<String>,
    event: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    /// The events that `chunk` completes, in order.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(i) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let raw = &self.buf[start..start + i];
            start += i + 1;
            let line = String::from_utf8_lossy(raw);
            if let Some(ev) = line_into(
                &mut self.id,
                &mut self.event,
                &mut self.data,
                line.trim_end_matches('\r'),
            ) {
                events.push(ev);
            }
        }
        self.buf.drain(..start);
        events
    }
}

/// Takes one line (without its line break) into the frame being read; a blank line ends the
/// frame, which is an event when it had an `event` or `data`.
fn line_into(
    id: &mut Option<String>,
    event: &mut Option<String>,
    data: &mut Vec<String>,
    line: &str,
) -> Option<SseEvent> {
    if line.is_empty() {
        let (id, event, data) = (id.take(), event.take(), std::mem::take(data));
        if data.is_empty() && event.is_none() {
            return None;
        }
        return Some(SseEvent {
            id,
            event: event.unwrap_or_else(|| "message".into()),
            data: data.join("\n"),
        });
    }
    if line.starts_with(':') {
        return None;
    }
    let (field, value) = match line.split_once(':') {
        Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
        None => (line, ""),
    };
    match field {
        "id" => *id = Some(value.to_string()),
        "event" => *event = Some(value.to_string()),
        "data" => data.push(value.to_string()),
        _ => {}
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(id: Option<&str>, event: &str, data: &str) -> SseEvent {
        SseEvent {
            id: id.map(str::to_string),
            event: event.to_string(),
            data: data.to_string(),
        }
    }

    #[test]
    fn frames_become_events() {
        let mut p = SseParser::default();
        let got = p.feed(
            b": keep-alive\n\nid: a1\nevent: output\ndata: {\"x\":1}\n\nevent: end\ndata: {}\n\n",
        );
        assert_eq!(
            got,
            vec![ev(Some("a1"), "output", "{\"x\":1}"), ev(None, "end", "{}"),]
        );
    }

    #[test]
    fn chunks_may_split_lines_and_characters() {
        let stream = "id: 7\r\nevent: output\r\ndata: h\u{e9}llo\r\n\r\n".as_bytes();
        let mut p = SseParser::default();
        let mut got = Vec::new();
        for b in stream {
            got.extend(p.feed(std::slice::from_ref(b)));
        }
        assert_eq!(got, vec![ev(Some("7"), "output", "h\u{e9}llo")]);
    }

    #[test]
    fn data_lines_join_and_defaults_apply() {
        let mut p = SseParser::default();
        let got = p.feed(b"data: one\ndata:two\ndata\nretry: 5\n\n\n");
        assert_eq!(got, vec![ev(None, "message", "one\ntwo\n")]);
        // Nothing is left over: an id does not carry into the next event.
        assert_eq!(p.feed(b"data: x\n\n"), vec![ev(None, "message", "x")]);
    }
}
