-- writer: svc-gateway (`tasks.cancel_requested_at`), svc-scheduler (its sweeper settles
-- `tasks.cancel_pending`).
--
-- A cancellation request is pending until its task's newest attempt has ended. The sweeper
-- reads the pending ones only: it cancels a queued attempt of such a task, and sends the cancel
-- again to the host of an active one whose request is overdue (the gateway committed the
-- request, then died or lost NATS before its message left: the attempt used to run to its end).
-- Before, it looked for queued attempts of every task whose cancellation was ever requested
-- (`tasks_cancel_requested`, every cancelled task of the database's history), which, planned
-- from the queue's side, read the whole queue once a second.
ALTER TABLE tasks ADD COLUMN cancel_pending boolean NOT NULL DEFAULT false;

-- Whoever writes the request (the gateway, a tool, an older gateway), it is pending from then.
CREATE FUNCTION cancel_request_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.cancel_pending := true;
    RETURN NEW;
END;
$$;
CREATE TRIGGER tasks_cancel_requested_insert BEFORE INSERT ON tasks
    FOR EACH ROW WHEN (NEW.cancel_requested_at IS NOT NULL)
    EXECUTE FUNCTION cancel_request_pending();
CREATE TRIGGER tasks_cancel_requested_update BEFORE UPDATE OF cancel_requested_at ON tasks
    FOR EACH ROW WHEN (OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL)
    EXECUTE FUNCTION cancel_request_pending();

-- Requests made before this migration whose task may still have work: one without an attempt
-- yet, or one whose attempt has not ended.
UPDATE tasks t SET cancel_pending = true
 WHERE t.cancel_requested_at IS NOT NULL
   AND (NOT t.has_attempt
        OR EXISTS (SELECT 1 FROM attempts a WHERE a.task_id = t.id
                    AND a.status IN ('queued', 'claimed', 'running')));

DROP INDEX tasks_cancel_requested;
CREATE INDEX tasks_cancel_pending ON tasks (cancel_requested_at, id) WHERE cancel_pending;

-- Queued attempts created before their agent had a binding (the sweeper binds them once a
-- second): usually none. Without this index the sweep read every queued attempt, or, planned
-- while the table was small, the whole table.
CREATE INDEX attempts_unbound ON attempts (agent_id) WHERE status = 'queued' AND binding_id IS NULL;
