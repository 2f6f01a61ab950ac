//! A call the policy says to ask about: the tool request published for the scheduler to record
//! as an Approval, the wait for its decision, then the call run or the deny reported.

use super::journal::{Batch, CallStatus};
use super::pinned::Pinned;
use super::{Runner, Session, Stop};
use crate::model::ToolCallReq;
use crate::tools::{ToolError, ToolOutput};
use agentscope_domain::SessionStatus;
use agentscope_schemas::Message as _;
use agentscope_schemas::v1::{DecideApproval, DecideApprovalReply};
use futures::StreamExt as _;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

impl Runner {
    /// Publishes a tool request for the scheduler to record as an Approval (idempotent).
    pub(super) async fn ask(&self, req: &agentscope_schemas::v1::ToolRequest) {
        let msg_id = format!("approval:session:{}:{}", req.session_id, req.request_id);
        let sent = async {
            self.js
                .publish_with_headers(
                    agentscope_bus::subjects::session_approval_requested(&req.session_id),
                    agentscope_bus::headers(&msg_id),
                    req.encode_to_vec().into(),
                )
                .await?
                .await
                .map_err(async_nats::Error::from)
        }
        .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, session_id = %req.session_id, "publish tool request; will retry");
        }
    }
}

/// What [`Session::start_if_allowed`] found, or [`Session::decide_and_start`] did.
enum Decided {
    /// The call was allowed and is now journaled `started`, with its decision.
    Started,
    /// Not allowed (yet): the Approval, if it is recorded (for a decision brought here: if the
    /// decision applied).
    Read(Option<Approval>),
}

/// A call's Approval as read.
struct Approval {
    id: Uuid,
    status: String,
    reason: Option<String>,
    decided_by: Option<String>,
}

impl Approval {
    fn of(id: Uuid, status: String, reason: Option<String>, decided_by: Option<String>) -> Self {
        Approval {
            id,
            status,
            reason,
            decided_by,
        }
    }
}

/// The answer to a decision brought here that did not apply (`code`: why).
fn not_applied(code: &str) -> DecideApprovalReply {
    DecideApprovalReply {
        ok: false,
        error_code: code.into(),
        ..Default::default()
    }
}

/// What a statement of [`start_allowed!`] found: the Approval, and the base of the events it
/// wrote if it started the call. Allowed but not started: the call was taken over (fenced).
fn decided(row: Option<(Approval, Option<i64>)>) -> Result<Decided, Stop> {
    Ok(match row {
        Some((_, Some(_))) => Decided::Started,
        Some((a, None)) if a.status == "allowed" => return Err(Stop::Fenced),
        Some((a, None)) => Decided::Read(Some(a)),
        None => Decided::Read(None),
    })
}

/// `sqlx::query!` of a statement that starts a call its Approval allows, with what else it
/// writes for it: `$ap` (`WITH ap AS (` the Approval's id, status, reason and decider, read or
/// decided), then the fence (this replica's token, `$2`, and the call, `$3`, still waiting), the
/// decision's and the call's events (`$4`: the call), the call `started`, and the select of
/// `ap` with the events' base, ending in `$tail`.
macro_rules! start_allowed {
    ($ap:literal, $tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query!(
            $ap + r#"), fence AS (
    UPDATE session_state SET last_seq = last_seq + 2, status = 'running', detail = '', updated_at = now()
    WHERE session_id = $1 AND lease_token = $2
      AND EXISTS (SELECT 1 FROM ap WHERE ap.status = 'allowed')
      AND EXISTS (SELECT 1 FROM session_tool_calls
          WHERE session_id = $1 AND call_id = $3 AND status = 'awaiting_approval')
    RETURNING last_seq - 2 AS base
), events AS (
    INSERT INTO session_events (session_id, seq, kind, payload)
    SELECT $1, fence.base + 1, 'approval_decided', jsonb_build_object('call_id', $3::text,
        'allow', true, 'status', ap.status, 'reason', ap.reason, 'decided_by', ap.decided_by)
    FROM fence, ap
    UNION ALL
    SELECT $1, fence.base + 2, 'tool_call', $4::jsonb FROM fence
), started AS (
    UPDATE session_tool_calls c SET status = 'started' FROM fence
    WHERE c.session_id = $1 AND c.call_id = $3 AND c.status = 'awaiting_approval'
)
SELECT ap.id AS "id!", ap.status AS "status!", ap.reason AS "reason?", ap.decided_by AS "decided_by?",
    (SELECT base FROM fence) AS "base?" "# + $tail,
            $($arg),+
        )
    };
}

/// The subscription on which a call waiting for its Approval (the id) hears decisions brought to
/// this replica, while it waits.
type Listening = Option<(Uuid, async_nats::Subscriber)>;

/// What a decision brought to this replica came to.
enum Brought {
    /// The call was allowed, started and ran: its output.
    Ran(ToolOutput),
    /// It was denied (recorded here).
    Decided(Approval),
}

impl Session<'_> {
    /// Reads the Approval of `call` and, if it is allowed, writes what [`Self::execute`] writes
    /// for an approved call (its `approval_decided` and `tool_call` events, the session
    /// `running`, the call `started`) in the same statement: one round trip from the decision
    /// to the tool. The write is fenced like every [`Self::write`]: this replica's token, and
    /// the call still waiting; an allowed call that cannot be started so was taken over. The
    /// Approval is read under a share lock: a decision whose transaction is still open (the
    /// gateway nudges before it commits) is waited for and seen, not read as pending.
    async fn start_if_allowed(&self, call: &ToolCallReq) -> Result<Decided, Stop> {
        let tool_call = json!({"call_id": call.id, "tool": call.name, "input": call.input});
        let row = start_allowed!(
            r#"WITH ap AS (
    SELECT id, status, reason, decided_by FROM approvals WHERE session_id = $1::uuid::text AND request_id = $3
    FOR SHARE
"#,
            "FROM ap",
            self.id,
            self.token,
            &call.id,
            tool_call,
        )
        .fetch_optional(&self.r.db)
        .await?;
        decided(row.map(|r| (Approval::of(r.id, r.status, r.reason, r.decided_by), r.base)))
    }

    /// A decision a gateway brought (`req`) for this call's pending Approval `approval`,
    /// recorded here and, when it allows the call, the call started, in one statement: what
    /// [`Self::start_if_allowed`] writes, with the Approval's update in place of its read (one
    /// commit from the decision to the tool instead of the gateway's and then this one). The
    /// update applies only to that Approval, of this call, still pending, in the caller's
    /// workspace (the gateway's, from its credential); a decision applies once (the row lock of
    /// the update), and it is recorded even when this replica lost the session (the fence stops
    /// only the start). The gateway is answered as soon as the statement is done or failed:
    /// `ok` when the decision applied; otherwise it decides by the record itself.
    async fn decide_and_start(
        &self,
        call: &ToolCallReq,
        approval: Uuid,
        req: &DecideApproval,
        reply: Option<async_nats::Subject>,
        listening: &mut Listening,
    ) -> Result<Decided, Stop> {
        let tool_call = json!({"call_id": call.id, "tool": call.name, "input": call.input});
        let status = if req.allow { "allowed" } else { "denied" };
        let workspace = req.workspace_id.parse::<Uuid>().ok();
        // Text PostgreSQL cannot store would fail the statement: such a decision does not
        // apply here (the gateway refuses it before it asks, in any case).
        let storable = !req.reason.contains('\0') && !req.decided_by.contains('\0');
        let row = match workspace.filter(|_| storable && req.approval_id == approval.to_string()) {
            None => Ok(None),
            Some(workspace) => {
                start_allowed!(
                    r#"WITH ap AS (
    UPDATE approvals SET status = $5, decided_at = now(), decided_by = $6, reason = NULLIF($7, '')
    WHERE id = $8 AND workspace_id = $9 AND session_id = $1::uuid::text AND request_id = $3
      AND attempt_id IS NULL AND status = 'pending'
    RETURNING id, status, reason, decided_by, jsonb_build_object('id', id, 'attempt_id', attempt_id,
        'task_id', NULL, 'session_id', session_id, 'request_id', request_id, 'tool_name', tool_name,
        'input', input, 'status', status, 'decided_by', decided_by, 'reason', reason,
        'created_at', created_at, 'expires_at', expires_at, 'decided_at', decided_at) AS approval
"#,
                    r#", ap.approval::text AS "approval!" FROM ap"#,
                    self.id,
                    self.token,
                    &call.id,
                    tool_call,
                    status,
                    &req.decided_by,
                    &req.reason,
                    approval,
                    workspace,
                )
                .fetch_optional(&self.r.db)
                .await
            }
        };
        if let Some(to) = reply {
            let applied = row.as_ref().ok().and_then(Option::as_ref);
            let answer = DecideApprovalReply {
                ok: applied.is_some(),
                error_code: if applied.is_some() { "" } else { "not_applied" }.into(),
                message: String::new(),
                status: if applied.is_some() { status } else { "" }.into(),
                approval_json: applied.map(|r| r.approval.clone()).unwrap_or_default(),
            };
            self.answer(to, answer).await;
        }
        if matches!(row, Ok(Some(_))) {
            self.stop_listening(listening).await;
        }
        decided(row?.map(|r| (Approval::of(r.id, r.status, r.reason, r.decided_by), r.base)))
    }

    /// A decision brought to this replica for the pending Approval `approval` of `call` (see
    /// [`agentscope_bus::subjects::session_decide`]): recorded here, and an allowed call started
    /// in the same statement (made ready meanwhile, as after a nudge) and run. `None` when it
    /// did not apply: the record says what happened instead.
    async fn decided_here(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
        approval: Uuid,
        m: async_nats::Message,
        listening: &mut Listening,
    ) -> Result<Option<Brought>, Stop> {
        let req = match DecideApproval::decode(m.payload.as_ref()) {
            Ok(req) => req,
            Err(_) => {
                if let Some(to) = m.reply {
                    self.answer(to, not_applied("invalid")).await;
                }
                return Ok(None);
            }
        };
        if !req.allow {
            return Ok(
                match self
                    .decide_and_start(call, approval, &req, m.reply, listening)
                    .await?
                {
                    Decided::Read(a) => a.map(Brought::Decided),
                    Decided::Started => None,
                },
            );
        }
        let (decided, ran) = self
            .run_once_started(
                p,
                input_id,
                call,
                self.decide_and_start(call, approval, &req, m.reply, listening),
                |d| matches!(d, Decided::Started),
            )
            .await;
        match decided? {
            Decided::Started => {
                let (out, ended) = ran?;
                self.commit(ended).await?;
                Ok(Some(Brought::Ran(out)))
            }
            Decided::Read(a) => Ok(a.map(Brought::Decided)),
        }
    }

    /// Listens for decisions brought here for the Approval `approval` (see [`Self::decided_here`]).
    /// Without the subscription, the gateway decides by the record and nudges, as it does for a
    /// call on a Worker.
    async fn listen(&self, listening: &mut Listening, approval: Uuid) {
        let subject = agentscope_bus::subjects::session_decide(&approval.to_string());
        match self.r.nats.subscribe(subject).await {
            Ok(sub) => *listening = Some((approval, sub)),
            Err(e) => tracing::warn!(error = %e, session_id = %self.id, "listen for a decision"),
        }
    }

    /// Stops listening for decisions brought here (the call's wait is over): those already
    /// received are answered as not applied, so their gateways decide by the record at once
    /// (where the Approval is decided) instead of waiting for an answer.
    async fn stop_listening(&self, listening: &mut Listening) {
        let Some((_, mut sub)) = listening.take() else {
            return;
        };
        let _ = sub.unsubscribe().await;
        while let Some(Some(m)) = futures::FutureExt::now_or_never(sub.next()) {
            if let Some(to) = m.reply {
                self.answer(to, not_applied("not_applied")).await;
            }
        }
    }

    async fn answer(&self, to: async_nats::Subject, answer: DecideApprovalReply) {
        if let Err(e) = self.r.nats.publish(to, answer.encode_to_vec().into()).await {
            tracing::warn!(error = %e, session_id = %self.id, "answer a decision");
        }
    }

    /// Waits for the Approval of `call` (asking the scheduler to record it, idempotently), then
    /// runs the call or reports the deny to the model.
    pub(super) async fn await_decision(
        &self,
        p: &Pinned,
        input_id: Uuid,
        call: &ToolCallReq,
    ) -> Result<(ToolOutput, bool), Stop> {
        let request = agentscope_schemas::v1::ToolRequest {
            request_id: call.id.clone(),
            attempt_id: String::new(),
            session_id: self.id.to_string(),
            tool_name: call.name.clone(),
            input_json: call.input.to_string(),
            lease_token: self.token as u64,
            requested_at_ms: agentscope_bus::now_ms(),
            timeout_ms: p
                .policy
                .approval_timeout_secs
                .unwrap_or(600)
                .saturating_mul(1000),
        };
        // Without a Worker to wait for, an allowed call starts in the statement that reads its
        // decision (see `start_if_allowed`).
        let at_once = !super::calls::waits_for_worker(p, call);
        let mut asked_at: Option<tokio::time::Instant> = None;
        // The first read rarely finds the decision; a read after a nudge of this session
        // (a decision's, usually) has the call get ready while it reads (and starts it).
        self.r.take_nudge(self.id);
        let mut nudged = false;
        // A call started here listens for its decision itself (see `decided_here`) until it
        // leaves this wait: under its Approval's id, known before the scheduler records it
        // (or, for one recorded otherwise, as read).
        let mut decisions: Listening = None;
        if at_once {
            let id = agentscope_domain::session_approval_id(self.id, &call.id);
            self.listen(&mut decisions, id).await;
        }
        let (status, reason, decided_by) = loop {
            // Listening before reading: a decision's nudge that arrives during the read wakes
            // the wait below instead of being missed until the next poll.
            let news = self.r.news.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            let row = if at_once {
                let (decided, ran) = if nudged {
                    let listening = &mut decisions;
                    let read = async move {
                        let d = self.start_if_allowed(call).await;
                        if matches!(d, Ok(Decided::Started)) {
                            self.stop_listening(listening).await;
                        }
                        d
                    };
                    let (decided, ran) = self
                        .run_once_started(p, input_id, call, read, |d| {
                            matches!(d, Decided::Started)
                        })
                        .await;
                    (decided?, Some(ran))
                } else {
                    (self.start_if_allowed(call).await?, None)
                };
                match decided {
                    Decided::Started => {
                        self.stop_listening(&mut decisions).await;
                        let (out, ended) = match ran {
                            Some(ran) => ran?,
                            None => self.run_started(p, input_id, call, None).await?,
                        };
                        self.commit(ended).await?;
                        return Ok((out, false));
                    }
                    Decided::Read(row) => row,
                }
            } else {
                // Under a share lock, as in `start_if_allowed`: a decision still committing is
                // waited for.
                sqlx::query!(
                    "SELECT id, status, reason, decided_by FROM approvals WHERE session_id = $1 AND request_id = $2 FOR SHARE",
                    self.id.to_string(),
                    &call.id,
                )
                .fetch_optional(&self.r.db)
                .await?
                .map(|r| Approval {
                    id: r.id,
                    status: r.status,
                    reason: r.reason,
                    decided_by: r.decided_by,
                })
            };
            match row {
                Some(a) if a.status != "pending" => break (a.status, a.reason, a.decided_by),
                Some(a) if at_once && decisions.as_ref().is_none_or(|(id, _)| *id != a.id) => {
                    self.stop_listening(&mut decisions).await;
                    self.listen(&mut decisions, a.id).await;
                }
                Some(_) => {}
                None if asked_at.is_none_or(|t| t.elapsed() > Duration::from_secs(2)) => {
                    self.r.ask(&request).await;
                    asked_at = Some(tokio::time::Instant::now());
                }
                None => {}
            }
            let brought = match decisions.as_mut() {
                Some((approval, sub)) => tokio::select! {
                    _ = tokio::time::timeout(Duration::from_millis(500), news) => None,
                    m = sub.next() => match m {
                        Some(m) => Some((*approval, m)),
                        // The subscription is gone: the gateway decides by the record.
                        None => {
                            decisions = None;
                            None
                        }
                    },
                },
                None => {
                    let _ = tokio::time::timeout(Duration::from_millis(500), news).await;
                    None
                }
            };
            if let Some((approval, m)) = brought {
                match self
                    .decided_here(p, input_id, call, approval, m, &mut decisions)
                    .await?
                {
                    Some(Brought::Ran(out)) => return Ok((out, false)),
                    Some(Brought::Decided(a)) => break (a.status, a.reason, a.decided_by),
                    // Read the record again at once.
                    None => {
                        nudged = false;
                        continue;
                    }
                }
            }
            nudged = self.r.take_nudge(self.id);
        };
        self.stop_listening(&mut decisions).await;
        let allowed = status == "allowed";
        let decided = json!({"call_id": call.id, "allow": allowed, "status": status, "reason": reason, "decided_by": decided_by});
        if allowed {
            return self.execute(p, input_id, call, Some(decided)).await;
        }
        let out = ToolError::ToolDenied.output(format!(
            "the approval was {status}{}",
            reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        ));
        let mut b = Batch::of(input_id);
        b.ended.push((
            call.id.clone(),
            CallStatus::Denied,
            out.output.clone(),
            true,
        ));
        b.status(SessionStatus::Running, "");
        b.result(call, &out);
        b.event("approval_decided", decided);
        b.event(
            "tool_denied",
            json!({"call_id": call.id, "tool": call.name, "input": call.input, "reason": out.output}),
        );
        self.write(b).await?;
        Ok((out, true))
    }
}
