-- writer: svc-scheduler (the recorder and the sweeper, through the trigger on `attempts`), and
-- the claimers (svc-scheduler, svc-gateway), which fold what the others wrote.
--
-- An attempt's end no longer locks the counters of its scopes. It used to update each counter
-- row (migration 0005's trigger), so the recorder's batch of ends locked the counters of every
-- host whose attempts it ended, in the global order, and waited for each claim in flight on
-- any of them; each claim in turn waited for the batch. In W1 bulk (4 hosts × 32 slots) the
-- recorder spent most of its time waiting on those locks, and claims waited on it about as long
-- as they ran (docs/BENCHMARKS.md, session 20).
--
-- Now an end appends a row per scope to `attempt_count_deltas` (no lock taken, nothing to
-- wait for), and the counter is its row in `attempt_counts` plus its pending deltas. Whoever
-- locks a counter to decide on it (a claim, direct dispatch: `ON CONFLICT DO UPDATE SET active =
-- attempt_counts.active`) folds the pending deltas into the row under that lock, in the same
-- statement, by the trigger below; so a claim still decides on an exact count. A delta
-- committed after the fold's snapshot stays for the next fold: until then the end counts as
-- still active, which only ever makes a claim take less, never more. Increments stay where
-- they were: in the claimer's transaction, under the lock it already holds.
CREATE TABLE attempt_count_deltas (
    scope text NOT NULL,
    id    uuid NOT NULL,
    delta integer NOT NULL
);
CREATE INDEX attempt_count_deltas_scope ON attempt_count_deltas (scope, id);

-- A counter as it stands: its row and what is pending for it. For reads that decide nothing
-- under a lock (a first look, an idle host's pick, tests and operators).
CREATE VIEW attempt_counts_now AS
SELECT c.scope, c.id,
       GREATEST(c.active + COALESCE((SELECT sum(d.delta) FROM attempt_count_deltas d
                                      WHERE d.scope = c.scope AND d.id = c.id), 0), 0)::integer
           AS active
  FROM attempt_counts c;

-- Folds a counter's pending deltas into its row when a claimer locks it without changing it
-- (the trigger's WHEN): the deltas it sees are deleted and added in the same statement.
CREATE FUNCTION attempt_counts_fold() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v bigint;
BEGIN
    WITH d AS (
        DELETE FROM attempt_count_deltas WHERE scope = NEW.scope AND id = NEW.id RETURNING delta
    )
    SELECT sum(delta) INTO v FROM d;
    IF v IS NOT NULL THEN
        NEW.active := GREATEST(NEW.active + v, 0);
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER attempt_counts_fold
    BEFORE UPDATE ON attempt_counts
    FOR EACH ROW WHEN (OLD.active = NEW.active)
    EXECUTE FUNCTION attempt_counts_fold();

-- Migration 0005's function, with a decrement appended as deltas instead of updating (and so
-- locking) the counters. Increments still update the rows: their callers hold those locks.
CREATE OR REPLACE FUNCTION attempt_counts_add(a attempts, d integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF d < 0 THEN
        INSERT INTO attempt_count_deltas (scope, id, delta)
        SELECT s, k, d FROM (VALUES
            ('workspace', a.workspace_id,
             EXISTS (SELECT 1 FROM workspaces WHERE id = a.workspace_id AND max_concurrency IS NOT NULL)),
            ('pool', a.pool_id,
             a.pool_id IS NOT NULL
             AND EXISTS (SELECT 1 FROM pools WHERE id = a.pool_id AND max_concurrency IS NOT NULL)),
            ('agent', a.agent_id,
             EXISTS (SELECT 1 FROM bindings WHERE agent_id = a.agent_id AND max_concurrency IS NOT NULL)),
            ('host', a.host_id, a.host_id IS NOT NULL)) AS x(s, k, counted)
        WHERE counted;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM workspaces WHERE id = a.workspace_id AND max_concurrency IS NOT NULL) THEN
        INSERT INTO attempt_counts (scope, id, active) VALUES ('workspace', a.workspace_id, GREATEST(d, 0))
        ON CONFLICT (scope, id) DO UPDATE SET active = GREATEST(attempt_counts.active + d, 0);
    END IF;
    IF a.pool_id IS NOT NULL
       AND EXISTS (SELECT 1 FROM pools WHERE id = a.pool_id AND max_concurrency IS NOT NULL) THEN
        INSERT INTO attempt_counts (scope, id, active) VALUES ('pool', a.pool_id, GREATEST(d, 0))
        ON CONFLICT (scope, id) DO UPDATE SET active = GREATEST(attempt_counts.active + d, 0);
    END IF;
    IF EXISTS (SELECT 1 FROM bindings WHERE agent_id = a.agent_id AND max_concurrency IS NOT NULL) THEN
        INSERT INTO attempt_counts (scope, id, active) VALUES ('agent', a.agent_id, GREATEST(d, 0))
        ON CONFLICT (scope, id) DO UPDATE SET active = GREATEST(attempt_counts.active + d, 0);
    END IF;
    IF a.host_id IS NOT NULL THEN
        INSERT INTO attempt_counts (scope, id, active) VALUES ('host', a.host_id, GREATEST(d, 0))
        ON CONFLICT (scope, id) DO UPDATE SET active = GREATEST(attempt_counts.active + d, 0);
    END IF;
END;
$$;

-- Migration 0007's `idle_host`, reading the host's counter with its pending deltas.
CREATE OR REPLACE FUNCTION idle_host(
    p_workspace uuid, p_pool uuid, p_provider text, p_caps text[], p_fresh_ms bigint)
RETURNS uuid
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
    SELECT hs.id
      FROM hosts hs LEFT JOIN attempt_counts_now ac ON ac.scope = 'host' AND ac.id = hs.id
     WHERE hs.workspace_id = p_workspace AND hs.pool_id = p_pool
       AND hs.last_seen_at > clock_timestamp() - make_interval(secs => p_fresh_ms / 1000.0)
       AND COALESCE(ac.active, 0) = 0 AND hs.capacity > 0
       AND p_caps <@ hs.capabilities
       AND EXISTS (SELECT 1 FROM jsonb_array_elements(hs.providers) e
                    WHERE e->>'name' = p_provider AND e->'installed' = 'true'::jsonb
                      AND e->'logged_in' = 'true'::jsonb)
     ORDER BY random()
     LIMIT 1);
END;
$$;

-- Migration 0007's `claim_attempts`, its first (unlocked) look at the host's counter reading
-- the pending deltas too; the locked read below folds them.
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

    -- One statement for the whole batch; the trigger on `attempts` moves the counters locked
    -- above. A spec without a run timeout of its own gets the deployment's.
    WITH u AS (
        UPDATE attempts a SET status = 'claimed', host_id = p_host,
               lease_token = nextval('lease_tokens'), claimed_at = clock_timestamp(),
               task_token_hash = p_hashes[x.n],
               spec = CASE WHEN jsonb_typeof(a.spec->'timeout_secs') = 'number'
                                AND a.spec->'timeout_secs' > '0'::jsonb THEN a.spec
                           ELSE a.spec || jsonb_build_object('timeout_secs', p_timeout,
                                                             'timeout_source', p_timeout_source) END
          FROM unnest(v_taken) WITH ORDINALITY AS x(id, n)
         WHERE a.id = x.id AND a.status = 'queued'
        RETURNING a.id, a.task_id, a.number, a.spec, a.lease_token, x.n
    )
    SELECT array_agg(u.id ORDER BY u.n), array_agg(u.task_id ORDER BY u.n),
           array_agg(u.number ORDER BY u.n), array_agg(u.spec ORDER BY u.n),
           array_agg(u.lease_token ORDER BY u.n), array_agg(u.n::integer ORDER BY u.n)
      INTO r_ids, r_task_ids, r_numbers, r_specs, r_tokens, r_slots
      FROM u;
    r_waiting := GREATEST(r_waiting - COALESCE(cardinality(r_ids), 0), 0);
    RETURN NEXT;
END;
$$;
