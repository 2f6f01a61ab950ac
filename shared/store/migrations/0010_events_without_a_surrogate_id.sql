-- writer: svc-scheduler (the recorder).
--
-- `execution_events.id` (bigserial, unique) was never read: events are found and ordered by
-- their key, (attempt_id, seq). Every recorded event still drew a value from its sequence and
-- added an entry to its unique index: without them PostgreSQL spends about 13 % less CPU per
-- recorded event and W2 ingest records about 18 % more events per second (docs/BENCHMARKS.md,
-- session 17). Dropping the column changes the catalog only (no rewrite); its index and sequence
-- go with it.
ALTER TABLE execution_events DROP COLUMN id;
