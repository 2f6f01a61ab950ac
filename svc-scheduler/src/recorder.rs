//! The recorder: stores every execution event exactly once, in order, and applies the lifecycle
//! transitions the events carry. Fencing: an event whose lease token or host does not match the
//! attempt's, or that arrives after the attempt ended, changes nothing and is recorded as rejected.

use crate::{Ctx, Error, attempts};
use agentscope_bus::{CONSUMER_RECORDER, STREAM_EVENTS, lease_key};
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::v1::{
    AttemptState, ExecutionEvent, Recorded, RecordedEvent, execution_event::Body,
};
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{AckKind, Message as JsMessage};
use chrono::TimeZone;
use futures::StreamExt;
use serde_json::json;
use sqlx::Connection as _;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

/// A commit notice carries the rows it announces when there are at most this many of them...
const NOTICE_EVENTS: usize = 64;
/// ... and their payloads come to at most this many bytes (a busy attempt's large batches are
/// read back by the gateways instead).
const NOTICE_BYTES: usize = 16 * 1024;

/// "will retry" warnings: one line per interval during an outage.
static RETRY_WARNING: agentscope_telemetry::Throttle =
    agentscope_telemetry::Throttle::new(Duration::from_secs(5));

pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    // Events of one attempt always go to the same worker, so they are handled in order.
    let workers = ctx.config.recorder_workers.max(1);
    let stream = ctx.js.get_stream(STREAM_EVENTS).await.map_err(Error::bus)?;
    // Created or updated: an existing consumer takes the current `max_deliver`.
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER_RECORDER.into()),
            ack_policy: AckPolicy::Explicit,
            // Short, so events in flight when a scheduler dies are redelivered soon; a slow
            // redelivery of a message still being handled is a harmless duplicate.
            ack_wait: Duration::from_secs(5),
            // Four pulls' worth for each of up to four workers, whatever this replica's count:
            // every replica creates or updates the one consumer with the same settings.
            max_ack_pending: 16 * BATCH_MAX as i64,
            max_deliver: ctx.config.max_deliver,
            ..Default::default()
        })
        .await
        .map_err(Error::bus)?;
    // Large pulls: a busy attempt's events arrive by the thousand and are recorded in batches.
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(BATCH_MAX)
        .heartbeat(Duration::from_secs(15))
        .messages()
        .await
        .map_err(Error::bus)?;
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (tx, rx) = mpsc::channel::<JsMessage>(BATCH_MAX);
        senders.push(tx);
        handles.push(tokio::spawn(worker(ctx.clone(), rx)));
    }
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => break,
            m = messages.next() => match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => { tracing::warn!(error = ?e, "recorder consumer"); continue }
                None => break,
            },
        };
        let shard = fxhash(msg.subject.as_str()) % workers;
        if senders[shard].send(msg).await.is_err() {
            break;
        }
    }
    drop(senders);
    for h in handles {
        let _ = h.await;
    }
    Ok(())
}

fn fxhash(s: &str) -> usize {
    s.bytes()
        .fold(0usize, |h, b| h.rotate_left(5) ^ b as usize)
        .wrapping_mul(0x9e37_79b9)
}

/// The most messages one transaction records.
const BATCH_MAX: usize = 1024;

/// Payload bytes one transaction records at most (besides [`BATCH_MAX`] messages): a message
/// may carry a batch of events.
const BATCH_BYTES: usize = 1 << 20;

async fn worker(ctx: Ctx, mut rx: mpsc::Receiver<JsMessage>) {
    while let Some(first) = rx.recv().await {
        // Whatever arrived while the previous batch was being written goes into this one.
        let mut size = first.payload.len();
        let mut batch = vec![first];
        while batch.len() < BATCH_MAX && size < BATCH_BYTES {
            match rx.try_recv() {
                Ok(m) => {
                    size += m.payload.len();
                    batch.push(m)
                }
                Err(_) => break,
            }
        }
        if batch.len() == 1 {
            let msg = batch.pop().expect("one message");
            handle_one(&ctx, msg).await;
        } else {
            record_batch(&ctx, batch).await;
        }
    }
}

/// Records one message (one event, or a batch of them) in its own transaction and settles it:
/// the same checks and statements as a batch of messages ([`record_checked`]).
async fn handle_one(ctx: &Ctx, msg: JsMessage) {
    let subject = msg.subject.to_string();
    let ack = match agentscope_schemas::decode_events(msg.payload.as_ref()) {
        Err(_) => {
            crate::reject(
                ctx,
                &subject,
                CONSUMER_RECORDER,
                "malformed ExecutionEvent payload",
                &msg.payload,
            )
            .await;
            AckKind::Term
        }
        Ok(events) => {
            let span = match events.as_slice() {
                [ev] => tracing::info_span!("record", attempt_id = %ev.attempt_id, seq = ev.seq),
                _ => tracing::info_span!("record_batch", events = events.len()),
            };
            agentscope_bus::set_parent(
                &span,
                agentscope_bus::traceparent(msg.headers.as_ref()).as_deref(),
            );
            let mut items = items_of(0, &subject, Ok(events));
            let res = match record_checked(ctx, &mut items).instrument(span).await {
                Ok(after) => {
                    after_commit(ctx, after).await;
                    combined(items.into_iter().map(|it| it.res))
                }
                Err(e) => Err(e),
            };
            settle(ctx, &msg, res).await
        }
    };
    if let Err(e) = msg.ack_with(ack).await {
        tracing::warn!(error = ?e, "ack event");
    }
}

/// The outcome of a message from those of its events: the first error, else a gap (an earlier
/// event is missing: the message comes again), else stored.
fn combined(
    results: impl Iterator<Item = Option<Result<Outcome, Error>>>,
) -> Result<Outcome, Error> {
    let mut out = Ok(Outcome::Stored);
    for r in results {
        match r.unwrap_or(Ok(Outcome::Duplicate)) {
            Err(e) => return Err(e),
            Ok(Outcome::Gap) => out = Ok(Outcome::Gap),
            Ok(_) => {}
        }
    }
    out
}

/// How a message whose handling ended with `res` is acknowledged (rejections recorded first).
async fn settle(ctx: &Ctx, msg: &JsMessage, res: Result<Outcome, Error>) -> AckKind {
    match res {
        Ok(Outcome::Stored | Outcome::Duplicate) => AckKind::Ack,
        // An earlier event is late; one that never comes leaves this event to
        // `rejected_messages` after `max_deliver` deliveries.
        Ok(Outcome::Gap) => {
            crate::retry_or_reject(
                ctx,
                msg,
                CONSUMER_RECORDER,
                "an earlier event of the attempt never arrived",
                true,
                Duration::from_millis(100),
                // An earlier event is usually only late: look again soon.
                crate::redelivery_max(ctx).min(Duration::from_secs(1)),
            )
            .await
        }
        Err(e) => {
            if e.retryable()
                && let Some(more) = RETRY_WARNING.check()
            {
                tracing::warn!(error = ?e, subject = %msg.subject, "record failed; will retry{more}");
            }
            crate::retry_or_reject(
                ctx,
                msg,
                CONSUMER_RECORDER,
                &crate::describe(&e),
                e.retryable(),
                Duration::from_millis(500),
                crate::redelivery_max(ctx),
            )
            .await
        }
    }
}

/// One event of a batch's messages (or a message that did not decode) and what became of it.
struct Item {
    /// Its message's index in the batch.
    msg: usize,
    /// The event when it decoded and passed the checks that need no database.
    ev: Option<(Uuid, ExecutionEvent)>,
    res: Option<Result<Outcome, Error>>,
}

/// The items of message `msg`: its events, each checked, or the message's decoding error.
fn items_of(
    msg: usize,
    subject: &str,
    events: Result<Vec<ExecutionEvent>, agentscope_schemas::DecodeError>,
) -> Vec<Item> {
    match events {
        Err(_) => vec![Item {
            msg,
            ev: None,
            res: Some(Err(Error::Rejected(
                "malformed ExecutionEvent payload".into(),
            ))),
        }],
        Ok(events) => events
            .into_iter()
            .map(|ev| match precheck(subject, &ev) {
                Ok(id) => Item {
                    msg,
                    ev: Some((id, ev)),
                    res: None,
                },
                Err(e) => Item {
                    msg,
                    ev: None,
                    res: Some(Err(e)),
                },
            })
            .collect(),
    }
}

/// A lifecycle transition or session update a stored event carries, applied in event order.
enum Change {
    Running {
        at: chrono::DateTime<chrono::Utc>,
    },
    Session(String),
    Finish {
        /// The attempt as the batch's earlier events left it.
        a: attempts::Active,
        status: AttemptStatus,
        class: Option<FailureClass>,
        detail: String,
        exit: Option<i32>,
    },
}

/// Records a batch of messages in one transaction: every attempt's rows locked once, its events
/// checked in seq order against the lock (fencing, duplicates, gaps) one by one, the good rows
/// inserted by one statement, transitions applied in order, then the commit
/// and only then the acknowledgements. A batch whose transaction fails is recorded again message
/// by message, so a poison message is rejected alone and the others still land.
async fn record_batch(ctx: &Ctx, batch: Vec<JsMessage>) {
    let mut items: Vec<Item> = Vec::with_capacity(batch.len());
    for (i, msg) in batch.iter().enumerate() {
        items.extend(items_of(
            i,
            msg.subject.as_str(),
            agentscope_schemas::decode_events(msg.payload.as_ref()),
        ));
    }
    let span = tracing::info_span!("record_batch", events = items.len());
    let done = record_checked(ctx, &mut items).instrument(span).await;
    match done {
        Ok(after) => {
            after_commit(ctx, after).await;
        }
        Err(e) => {
            if e.retryable()
                && let Some(more) = RETRY_WARNING.check()
            {
                tracing::warn!(error = ?e, "record batch failed; recording its messages one by one{more}");
            }
            // One by one: the offending message fails alone, the others are recorded.
            for msg in batch {
                handle_one(ctx, msg).await;
            }
            return;
        }
    }
    let mut results: Vec<Vec<Option<Result<Outcome, Error>>>> =
        batch.iter().map(|_| Vec::new()).collect();
    for it in items {
        results[it.msg].push(it.res);
    }
    for (msg, res) in batch.into_iter().zip(results) {
        let ack = settle(ctx, &msg, combined(res.into_iter())).await;
        if let Err(e) = msg.ack_with(ack).await {
            tracing::warn!(error = ?e, "ack event");
        }
    }
}

/// What happens once a batch committed: leases released, pools nudged, followers woken.
#[derive(Default)]
struct AfterCommit {
    /// Ended attempts: (host, attempt, pool).
    ended: Vec<(Option<Uuid>, Uuid, Option<Uuid>)>,
    retry_pools: Vec<Uuid>,
    /// A notice per attempt with newly stored events.
    recorded: Vec<Recorded>,
    stored: u64,
    duplicates: u64,
    fenced: u64,
}

async fn after_commit(ctx: &Ctx, after: AfterCommit) {
    if after.stored > 0 {
        ctx.metrics
            .add("agentscope_events_recorded_total", &[], after.stored);
    }
    if after.duplicates > 0 {
        ctx.metrics
            .add("agentscope_events_duplicate_total", &[], after.duplicates);
    }
    if after.fenced > 0 {
        ctx.metrics
            .add("agentscope_events_fenced_total", &[], after.fenced);
    }
    for (host, attempt_id, pool) in after.ended {
        // The attempt is over: release its lease so nothing can renew it.
        if let Some(host) = host {
            let _ = ctx
                .leases
                .purge(lease_key(&host.to_string(), &attempt_id.to_string()))
                .await;
        }
        if let Some(pool) = pool {
            attempts::nudge(ctx, pool).await;
        }
    }
    for pool in after.retry_pools {
        attempts::nudge(ctx, pool).await;
    }
    for notice in after.recorded {
        crate::intake::publish_recorded(ctx, notice).await;
    }
}

/// The checks of an event that need no database: its attempt id, subject, seq and body.
fn precheck(subject: &str, ev: &ExecutionEvent) -> Result<Uuid, Error> {
    let attempt_id = Uuid::parse_str(&ev.attempt_id)
        .map_err(|_| Error::Rejected("attempt_id is not a UUID".into()))?;
    // The subject's host id is the one NATS authorized to publish it; the attempt's host is
    // checked against it under the attempt's lock.
    if subject != agentscope_bus::subjects::events(&ev.host_id, &ev.attempt_id) {
        return Err(Error::Rejected(
            "subject does not match host_id and attempt_id".into(),
        ));
    }
    if ev.seq == 0 || ev.seq > i64::MAX as u64 {
        return Err(Error::Rejected("seq must be positive".into()));
    }
    if ev.body.is_none() {
        return Err(Error::Rejected("event has no body".into()));
    }
    Ok(attempt_id)
}

/// The transaction of [`record_batch`]: sets each checked item's outcome; commits.
async fn record_checked(ctx: &Ctx, items: &mut [Item]) -> Result<AfterCommit, Error> {
    let mut after = AfterCommit::default();
    // Each attempt's items in seq order (stable: a redelivery keeps its place after the first).
    let mut by_attempt: Vec<(Uuid, Vec<usize>)> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        if let Some((id, _)) = &it.ev {
            match by_attempt.iter_mut().find(|(a, _)| a == id) {
                Some((_, v)) => v.push(i),
                None => by_attempt.push((*id, vec![i])),
            }
        }
    }
    if by_attempt.is_empty() {
        return Ok(after);
    }
    for (_, v) in by_attempt.iter_mut() {
        v.sort_by_key(|&i| items[i].ev.as_ref().map(|(_, e)| e.seq).unwrap_or(0));
    }
    if let [(attempt_id, idx)] = by_attempt.as_slice() {
        let events: Vec<&ExecutionEvent> = idx
            .iter()
            .map(|&i| &items[i].ev.as_ref().expect("checked item").1)
            .collect();
        if let Some(notice) = record_plain(ctx, *attempt_id, &events).await? {
            for &i in idx {
                items[i].res = Some(Ok(Outcome::Stored));
            }
            after.recorded.push(notice);
            after.stored += idx.len() as u64;
            return Ok(after);
        }
    }
    let mut ids: Vec<Uuid> = by_attempt.iter().map(|(a, _)| *a).collect();
    ids.sort();
    let mut conn = ctx.recorder_db.acquire().await?;
    let mut tx = conn.begin().await?;
    let locked = attempts::lock_many(&mut tx, &ids).await?;

    let mut rows = Rows::default();
    // Each attempt's new last seq, where this batch stores events of it.
    let mut seq_of: std::collections::HashMap<Uuid, i64> = Default::default();
    let mut changes: Vec<(usize, Change)> = Vec::new();
    for (attempt_id, idx) in &by_attempt {
        let Some(a) = locked.iter().find(|a| a.id == *attempt_id) else {
            for &i in idx {
                items[i].res = Some(Err(Error::Rejected(format!(
                    "unknown attempt {attempt_id}"
                ))));
            }
            continue;
        };
        let mut a = copy(a);
        let start_seq = a.last_seq;
        // Redeliveries at or below `last_seq`: which of those rows the scheduler wrote itself.
        let old: Vec<i64> = idx
            .iter()
            .filter_map(|&i| items[i].ev.as_ref().map(|(_, e)| e.seq as i64))
            .filter(|&s| s <= a.last_seq)
            .collect();
        let by_scheduler: Vec<i64> = if old.is_empty() {
            vec![]
        } else {
            sqlx::query_scalar!(
                "SELECT seq FROM execution_events WHERE attempt_id = $1 AND seq = ANY($2) AND payload->>'recorded_by' = 'scheduler'",
                attempt_id,
                &old,
            )
            .fetch_all(&mut *tx)
            .await?
        };
        let mut ended = false;
        for &i in idx {
            let (_, ev) = items[i].ev.as_ref().expect("checked item");
            let seq = ev.seq as i64;
            let res = if seq <= a.last_seq && !(seq <= start_seq && by_scheduler.contains(&seq)) {
                // A redelivery of the host's own event (or a repeat inside this batch); a host
                // event where the scheduler recorded the attempt's end is fenced below.
                after.duplicates += 1;
                Ok(Outcome::Duplicate)
            } else if a.lease_token != Some(ev.lease_token as i64)
                || a.host_id.map(|h| h.to_string()) != Some(ev.host_id.clone())
            {
                after.fenced += 1;
                Err(Error::Rejected(format!(
                    "fenced: lease token {} from host {} does not hold attempt {attempt_id}",
                    ev.lease_token, ev.host_id
                )))
            } else if a.status.is_terminal() || ended {
                after.fenced += 1;
                Err(Error::Rejected(format!(
                    "fenced: attempt {attempt_id} is already {}",
                    a.status
                )))
            } else if seq > a.last_seq + 1 {
                Ok(Outcome::Gap)
            } else {
                let body = ev.body.as_ref().expect("checked body");
                let (kind, payload, at) = row_of(ev, body);
                rows.push(*attempt_id, seq, kind, payload, at);
                a.last_seq = seq;
                match body {
                    Body::Lifecycle(l) => match AttemptState::try_from(l.state).unwrap_or_default()
                    {
                        AttemptState::Running if a.status.can_move_to(AttemptStatus::Running) => {
                            a.status = AttemptStatus::Running;
                            changes.push((i, Change::Running { at }));
                        }
                        s @ (AttemptState::Succeeded
                        | AttemptState::Failed
                        | AttemptState::Cancelled) => {
                            let (status, class) = match s {
                                AttemptState::Succeeded => (AttemptStatus::Succeeded, None),
                                AttemptState::Cancelled => {
                                    (AttemptStatus::Cancelled, Some(FailureClass::Cancelled))
                                }
                                _ => (
                                    AttemptStatus::Failed,
                                    Some(FailureClass::parse(&l.failure_class)),
                                ),
                            };
                            changes.push((
                                i,
                                Change::Finish {
                                    a: copy(&a),
                                    status,
                                    class,
                                    detail: crate::storable(&l.detail).into_owned(),
                                    exit: l.has_exit_code.then_some(l.exit_code),
                                },
                            ));
                            ended = true;
                        }
                        _ => {}
                    },
                    Body::SessionStarted(s) => changes.push((
                        i,
                        Change::Session(crate::storable(&s.provider_session_id).into_owned()),
                    )),
                    _ => {}
                }
                Ok(Outcome::Stored)
            };
            items[i].res = Some(res);
        }
        if a.last_seq > start_seq {
            seq_of.insert(a.id, a.last_seq);
            let n = notice(a.id, a.task_id, a.number, a.last_seq, ended, rows.of(a.id));
            after.recorded.push(n);
            after.stored += (a.last_seq - start_seq) as u64;
        }
        if ended {
            after.ended.push((a.host_id, a.id, a.pool_id));
        }
    }
    if !rows.seq.is_empty() {
        sqlx::query!(
            "INSERT INTO execution_events (attempt_id, seq, kind, payload, at)
             SELECT * FROM UNNEST($1::uuid[], $2::bigint[], $3::text[], $4::jsonb[], $5::timestamptz[])",
            &rows.attempt_id,
            &rows.seq,
            // The kinds are static names; text[] takes them as &str (the check expects String).
            &rows.kind as &[&str],
            &rows.payload,
            &rows.at,
        )
        .execute(&mut *tx)
        .await?;
    }
    // The transitions, a statement for each kind: an attempt's `running` comes before its end
    // and nothing after its end (fenced above), and each was decided against the attempt as
    // the events before it left it. A `running` that comes with the end is written by the end.
    // Each statement that changes an attempt's status also sets its `last_seq`: one new version
    // of the row per attempt and batch, not two.
    let mut running: (Vec<Uuid>, Vec<chrono::DateTime<chrono::Utc>>) = (vec![], vec![]);
    let mut ends = Vec::new();
    for (i, change) in &changes {
        let attempt_id = items[*i].ev.as_ref().expect("checked item").0;
        match change {
            Change::Running { at } => {
                running.0.push(attempt_id);
                running.1.push(*at);
            }
            Change::Session(s) => {
                sqlx::query!(
                    "UPDATE attempts SET provider_session_id = $2 WHERE id = $1",
                    attempt_id,
                    s,
                )
                .execute(&mut *tx)
                .await?;
            }
            Change::Finish {
                a,
                status,
                class,
                detail,
                exit,
            } => {
                // Its `running`, if any, came before it and is taken over by the end.
                let started_at = running.0.iter().position(|id| *id == a.id).map(|k| {
                    running.0.swap_remove(k);
                    running.1.swap_remove(k)
                });
                ends.push(attempts::End {
                    a,
                    status: *status,
                    class: *class,
                    detail,
                    exit_code: *exit,
                    started_at,
                    last_seq: seq_of.remove(&a.id),
                });
            }
        }
    }
    if !running.0.is_empty() {
        let seqs: Vec<Option<i64>> = running.0.iter().map(|id| seq_of.remove(id)).collect();
        sqlx::query!(
            "UPDATE attempts a SET status = 'running', started_at = u.at,
                 last_seq = COALESCE(u.seq, a.last_seq)
             FROM UNNEST($1::uuid[], $2::timestamptz[], $3::int8[]) AS u(id, at, seq)
             WHERE a.id = u.id",
            &running.0,
            &running.1,
            &seqs as &[Option<i64>],
        )
        .execute(&mut *tx)
        .await?;
    }
    // The attempts whose status did not change in this batch.
    if !seq_of.is_empty() {
        let (ids, seqs): (Vec<Uuid>, Vec<i64>) = seq_of.into_iter().unzip();
        sqlx::query!(
            "UPDATE attempts a SET last_seq = u.seq FROM UNNEST($1::uuid[], $2::bigint[]) AS u(id, seq) WHERE a.id = u.id",
            &ids,
            &seqs,
        )
        .execute(&mut *tx)
        .await?;
    }
    if !ends.is_empty() {
        for pool in attempts::finish_many(&mut tx, &ends)
            .await?
            .into_iter()
            .flatten()
        {
            after.retry_pools.push(pool);
        }
    }
    tx.commit().await?;
    conn.release();
    Ok(after)
}

/// An event's row: its kind, its payload (made storable) and its time.
fn row_of(
    ev: &ExecutionEvent,
    body: &Body,
) -> (
    &'static str,
    serde_json::Value,
    chrono::DateTime<chrono::Utc>,
) {
    let (kind, mut payload) = to_record(body);
    // Free text from a provider may carry NUL, which PostgreSQL cannot store.
    crate::storable_json(&mut payload);
    let at = chrono::Utc
        .timestamp_millis_opt(ev.at_ms)
        .single()
        .unwrap_or_else(chrono::Utc::now);
    (kind, payload, at)
}

/// The usual case in one statement, its own transaction: `events` (checked, in seq order) are
/// all of one attempt, change nothing but its `last_seq` (no lifecycle transition, no provider
/// session), carry one lease token and host, and follow on from the attempt's `last_seq` while
/// it is claimed or running under that token and host. Then they are stored, `last_seq` moves to
/// the last of them, and the attempt's task is returned. Otherwise (a duplicate, a gap, a fenced
/// holder, an unknown or finished attempt, a transition) nothing is written and the answer is
/// None: the full path decides, under the attempt's lock, as it would have without this one.
/// The attempt's row is locked by the statement's UPDATE, which checks its conditions again on
/// the row's newest version when another transaction changed it meanwhile.
async fn record_plain(
    ctx: &Ctx,
    attempt_id: Uuid,
    events: &[&ExecutionEvent],
) -> Result<Option<Recorded>, Error> {
    let Some(first) = events.first() else {
        return Ok(None);
    };
    // The full path compares host ids as the attempt's spells them.
    let host = match Uuid::parse_str(&first.host_id) {
        Ok(h) if h.to_string() == first.host_id => h,
        _ => return Ok(None),
    };
    let plain = events.iter().enumerate().all(|(k, ev)| {
        ev.seq == first.seq + k as u64
            && ev.lease_token == first.lease_token
            && ev.host_id == first.host_id
            && matches!(&ev.body, Some(b) if !matches!(b, Body::Lifecycle(_) | Body::SessionStarted(_)))
    });
    if !plain {
        return Ok(None);
    }
    let mut rows = Rows::default();
    for ev in events {
        let (kind, payload, at) = row_of(ev, ev.body.as_ref().expect("checked body"));
        rows.push(attempt_id, ev.seq as i64, kind, payload, at);
    }
    // `last_seq` before the first of them, and after the last.
    let before = first.seq as i64 - 1;
    let stored = sqlx::query!(
        "WITH a AS (
             UPDATE attempts SET last_seq = $5
             WHERE id = $1 AND lease_token = $2 AND host_id = $3
               AND status IN ('claimed', 'running') AND last_seq = $4
             RETURNING task_id, number
         ), stored AS (
             INSERT INTO execution_events (attempt_id, seq, kind, payload, at)
             SELECT $1, u.seq, u.kind, u.payload, u.at
             FROM a, UNNEST($6::bigint[], $7::text[], $8::jsonb[], $9::timestamptz[])
                 AS u(seq, kind, payload, at)
         )
         SELECT task_id, number FROM a",
        attempt_id,
        first.lease_token as i64,
        host,
        before,
        before + events.len() as i64,
        &rows.seq,
        &rows.kind as &[&str],
        &rows.payload,
        &rows.at,
    )
    .fetch_optional(&ctx.recorder_db)
    .await?;
    let last = before + events.len() as i64;
    Ok(stored.map(|a| {
        notice(
            attempt_id,
            a.task_id,
            a.number,
            last,
            false,
            rows.of(attempt_id),
        )
    }))
}

/// The notice of an attempt's newly stored rows (`rows`, in seq order, the last at `seq`),
/// `ended` when the attempt's end was committed with them. A notice of an end carries no rows:
/// a live stream reads the end of its scope from the database in any case.
fn notice<'a>(
    attempt_id: Uuid,
    task_id: Uuid,
    number: i32,
    seq: i64,
    ended: bool,
    rows: impl Iterator<Item = RowRef<'a>> + Clone,
) -> Recorded {
    Recorded {
        attempt_id: attempt_id.to_string(),
        seq: seq as u64,
        task_id: task_id.to_string(),
        ended,
        number,
        events: if ended { vec![] } else { carried(rows) },
    }
}

/// The rows a notice carries: all of them, as stored, or none when they are too many or too
/// large (a gateway then reads them).
fn carried<'a>(rows: impl Iterator<Item = RowRef<'a>> + Clone) -> Vec<RecordedEvent> {
    // A busy attempt's batch: nothing to render.
    if rows.clone().count() > NOTICE_EVENTS {
        return vec![];
    }
    let mut out = Vec::new();
    let mut bytes = 0;
    for (seq, kind, payload, at) in rows {
        let payload = payload.to_string();
        bytes += payload.len();
        if bytes > NOTICE_BYTES {
            return vec![];
        }
        out.push(RecordedEvent {
            seq: seq as u64,
            kind: kind.to_string(),
            payload,
            at_us: at.timestamp_micros(),
        });
    }
    out
}

/// One row as [`Rows::of`] lists it: seq, kind, payload, time.
type RowRef<'a> = (
    i64,
    &'static str,
    &'a serde_json::Value,
    chrono::DateTime<chrono::Utc>,
);

/// Rows of `execution_events` as the columns of one multi-row INSERT.
#[derive(Default)]
struct Rows {
    attempt_id: Vec<Uuid>,
    seq: Vec<i64>,
    kind: Vec<&'static str>,
    payload: Vec<serde_json::Value>,
    at: Vec<chrono::DateTime<chrono::Utc>>,
}

impl Rows {
    fn push(
        &mut self,
        attempt_id: Uuid,
        seq: i64,
        kind: &'static str,
        payload: serde_json::Value,
        at: chrono::DateTime<chrono::Utc>,
    ) {
        self.attempt_id.push(attempt_id);
        self.seq.push(seq);
        self.kind.push(kind);
        self.payload.push(payload);
        self.at.push(at);
    }

    /// The rows of one attempt, in the order they were pushed.
    fn of(&self, attempt_id: Uuid) -> impl Iterator<Item = RowRef<'_>> + Clone {
        (0..self.seq.len())
            .filter(move |&i| self.attempt_id[i] == attempt_id)
            .map(|i| (self.seq[i], self.kind[i], &self.payload[i], self.at[i]))
    }
}

fn copy(a: &attempts::Active) -> attempts::Active {
    attempts::Active {
        id: a.id,
        task_id: a.task_id,
        number: a.number,
        status: a.status,
        lease_token: a.lease_token,
        host_id: a.host_id,
        pool_id: a.pool_id,
        last_seq: a.last_seq,
    }
}

enum Outcome {
    Stored,
    Duplicate,
    /// An earlier event of the attempt has not arrived yet.
    Gap,
}

/// The normalized record of an event: a kind and a JSON payload.
pub(crate) fn to_record(body: &Body) -> (&'static str, serde_json::Value) {
    match body {
        Body::Lifecycle(l) => (
            "lifecycle",
            json!({
                "state": AttemptState::try_from(l.state).unwrap_or_default().as_str_name()
                    .trim_start_matches("ATTEMPT_STATE_").to_lowercase(),
                "failure_class": (!l.failure_class.is_empty()).then_some(&l.failure_class),
                "remedy": (!l.failure_class.is_empty()).then(|| FailureClass::parse(&l.failure_class).remedy()),
                "detail": l.detail,
                "exit_code": l.has_exit_code.then_some(l.exit_code),
            }),
        ),
        Body::Output(o) => (
            "output",
            json!({"stream": o.stream, "text": o.text, "truncated": o.truncated}),
        ),
        Body::Diagnostic(d) => (
            "diagnostic",
            json!({"level": d.level, "code": d.code, "message": d.message}),
        ),
        Body::SessionStarted(s) => (
            "session_started",
            json!({"provider_session_id": s.provider_session_id, "model": s.model}),
        ),
        Body::AssistantMessage(m) => ("assistant_message", json!({"text": m.text})),
        Body::ToolCall(t) => (
            "tool_call",
            json!({"call_id": t.call_id, "name": t.name, "input": t.input_json}),
        ),
        Body::ToolResult(t) => (
            "tool_result",
            json!({"call_id": t.call_id, "output": t.output, "is_error": t.is_error}),
        ),
        Body::FileChange(f) => ("file_change", json!({"path": f.path, "change": f.change})),
        Body::Usage(u) => (
            "usage",
            json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "cost_usd": u.cost_usd}),
        ),
        Body::Error(e) => ("error", json!({"message": e.message, "code": e.code})),
        Body::Result(r) => (
            "result",
            json!({"is_error": r.is_error, "text": r.text, "turns": r.turns}),
        ),
        Body::Raw(r) => ("raw", json!({"provider": r.provider, "line": r.line})),
        Body::ApprovalRequested(a) => (
            "approval_requested",
            json!({"request_id": a.request_id, "tool_name": a.tool_name, "input": a.input_json, "timeout_ms": a.timeout_ms}),
        ),
        Body::ApprovalDecided(a) => (
            "approval_decided",
            json!({"request_id": a.request_id, "allow": a.allow, "reason": a.reason, "decided_by": a.decided_by, "failure_class": (!a.failure_class.is_empty()).then_some(&a.failure_class)}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{NOTICE_BYTES, NOTICE_EVENTS, Rows, carried};
    use uuid::Uuid;

    fn rows(n: usize, text: &str) -> Rows {
        let mut rows = Rows::default();
        let at = chrono::DateTime::from_timestamp_micros(1_700_000_000_123_000).unwrap();
        for k in 0..n {
            // Another attempt's row between each of this one's.
            rows.push(Uuid::from_u128(9), k as i64, "output", "x".into(), at);
            let payload = serde_json::json!({"text": text, "seq": k});
            rows.push(Uuid::from_u128(1), 10 + k as i64, "output", payload, at);
        }
        rows
    }

    /// A notice carries an attempt's rows as stored (its own only, in order), or none at all
    /// when they are too many or too large for it.
    #[test]
    fn a_notice_carries_all_of_an_attempts_rows_or_none() {
        let r = rows(3, "a \"q\" é");
        let got = carried(r.of(Uuid::from_u128(1)));
        let seqs: Vec<u64> = got.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![10, 11, 12]);
        assert_eq!(got[1].kind, "output");
        assert_eq!(got[1].payload, r#"{"seq":1,"text":"a \"q\" é"}"#);
        assert_eq!(got[1].at_us, 1_700_000_000_123_000);
        assert_eq!(
            carried(rows(NOTICE_EVENTS, "a").of(Uuid::from_u128(1))).len(),
            NOTICE_EVENTS
        );
        assert!(carried(rows(NOTICE_EVENTS + 1, "a").of(Uuid::from_u128(1))).is_empty());
        let big = "b".repeat(NOTICE_BYTES / 2);
        assert_eq!(carried(rows(1, &big).of(Uuid::from_u128(1))).len(), 1);
        assert!(carried(rows(2, &big).of(Uuid::from_u128(1))).is_empty());
    }
}
