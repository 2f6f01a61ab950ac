-- Managed execution (svc-dataplane runs the model/tool loop). A session is pinned to the agent
-- version it started with.

-- writer: svc-gateway. Insert-only.
CREATE TABLE sessions (
    id               uuid PRIMARY KEY,
    workspace_id     uuid NOT NULL REFERENCES workspaces(id),
    agent_id         uuid NOT NULL REFERENCES agents(id),
    agent_version_id uuid NOT NULL REFERENCES agent_versions(id),
    environment      text NOT NULL CHECK (environment IN ('local', 'sandbox', 'remote', 'self_hosted')),
    -- self_hosted: the Worker's name in the workspace.
    worker           text CHECK ((environment = 'self_hosted') = (worker IS NOT NULL)),
    -- The Issue the session works on: its comment and upload tools write there.
    issue_id         uuid REFERENCES issues(id),
    -- The same create request twice is one session.
    idempotency_key  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, idempotency_key)
);
CREATE INDEX sessions_workspace ON sessions (workspace_id, created_at DESC);

-- writer: svc-gateway. Insert-only: work submitted to a session, in order.
CREATE TABLE session_inputs (
    id              uuid PRIMARY KEY,
    session_id      uuid NOT NULL REFERENCES sessions(id),
    workspace_id    uuid NOT NULL REFERENCES workspaces(id),
    text            text NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (session_id, idempotency_key)
);
CREATE INDEX session_inputs_order ON session_inputs (session_id, id);

-- writer: svc-dataplane. The session's live state; `lease_token` fences a replica that lost
-- its session lease (its writes are refused).
CREATE TABLE session_state (
    session_id  uuid PRIMARY KEY REFERENCES sessions(id),
    status      text NOT NULL,
    detail      text NOT NULL DEFAULT '',
    lease_token bigint NOT NULL DEFAULT 0,
    replica     text NOT NULL DEFAULT '',
    last_seq    bigint NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-dataplane. The outcome of each input's turn (never an acceptance of the Issue).
CREATE TABLE session_outcomes (
    input_id    uuid PRIMARY KEY REFERENCES session_inputs(id),
    session_id  uuid NOT NULL REFERENCES sessions(id),
    status      text NOT NULL CHECK (status IN ('completed', 'max_iterations', 'model_connection', 'tool_denied')),
    detail      text NOT NULL DEFAULT '',
    iterations  integer NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-dataplane. The conversation, append-only.
CREATE TABLE session_messages (
    session_id uuid NOT NULL REFERENCES sessions(id),
    seq        bigint NOT NULL CHECK (seq > 0),
    input_id   uuid NOT NULL REFERENCES session_inputs(id),
    message    jsonb NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- writer: svc-dataplane. The tool-call journal: a row is `started` before the tool runs and
-- `completed` (with its result message, in one transaction) after; a `started` row found by
-- another replica is `interrupted`, never run again.
CREATE TABLE session_tool_calls (
    session_id  uuid NOT NULL REFERENCES sessions(id),
    call_id     text NOT NULL,
    input_id    uuid NOT NULL REFERENCES session_inputs(id),
    tool        text NOT NULL,
    input       jsonb NOT NULL,
    status      text NOT NULL CHECK (status IN ('awaiting_approval', 'started', 'completed', 'interrupted', 'denied')),
    output      text,
    is_error    boolean NOT NULL DEFAULT false,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (session_id, call_id)
);

-- writer: svc-dataplane. Append-only; one row per (session, seq).
CREATE TABLE session_events (
    session_id uuid NOT NULL REFERENCES sessions(id),
    seq        bigint NOT NULL CHECK (seq > 0),
    kind       text NOT NULL,
    payload    jsonb NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (session_id, seq)
);

-- writer: svc-dataplane. Shared knowledge per workspace, searched live by the memory tools.
CREATE TABLE memory_entries (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    text         text NOT NULL,
    session_id   uuid REFERENCES sessions(id),
    created_at   timestamptz NOT NULL DEFAULT now(),
    tsv          tsvector GENERATED ALWAYS AS (to_tsvector('english', text)) STORED
);
CREATE INDEX memory_entries_tsv ON memory_entries USING gin (tsv);
CREATE INDEX memory_entries_workspace ON memory_entries (workspace_id, created_at DESC);

-- Approvals of managed sessions: keyed by (session, request) where hosted ones use the attempt.
CREATE UNIQUE INDEX approvals_session_request ON approvals (session_id, request_id) WHERE session_id IS NOT NULL;

-- writer: svc-gateway. Tool credentials, sealed with AES-256-GCM (shared/domain/src/vault.rs);
-- the plaintext never reaches the database, a log line or an event.
CREATE TABLE vault_secrets (
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    name         text NOT NULL CHECK (name ~ '^[A-Z_][A-Z0-9_]{0,127}$'),
    key_id       text NOT NULL,
    nonce        bytea NOT NULL,
    ciphertext   bytea NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, name)
);

-- Self-hosted Workers authenticate with tokens of their own kind.
ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_kind_check;
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_kind_check CHECK (kind IN ('api', 'host', 'worker'));

-- Artifacts uploaded by managed sessions.
ALTER TABLE artifacts ADD COLUMN session_id uuid REFERENCES sessions(id);
