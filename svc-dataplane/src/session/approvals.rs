//! A call the policy says to ask about: the tool request published for the scheduler to record
//! as an Approval, the wait for its decision, then the call run or the deny reported.

use super::journal::{Batch, CallStatus};
use super::pinned::Pinned;
use super::{Runner, Session, Stop};
use crate::model::ToolCallReq;
use crate::tools::{ToolError, ToolOutput};
use agentscope_domain::SessionStatus;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

impl Runner {
    /// Publishes a tool request for the scheduler to record as an Approval (idempotent).
    pub(super) async fn ask(&self, req: &agentscope_schemas::v1::ToolRequest) {
        use agentscope_schemas::Message as _;
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

/// What [`Session::start_if_allowed`] found.
enum Decided {
    /// The call was allowed and is now journaled `started`, with its decision.
    Started,
    /// Not allowed (yet): the Approval's status, reason and decider, if it is recorded.
    Read(Option<(String, Option<String>, Option<String>)>),
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
        let row = sqlx::query!(
            r#"WITH ap AS (
    SELECT status, reason, decided_by FROM approvals WHERE session_id = $1::uuid::text AND request_id = $3
    FOR SHARE
), fence AS (
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
SELECT ap.status AS "status!", ap.reason AS "reason?", ap.decided_by AS "decided_by?",
    (SELECT base FROM fence) AS "base?"
FROM ap"#,
            self.id,
            self.token,
            &call.id,
            tool_call,
        )
        .fetch_optional(&self.r.db)
        .await?;
        Ok(match row {
            Some(r) if r.base.is_some() => Decided::Started,
            Some(r) if r.status == "allowed" => return Err(Stop::Fenced),
            Some(r) => Decided::Read(Some((r.status, r.reason, r.decided_by))),
            None => Decided::Read(None),
        })
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
        let (status, reason, decided_by) = loop {
            // Listening before reading: a decision's nudge that arrives during the read wakes
            // the wait below instead of being missed until the next poll.
            let news = self.r.news.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            let row = if at_once {
                let (decided, ran) = if nudged {
                    let (decided, ran) = self
                        .run_once_started(p, input_id, call, self.start_if_allowed(call), |d| {
                            matches!(d, Decided::Started)
                        })
                        .await;
                    (decided?, Some(ran))
                } else {
                    (self.start_if_allowed(call).await?, None)
                };
                match decided {
                    Decided::Started => {
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
                    "SELECT status, reason, decided_by FROM approvals WHERE session_id = $1 AND request_id = $2 FOR SHARE",
                    self.id.to_string(),
                    &call.id,
                )
                .fetch_optional(&self.r.db)
                .await?
                .map(|r| (r.status, r.reason, r.decided_by))
            };
            match row {
                Some((status, reason, by)) if status != "pending" => break (status, reason, by),
                Some(_) => {}
                None if asked_at.is_none_or(|t| t.elapsed() > Duration::from_secs(2)) => {
                    self.r.ask(&request).await;
                    asked_at = Some(tokio::time::Instant::now());
                }
                None => {}
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), news).await;
            nudged = self.r.take_nudge(self.id);
        };
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
