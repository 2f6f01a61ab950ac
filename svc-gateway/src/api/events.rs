//! Execution events, as a JSON page or a live SSE stream that resumes from `Last-Event-ID`.
//!
//! Gap-free by construction: the recorder stores each attempt's events with consecutive `seq`
//! in commit order, and a follow-up attempt exists only after the previous one ended, so a cursor
//! (attempt number, seq) never skips a row that commits later.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Id};
use agentscope_api::EventQuery;
use agentscope_domain::AttemptStatus;
use axum::Json;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use sqlx::Row;
use std::convert::Infallible;
use std::time::Duration;
use uuid::Uuid;

#[derive(Clone, Copy, Debug)]
enum Scope {
    Attempt(Uuid),
    Task(Uuid),
}

/// Position after which to read: (attempt number, seq).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Cursor {
    number: i32,
    seq: i64,
}

impl Cursor {
    fn parse(s: &str, scope: Scope) -> Option<Cursor> {
        let s = s.trim();
        match scope {
            Scope::Attempt(_) => s.parse().ok().map(|seq| Cursor { number: 0, seq }),
            Scope::Task(_) => {
                let (n, q) = s.split_once(':')?;
                Some(Cursor {
                    number: n.parse().ok()?,
                    seq: q.parse().ok()?,
                })
            }
        }
    }
    fn render(&self, scope: Scope) -> String {
        match scope {
            Scope::Attempt(_) => self.seq.to_string(),
            Scope::Task(_) => format!("{}:{}", self.number, self.seq),
        }
    }
}

pub async fn attempt_events(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    headers: HeaderMap,
    q: Result<Query<EventQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let owned: Option<(Uuid,)> =
        sqlx::query_as("SELECT id FROM attempts WHERE id = $1 AND workspace_id = $2")
            .bind(id)
            .bind(auth.workspace_id)
            .fetch_optional(&s.db)
            .await?;
    owned.ok_or_else(|| ApiError::not_found("attempt"))?;
    events(s, Scope::Attempt(id), headers, q?.0).await
}

pub async fn task_events(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    headers: HeaderMap,
    q: Result<Query<EventQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let owned: Option<(Uuid,)> =
        sqlx::query_as("SELECT id FROM tasks WHERE id = $1 AND workspace_id = $2")
            .bind(id)
            .bind(auth.workspace_id)
            .fetch_optional(&s.db)
            .await?;
    owned.ok_or_else(|| ApiError::not_found("task"))?;
    events(s, Scope::Task(id), headers, q?.0).await
}

async fn events(
    s: AppState,
    scope: Scope,
    headers: HeaderMap,
    q: EventQuery,
) -> ApiResult<Response> {
    let wants_sse = q.follow.unwrap_or(false)
        || headers
            .get(axum::http::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"));
    let raw_cursor = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.after);
    let cursor = match raw_cursor {
        None => Cursor::default(),
        Some(c) => Cursor::parse(&c, scope).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_cursor",
                format!("`{c}` is not an event id of this stream"),
            )
        })?,
    };
    if !wants_sse {
        let limit = q.limit.unwrap_or(500).clamp(1, 5000);
        let page = fetch(&s, scope, cursor, limit).await?;
        let next = page.last().map(|(c, _)| *c).unwrap_or(cursor);
        let items: Vec<Value> = page.into_iter().map(|(_, v)| v).collect();
        return Ok(Json(json!({"items": items, "next": next.render(scope)})).into_response());
    }
    s.metrics.inc("agentscope_sse_streams_total", &[]);
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(64);
    tokio::spawn(follow(s, scope, cursor, tx));
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// Feeds one SSE client until the stream's work is over or the client goes away.
async fn follow(
    s: AppState,
    scope: Scope,
    mut cursor: Cursor,
    tx: tokio::sync::mpsc::Sender<Event>,
) {
    loop {
        if s.shutdown.is_cancelled() {
            // The gateway stops: the client resumes elsewhere from its Last-Event-ID.
            let _ = tx
                .send(
                    Event::default()
                        .event("shutdown")
                        .data(r#"{"resume":true}"#),
                )
                .await;
            return;
        }
        // Subscribe before reading, so a commit between the read and the wait still wakes us.
        let mut wake = s.recorded.subscribe();
        let page = match fetch(&s, scope, cursor, 500).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = ?e, "read events for a live stream");
                let outage = match &e {
                    crate::error::ApiError::Db(e) => matches!(
                        agentscope_store::fault(e),
                        agentscope_store::Fault::Unavailable | agentscope_store::Fault::Conflict
                    ),
                    crate::error::ApiError::Bus(_) => true,
                    _ => false,
                };
                let data = if outage {
                    r#"{"code":"unavailable"}"#
                } else {
                    r#"{"code":"internal"}"#
                };
                let _ = tx.send(Event::default().event("error").data(data)).await;
                return;
            }
        };
        let empty = page.is_empty();
        for (c, v) in page {
            let kind = v["kind"].as_str().unwrap_or("event").to_string();
            let ev = Event::default()
                .id(c.render(scope))
                .event(kind)
                .data(v.to_string());
            if tx.send(ev).await.is_err() {
                return;
            }
            cursor = c;
        }
        if !empty {
            continue;
        }
        match finished(&s, scope, cursor).await {
            Ok(Some(status)) => {
                let _ = tx
                    .send(
                        Event::default()
                            .event("end")
                            .data(json!({"status": status}).to_string()),
                    )
                    .await;
                return;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = ?e, "read stream state"),
        }
        let deadline = tokio::time::sleep(Duration::from_secs(2));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => break,
                _ = s.shutdown.cancelled() => break,
                _ = tx.closed() => return,
                r = wake.recv() => match r {
                    Ok((attempt, task)) => {
                        let hit = match scope { Scope::Attempt(a) => a == attempt, Scope::Task(t) => t == task };
                        if hit { break }
                    }
                    Err(_) => break,
                },
            }
        }
    }
}

async fn fetch(
    s: &AppState,
    scope: Scope,
    c: Cursor,
    limit: i64,
) -> ApiResult<Vec<(Cursor, Value)>> {
    let rows = match scope {
        Scope::Attempt(id) => {
            sqlx::query(
                "SELECT a.id AS attempt_id, a.number, e.seq, e.kind, e.payload, e.at FROM execution_events e
                 JOIN attempts a ON a.id = e.attempt_id
                 WHERE e.attempt_id = $1 AND e.seq > $2 ORDER BY e.seq LIMIT $3",
            )
            .bind(id)
            .bind(c.seq)
            .bind(limit)
            .fetch_all(&s.db)
            .await?
        }
        Scope::Task(id) => {
            sqlx::query(
                "SELECT a.id AS attempt_id, a.number, e.seq, e.kind, e.payload, e.at FROM execution_events e
                 JOIN attempts a ON a.id = e.attempt_id
                 WHERE a.task_id = $1 AND (a.number, e.seq) > ($2, $3) ORDER BY a.number, e.seq LIMIT $4",
            )
            .bind(id)
            .bind(c.number)
            .bind(c.seq)
            .bind(limit)
            .fetch_all(&s.db)
            .await?
        }
    };
    rows.iter()
        .map(|r| {
            let cur = Cursor {
                number: match scope {
                    Scope::Attempt(_) => 0,
                    Scope::Task(_) => r.try_get("number")?,
                },
                seq: r.try_get("seq")?,
            };
            Ok((
                cur,
                json!({
                    "id": cur.render(scope),
                    "attempt_id": r.try_get::<Uuid, _>("attempt_id")?,
                    "attempt_number": r.try_get::<i32, _>("number")?,
                    "seq": cur.seq,
                    "kind": r.try_get::<String, _>("kind")?,
                    "at": r.try_get::<chrono::DateTime<chrono::Utc>, _>("at")?,
                    "payload": r.try_get::<Value, _>("payload")?,
                }),
            ))
        })
        .collect()
}

/// The final status when nothing more can follow `c`, else None.
async fn finished(s: &AppState, scope: Scope, c: Cursor) -> ApiResult<Option<String>> {
    let row: Option<(i32, String, i64)> = match scope {
        Scope::Attempt(id) => sqlx::query_as("SELECT number, status, last_seq FROM attempts WHERE id = $1")
            .bind(id)
            .fetch_optional(&s.db)
            .await?,
        Scope::Task(id) => sqlx::query_as(
            "SELECT number, status, last_seq FROM attempts WHERE task_id = $1 ORDER BY number DESC LIMIT 1",
        )
        .bind(id)
        .fetch_optional(&s.db)
        .await?,
    };
    let Some((number, status, last_seq)) = row else {
        return Ok(None);
    };
    let terminal = AttemptStatus::parse(&status).is_some_and(|st| st.is_terminal());
    let caught_up = match scope {
        Scope::Attempt(_) => c.seq >= last_seq,
        Scope::Task(_) => (c.number, c.seq) >= (number, last_seq) || last_seq == 0,
    };
    Ok((terminal && caught_up).then_some(status))
}
