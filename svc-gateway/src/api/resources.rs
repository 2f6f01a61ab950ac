//! Workspaces, tokens, agents and versions, runtime profiles, pools, bindings and hosts.

use crate::AppState;
use crate::api::from_json;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Admin, Auth, Body, Id};
use agentscope_api as t;
use agentscope_api::{
    NewAgent, NewBinding, NewPool, NewProfile, NewToken, NewVersion, NewWorkspace,
};
use agentscope_domain::{KNOWN_PROVIDERS, TokenKind, new_token};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use sqlx::Connection as _;
use uuid::Uuid;

pub(crate) fn check_name(field: &str, v: &str) -> ApiResult<()> {
    if v.trim().is_empty() || v.len() > 200 || v.chars().any(|c| c.is_control()) {
        return Err(ApiError::bad_request(
            "invalid_field",
            format!("`{field}` must be 1 to 200 printable characters"),
        ));
    }
    Ok(())
}

fn check_provider(p: &str) -> ApiResult<()> {
    if !KNOWN_PROVIDERS.contains(&p) && p != agentscope_domain::MANAGED_PROVIDER {
        return Err(ApiError::bad_request(
            "invalid_field",
            format!(
                "unknown provider `{p}`; known: {}",
                KNOWN_PROVIDERS.join(", ")
            ),
        ));
    }
    Ok(())
}

fn check_limit(field: &str, v: Option<i32>) -> ApiResult<()> {
    if v.is_some_and(|v| v <= 0) {
        return Err(ApiError::bad_request(
            "invalid_field",
            format!("`{field}` must be positive"),
        ));
    }
    Ok(())
}

async fn issue_token(
    db: &agentscope_store::warm::Warm,
    workspace_id: Uuid,
    kind: TokenKind,
    name: &str,
) -> ApiResult<(Uuid, String)> {
    let token = new_token(kind);
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO api_tokens (id, workspace_id, kind, name, token_hash) VALUES ($1, $2, $3, $4, $5)",
        id,
        workspace_id,
        kind.as_str(),
        name,
        agentscope_domain::hash_token(&token),
    )
    .execute(db)
    .await?;
    Ok((id, token))
}

pub async fn create_workspace(
    State(s): State<AppState>,
    _: Admin,
    Body(b): Body<NewWorkspace>,
) -> ApiResult<(StatusCode, Json<t::WorkspaceCreated>)> {
    check_name("name", &b.name)?;
    check_limit("max_concurrency", b.max_concurrency)?;
    let id = Uuid::now_v7();
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    sqlx::query!(
        "INSERT INTO workspaces (id, name, max_concurrency) VALUES ($1, $2, $3)",
        id,
        &b.name,
        b.max_concurrency,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    conn.release();
    let (_, token) = issue_token(&s.db, id, TokenKind::Api, "initial").await?;
    Ok((
        StatusCode::CREATED,
        Json(t::WorkspaceCreated {
            workspace: t::Workspace {
                id,
                name: b.name,
                max_concurrency: b.max_concurrency,
            },
            api_token: token,
        }),
    ))
}

pub async fn get_workspace(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::Workspace>> {
    let w = sqlx::query!(
        "SELECT name, max_concurrency FROM workspaces WHERE id = $1",
        auth.workspace_id,
    )
    .fetch_one(&s.db)
    .await?;
    Ok(Json(t::Workspace {
        id: auth.workspace_id,
        name: w.name,
        max_concurrency: w.max_concurrency,
    }))
}

pub async fn create_api_token(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewToken>,
) -> ApiResult<(StatusCode, Json<t::TokenCreated>)> {
    check_name("name", &b.name)?;
    let (id, token) = issue_token(&s.db, auth.workspace_id, TokenKind::Api, &b.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(t::TokenCreated {
            id,
            name: b.name,
            token,
        }),
    ))
}

pub async fn create_host_token(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewToken>,
) -> ApiResult<(StatusCode, Json<t::TokenCreated>)> {
    check_name("name", &b.name)?;
    let (id, token) = issue_token(&s.db, auth.workspace_id, TokenKind::Host, &b.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(t::TokenCreated {
            id,
            name: b.name,
            token,
        }),
    ))
}

pub async fn create_worker_token(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewToken>,
) -> ApiResult<(StatusCode, Json<t::TokenCreated>)> {
    check_name("name", &b.name)?;
    let (id, token) = issue_token(&s.db, auth.workspace_id, TokenKind::Worker, &b.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(t::TokenCreated {
            id,
            name: b.name,
            token,
        }),
    ))
}

fn check_version(v: &NewVersion) -> ApiResult<()> {
    check_provider(&v.provider)?;
    check_limit("max_iters", v.max_iters)?;
    if v.instructions.len() > 256 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`instructions` is longer than 256 KiB",
        ));
    }
    if v.policy.as_ref().is_some_and(|c| !c.is_object()) {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`policy` must be an object",
        ));
    }
    if v.policy.as_ref().is_some_and(|c| !storable_numbers(c)) {
        // PostgreSQL keeps a JSON number's exact decimal; one near f64's limits would not read
        // back into a JSON value, and every later read of the version would fail.
        return Err(ApiError::bad_request(
            "invalid_field",
            "`policy` holds a number beyond ±1e300",
        ));
    }
    let names = |t: &Value| t.as_array().is_some_and(|a| a.iter().all(Value::is_string));
    if v.tools.as_ref().is_some_and(|t| !names(t)) {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`tools` must be an array of tool names",
        ));
    }
    let files = |c: &Value| {
        c.as_object()
            .is_some_and(|o| o.values().all(Value::is_string))
    };
    if v.capability_files.as_ref().is_some_and(|c| !files(c)) {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`capability_files` must be an object of file name to text content",
        ));
    }
    Ok(())
}

/// Whether every number in `v` reads back from PostgreSQL's exact decimal into an `f64`.
fn storable_numbers(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_f64().is_some_and(|f| f.abs() < 1e300),
        Value::Array(a) => a.iter().all(storable_numbers),
        Value::Object(o) => o.values().all(storable_numbers),
        _ => true,
    }
}

async fn insert_version(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    workspace_id: Uuid,
    agent_id: Uuid,
    v: &NewVersion,
) -> ApiResult<t::VersionSummary> {
    let next = sqlx::query_scalar!(
        r#"SELECT COALESCE(max(version), 0) + 1 AS "next!" FROM agent_versions WHERE agent_id = $1"#,
        agent_id,
    )
    .fetch_one(&mut **tx)
    .await?;
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO agent_versions (id, agent_id, workspace_id, version, instructions, provider, model, capability_files, tools, policy, max_iters)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        id,
        agent_id,
        workspace_id,
        next,
        &v.instructions,
        &v.provider,
        v.model.as_deref(),
        v.capability_files.clone().unwrap_or_else(|| json!({})),
        v.tools.clone().unwrap_or_else(|| json!([])),
        v.policy.clone().unwrap_or_else(|| json!({})),
        v.max_iters,
    )
    .execute(&mut **tx)
    .await?;
    Ok(t::VersionSummary {
        id,
        agent_id: Some(agent_id),
        version: next,
        provider: v.provider.clone(),
        model: v.model.clone(),
        instructions: v.instructions.clone(),
    })
}

pub async fn create_agent(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewAgent>,
) -> ApiResult<(StatusCode, Json<t::Agent>)> {
    check_name("name", &b.name)?;
    let first = b.version();
    check_version(&first)?;
    let id = Uuid::now_v7();
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    sqlx::query!(
        "INSERT INTO agents (id, workspace_id, name) VALUES ($1, $2, $3)",
        id,
        auth.workspace_id,
        &b.name,
    )
    .execute(&mut *tx)
    .await?;
    let version = insert_version(&mut tx, auth.workspace_id, id, &first).await?;
    tx.commit().await?;
    conn.release();
    Ok((
        StatusCode::CREATED,
        Json(t::Agent {
            id,
            name: b.name,
            created_at: None,
            current_version: version,
        }),
    ))
}

/// An agent with its newest version, as JSON.
struct AgentRow {
    id: Uuid,
    name: String,
    created_at: DateTime<Utc>,
    current_version: Value,
}

/// `sqlx::query_as!` into [`AgentRow`]: the agents' shared SELECT, then `$tail` (a literal).
macro_rules! select_agents {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            AgentRow,
            r#"SELECT a.id, a.name, a.created_at,
                   json_build_object('id', v.id, 'version', v.version, 'provider', v.provider,
                                     'model', v.model, 'instructions', v.instructions) AS "current_version!"
            FROM agents a
            JOIN LATERAL (SELECT * FROM agent_versions WHERE agent_id = a.id ORDER BY version DESC LIMIT 1) v ON true
            "# + $tail,
            $($arg),+
        )
    };
}

fn agent_json(r: AgentRow) -> ApiResult<t::Agent> {
    Ok(t::Agent {
        id: r.id,
        name: r.name,
        created_at: Some(r.created_at),
        current_version: from_json(r.current_version)?,
    })
}

pub async fn list_agents(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::AgentList>> {
    let rows = select_agents!(
        "WHERE a.workspace_id = $1 ORDER BY a.name",
        auth.workspace_id
    )
    .fetch_all(&s.db)
    .await?;
    let items = rows
        .into_iter()
        .map(agent_json)
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(Json(t::AgentList { items }))
}

pub async fn get_agent(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Agent>> {
    let row = select_agents!(
        "WHERE a.workspace_id = $1 AND a.id = $2",
        auth.workspace_id,
        id
    )
    .fetch_optional(&s.db)
    .await?
    .ok_or_else(|| ApiError::not_found("agent"))?;
    Ok(Json(agent_json(row)?))
}

async fn own_agent(s: &AppState, auth: Auth, id: Uuid) -> ApiResult<()> {
    let found = sqlx::query_scalar!(
        "SELECT id FROM agents WHERE id = $1 AND workspace_id = $2",
        id,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?;
    found
        .map(|_| ())
        .ok_or_else(|| ApiError::not_found("agent"))
}

/// Saving an agent makes a new immutable version; running work keeps the version it started with.
pub async fn create_version(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    Body(b): Body<NewVersion>,
) -> ApiResult<(StatusCode, Json<t::VersionSummary>)> {
    check_version(&b)?;
    own_agent(&s, auth, id).await?;
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    // Serialize version numbering per agent.
    sqlx::query_scalar!("SELECT id FROM agents WHERE id = $1 FOR UPDATE", id)
        .fetch_optional(&mut *tx)
        .await?;
    let v = insert_version(&mut tx, auth.workspace_id, id, &b).await?;
    tx.commit().await?;
    conn.release();
    Ok((StatusCode::CREATED, Json(v)))
}

pub async fn list_versions(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::AgentVersionList>> {
    own_agent(&s, auth, id).await?;
    let items = sqlx::query_as!(
        t::AgentVersion,
        "SELECT id, version, provider, model, instructions, capability_files, tools, policy,
            max_iters, created_at
         FROM agent_versions WHERE agent_id = $1 ORDER BY version",
        id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::AgentVersionList { items }))
}

pub async fn create_profile(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewProfile>,
) -> ApiResult<(StatusCode, Json<t::RuntimeProfile>)> {
    check_name("name", &b.name)?;
    check_provider(&b.provider)?;
    let params = b.params.unwrap_or_else(|| json!({}));
    let Some(obj) = params.as_object() else {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`params` must be an object",
        ));
    };
    if let Some(cmd) = obj.get("command") {
        let ok = cmd
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(|x| x.is_string()));
        if !ok {
            return Err(ApiError::bad_request(
                "invalid_field",
                "`params.command` must be a non-empty array of strings",
            ));
        }
    }
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO runtime_profiles (id, workspace_id, name, provider, params) VALUES ($1, $2, $3, $4, $5)",
        id,
        auth.workspace_id,
        &b.name,
        &b.provider,
        &params,
    )
    .execute(&s.db)
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(t::RuntimeProfile {
            id,
            name: b.name,
            provider: b.provider,
            params,
            created_at: None,
        }),
    ))
}

pub async fn list_profiles(
    State(s): State<AppState>,
    auth: Auth,
) -> ApiResult<Json<t::RuntimeProfileList>> {
    let items = sqlx::query_as!(
        t::RuntimeProfile,
        "SELECT id, name, provider, params, created_at
         FROM runtime_profiles WHERE workspace_id = $1 ORDER BY name",
        auth.workspace_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::RuntimeProfileList { items }))
}

pub async fn create_pool(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewPool>,
) -> ApiResult<(StatusCode, Json<t::Pool>)> {
    check_name("name", &b.name)?;
    check_limit("max_concurrency", b.max_concurrency)?;
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO pools (id, workspace_id, name, max_concurrency) VALUES ($1, $2, $3, $4)",
        id,
        auth.workspace_id,
        &b.name,
        b.max_concurrency,
    )
    .execute(&s.db)
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(t::Pool {
            id,
            name: b.name,
            max_concurrency: b.max_concurrency,
            created_at: None,
        }),
    ))
}

pub async fn list_pools(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::PoolList>> {
    let items = sqlx::query_as!(
        t::Pool,
        "SELECT id, name, max_concurrency, created_at
         FROM pools WHERE workspace_id = $1 ORDER BY name",
        auth.workspace_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::PoolList { items }))
}

pub async fn create_binding(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewBinding>,
) -> ApiResult<(StatusCode, Json<t::Binding>)> {
    check_limit("max_concurrency", b.max_concurrency)?;
    check_limit("max_attempts", b.max_attempts)?;
    if b.retry_backoff_ms
        .is_some_and(|v| !(0..=3_600_000).contains(&v))
    {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`retry_backoff_ms` must be between 0 and 3600000",
        ));
    }
    for p in &b.fallback_providers {
        check_provider(p)?;
    }
    for c in &b.required_capabilities {
        check_name("required_capabilities", c)?;
    }
    // Every referenced resource must be in the caller's workspace.
    let ok = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM agents WHERE id = $1 AND workspace_id = $4)
            AND EXISTS (SELECT 1 FROM pools WHERE id = $2 AND workspace_id = $4)
            AND ($3::uuid IS NULL OR EXISTS (SELECT 1 FROM runtime_profiles WHERE id = $3 AND workspace_id = $4)) AS "ok!""#,
        b.agent_id,
        b.pool_id,
        b.runtime_profile_id,
        auth.workspace_id,
    )
    .fetch_one(&s.db)
    .await?;
    if !ok {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_reference",
            "agent, pool or runtime profile not found in this workspace",
        ));
    }
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO bindings (id, workspace_id, agent_id, pool_id, runtime_profile_id, required_capabilities, max_concurrency, max_attempts, retry_backoff_ms, fallback_providers)
         VALUES ($1, $2, $3, $4, $5, $6, $7, COALESCE($8, 3), COALESCE($9::bigint, 1000), $10)",
        id,
        auth.workspace_id,
        b.agent_id,
        b.pool_id,
        b.runtime_profile_id,
        &b.required_capabilities,
        b.max_concurrency,
        b.max_attempts,
        b.retry_backoff_ms,
        &b.fallback_providers,
    )
    .execute(&s.db)
    .await?;
    Ok((StatusCode::CREATED, Json(binding_by_id(&s, id).await?)))
}

/// `sqlx::query_as!` into `t::Binding`: the bindings' shared SELECT, then `$tail` (a literal).
macro_rules! select_bindings {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            t::Binding,
            "SELECT id, agent_id, pool_id, runtime_profile_id, required_capabilities,
            max_concurrency, max_attempts, retry_backoff_ms, fallback_providers FROM bindings "
                + $tail,
            $($arg),+
        )
    };
}

async fn binding_by_id(s: &AppState, id: Uuid) -> ApiResult<t::Binding> {
    Ok(select_bindings!("WHERE id = $1", id)
        .fetch_one(&s.db)
        .await?)
}

pub async fn list_bindings(
    State(s): State<AppState>,
    auth: Auth,
) -> ApiResult<Json<t::BindingList>> {
    let items = select_bindings!(
        "WHERE workspace_id = $1 ORDER BY created_at",
        auth.workspace_id
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::BindingList { items }))
}

/// A host as stored, with its heartbeat's age.
struct HostRow {
    id: Uuid,
    name: String,
    pool_name: String,
    pool_id: Option<Uuid>,
    capacity: i32,
    running: i32,
    capabilities: Vec<String>,
    providers: Value,
    version: String,
    last_seen_at: DateTime<Utc>,
    checks: Value,
    age_ms: f64,
}

fn host_json(r: HostRow, offline_after_ms: u64) -> ApiResult<t::Host> {
    let age_ms = r.age_ms;
    let online = age_ms <= offline_after_ms as f64;
    let reported: Vec<t::HostCheck> = from_json(r.checks)?;
    let find = |name: &str| {
        reported
            .iter()
            .find(|c| c.name.as_deref() == Some(name))
            .cloned()
            .unwrap_or_else(|| t::HostCheck::failed("not reported"))
    };
    // Connectivity is judged from the heartbeat's age as well as what the host reports.
    let mut connectivity = find("connectivity");
    if !online {
        connectivity = t::HostCheck::failed(format!("no heartbeat for {:.0} s", age_ms / 1000.0));
    }
    // An offline host's last heartbeat is history: no running count and no readiness from it.
    let dispatch = if online {
        find("dispatch_readiness")
    } else {
        t::HostCheck::failed(format!(
            "offline: no heartbeat for {:.0} s; it accepts no work",
            age_ms / 1000.0
        ))
    };
    let running = if online { Some(r.running) } else { None };
    Ok(t::Host {
        id: r.id,
        name: r.name,
        pool: r.pool_name,
        pool_id: r.pool_id,
        capacity: r.capacity,
        running,
        capabilities: r.capabilities,
        providers: r.providers,
        version: r.version,
        online,
        last_seen_at: r.last_seen_at,
        checks: t::HostChecks {
            connectivity,
            provider_discovery: find("provider_discovery"),
            dispatch_readiness: dispatch,
        },
    })
}

/// `sqlx::query_as!` into [`HostRow`]: the hosts' shared SELECT, then `$tail` (a literal).
macro_rules! select_hosts {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            HostRow,
            r#"SELECT id, name, pool_name, pool_id, capacity, running, capabilities, providers, version,
            last_seen_at, checks, EXTRACT(EPOCH FROM (now() - last_seen_at))::float8 * 1000 AS "age_ms!"
            FROM hosts "# + $tail,
            $($arg),+
        )
    };
}

pub async fn list_hosts(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::HostList>> {
    let rows = select_hosts!(
        "WHERE workspace_id = $1 ORDER BY name, id",
        auth.workspace_id
    )
    .fetch_all(&s.db)
    .await?;
    let items = rows
        .into_iter()
        .map(|r| host_json(r, s.config.host_offline_after_ms))
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(Json(t::HostList { items }))
}

pub async fn get_host(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Host>> {
    let row = select_hosts!("WHERE workspace_id = $1 AND id = $2", auth.workspace_id, id)
        .fetch_optional(&s.db)
        .await?
        .ok_or_else(|| ApiError::not_found("host"))?;
    Ok(Json(host_json(row, s.config.host_offline_after_ms)?))
}
