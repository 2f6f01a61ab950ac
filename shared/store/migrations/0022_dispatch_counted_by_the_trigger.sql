-- writer: svc-gateway (direct dispatch).
--
-- `submit_task`'s direct dispatch counts its attempt through the trigger on `attempts` again, as
-- before migration 0021, which had it move the counters it had locked itself (an `UPDATE` of
-- those rows, and the transaction setting `agentscope.claim_counted` set and cleared around its
-- INSERT so that the trigger skips that row). Measured on a fast machine, alternated pairs of
-- W1 low load, that made every direct dispatch slower: task created → attempt claimed 0.29–0.31
-- → 0.38–0.42 ms and submit → provider started +0.03–0.12 ms in 4 of 4 pairs
-- (docs/BENCHMARKS.md, session 36). The rest of 0021 (the trigger's WHEN conditions, an end's
-- deltas appended in the trigger) stays.

-- Migration 0021's `submit_task`, without its own counting.
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
            -- Counted by the trigger on `attempts` (`attempts_count_active_insert`).
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

