-- writer: svc-gateway.
--
-- Several submissions of one agent's tasks stored in one statement, queued (no direct dispatch,
-- no issue, no idempotency key): what the gateway's submission batches send when requests
-- arrive faster than their statements complete (`svc-gateway/src/batch.rs`). Each task gets its
-- attempt 1 in the same statement, as `submit_task` (migrations 0007 to 0009) gives one task;
-- the plan is checked once for all of them, as `submit_task` checks it, and a stale plan stores
-- nothing (`r_stale`): the gateway then submits each on its own, reading the plan again.
--
-- One statement instead of one per task: in W1 bulk each task's own statement and commit cost
-- PostgreSQL about as much as everything else of the task (docs/BENCHMARKS.md, session 20).
CREATE FUNCTION submit_queued_tasks(
    p_workspace uuid, p_agent uuid, p_agent_version uuid, p_binding uuid, p_pool uuid,
    p_provider text, p_caps text[], p_tasks uuid[], p_attempts uuid[], p_repositories text[],
    p_branches text[], p_inputs text[], p_timeouts integer[], p_request_hashes text[],
    p_specs jsonb[])
RETURNS TABLE (r_stale boolean, r_created_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    r_stale := NOT EXISTS (SELECT 1 FROM agents WHERE id = p_agent AND workspace_id = p_workspace)
               OR (SELECT v.id FROM agent_versions v WHERE v.agent_id = p_agent
                    ORDER BY v.version DESC LIMIT 1) IS DISTINCT FROM p_agent_version
               OR (SELECT b.id FROM bindings b WHERE b.agent_id = p_agent)
                  IS DISTINCT FROM p_binding;
    IF r_stale THEN
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO tasks (id, workspace_id, agent_id, repository, branch, input, timeout_secs,
                       request_hash, has_attempt)
    SELECT u.id, p_workspace, p_agent, u.repository, u.branch, u.input, u.timeout_secs,
           u.request_hash, true
      FROM unnest(p_tasks, p_repositories, p_branches, p_inputs, p_timeouts, p_request_hashes)
           AS u(id, repository, branch, input, timeout_secs, request_hash);
    INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id,
                          agent_version_id, binding_id, pool_id, provider,
                          required_capabilities, spec)
    SELECT u.id, u.task_id, p_workspace, 1, 'queued', p_agent, p_agent_version, p_binding,
           p_pool, p_provider, p_caps, u.spec
      FROM unnest(p_attempts, p_tasks, p_specs) AS u(id, task_id, spec);
    r_created_at := now();
    RETURN NEXT;
END;
$$;
