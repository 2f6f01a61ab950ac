//! `GET /v1/tasks/{id}/explain`: why a task waits, or why it failed.
//!
//! A waiting task gets its task-level blockers and, for every host of the workspace, each
//! predicate of the scheduler's claim (`svc-scheduler/src/claim.rs`) that keeps that host from
//! claiming it. A task that ended without success gets its failure class, the remedy hint and
//! the last events of the attempt that ended it. Everything is read from the records; nothing
//! here changes them.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Id};
use agentscope_domain::{AttemptStatus, FailureClass, task_status};
use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};
use uuid::Uuid;

/// How many of the ending attempt's events are shown as evidence.
const EVIDENCE_EVENTS: i64 = 10;

fn blocker(predicate: &str, detail: impl Into<String>) -> Value {
    json!({"predicate": predicate, "detail": detail.into()})
}

/// What the scheduler matches hosts against: the newest attempt, or (before the scheduler has
/// created one) what the agent's binding would give it.
struct Target {
    binding_id: Option<Uuid>,
    pool_id: Option<Uuid>,
    provider: Option<String>,
    required_capabilities: Vec<String>,
}

struct Attempt {
    id: Uuid,
    number: i32,
    status: AttemptStatus,
    host_id: Option<Uuid>,
    failure_class: Option<String>,
    failure_detail: Option<String>,
    exit_code: Option<i32>,
    not_before_ms: f64,
    target: Target,
    json: Value,
}

/// One attempt of the task as stored, with its JSON for the answer.
struct AttemptRow {
    id: Uuid,
    number: i32,
    status: String,
    host_id: Option<Uuid>,
    binding_id: Option<Uuid>,
    pool_id: Option<Uuid>,
    provider: Option<String>,
    required_capabilities: Vec<String>,
    failure_class: Option<String>,
    failure_detail: Option<String>,
    exit_code: Option<i32>,
    not_before_ms: f64,
    j: Value,
}

fn attempt_from(r: AttemptRow) -> ApiResult<Attempt> {
    let failure_class = r.failure_class;
    let mut json = r.j;
    if let Some(c) = &failure_class {
        json["remedy"] = json!(FailureClass::parse(c).remedy());
    }
    Ok(Attempt {
        id: r.id,
        number: r.number,
        status: AttemptStatus::parse(&r.status).unwrap_or(AttemptStatus::Failed),
        host_id: r.host_id,
        failure_class,
        failure_detail: r.failure_detail,
        exit_code: r.exit_code,
        not_before_ms: r.not_before_ms,
        target: Target {
            binding_id: r.binding_id,
            pool_id: r.pool_id,
            provider: r.provider,
            required_capabilities: r.required_capabilities,
        },
        json,
    })
}

pub async fn explain(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<agentscope_api::Explanation>> {
    let task = sqlx::query!(
        "SELECT t.agent_id, ag.name AS agent_name, t.cancel_requested_at FROM tasks t
         JOIN agents ag ON ag.id = t.agent_id
         WHERE t.workspace_id = $1 AND t.id = $2",
        auth.workspace_id,
        id,
    )
    .fetch_optional(&s.db)
    .await?
    .ok_or_else(|| ApiError::not_found("task"))?;
    let agent_id = task.agent_id;
    let agent_name = task.agent_name;
    let cancel_requested_at = task.cancel_requested_at;

    let rows = sqlx::query_as!(
        AttemptRow,
        r#"SELECT a.id, a.number, a.status, a.host_id, a.binding_id, a.pool_id, a.provider,
                a.required_capabilities, a.failure_class, a.failure_detail, a.exit_code,
                EXTRACT(EPOCH FROM (a.not_before - now()))::float8 * 1000 AS "not_before_ms!",
                json_build_object('id', a.id, 'number', a.number, 'status', a.status,
                    'host_id', a.host_id, 'pool_id', a.pool_id, 'binding_id', a.binding_id,
                    'provider', a.provider, 'required_capabilities', a.required_capabilities,
                    'not_before', a.not_before, 'created_at', a.created_at,
                    'claimed_at', a.claimed_at, 'started_at', a.started_at,
                    'finished_at', a.finished_at, 'failure_class', a.failure_class,
                    'failure_detail', a.failure_detail, 'exit_code', a.exit_code,
                    'events', a.last_seq) AS "j!"
         FROM attempts a WHERE a.workspace_id = $1 AND a.task_id = $2 ORDER BY a.number"#,
        auth.workspace_id,
        id,
    )
    .fetch_all(&s.db)
    .await?;
    let attempts = rows
        .into_iter()
        .map(attempt_from)
        .collect::<ApiResult<Vec<_>>>()?;
    let newest = attempts.last();
    let status = task_status(newest.map(|a| a.status));
    let mut out = json!({
        "task_id": id,
        "status": status,
        "agent_id": agent_id,
        "agent_name": agent_name,
        "cancel_requested_at": cancel_requested_at,
        "attempts": attempts.iter().map(|a| a.json.clone()).collect::<Vec<_>>(),
    });

    out["timeout"] = effective_timeout(&s, auth, id, newest.map(|a| a.id)).await?;

    match newest {
        None => {
            out["waiting"] = json!(true);
            out["attempt"] = Value::Null;
            let target = target_from_binding(&s, auth, agent_id).await?;
            let mut reasons = vec![blocker(
                "no_attempt",
                "the scheduler has not created an attempt yet; its sweep creates one for every task without",
            )];
            waiting(
                &s,
                auth,
                &mut out,
                &mut reasons,
                &target,
                agent_id,
                &agent_name,
                cancel_requested_at,
            )
            .await?;
        }
        Some(a) if a.status == AttemptStatus::Queued => {
            out["waiting"] = json!(true);
            out["attempt"] = a.json.clone();
            let mut reasons = Vec::new();
            if a.not_before_ms > 0.0 {
                reasons.push(blocker(
                    "backoff",
                    format!(
                        "attempt {} waits for its retry backoff: claimable in {:.1} s",
                        a.number,
                        a.not_before_ms / 1000.0
                    ),
                ));
            }
            waiting(
                &s,
                auth,
                &mut out,
                &mut reasons,
                &a.target,
                agent_id,
                &agent_name,
                cancel_requested_at,
            )
            .await?;
        }
        Some(a) if a.status.is_active() => {
            out["waiting"] = json!(false);
            out["attempt"] = a.json.clone();
            let host = match a.host_id {
                Some(h) => sqlx::query!(
                    "SELECT id, name, pool_name FROM hosts WHERE workspace_id = $1 AND id = $2",
                    auth.workspace_id,
                    h,
                )
                .fetch_optional(&s.db)
                .await?
                .map(|r| {
                    json!({
                        "host_id": r.id,
                        "name": r.name,
                        "pool": r.pool_name,
                    })
                }),
                None => None,
            };
            let name = host
                .as_ref()
                .and_then(|h| h["name"].as_str())
                .unwrap_or("an unknown host")
                .to_string();
            out["host"] = host.unwrap_or(Value::Null);
            out["summary"] = json!(format!(
                "not waiting: attempt {} is {} on host {name}",
                a.number, a.status
            ));
        }
        Some(a) if a.status == AttemptStatus::Succeeded => {
            out["waiting"] = json!(false);
            out["attempt"] = a.json.clone();
            out["summary"] = json!(format!("succeeded in attempt {}", a.number));
        }
        Some(a) => {
            out["waiting"] = json!(false);
            out["attempt"] = a.json.clone();
            let class = a.failure_class.clone().unwrap_or_else(|| match a.status {
                AttemptStatus::Cancelled => FailureClass::Cancelled.as_str().into(),
                AttemptStatus::Lost => FailureClass::LeaseLost.as_str().into(),
                _ => FailureClass::Internal.as_str().into(),
            });
            let evidence = sqlx::query_scalar!(
                r#"SELECT json_build_object('seq', e.seq, 'kind', e.kind, 'payload', e.payload, 'at', e.at) AS "event!"
                 FROM (SELECT seq, kind, payload, at FROM execution_events
                       WHERE attempt_id = $1 ORDER BY seq DESC LIMIT $2) e
                 ORDER BY e.seq"#,
                a.id,
                EVIDENCE_EVENTS,
            )
            .fetch_all(&s.db)
            .await?;
            let remedy = FailureClass::parse(&class).remedy();
            out["summary"] = json!(format!(
                "{status}: attempt {} ended {} with class {class}",
                a.number, a.status
            ));
            out["failure"] = json!({
                "attempt_id": a.id,
                "attempt_number": a.number,
                "attempt_status": a.status,
                "class": class,
                "remedy": remedy,
                "detail": a.failure_detail,
                "exit_code": a.exit_code,
                "evidence": evidence,
            });
        }
    }
    Ok(Json(crate::api::from_json(out)?))
}

/// The run timeout that applies to the task's attempts and where it comes from. Precedence: the
/// task's `timeout_secs`, then the runtime profile's `timeout_secs` parameter, then the
/// deployment default (`AGENTSCOPE_RUN_TIMEOUT_SECS` of the scheduler and the gateway). The claim
/// that leases an attempt writes the default into its spec; before that it is derived here, and
/// the default is named without a number (the claiming service's setting decides it).
async fn effective_timeout(
    s: &AppState,
    auth: Auth,
    task_id: Uuid,
    newest: Option<Uuid>,
) -> ApiResult<Value> {
    let describe = |secs: Option<i64>, source: &str| {
        let detail = match (source, secs) {
            ("task", Some(n)) => format!("{n} s, from the task's timeout_secs"),
            ("profile", Some(n)) => {
                format!("{n} s, from the runtime profile's timeout_secs (the task sets none)")
            }
            (_, Some(n)) => format!(
                "{n} s, the deployment default (AGENTSCOPE_RUN_TIMEOUT_SECS of the scheduler and the gateway; neither the task nor its runtime profile sets timeout_secs)"
            ),
            (_, None) => "the deployment default (AGENTSCOPE_RUN_TIMEOUT_SECS of the scheduler and the gateway; neither the task nor its runtime profile sets timeout_secs)".to_string(),
        };
        json!({"secs": secs, "source": source, "detail": detail})
    };
    if let Some(attempt) = newest {
        let row = sqlx::query!(
            r#"SELECT (spec->>'timeout_secs')::bigint AS "secs?", spec->>'timeout_source' AS "source?"
             FROM attempts WHERE workspace_id = $1 AND id = $2"#,
            auth.workspace_id,
            attempt,
        )
        .fetch_optional(&s.db)
        .await?
        .map(|r| (r.secs, r.source));
        if let Some((Some(secs), Some(source))) = row
            && secs > 0
        {
            return Ok(describe(Some(secs), &source));
        }
    }
    let row = sqlx::query!(
        r#"SELECT t.timeout_secs, rp.params->'timeout_secs' AS "profile_secs?"
         FROM tasks t
         LEFT JOIN bindings b ON b.agent_id = t.agent_id
         LEFT JOIN runtime_profiles rp ON rp.id = b.runtime_profile_id
         WHERE t.workspace_id = $1 AND t.id = $2"#,
        auth.workspace_id,
        task_id,
    )
    .fetch_optional(&s.db)
    .await?
    .map(|r| (r.timeout_secs, r.profile_secs));
    let (task_secs, profile) = row.unwrap_or((None, None));
    if let Some(t) = task_secs.filter(|t| *t > 0) {
        return Ok(describe(Some(t as i64), "task"));
    }
    let profile = profile.and_then(|v| match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse::<i64>().ok(),
        _ => None,
    });
    Ok(match profile.filter(|p| *p > 0) {
        Some(p) => describe(Some(p), "profile"),
        None => describe(None, "default"),
    })
}

/// The binding's view of a task that has no attempt yet.
async fn target_from_binding(s: &AppState, auth: Auth, agent_id: Uuid) -> ApiResult<Target> {
    let row = sqlx::query!(
        r#"SELECT b.id AS "binding_id?", b.pool_id AS "pool_id?",
                b.required_capabilities AS "required_capabilities?",
                COALESCE(rp.provider, v.provider) AS "provider?"
         FROM agents ag
         LEFT JOIN LATERAL (SELECT provider FROM agent_versions WHERE agent_id = ag.id
                            ORDER BY version DESC LIMIT 1) v ON true
         LEFT JOIN bindings b ON b.agent_id = ag.id
         LEFT JOIN runtime_profiles rp ON rp.id = b.runtime_profile_id
         WHERE ag.workspace_id = $1 AND ag.id = $2"#,
        auth.workspace_id,
        agent_id,
    )
    .fetch_one(&s.db)
    .await?;
    Ok(Target {
        binding_id: row.binding_id,
        pool_id: row.pool_id,
        provider: row.provider,
        required_capabilities: row.required_capabilities.unwrap_or_default(),
    })
}

/// A concurrency limit that is reached: `(limit, active)`.
fn reached(limit: Option<i32>, active: i64) -> Option<(i32, i64)> {
    limit.filter(|l| active >= *l as i64).map(|l| (l, active))
}

/// Fills `reasons`, `hosts` and `summary` of a waiting task.
#[allow(clippy::too_many_arguments)]
async fn waiting(
    s: &AppState,
    auth: Auth,
    out: &mut Value,
    reasons: &mut Vec<Value>,
    target: &Target,
    agent_id: Uuid,
    agent_name: &str,
    cancel_requested_at: Option<chrono::DateTime<chrono::Utc>>,
) -> ApiResult<()> {
    let ws = auth.workspace_id;
    if target.binding_id.is_none() {
        let bound_now = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM bindings WHERE workspace_id = $1 AND agent_id = $2) AS "bound!""#,
            ws,
            agent_id,
        )
        .fetch_one(&s.db)
        .await?;
        reasons.push(blocker(
            "binding",
            if bound_now {
                format!(
                    "agent `{agent_name}` was bound after this attempt was created; the scheduler's sweep attaches the binding"
                )
            } else {
                format!(
                    "agent `{agent_name}` has no binding: POST /v1/bindings to bind it to a pool"
                )
            },
        ));
    }
    if let Some(at) = cancel_requested_at {
        reasons.push(blocker(
            "cancel_requested",
            format!(
                "cancellation was requested at {}; the scheduler cancels the queued attempt",
                at.to_rfc3339()
            ),
        ));
    }

    // The target pool and the three concurrency limits; each is the same for every host.
    let pool = match target.pool_id {
        Some(p) => sqlx::query!(
            "SELECT name, max_concurrency FROM pools WHERE workspace_id = $1 AND id = $2",
            ws,
            p,
        )
        .fetch_optional(&s.db)
        .await?
        .map(|r| (r.name, r.max_concurrency)),
        None => None,
    };
    let pool_name = pool.as_ref().map(|p| p.0.clone());
    let pool_limit = match (target.pool_id, pool.as_ref().and_then(|p| p.1)) {
        (Some(p), Some(limit)) => {
            let n = sqlx::query_scalar!(
                r#"SELECT count(*) AS "n!" FROM attempts WHERE workspace_id = $1 AND pool_id = $2
                 AND status IN ('claimed','running')"#,
                ws,
                p,
            )
            .fetch_one(&s.db)
            .await?;
            reached(Some(limit), n)
        }
        _ => None,
    };
    let agent_limit = match target.binding_id {
        Some(b) => {
            let limit = sqlx::query_scalar!(
                "SELECT max_concurrency FROM bindings WHERE workspace_id = $1 AND id = $2",
                ws,
                b,
            )
            .fetch_optional(&s.db)
            .await?;
            match limit.flatten() {
                Some(limit) => {
                    let n = sqlx::query_scalar!(
                        r#"SELECT count(*) AS "n!" FROM attempts WHERE workspace_id = $1 AND agent_id = $2
                         AND status IN ('claimed','running')"#,
                        ws,
                        agent_id,
                    )
                    .fetch_one(&s.db)
                    .await?;
                    reached(Some(limit), n)
                }
                None => None,
            }
        }
        None => None,
    };
    let w = sqlx::query!(
        r#"SELECT w.max_concurrency, (SELECT count(*) FROM attempts a WHERE a.workspace_id = w.id
             AND a.status IN ('claimed','running')) AS "active!"
         FROM workspaces w WHERE w.id = $1"#,
        ws,
    )
    .fetch_one(&s.db)
    .await?;
    let workspace_limit = reached(w.max_concurrency, w.active);

    let hosts = sqlx::query!(
        r#"SELECT h.id, h.name, h.pool_id, h.pool_name, h.capacity, h.providers, h.capabilities,
                p.name AS "pool_display?",
                EXTRACT(EPOCH FROM (now() - h.last_seen_at))::float8 * 1000 AS "age_ms!",
                (SELECT count(*) FROM attempts a WHERE a.host_id = h.id
                     AND a.status IN ('claimed','running')) AS "active!"
         FROM hosts h LEFT JOIN pools p ON p.id = h.pool_id
         WHERE h.workspace_id = $1 ORDER BY h.name, h.id"#,
        ws,
    )
    .fetch_all(&s.db)
    .await?;
    if hosts.is_empty() {
        reasons.push(blocker(
            "no_hosts",
            "no host is registered in this workspace: start svc-host with a host token (POST /v1/host-tokens)",
        ));
    }
    let wanted_pool = match (&pool_name, target.pool_id) {
        (Some(n), _) => format!("`{n}`"),
        (None, Some(p)) => format!("{p} (no longer exists)"),
        (None, None) => "none (the agent has no binding)".to_string(),
    };

    let mut items = Vec::new();
    let mut eligible = Vec::new();
    for h in hosts {
        let host_id = h.id;
        let name = h.name;
        let host_pool_id = h.pool_id;
        let host_pool = h.pool_name;
        let capacity = h.capacity;
        let providers = h.providers;
        let capabilities = h.capabilities;
        let age_ms = h.age_ms;
        let active = h.active;
        let mut failing = Vec::new();

        // scope: the host's pool name resolves to no pool of this workspace.
        if host_pool_id.is_none() {
            failing.push(blocker(
                "scope",
                format!(
                    "host registered for pool `{host_pool}`, which does not exist in this workspace \
                     (create it with POST /v1/pools and restart the host, or fix AGENTSCOPE_POOL)"
                ),
            ));
        }
        // pool: the host serves another pool than the task's.
        let other_pool = match host_pool_id {
            Some(p) => target.pool_id != Some(p),
            None => pool_name.as_deref() != Some(host_pool.as_str()),
        };
        if other_pool {
            failing.push(blocker(
                "pool",
                format!("host is in pool `{host_pool}`; the task needs pool {wanted_pool}"),
            ));
        }
        // connectivity: judged from the heartbeat's age, as `GET /v1/hosts` does.
        if age_ms > s.config.host_offline_after_ms as f64 {
            failing.push(blocker(
                "connectivity",
                format!(
                    "no heartbeat for {:.0} s (a host is offline after {} ms)",
                    age_ms / 1000.0,
                    s.config.host_offline_after_ms
                ),
            ));
        }
        // provider: installed and logged in.
        match &target.provider {
            Some(want) => {
                let found = providers
                    .as_array()
                    .and_then(|a| a.iter().find(|p| p["name"] == want.as_str()));
                match found {
                    None => failing.push(blocker(
                        "provider",
                        format!(
                            "`{want}` not installed: the host does not offer it (offers: {})",
                            offered(&providers)
                        ),
                    )),
                    Some(p) if p["installed"] != true => failing.push(blocker(
                        "provider",
                        format!("`{want}` not installed: {}", text(&p["detail"])),
                    )),
                    Some(p) if p["logged_in"] != true => failing.push(blocker(
                        "provider",
                        format!("`{want}` not logged in: {}", text(&p["detail"])),
                    )),
                    Some(_) => {}
                }
            }
            None => failing.push(blocker("provider", "the task names no provider")),
        }
        // capability: every required capability on the host.
        let missing: Vec<&str> = target
            .required_capabilities
            .iter()
            .filter(|c| !capabilities.contains(c))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            failing.push(blocker(
                "capability",
                format!(
                    "missing capabilities: {} (host has: {})",
                    missing.join(", "),
                    if capabilities.is_empty() {
                        "none".to_string()
                    } else {
                        capabilities.join(", ")
                    }
                ),
            ));
        }
        // capacity: the host's slots are taken by claimed or running attempts.
        if active >= capacity as i64 {
            failing.push(blocker(
                "capacity",
                format!("host is full: {active} active attempts of capacity {capacity}"),
            ));
        }
        if let Some((limit, n)) = agent_limit {
            failing.push(blocker(
                "agent_limit",
                format!("agent `{agent_name}` runs {n} attempts; its binding allows {limit}"),
            ));
        }
        if let Some((limit, n)) = pool_limit {
            failing.push(blocker(
                "pool_limit",
                format!("pool {wanted_pool} runs {n} attempts; its max_concurrency is {limit}"),
            ));
        }
        if let Some((limit, n)) = workspace_limit {
            failing.push(blocker(
                "workspace_limit",
                format!("the workspace runs {n} attempts; its max_concurrency is {limit}"),
            ));
        }
        if failing.is_empty() {
            eligible.push(name.clone());
        }
        let pool_display = h.pool_display;
        items.push(json!({
            "host_id": host_id,
            "name": name,
            "pool": pool_display.unwrap_or(host_pool),
            "pool_id": host_pool_id,
            "eligible": failing.is_empty(),
            "failing": failing,
        }));
    }
    let summary = if !reasons.is_empty() && eligible.is_empty() {
        format!(
            "waiting: {} ({} hosts, none eligible)",
            reasons
                .iter()
                .filter_map(|r| r["predicate"].as_str())
                .collect::<Vec<_>>()
                .join(", "),
            items.len()
        )
    } else if eligible.is_empty() {
        format!(
            "waiting: none of the {} hosts can claim it; see each host's failing predicates",
            items.len()
        )
    } else if reasons.is_empty() {
        format!(
            "waiting: eligible host(s) {} will claim it at their next claim",
            eligible.join(", ")
        )
    } else {
        format!(
            "waiting: {} (eligible hosts: {})",
            reasons
                .iter()
                .filter_map(|r| r["predicate"].as_str())
                .collect::<Vec<_>>()
                .join(", "),
            eligible.join(", ")
        )
    };
    out["target"] = json!({
        "binding_id": target.binding_id,
        "pool_id": target.pool_id,
        "pool": pool_name,
        "provider": target.provider,
        "required_capabilities": target.required_capabilities,
    });
    out["reasons"] = json!(reasons);
    out["hosts"] = json!(items);
    out["eligible_hosts"] = json!(eligible.len());
    out["summary"] = json!(summary);
    Ok(())
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn offered(providers: &Value) -> String {
    let names: Vec<&str> = providers
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}
