//! One Attempt on this host: keep the lease, prepare the task directory, run the provider, report
//! every event in order, and stop at once when the lease is lost.

use crate::Ctx;
use crate::isolation;
use crate::journal::Entry;
use crate::process;
use crate::provider::{self, RunAs, TaskDir};
use agentscope_bus::subjects;
use agentscope_domain::FailureClass;
use agentscope_schemas::Message;
use agentscope_schemas::v1::{
    ApprovalDecision, AttemptAssignment, AttemptState, Diagnostic, ExecutionEvent, LeaseRecord,
    Lifecycle, execution_event::Body,
};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::BufReader;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Why a running Attempt must stop before its provider finishes.
#[derive(Clone)]
pub struct Stops {
    /// The platform asked to cancel.
    pub cancel: CancellationToken,
    /// The lease is gone: nothing more may be reported.
    pub lease_lost: CancellationToken,
    /// The host is shutting down: stop, and let the scheduler retry elsewhere.
    pub shutdown: CancellationToken,
}

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
    entry: Entry,
    lease_lost: CancellationToken,
    /// Replaced by `[REDACTED:NAME]` in every event (the task credential, the host's keys).
    secrets: isolation::Secrets,
    out: tokio::sync::mpsc::Sender<Out>,
}

/// Publishes awaiting their acknowledgement at most, per attempt.
const WINDOW: usize = 512;
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

    pub async fn set_state(&mut self, state: &str) {
        self.entry.state = state.into();
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
        state: AttemptState,
        class: Option<FailureClass>,
        detail: impl Into<String>,
        exit_code: Option<i32>,
    ) -> bool {
        self.emit(Body::Lifecycle(Lifecycle {
            state: state as i32,
            failure_class: class.map(|c| c.as_str().to_string()).unwrap_or_default(),
            detail: detail.into(),
            exit_code: exit_code.unwrap_or(0),
            has_exit_code: exit_code.is_some(),
        }))
        .await
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

/// Publishes a provider's tool request for a decision and records it as an event.
async fn request_approval(
    ctx: &Ctx,
    a: &AttemptAssignment,
    sink: &mut EventSink,
    req: &provider::ControlRequest,
    key: &str,
    timeout_ms: u32,
) {
    let input_json = isolation::redact_text(&req.input.to_string(), &sink.secrets);
    sink.emit(Body::ApprovalRequested(
        agentscope_schemas::v1::ApprovalRequested {
            request_id: key.to_string(),
            tool_name: req.tool_name.clone(),
            input_json: input_json.clone(),
            timeout_ms,
        },
    ))
    .await;
    // The request's event is in the stream before the request itself.
    sink.flush().await;
    let tr = agentscope_schemas::v1::ToolRequest {
        request_id: key.to_string(),
        attempt_id: a.attempt_id.clone(),
        session_id: String::new(),
        tool_name: req.tool_name.clone(),
        input_json,
        lease_token: a.lease_token,
        requested_at_ms: agentscope_bus::now_ms(),
        timeout_ms,
    };
    let msg_id = format!("approval:{}:{key}", a.attempt_id);
    let mut delay = Duration::from_millis(100);
    for _ in 0..20 {
        let sent = async {
            ctx.js
                .publish_with_headers(
                    subjects::approval_requested(&ctx.host_id.to_string(), &a.attempt_id),
                    agentscope_bus::headers(&msg_id),
                    tr.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        match sent {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "publish tool request; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Writes protocol lines to the provider's stdin (when it is still open).
async fn write_lines(stdin: &mut Option<tokio::process::ChildStdin>, lines: Vec<String>) {
    use tokio::io::AsyncWriteExt;
    let Some(pipe) = stdin.as_mut() else { return };
    for l in lines {
        let _ = pipe.write_all(l.as_bytes()).await;
    }
    let _ = pipe.flush().await;
}

/// Tells the provider the decision and records it.
#[allow(clippy::too_many_arguments)]
async fn answer(
    stdin: &mut Option<tokio::process::ChildStdin>,
    adapter: &dyn provider::Adapter,
    sink: &mut EventSink,
    req: &provider::ControlRequest,
    key: &str,
    allow: bool,
    reason: &str,
    decided_by: &str,
    class: &str,
) {
    use tokio::io::AsyncWriteExt;
    if let Some(pipe) = stdin.as_mut() {
        let text = adapter.control_response(req, allow, reason);
        let _ = pipe.write_all(text.as_bytes()).await;
        let _ = pipe.flush().await;
    }
    sink.emit(Body::ApprovalDecided(
        agentscope_schemas::v1::ApprovalDecided {
            request_id: key.to_string(),
            allow,
            reason: reason.to_string(),
            decided_by: decided_by.to_string(),
            failure_class: class.to_string(),
        },
    ))
    .await;
}

/// Cuts every text field of `body` to at most `max` bytes (on a char boundary).
pub fn shrink(body: &mut Body, max: usize) {
    fn cut(s: &mut String, max: usize) -> bool {
        if s.len() <= max {
            return false;
        }
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        true
    }
    match body {
        Body::Output(o) => o.truncated |= cut(&mut o.text, max),
        Body::Raw(r) => {
            cut(&mut r.line, max);
        }
        Body::AssistantMessage(m) => {
            cut(&mut m.text, max);
        }
        Body::ToolCall(t) => {
            cut(&mut t.input_json, max);
        }
        Body::ToolResult(t) => {
            cut(&mut t.output, max);
        }
        Body::Result(r) => {
            cut(&mut r.text, max);
        }
        Body::Error(e) => {
            cut(&mut e.message, max);
        }
        Body::Diagnostic(d) => {
            cut(&mut d.message, max);
        }
        Body::Lifecycle(l) => {
            cut(&mut l.detail, max);
        }
        Body::FileChange(f) => {
            cut(&mut f.path, max);
        }
        Body::ApprovalRequested(r) => {
            cut(&mut r.input_json, max);
        }
        Body::ApprovalDecided(d) => {
            cut(&mut d.reason, max);
        }
        Body::SessionStarted(_) | Body::Usage(_) => {}
    }
}

/// Keeps the lease alive (`agentscope_bus::lease`): a renewal applied while its reply was lost
/// is still ours, and a lease that cannot be renewed is given up before its TTL ends, so the
/// provider stops before any other host may start the same work. Fires `lost` when it ends.
pub async fn keep_lease(
    ctx: Ctx,
    a: AttemptAssignment,
    lost: CancellationToken,
    done: CancellationToken,
) {
    let ttl = Duration::from_millis(ctx.lease_ttl_ms());
    // The value never changes while the lease is held: equal value means "still ours".
    let record = LeaseRecord {
        attempt_id: a.attempt_id.clone(),
        host_id: ctx.host_id.to_string(),
        token: a.lease_token,
        acquired_at_ms: 0,
        renewed_at_ms: 0,
    };
    let lease = agentscope_bus::lease::Lease::held(
        &ctx.leases,
        &a.lease_key,
        record.encode_to_vec().into(),
        a.lease_revision,
        ttl,
    );
    if let Some(why) = lease.keep(done).await {
        tracing::warn!(attempt_id = %a.attempt_id, reason = %why, "lease lost; stopping the provider");
        lost.cancel();
    }
}

/// Runs one assignment to its end. The caller holds the capacity slot until this returns.
pub async fn run(
    ctx: Ctx,
    a: AttemptAssignment,
    stops: Stops,
    mut decisions: tokio::sync::mpsc::Receiver<ApprovalDecision>,
    resume: Option<Entry>,
) {
    let span = tracing::info_span!("attempt", workspace_id = %a.workspace_id, task_id = %a.task_id, attempt_id = %a.attempt_id, host_id = %ctx.host_id);
    agentscope_bus::set_parent(
        &span,
        Some(a.traceparent.as_str()).filter(|s| !s.is_empty()),
    );
    async move {
        let resuming = resume.as_ref().map(|e| e.provider_session_id.clone());
        let entry = resume.unwrap_or_else(|| Entry {
            attempt_id: a.attempt_id.clone(),
            task_id: a.task_id.clone(),
            lease_key: a.lease_key.clone(),
            lease_token: a.lease_token,
            last_seq: 0,
            state: "claimed".into(),
            provider_session_id: String::new(),
            provider: a
                .spec
                .as_ref()
                .map(|s| s.provider.clone())
                .unwrap_or_default(),
            assignment_hex: hex::encode(a.encode_to_vec()),
            saved_at_ms: agentscope_bus::now_ms(),
        });
        let mut sink = EventSink::new(
            ctx.clone(),
            entry,
            stops.lease_lost.clone(),
            isolation::secrets_of_attempt(&a.task_token),
        );
        if resuming.is_none() {
            sink.set_state("claimed").await;
        }
        let renew_done = CancellationToken::new();
        let renewer = tokio::spawn(keep_lease(
            ctx.clone(),
            a.clone(),
            stops.lease_lost.clone(),
            renew_done.clone(),
        ));

        // The attempt's own uid, held until its last process is gone.
        let lease = match ctx.identities.clone() {
            None => Ok(None),
            Some(ids) => tokio::task::spawn_blocking(move || ids.acquire().map(Some))
                .await
                .unwrap_or_else(|e| {
                    Err(isolation::Error::Io {
                        action: "acquire a uid",
                        path: Default::default(),
                        source: std::io::Error::other(e),
                    })
                }),
        };
        // Whether the provider's whole tree is known to be gone (its sentinel ended by itself).
        let mut gone = false;
        let outcome = match &lease {
            Ok(l) => {
                execute(
                    &ctx,
                    &a,
                    &mut sink,
                    &stops,
                    &mut decisions,
                    resuming.as_deref(),
                    false,
                    l.as_ref().map(|l| l.who),
                    &mut gone,
                )
                .await
            }
            Err(e) => failed(FailureClass::Internal, format!("{e}")),
        };
        if let (Ok(Some(lease)), Some(ids)) = (lease, ctx.identities.clone()) {
            let uid = lease.who.uid;
            let root = ctx.tasks_dir.join(&a.attempt_id);
            let release = move || {
                // Unless the sentinel saw the whole tree end, whatever escaped it dies with the
                // uid (a /proc scan). Then the directory goes back to the host: its root (0700)
                // is enough to keep the uid's next holder out of everything below it.
                let left = ids.release(lease, gone);
                if let Err(e) = isolation::take_back(&root)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::error!(error = %e, "take the task directory back");
                }
                left
            };
            let left = if gone {
                release()
            } else {
                tokio::task::spawn_blocking(release)
                    .await
                    .unwrap_or_default()
            };
            if left.killed > 0 || !left.survivors.is_empty() {
                tracing::warn!(
                    uid,
                    killed = left.killed,
                    survivors = left.survivors.len(),
                    "processes of the attempt outlived its provider and were killed"
                )
            }
        }
        if let (Some(FailureClass::ProviderLogin), Some(spec)) = (outcome.1, a.spec.as_ref()) {
            // Before the failure is reported (and the task moves on): the next claim must not
            // bring this provider's work here again.
            ctx.provider_login_failed(&spec.provider, &outcome.2);
        }
        if !stops.lease_lost.is_cancelled() {
            let (state, class, detail, exit) = outcome;
            sink.lifecycle(state, class, detail, exit).await;
            // Every event is in the stream before the lease and the journal entry go.
            sink.flush().await;
        }
        renew_done.cancel();
        let _ = renewer.await;
        if let Err(e) = ctx.journal.remove(&a.attempt_id) {
            tracing::error!(error = ?e, "remove journal entry");
        }
        tracing::info!("attempt done on this host");
    }
    .instrument(span)
    .await
}

type Outcome = (AttemptState, Option<FailureClass>, String, Option<i32>);

fn failed(class: FailureClass, detail: impl Into<String>) -> Outcome {
    (AttemptState::Failed, Some(class), detail.into(), None)
}

#[allow(clippy::too_many_arguments)]
async fn execute(
    ctx: &Ctx,
    a: &AttemptAssignment,
    sink: &mut EventSink,
    stops: &Stops,
    decisions: &mut tokio::sync::mpsc::Receiver<ApprovalDecision>,
    resume: Option<&str>,
    fresh_only: bool,
    who: Option<RunAs>,
    gone: &mut bool,
) -> Outcome {
    // Nothing of this launch runs until its sentinel does.
    *gone = true;
    let spec = a.spec.clone().unwrap_or_default();
    let Some(adapter) = ctx.adapter(&spec.provider) else {
        return failed(
            FailureClass::ProviderLogin,
            format!("provider `{}` is not available on this host", spec.provider),
        );
    };
    let dir = if let Some(session) = resume {
        sink.diag(
            "info",
            "resuming",
            format!(
                "the host restarted; resuming provider session {session} in the same task directory"
            ),
        )
        .await;
        existing_task_dir(ctx, a)
    } else {
        sink.diag("info", "preparing", "preparing task directory")
            .await;
        match prepare(ctx, a, sink, &stops.cancel).await {
            Ok(d) => d,
            Err(_) if stops.cancel.is_cancelled() => {
                return (
                    AttemptState::Cancelled,
                    Some(FailureClass::Cancelled),
                    "cancelled while preparing the task directory".into(),
                    None,
                );
            }
            Err(detail) => return failed(FailureClass::TaskDir, detail),
        }
    };
    if stops.cancel.is_cancelled() {
        return (
            AttemptState::Cancelled,
            Some(FailureClass::Cancelled),
            "cancelled before start".into(),
            None,
        );
    }
    if stops.shutdown.is_cancelled() {
        return failed(
            FailureClass::HostRestart,
            "the host shut down before the provider started",
        );
    }
    // A retry continues the previous attempt's provider session when it exists on this host
    // (H17); its HOME, where the session lives, is carried over.
    let mut reuse: Option<String> = None;
    if resume.is_none() && !fresh_only && !spec.resume_session_id.is_empty() {
        let prev_root = ctx.tasks_dir.join(&spec.resume_from_attempt_id);
        let prev = TaskDir {
            repo: None,
            input_dir: prev_root.join("input"),
            home: prev_root.join("home"),
            tmp: prev_root.join("tmp"),
            root: prev_root,
        };
        let can = ctx.descriptor(adapter.name()).is_some_and(|d| d.resume)
            && !spec.resume_from_attempt_id.contains(['/', '.'])
            && adapter.session_exists(&prev, &spec.resume_session_id);
        // The provider's state: HOME, and CODEX_HOME where Codex keeps it.
        let mut copied = can;
        for (from, to) in [
            (prev.home.clone(), dir.home.clone()),
            (prev.root.join("codex-home"), dir.root.join("codex-home")),
        ] {
            if copied && from.is_dir() {
                let _ = tokio::fs::create_dir_all(&to).await;
                copied = tokio::process::Command::new("cp")
                    .arg("-a")
                    .arg(from.join("."))
                    .arg(&to)
                    .status()
                    .await
                    .is_ok_and(|s| s.success());
            }
        }
        if copied {
            sink.diag(
                "info",
                "reusing_session",
                format!(
                    "this retry continues provider session {} of the previous attempt",
                    spec.resume_session_id
                ),
            )
            .await;
            reuse = Some(spec.resume_session_id.clone());
        } else {
            sink.diag("info", "fresh_session", format!("provider session {} of the previous attempt is not available on this host; starting a fresh session", spec.resume_session_id)).await;
        }
    }
    let resumed_session = resume.map(str::to_string).or_else(|| reuse.clone());
    let launch_ctx = provider::LaunchCtx {
        spec: &spec,
        dir: &dir,
        attempt_id: &a.attempt_id,
        api_url: &ctx.config.api_url,
        task_token: &a.task_token,
        cli: ctx.cli_path(),
    };
    let launched = match resumed_session.as_deref() {
        Some(session) => adapter
            .resume_launch(&launch_ctx, session)
            .unwrap_or_else(|| {
                Err(provider::Refusal {
                    class: FailureClass::HostRestart,
                    detail: "this provider cannot resume".into(),
                })
            }),
        None => adapter.launch(&launch_ctx),
    };
    let launch = match launched {
        Ok(l) => l,
        Err(r) => return failed(r.class, r.detail),
    };
    for (rel, content) in &launch.files {
        let path = dir.root.join(rel);
        if !path.starts_with(&dir.root)
            || rel
                .components()
                .any(|c| c == std::path::Component::ParentDir)
        {
            return failed(
                FailureClass::Internal,
                format!("adapter file {} escapes the task directory", rel.display()),
            );
        }
        if let Some(parent) = path.parent()
            && let Err(e) = isolation::create_private_dir(parent)
        {
            return failed(
                FailureClass::TaskDir,
                format!("create {}: {e}", parent.display()),
            );
        }
        // Adapter files hold the task credential (MCP configurations): owner only.
        if let Err(e) = isolation::write_private(&path, content.as_bytes()) {
            return failed(
                FailureClass::TaskDir,
                format!("write {}: {e}", path.display()),
            );
        }
    }
    // Exactly what `prepare` made, nothing added: its entries are known, no walk is needed.
    let plain =
        resume.is_none() && dir.repo.is_none() && reuse.is_none() && launch.files.is_empty();
    if !plain {
        use std::os::unix::fs::PermissionsExt;
        if let Err(e) = std::fs::set_permissions(&dir.root, std::fs::Permissions::from_mode(0o700))
        {
            return failed(
                FailureClass::TaskDir,
                format!("chmod {}: {e}", dir.root.display()),
            );
        }
    }
    // The whole directory is the attempt's: also an earlier attempt's copied HOME, or the
    // directory a restarted host resumes in.
    if let Some(who) = who {
        let owned = if plain {
            let mut entries: Vec<std::path::PathBuf> =
                INPUT_FILES.iter().map(|f| dir.input_dir.join(f)).collect();
            entries.extend([
                dir.input_dir.clone(),
                dir.home.clone(),
                dir.tmp.clone(),
                dir.root.clone(),
            ]);
            entries
                .iter()
                .try_for_each(|p| std::os::unix::fs::lchown(p, Some(who.uid), Some(who.gid)))
        } else {
            let root = dir.root.clone();
            tokio::task::spawn_blocking(move || isolation::chown_tree(&root, who))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        };
        if let Err(e) = owned {
            return failed(
                FailureClass::TaskDir,
                format!("give the task directory to uid {}: {e}", who.uid),
            );
        }
    }
    let user = isolation::user_name(who);
    let mut env = launch.env.clone();
    for (k, v) in [
        ("USER", user.clone()),
        ("LOGNAME", user),
        ("AGENTSCOPE_TASK_ID", a.task_id.clone()),
        ("AGENTSCOPE_ATTEMPT_ID", a.attempt_id.clone()),
        ("AGENTSCOPE_WORKSPACE_ID", a.workspace_id.clone()),
        (
            "AGENTSCOPE_TASK_DIR",
            dir.root.to_string_lossy().into_owned(),
        ),
        (
            "AGENTSCOPE_INPUT_DIR",
            dir.input_dir.to_string_lossy().into_owned(),
        ),
        ("AGENTSCOPE_API", ctx.config.api_url.clone()),
        ("AGENTSCOPE_TASK_TOKEN", a.task_token.clone()),
        ("PATH", ctx.executor_path().to_string_lossy().into_owned()),
    ] {
        env.push((k.to_string(), v));
    }
    // Nothing of the host's own environment (its token, its settings) leaks through: the
    // environment is cleared and only allow-listed variables are set.
    let (env, refused) = isolation::filter_env(env);
    if !refused.is_empty() {
        tracing::error!(
            ?refused,
            "variables outside the allow-list not passed to the provider"
        );
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let Some(program) = isolation::resolve_program(&launch.argv[0], path.as_ref(), &launch.cwd)
    else {
        return failed(
            FailureClass::ToolDependency,
            format!("`{}` was not found on this host", launch.argv[0]),
        );
    };
    // The sentinel (spawned without copying the host's memory) starts the provider under the
    // attempt's uid, keeps its whole tree below it, and ends it with the host.
    let mut cmd = tokio::process::Command::new(isolation::sentinel_path());
    cmd.args(isolation::sentinel_args(
        std::process::id(),
        who,
        &program,
        &launch.argv,
    ))
    .current_dir(&launch.cwd)
    .env_clear()
    .envs(env)
    .stdin(if launch.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0)
    .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return failed(
                FailureClass::Internal,
                format!("start {}: {e}", isolation::sentinel_path().display()),
            );
        }
    };
    *gone = false;
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    // Providers driven over stdin keep it open (approvals); others get their input and EOF.
    let mut stdin = child.stdin.take();
    if let (Some(text), Some(pipe)) = (launch.stdin.clone(), stdin.as_mut()) {
        use tokio::io::AsyncWriteExt;
        let _ = pipe.write_all(text.as_bytes()).await;
        let _ = pipe.flush().await;
    }
    if !launch.keep_stdin_open {
        stdin = None;
    }
    let mut rejected = false;
    // The last `Result` seen: Some(None) a success, Some(Some(text)) a failure.
    let mut result_error: Option<Option<String>> = None;
    let mut pending: std::collections::HashMap<String, provider::ControlRequest> =
        Default::default();
    // "Allow always" lives in this attempt's memory only: it never outlives the task.
    let mut always: std::collections::HashSet<String> = Default::default();
    // The last denied tool request, until a later one is allowed: a turn that ends after it
    // ended because of it (`tool_denied`, or `approval_timeout` when nobody decided).
    let mut denial: Option<(FailureClass, String)> = None;
    // Every process of the provider's tree carries this, even one that left the process group.
    let marker = format!("AGENTSCOPE_ATTEMPT_ID={}", a.attempt_id);
    let mut parser = adapter.parser_for(&launch);
    // A resumed or restarted provider session may number its items from the start again (Codex's
    // `item_0`): its call and approval ids get the launch's first seq as a prefix, so they stay
    // unique within the attempt. The first launch keeps the provider's own ids.
    let scope = (resume.is_some() || fresh_only).then(|| format!("g{}", sink.entry.last_seq + 1));
    let mut watch = ModelWatch::default();
    if let Some(d) = ctx.descriptor(adapter.name()) {
        if !d.live_stream {
            sink.diag(
                "info",
                "no_live_stream",
                format!(
                    "{} has no live event stream: its events arrive when the run ends",
                    d.name
                ),
            )
            .await;
        }
        if !d.resume {
            sink.diag(
                "info",
                "no_resume",
                format!(
                    "{} has no session resume: a retry starts a fresh session",
                    d.name
                ),
            )
            .await;
        }
    }
    sink.lifecycle(
        AttemptState::Running,
        None,
        format!("started {} (pgid {pgid})", adapter.name()),
        None,
    )
    .await;

    // Both output streams feed one channel so events keep their arrival order.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(&'static str, String, bool)>(256);
    for (name, max, pipe) in [
        (
            "stdout",
            adapter.max_line_bytes(),
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
        ),
        (
            "stderr",
            ctx.config.max_line_bytes,
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
        ),
    ] {
        let Some(pipe) = pipe else { continue };
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut r = BufReader::new(pipe);
            while let Ok(Some((line, truncated))) = process::read_line_bounded(&mut r, max).await {
                if tx.send((name, line, truncated)).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);

    let (timeout, limit) = run_limit(&spec);
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let grace = Duration::from_millis(ctx.config.kill_grace_ms);
    let mut stop: Option<Outcome> = None;
    let mut output_open = true;
    let status = loop {
        tokio::select! {
            biased;
            _ = stops.lease_lost.cancelled(), if stop.is_none() => {
                let left = process::stop_tree(pgid, None, &marker).await;
                stop = Some(failed(FailureClass::LeaseLost, format!("lease lost; provider killed ({} left)", left.len())));
            }
            _ = stops.cancel.cancelled(), if stop.is_none() => {
                sink.diag("info", "cancelling", format!("SIGTERM to process group {pgid}, SIGKILL after {} ms", grace.as_millis())).await;
                let left = process::stop_tree(pgid, Some(grace), &marker).await;
                stop = Some(if left.is_empty() {
                    (AttemptState::Cancelled, Some(FailureClass::Cancelled), "cancelled; the provider's process tree is gone".into(), None)
                } else {
                    failed(FailureClass::Internal, format!("cancel left processes {left:?}"))
                });
            }
            _ = stops.shutdown.cancelled(), if stop.is_none() => {
                sink.diag("warn", "host_shutdown", "the host is shutting down; stopping the provider").await;
                let left = process::stop_tree(pgid, Some(grace), &marker).await;
                stop = Some(failed(FailureClass::HostRestart, format!("the host shut down during the attempt ({} processes left)", left.len())));
            }
            _ = &mut deadline, if stop.is_none() => {
                let left = process::stop_tree(pgid, Some(grace), &marker).await;
                stop = Some(failed(FailureClass::Timeout, format!("timed out after {} s: {limit} ({} processes left)", timeout.as_secs(), left.len())));
            }
            line = rx.recv(), if output_open => match line {
                Some(("stdout", text, truncated)) => {
                    if resumed_session.is_some() && adapter.resume_rejected(&text) {
                        rejected = true;
                    }
                    if let Some(req) = (!truncated).then(|| adapter.control_request(&text)).flatten() {
                        let key = scoped_id(scope.as_deref(), &req.request_id);
                        if always.contains(&req.tool_name) {
                            answer(&mut stdin, adapter, sink, &req, &key, true, "allowed for the rest of this task", "always_for_task", "").await;
                            denial = None;
                        } else {
                            request_approval(ctx, a, sink, &req, &key, launch.approval_timeout_ms).await;
                            pending.insert(key, req);
                        }
                        continue;
                    }
                    if stop.is_none() && adapter.model_connection_error(&text) {
                        for body in parser.line(&text, truncated) {
                            sink.emit(scope_ids(body, scope.as_deref())).await;
                        }
                        let limit = (ctx.config.model_retry_limit, Duration::from_secs(ctx.config.model_retry_secs));
                        if let Some((errors, secs)) = watch.connection_error(limit.0, limit.1) {
                            let detail = format!("the provider could not connect to its model endpoint {}: {errors} connection errors in a row over {secs} s, no response", adapter.model_endpoint());
                            sink.diag("error", FailureClass::ModelUnreachable.as_str(), detail.clone()).await;
                            let left = process::stop_tree(pgid, Some(grace), &marker).await;
                            stop = Some(failed(FailureClass::ModelUnreachable, format!("{detail} ({} processes left)", left.len())));
                        }
                        continue;
                    }
                    let fatal = if stop.is_none() { adapter.fatal(&text) } else { None };
                    if let Some((class, detail)) = fatal {
                        for body in parser.line(&text, truncated) {
                            sink.emit(scope_ids(body, scope.as_deref())).await;
                        }
                        sink.diag("error", class.as_str(), detail.clone()).await;
                        let left = process::stop_tree(pgid, Some(grace), &marker).await;
                        stop = Some(failed(class, format!("{detail} ({} processes left)", left.len())));
                        continue;
                    }
                    let mut end = false;
                    for body in parser.line(&text, truncated) {
                        // The provider's final result ends its work: stdin closes (providers
                        // driven over stdin exit then).
                        end |= matches!(body, Body::Result(_));
                        if let Body::Result(r) = &body {
                            result_error = Some(r.is_error.then(|| r.text.clone()));
                        }
                        if matches!(body, Body::AssistantMessage(_) | Body::ToolCall(_) | Body::Result(_) | Body::Usage(_)) {
                            watch.progress();
                        }
                        sink.emit(scope_ids(body, scope.as_deref())).await;
                    }
                    write_lines(&mut stdin, parser.replies()).await;
                    if end {
                        stdin = None;
                    }
                }
                Some((stream, text, truncated)) => {
                    if resumed_session.is_some() && adapter.resume_rejected(&text) {
                        rejected = true;
                    }
                    sink.emit(Body::Output(agentscope_schemas::v1::Output { stream: stream.into(), text, truncated })).await;
                }
                None => {
                    output_open = false;
                    // The output is read: once the provider is gone, its sentinel ends the rest.
                    isolation::end_rest(pgid);
                }
            },
            d = decisions.recv(), if !pending.is_empty() => {
                let Some(d) = d else { continue };
                let Some(req) = pending.remove(&d.request_id) else { continue };
                let class = if d.decided_by == "policy" { FailureClass::ApprovalTimeout.as_str() } else { "" };
                if d.allow && d.always_for_task {
                    always.insert(req.tool_name.clone());
                }
                answer(&mut stdin, adapter, sink, &req, &d.request_id, d.allow, &d.reason, &d.decided_by, class).await;
                denial = denied_outcome(&req, &d);
                if !d.allow {
                    parser.denied(&req.tool_name, &d.reason);
                }
            }
            st = child.wait(), if !output_open || stop.is_some() => break st,
        }
    };
    if !stops.lease_lost.is_cancelled() {
        for body in parser.finish() {
            sink.emit(scope_ids(body, scope.as_deref())).await;
        }
    }
    if let Some(outcome) = stop {
        return outcome;
    }
    // The sentinel exits by itself only once nothing of the provider's tree is left (no scan
    // needed); one that ended by a signal may have been killed before it could end the rest.
    *gone = status.as_ref().is_ok_and(|s| s.code().is_some());
    if !*gone {
        process::stop_tree(pgid, None, &marker).await;
    }
    let turn_failed = launch.result_decides && !matches!(result_error, Some(None));
    if rejected && !fresh_only && (turn_failed || !status.as_ref().is_ok_and(|s| s.success())) {
        sink.diag("warn", "resume_rejected", "the provider rejected the session resume; starting a fresh session in this attempt, once").await;
        return Box::pin(execute(
            ctx, a, sink, stops, decisions, None, true, who, gone,
        ))
        .await;
    }
    match status {
        Ok(s) if s.success() && turn_failed => (
            AttemptState::Failed,
            Some(FailureClass::AgentError),
            match result_error {
                Some(Some(text)) => format!("the agent's turn failed: {text}"),
                _ => "the provider ended without finishing its turn".into(),
            },
            Some(0),
        ),
        Ok(s) if s.success() => match denial {
            // The work asked for did not happen: not a plain success.
            Some((class, detail)) => (AttemptState::Failed, Some(class), detail, Some(0)),
            None => (
                AttemptState::Succeeded,
                None,
                "exit status 0".into(),
                Some(0),
            ),
        },
        Ok(s) => match s.code() {
            Some(code) => (
                AttemptState::Failed,
                Some(FailureClass::ExitNonzero),
                format!("exit status {code}"),
                Some(code),
            ),
            None => failed(
                FailureClass::ProviderCrash,
                format!("provider ended by a signal: {s}"),
            ),
        },
        Err(e) => failed(
            FailureClass::ProviderCrash,
            format!("wait for provider: {e}"),
        ),
    }
}

/// The denial a turn that ends now ended with: a deny replaces it, an allow clears it.
fn denied_outcome(
    req: &provider::ControlRequest,
    d: &ApprovalDecision,
) -> Option<(FailureClass, String)> {
    if d.allow {
        return None;
    }
    let (class, by) = if d.decided_by == "policy" {
        (
            FailureClass::ApprovalTimeout,
            "nobody decided before the approval timeout".to_string(),
        )
    } else {
        (
            FailureClass::ToolDenied,
            format!("denied by {}", d.decided_by),
        )
    };
    let reason = match d.reason.trim() {
        "" => String::new(),
        r => format!(": {r}"),
    };
    Some((
        class,
        format!(
            "the agent's turn ended after its `{}` request was refused ({by}{reason})",
            req.tool_name
        ),
    ))
}

/// Counts a provider's model connection errors in a row (a CLI retrying an endpoint that does
/// not answer); any model output in between starts the count over.
#[derive(Debug, Default)]
pub struct ModelWatch {
    errors: u32,
    first: Option<std::time::Instant>,
}

impl ModelWatch {
    /// One more connection error. Some((errors, seconds since the first)) when the attempt
    /// should end: `limit` errors in a row, or the first of them `max` ago.
    pub fn connection_error(&mut self, limit: u32, max: Duration) -> Option<(u32, u64)> {
        self.errors += 1;
        let first = *self.first.get_or_insert_with(std::time::Instant::now);
        let since = first.elapsed();
        (self.errors >= limit.max(1) || since >= max).then_some((self.errors, since.as_secs()))
    }

    /// The model answered.
    pub fn progress(&mut self) {
        self.errors = 0;
        self.first = None;
    }
}

/// `id` within launch `scope` of an attempt (None: the attempt's first launch, ids unchanged).
pub fn scoped_id(scope: Option<&str>, id: &str) -> String {
    match scope {
        Some(g) if !id.is_empty() => format!("{g}:{id}"),
        _ => id.to_string(),
    }
}

/// Puts the call ids of `body` in launch `scope`, so that a provider that restarts its item
/// numbering on resume never records two different calls under one id in an attempt.
pub fn scope_ids(mut body: Body, scope: Option<&str>) -> Body {
    if scope.is_some() {
        match &mut body {
            Body::ToolCall(c) => c.call_id = scoped_id(scope, &c.call_id),
            Body::ToolResult(r) => r.call_id = scoped_id(scope, &r.call_id),
            _ => {}
        }
    }
    body
}

/// The run timeout of an attempt, from the scheduler's resolution (task, then runtime profile,
/// then the deployment default), and the words naming the limit that applies.
pub fn run_limit(spec: &agentscope_schemas::v1::TaskSpec) -> (Duration, String) {
    /// An attempt whose spec carries no timeout (created before timeouts were resolved).
    const FALLBACK_SECS: u64 = 4 * 3600;
    let secs = match spec.timeout_secs {
        0 => FALLBACK_SECS,
        s => s as u64,
    };
    let limit = match spec.timeout_source.as_str() {
        "task" => format!("the task's timeout_secs ({secs} s)"),
        "profile" => format!("the runtime profile's timeout_secs ({secs} s)"),
        _ => format!(
            "the deployment's default run timeout ({secs} s, the scheduler's AGENTSCOPE_RUN_TIMEOUT_SECS)"
        ),
    };
    (Duration::from_secs(secs), limit)
}

/// The task directory an earlier run of this host prepared for the attempt.
pub fn existing_task_dir(ctx: &Ctx, a: &AttemptAssignment) -> TaskDir {
    let root = ctx.tasks_dir.join(&a.attempt_id);
    let repo = root.join("repo");
    TaskDir {
        repo: repo.is_dir().then_some(repo),
        input_dir: root.join("input"),
        home: root.join("home"),
        tmp: root.join("tmp"),
        root,
    }
}

/// The input material in a task directory's `input/`.
const INPUT_FILES: [&str; 3] = ["INPUT.md", "ISSUE.md", "INSTRUCTIONS.md"];

/// Creates a fresh directory for the attempt, clones the named repository and branch, and writes
/// the input material. Never uses the host's own checkout.
async fn prepare(
    ctx: &Ctx,
    a: &AttemptAssignment,
    sink: &mut EventSink,
    cancel: &CancellationToken,
) -> Result<TaskDir, String> {
    let spec = a.spec.clone().unwrap_or_default();
    let root = ctx.tasks_dir.join(&a.attempt_id);
    if root.exists() {
        tokio::fs::remove_dir_all(&root)
            .await
            .map_err(|e| format!("clear {}: {e}", root.display()))?;
    }
    let input_dir = root.join("input");
    let home = root.join("home");
    let tmp = root.join("tmp");
    // The task directory is its attempt's only (0700; given to the attempt's uid before start).
    for d in [&root, &home, &tmp, &input_dir] {
        isolation::create_private_dir(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let repo = if spec.repository.is_empty() {
        None
    } else {
        let dest = root.join("repo");
        clone(&spec.repository, &spec.branch, &dest, cancel).await?;
        sink.diag(
            "info",
            "cloned",
            format!(
                "cloned {} branch {}",
                spec.repository,
                if spec.branch.is_empty() {
                    "(default)"
                } else {
                    &spec.branch
                }
            ),
        )
        .await;
        Some(dest)
    };
    let issue = format!("# {}\n\n{}\n", spec.issue_title, spec.issue_body);
    // A fresh directory: plain new files (nobody reads them before the provider starts).
    for (name, body) in INPUT_FILES.iter().zip([
        spec.input.as_str(),
        issue.as_str(),
        spec.instructions.as_str(),
    ]) {
        let p = input_dir.join(name);
        isolation::write_new_private(&p, body.as_bytes())
            .map_err(|e| format!("write {}: {e}", p.display()))?;
    }
    Ok(TaskDir {
        root,
        repo,
        input_dir,
        home,
        tmp,
    })
}

async fn clone(
    repository: &str,
    branch: &str,
    dest: &Path,
    cancel: &CancellationToken,
) -> Result<(), String> {
    if repository.starts_with('-') || branch.starts_with('-') {
        return Err("repository and branch must not start with '-'".into());
    }
    let mut cmd = tokio::process::Command::new("git");
    cmd.arg("clone").arg("--quiet").arg("--single-branch");
    if !branch.is_empty() {
        cmd.arg("--branch").arg(branch);
    }
    cmd.arg("--").arg(repository).arg(dest);
    // Its own process group, so that a cancel stops git's helpers too; none of the host's
    // environment (its token) but a PATH.
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LANG", "C.UTF-8")
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| format!("run git: {e}"))?;
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    let out = tokio::select! {
        out = child.wait_with_output() => out.map_err(|e| format!("run git: {e}"))?,
        _ = cancel.cancelled() => {
            process::kill_group(pgid).await;
            return Err("cancelled during git clone".into());
        }
        _ = tokio::time::sleep(Duration::from_secs(600)) => {
            process::kill_group(pgid).await;
            return Err("git clone timed out after 600 s".into());
        }
    };
    if !out.status.success() {
        return Err(format!(
            "git clone {repository} (branch {branch}) failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentscope_schemas::v1::{ToolCall, ToolResult};

    fn call(id: &str) -> Body {
        Body::ToolCall(ToolCall {
            call_id: id.into(),
            name: "shell".into(),
            input_json: "{}".into(),
        })
    }

    #[test]
    fn call_ids_stay_unique_across_resumes() {
        // Codex numbers its items from item_0 again after a resume.
        let first = scope_ids(call("item_0"), None);
        let resumed = scope_ids(call("item_0"), Some("g12"));
        let again = scope_ids(call("item_0"), Some("g30"));
        let ids: Vec<String> = [first, resumed, again]
            .into_iter()
            .map(|b| match b {
                Body::ToolCall(c) => c.call_id,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(ids, ["item_0", "g12:item_0", "g30:item_0"]);
        // A result names the same call as its call.
        match scope_ids(
            Body::ToolResult(ToolResult {
                call_id: "item_0".into(),
                output: "ok".into(),
                is_error: false,
            }),
            Some("g12"),
        ) {
            Body::ToolResult(r) => assert_eq!(r.call_id, "g12:item_0"),
            _ => unreachable!(),
        }
    }

    #[test]
    fn approval_keys_follow_the_call_ids() {
        // The approval is keyed (and decided) under the scoped id; the provider is answered
        // under its own id, which the ControlRequest keeps.
        assert_eq!(scoped_id(None, "item_0"), "item_0");
        assert_eq!(scoped_id(Some("g12"), "item_0"), "g12:item_0");
        assert_ne!(scoped_id(Some("g12"), "item_0"), scoped_id(None, "item_0"));
        assert_eq!(scoped_id(Some("g12"), ""), "");
    }

    #[test]
    fn repeated_connection_errors_end_the_run_and_progress_resets_them() {
        let mut w = ModelWatch::default();
        let long = Duration::from_secs(3600);
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long), None);
        w.progress();
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long).map(|(n, _)| n), Some(3));
        // The seconds bound ends it before the count does.
        let mut w = ModelWatch::default();
        assert!(w.connection_error(100, Duration::ZERO).is_some());
    }

    #[test]
    fn the_timeout_names_its_limit() {
        let spec = |secs, source: &str| agentscope_schemas::v1::TaskSpec {
            timeout_secs: secs,
            timeout_source: source.into(),
            ..Default::default()
        };
        let (d, l) = run_limit(&spec(2, "profile"));
        assert_eq!(d, Duration::from_secs(2));
        assert!(l.contains("runtime profile's timeout_secs"), "{l}");
        let (d, l) = run_limit(&spec(7, "task"));
        assert_eq!(d, Duration::from_secs(7));
        assert!(l.contains("task's timeout_secs"), "{l}");
        let (d, l) = run_limit(&spec(0, ""));
        assert_eq!(d, Duration::from_secs(4 * 3600));
        assert!(l.contains("default"), "{l}");
    }
}
