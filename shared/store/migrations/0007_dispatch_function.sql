-- writer: svc-gateway (its exception on `attempts`). Direct dispatch: the gateway, having stored
-- a task with its attempt 1, claims queued work of the attempt's pool for one idle host in one
-- statement, and then offers it to that host itself, instead of nudging the hosts and waiting
-- for one to ask the scheduler.
--
-- The host is one of the pool's that can run the attempt (its provider ready, the attempt's
-- capabilities), seen within `p_fresh_ms` (its heartbeat, mirrored into `hosts`), and below its
-- capacity by its counter (read unlocked: the claim itself decides under the counters' locks);
-- the least loaded first, ties broken at random. The claim is `claim_attempts` for one slot,
-- with every attempt claimed for the host listed as held (the host's own claims judge lost
-- offers, not this) and none as ended (the counter is the upper bound of what runs there). It
-- takes the pool's oldest queued work the host can run, which is the new attempt unless others
-- wait. Returns one row when something was claimed (r_host, and the claim's arrays), none
-- otherwise.
CREATE FUNCTION dispatch_attempt(
    p_attempt uuid, p_fresh_ms bigint, p_hash text, p_timeout bigint, p_timeout_source text)
RETURNS TABLE (
    r_host uuid, r_ids uuid[], r_task_ids uuid[], r_numbers integer[], r_specs jsonb[],
    r_tokens bigint[])
LANGUAGE plpgsql AS $$
DECLARE
    a record;
    c record;
    v_host uuid;
BEGIN
    SELECT at.workspace_id, at.pool_id, at.provider, at.required_capabilities INTO a
      FROM attempts at
     WHERE at.id = p_attempt AND at.status = 'queued' AND at.not_before <= now();
    IF NOT FOUND OR a.pool_id IS NULL OR a.provider IS NULL THEN
        RETURN;
    END IF;
    SELECT hs.id INTO v_host
      FROM hosts hs LEFT JOIN attempt_counts ac ON ac.scope = 'host' AND ac.id = hs.id
     WHERE hs.workspace_id = a.workspace_id AND hs.pool_id = a.pool_id
       AND hs.last_seen_at > clock_timestamp() - make_interval(secs => p_fresh_ms / 1000.0)
       AND COALESCE(ac.active, 0) < hs.capacity
       AND a.required_capabilities <@ hs.capabilities
       AND EXISTS (SELECT 1 FROM jsonb_array_elements(hs.providers) e
                    WHERE e->>'name' = a.provider AND e->'installed' = 'true'::jsonb
                      AND e->'logged_in' = 'true'::jsonb)
     ORDER BY COALESCE(ac.active, 0), random()
     LIMIT 1;
    IF v_host IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO c
      FROM claim_attempts(v_host, a.workspace_id, 1,
                          ARRAY(SELECT x.id::text FROM attempts x
                                 WHERE x.host_id = v_host AND x.status = 'claimed'),
                          '{}', ARRAY[p_hash], p_timeout, p_timeout_source);
    IF c.r_ids IS NULL OR cardinality(c.r_ids) = 0 THEN
        RETURN;
    END IF;
    r_host := v_host;
    r_ids := c.r_ids;
    r_task_ids := c.r_task_ids;
    r_numbers := c.r_numbers;
    r_specs := c.r_specs;
    r_tokens := c.r_tokens;
    RETURN NEXT;
END;
$$;
