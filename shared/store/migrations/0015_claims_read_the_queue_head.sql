-- writer: svc-scheduler. A claim reads the queue's head, not the whole queue.
--
-- `claim_attempts` (migration 0014) picked its candidates with `ORDER BY not_before,
-- created_at LIMIT n` over `attempts_queued (pool_id, not_before)`: the index does not give
-- that order, so each claim read, joined and sorted every queued attempt of the pool before
-- taking the first few (with 2,000 queued, about 4,000 buffer reads per claim), and its batch's
-- UPDATE (`a.id = x.id AND a.status = 'queued'`) was planned as a hash join over the whole
-- queued index. A claim's cost grew with the backlog. The index now carries the claim's order,
-- so the candidates' read stops after the rows it locks, and the UPDATE finds its rows by
-- primary key. Every query the old index served has the same leading columns here.

DROP INDEX attempts_queued;
CREATE INDEX attempts_queued ON attempts (pool_id, not_before, created_at) WHERE status = 'queued';

-- Migration 0014's `claim_attempts`; its batch's UPDATE finds its rows by id alone.
CREATE OR REPLACE FUNCTION claim_attempts(
    p_host uuid, p_workspace uuid, p_free integer, p_held text[], p_ended text[],
    p_hashes text[], p_timeout bigint, p_timeout_source text, p_in_flight_ms bigint)
RETURNS TABLE (
    r_registered boolean, r_pool_id uuid, r_waiting bigint, r_recorded_ends text[],
    r_lost_offers boolean, r_reason text, r_ids uuid[], r_task_ids uuid[], r_numbers integer[],
    r_specs jsonb[], r_tokens bigint[], r_slots integer[])
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    c record;
    v_unrecorded text[];
    v_host_active bigint;
    v_want bigint;
    v_slots bigint;
    v_cand_ids uuid[] := '{}';
    v_cand_agents uuid[] := '{}';
    v_cand_limits integer[] := '{}';
    v_agents uuid[];
    v_scopes text[] := '{}';
    v_keys uuid[] := '{}';
    v_in_workspace bigint := 0;
    v_in_pool bigint := 0;
    v_in_host bigint := 0;
    v_agent_counts jsonb := '{}';
    v_agent_n bigint;
    v_ended_active bigint := 0;
    v_taken uuid[] := '{}';
    v_n bigint;
    i integer;
BEGIN
    SELECT hs.id, hs.pool_id, hs.capacity, hs.capabilities,
           p.max_concurrency AS pool_limit, w.max_concurrency AS workspace_limit,
           ARRAY(SELECT e->>'name' FROM jsonb_array_elements(hs.providers) e
                 WHERE e->'installed' = 'true'::jsonb AND e->'logged_in' = 'true'::jsonb) AS ready
      INTO h
      FROM hosts hs JOIN workspaces w ON w.id = hs.workspace_id LEFT JOIN pools p ON p.id = hs.pool_id
     WHERE hs.id = p_host AND hs.workspace_id = p_workspace;
    IF NOT FOUND THEN
        r_registered := false;
        RETURN NEXT;
        RETURN;
    END IF;
    r_registered := true;
    r_pool_id := h.pool_id;
    r_ids := '{}'; r_task_ids := '{}'; r_numbers := '{}'; r_specs := '{}'; r_tokens := '{}';
    r_slots := '{}';
    -- The ends the host lists that are not recorded yet (a first look, unlocked); the others
    -- are, and an ended attempt never becomes active again.
    v_unrecorded := ARRAY(SELECT a.id::text FROM attempts a WHERE a.host_id = p_host
                            AND a.status IN ('claimed', 'running') AND a.id::text = ANY(p_ended));
    r_recorded_ends := ARRAY(SELECT DISTINCT e FROM unnest(p_ended) e
                              WHERE NOT (e = ANY(v_unrecorded)) ORDER BY e);
    IF h.pool_id IS NULL THEN
        r_waiting := 0;
        r_lost_offers := false;
        r_reason := 'no_pool';
        RETURN NEXT;
        RETURN;
    END IF;
    r_lost_offers := EXISTS (SELECT 1 FROM attempts a WHERE a.host_id = p_host AND a.status = 'claimed'
                              AND NOT (a.id::text = ANY(p_held))
                              AND a.claimed_at < clock_timestamp()
                                                 - make_interval(secs => p_in_flight_ms / 1000.0));
    r_waiting := (SELECT count(*) FROM (
                      SELECT 1 FROM attempts a
                       WHERE a.status = 'queued' AND a.workspace_id = p_workspace AND a.pool_id = h.pool_id
                         AND a.not_before <= now() AND a.required_capabilities <@ h.capabilities
                         AND a.provider = ANY(h.ready)
                       LIMIT 100) q);
    IF r_lost_offers THEN
        r_reason := 'lost_offers';
        RETURN NEXT;
        RETURN;
    END IF;
    -- The host's capacity counts what runs there: not the attempts it says ended whose ends
    -- are not recorded yet (its free slots already say so).
    v_host_active := COALESCE((SELECT ac.active FROM attempt_counts_now ac
                                WHERE ac.scope = 'host' AND ac.id = p_host), 0);
    v_want := LEAST(p_free, h.capacity - (v_host_active - cardinality(v_unrecorded)));
    IF v_want <= 0 OR r_waiting = 0 THEN
        r_reason := CASE WHEN r_waiting = 0 THEN 'no_work' ELSE 'host_full' END;
        RETURN NEXT;
        RETURN;
    END IF;

    -- Candidates, locked: concurrent claims skip them and take the next ones. A few more than
    -- wanted, for those an agent limit turns down.
    FOR c IN
        SELECT a.id, a.agent_id, b.max_concurrency AS agent_limit
          FROM attempts a LEFT JOIN bindings b ON b.id = a.binding_id
         WHERE a.status = 'queued' AND a.workspace_id = p_workspace AND a.pool_id = h.pool_id
           AND a.not_before <= now() AND a.required_capabilities <@ h.capabilities
           AND a.provider = ANY(h.ready)
         ORDER BY a.not_before, a.created_at
         LIMIT LEAST(v_want + 8, 64)
           FOR UPDATE OF a SKIP LOCKED
    LOOP
        v_cand_ids := v_cand_ids || c.id;
        v_cand_agents := v_cand_agents || c.agent_id;
        v_cand_limits := v_cand_limits || c.agent_limit;
    END LOOP;
    IF cardinality(v_cand_ids) = 0 THEN
        r_waiting := 0;
        r_reason := 'no_work';
        RETURN NEXT;
        RETURN;
    END IF;

    -- The counters of every limit that applies, locked in the trigger's order.
    IF h.workspace_limit IS NOT NULL THEN
        v_scopes := v_scopes || 'workspace'::text;
        v_keys := v_keys || p_workspace;
    END IF;
    IF h.pool_limit IS NOT NULL THEN
        v_scopes := v_scopes || 'pool'::text;
        v_keys := v_keys || h.pool_id;
    END IF;
    v_agents := ARRAY(SELECT DISTINCT ag FROM unnest(v_cand_agents, v_cand_limits) x(ag, lim)
                       WHERE lim IS NOT NULL ORDER BY ag);
    v_scopes := v_scopes || array_fill('agent'::text, ARRAY[cardinality(v_agents)]);
    v_keys := v_keys || v_agents;
    v_scopes := v_scopes || 'host'::text;
    v_keys := v_keys || p_host;
    FOR c IN
        INSERT INTO attempt_counts (scope, id, active)
        SELECT s, k, 0 FROM unnest(v_scopes, v_keys) WITH ORDINALITY AS x(s, k, n) ORDER BY n
        ON CONFLICT (scope, id) DO UPDATE SET active = attempt_counts.active
        RETURNING attempt_counts.scope, attempt_counts.id, attempt_counts.active
    LOOP
        CASE c.scope
            WHEN 'workspace' THEN v_in_workspace := c.active;
            WHEN 'pool' THEN v_in_pool := c.active;
            WHEN 'host' THEN v_in_host := c.active;
            ELSE v_agent_counts := v_agent_counts || jsonb_build_object(c.id::text, c.active);
        END CASE;
    END LOOP;
    -- After the fold (this statement reads a newer snapshot): an end the fold saw is out of
    -- both the counter and this count; one committed after the fold but before this count is
    -- in the counter and not subtracted here (one slot less, never one more); one committed
    -- later is in both.
    IF cardinality(v_unrecorded) > 0 THEN
        v_ended_active := (SELECT count(*) FROM attempts a WHERE a.host_id = p_host
                             AND a.status IN ('claimed', 'running') AND a.id::text = ANY(p_ended));
    END IF;
    v_slots := LEAST(v_want, h.capacity - (v_in_host - v_ended_active));

    FOR i IN 1 .. cardinality(v_cand_ids) LOOP
        EXIT WHEN v_slots <= 0;
        v_agent_n := COALESCE((v_agent_counts ->> v_cand_agents[i]::text)::bigint, 0);
        CONTINUE WHEN (v_cand_limits[i] IS NOT NULL AND v_agent_n >= v_cand_limits[i])
                   OR (h.pool_limit IS NOT NULL AND v_in_pool >= h.pool_limit)
                   OR (h.workspace_limit IS NOT NULL AND v_in_workspace >= h.workspace_limit);
        v_agent_counts := v_agent_counts || jsonb_build_object(v_cand_agents[i]::text, v_agent_n + 1);
        v_in_pool := v_in_pool + 1;
        v_in_workspace := v_in_workspace + 1;
        v_slots := v_slots - 1;
        v_taken := v_taken || v_cand_ids[i];
    END LOOP;
    IF cardinality(v_taken) = 0 THEN
        r_reason := 'limits';
        RETURN NEXT;
        RETURN;
    END IF;

    -- One statement for the whole batch, by primary key: this transaction has held every row
    -- of `v_taken` locked since the candidates' read, which took only rows that were queued
    -- when locked (a row another claim changed meanwhile is read again at the lock and left
    -- out), so nothing can have moved them out of `queued`. The counters locked above move once per scope below,
    -- not once per attempt through the trigger on `attempts`, which skips the rows this
    -- statement claims (the setting is this transaction's and is cleared right after). A spec
    -- without a run timeout of its own gets the deployment's.
    PERFORM set_config('agentscope.claim_counted', 'on', true);
    WITH u AS (
        UPDATE attempts a SET status = 'claimed', host_id = p_host,
               lease_token = nextval('lease_tokens'), claimed_at = clock_timestamp(),
               task_token_hash = p_hashes[x.n],
               spec = CASE WHEN jsonb_typeof(a.spec->'timeout_secs') = 'number'
                                AND a.spec->'timeout_secs' > '0'::jsonb THEN a.spec
                           ELSE a.spec || jsonb_build_object('timeout_secs', p_timeout,
                                                             'timeout_source', p_timeout_source) END
          FROM unnest(v_taken) WITH ORDINALITY AS x(id, n)
         WHERE a.id = x.id
        RETURNING a.id, a.task_id, a.number, a.spec, a.lease_token, x.n
    )
    SELECT array_agg(u.id ORDER BY u.n), array_agg(u.task_id ORDER BY u.n),
           array_agg(u.number ORDER BY u.n), array_agg(u.spec ORDER BY u.n),
           array_agg(u.lease_token ORDER BY u.n), array_agg(u.n::integer ORDER BY u.n)
      INTO r_ids, r_task_ids, r_numbers, r_specs, r_tokens, r_slots
      FROM u;
    PERFORM set_config('agentscope.claim_counted', '', true);
    v_n := COALESCE(cardinality(r_ids), 0);
    -- What the trigger would have added for each claimed attempt (`attempt_counts_add`, the same
    -- conditions), per scope, in the global order.
    IF v_n > 0 THEN
        INSERT INTO attempt_counts (scope, id, active)
        SELECT d.scope, d.id, d.n FROM (
            SELECT 1 AS o, 'workspace'::text AS scope, p_workspace AS id, v_n AS n
             WHERE EXISTS (SELECT 1 FROM workspaces WHERE id = p_workspace
                             AND max_concurrency IS NOT NULL)
            UNION ALL
            SELECT 2, 'pool', h.pool_id, v_n
             WHERE EXISTS (SELECT 1 FROM pools WHERE id = h.pool_id AND max_concurrency IS NOT NULL)
            UNION ALL
            SELECT 3, 'agent', a.agent_id, count(*) FROM attempts a
             WHERE a.id = ANY(r_ids)
               AND EXISTS (SELECT 1 FROM bindings WHERE agent_id = a.agent_id
                             AND max_concurrency IS NOT NULL)
             GROUP BY a.agent_id
            UNION ALL
            SELECT 4, 'host', p_host, v_n) d
        ORDER BY d.o, d.id
        ON CONFLICT (scope, id) DO UPDATE SET active = attempt_counts.active + EXCLUDED.active;
    END IF;
    r_waiting := GREATEST(r_waiting - COALESCE(cardinality(r_ids), 0), 0);
    RETURN NEXT;
END;
$$;
