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
use agentscope_schemas::v1::{Recorded, RecordedEvent};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Scope {
    Attempt(Uuid),
    Task(Uuid),
}

impl Scope {
    /// The cursor of the event `seq` of attempt `number` in this scope's stream (an attempt's
    /// own stream numbers its cursors 0).
    fn cursor(self, number: i32, seq: i64) -> Cursor {
        match self {
            Scope::Attempt(_) => Cursor { number: 0, seq },
            Scope::Task(_) => Cursor { number, seq },
        }
    }
}

/// Position after which to read: (attempt number, seq).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Cursor {
    number: i32,
    seq: i64,
}

impl Cursor {
    /// After every event of any scope: a read from here returns no event.
    const END: Cursor = Cursor {
        number: i32::MAX,
        seq: i64::MAX,
    };

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
    events(s, auth, Scope::Attempt(id), headers, q?.0).await
}

pub async fn task_events(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    headers: HeaderMap,
    q: Result<Query<EventQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    events(s, auth, Scope::Task(id), headers, q?.0).await
}

/// Whether the scope is the workspace's, where a read of it did not already say so (it found
/// no attempt: a task of the workspace may have none yet), or before refusing a cursor (an
/// unknown scope is not found, whatever the cursor).
async fn owned(s: &AppState, auth: Auth, scope: Scope) -> ApiResult<()> {
    let (found, what) = match scope {
        Scope::Attempt(id) => (
            sqlx::query_scalar!(
                "SELECT id FROM attempts WHERE id = $1 AND workspace_id = $2",
                id,
                auth.workspace_id,
            )
            .fetch_optional(&s.db)
            .await?,
            "attempt",
        ),
        Scope::Task(id) => (
            sqlx::query_scalar!(
                "SELECT id FROM tasks WHERE id = $1 AND workspace_id = $2",
                id,
                auth.workspace_id,
            )
            .fetch_optional(&s.db)
            .await?,
            "task",
        ),
    };
    found.map(|_| ()).ok_or_else(|| ApiError::not_found(what))
}

async fn events(
    s: AppState,
    auth: Auth,
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
        Some(c) => match Cursor::parse(&c, scope) {
            Some(c) => c,
            None => {
                owned(&s, auth, scope).await?;
                return Err(ApiError::bad_request(
                    "invalid_cursor",
                    format!("`{c}` is not an event id of this stream"),
                ));
            }
        },
    };
    let ws = auth.workspace_id;
    if !wants_sse {
        let limit = q.limit.unwrap_or(500).clamp(1, 5000);
        // The page's read is also the check that the scope is the workspace's.
        let (page, newest) = fetch(&s, scope, ws, cursor, limit).await?;
        if newest.is_none() {
            owned(&s, auth, scope).await?;
        }
        let next = page.last().map(|(c, _)| *c).unwrap_or(cursor);
        let items: Vec<Value> = page.into_iter().map(|(_, v)| v).collect();
        return Ok(Json(json!({"items": items, "next": next.render(scope)})).into_response());
    }
    // The stream's first page, read before anything is sent: it is also the check that the
    // scope is the workspace's, and it may start the scope's shared reader. Commit notices are
    // heard from before the read on, so the reader misses none committed after it.
    let wake = s.recorded.subscribe();
    let (page, newest) = fetch(&s, scope, ws, cursor, PAGE).await?;
    if newest.is_none() {
        owned(&s, auth, scope).await?;
    }
    s.metrics.inc("agentscope_sse_streams_total", &[]);
    // Frames go out pre-rendered, as many as are ready in one chunk (one write per batch, not
    // per event). At shutdown the stream says so and ends; the HTTP server's graceful shutdown
    // waits for its connection.
    let first = First {
        page,
        seed: Seed { newest, wake },
    };
    let follow = Follow::new(s, scope, ws, cursor, first);
    let stream = futures::stream::unfold(follow, |mut f| async move {
        f.next().await.map(|b| (Ok::<_, Infallible>(b), f))
    });
    Ok((
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

/// A commit notice of the recorder (or of the scheduler's own end of an attempt), as live
/// streams use it.
pub struct Notice {
    attempt: Uuid,
    task: Uuid,
    /// The attempt's end was committed with it.
    ended: bool,
    /// The attempt's number (with `events`) and newest stored seq.
    number: i32,
    seq: i64,
    /// The rows this commit stored for the attempt, consecutive and ending at `seq`; empty when
    /// the notice came without them (too many or too large, or not the recorder's).
    events: Vec<RecordedEvent>,
}

impl Notice {
    /// None for a notice whose ids or seq do not parse (it wakes nothing).
    pub fn of(n: Recorded) -> Option<Notice> {
        Some(Notice {
            attempt: Uuid::parse_str(&n.attempt_id).ok()?,
            task: Uuid::parse_str(&n.task_id).ok()?,
            ended: n.ended,
            number: n.number,
            seq: i64::try_from(n.seq).ok()?,
            events: n.events,
        })
    }

    fn hits(&self, scope: Scope) -> bool {
        match scope {
            Scope::Attempt(a) => a == self.attempt,
            Scope::Task(t) => t == self.task,
        }
    }

    /// The scope's events after `head` as the notice brings them, when it brings every one of
    /// them: not an end, of the scope's newest attempt (as its reader last read it), its rows
    /// consecutive, ending at its seq and starting no later than just after `head` (an empty page
    /// when `head` is past them already). None: the database is read instead. The page is what
    /// that read would return: each row as it was stored, rendered by [`event`].
    fn page(
        &self,
        scope: Scope,
        head: Cursor,
        newest: Option<&Newest>,
    ) -> Option<Vec<(Cursor, Value)>> {
        let first = i64::try_from(self.events.first()?.seq).ok()?;
        let number = scope.cursor(self.number, first).number;
        if self.ended || newest?.number != number || head.number != number {
            return None;
        }
        let consecutive = self
            .events
            .iter()
            .zip(first..)
            .all(|(e, seq)| i64::try_from(e.seq) == Ok(seq));
        let last = first.checked_add(self.events.len() as i64 - 1)?;
        if !consecutive || last != self.seq || first > head.seq.checked_add(1)? {
            return None;
        }
        let skip = usize::try_from(head.seq + 1 - first).ok()?;
        let mut page = Vec::with_capacity(self.events.len().saturating_sub(skip));
        for e in self.events.iter().skip(skip) {
            page.push(event(
                scope,
                EventRow {
                    attempt_id: self.attempt,
                    number: self.number,
                    seq: e.seq as i64,
                    kind: e.kind.clone(),
                    payload: serde_json::from_str(&e.payload).ok()?,
                    at: chrono::DateTime::from_timestamp_micros(e.at_us)?,
                },
            ));
        }
        Some(page)
    }
}

/// A live stream's first read: its page, and where the scope's reader would start from it.
struct First {
    page: Vec<(Cursor, Value)>,
    seed: Seed,
}

/// Live readers, one per followed attempt or task, shared by all of its SSE clients.
#[derive(Clone, Default)]
pub struct Feeds(Arc<Mutex<HashMap<Scope, Weak<Feed>>>>);

/// One shared reader of a scope's events: woken by the recorder's commit notices, it reads what
/// was committed after its head once (by the scope's own indexed cursor) and broadcasts it to
/// every follower. Stops when its last follower leaves.
struct Feed {
    tx: broadcast::Sender<Arc<Batch>>,
    /// Set before the feed sends its last batch (the scope is over); later followers start
    /// another feed.
    ended: Arc<AtomicBool>,
    _stop: tokio_util::sync::DropGuard,
}

/// Events after `prev`, in order, each as its SSE frame (rendered once for every follower), and
/// all of them in one chunk; `end` when nothing more can follow the last of them.
struct Batch {
    prev: Cursor,
    events: Vec<(Cursor, Bytes)>,
    all: Bytes,
    end: Option<String>,
}

/// One SSE frame: `id`, `event` and `data` lines and the blank line that ends it.
fn frame(out: &mut BytesMut, id: Option<&str>, event: &str, data: &str) {
    if let Some(id) = id {
        out.put_slice(b"id: ");
        out.put_slice(id.as_bytes());
        out.put_u8(b'\n');
    }
    out.put_slice(b"event: ");
    out.put_slice(event.as_bytes());
    // Compact JSON has no line breaks; anything else is split into data lines.
    for line in data.split('\n') {
        out.put_slice(b"\ndata: ");
        out.put_slice(line.as_bytes());
    }
    out.put_slice(b"\n\n");
}

/// The frame of a stored event.
fn event_frame(out: &mut BytesMut, scope: Scope, c: Cursor, v: &Value) {
    let kind = v["kind"].as_str().unwrap_or("event");
    frame(out, Some(&c.render(scope)), kind, &v.to_string());
}

fn single(event: &str, data: &str) -> Bytes {
    let mut b = BytesMut::new();
    frame(&mut b, None, event, data);
    b.freeze()
}

/// Batches a feed keeps for its followers; one that falls further behind re-reads from the
/// database by its own cursor.
const FEED_BUFFER: usize = 256;
/// Events read by one query.
const PAGE: i64 = 500;
/// A follower's chunk grows by batches already waiting up to about this size.
const COALESCE_BYTES: usize = 256 * 1024;

impl Feeds {
    /// Joins the scope's live reader, or starts one. A reader started here begins where
    /// `seed` (a read of the scope, and the notices heard since just before it) left the
    /// scope, or, without one, reads where it ends.
    fn subscribe(
        &self,
        s: &AppState,
        scope: Scope,
        workspace: Uuid,
        seed: Option<Seed>,
    ) -> (Arc<Feed>, broadcast::Receiver<Arc<Batch>>) {
        let mut map = self.0.lock().expect("feeds");
        if let Some(feed) = map
            .get(&scope)
            .and_then(Weak::upgrade)
            .filter(|f| !f.ended.load(Ordering::SeqCst))
        {
            let rx = feed.tx.subscribe();
            return (feed, rx);
        }
        map.retain(|_, f| f.strong_count() > 0);
        let (tx, rx) = broadcast::channel(FEED_BUFFER);
        // Stops when its last follower leaves, or when the gateway stops.
        let stop = s.work.stopping().child_token();
        let ended = Arc::new(AtomicBool::new(false));
        let feed = Arc::new(Feed {
            tx: tx.clone(),
            ended: ended.clone(),
            _stop: stop.clone().drop_guard(),
        });
        map.insert(scope, Arc::downgrade(&feed));
        let reader = Reader {
            scope,
            workspace,
            tx,
            ended,
            stop,
        };
        s.work.spawn(read_feed(s.clone(), reader, seed));
        (feed, rx)
    }
}

/// Where a new reader starts: the scope's newest attempt as a read found it, and the commit
/// notices heard since just before that read.
struct Seed {
    newest: Option<Newest>,
    wake: broadcast::Receiver<Arc<Notice>>,
}

/// A shared reader's scope (of `workspace`) and its ends.
struct Reader {
    scope: Scope,
    workspace: Uuid,
    tx: broadcast::Sender<Arc<Batch>>,
    ended: Arc<AtomicBool>,
    stop: CancellationToken,
}

/// The shared reader of one scope.
async fn read_feed(s: AppState, r: Reader, seed: Option<Seed>) {
    let Reader {
        scope,
        workspace,
        tx,
        ended,
        stop,
    } = r;
    if stop.is_cancelled() {
        return;
    }
    // Followers catch up from the database themselves; the feed starts at the scope's end as
    // of its seed's read or its own (nothing to read there yet: whatever commits later sends a
    // notice), unless it is over.
    let (mut wake, mut newest) = match seed {
        Some(seed) => (seed.wake, seed.newest),
        None => {
            let wake = s.recorded.subscribe();
            let newest = loop {
                match fetch(&s, scope, workspace, Cursor::END, 1).await {
                    Ok((_, n)) => break n,
                    Err(e) => {
                        tracing::warn!(error = ?e, "read the end of a live stream");
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        }
                    }
                }
            };
            (wake, newest)
        }
    };
    let mut head = newest.as_ref().map(Newest::head).unwrap_or_default();
    loop {
        // Over once the newest attempt ended and its last event is out: known from the read
        // that brought `head` (pages read in one statement with the newest attempt).
        if let Some(status) = newest.as_ref().and_then(|n| n.finished(head)) {
            ended.store(true, Ordering::SeqCst);
            let _ = tx.send(Arc::new(Batch {
                prev: head,
                events: vec![],
                all: Bytes::new(),
                end: Some(status),
            }));
            return;
        }
        // Until a notice for the scope, or a while without one (a notice may be lost).
        let deadline = tokio::time::sleep(Duration::from_secs(2));
        tokio::pin!(deadline);
        let heard = loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = &mut deadline => break None,
                r = wake.recv() => match r {
                    Ok(n) if n.hits(scope) => break Some(n),
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => break None,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        };
        // The usual case while an attempt runs: the notice brings what its commit stored, just
        // after `head`, and the page is sent without reading it back.
        if let Some(n) = heard.as_deref()
            && let Some(page) = n.page(scope, head, newest.as_ref())
        {
            if let Some(newest) = newest.as_mut() {
                newest.last_seq = newest.last_seq.max(n.seq);
            }
            if !page.is_empty() {
                s.metrics
                    .inc("agentscope_sse_pages_total", &[("from", "notice")]);
                head = send_page(&tx, scope, head, &page);
            }
            continue;
        }
        // Everything committed after `head`, page by page. A read that fails leaves `newest` and
        // `head` as the last page that came in left them (still a pair read together).
        loop {
            let (page, n) = match fetch(&s, scope, workspace, head, PAGE).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = ?e, "read events for live streams");
                    break;
                }
            };
            newest = n;
            if page.is_empty() {
                break;
            }
            s.metrics
                .inc("agentscope_sse_pages_total", &[("from", "database")]);
            head = send_page(&tx, scope, head, &page);
            if page.len() as i64 != PAGE {
                break;
            }
        }
    }
}

/// Broadcasts a page of events that follows `head` to a feed's followers, each event's frame
/// rendered once for all of them; the new head.
fn send_page(
    tx: &broadcast::Sender<Arc<Batch>>,
    scope: Scope,
    head: Cursor,
    page: &[(Cursor, Value)],
) -> Cursor {
    let mut all = BytesMut::new();
    let mut bounds = Vec::with_capacity(page.len());
    for (c, v) in page {
        event_frame(&mut all, scope, *c, v);
        bounds.push((*c, all.len()));
    }
    let all = all.freeze();
    let mut start = 0;
    let events: Vec<(Cursor, Bytes)> = bounds
        .into_iter()
        .map(|(c, end)| {
            let f = all.slice(start..end);
            start = end;
            (c, f)
        })
        .collect();
    let new_head = events.last().map(|(c, _)| *c).unwrap_or(head);
    // Without receivers the feed is about to stop anyway.
    let _ = tx.send(Arc::new(Batch {
        prev: head,
        events,
        all,
        end: None,
    }));
    new_head
}

/// A read of a scope: a page of events and the scope's newest attempt (see [`fetch`]).
type Read = (Vec<(Cursor, Value)>, Option<Newest>);

/// One SSE client's stream, polled by its connection (no task or channel of its own between
/// the feed and the socket): first its first page (`first`) and the database after it, then the
/// scope's shared feed. A follower whose cursor is not where a batch starts (it fell behind, or
/// the feed is ahead of its catch-up) reads from the database again by its own cursor, so it
/// never skips or repeats an event.
struct Follow {
    s: AppState,
    scope: Scope,
    workspace: Uuid,
    cursor: Cursor,
    /// The first read, not yet sent.
    first: Option<Read>,
    /// Read from the database (by `cursor`) before taking the feed's next batch.
    catch_up: bool,
    /// Keeps the scope's feed alive while this follower is on it.
    _on: Arc<Feed>,
    feed: broadcast::Receiver<Arc<Batch>>,
    /// The last chunk (the end, an error, or the gateway stopping) has been sent.
    over: bool,
}

impl Follow {
    /// A feed joined after the first read may have sent batches since: the next one it sends
    /// then starts after this follower's cursor, which reads the gap from the database. One
    /// started here begins where the first read left the scope.
    fn new(s: AppState, scope: Scope, workspace: Uuid, cursor: Cursor, first: First) -> Follow {
        let First { page, seed } = first;
        let newest = seed.newest.clone();
        let (on, feed) = s.feeds.subscribe(&s, scope, workspace, Some(seed));
        Follow {
            s,
            scope,
            workspace,
            cursor,
            first: Some((page, newest)),
            catch_up: true,
            _on: on,
            feed,
            over: false,
        }
    }

    /// The next chunk to send (as many frames as are ready), or None once the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        if self.over {
            return None;
        }
        loop {
            if self.s.shutdown.is_cancelled() {
                // The gateway stops: the client resumes elsewhere from its Last-Event-ID.
                self.over = true;
                return Some(single("shutdown", r#"{"resume":true}"#));
            }
            if self.catch_up {
                let read = match self.first.take() {
                    Some(read) => Ok(read),
                    None => fetch(&self.s, self.scope, self.workspace, self.cursor, PAGE).await,
                };
                let (page, newest) = match read {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(error = ?e, "read events for a live stream");
                        self.over = true;
                        return Some(single("error", error_code(&e)));
                    }
                };
                let mut chunk = BytesMut::new();
                for (c, v) in &page {
                    event_frame(&mut chunk, self.scope, *c, v);
                }
                if let Some((last, _)) = page.last() {
                    self.cursor = *last;
                }
                // A full page: more may follow at once.
                if page.len() as i64 != PAGE {
                    self.catch_up = false;
                    if let Some(status) = newest.and_then(|n| n.finished(self.cursor)) {
                        self.over = true;
                        chunk.put_slice(&end_event(&status));
                    }
                }
                if !chunk.is_empty() {
                    return Some(chunk.freeze());
                }
                continue;
            }
            let batch = tokio::select! {
                _ = self.s.shutdown.cancelled() => continue,
                // The feed's own fallback: nothing heard for a while, look for ourselves (and
                // keep the connection alive with a comment).
                _ = tokio::time::sleep(Duration::from_secs(5)) => {
                    self.catch_up = true;
                    return Some(Bytes::from_static(b":\n\n"));
                }
                b = self.feed.recv() => match b {
                    Ok(b) => b,
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        self.fell_behind();
                        continue;
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        // The feed ended (its scope finished) or stopped: read for ourselves.
                        (self._on, self.feed) =
                            self.s.feeds.subscribe(&self.s, self.scope, self.workspace, None);
                        self.catch_up = true;
                        continue;
                    }
                },
            };
            let mut out = Vec::new();
            let Some(mut size) = self.take(&batch, &mut out) else {
                continue;
            };
            // Batches already waiting go out in the same chunk: a follower that fell behind a
            // busy feed catches up in one write (fewer system calls and wake-ups on both ends
            // when they cost the most), without waiting for anything that is not there yet.
            while !self.over && size < COALESCE_BYTES {
                match self.feed.try_recv() {
                    Ok(b) => match self.take(&b, &mut out) {
                        Some(added) => size += added,
                        None => break,
                    },
                    Err(broadcast::error::TryRecvError::Lagged(_)) => {
                        self.fell_behind();
                        break;
                    }
                    // Nothing more yet, or the feed is gone (the next call sees to it).
                    Err(_) => break,
                }
            }
            match out.len() {
                0 => continue,
                1 => return out.pop(),
                _ => {
                    let mut chunk = BytesMut::with_capacity(size);
                    for part in &out {
                        chunk.put_slice(part);
                    }
                    return Some(chunk.freeze());
                }
            }
        }
    }

    /// The feed dropped batches this follower had not taken: it reads them from the database.
    fn fell_behind(&mut self) {
        self.s.metrics.inc("agentscope_sse_lagged_total", &[]);
        self.catch_up = true;
    }

    /// Adds what of `batch` follows this follower's cursor to `out` (and the end, when the
    /// batch brings it), moving the cursor; the bytes added. None, with nothing added, when the
    /// batch starts after the cursor: something between them went by, to be read from the
    /// database.
    fn take(&mut self, batch: &Batch, out: &mut Vec<Bytes>) -> Option<usize> {
        if batch.prev > self.cursor {
            self.catch_up = true;
            return None;
        }
        let before = out.len();
        if let Some((last, _)) = batch.events.last().filter(|(l, _)| *l > self.cursor) {
            if batch.prev == self.cursor {
                // The usual case: the whole batch follows on, one shared chunk.
                out.push(batch.all.clone());
            } else {
                let after = batch.events.iter().filter(|(c, _)| *c > self.cursor);
                out.extend(after.map(|(_, f)| f.clone()));
            }
            self.cursor = *last;
        }
        if let Some(status) = &batch.end {
            self.over = true;
            out.push(end_event(status));
        }
        Some(out[before..].iter().map(Bytes::len).sum())
    }
}

fn end_event(status: &str) -> Bytes {
    single("end", &json!({"status": status}).to_string())
}

fn error_code(e: &ApiError) -> &'static str {
    let outage = match e {
        ApiError::Db(e) => matches!(
            agentscope_store::fault(e),
            agentscope_store::Fault::Unavailable | agentscope_store::Fault::Conflict
        ),
        ApiError::Bus(_) => true,
        _ => false,
    };
    if outage {
        r#"{"code":"unavailable"}"#
    } else {
        r#"{"code":"internal"}"#
    }
}

/// The scope's newest attempt as of a read: its number (0 in an attempt's own stream), status
/// and newest recorded seq.
#[derive(Debug, Clone)]
struct Newest {
    number: i32,
    status: String,
    last_seq: i64,
}

impl Newest {
    /// The cursor of the scope's newest event.
    fn head(&self) -> Cursor {
        Cursor {
            number: self.number,
            seq: self.last_seq,
        }
    }

    /// The final status when nothing more can follow `c`, else None.
    fn finished(&self, c: Cursor) -> Option<String> {
        let terminal = AttemptStatus::parse(&self.status).is_some_and(|st| st.is_terminal());
        let caught_up = c >= self.head() || self.last_seq == 0;
        (terminal && caught_up).then(|| self.status.clone())
    }
}

/// One event of a page, read with its scope's newest attempt.
struct EventRow {
    attempt_id: Uuid,
    number: i32,
    seq: i64,
    kind: String,
    payload: Value,
    at: chrono::DateTime<chrono::Utc>,
}

/// A page of events after `c` and, read in the same statement (so from the same snapshot), the
/// scope's newest attempt: whether the page ends the scope needs no second query. None: the
/// scope has no attempt of `workspace` (then the page is empty).
async fn fetch(
    s: &AppState,
    scope: Scope,
    workspace: Uuid,
    c: Cursor,
    limit: i64,
) -> ApiResult<Read> {
    let mut newest = None;
    let mut rows = Vec::new();
    match scope {
        Scope::Attempt(id) => {
            let found = sqlx::query!(
                r#"SELECT a.id AS attempt_id, a.number, a.status, a.last_seq, e.seq AS "seq?",
                          e.kind AS "kind?", e.payload AS "payload?", e.at AS "at?"
                   FROM attempts a LEFT JOIN LATERAL (
                       SELECT seq, kind, payload, at FROM execution_events
                       WHERE attempt_id = a.id AND seq > $2 ORDER BY seq LIMIT $3) e ON true
                   WHERE a.id = $1 AND a.workspace_id = $4 ORDER BY e.seq"#,
                id,
                c.seq,
                limit,
                workspace,
            )
            .fetch_all(&s.db)
            .await?;
            for r in found {
                newest.get_or_insert_with(|| Newest {
                    number: 0,
                    status: r.status.clone(),
                    last_seq: r.last_seq,
                });
                if let (Some(seq), Some(kind), Some(payload), Some(at)) =
                    (r.seq, r.kind, r.payload, r.at)
                {
                    rows.push(EventRow {
                        attempt_id: r.attempt_id,
                        number: r.number,
                        seq,
                        kind,
                        payload,
                        at,
                    });
                }
            }
        }
        Scope::Task(id) => {
            // The task's attempts by (task_id, number), each one's events by (attempt_id, seq):
            // both unique indexes, so a page reads only the rows it returns.
            let found = sqlx::query!(
                r#"WITH newest AS (
                       SELECT number, status, last_seq FROM attempts
                       WHERE task_id = $1 AND workspace_id = $5 ORDER BY number DESC LIMIT 1)
                   SELECT n.number AS "newest_number!", n.status AS "newest_status!",
                          n.last_seq AS "newest_seq!", p.attempt_id AS "attempt_id?",
                          p.number AS "number?", p.seq AS "seq?", p.kind AS "kind?",
                          p.payload AS "payload?", p.at AS "at?"
                   FROM newest n LEFT JOIN LATERAL (
                       SELECT a.id AS attempt_id, a.number, e.seq, e.kind, e.payload, e.at
                       FROM attempts a
                       CROSS JOIN LATERAL (
                           SELECT seq, kind, payload, at FROM execution_events
                           WHERE attempt_id = a.id
                             AND seq > CASE WHEN a.number = $2 THEN $3::bigint ELSE 0 END
                           ORDER BY seq LIMIT $4) e
                       WHERE a.task_id = $1 AND a.number >= $2
                       ORDER BY a.number, e.seq LIMIT $4) p ON true
                   ORDER BY p.number, p.seq"#,
                id,
                c.number,
                c.seq,
                limit,
                workspace,
            )
            .fetch_all(&s.db)
            .await?;
            for r in found {
                newest.get_or_insert_with(|| Newest {
                    number: r.newest_number,
                    status: r.newest_status.clone(),
                    last_seq: r.newest_seq,
                });
                if let (
                    Some(attempt_id),
                    Some(number),
                    Some(seq),
                    Some(kind),
                    Some(payload),
                    Some(at),
                ) = (r.attempt_id, r.number, r.seq, r.kind, r.payload, r.at)
                {
                    rows.push(EventRow {
                        attempt_id,
                        number,
                        seq,
                        kind,
                        payload,
                        at,
                    });
                }
            }
        }
    };
    let page = rows.into_iter().map(|r| event(scope, r)).collect();
    Ok((page, newest))
}

/// A stored event as a page of `scope` renders it, with its cursor.
fn event(scope: Scope, r: EventRow) -> (Cursor, Value) {
    let cur = scope.cursor(r.number, r.seq);
    let v = json!({
        "id": cur.render(scope),
        "attempt_id": r.attempt_id,
        "attempt_number": r.number,
        "seq": r.seq,
        "kind": r.kind,
        "at": r.at,
        "payload": r.payload,
    });
    (cur, v)
}

#[cfg(test)]
mod tests {
    use agentscope_api::sse::{SseEvent, SseParser};

    /// What [`super::frame`] writes, the clients' parser reads back as it was.
    #[test]
    fn frames_read_back() {
        let mut out = bytes::BytesMut::new();
        super::frame(&mut out, Some("c1"), "output", r#"{"line":"a"}"#);
        super::frame(&mut out, None, "end", "two\nlines");
        let got = SseParser::default().feed(&out);
        assert_eq!(
            got,
            vec![
                SseEvent {
                    id: Some("c1".into()),
                    event: "output".into(),
                    data: r#"{"line":"a"}"#.into(),
                },
                SseEvent {
                    id: None,
                    event: "end".into(),
                    data: "two\nlines".into(),
                },
            ]
        );
    }

    use super::{Cursor, Newest, Notice, Scope};
    use agentscope_schemas::v1::RecordedEvent;
    use uuid::Uuid;

    /// A notice of attempt 2 of a task storing `seqs`, its newest seq the last of them.
    fn notice(seqs: &[u64]) -> Notice {
        Notice {
            attempt: Uuid::from_u128(1),
            task: Uuid::from_u128(2),
            ended: false,
            number: 2,
            seq: seqs.last().map_or(0, |s| *s as i64),
            events: seqs
                .iter()
                .map(|&seq| RecordedEvent {
                    seq,
                    kind: "output".into(),
                    payload: format!(r#"{{"text":"line {seq}"}}"#),
                    at_us: 1_700_000_000_123_456,
                })
                .collect(),
        }
    }

    fn running(number: i32, last_seq: i64) -> Newest {
        Newest {
            number,
            status: "running".into(),
            last_seq,
        }
    }

    fn seqs(page: &[(Cursor, serde_json::Value)]) -> Vec<i64> {
        page.iter().map(|(c, _)| c.seq).collect()
    }

    /// A notice gives a live reader the events just after its head, rendered as a read of the
    /// scope would, or sends it to the database when it cannot tell that it brings all of them.
    #[test]
    fn a_notice_brings_a_page_only_when_it_follows_on_from_the_head() {
        let task = Scope::Task(Uuid::from_u128(2));
        let head = |seq| Cursor { number: 2, seq };
        let newest = running(2, 4);
        // Right after the head, and partly seen already.
        let page = notice(&[5, 6]).page(task, head(4), Some(&newest)).unwrap();
        assert_eq!(seqs(&page), vec![5, 6]);
        assert_eq!(page[0].1["id"], "2:5");
        assert_eq!(page[0].1["attempt_number"], 2);
        assert_eq!(page[0].1["payload"]["text"], "line 5");
        assert_eq!(page[0].1["at"], "2023-11-14T22:13:20.123456Z");
        let page = notice(&[4, 5, 6])
            .page(task, head(5), Some(&newest))
            .unwrap();
        assert_eq!(seqs(&page), vec![6]);
        // Already sent: nothing to send, nothing to read.
        let page = notice(&[3, 4]).page(task, head(6), Some(&newest)).unwrap();
        assert!(page.is_empty());
        // An attempt's own stream numbers its cursor 0 and still says the attempt's number.
        let attempt = Scope::Attempt(Uuid::from_u128(1));
        let at0 = Cursor { number: 0, seq: 4 };
        let page = notice(&[5])
            .page(attempt, at0, Some(&running(0, 4)))
            .unwrap();
        assert_eq!(page[0].1["id"], "5");
        assert_eq!(page[0].1["attempt_number"], 2);

        // Read instead: a gap before its rows (a notice went missing), rows out of order or not
        // ending at its seq, no rows, an end, another attempt than the head's or the newest,
        // no newest known, a payload that is not JSON.
        assert!(notice(&[6, 7]).page(task, head(4), Some(&newest)).is_none());
        assert!(notice(&[5, 7]).page(task, head(4), Some(&newest)).is_none());
        let mut n = notice(&[5, 6]);
        n.seq = 7;
        assert!(n.page(task, head(4), Some(&newest)).is_none());
        assert!(notice(&[]).page(task, head(4), Some(&newest)).is_none());
        let mut n = notice(&[5]);
        n.ended = true;
        assert!(n.page(task, head(4), Some(&newest)).is_none());
        let previous = Cursor { number: 1, seq: 4 };
        assert!(notice(&[1]).page(task, previous, Some(&newest)).is_none());
        assert!(
            notice(&[5])
                .page(task, head(4), Some(&running(3, 0)))
                .is_none()
        );
        assert!(notice(&[5]).page(task, head(4), None).is_none());
        let mut n = notice(&[5]);
        n.events[0].payload = "{not json".into();
        assert!(n.page(task, head(4), Some(&newest)).is_none());
    }
}
