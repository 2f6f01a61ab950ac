//! Human output: lines (a closed stdout ends the program quietly), aligned tables, events.

use serde_json::Value;
use std::collections::HashMap;
use std::io::Write;

/// A JSON value on one line, cut to 80 characters.
pub(crate) fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

/// Prints a line; a closed stdout (e.g. `| head`) ends the program quietly.
pub(crate) fn out(line: impl std::fmt::Display) {
    if writeln!(std::io::stdout(), "{line}").is_err() {
        std::process::exit(0);
    }
}

pub(crate) fn print_json(v: &Value) {
    out(serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// A JSON value as a table cell: strings bare, null as `-`.
pub(crate) fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(crate) fn when(v: &Value) -> String {
    v.as_str()
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map(|t| {
            t.with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string()
        })
        .unwrap_or_else(|| cell(v))
}

/// The last 8 hex digits of an id (the random part of a UUIDv7).
pub(crate) fn short(id: &str) -> String {
    let hex: String = id.chars().filter(|c| *c != '-').collect();
    hex[hex.len().saturating_sub(8)..].to_string()
}

pub(crate) fn name_of(names: &HashMap<String, String>, id: &Value) -> String {
    id.as_str()
        .and_then(|i| names.get(i).cloned())
        .unwrap_or_else(|| cell(id))
}

/// Aligned columns; the last column is not padded.
pub(crate) fn table_lines(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let fmt = |cells: Vec<&str>| {
        let n = cells.len();
        let mut line = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            line.push_str(c);
            if i + 1 < n {
                let pad = widths
                    .get(i)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(c.chars().count());
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        line
    };
    let mut lines = vec![fmt(header.to_vec())];
    lines.extend(
        rows.iter()
            .map(|r| fmt(r.iter().map(String::as_str).collect())),
    );
    lines
}

pub(crate) fn table(header: &[&str], rows: Vec<Vec<String>>) {
    if rows.is_empty() {
        out("(none)");
        return;
    }
    for l in table_lines(header, &rows) {
        out(l);
    }
}

/// One line per event: `[a<attempt_number> #<seq>] <kind> <summary>`.
pub(crate) fn event_line(ev: &Value) -> String {
    let kind = ev["kind"].as_str().unwrap_or("event");
    let p = &ev["payload"];
    let summary = match kind {
        "output" => {
            let t = text(&p["text"]);
            let t = t
                .trim_end_matches(['\n', '\r'])
                .replace("\r\n", "\\n")
                .replace('\n', "\\n");
            let trunc = if p["truncated"] == true {
                " [truncated]"
            } else {
                ""
            };
            format!("{}: {t}{trunc}", text(&p["stream"]))
        }
        "lifecycle" => {
            let mut s = text(&p["state"]);
            if let Some(c) = p["failure_class"].as_str().filter(|c| !c.is_empty()) {
                s.push_str(&format!(" class={c}"));
                if let Some(r) = p["remedy"].as_str().filter(|r| !r.is_empty()) {
                    s.push_str(&format!(" ({r})"));
                }
            }
            if !p["exit_code"].is_null() {
                s.push_str(&format!(" exit={}", p["exit_code"]));
            }
            let d = text(&p["detail"]);
            if !d.is_empty() {
                s.push_str(&format!(" - {}", d.replace('\n', "\\n")));
            }
            s
        }
        "diagnostic" => format!(
            "{} {}: {}",
            text(&p["level"]),
            text(&p["code"]),
            text(&p["message"]).replace('\n', "\\n")
        ),
        _ => p.to_string(),
    };
    format!(
        "[a{} #{}] {kind} {summary}",
        ev["attempt_number"], ev["seq"]
    )
}

pub(crate) fn print_event(ev: &Value, json: bool) {
    if json {
        out(ev.to_string())
    } else {
        out(event_line(ev))
    }
}

/// `attempt <n> <status> host=<id> [class=<c> (<remedy>)] [exit=<code>] id=<attempt id>`
pub(crate) fn attempt_line(a: &Value) -> String {
    let mut s = format!(
        "attempt {} {} host={}",
        cell(&a["number"]),
        cell(&a["status"]),
        cell(&a["host_id"])
    );
    if let Some(c) = a["failure_class"].as_str().filter(|c| !c.is_empty()) {
        s.push_str(&format!(" class={c}"));
        if let Some(r) = a["remedy"].as_str().filter(|r| !r.is_empty()) {
            s.push_str(&format!(" ({r})"));
        }
    }
    if !a["exit_code"].is_null() {
        s.push_str(&format!(" exit={}", a["exit_code"]));
    }
    s.push_str(&format!(" id={}", cell(&a["id"])));
    s
}
