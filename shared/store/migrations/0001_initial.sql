-- Durable model. Each table has one writing service (ARCHITECTURE.md, "Data ownership").

-- writer: svc-gateway
CREATE TABLE workspaces (
    id              uuid PRIMARY KEY,
    name            text NOT NULL UNIQUE,
    max_concurrency integer CHECK (max_concurrency IS NULL OR max_concurrency > 0),
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-gateway. Tokens are stored as SHA-256 hashes only.
CREATE TABLE api_tokens (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    kind         text NOT NULL CHECK (kind IN ('api', 'host')),
    name         text NOT NULL,
    token_hash   text NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);

-- writer: svc-gateway
CREATE TABLE agents (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    name         text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name)
);

-- writer: svc-gateway. Immutable snapshots: rows are inserted, never updated.
CREATE TABLE agent_versions (
    id               uuid PRIMARY KEY,
    agent_id         uuid NOT NULL REFERENCES agents(id),
    workspace_id     uuid NOT NULL REFERENCES workspaces(id),
    version          integer NOT NULL,
    instructions     text NOT NULL DEFAULT '',
    provider         text NOT NULL,
    model            text,
    capability_files jsonb NOT NULL DEFAULT '{}'::jsonb,
    tools            jsonb NOT NULL DEFAULT '[]'::jsonb,
    policy           jsonb NOT NULL DEFAULT '{}'::jsonb,
    max_iters        integer,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (agent_id, version)
);

-- writer: svc-gateway
CREATE TABLE runtime_profiles (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    name         text NOT NULL,
    provider     text NOT NULL,
    params       jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name)
);

-- writer: svc-gateway
CREATE TABLE pools (
    id              uuid PRIMARY KEY,
    workspace_id    uuid NOT NULL REFERENCES workspaces(id),
    name            text NOT NULL,
    max_concurrency integer CHECK (max_concurrency IS NULL OR max_concurrency > 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name)
);

-- writer: svc-gateway. One binding per agent.
CREATE TABLE bindings (
    id                    uuid PRIMARY KEY,
    workspace_id          uuid NOT NULL REFERENCES workspaces(id),
    agent_id              uuid NOT NULL UNIQUE REFERENCES agents(id),
    pool_id               uuid NOT NULL REFERENCES pools(id),
    runtime_profile_id    uuid REFERENCES runtime_profiles(id),
    required_capabilities text[] NOT NULL DEFAULT '{}',
    max_concurrency       integer CHECK (max_concurrency IS NULL OR max_concurrency > 0),
    max_attempts          integer NOT NULL DEFAULT 3 CHECK (max_attempts > 0),
    retry_backoff_ms      bigint NOT NULL DEFAULT 1000 CHECK (retry_backoff_ms >= 0),
    fallback_providers    text[] NOT NULL DEFAULT '{}',
    created_at            timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-scheduler (from host registrations and presence).
CREATE TABLE hosts (
    id            uuid PRIMARY KEY,
    workspace_id  uuid NOT NULL REFERENCES workspaces(id),
    pool_id       uuid REFERENCES pools(id),
    pool_name     text NOT NULL,
    name          text NOT NULL,
    capacity      integer NOT NULL CHECK (capacity >= 0),
    providers     jsonb NOT NULL DEFAULT '[]'::jsonb,
    capabilities  text[] NOT NULL DEFAULT '{}',
    checks        jsonb NOT NULL DEFAULT '[]'::jsonb,
    version       text NOT NULL DEFAULT '',
    registered_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    running       integer NOT NULL DEFAULT 0
);

-- writer: svc-gateway
CREATE TABLE issues (
    id                uuid PRIMARY KEY,
    workspace_id      uuid NOT NULL REFERENCES workspaces(id),
    title             text NOT NULL,
    body              text NOT NULL DEFAULT '',
    assignee_agent_id uuid REFERENCES agents(id),
    status            text NOT NULL DEFAULT 'open',
    created_at        timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-gateway
CREATE TABLE comments (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    issue_id     uuid NOT NULL REFERENCES issues(id),
    author       text NOT NULL,
    body         text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-gateway (metadata; content lives in the JetStream object store).
CREATE TABLE artifacts (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    issue_id     uuid REFERENCES issues(id),
    task_id      uuid,
    attempt_id   uuid,
    name         text NOT NULL,
    content_type text NOT NULL,
    size_bytes   bigint NOT NULL,
    sha256       text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- writer: svc-gateway. The task's status is derived from its newest attempt.
CREATE TABLE tasks (
    id                  uuid PRIMARY KEY,
    workspace_id        uuid NOT NULL REFERENCES workspaces(id),
    issue_id            uuid REFERENCES issues(id),
    agent_id            uuid NOT NULL REFERENCES agents(id),
    kind                text NOT NULL DEFAULT 'issue' CHECK (kind IN ('issue', 'chat')),
    repository          text,
    branch              text,
    input               text NOT NULL DEFAULT '',
    timeout_secs        integer,
    idempotency_key     text,
    cancel_requested_at timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, idempotency_key)
);
CREATE INDEX tasks_workspace_created ON tasks (workspace_id, created_at DESC);

-- writer: svc-scheduler. A retry is a new row; rows in a terminal status never change again.
CREATE TABLE attempts (
    id                    uuid PRIMARY KEY,
    task_id               uuid NOT NULL REFERENCES tasks(id),
    workspace_id          uuid NOT NULL REFERENCES workspaces(id),
    number                integer NOT NULL CHECK (number > 0),
    status                text NOT NULL CHECK (status IN ('queued','claimed','running','succeeded','failed','cancelled','lost')),
    agent_id              uuid NOT NULL REFERENCES agents(id),
    agent_version_id      uuid REFERENCES agent_versions(id),
    binding_id            uuid REFERENCES bindings(id),
    pool_id               uuid REFERENCES pools(id),
    provider              text,
    required_capabilities text[] NOT NULL DEFAULT '{}',
    spec                  jsonb NOT NULL DEFAULT '{}'::jsonb,
    host_id               uuid REFERENCES hosts(id),
    lease_token           bigint,
    not_before            timestamptz NOT NULL DEFAULT now(),
    created_at            timestamptz NOT NULL DEFAULT now(),
    claimed_at            timestamptz,
    started_at            timestamptz,
    finished_at           timestamptz,
    failure_class         text,
    failure_detail        text,
    exit_code             integer,
    provider_session_id   text,
    last_seq              bigint NOT NULL DEFAULT 0,
    UNIQUE (task_id, number)
);
CREATE INDEX attempts_queued ON attempts (pool_id, not_before) WHERE status = 'queued';
CREATE INDEX attempts_active ON attempts (host_id) WHERE status IN ('claimed', 'running');

-- writer: svc-scheduler (the recorder). Append-only; one row per (attempt, seq).
CREATE TABLE execution_events (
    id          bigserial UNIQUE,
    attempt_id  uuid NOT NULL REFERENCES attempts(id),
    seq         bigint NOT NULL CHECK (seq > 0),
    kind        text NOT NULL,
    payload     jsonb NOT NULL,
    at          timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (attempt_id, seq)
);

-- writer: svc-scheduler. A decision is applied once: decided_at moves from NULL exactly once.
CREATE TABLE approvals (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    attempt_id   uuid REFERENCES attempts(id),
    session_id   text,
    request_id   text NOT NULL,
    tool_name    text NOT NULL,
    input        jsonb NOT NULL DEFAULT '{}'::jsonb,
    status       text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending','allowed','denied','timed_out')),
    decided_by   text,
    reason       text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    decided_at   timestamptz,
    UNIQUE (attempt_id, request_id)
);

-- writer: svc-scheduler
CREATE TABLE runs (
    id           uuid PRIMARY KEY,
    workspace_id uuid NOT NULL REFERENCES workspaces(id),
    issue_id     uuid REFERENCES issues(id),
    status       text NOT NULL DEFAULT 'running',
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);

-- writer: svc-scheduler
CREATE TABLE run_nodes (
    id          uuid PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES runs(id),
    task_id     uuid REFERENCES tasks(id),
    name        text NOT NULL,
    status      text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending','running','completed','failed')),
    depends_on  uuid[] NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

-- writer: svc-scheduler. Bus messages that could not be processed and were terminated.
CREATE TABLE rejected_messages (
    id          bigserial PRIMARY KEY,
    subject     text NOT NULL,
    consumer    text NOT NULL,
    reason      text NOT NULL,
    payload     bytea NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
