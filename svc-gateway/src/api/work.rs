//! Issues, comments, tasks (submission, cancellation) and attempts.

use crate::AppState;
use crate::api::resources::check_name;
use crate::dispatch::Dispatched;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Body, Id};
use agentscope_api as t;
use agentscope_api::{CancelTask, NewComment, NewIssue, NewTask, TaskFilter};
use agentscope_bus::subjects;
use agentscope_domain::{AttemptStatus, task_status};
use agentscope_schemas::Message;
use agentscope_schemas::v1::CancelRequest;
use agentscope_store::first_attempt::{DEFAULT_TIMEOUT_SOURCE, TaskFields};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde_json::json;
use sqlx::Connection as _;
use uuid::Uuid;

fn check_source(repository: &Option<String>, branch: &Option<String>) -> ApiResult<()> {
    if let Some(r) = repository
        && (r.is_empty()
            || r.len() > 2048
            || r.starts_with('-')
            || r.chars().any(|c| c.is_control()))
    {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`repository` must be a path or URL (at most 2048 characters, not starting with '-')",
        ));
    }
    if let Some(b) = branch {
        let bad = b.is_empty()
            || b.len() > 255
            || b.starts_with('-')
            || b.contains("..")
            || b.chars()
                .any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c));
        if bad {
            return Err(ApiError::bad_request(
                "invalid_field",
                "`branch` is not a valid git branch name",
            ));
        }
    }
    Ok(())
}

pub async fn create_issue(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewIssue>,
) -> ApiResult<(StatusCode, Json<t::IssueCreated>)> {
    check_name("title", &b.title)?;
    check_source(&b.repository, &b.branch)?;
    if b.body.len() > 256 * 1024 || b.input.len() > 256 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`body` and `input` are limited to 256 KiB",
        ));
    }
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    if let Some(agent) = b.assignee_agent_id {
        let own = sqlx::query_scalar!(
            "SELECT id FROM agents WHERE id = $1 AND workspace_id = $2",
            agent,
            auth.workspace_id,
        )
        .fetch_optional(&mut *tx)
        .await?;
        if own.is_none() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_reference",
                "assignee agent not found in this workspace",
            ));
        }
    }
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO issues (id, workspace_id, title, body, assignee_agent_id) VALUES ($1, $2, $3, $4, $5)",
        id,
        auth.workspace_id,
        &b.title,
        &b.body,
        b.assignee_agent_id,
    )
    .execute(&mut *tx)
    .await?;
    // An Issue assigned to an agent becomes a Task in the same transaction.
    let task = match b.assignee_agent_id {
        Some(agent) => {
            let sub = Submission {
                task: TaskFields {
                    workspace_id: auth.workspace_id,
                    agent_id: agent,
                    issue_id: Some(id),
                    repository: b.repository.as_deref(),
                    branch: b.branch.as_deref(),
                    input: &b.input,
                    timeout_secs: None,
                },
                idempotency_key: None,
                request_hash: None,
            };
            let stored = insert_task(&mut tx, &sub, dispatching(&s), &s.plans)
                .await?
                .ok_or_else(|| ApiError::Db(sqlx::Error::RowNotFound))?;
            Some(stored)
        }
        None => None,
    };
    tx.commit().await?;
    conn.release();
    let task_id = task.as_ref().map(|t| t.id);
    if let Some(mut t) = task {
        hand_out(&s, auth.workspace_id, &mut t).await;
    }
    Ok((
        StatusCode::CREATED,
        Json(t::IssueCreated {
            id,
            title: b.title,
            body: b.body,
            assignee_agent_id: b.assignee_agent_id,
            task_id,
        }),
    ))
}

pub async fn list_issues(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::IssueList>> {
    let items = sqlx::query_as!(
        t::IssueSummary,
        "SELECT id, title, status, assignee_agent_id, created_at
         FROM issues WHERE workspace_id = $1 ORDER BY created_at DESC LIMIT 500",
        auth.workspace_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::IssueList { items }))
}

pub async fn get_issue(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Issue>> {
    let row = sqlx::query_as!(
        t::Issue,
        r#"SELECT i.id, i.title, i.body, i.status, i.assignee_agent_id, i.created_at,
            ARRAY(SELECT t.id FROM tasks t WHERE t.issue_id = i.id ORDER BY t.created_at) AS "tasks!"
         FROM issues i WHERE i.workspace_id = $1 AND i.id = $2"#,
        auth.workspace_id,
        id,
    )
    .fetch_optional(&s.db)
    .await?;
    Ok(Json(row.ok_or_else(|| ApiError::not_found("issue"))?))
}

async fn own_issue(s: &AppState, auth: Auth, id: Uuid) -> ApiResult<()> {
    let own = sqlx::query_scalar!(
        "SELECT id FROM issues WHERE id = $1 AND workspace_id = $2",
        id,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?;
    own.map(|_| ()).ok_or_else(|| ApiError::not_found("issue"))
}

pub async fn create_comment(
    State(s): State<AppState>,
    auth: Auth,
    Id(issue): Id,
    Body(b): Body<NewComment>,
) -> ApiResult<(StatusCode, Json<t::Comment>)> {
    if b.body.trim().is_empty() || b.body.len() > 64 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`body` must be 1 byte to 64 KiB",
        ));
    }
    if let Some(a) = &b.author {
        check_name("author", a)?;
    }
    let author = auth.author();
    own_issue(&s, auth, issue).await?;
    let id = Uuid::now_v7();
    sqlx::query!(
        "INSERT INTO comments (id, workspace_id, issue_id, author, body) VALUES ($1, $2, $3, $4, $5)",
        id,
        auth.workspace_id,
        issue,
        &author,
        &b.body,
    )
    .execute(&s.db)
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(t::Comment {
            id,
            issue_id: Some(issue),
            author,
            body: b.body,
            created_at: None,
        }),
    ))
}

pub async fn list_comments(
    State(s): State<AppState>,
    auth: Auth,
    Id(issue): Id,
) -> ApiResult<Json<t::CommentList>> {
    own_issue(&s, auth, issue).await?;
    // The list of an Issue's comments leaves each comment's `issue_id` out.
    let items = sqlx::query_as!(
        t::Comment,
        r#"SELECT id, NULL::uuid AS "issue_id?", author, body, created_at FROM comments WHERE issue_id = $1 ORDER BY created_at, id"#,
        issue,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::CommentList { items }))
}

trait RequestHash {
    fn request_hash(&self) -> String;
}

impl RequestHash for NewTask {
    /// What makes two submissions the same request (everything but the key).
    fn request_hash(&self) -> String {
        crate::api::request_hash(&json!({
            "agent_id": self.agent_id,
            "issue_id": self.issue_id,
            "repository": self.repository,
            "branch": self.branch,
            "input": self.input,
            "timeout_secs": self.timeout_secs,
        }))
    }
}

/// A task to store, with its first attempt.
struct Submission<'a> {
    task: agentscope_store::first_attempt::TaskFields<'a>,
    idempotency_key: Option<&'a str>,
    request_hash: Option<&'a str>,
}

/// What [`insert_task`] stored.
struct Stored {
    id: Uuid,
    created_at: chrono::DateTime<chrono::Utc>,
    attempt: t::Attempt,
    pool_id: Option<Uuid>,
    /// The attempt as stored claimed for an idle host (direct dispatch), with the task token
    /// whose hash it got, and the pool's turn to dispatch.
    claim: Option<(crate::dispatch::Claim, String)>,
    _turn: Option<crate::dispatch::Turn>,
}

/// Stores a task and its first attempt in one statement (`submit_task`, migrations 0007 and
/// 0008; so in one transaction with whatever else `db` is in): the task is never without an
/// attempt, and no bus message stands between the submission and the hosts. The attempt is
/// queued, or, with direct dispatch on (`dispatching`) and no other dispatch of this gateway
/// under way for the pool, claimed for an idle host if the pool has one and no older work waits
/// for it. `None` when the agent, or the issue, is not in the workspace.
///
/// The attempt is resolved from its agent's plan ([`agentscope_store::first_attempt`], the read
/// the scheduler also makes for a task found without an attempt), which also checks that the
/// agent and the issue are the workspace's. A task without an issue is resolved from the plan
/// this gateway kept from an earlier submission of the agent, if it has one, and the statement
/// that stores it checks that this plan is still the agent's; a stale one stores nothing, and
/// the plan is read again. (Agents, issues, versions, bindings and pools are never deleted nor
/// moved, so what was read still holds for the insert.)
async fn insert_task(
    db: &mut sqlx::PgConnection,
    sub: &Submission<'_>,
    dispatching: Option<crate::dispatch::Dispatching<'_>>,
    plans: &crate::plans::Plans,
) -> Result<Option<Stored>, sqlx::Error> {
    let task = &sub.task;
    let (ws, agent) = (task.workspace_id, task.agent_id);
    let mut kept = match task.issue_id {
        None => plans.get(ws, agent),
        Some(_) => None,
    };
    // A plan read here is stale only if the agent got a new version or its first binding in
    // between; a few reads are enough unless it gets them without pause.
    for _ in 0..4 {
        let (plan, issue) = match kept.take() {
            Some(plan) => (plan, None),
            None => match agentscope_store::first_attempt::read(&mut *db, task).await? {
                Some((plan, issue)) => {
                    let plan = std::sync::Arc::new(plan);
                    plans.keep(ws, agent, plan.clone());
                    (plan, issue)
                }
                None => {
                    plans.forget(ws, agent);
                    return Ok(None);
                }
            },
        };
        let p = plan.plan(task, issue.as_ref());
        match store_task(&mut *db, sub, p, dispatching).await? {
            Some(stored) => return Ok(Some(stored)),
            None => plans.forget(ws, agent),
        }
    }
    Err(sqlx::Error::Protocol(
        "the agent's plan changed on every read".into(),
    ))
}

/// `submit_task` for `sub` resolved as `p`; `None` when `p` is not the agent's plan any more.
async fn store_task(
    db: &mut sqlx::PgConnection,
    sub: &Submission<'_>,
    p: agentscope_store::first_attempt::Plan,
    dispatching: Option<crate::dispatch::Dispatching<'_>>,
) -> Result<Option<Stored>, sqlx::Error> {
    let task = &sub.task;
    let (id, attempt_id) = (Uuid::now_v7(), Uuid::now_v7());
    let turn = match (dispatching, p.pool_id) {
        (Some(d), Some(pool)) => d.pools.enter(pool),
        _ => None,
    };
    // Only a submission that may dispatch needs a credential for its attempt (its hash is
    // stored only if the attempt is stored claimed).
    let (fresh_ms, run_timeout, task_token) = match (&turn, dispatching) {
        (Some(_), Some(d)) => (
            d.config.host_offline_after_ms.min(i64::MAX as u64) as i64,
            d.config.run_timeout_secs as i64,
            Some(agentscope_domain::new_token(
                agentscope_domain::TokenKind::Task,
            )),
        ),
        _ => (0, 0, None),
    };
    // The host the pool's last dispatch went to hears of the attempt while the statement runs
    // (and the statement prefers it among the idle hosts): with a slot free, it prepares the
    // task directory meanwhile.
    let prefer = turn.as_ref().and_then(|t| t.last_host);
    if let (Some(host), Some(d)) = (prefer, dispatching) {
        crate::dispatch::tell_early(d.nats, host, task.workspace_id, id, attempt_id, &p.spec).await;
    }
    let row = sqlx::query!(
        r#"SELECT r_stale AS "stale!", r_created_at AS created_at, r_host AS host,
                  r_token AS token, r_spec AS spec
           FROM submit_task($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                            $17, $18, $19, $20, $21, $22)"#,
        id,
        task.workspace_id,
        task.issue_id,
        task.agent_id,
        task.repository,
        task.branch,
        task.input,
        task.timeout_secs,
        sub.idempotency_key,
        sub.request_hash,
        attempt_id,
        p.agent_version_id,
        p.binding_id,
        p.pool_id,
        p.provider.as_deref(),
        &p.required_capabilities,
        &p.spec,
        fresh_ms,
        task_token.as_deref().map(agentscope_domain::hash_token),
        run_timeout,
        DEFAULT_TIMEOUT_SOURCE,
        prefer,
    )
    .fetch_one(&mut *db)
    .await?;
    let (false, Some(created_at)) = (row.stale, row.created_at) else {
        return Ok(None);
    };
    if let Some(t) = &turn {
        t.went_to(row.host);
    }
    let claim = match (row.host, row.token, row.spec, task_token) {
        (Some(host), Some(token), Some(spec), Some(task_token)) => Some((
            crate::dispatch::Claim {
                host,
                id: attempt_id,
                task_id: id,
                spec,
                token,
            },
            task_token,
        )),
        _ => None,
    };
    Ok(Some(stored(id, attempt_id, created_at, p, claim, turn)))
}

/// What a submission stored: the task `id` and its attempt 1, `attempt_id`, as planned by `p`.
fn stored(
    id: Uuid,
    attempt_id: Uuid,
    created_at: chrono::DateTime<chrono::Utc>,
    p: agentscope_store::first_attempt::Plan,
    claim: Option<(crate::dispatch::Claim, String)>,
    turn: Option<crate::dispatch::Turn>,
) -> Stored {
    Stored {
        id,
        created_at,
        pool_id: p.pool_id,
        claim,
        _turn: turn,
        attempt: t::Attempt {
            id: attempt_id,
            task_id: id,
            number: 1,
            status: AttemptStatus::Queued.as_str().to_string(),
            provider: p.provider,
            host_id: None,
            lease_token: None,
            agent_version_id: p.agent_version_id,
            created_at,
            not_before: created_at,
            claimed_at: None,
            started_at: None,
            finished_at: None,
            failure_class: None,
            failure_detail: None,
            exit_code: None,
            provider_session_id: None,
            events: 0,
            remedy: None,
        },
    }
}

/// Stores `sub` in a batch with other submissions (`crate::batch`) when it is one that is stored
/// queued by its agent's kept plan: no issue, no idempotency key, and no direct dispatch for it
/// (this gateway's dispatch for the pool is under way). `None`: store it on its own
/// ([`insert_task`]), as also when the kept plan turned out stale or PostgreSQL refused the
/// batch.
async fn batched(s: &AppState, sub: &Submission<'_>) -> Result<Option<Stored>, sqlx::Error> {
    let task = &sub.task;
    if sub.idempotency_key.is_some() || task.issue_id.is_some() {
        return Ok(None);
    }
    let Some(kept) = s.plans.get(task.workspace_id, task.agent_id) else {
        return Ok(None);
    };
    let mut p = kept.plan(task, None);
    // One that may be dispatched directly goes on its own (the turn is taken again there).
    if let (Some(d), Some(pool)) = (dispatching(s), p.pool_id)
        && d.pools.enter(pool).is_some()
    {
        return Ok(None);
    }
    let (id, attempt_id) = (Uuid::now_v7(), Uuid::now_v7());
    // The spec (which holds the input) goes to the batch; the answer needs only the columns.
    let spec = std::mem::take(&mut p.spec);
    let item = crate::batch::Item {
        workspace_id: task.workspace_id,
        agent_id: task.agent_id,
        kept,
        plan: p.clone(),
        spec,
        task_id: id,
        attempt_id,
        repository: task.repository.map(str::to_string),
        branch: task.branch.map(str::to_string),
        input: task.input.to_string(),
        timeout_secs: task.timeout_secs,
        request_hash: sub.request_hash.map(str::to_string),
    };
    Ok(
        match s.batches.submit(&s.submit_db, &s.metrics, item).await? {
            crate::batch::Outcome::Stored(created_at) => {
                Some(stored(id, attempt_id, created_at, p, None, None))
            }
            crate::batch::Outcome::Stale => {
                s.plans.forget(task.workspace_id, task.agent_id);
                None
            }
            crate::batch::Outcome::Alone => None,
        },
    )
}

/// Direct dispatch's settings, this gateway's pools under way and its NATS connection, if it is
/// on.
fn dispatching(s: &AppState) -> Option<crate::dispatch::Dispatching<'_>> {
    s.config
        .direct_dispatch
        .then_some(crate::dispatch::Dispatching {
            pools: &s.dispatching,
            config: &s.config,
            nats: &s.nats,
        })
}

/// A stored task's attempt 1: the work its statement claimed for an idle host is offered there;
/// otherwise (or if the offer is not taken) the pool's hosts hear of it. Done in a task of its
/// own, so that a client that goes away meanwhile does not leave an offer half made (the attempt
/// would wait, claimed, for its host's next claim).
async fn hand_out(s: &AppState, workspace_id: Uuid, stored: &mut Stored) -> Dispatched {
    let pool_id = stored.pool_id;
    let Some((claim, token)) = stored.claim.take() else {
        announce(s, workspace_id, pool_id).await;
        return Dispatched::Queued;
    };
    let s = s.clone();
    tokio::spawn(async move {
        let d = crate::dispatch::offer(&s, workspace_id, claim, token).await;
        if d == Dispatched::Queued {
            announce(&s, workspace_id, pool_id).await;
        } else {
            s.metrics.inc("agentscope_tasks_submitted_total", &[]);
        }
        d
    })
    .await
    .unwrap_or(Dispatched::Queued)
}

/// Wakes one host of the pool with a free slot for the attempt just stored (core NATS, as the
/// scheduler's nudges). If it is lost, hosts poll and the scheduler's sweep nudges pools with
/// ready work; the scheduler also counts these (`agentscope_bus::NEW_WORK`) in its view of
/// waiting work.
async fn announce(s: &AppState, workspace_id: Uuid, pool_id: Option<Uuid>) {
    let Some(pool_id) = pool_id else { return };
    let sent = s
        .nats
        .publish(
            subjects::pool_work(&workspace_id.to_string(), &pool_id.to_string()),
            bytes::Bytes::from_static(agentscope_bus::NEW_WORK),
        )
        .await;
    match sent {
        Ok(()) => s.metrics.inc("agentscope_tasks_submitted_total", &[]),
        Err(e) => {
            tracing::warn!(error = %e, %pool_id, "announce new work; hosts' polls and the scheduler's sweep will find it")
        }
    }
}

pub async fn create_task(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewTask>,
) -> ApiResult<(StatusCode, Json<t::Task>)> {
    check_source(&b.repository, &b.branch)?;
    if b.input.len() > 256 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`input` is limited to 256 KiB",
        ));
    }
    if b.timeout_secs.is_some_and(|t| t <= 0) {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`timeout_secs` must be positive",
        ));
    }
    let hash = b.request_hash();
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k)?;
        if let Some(id) = existing_task(&s, auth, k, &hash).await? {
            return Ok((StatusCode::OK, Json(task_json(&s, auth, id).await?)));
        }
    }
    // The task and its first attempt, in one statement (with other submissions' when they
    // queue up behind each other).
    let sub = Submission {
        task: TaskFields {
            workspace_id: auth.workspace_id,
            agent_id: b.agent_id,
            issue_id: b.issue_id,
            repository: b.repository.as_deref(),
            branch: b.branch.as_deref(),
            input: &b.input,
            timeout_secs: b.timeout_secs,
        },
        idempotency_key: b.idempotency_key.as_deref(),
        request_hash: Some(&hash),
    };
    let stored = match batched(&s, &sub).await {
        Ok(None) => {
            let mut conn = s.submit_db.acquire().await?;
            let stored = insert_task(&mut conn, &sub, dispatching(&s), &s.plans).await;
            if stored.is_ok() {
                conn.release();
            }
            stored
        }
        stored => stored,
    };
    let stored = match stored {
        Ok(Some(stored)) => stored,
        Ok(None) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_reference",
                "agent or issue not found in this workspace",
            ));
        }
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() && b.idempotency_key.is_some() => {
            // A concurrent request with the same key won the race.
            let key = b.idempotency_key.as_deref().unwrap_or_default();
            let id = existing_task(&s, auth, key, &hash)
                .await?
                .ok_or_else(|| ApiError::Db(sqlx::Error::RowNotFound))?;
            return Ok((StatusCode::OK, Json(task_json(&s, auth, id).await?)));
        }
        Err(e) => return Err(e.into()),
    };
    let mut status = AttemptStatus::Queued;
    let mut stored = stored;
    let dispatched = hand_out(&s, auth.workspace_id, &mut stored).await;
    let mut attempt = stored.attempt;
    if let Dispatched::Claimed {
        host_id,
        lease_token,
    } = dispatched
    {
        status = AttemptStatus::Claimed;
        attempt.status = status.as_str().to_string();
        attempt.host_id = Some(host_id);
        attempt.lease_token = Some(lease_token);
    }
    Ok((
        StatusCode::CREATED,
        Json(t::Task {
            id: stored.id,
            status: task_status(Some(status)).to_string(),
            issue_id: b.issue_id,
            agent_id: b.agent_id,
            repository: b.repository,
            branch: b.branch,
            input: b.input,
            timeout_secs: b.timeout_secs,
            idempotency_key: b.idempotency_key,
            cancel_requested_at: None,
            created_at: stored.created_at,
            attempts: vec![attempt],
        }),
    ))
}

/// The task an earlier submission with `key` created, if the request was the same; another
/// request under the same key is `409 idempotency_conflict`.
async fn existing_task(s: &AppState, auth: Auth, key: &str, hash: &str) -> ApiResult<Option<Uuid>> {
    let existing = sqlx::query!(
        "SELECT id, request_hash FROM tasks WHERE workspace_id = $1 AND idempotency_key = $2",
        auth.workspace_id,
        key,
    )
    .fetch_optional(&s.db)
    .await?;
    match existing {
        Some(r) => {
            crate::api::same_request(key, r.request_hash.as_deref(), hash)?;
            Ok(Some(r.id))
        }
        None => Ok(None),
    }
}

/// `sqlx::query_as!` into `t::Attempt`: the attempts' shared SELECT, then `$tail` (a literal).
/// `remedy` is filled in by [`with_remedy`].
macro_rules! select_attempts {
    ($tail:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            t::Attempt,
            r#"SELECT a.id, a.task_id, a.number, a.status, a.provider, a.host_id, a.lease_token,
            a.agent_version_id, a.created_at, a.not_before, a.claimed_at, a.started_at, a.finished_at,
            a.failure_class, a.failure_detail, a.exit_code, a.provider_session_id, a.last_seq AS events,
            NULL::text AS "remedy?" FROM attempts a "# + $tail,
            $($arg),+
        )
    };
}

fn with_remedy(mut a: t::Attempt) -> t::Attempt {
    a.remedy = a.failure_class.as_deref().map(|c| {
        agentscope_domain::FailureClass::parse(c)
            .remedy()
            .to_string()
    });
    a
}

pub(crate) async fn task_json(s: &AppState, auth: Auth, id: Uuid) -> ApiResult<t::Task> {
    let row = sqlx::query!(
        "SELECT id, issue_id, agent_id, repository, branch, input, timeout_secs, idempotency_key,
                cancel_requested_at, created_at FROM tasks WHERE workspace_id = $1 AND id = $2",
        auth.workspace_id,
        id,
    )
    .fetch_optional(&s.db)
    .await?
    .ok_or_else(|| ApiError::not_found("task"))?;
    let attempts = select_attempts!("WHERE a.task_id = $1 ORDER BY a.number", id)
        .fetch_all(&s.db)
        .await?;
    let attempts: Vec<t::Attempt> = attempts.into_iter().map(with_remedy).collect();
    let newest = attempts
        .last()
        .and_then(|a| AttemptStatus::parse(&a.status));
    Ok(t::Task {
        id,
        status: task_status(newest).to_string(),
        issue_id: row.issue_id,
        agent_id: row.agent_id,
        repository: row.repository,
        branch: row.branch,
        input: row.input,
        timeout_secs: row.timeout_secs,
        idempotency_key: row.idempotency_key,
        cancel_requested_at: row.cancel_requested_at,
        created_at: row.created_at,
        attempts,
    })
}

pub async fn get_task(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Task>> {
    Ok(Json(task_json(&s, auth, id).await?))
}

pub async fn list_tasks(
    State(s): State<AppState>,
    auth: Auth,
    q: Result<Query<TaskFilter>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<t::TaskList>> {
    let Query(q) = q?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    // `status` is derived below from the newest attempt's.
    let rows = sqlx::query_as!(
        t::TaskSummary,
        r#"SELECT t.id, t.issue_id, t.agent_id, t.created_at, a.number AS "newest_attempt?",
            a.status AS "attempt_status?", a.failure_class AS "failure_class?", ''::text AS "status!"
         FROM tasks t LEFT JOIN LATERAL (SELECT number, status, failure_class FROM attempts
             WHERE task_id = t.id ORDER BY number DESC LIMIT 1) a ON true
         WHERE t.workspace_id = $1 ORDER BY t.created_at DESC LIMIT $2"#,
        auth.workspace_id,
        limit,
    )
    .fetch_all(&s.db)
    .await?;
    let mut items = Vec::new();
    for mut v in rows {
        let st = task_status(v.attempt_status.as_deref().and_then(AttemptStatus::parse));
        if q.status.as_deref().is_none_or(|f| f == st) {
            v.status = st.to_string();
            items.push(v);
        }
    }
    Ok(Json(t::TaskList { items }))
}

/// Records the request durably, then tells the scheduler. Idempotent.
pub async fn cancel_task(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<t::Task>)> {
    // The body is optional here.
    let body: CancelTask = crate::extract::optional_body(&body, "cancel request")?;
    let reason = body
        .reason
        .unwrap_or_else(|| "cancelled through the API".into());
    if reason.len() > 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`reason` is limited to 1024 bytes",
        ));
    }
    let updated = sqlx::query_scalar!(
        "UPDATE tasks SET cancel_requested_at = COALESCE(cancel_requested_at, now())
         WHERE id = $1 AND workspace_id = $2 RETURNING id",
        id,
        auth.workspace_id,
    )
    .fetch_optional(&s.db)
    .await?;
    if updated.is_none() {
        return Err(ApiError::not_found("task"));
    }
    let m = CancelRequest {
        task_id: id.to_string(),
        workspace_id: auth.workspace_id.to_string(),
        reason,
    };
    s.js.publish_with_headers(
        subjects::TASK_CANCEL,
        agentscope_bus::headers(&format!("cancel:{id}")),
        m.encode_to_vec().into(),
    )
    .await
    .map_err(ApiError::bus)?
    .await
    .map_err(ApiError::bus)?;
    Ok((StatusCode::ACCEPTED, Json(task_json(&s, auth, id).await?)))
}

pub async fn get_attempt(
    State(s): State<AppState>,
    auth: Auth,
    Id(id): Id,
) -> ApiResult<Json<t::Attempt>> {
    let row = select_attempts!(
        "WHERE a.workspace_id = $1 AND a.id = $2",
        auth.workspace_id,
        id
    )
    .fetch_optional(&s.db)
    .await?;
    let a = row.ok_or_else(|| ApiError::not_found("attempt"))?;
    Ok(Json(with_remedy(a)))
}
