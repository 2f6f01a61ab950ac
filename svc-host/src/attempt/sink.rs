//! The event sink: an attempt's events published in seq order under its fencing token, with the
//! journal's checkpoints.

use super::truncate::shrink;
use crate::Ctx;
use crate::isolation;
use crate::journal::Entry;
use agentscope_bus::subjects;
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::Message;
use agentscope_schemas::v1::{
    AttemptState, Diagnostic, ExecutionEvent, Lifecycle, execution_event::Body,
};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Publishes the events of one attempt with consecutive seq numbers and its fencing token.
///
/// `emit` hands the event to the attempt's publisher task, which keeps one message awaiting its
/// stream acknowledgement at a time: whatever events were handed over meanwhile go out together
/// as one `ExecutionEventBatch` when the acknowledgement comes (up to [`BATCH_EVENTS`] events,
/// [`BATCH_BYTES`]); an event handed over while nothing is in flight goes out alone, at once. An
/// informational diagnostic with nothing else ready waits up to `event_linger_ms` for the next
/// event and goes out with it (an attempt's `preparing` goes with its `running`: one message,
/// one transaction of the recorder, one notice fewer per attempt). A
/// failed publish is sent again under the same `Nats-Msg-Id` (the stream drops a copy it already
/// holds) before anything later, so the stream never holds an event without every earlier one.
/// The journal's `last_seq` is the highest seq acknowledged, checkpointed at most every
/// [`CHECKPOINT_EVERY`] and whenever the sink is flushed; a restarted host takes the stream's
/// newest event of the attempt when that is further (`recover`).
pub struct EventSink {
    ctx: Ctx,
    /// `last_seq` here is the newest seq handed to the publisher.
    pub(super) entry: Entry,
    lease_lost: CancellationToken,
    /// Replaced by `[REDACTED:NAME]` in every event (the task credential, the host's keys).
    pub(super) secrets: isolation::Secrets,
    out: tokio::sync::mpsc::Sender<Out>,
    /// A save handed to the publisher and not awaited yet (see [`EventSink::set_state_soon`]).
    saving: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// Events handed to the publisher and not yet acknowledged, at most: the channel's capacity
/// (emit waits while it is full) besides the message in flight.
pub(crate) const WINDOW: usize = 512;
/// Events in one message at most.
const BATCH_EVENTS: usize = 256;
/// Bytes of events in one batch at most (a larger event goes alone).
const BATCH_BYTES: usize = 64 << 10;
/// How often the journal's `last_seq` is written while events flow.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(20);

enum Out {
    Event {
        seq: u64,
        payload: bytes::Bytes,
        /// May wait up to `event_linger_ms` for the next event.
        linger: bool,
    },
    /// A new journal entry (its `last_seq` is replaced by the acknowledged one), written at once.
    Save {
        entry: Entry,
        durable: bool,
        done: tokio::sync::oneshot::Sender<()>,
    },
    /// Answered once every event handed over before it is acknowledged and checkpointed.
    Flush(tokio::sync::oneshot::Sender<()>),
}

impl EventSink {
    pub fn new(
        ctx: Ctx,
        entry: Entry,
        lease_lost: CancellationToken,
        secrets: isolation::Secrets,
    ) -> Self {
        let subject = subjects::events(&ctx.host_id.to_string(), &entry.attempt_id);
        let (out, rx) = tokio::sync::mpsc::channel(WINDOW);
        tokio::spawn(
            publisher(ctx.clone(), subject, entry.clone(), lease_lost.clone(), rx)
                .in_current_span(),
        );
        Self {
            ctx,
            entry,
            lease_lost,
            secrets,
            out,
            saving: None,
        }
    }

    /// Hands the event to the publisher (waiting while its window is full). Returns false when
    /// the event cannot be delivered: the lease is lost.
    pub async fn emit(&mut self, body: Body) -> bool {
        self.emit_with(body, false).await
    }

    async fn emit_with(&mut self, mut body: Body, linger: bool) -> bool {
        if self.lease_lost.is_cancelled() {
            return false;
        }
        isolation::redact_body(&mut body, &self.secrets);
        let session = match &body {
            Body::SessionStarted(s) => Some(s.provider_session_id.clone()),
            _ => None,
        };
        let seq = self.entry.last_seq + 1;
        let ev = ExecutionEvent {
            attempt_id: self.entry.attempt_id.clone(),
            seq,
            lease_token: self.entry.lease_token,
            host_id: self.ctx.host_id.to_string(),
            at_ms: agentscope_bus::now_ms(),
            body: Some(body),
        };
        let mut payload = ev.encode_to_vec();
        if payload.len() > agentscope_bus::MAX_MESSAGE_BYTES {
            // Keep the head of whatever text made the event too large for the bus.
            let mut ev = ev;
            if let Some(body) = ev.body.as_mut() {
                shrink(body, agentscope_bus::MAX_MESSAGE_BYTES / 4);
                // A cut may end inside a secret.
                isolation::redact_body(body, &self.secrets);
            }
            payload = ev.encode_to_vec();
        }
        if self
            .out
            .send(Out::Event {
                seq,
                payload: payload.into(),
                linger,
            })
            .await
            .is_err()
        {
            return false;
        }
        self.entry.last_seq = seq;
        if let Some(id) = session {
            // Kept in the journal for recovery (resume needs it).
            self.entry.provider_session_id = id;
            self.save(false).await;
        }
        true
    }

    /// Waits until every event emitted so far is acknowledged by the stream and checkpointed.
    /// Returns false when that cannot happen any more (the lease is lost).
    pub async fn flush(&mut self) -> bool {
        let (done, wait) = tokio::sync::oneshot::channel();
        self.out.send(Out::Flush(done)).await.is_ok() && wait.await.is_ok()
    }

    pub async fn set_state(&mut self, state: AttemptStatus) {
        self.entry.state = state;
        self.save(true).await;
    }

    /// [`Self::set_state`], written by the publisher while the caller goes on; [`Self::saved`]
    /// waits for it (before anything that needs the entry on disk, such as the provider's start).
    pub async fn set_state_soon(&mut self, state: AttemptStatus) {
        self.entry.state = state;
        self.saving = self.begin_save(true).await;
    }

    /// Returns once the save begun by [`Self::set_state_soon`] (if any) is written.
    pub async fn saved(&mut self) {
        if let Some(wait) = self.saving.take() {
            let _ = wait.await;
        }
    }

    async fn save(&mut self, durable: bool) {
        self.saved().await;
        if let Some(wait) = self.begin_save(durable).await {
            let _ = wait.await;
        }
    }

    /// Hands the entry to the publisher; None if the publisher is gone.
    async fn begin_save(&mut self, durable: bool) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let (done, wait) = tokio::sync::oneshot::channel();
        let entry = self.entry.clone();
        self.out
            .send(Out::Save {
                entry,
                durable,
                done,
            })
            .await
            .ok()
            .map(|()| wait)
    }

    /// A diagnostic; an `info` one may wait a moment for the next event (see [`EventSink`]).
    pub async fn diag(&mut self, level: &str, code: &str, message: impl Into<String>) -> bool {
        let linger = level == "info";
        self.emit_with(
            Body::Diagnostic(Diagnostic {
                level: level.into(),
                code: code.into(),
                message: message.into(),
            }),
            linger,
        )
        .await
    }

    pub async fn lifecycle(
        &mut self,
        state: AttemptStatus,
        class: Option<FailureClass>,
        detail: impl Into<String>,
        exit_code: Option<i32>,
    ) -> bool {
        self.emit(Body::Lifecycle(Lifecycle {
            state: wire_state(state) as i32,
            failure_class: class.map(|c| c.as_str().to_string()).unwrap_or_default(),
            detail: detail.into(),
            exit_code: exit_code.unwrap_or(0),
            has_exit_code: exit_code.is_some(),
        }))
        .await
    }
}

/// An attempt's state as the bus says it (`Lifecycle.state`). The host reports only its own
/// moves: claimed (preparing), running, and the ends; the scheduler decides `queued` and `lost`.
pub fn wire_state(state: AttemptStatus) -> AttemptState {
    match state {
        AttemptStatus::Claimed => AttemptState::Preparing,
        AttemptStatus::Running => AttemptState::Running,
        AttemptStatus::Succeeded => AttemptState::Succeeded,
        AttemptStatus::Failed => AttemptState::Failed,
        AttemptStatus::Cancelled => AttemptState::Cancelled,
        AttemptStatus::Queued | AttemptStatus::Lost => AttemptState::Unspecified,
    }
}

/// The message awaiting its acknowledgement: one event, or a batch of consecutive ones.
struct InFlight {
    /// Its newest seq.
    seq: u64,
    msg_id: String,
    payload: bytes::Bytes,
    ack: InFlightAck,
}

/// The publisher's state besides the message in flight.
struct Publisher {
    ctx: Ctx,
    entry: Entry,
    /// Events handed over and not yet published, in seq order.
    ready: std::collections::VecDeque<(u64, bytes::Bytes)>,
    /// Until when `ready` may wait for more: set while it holds only events that may linger.
    linger_until: Option<tokio::time::Instant>,
    acked: u64,
    saved: u64,
    saved_at: tokio::time::Instant,
    flushes: Vec<tokio::sync::oneshot::Sender<()>>,
    /// The sink still hands over work.
    open: bool,
}

impl Publisher {
    fn take(&mut self, cmd: Option<Out>) {
        match cmd {
            None => self.open = false,
            Some(Out::Event {
                seq,
                payload,
                linger,
            }) => {
                let wait = Duration::from_millis(self.ctx.config.event_linger_ms);
                if !linger || wait.is_zero() {
                    self.linger_until = None;
                } else if self.ready.is_empty() {
                    self.linger_until = Some(tokio::time::Instant::now() + wait);
                }
                self.ready.push_back((seq, payload));
            }
            Some(Out::Save {
                entry,
                durable,
                done,
            }) => {
                self.entry = entry;
                self.checkpoint(durable);
                let _ = done.send(());
            }
            Some(Out::Flush(done)) => self.flushes.push(done),
        }
    }

    /// Whether what is ready waits for more: only events that may linger, their time not up,
    /// nobody waiting for a flush and the sink still open.
    fn lingers(&self) -> bool {
        self.open
            && self.flushes.is_empty()
            && self
                .linger_until
                .is_some_and(|t| tokio::time::Instant::now() < t)
    }

    fn checkpoint(&mut self, durable: bool) {
        self.entry.last_seq = self.acked;
        self.entry.saved_at_ms = agentscope_bus::now_ms();
        if let Err(e) = self.ctx.journal.save(&self.entry, durable) {
            tracing::error!(error = ?e, "write journal checkpoint");
        }
        self.saved = self.acked;
        self.saved_at = tokio::time::Instant::now();
    }
}

/// The attempt's publisher: owns the message in flight and the journal entry's writes.
async fn publisher(
    ctx: Ctx,
    subject: String,
    entry: Entry,
    lease_lost: CancellationToken,
    mut rx: tokio::sync::mpsc::Receiver<Out>,
) {
    let mut in_flight: Option<InFlight> = None;
    let mut p = Publisher {
        ctx,
        acked: entry.last_seq,
        saved: entry.last_seq,
        entry,
        ready: Default::default(),
        linger_until: None,
        saved_at: tokio::time::Instant::now(),
        flushes: Vec::new(),
        open: true,
    };
    loop {
        if in_flight.is_none() {
            // Everything handed over by now goes into the next message.
            while p.open && p.ready.len() < WINDOW {
                match rx.try_recv() {
                    Ok(cmd) => p.take(Some(cmd)),
                    Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => p.take(None),
                }
            }
            if !p.ready.is_empty() && !p.lingers() {
                p.linger_until = None;
                let (msg_id, payload, seq) = next_message(&p.entry.attempt_id, &mut p.ready);
                in_flight = Some(publish(&p.ctx, &subject, msg_id, payload, seq).await);
            }
        }
        let next_checkpoint = p.saved_at + CHECKPOINT_EVERY;
        tokio::select! {
            biased;
            _ = lease_lost.cancelled() => return,
            r = async { in_flight.as_mut().expect("in flight").ack.as_mut().await }, if in_flight.is_some() => {
                let f = in_flight.take().expect("in flight");
                if let Err(e) = r {
                    tracing::warn!(error = %e, seq = f.seq, "publish event; retrying");
                    if !resend(&p.ctx, &subject, &f.msg_id, &f.payload, &lease_lost).await {
                        return;
                    }
                }
                p.acked = f.seq;
            },
            cmd = rx.recv(), if p.open && p.ready.len() < WINDOW => p.take(cmd),
            _ = tokio::time::sleep_until(next_checkpoint), if p.acked > p.saved => {}
            // The next turn publishes what lingered.
            _ = tokio::time::sleep_until(p.linger_until.unwrap_or(next_checkpoint)), if in_flight.is_none() && p.linger_until.is_some() => {
                p.linger_until = None;
            }
        }
        let idle = in_flight.is_none() && p.ready.is_empty();
        // At most every CHECKPOINT_EVERY (the timer above catches up), and before a flush is
        // answered: not after every acknowledgement of a slow stream of events.
        if p.acked > p.saved
            && (p.saved_at.elapsed() >= CHECKPOINT_EVERY
                || (idle && (!p.flushes.is_empty() || !p.open)))
        {
            p.checkpoint(false);
        }
        if idle {
            for f in p.flushes.drain(..) {
                let _ = f.send(());
            }
            if !p.open {
                return;
            }
        }
    }
}

/// The next message of `ready`: its first event alone, or as many as fit in one batch. Returns
/// its `Nats-Msg-Id`, payload and newest seq.
fn next_message(
    attempt_id: &str,
    ready: &mut std::collections::VecDeque<(u64, bytes::Bytes)>,
) -> (String, bytes::Bytes, u64) {
    let mut n = 0;
    let mut size = 0;
    for (_, p) in ready.iter() {
        // A tag and a length before each event.
        let framed = p.len() + 8;
        if n == BATCH_EVENTS || (n > 0 && size + framed > BATCH_BYTES) {
            break;
        }
        n += 1;
        size += framed;
    }
    let first = ready.front().expect("an event is ready").0;
    if n == 1 {
        let (seq, payload) = ready.pop_front().expect("an event is ready");
        return (format!("{attempt_id}:{seq}"), payload, seq);
    }
    let events: Vec<(u64, bytes::Bytes)> = ready.drain(..n).collect();
    let last = events.last().expect("a batch").0;
    let payload = agentscope_schemas::encode_batch(events.iter().map(|(_, p)| p.as_ref()));
    (format!("{attempt_id}:{first}-{last}"), payload.into(), last)
}

async fn publish(
    ctx: &Ctx,
    subject: &str,
    msg_id: String,
    payload: bytes::Bytes,
    seq: u64,
) -> InFlight {
    let sent = ctx
        .js
        .publish_with_headers(
            subject.to_string(),
            agentscope_bus::headers(&msg_id),
            payload.clone(),
        )
        .await;
    let ack: InFlightAck = match sent {
        Ok(f) => std::future::IntoFuture::into_future(f),
        // Not even handed to the connection: settled by sending it again.
        Err(e) => Box::pin(std::future::ready(Err(e))),
    };
    InFlight {
        seq,
        msg_id,
        payload,
        ack,
    }
}

type InFlightAck = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<
                    async_nats::jetstream::publish::PublishAck,
                    async_nats::jetstream::context::PublishError,
                >,
            > + Send,
    >,
>;

/// Publishes a message again until the stream acknowledges it, while the lease holds. Returns
/// false when the lease is lost.
async fn resend(
    ctx: &Ctx,
    subject: &str,
    msg_id: &str,
    payload: &bytes::Bytes,
    lease_lost: &CancellationToken,
) -> bool {
    let mut delay = Duration::from_millis(50);
    loop {
        if lease_lost.is_cancelled() {
            return false;
        }
        let res = async {
            ctx.js
                .publish_with_headers(
                    subject.to_string(),
                    agentscope_bus::headers(msg_id),
                    payload.clone(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        match res {
            Ok(_) => return true,
            Err(e) => {
                tracing::warn!(error = %e, msg_id, "publish event; retrying");
                tokio::select! {
                    _ = lease_lost.cancelled() => return false,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    fn ready(sizes: &[usize]) -> VecDeque<(u64, bytes::Bytes)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let ev = ExecutionEvent {
                    attempt_id: "a".into(),
                    seq: i as u64 + 1,
                    body: Some(Body::Diagnostic(Diagnostic {
                        message: "x".repeat(*n),
                        ..Default::default()
                    })),
                    ..Default::default()
                };
                (ev.seq, bytes::Bytes::from(ev.encode_to_vec()))
            })
            .collect()
    }

    #[test]
    fn one_ready_event_goes_alone_under_its_own_id() {
        let mut r = ready(&[10]);
        let alone = r[0].1.clone();
        let (id, payload, seq) = next_message("a", &mut r);
        assert_eq!((id.as_str(), &payload, seq), ("a:1", &alone, 1));
        assert!(r.is_empty());
    }

    #[test]
    fn ready_events_go_together_up_to_the_batch_bounds() {
        let mut r = ready(&[100; BATCH_EVENTS + 5]);
        let (id, payload, seq) = next_message("a", &mut r);
        assert_eq!(
            (id.as_str(), seq),
            (format!("a:1-{BATCH_EVENTS}").as_str(), BATCH_EVENTS as u64)
        );
        let events = agentscope_schemas::decode_events(&payload).unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=BATCH_EVENTS as u64).collect::<Vec<_>>());
        assert_eq!(r.len(), 5);
        assert_eq!(r.front().unwrap().0, BATCH_EVENTS as u64 + 1);

        // Bytes bound: a large event is not added to a batch; it goes alone next.
        let mut r = ready(&[1000, 1000, BATCH_BYTES, 10]);
        assert_eq!(next_message("a", &mut r).0, "a:1-2");
        assert_eq!(next_message("a", &mut r).0, "a:3");
        assert_eq!(next_message("a", &mut r).0, "a:4");
        assert!(r.is_empty());
    }
}
