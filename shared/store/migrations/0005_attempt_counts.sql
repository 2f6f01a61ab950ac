-- writer: svc-scheduler, through the trigger below only. Active (claimed or running) attempts
-- per concurrency scope, kept in the same transaction as every change of an attempt's status,
-- so a claim checks a limit by reading (and locking) one row instead of counting `attempts`.
--
-- Scopes: 'host' (every host: its capacity always limits it), and 'workspace', 'pool' and
-- 'agent' only when that workspace, pool or agent's binding has a max_concurrency. Limits are
-- set when a workspace, pool or binding is created and never change (there is no API that
-- changes them); a change that sets a limit later must also insert the scope's current count.
CREATE TABLE attempt_counts (
    scope  text NOT NULL CHECK (scope IN ('workspace', 'pool', 'agent', 'host')),
    id     uuid NOT NULL,
    active integer NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, id)
);

-- Adds `d` to the counters of attempt `a`'s scopes. Rows are touched in one global order
-- (workspace, pool, agent, host), the order in which a claim locks them too.
CREATE FUNCTION attempt_counts_add(a attempts, d integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
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

CREATE FUNCTION attempts_count_active() RETURNS trigger
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
        PERFORM attempt_counts_add(OLD, -1);
    END IF;
    IF is_active THEN
        PERFORM attempt_counts_add(NEW, 1);
    END IF;
    RETURN NULL;
END;
$$;

-- Fires only for statements that set one of these columns: the recorder's per-event
-- `last_seq` updates do not run it.
CREATE TRIGGER attempts_count_active
    AFTER INSERT OR DELETE OR UPDATE OF status, host_id, pool_id, agent_id, workspace_id ON attempts
    FOR EACH ROW EXECUTE FUNCTION attempts_count_active();

-- The counts of attempts already active when this migration runs.
INSERT INTO attempt_counts (scope, id, active)
SELECT 'host', host_id, count(*) FROM attempts
WHERE status IN ('claimed', 'running') AND host_id IS NOT NULL GROUP BY host_id;
INSERT INTO attempt_counts (scope, id, active)
SELECT 'workspace', a.workspace_id, count(*) FROM attempts a JOIN workspaces w ON w.id = a.workspace_id
WHERE a.status IN ('claimed', 'running') AND w.max_concurrency IS NOT NULL GROUP BY a.workspace_id;
INSERT INTO attempt_counts (scope, id, active)
SELECT 'pool', a.pool_id, count(*) FROM attempts a JOIN pools p ON p.id = a.pool_id
WHERE a.status IN ('claimed', 'running') AND p.max_concurrency IS NOT NULL GROUP BY a.pool_id;
INSERT INTO attempt_counts (scope, id, active)
SELECT 'agent', a.agent_id, count(*) FROM attempts a JOIN bindings b ON b.agent_id = a.agent_id
WHERE a.status IN ('claimed', 'running') AND b.max_concurrency IS NOT NULL GROUP BY a.agent_id;
