-- writer: svc-scheduler.
--
-- A hosted attempt's approval decision is committed, then published to its host's control
-- stream. A scheduler that died or lost NATS between the two left the decision in the record and
-- the attempt waiting for it until its run timeout, and a client's retry of the same decision
-- was answered "already decided" without sending anything. `undelivered` is set with such a
-- decision and cleared once the stream has acknowledged its command; the sweeper sends what
-- stays undelivered, and so does a repeat of the decision.
ALTER TABLE approvals ADD COLUMN undelivered boolean NOT NULL DEFAULT false;
CREATE INDEX approvals_undelivered ON approvals (decided_at) WHERE undelivered;
