-- writer: svc-scheduler (the recorder).
--
-- Every event still belongs to an attempt, checked once per statement instead of once per row.
-- The foreign key `execution_events.attempt_id -> attempts(id)` ran its check as a query of its
-- own for each inserted row (executor start-up, an index scan, a row lock): about half of the
-- PostgreSQL time of the recorder's batched INSERT of a busy attempt's events
-- (docs/BENCHMARKS.md, session 18). The triggers below keep what the key guaranteed:
--   * an INSERT whose rows name an attempt that does not exist fails with
--     `foreign_key_violation` (23503), as the key did; the statement takes the same
--     `FOR KEY SHARE` lock on each attempt it names, so a concurrent DELETE of that attempt
--     waits for it, and one already under way makes the check fail;
--   * an attempt that has events can be neither deleted nor given another id.
-- Attempts are never deleted and their ids never change; the second pair of triggers is there
-- so that no later change can orphan events silently. Both checks read with a fresh snapshot
-- after taking their lock, which is what READ COMMITTED (every service's isolation level) does;
-- a deleting transaction at REPEATABLE READ would not see events committed after it began.
ALTER TABLE execution_events DROP CONSTRAINT execution_events_attempt_id_fkey;

CREATE FUNCTION execution_events_have_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Each attempt the statement names once, locked as the foreign key locked it; a row of an
    -- attempt that is missing (or deleted meanwhile) finds nothing to lock.
    IF EXISTS (
        SELECT 1
        FROM (SELECT DISTINCT attempt_id FROM inserted) n
        LEFT JOIN LATERAL (
            SELECT true AS found FROM attempts a WHERE a.id = n.attempt_id FOR KEY SHARE
        ) a ON true
        WHERE a.found IS NULL
    ) THEN
        RAISE EXCEPTION 'an execution event names an attempt that does not exist'
            USING ERRCODE = 'foreign_key_violation', TABLE = 'execution_events';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER execution_events_have_attempts
    AFTER INSERT ON execution_events REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION execution_events_have_attempts();

CREATE FUNCTION attempts_keep_their_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The attempt's row is locked by now: an insert of its events that holds the key-share
    -- lock has committed, and this read sees its rows.
    IF EXISTS (SELECT 1 FROM execution_events WHERE attempt_id = OLD.id) THEN
        RAISE EXCEPTION 'attempt % has execution events', OLD.id
            USING ERRCODE = 'foreign_key_violation', TABLE = 'attempts';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

CREATE TRIGGER attempts_keep_their_events_on_delete
    BEFORE DELETE ON attempts
    FOR EACH ROW EXECUTE FUNCTION attempts_keep_their_events();

CREATE TRIGGER attempts_keep_their_events_on_new_id
    BEFORE UPDATE OF id ON attempts
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION attempts_keep_their_events();
