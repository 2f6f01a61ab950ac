-- Task-scoped credentials: one per attempt, valid only while the attempt is claimed or running.
-- writer: svc-scheduler (issued with the claim).
ALTER TABLE attempts ADD COLUMN task_token_hash text UNIQUE;

-- Artifact content lives with its metadata, in one transaction and one backup.
-- writer: svc-gateway.
ALTER TABLE artifacts ADD COLUMN content bytea NOT NULL DEFAULT '\x';
ALTER TABLE artifacts ADD COLUMN author text NOT NULL DEFAULT 'api';
CREATE INDEX artifacts_issue ON artifacts (issue_id, created_at);
CREATE INDEX artifacts_task ON artifacts (task_id, created_at);
