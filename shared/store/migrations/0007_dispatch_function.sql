-- writer: svc-scheduler and svc-gateway. Two claimers: the scheduler (a host asks) and the
-- gateway (direct dispatch, below).
--
-- `claim_attempts` (migration 0006) again, with one more parameter: a claim younger than
-- `p_in_flight_ms` that the host does not list is not a lost offer yet. Its offer may still be
-- on its way (the gateway's, crossing the host's own claim), and a lost offer blocks the claim
-- of anything new; the scheduler re-offers only older ones too (`claim.rs`).
DROP FUNCTION claim_attempts(uuid, uuid, integer, text[], text[], text[], bigint, text);

CREATE FUNCTION claim_attempts(
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
    v_host_active := COALESCE((SELECT ac.active FROM attempt_counts ac
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
    -- Exact now that the host's counter is locked (this statement reads a new snapshot): an end
    -- the recorder committed before the lock is out of both the counter and this count; one it
    -- is committing waits on the lock and is still in both.
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

-- An idle host of a pool for an attempt of `p_provider` needing `p_caps`: seen within
-- `p_fresh_ms` (its heartbeat, mirrored into `hosts`), the provider ready there, the
-- capabilities present, and no active attempt by its counter (read unlocked: a claim decides
-- under the counters' locks); one at random if several are, NULL if none.
CREATE FUNCTION idle_host(
    p_workspace uuid, p_pool uuid, p_provider text, p_caps text[], p_fresh_ms bigint)
RETURNS uuid
-- PL/pgSQL, not SQL: a backend keeps its plan (a SQL function's is made again for each
-- statement that calls it, on every task's insert).
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
    SELECT hs.id
      FROM hosts hs LEFT JOIN attempt_counts ac ON ac.scope = 'host' AND ac.id = hs.id
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

-- A task and its attempt 1, stored in one statement (svc-gateway: tasks; attempts, its
-- exception), and direct dispatch: when `p_fresh_ms` is positive, the pool has an `idle_host` for
-- the attempt, and no older queued work of the pool waits that this host could run, the attempt
-- is stored claimed for that host, within every limit: the counters of the limits that apply are
-- locked in the trigger's order (workspace, pool, agent, host; as `claim_attempts` does), each
-- checked, and the insert moves them (the trigger). The gateway then creates its lease and offers
-- it to the host. Otherwise the attempt is stored queued and the pool's hosts claim it: a busy
-- pool, or one with a backlog, is left to the hosts' own claims, which take work in batches and
-- oldest first (one claim per attempt costs more than the hops it saves once hosts are busy).
--
-- Returns one row: the task's `created_at` (the attempt's too, and its `not_before`), and when
-- the attempt was stored claimed, its host, fencing token and spec (NULL otherwise).
CREATE FUNCTION submit_task(
    p_task uuid, p_workspace uuid, p_issue uuid, p_agent uuid, p_repository text,
    p_branch text, p_input text, p_timeout_secs integer, p_idempotency_key text,
    p_request_hash text, p_attempt uuid, p_agent_version uuid, p_binding uuid, p_pool uuid,
    p_provider text, p_caps text[], p_spec jsonb, p_fresh_ms bigint, p_hash text,
    p_run_timeout bigint, p_timeout_source text)
RETURNS TABLE (
    r_created_at timestamptz, r_host uuid, r_token bigint, r_spec jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    l record;
    x record;
    v_host uuid;
    v_ok boolean := true;
    v_scopes text[] := '{}';
    v_keys uuid[] := '{}';
    v_token bigint;
    v_spec jsonb := p_spec;
BEGIN
    INSERT INTO tasks (id, workspace_id, issue_id, agent_id, repository, branch, input,
                       timeout_secs, idempotency_key, request_hash)
    VALUES (p_task, p_workspace, p_issue, p_agent, p_repository, p_branch, p_input,
            p_timeout_secs, p_idempotency_key, p_request_hash)
    RETURNING created_at INTO r_created_at;
    IF p_fresh_ms > 0 AND p_pool IS NOT NULL AND p_provider IS NOT NULL THEN
        v_host := idle_host(p_workspace, p_pool, p_provider, p_caps, p_fresh_ms);
    END IF;
    IF v_host IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM attempts a JOIN hosts hs ON hs.id = v_host
         WHERE a.status = 'queued' AND a.workspace_id = p_workspace AND a.pool_id = p_pool
           AND a.not_before <= now() AND a.required_capabilities <@ hs.capabilities
           AND EXISTS (SELECT 1 FROM jsonb_array_elements(hs.providers) e
                        WHERE e->>'name' = a.provider AND e->'installed' = 'true'::jsonb
                          AND e->'logged_in' = 'true'::jsonb)) THEN
        SELECT w.max_concurrency AS workspace_limit, p.max_concurrency AS pool_limit,
               b.max_concurrency AS agent_limit, hs.capacity AS host_limit
          INTO l
          FROM hosts hs JOIN workspaces w ON w.id = p_workspace JOIN pools p ON p.id = p_pool
               LEFT JOIN bindings b ON b.id = p_binding
         WHERE hs.id = v_host;
        IF l.workspace_limit IS NOT NULL THEN
            v_scopes := v_scopes || 'workspace'::text;
            v_keys := v_keys || p_workspace;
        END IF;
        IF l.pool_limit IS NOT NULL THEN
            v_scopes := v_scopes || 'pool'::text;
            v_keys := v_keys || p_pool;
        END IF;
        IF l.agent_limit IS NOT NULL THEN
            v_scopes := v_scopes || 'agent'::text;
            v_keys := v_keys || p_agent;
        END IF;
        v_scopes := v_scopes || 'host'::text;
        v_keys := v_keys || v_host;
        FOR x IN
            INSERT INTO attempt_counts (scope, id, active)
            SELECT s, k, 0 FROM unnest(v_scopes, v_keys) WITH ORDINALITY AS u(s, k, n) ORDER BY n
            ON CONFLICT (scope, id) DO UPDATE SET active = attempt_counts.active
            RETURNING attempt_counts.scope, attempt_counts.active
        LOOP
            v_ok := v_ok AND x.active < CASE x.scope
                WHEN 'workspace' THEN l.workspace_limit
                WHEN 'pool' THEN l.pool_limit
                WHEN 'agent' THEN l.agent_limit
                ELSE l.host_limit END;
        END LOOP;
        IF v_ok THEN
            -- As `claim_attempts` does: a spec without a run timeout of its own gets the
            -- deployment's.
            IF (jsonb_typeof(p_spec->'timeout_secs') = 'number'
                AND p_spec->'timeout_secs' > '0'::jsonb) IS NOT TRUE THEN
                v_spec := p_spec || jsonb_build_object('timeout_secs', p_run_timeout,
                                                       'timeout_source', p_timeout_source);
            END IF;
            v_token := nextval('lease_tokens');
            INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id,
                                  agent_version_id, binding_id, pool_id, provider,
                                  required_capabilities, spec, host_id, lease_token, claimed_at,
                                  task_token_hash)
            VALUES (p_attempt, p_task, p_workspace, 1, 'claimed', p_agent, p_agent_version,
                    p_binding, p_pool, p_provider, p_caps, v_spec, v_host, v_token,
                    clock_timestamp(), p_hash);
            r_host := v_host;
            r_token := v_token;
            r_spec := v_spec;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id,
                          agent_version_id, binding_id, pool_id, provider,
                          required_capabilities, spec)
    VALUES (p_attempt, p_task, p_workspace, 1, 'queued', p_agent, p_agent_version, p_binding,
            p_pool, p_provider, p_caps, p_spec);
    RETURN NEXT;
END;
$$;
