//! The session's journal: every durable step (messages, tool-call rows, events, status, an
//! input's outcome) is one [`Batch`], written by one statement (in [`Session::write_on`]) that first checks this
//! replica's fencing token, so a fenced replica writes nothing.

use super::{Session, Stop};
use crate::model::{Message, ToolCallReq};
use crate::tools::ToolOutput;
use agentscope_domain::{InputOutcome, SessionStatus};
use serde_json::{Value, json};
use uuid::Uuid;

/// The rows of one durable step, written by one statement (in [`Session::write_on`]): one round trip and one
/// transaction that first checks the replica's fencing token and writes all of them, or nothing.
#[derive(Default)]
pub(super) struct Batch {
    /// The input the messages and new journal rows belong to.
    pub(super) input_id: Option<Uuid>,
    pub(super) events: Vec<(&'static str, Value)>,
    pub(super) messages: Vec<Value>,
    /// New tool-call journal rows: call, status, output.
    pub(super) journal: Vec<(String, String, Value, CallStatus, String, bool)>,
    /// A call moved from `awaiting_approval` to `started`: nothing is written unless it waited.
    pub(super) started: Option<String>,
    /// The ends of journaled calls: call id, status, output, is_error.
    pub(super) ended: Vec<(String, CallStatus, String, bool)>,
    /// The session's status and detail.
    pub(super) status: Option<(SessionStatus, String)>,
    /// The input's outcome: status, detail, iterations.
    pub(super) outcome: Option<(InputOutcome, String, i32)>,
}

/// Where a tool call is in the journal (`session_tool_calls.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CallStatus {
    /// Waits for an Approval; not run yet.
    AwaitingApproval,
    /// About to run or running: once committed, never run again (a read is read again).
    Started,
    /// Ran; its output is the result.
    Completed,
    /// Denied by policy, by an Approval, or not one of the agent's tools; never run.
    Denied,
    /// Found `started` on takeover and reported interrupted to the model.
    Interrupted,
}

impl CallStatus {
    pub(super) const ALL: [CallStatus; 5] = [
        Self::AwaitingApproval,
        Self::Started,
        Self::Completed,
        Self::Denied,
        Self::Interrupted,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::AwaitingApproval => "awaiting_approval",
            Self::Started => "started",
            Self::Completed => "completed",
            Self::Denied => "denied",
            Self::Interrupted => "interrupted",
        }
    }

    pub(super) fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

impl Batch {
    pub(super) fn of(input_id: Uuid) -> Batch {
        Batch {
            input_id: Some(input_id),
            ..Batch::default()
        }
    }

    pub(super) fn event(&mut self, kind: &'static str, payload: Value) {
        self.events.push((kind, payload));
    }

    pub(super) fn message(&mut self, m: &Message) {
        self.messages
            .push(serde_json::to_value(m).unwrap_or(Value::Null));
    }

    pub(super) fn journal(
        &mut self,
        call: &ToolCallReq,
        status: CallStatus,
        out: Option<&ToolOutput>,
    ) {
        self.journal.push((
            call.id.clone(),
            call.name.clone(),
            call.input.clone(),
            status,
            out.map(|o| o.output.clone()).unwrap_or_default(),
            out.is_some_and(|o| o.is_error),
        ));
    }

    pub(super) fn status(&mut self, status: SessionStatus, detail: &str) {
        self.status = Some((status, detail.to_string()));
    }

    /// Tool-call rows the batch inserts or ends.
    pub(super) fn rows(&self) -> usize {
        self.journal.len() + self.ended.len()
    }

    /// `later`'s rows after these, in one write (its status and outcome win).
    pub(super) fn append(&mut self, later: Batch) {
        debug_assert!(self.started.is_none() || later.started.is_none());
        self.input_id = later.input_id.or(self.input_id);
        self.events.extend(later.events);
        self.messages.extend(later.messages);
        self.journal.extend(later.journal);
        self.started = later.started.or(self.started.take());
        self.ended.extend(later.ended);
        self.status = later.status.or(self.status.take());
        self.outcome = later.outcome.or(self.outcome.take());
    }

    /// The result message of `call`.
    pub(super) fn result(&mut self, call: &ToolCallReq, out: &ToolOutput) {
        self.message(&Message::ToolResult {
            call_id: call.id.clone(),
            output: out.output.clone(),
            is_error: out.is_error,
        });
    }

    /// The input's outcome, the session's status and the `outcome` event.
    pub(super) fn finish(&mut self, status: InputOutcome, detail: &str, iterations: u32) {
        let input_id = self.input_id;
        // Finishing a turn is an outcome, never the acceptance of the Issue.
        self.status(status.session_status(), detail);
        self.outcome = Some((status, detail.to_string(), iterations as i32));
        self.event(
            "outcome",
            json!({"input_id": input_id, "status": status.as_str(), "detail": detail, "iterations": iterations}),
        );
    }
}

/// A call's end, not written yet: its batch, and the memory note it stores with it.
pub(super) struct Ended {
    pub(super) batch: Batch,
    pub(super) note: Option<crate::tools::MemoryNote>,
}

impl Session<'_> {
    /// Writes `b` if this replica still holds the session.
    pub(super) async fn write(&self, b: Batch) -> Result<(), Stop> {
        self.write_on(&self.r.db, b).await
    }

    /// [`Self::write`] on a connection (inside a transaction that holds more of the step).
    pub(super) async fn write_on<'e>(
        &self,
        on: impl sqlx::PgExecutor<'e>,
        b: Batch,
    ) -> Result<(), Stop> {
        let (kinds, payloads): (Vec<&str>, Vec<Value>) = b.events.into_iter().unzip();
        let mut j = (vec![], vec![], vec![], vec![], vec![], vec![]);
        for (call_id, tool, input, status, output, is_error) in b.journal {
            j.0.push(call_id);
            j.1.push(tool);
            j.2.push(input);
            j.3.push(status.as_str());
            j.4.push(output);
            j.5.push(is_error);
        }
        let (status, detail) = b.status.map(|(s, d)| (s.as_str(), d)).unzip();
        let mut e = (vec![], vec![], vec![], vec![]);
        for (call_id, status, output, is_error) in b.ended {
            e.0.push(call_id);
            e.1.push(status.as_str());
            e.2.push(output);
            e.3.push(is_error);
        }
        let (outcome, outcome_detail, iterations) = match b.outcome {
            Some((s, d, n)) => (Some(s.as_str()), Some(d), Some(n)),
            None => (None, None, None),
        };
        // The batch in one statement. The ends are found by the primary key (`call_id = ANY`),
        // not by a join with their arrays, which the planner may make a scan of the session's
        // every call. `fence` takes the session's row (`FOR UPDATE` by its
        // update) only if this replica's token still holds it (and, for an approved call, only
        // if the call still waits), and reserves the events' sequence numbers; every other part
        // reads `fence`, so a fenced replica writes nothing. Data-modifying CTEs run once, in
        // one snapshot and one transaction.
        let row = sqlx::query_scalar!(
            r#"WITH fence AS (
    UPDATE session_state SET last_seq = last_seq + cardinality($3::text[]),
        status = COALESCE($13::text, status), detail = COALESCE($14::text, detail), updated_at = now()
    WHERE session_id = $1 AND lease_token = $2
      AND ($15::text IS NULL OR EXISTS (SELECT 1 FROM session_tool_calls
          WHERE session_id = $1 AND call_id = $15::text AND status = 'awaiting_approval'))
    RETURNING last_seq - cardinality($3::text[]) AS base
), events AS (
    INSERT INTO session_events (session_id, seq, kind, payload)
    SELECT $1, fence.base + e.n, e.kind, e.payload
    FROM fence, unnest($3::text[], $4::jsonb[]) WITH ORDINALITY AS e(kind, payload, n)
), messages AS (
    INSERT INTO session_messages (session_id, seq, input_id, message)
    SELECT $1, (SELECT COALESCE(max(seq), 0) FROM session_messages WHERE session_id = $1) + m.n, $5::uuid, m.message
    FROM fence, unnest($6::jsonb[]) WITH ORDINALITY AS m(message, n)
), journal AS (
    INSERT INTO session_tool_calls (session_id, call_id, input_id, tool, input, status, output, is_error, finished_at)
    SELECT $1, j.call_id, $5::uuid, j.tool, j.input, j.status,
        CASE WHEN j.status IN ('started', 'awaiting_approval') THEN NULL ELSE j.output END, j.is_error,
        CASE WHEN j.status = 'started' THEN NULL ELSE now() END
    FROM fence, unnest($7::text[], $8::text[], $9::jsonb[], $10::text[], $11::text[], $12::bool[])
        AS j(call_id, tool, input, status, output, is_error)
), started AS (
    UPDATE session_tool_calls c SET status = 'started' FROM fence
    WHERE c.session_id = $1 AND c.call_id = $15::text AND c.status = 'awaiting_approval'
), ended AS (
    UPDATE session_tool_calls c SET status = ($16::text[])[array_position($19::text[], c.call_id)],
        output = ($17::text[])[array_position($19::text[], c.call_id)],
        is_error = ($18::bool[])[array_position($19::text[], c.call_id)], finished_at = now()
    FROM fence WHERE c.session_id = $1 AND c.call_id = ANY($19::text[])
), outcome AS (
    INSERT INTO session_outcomes (input_id, session_id, status, detail, iterations)
    SELECT $5::uuid, $1, $20::text, $21::text, $22::int4 FROM fence WHERE $20::text IS NOT NULL
    ON CONFLICT (input_id) DO NOTHING
), answered AS (
    UPDATE session_inputs i SET answered = true FROM fence
    WHERE i.id = $5::uuid AND $20::text IS NOT NULL AND NOT i.answered
)
SELECT base FROM fence"#,
            self.id,
            self.token,
            &kinds as &[&str],
            &payloads as &[Value],
            b.input_id,
            &b.messages as &[Value],
            &j.0 as &[String],
            &j.1 as &[String],
            &j.2 as &[Value],
            &j.3 as &[&str],
            &j.4 as &[String],
            &j.5 as &[bool],
            status,
            detail,
            b.started,
            &e.1 as &[&str],
            &e.2 as &[String],
            &e.3 as &[bool],
            &e.0 as &[String],
            outcome,
            outcome_detail,
            iterations,
        )
        .fetch_optional(on)
        .await?;
        match row {
            Some(_) => Ok(()),
            None => Err(Stop::Fenced),
        }
    }

    /// Writes a call's end (and commits its memory note with it).
    pub(super) async fn commit(&self, ended: Ended) -> Result<(), Stop> {
        match ended.note {
            Some(note) => {
                use sqlx::Connection as _;
                let mut conn = self.r.db.acquire().await?;
                let mut tx = conn.begin().await?;
                note.insert(&mut tx).await?;
                self.write_on(&mut *tx, ended.batch).await?;
                tx.commit().await?;
                conn.release();
                Ok(())
            }
            None => self.write(ended.batch).await,
        }
    }

    pub(super) async fn event(&self, kind: &'static str, payload: Value) -> Result<(), Stop> {
        let mut b = Batch::default();
        b.event(kind, payload);
        self.write(b).await
    }

    pub(super) async fn set_status(&self, status: SessionStatus, detail: &str) -> Result<(), Stop> {
        let mut b = Batch::default();
        b.status(status, detail);
        self.write(b).await
    }

    pub(super) async fn history(&self) -> Result<Vec<(Uuid, Message)>, Stop> {
        let rows = sqlx::query!(
            "SELECT input_id, message FROM session_messages WHERE session_id = $1 ORDER BY seq",
            self.id,
        )
        .fetch_all(&self.r.db)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| {
                serde_json::from_value(r.message)
                    .ok()
                    .map(|m| (r.input_id, m))
            })
            .collect())
    }

    /// A session this replica will not run (its environment is not enabled): the state says so
    /// with a stable code, once, and its inputs stay unanswered until the deployment changes.
    pub(super) async fn refuse(&self, reason: &str) -> Result<(), Stop> {
        // The status and its diagnostic commit together.
        let mut b = Batch::default();
        b.status(SessionStatus::EnvironmentNotAllowed, reason);
        b.event(
            "diagnostic",
            json!({"code": "environment_not_allowed", "message": reason}),
        );
        self.write(b).await
    }
}
