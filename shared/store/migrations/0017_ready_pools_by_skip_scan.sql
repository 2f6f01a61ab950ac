-- writer: svc-scheduler (its sweeper reads this). The pools with ready work, found by a skip
-- scan of the queue's index: about two entries read per pool, not one per queued attempt.
--
-- The sweeper nudged every pool with ready work once a second from `SELECT DISTINCT pool_id
-- FROM attempts WHERE status = 'queued' AND ... not_before <= now()`, which reads every queued
-- attempt's entry of `attempts_queued` (or, planned while the table was small, scans the whole
-- table): a cost per second that grew with the backlog. Here each step takes the next pool
-- after the previous one from `attempts_queued (pool_id, not_before, created_at)`, then checks
-- that pool's oldest `not_before`. Without sequential scans, which statistics of a young table
-- would choose (as for `claim_attempts`, migration 0016).
CREATE FUNCTION pools_with_ready_work() RETURNS SETOF uuid
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    WITH RECURSIVE p(pool_id) AS (
        (SELECT a.pool_id FROM attempts a
          WHERE a.status = 'queued' AND a.pool_id IS NOT NULL
          ORDER BY a.pool_id LIMIT 1)
        UNION ALL
        SELECT (SELECT a.pool_id FROM attempts a
                 WHERE a.status = 'queued' AND a.pool_id > p.pool_id
                 ORDER BY a.pool_id LIMIT 1)
          FROM p WHERE p.pool_id IS NOT NULL
    )
    SELECT p.pool_id FROM p
     WHERE p.pool_id IS NOT NULL
       -- A subquery of its own (an EXISTS would be planned as a join reading every entry).
       AND (SELECT true FROM attempts a
             WHERE a.status = 'queued' AND a.pool_id = p.pool_id AND a.not_before <= now()
             LIMIT 1)
$$;
