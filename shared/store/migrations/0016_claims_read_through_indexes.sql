-- writer: svc-scheduler. Every statement of a claim reads through an index.
--
-- A claim's statements are planned once per connection and kept. In a database that is young or
-- growing fast, the statistics still describe a small `attempts` table when they are planned,
-- and for a small table a sequential scan looks cheapest: the batch's `UPDATE ... FROM
-- unnest(v_taken) WHERE a.id = x.id` (migration 0015) was planned as a hash join over a scan of
-- the whole table, 4,008 rows read to claim 7, and kept that plan as the table grew. Every row a
-- claim reads is reachable by an index (the queue's head, the host's active attempts, rows by
-- id, the counters by scope), so the function plans without sequential scans whatever the
-- statistics say.
ALTER FUNCTION claim_attempts(uuid, uuid, integer, text[], text[], text[], bigint, text, bigint)
    SET enable_seqscan = off;
