-- writers: svc-scheduler (the recorder's ends, claims), svc-gateway (direct dispatch).
--
-- An attempt's counters (migrations 0005, 0013, 0014) are moved by the per-row trigger on
-- `attempts` only for changes that move one, and the trigger is no longer called for the others.
-- Its function ran for every row stored or changed in those columns: an attempt stored queued, a
-- claim's own UPDATE (which `claim_attempts` counts itself) and claimed → running each called it
-- only for it to find nothing to do. Its WHEN conditions are judged without calling it. An end
-- appends its deltas in the trigger itself, without a call of `attempt_counts_add` (one query
-- less per end), and `submit_task`'s direct dispatch counts its attempt on the counters it has
-- just locked, as a claim does, instead of through the trigger (three lookups of the limits and
-- an upsert of each counted scope's row, which the statement had already locked). In W1 low load
-- the trigger's call of `attempt_counts_add` was a tenth of `submit_task`'s time, on the path of
-- every POST; in W1 bulk the ends' calls a twentieth of PostgreSQL's (docs/BENCHMARKS.md,
-- session 35, from `pg_stat_statements`).
DROP TRIGGER attempts_count_active ON attempts;

CREATE OR REPLACE FUNCTION attempts_count_active() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    was_active boolean := TG_OP <> 'INSERT' AND OLD.status IN ('claimed', 'running');
    is_active  boolean := TG_OP <> 'DELETE' AND NEW.status IN ('claimed', 'running');
BEGIN
    IF was_active AND is_active
       AND OLD.host_id IS NOT DISTINCT FROM NEW.host_id
       AND OLD.pool_id IS NOT DISTINCT FROM NEW.pool_id
       AND OLD.agent_id = NEW.agent_id AND OLD.workspace_id = NEW.workspace_id THEN
        RETURN NULL;
    END IF;
    IF was_active THEN
        -- `attempt_counts_add(OLD, -1)` (migration 0013): a delta per counted scope.
        INSERT INTO attempt_count_deltas (scope, id, delta)
        SELECT s, k, -1 FROM (VALUES
            ('workspace', OLD.workspace_id,
             EXISTS (SELECT 1 FROM workspaces WHERE id = OLD.workspace_id
                                                AND max_concurrency IS NOT NULL)),
            ('pool', OLD.pool_id,
             OLD.pool_id IS NOT NULL
             AND EXISTS (SELECT 1 FROM pools WHERE id = OLD.pool_id AND max_concurrency IS NOT NULL)),
            ('agent', OLD.agent_id,
             EXISTS (SELECT 1 FROM bindings WHERE agent_id = OLD.agent_id
                                              AND max_concurrency IS NOT NULL)),
            ('host', OLD.host_id, OLD.host_id IS NOT NULL)) AS x(s, k, counted)
        WHERE counted;
    END IF;
    IF is_active THEN
        PERFORM attempt_counts_add(NEW, 1);
    END IF;
    RETURN NULL;
END;
$$;

-- `agentscope.claim_counted`: the claimer's own statement, which counts its attempts itself.
CREATE TRIGGER attempts_count_active_insert
    AFTER INSERT ON attempts
    FOR EACH ROW WHEN (NEW.status IN ('claimed', 'running')
                       AND current_setting('agentscope.claim_counted', true)
                           IS DISTINCT FROM 'on')
    EXECUTE FUNCTION attempts_count_active();
CREATE TRIGGER attempts_count_active_update
    AFTER UPDATE OF status, host_id, pool_id, agent_id, workspace_id ON attempts
    FOR EACH ROW WHEN (
        current_setting('agentscope.claim_counted', true) IS DISTINCT FROM 'on'
        AND ((OLD.status IN ('claimed', 'running')) <> (NEW.status IN ('claimed', 'running'))
             OR (NEW.status IN ('claimed', 'running')
                 AND (OLD.host_id IS DISTINCT FROM NEW.host_id
                      OR OLD.pool_id IS DISTINCT FROM NEW.pool_id
                      OR OLD.agent_id IS DISTINCT FROM NEW.agent_id
                      OR OLD.workspace_id IS DISTINCT FROM NEW.workspace_id))))
    EXECUTE FUNCTION attempts_count_active();
CREATE TRIGGER attempts_count_active_delete
    AFTER DELETE ON attempts
    FOR EACH ROW WHEN (OLD.status IN ('claimed', 'running'))
    EXECUTE FUNCTION attempts_count_active();

-- Migration 0020's `submit_task`, its direct dispatch counting its attempt itself.
CREATE OR REPLACE FUNCTION submit_task(
    p_task uuid, p_workspace uuid, p_issue uuid, p_agent uuid, p_repository text,
    p_branch text, p_input text, p_timeout_secs integer, p_idempotency_key text,
    p_request_hash text, p_attempt uuid, p_agent_version uuid, p_binding uuid, p_pool uuid,
    p_provider text, p_caps text[], p_spec jsonb, p_fresh_ms bigint, p_hash text,
    p_run_timeout bigint, p_timeout_source text, p_prefer uuid)
RETURNS TABLE (
    r_stale boolean, r_created_at timestamptz, r_host uuid, r_token bigint, r_spec jsonb)
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
    -- The plan the caller resolved the attempt by is still the agent's (it may have kept it from
    -- an earlier task): the agent is the workspace's, its newest version and its binding are
    -- the ones named. Otherwise nothing is stored.
    r_stale := NOT EXISTS (SELECT 1 FROM agents WHERE id = p_agent AND workspace_id = p_workspace)
               OR (SELECT v.id FROM agent_versions v WHERE v.agent_id = p_agent
                    ORDER BY v.version DESC LIMIT 1) IS DISTINCT FROM p_agent_version
               OR (SELECT b.id FROM bindings b WHERE b.agent_id = p_agent)
                  IS DISTINCT FROM p_binding;
    IF r_stale THEN
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO tasks (id, workspace_id, issue_id, agent_id, repository, branch, input,
                       timeout_secs, idempotency_key, request_hash, has_attempt)
    VALUES (p_task, p_workspace, p_issue, p_agent, p_repository, p_branch, p_input,
            p_timeout_secs, p_idempotency_key, p_request_hash, true)
    RETURNING created_at INTO r_created_at;
    IF p_fresh_ms > 0 AND p_pool IS NOT NULL AND p_provider IS NOT NULL THEN
        v_host := idle_host(p_workspace, p_pool, p_provider, p_caps, p_fresh_ms, p_prefer);
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
            -- The counters locked above take the attempt here, not through the trigger on
            -- `attempts`, which skips this one row (the setting is this transaction's and is
            -- cleared right after), as `claim_attempts` counts its batch.
            UPDATE attempt_counts c SET active = c.active + 1
              FROM unnest(v_scopes, v_keys) AS u(s, k)
             WHERE c.scope = u.s AND c.id = u.k;
            PERFORM set_config('agentscope.claim_counted', 'on', true);
            INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id,
                                  agent_version_id, binding_id, pool_id, provider,
                                  required_capabilities, spec, host_id, lease_token, claimed_at,
                                  task_token_hash)
            VALUES (p_attempt, p_task, p_workspace, 1, 'claimed', p_agent, p_agent_version,
                    p_binding, p_pool, p_provider, p_caps, v_spec, v_host, v_token,
                    clock_timestamp(), p_hash);
            PERFORM set_config('agentscope.claim_counted', '', true);
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

