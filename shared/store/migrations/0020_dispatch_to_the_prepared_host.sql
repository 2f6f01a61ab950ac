-- writer: svc-gateway.
--
-- A submission's attempt goes, among the pool's idle hosts, to the one the gateway names if it
-- is one of them (`p_prefer`; NULL: any). The gateway names the host its previous direct
-- dispatch to the pool went to, and, while this statement runs, has that host prepare the
-- attempt's task directory ahead of the offer (`ClaimOffer.prepare_only`): a host chosen at
-- random among several idle ones would seldom be the one that prepared.

DROP FUNCTION submit_task(uuid, uuid, uuid, uuid, text, text, text, integer, text, text, uuid,
                          uuid, uuid, uuid, text, text[], jsonb, bigint, text, bigint, text);
DROP FUNCTION idle_host(uuid, uuid, text, text[], bigint);

-- Migration 0013's `idle_host`, the named host first among the idle ones.
CREATE FUNCTION idle_host(
    p_workspace uuid, p_pool uuid, p_provider text, p_caps text[], p_fresh_ms bigint,
    p_prefer uuid)
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
     ORDER BY hs.id IS NOT DISTINCT FROM p_prefer DESC, random()
     LIMIT 1);
END;
$$;

-- Migration 0009's `submit_task`, passing the named host on.
CREATE FUNCTION submit_task(
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

