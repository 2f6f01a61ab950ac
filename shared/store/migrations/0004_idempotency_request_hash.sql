-- An idempotency key names one request: the hash of the request it was first used with is kept
-- with it, and the same key with another request is refused (409 idempotency_conflict).
-- Rows made before this migration have no hash and are taken as the same request.
ALTER TABLE tasks ADD COLUMN request_hash text;
ALTER TABLE sessions ADD COLUMN request_hash text;
ALTER TABLE session_inputs ADD COLUMN request_hash text;
