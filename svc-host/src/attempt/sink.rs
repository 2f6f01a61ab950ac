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
/// Pipelined: `emit` hands the event to the attempt's publisher task, which keeps up to
/// [`WINDOW`] publishes awaiting their stream acknowledgement, in seq order. A failed publish is
/// sent again, with every later one of the window, in order and under the same `Nats-Msg-Id`
/// (the stream drops the copies it already holds). The journal's `last_seq` is the highest seq
/// acknowledged with every earlier one, checkpointed at most every [`CHECKPOINT_EVERY`] and
/// whenever the sink is flushed; a restarted host takes the stream's newest event of the attempt
/// when that is further (`recover`), as before.
pub struct EventSink {
    ctx: Ctx,
    /// `last_seq` here is the newest seq handed to the publisher.
    pub(super) entry: Entry,
    lease_lost: CancellationToken,
    /// Replaced by `[REDACTED:NAME]` in every event (the task credential, the host's keys).
    pub(super) secrets: isolation::Secrets,
    out: tokio::sync::mpsc::Sender<Out>,
}

/// Publishes awaiting their acknowledgement at most, per attempt.
pub(crate) const WINDOW: usize = 512;
/// Bytes of payload awaiting acknowledgement at most, per attempt.
const WINDOW_BYTES: usize = 8 << 20;
/// How often the journal's `last_seq` is written while events flow.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(20);

enum Out {
    Event {
        seq: u64,
        payload: bytes::Bytes,
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
        }
    }

    /// Hands the event to the publisher (waiting while its window is full). Returns false when
    /// the event cannot be delivered: the lease is lost.
    pub async fn emit(&mut self, mut body: Body) -> bool {
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

    async fn save(&mut self, durable: bool) {
        let (done, wait) = tokio::sync::oneshot::channel();
        let entry = self.entry.clone();
        if self
            .out
            .send(Out::Save {
                entry,
                durable,
                done,
            })
            .await
            .is_ok()
        {
            let _ = wait.await;
        }
    }

    pub async fn diag(&mut self, level: &str, code: &str, message: impl Into<String>) -> bool {
        self.emit(Body::Diagnostic(Diagnostic {
            level: level.into(),
            code: code.into(),
            message: message.into(),
        }))
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

/// A publish awaiting its acknowledgement.
struct InFlight {
    seq: u64,
    payload: bytes::Bytes,
    ack: InFlightAck,
}

/// The attempt's publisher: owns the in-flight window and the journal entry's writes.
async fn publisher(
    ctx: Ctx,
    subject: String,
    mut entry: Entry,
    lease_lost: CancellationToken,
    mut rx: tokio::sync::mpsc::Receiver<Out>,
) {
    use std::collections::VecDeque;
    let mut window: VecDeque<InFlight> = VecDeque::new();
    let mut bytes = 0usize;
    let mut acked = entry.last_seq;
    let mut saved = acked;
    let mut saved_at = tokio::time::Instant::now();
    let mut flushes: Vec<tokio::sync::oneshot::Sender<()>> = Vec::new();
    let mut open = true;
    let write = |entry: &mut Entry, acked: u64, durable: bool| {
        entry.last_seq = acked;
        entry.saved_at_ms = agentscope_bus::now_ms();
        if let Err(e) = ctx.journal.save(entry, durable) {
            tracing::error!(error = ?e, "write journal checkpoint");
        }
    };
    loop {
        let room = window.len() < WINDOW && bytes < WINDOW_BYTES;
        let next_checkpoint = saved_at + CHECKPOINT_EVERY;
        tokio::select! {
            biased;
            _ = lease_lost.cancelled() => return,
            r = async { window.front_mut().expect("in flight").ack.as_mut().await }, if !window.is_empty() => match r {
                Ok(_) => {
                    let f = window.pop_front().expect("in flight");
                    bytes -= f.payload.len();
                    acked = f.seq;
                }
                Err(e) => {
                    tracing::warn!(error = %e, seq = window.front().map(|f| f.seq), "publish event; retrying (with the later ones in flight)");
                    let pending: Vec<(u64, bytes::Bytes)> =
                        window.drain(..).map(|f| (f.seq, f.payload)).collect();
                    bytes = 0;
                    if !resend(&ctx, &subject, &entry.attempt_id, &pending, &lease_lost).await {
                        return;
                    }
                    acked = pending.last().map(|f| f.0).unwrap_or(acked);
                }
            },
            cmd = rx.recv(), if open && room => match cmd {
                None => open = false,
                Some(Out::Event { seq, payload }) => {
                    let msg_id = format!("{}:{seq}", entry.attempt_id);
                    let sent = ctx
                        .js
                        .publish_with_headers(subject.clone(), agentscope_bus::headers(&msg_id), payload.clone())
                        .await;
                    let ack: InFlightAck = match sent {
                        Ok(f) => std::future::IntoFuture::into_future(f),
                        // Not even handed to the connection: settled by sending it again.
                        Err(e) => Box::pin(std::future::ready(Err(e))),
                    };
                    bytes += payload.len();
                    window.push_back(InFlight { seq, payload, ack });
                }
                Some(Out::Save { entry: e, durable, done }) => {
                    entry = e;
                    write(&mut entry, acked, durable);
                    saved = acked;
                    saved_at = tokio::time::Instant::now();
                    let _ = done.send(());
                }
                Some(Out::Flush(done)) => flushes.push(done),
            },
            _ = tokio::time::sleep_until(next_checkpoint), if acked > saved => {}
        }
        if acked > saved && (window.is_empty() || saved_at.elapsed() >= CHECKPOINT_EVERY) {
            write(&mut entry, acked, false);
            saved = acked;
            saved_at = tokio::time::Instant::now();
        }
        if window.is_empty() {
            for f in flushes.drain(..) {
                let _ = f.send(());
            }
            if !open {
                return;
            }
        }
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

/// Publishes the window's events again, in order, each until the stream acknowledges it, while
/// the lease holds. Returns false when the lease is lost.
async fn resend(
    ctx: &Ctx,
    subject: &str,
    attempt_id: &str,
    pending: &[(u64, bytes::Bytes)],
    lease_lost: &CancellationToken,
) -> bool {
    let mut delay = Duration::from_millis(50);
    for (seq, payload) in pending {
        let msg_id = format!("{attempt_id}:{seq}");
        loop {
            if lease_lost.is_cancelled() {
                return false;
            }
            let res = async {
                ctx.js
                    .publish_with_headers(
                        subject.to_string(),
                        agentscope_bus::headers(&msg_id),
                        payload.clone(),
                    )
                    .await?
                    .await
                    .map_err(async_nats::Error::from)
            }
            .await;
            match res {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, seq, "publish event; retrying");
                    tokio::select! {
                        _ = lease_lost.cancelled() => return false,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
    true
}
