//! One input of a session: model turns and tool calls until the model answers without tools,
//! `max_iters` is reached, or the model cannot be reached.

use super::journal::{Batch, CallStatus, Ended};
use super::pinned::Pinned;
use super::{Session, Stop};
use crate::model::{self, Message, ModelError, ToolCallReq};
use crate::policy::Decision;
use crate::tools::{self, ToolOutput};
use agentscope_domain::{InputOutcome, SessionStatus};
use futures::future::{BoxFuture, FutureExt};
use serde_json::json;
use std::collections::{HashSet, VecDeque};
use uuid::Uuid;

impl Session<'_> {
    /// One input: model turns and tool calls until the model stops calling tools.
    ///
    /// The conversation is loaded once and then kept in the model API's wire format, each new
    /// message appended ([`model::Conversation`]). A model turn is one write: its message and
    /// events, and, when the turn's first call can run at once, that call's `started` journal row
    /// (or, for the last turn, the input's outcome). A tool's result is another write.
    ///
    /// The calls that only read at the head of a turn (one, or several asked for at once) run
    /// while their turn is written, the next model request goes out before that write is
    /// awaited (it commits while the model thinks), and their ends are written with the next
    /// write: one write per iteration. Nothing durable depends on a request the model has not
    /// answered yet: if the write fails (or this replica is fenced) the request is dropped, and
    /// a replica that takes the session over asks again from what was committed; a read found
    /// `started` there is read again (see [`Self::call`]).
    pub(super) async fn work(&self, p: &Pinned, input_id: Uuid, text: &str) -> Result<(), Stop> {
        let history = self.history().await?;
        let model = self.r.model_config(&p.model);
        let specs = tools::specs(&p.enabled);
        let prompt = model::Prompt::new(&model, &p.instructions, &specs);
        let mut conversation = model::Conversation::new(model.api);
        // Every call id the session has seen: a model that repeats one goes through the journal.
        let mut known_calls: HashSet<String> = HashSet::new();
        // Ids of the pending calls first seen in the turn just written, until each is called.
        let mut fresh: HashSet<String> = HashSet::new();
        let mut iterations: u32 = 0;
        let mut has_input = false;
        // Tool calls of the last assistant message that have no result yet (a takeover): run
        // them, or report them interrupted.
        let mut pending: Vec<ToolCallReq> = vec![];
        for (i, m) in &history {
            has_input |= *i == input_id;
            match m {
                Message::Assistant { tool_calls, .. } => {
                    if *i == input_id {
                        iterations += 1;
                    }
                    known_calls.extend(tool_calls.iter().map(|c| c.id.clone()));
                    pending = tool_calls.clone();
                }
                Message::ToolResult { call_id, .. } => pending.retain(|c| &c.id != call_id),
                Message::User { .. } => {}
            }
            conversation.push(m);
        }
        drop(history);
        let mut b = Batch::of(input_id);
        b.status(SessionStatus::Running, "");
        if !has_input {
            let m = Message::User {
                text: text.to_string(),
            };
            b.message(&m);
            b.event("input", json!({"input_id": input_id, "text": text}));
            conversation.push(&m);
        }
        self.write(b).await?;
        let mut denied = false;
        // The calls journaled `started` together with the turn that asked for them, in order.
        let mut started_with_turn: VecDeque<String> = VecDeque::new();
        // Writes sent and not yet awaited, in order: a turn whose first call only reads, or the
        // end of a call started with its turn. They commit while the next model request is in
        // flight, and before anything else is written, so the journal's order is the
        // conversation's.
        let mut unwritten: Option<BoxFuture<'_, Result<(), Stop>>> = None;
        // The ends of calls that only read: the first rows of the next write.
        let mut carried: Option<Batch> = None;
        // Those calls' outputs and ends: they ran while their turn was written.
        let mut ran_with_turn: VecDeque<(ToolOutput, Ended)> = VecDeque::new();
        loop {
            for call in std::mem::take(&mut pending) {
                let (out, was_denied) = if started_with_turn.front() == Some(&call.id) {
                    started_with_turn.pop_front();
                    let (out, ended) = match ran_with_turn.pop_front() {
                        Some(ran) => ran,
                        None => self.run_started(p, input_id, &call, None).await?,
                    };
                    match ended {
                        Ended { batch, note: None } if reads_only(p, &call) => {
                            carry(&mut carried, batch)
                        }
                        ended => unwritten = Some(self.then_commit(unwritten.take(), ended)),
                    }
                    (out, false)
                } else if fresh.contains(&call.id)
                    && reads_only(p, &call)
                    && self.allowed_at_once(p, &call)
                {
                    // A read later in the turn runs once the calls before it have run; it needs
                    // no `started` row first (running it again changes nothing), so its row goes
                    // in as `completed`, with its result, in the next write.
                    fresh.remove(&call.id);
                    if carried.as_ref().is_some_and(|c| c.rows() >= READS_TOGETHER) {
                        // A write holds the results of a few reads at most.
                        self.flush(&mut unwritten, &mut carried).await?;
                    }
                    let (out, ended) = self.run_started(p, input_id, &call, None).await?;
                    let mut b = Batch::of(input_id);
                    b.journal(&call, CallStatus::Completed, Some(&out));
                    b.event(
                        "tool_call",
                        json!({"call_id": call.id, "tool": call.name, "input": call.input}),
                    );
                    let mut end = ended.batch;
                    // The row is inserted whole, not updated.
                    end.ended.clear();
                    b.append(end);
                    carry(&mut carried, b);
                    (out, false)
                } else {
                    self.flush(&mut unwritten, &mut carried).await?;
                    let fresh = fresh.remove(&call.id);
                    self.call(p, input_id, &call, fresh).await?
                };
                denied |= was_denied;
                conversation.push(&Message::ToolResult {
                    call_id: call.id,
                    output: out.output,
                    is_error: out.is_error,
                });
            }
            if iterations >= p.max_iters {
                if let Some(w) = unwritten.take() {
                    w.await?;
                }
                let detail = format!("stopped after {iterations} model turns (max_iters)");
                let mut b = carried.take().unwrap_or_else(|| Batch::of(input_id));
                b.finish(InputOutcome::MaxIterations, &detail, iterations);
                return self.write(b).await;
            }
            // The model already has the result; the turn is written only after it is.
            let ((), turn) = tokio::try_join!(
                async {
                    match unwritten.take() {
                        Some(w) => w.await,
                        None => Ok(()),
                    }
                },
                async {
                    Ok(model::complete_turn(&self.r.http, &model, &prompt, &conversation).await)
                }
            )?;
            let turn = match turn {
                Ok(t) => t,
                Err(e) => {
                    let detail = match &e {
                        ModelError::Connection(m) | ModelError::Rejected(m) => m.clone(),
                    };
                    let mut b = carried.take().unwrap_or_else(|| Batch::of(input_id));
                    b.event(
                        "diagnostic",
                        json!({"code": "model_connection", "message": detail}),
                    );
                    b.finish(InputOutcome::ModelConnection, &detail, iterations);
                    return self.write(b).await;
                }
            };
            let mut b = carried.take().unwrap_or_else(|| Batch::of(input_id));
            if !turn.text.is_empty() {
                b.event("assistant_message", json!({"text": turn.text}));
            }
            b.event(
                "usage",
                json!({"input_tokens": turn.input_tokens, "output_tokens": turn.output_tokens}),
            );
            let m = Message::Assistant {
                text: turn.text,
                tool_calls: turn.tool_calls,
            };
            b.message(&m);
            // Appended now: a failed write ends the session's work here anyway.
            conversation.push(&m);
            iterations += 1;
            let Message::Assistant { tool_calls, .. } = m else {
                unreachable!("an assistant message")
            };
            if tool_calls.is_empty() {
                let (status, detail) = if denied {
                    (
                        InputOutcome::ToolDenied,
                        "the turn ended after a tool was denied by policy",
                    )
                } else {
                    (InputOutcome::Completed, "")
                };
                b.finish(status, detail, iterations);
                return self.write(b).await;
            }
            // Started with the turn: its leading reads, or else its first call.
            let mut with_turn: Vec<&ToolCallReq> = vec![];
            for call in &tool_calls {
                if !self.starts_at_once(p, call, &known_calls)
                    || with_turn.iter().any(|c| c.id == call.id)
                {
                    break;
                }
                if !reads_only(p, call) {
                    if with_turn.is_empty() {
                        with_turn.push(call);
                    }
                    break;
                }
                with_turn.push(call);
                if with_turn.len() == READS_TOGETHER {
                    break;
                }
            }
            for call in &with_turn {
                b.journal(call, CallStatus::Started, None);
                b.event(
                    "tool_call",
                    json!({"call_id": call.id, "tool": call.name, "input": call.input}),
                );
                started_with_turn.push_back(call.id.clone());
            }
            match with_turn.first() {
                // Nothing to repeat or undo: calls that only read run (together) while the turn
                // that starts them is written, and the write is awaited only before the next one.
                Some(first) if reads_only(p, first) => {
                    let mut write = self.write(b).boxed();
                    let ran = {
                        let run = futures::future::try_join_all(
                            with_turn
                                .iter()
                                .map(|call| self.run_started(p, input_id, call, None)),
                        );
                        tokio::pin!(run);
                        // The read first: it is on the way to the next model request, the write
                        // is not (polling the write first measured slower, 1.03 against 0.93 ms
                        // per iteration over 7 interleaved W3 runs).
                        tokio::select! {
                            biased;
                            ran = &mut run => ran,
                            written = &mut write => {
                                write = futures::future::ready(written).boxed();
                                run.await
                            }
                        }
                    };
                    match ran {
                        Ok(ran) => ran_with_turn = ran.into(),
                        Err(e) => {
                            let _ = write.await;
                            return Err(e);
                        }
                    }
                    unwritten = Some(write);
                }
                // A call with effects runs only once the turn (and with it the call's `started`
                // row) has committed; it gets ready meanwhile (see `start_and_run`).
                Some(first) => {
                    ran_with_turn = [self.start_and_run(p, input_id, first, b).await?].into();
                }
                None => self.write(b).await?,
            }
            // Ids new to the session and not started with the turn: no journal row to look for
            // (a repeated one has the row its first occurrence writes).
            fresh = tool_calls
                .iter()
                .filter(|c| !known_calls.contains(&c.id) && !started_with_turn.contains(&c.id))
                .map(|c| c.id.clone())
                .collect();
            known_calls.extend(tool_calls.iter().map(|c| c.id.clone()));
            pending = tool_calls;
        }
    }

    /// Everything not written yet, in order: the writes in flight, then the carried rows.
    async fn flush<'a>(
        &'a self,
        unwritten: &mut Option<BoxFuture<'a, Result<(), Stop>>>,
        carried: &mut Option<Batch>,
    ) -> Result<(), Stop> {
        if let Some(w) = unwritten.take() {
            w.await?;
        }
        match carried.take() {
            Some(c) => self.write(c).await,
            None => Ok(()),
        }
    }

    /// `before` (when there is one), then the call's end, in that order.
    fn then_commit<'a>(
        &'a self,
        before: Option<BoxFuture<'a, Result<(), Stop>>>,
        ended: Ended,
    ) -> BoxFuture<'a, Result<(), Stop>> {
        async move {
            if let Some(w) = before {
                w.await?;
            }
            self.commit(ended).await
        }
        .boxed()
    }

    /// Whether `call` (the first of a fresh turn) may be journaled `started` with the turn: the
    /// policy allows it, it is one of the agent's tools, its id is new to the session, and it
    /// waits for nothing (a Worker's calls first wait for the Worker to beat).
    pub(super) fn starts_at_once(
        &self,
        p: &Pinned,
        call: &ToolCallReq,
        known_calls: &HashSet<String>,
    ) -> bool {
        !known_calls.contains(&call.id) && self.allowed_at_once(p, call)
    }

    /// Whether `call` may run without asking or waiting: the policy allows it, it is one of the
    /// agent's tools, and no Worker runs it.
    fn allowed_at_once(&self, p: &Pinned, call: &ToolCallReq) -> bool {
        p.worker.is_none()
            && tools::ALL.contains(&call.name.as_str())
            && (p.enabled.is_empty() || p.enabled.contains(&call.name))
            && p.policy.decide(&call.name, &call.input).0 == Decision::Allow
    }
}

/// Adds `b`'s rows after those `carried` holds for the next write.
fn carry(carried: &mut Option<Batch>, b: Batch) {
    match carried {
        Some(c) => c.append(b),
        None => *carried = Some(b),
    }
}

/// Reads that run together with their turn's write, or whose results one write carries, at most:
/// a model asking for thousands at once gets them in bounded steps (each result is capped at the
/// Environment's `max_output`).
const READS_TOGETHER: usize = 16;

/// A file tool that only reads, in the session's own Environment (an E2B sandbox is created on
/// first use, a Worker's calls wait for the Worker): running it again changes nothing.
pub(super) fn reads_only(p: &Pinned, call: &ToolCallReq) -> bool {
    !p.e2b && p.worker.is_none() && matches!(call.name.as_str(), "read_file" | "list_files")
}
