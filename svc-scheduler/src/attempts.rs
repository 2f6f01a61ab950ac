//! Attempt creation, completion and retry. Every function here runs inside the caller's
//! transaction, so a state change and its consequences (a retry) commit together.

use crate::{Ctx, Error};
use agentscope_domain::{AttemptStatus, FailureClass, RetryPolicy};
use sqlx::{Postgres, Transaction};
use std::collections::HashMap;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

type Tx<'a> = Transaction<'a, Postgres>;

/// Creates Attempt 1 of a task if it has none. Idempotent: returns the pool to nudge, if any.
///
/// The gateway creates attempt 1 with the task itself; this is for a task found without one
/// (the sweep, a submission message from a gateway that did not). Two reads (the task, then what
/// it resolves to now) and one `INSERT ... ON CONFLICT DO NOTHING` (its own transaction) that a
/// redelivered or concurrent submission cannot duplicate. A cancellation requested between them
/// is caught by the cancel message itself (it finds the attempt) or by the sweeper (queued
/// attempts of tasks whose cancellation was requested).
pub(crate) async fn ensure_first_attempt(ctx: &Ctx, task_id: Uuid) -> Result<Option<Uuid>, Error> {
    use agentscope_store::first_attempt::{TaskFields, plan};
    let task = sqlx::query!(
        r#"SELECT workspace_id, agent_id, issue_id, repository, branch, input, timeout_secs,
                  cancel_requested_at IS NOT NULL AS "cancel_requested!"
           FROM tasks WHERE id = $1"#,
        task_id,
    )
    .fetch_optional(&ctx.db)
    .await?;
    let Some(task) = task else {
        return Err(Error::Rejected(format!("unknown task {task_id}")));
    };
    let fields = TaskFields {
        workspace_id: task.workspace_id,
        agent_id: task.agent_id,
        issue_id: task.issue_id,
        repository: task.repository.as_deref(),
        branch: task.branch.as_deref(),
        input: &task.input,
        timeout_secs: task.timeout_secs,
    };
    let Some(r) = plan(&ctx.db, &fields).await? else {
        // The row's references are checked by its foreign keys and by the gateway's insert:
        // an agent or issue of another workspace is not a task of this one.
        return Err(Error::Rejected(format!(
            "task {task_id} names an agent or issue outside its workspace"
        )));
    };
    let (status, class): (AttemptStatus, Option<FailureClass>) = if task.cancel_requested {
        (AttemptStatus::Cancelled, Some(FailureClass::Cancelled))
    } else {
        (AttemptStatus::Queued, None)
    };
    let inserted = sqlx::query!(
        r#"
        INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id, agent_version_id,
            binding_id, pool_id, provider, required_capabilities, spec, failure_class,
            finished_at)
        VALUES ($1, $2, $3, 1, $4, $5, $6, $7, $8, $9, $10, $11, $12,
            CASE WHEN $4 = 'cancelled' THEN now() END)
        ON CONFLICT (task_id, number) DO NOTHING
        "#,
        Uuid::now_v7(),
        task_id,
        task.workspace_id,
        status.as_str(),
        task.agent_id,
        r.agent_version_id,
        r.binding_id,
        r.pool_id,
        r.provider,
        &r.required_capabilities,
        &r.spec,
        class.map(|c| c.as_str()),
    )
    .execute(&ctx.db)
    .await?;
    if inserted.rows_affected() == 0 {
        // A redelivery: the attempt exists (and its nudge went out then).
        return Ok(None);
    }
    ctx.metrics.inc("agentscope_attempts_created_total", &[]);
    tracing::info!(%task_id, attempt = 1, "attempt created");
    Ok(r.pool_id.filter(|_| status == AttemptStatus::Queued))
}

/// Re-reads the binding for queued attempts that had none; returns pools to nudge.
pub(crate) async fn rebind_unbound(ctx: &Ctx) -> Result<Vec<Uuid>, Error> {
    let pools = sqlx::query_scalar!(
        r#"
        UPDATE attempts a SET binding_id = b.id, pool_id = b.pool_id,
            required_capabilities = b.required_capabilities
        FROM bindings b
        WHERE a.status = 'queued' AND a.binding_id IS NULL AND b.agent_id = a.agent_id
        RETURNING b.pool_id
        "#,
    )
    .fetch_all(&ctx.sweep_db)
    .await?;
    Ok(pools)
}

pub(crate) struct Active {
    pub id: Uuid,
    pub task_id: Uuid,
    pub number: i32,
    pub status: AttemptStatus,
    pub lease_token: Option<i64>,
    pub host_id: Option<Uuid>,
    pub pool_id: Option<Uuid>,
    pub last_seq: i64,
}

/// Locks an attempt row for the rest of the transaction.
pub(crate) async fn lock(tx: &mut Tx<'_>, attempt_id: Uuid) -> Result<Option<Active>, Error> {
    Ok(lock_many(tx, &[attempt_id]).await?.pop())
}

/// An attempt's row as [`lock_many`] reads it.
struct Row {
    id: Uuid,
    task_id: Uuid,
    number: i32,
    status: String,
    lease_token: Option<i64>,
    host_id: Option<Uuid>,
    pool_id: Option<Uuid>,
    last_seq: i64,
}

/// Locks the rows of `ids` in id order (one statement; two transactions that lock overlapping
/// sets this way cannot deadlock on them). Unknown ids are left out.
pub(crate) async fn lock_many(tx: &mut Tx<'_>, ids: &[Uuid]) -> Result<Vec<Active>, Error> {
    // One row (every lock but the recorder's batches, and most of those) by `id = $1`:
    // Postgres keeps custom plans for `id = ANY($1)` and so plans it again on every call, which
    // costs three times its execution.
    let rows = match ids {
        [id] => {
            sqlx::query_as!(
                Row,
                "SELECT id, task_id, number, status, lease_token, host_id, pool_id, last_seq
                 FROM attempts WHERE id = $1 FOR UPDATE",
                id,
            )
            .fetch_all(&mut **tx)
            .await?
        }
        _ => {
            sqlx::query_as!(
                Row,
                "SELECT id, task_id, number, status, lease_token, host_id, pool_id, last_seq
                 FROM attempts WHERE id = ANY($1) ORDER BY id FOR UPDATE",
                ids,
            )
            .fetch_all(&mut **tx)
            .await?
        }
    };
    rows.into_iter()
        .map(|row| {
            Ok(Active {
                id: row.id,
                task_id: row.task_id,
                number: row.number,
                status: AttemptStatus::parse(&row.status)
                    .ok_or_else(|| Error::Rejected(format!("unknown status {}", row.status)))?,
                lease_token: row.lease_token,
                host_id: row.host_id,
                pool_id: row.pool_id,
                last_seq: row.last_seq,
            })
        })
        .collect()
}

/// How one attempt ends: see [`finish_many`].
pub(crate) struct End<'a> {
    pub a: &'a Active,
    pub status: AttemptStatus,
    pub class: Option<FailureClass>,
    pub detail: &'a str,
    pub exit_code: Option<i32>,
    /// Its `running` event's time when that comes in the same batch as its end (the row is
    /// updated once, not twice).
    pub started_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Its last recorded event's seq, when the batch that ends it records events of it (set
    /// by the same update).
    pub last_seq: Option<i64>,
}

/// Moves an attempt to a terminal status and, when the class is retryable and the policy
/// allows, creates the next Attempt in the same transaction. Returns the retry's pool to nudge.
pub(crate) async fn finish(
    tx: &mut Tx<'_>,
    a: &Active,
    status: AttemptStatus,
    class: Option<FailureClass>,
    detail: &str,
    exit_code: Option<i32>,
) -> Result<Option<Uuid>, Error> {
    let end = End {
        a,
        status,
        class,
        detail,
        exit_code,
        started_at: None,
        last_seq: None,
    };
    Ok(finish_many(tx, &[end]).await?.pop().flatten())
}

/// [`finish`] for several attempts (distinct, locked by the caller): one statement ends them all
/// and denies their pending approvals; only a retry or fallback takes statements of its own.
/// Their counters take no lock (an end appends deltas: migration 0013). Returns, per attempt in
/// order, the pool of its retry to nudge.
pub(crate) async fn finish_many(
    tx: &mut Tx<'_>,
    ends: &[End<'_>],
) -> Result<Vec<Option<Uuid>>, Error> {
    debug_assert!(ends.iter().all(|e| e.status.is_terminal()));
    let ids: Vec<Uuid> = ends.iter().map(|e| e.a.id).collect();
    let statuses: Vec<&str> = ends.iter().map(|e| e.status.as_str()).collect();
    let classes: Vec<Option<&str>> = ends.iter().map(|e| e.class.map(|c| c.as_str())).collect();
    let details: Vec<&str> = ends.iter().map(|e| e.detail).collect();
    let exits: Vec<Option<i32>> = ends.iter().map(|e| e.exit_code).collect();
    let started: Vec<Option<chrono::DateTime<chrono::Utc>>> =
        ends.iter().map(|e| e.started_at).collect();
    let seqs: Vec<Option<i64>> = ends.iter().map(|e| e.last_seq).collect();
    // A task whose cancellation was requested ends cancelled, whatever else happened, except
    // a success. Nobody is waiting for an ended attempt's open tool requests any more.
    let rows = sqlx::query!(
        r#"
        WITH f AS (
            SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
                                 $6::timestamptz[], $7::int8[])
                AS f(id, status, class, detail, exit_code, started_at, last_seq)
        ), u AS (
            UPDATE attempts a SET
                status = CASE WHEN t.cancel_requested_at IS NOT NULL AND f.status <> 'succeeded'
                              THEN 'cancelled' ELSE f.status END,
                failure_class = CASE WHEN t.cancel_requested_at IS NOT NULL AND f.status <> 'succeeded'
                                     THEN 'cancelled' ELSE f.class END,
                finished_at = clock_timestamp(),
                failure_detail = NULLIF(f.detail, ''),
                exit_code = f.exit_code,
                started_at = COALESCE(f.started_at, a.started_at),
                last_seq = COALESCE(f.last_seq, a.last_seq)
            FROM f, tasks t
            WHERE a.id = f.id AND t.id = a.task_id
            RETURNING a.id, a.status, a.failure_class, t.cancel_requested_at IS NOT NULL AS cancel_requested
        ), denied AS (
            UPDATE approvals ap SET status = 'denied', decided_at = now(), decided_by = 'platform',
                reason = 'the attempt ended: ' || u.status
            FROM u WHERE ap.attempt_id = u.id AND ap.status = 'pending'
        )
        SELECT id AS "id!", status AS "status!", failure_class,
               cancel_requested AS "cancel_requested!" FROM u
        "#,
        &ids,
        &statuses as &[&str],
        &classes as &[Option<&str>],
        &details as &[&str],
        &exits as &[Option<i32>],
        &started as &[Option<chrono::DateTime<chrono::Utc>>],
        &seqs as &[Option<i64>],
    )
    .fetch_all(&mut **tx)
    .await?;
    let mut pools = Vec::with_capacity(ends.len());
    for e in ends {
        let Some(row) = rows.iter().find(|r| r.id == e.a.id) else {
            // Locked by the caller, so it exists; nothing to retry if it somehow does not.
            pools.push(None);
            continue;
        };
        let status = AttemptStatus::parse(&row.status).unwrap_or(e.status);
        let class = row.failure_class.as_deref().map(FailureClass::parse);
        let a = e.a;
        tracing::info!(attempt_id = %a.id, task_id = %a.task_id, %status, class = class.map(|c| c.as_str()), "attempt finished");
        pools.push(after_end(tx, a, status, class, row.cancel_requested).await?);
    }
    Ok(pools)
}

/// What follows an attempt's end in the same transaction: a fallback provider or a retry.
async fn after_end(
    tx: &mut Tx<'_>,
    a: &Active,
    status: AttemptStatus,
    class: Option<FailureClass>,
    cancel_requested: bool,
) -> Result<Option<Uuid>, Error> {
    // The provider itself is the problem: try the binding's next fallback provider, fresh.
    let provider_trouble = matches!(
        class,
        Some(
            FailureClass::ProviderLogin
                | FailureClass::ToolDependency
                | FailureClass::BadParameters
        )
    );
    if status == AttemptStatus::Failed && provider_trouble && !cancel_requested {
        return fallback(tx, a).await;
    }
    let retry = matches!(status, AttemptStatus::Failed | AttemptStatus::Lost)
        && class.is_some_and(|c| c.retryable())
        && !cancel_requested;
    if !retry {
        return Ok(None);
    }
    let policy = sqlx::query!(
        "SELECT b.max_attempts, b.retry_backoff_ms FROM attempts a JOIN bindings b ON b.id = a.binding_id WHERE a.id = $1",
        a.id,
    )
    .fetch_optional(&mut **tx)
    .await?;
    let policy = policy
        .map(|p| RetryPolicy {
            max_attempts: p.max_attempts.max(1) as u32,
            backoff_base_ms: p.retry_backoff_ms.max(0) as u64,
            ..RetryPolicy::default()
        })
        .unwrap_or_default();
    let next = a.number as u32 + 1;
    let Some(delay_ms) = policy.delay_before(next) else {
        tracing::info!(task_id = %a.task_id, "retries exhausted");
        return Ok(None);
    };
    sqlx::query!(
        r#"
        INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id, agent_version_id,
            binding_id, pool_id, provider, required_capabilities, spec, not_before)
        SELECT $2, task_id, workspace_id, $3, 'queued', agent_id, agent_version_id, binding_id,
            pool_id, provider, required_capabilities,
            -- The retry may continue this attempt's provider session where it still exists.
            spec || jsonb_build_object('resume_session_id', COALESCE(provider_session_id, ''),
                                       'resume_from_attempt_id', id::text),
            now() + make_interval(secs => $4::double precision / 1000.0)
        FROM attempts WHERE id = $1
        ON CONFLICT (task_id, number) DO NOTHING
        "#,
        a.id,
        Uuid::now_v7(),
        next as i32,
        delay_ms as f64,
    )
    .execute(&mut **tx)
    .await?;
    tracing::info!(task_id = %a.task_id, attempt = next, delay_ms, "retry scheduled as a new attempt");
    if delay_ms == 0
        && let Some(pool) = a.pool_id
    {
        add_waiting(pool, 1);
    }
    Ok(a.pool_id)
}

/// Cross-backend fresh fallback: a new attempt on the binding's next untried fallback
/// provider, whose input is a context pack rebuilt from the platform's records.
async fn fallback(tx: &mut Tx<'_>, a: &Active) -> Result<Option<Uuid>, Error> {
    let row = sqlx::query!(
        "SELECT b.fallback_providers, b.max_attempts, a.spec FROM attempts a JOIN bindings b ON b.id = a.binding_id WHERE a.id = $1",
        a.id,
    )
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let (fallbacks, max_attempts, spec) = (row.fallback_providers, row.max_attempts, row.spec);
    let tried: Vec<String> = sqlx::query_scalar!(
        r#"SELECT DISTINCT provider AS "provider!" FROM attempts WHERE task_id = $1 AND provider IS NOT NULL"#,
        a.task_id,
    )
    .fetch_all(&mut **tx)
    .await?;
    let Some(next) = fallbacks.into_iter().find(|p| !tried.contains(p)) else {
        return Ok(None);
    };
    if a.number >= max_attempts {
        tracing::info!(task_id = %a.task_id, "no attempt left for a fallback");
        return Ok(None);
    }
    let pack = context_pack(tx, a.task_id).await?;
    let mut spec = spec;
    let original = spec["input"].as_str().unwrap_or_default().to_string();
    spec["provider"] = serde_json::json!(next);
    // The profile's parameters belong to the failed provider; the fallback runs on defaults.
    spec["params"] = serde_json::json!({});
    spec["input"] = serde_json::json!(format!("{pack}\n## Original input\n\n{original}\n"));
    spec["context_pack"] = serde_json::json!(true);
    let number = a.number + 1;
    sqlx::query!(
        r#"
        INSERT INTO attempts (id, task_id, workspace_id, number, status, agent_id, agent_version_id,
            binding_id, pool_id, provider, required_capabilities, spec)
        SELECT $2, task_id, workspace_id, $3, 'queued', agent_id, agent_version_id, binding_id,
            pool_id, $4, required_capabilities, $5
        FROM attempts WHERE id = $1
        ON CONFLICT (task_id, number) DO NOTHING
        "#,
        a.id,
        Uuid::now_v7(),
        number,
        &next,
        &spec,
    )
    .execute(&mut **tx)
    .await?;
    tracing::info!(task_id = %a.task_id, attempt = number, provider = %next, "fresh fallback to another provider, with a context pack");
    if let Some(pool) = a.pool_id {
        add_waiting(pool, 1);
    }
    Ok(a.pool_id)
}

/// The task's context, rebuilt from persisted records only: the Issue, its comments, its
/// Artifacts and the outcomes of the previous attempts.
async fn context_pack(tx: &mut Tx<'_>, task_id: Uuid) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::from(
        "# Context pack\n\nRebuilt from the platform's records: an earlier attempt of this task ran on another provider.\n",
    );
    let issue = sqlx::query!(
        r#"SELECT t.issue_id, i.title AS "title?", i.body AS "body?" FROM tasks t LEFT JOIN issues i ON i.id = t.issue_id WHERE t.id = $1"#,
        task_id,
    )
    .fetch_optional(&mut **tx)
    .await?
    .map(|i| (i.issue_id, i.title, i.body));
    let issue_id = issue.as_ref().and_then(|i| i.0);
    if let Some((Some(_), title, body)) = &issue {
        let _ = write!(
            out,
            "\n## Issue: {}\n\n{}\n",
            title.clone().unwrap_or_default(),
            body.clone().unwrap_or_default()
        );
        let comments = sqlx::query!(
            "SELECT author, body, created_at FROM comments WHERE issue_id = $1 ORDER BY created_at, id",
            issue_id,
        )
        .fetch_all(&mut **tx)
        .await?;
        out.push_str("\n## Comments\n\n");
        if comments.is_empty() {
            out.push_str("(none)\n");
        }
        for c in comments {
            let (author, body) = (c.author, c.body);
            let _ = writeln!(out, "- {author} ({}): {body}", c.created_at.to_rfc3339());
        }
    }
    let artifacts = sqlx::query!(
        r#"SELECT name, content_type, size_bytes,
                  CASE WHEN size_bytes <= 16384 THEN content ELSE '\x'::bytea END AS "content!"
         FROM artifacts WHERE task_id = $1 OR ($2::uuid IS NOT NULL AND issue_id = $2) ORDER BY created_at, id"#,
        task_id,
        issue_id,
    )
    .fetch_all(&mut **tx)
    .await?;
    out.push_str("\n## Artifacts\n\n");
    if artifacts.is_empty() {
        out.push_str("(none)\n");
    }
    for artifact in artifacts {
        let (name, ct, size, content) = (
            artifact.name,
            artifact.content_type,
            artifact.size_bytes,
            artifact.content,
        );
        let _ = writeln!(out, "### {name} ({ct}, {size} bytes)\n");
        let textual = ct.starts_with("text/") || ct == "application/json";
        match (textual && !content.is_empty(), String::from_utf8(content)) {
            (true, Ok(text)) => {
                let _ = writeln!(out, "```\n{text}\n```\n");
            }
            _ => out.push_str(
                "(not included: binary or larger than 16 KiB; download it through the API)\n\n",
            ),
        }
    }
    let previous = sqlx::query!(
        "SELECT number, provider, status, failure_class, failure_detail FROM attempts WHERE task_id = $1 ORDER BY number",
        task_id,
    )
    .fetch_all(&mut **tx)
    .await?;
    out.push_str("\n## Previous attempts\n\n");
    for p in previous {
        let _ = writeln!(
            out,
            "- attempt {} on {}: {}{}{}",
            p.number,
            p.provider.unwrap_or_default(),
            p.status,
            p.failure_class
                .map(|c| format!(" ({c})"))
                .unwrap_or_default(),
            p.failure_detail
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        );
    }
    Ok(out)
}

/// This process's view of how many attempts wait in each pool: set by every claim it serves
/// (the claim counts them), raised when it creates one. A pool it knows nothing about counts as
/// having work. Other scheduler replicas keep their own view; each one's sweeper re-reads the
/// database every `sweep_interval_ms`, so a stale view delays a nudge by one sweep at most.
fn waiting_view() -> &'static std::sync::Mutex<HashMap<Uuid, u32>> {
    static WAITING: std::sync::OnceLock<std::sync::Mutex<HashMap<Uuid, u32>>> =
        std::sync::OnceLock::new();
    WAITING.get_or_init(Default::default)
}

pub(crate) fn set_waiting(pool_id: Uuid, waiting: u32) {
    waiting_view()
        .lock()
        .expect("waiting view")
        .insert(pool_id, waiting);
}

fn add_waiting(pool_id: Uuid, n: u32) {
    let mut view = waiting_view().lock().expect("waiting view");
    let w = view.entry(pool_id).or_default();
    *w = w.saturating_add(n);
}

/// Counts the attempts the gateway creates (its nudges carry [`agentscope_bus::NEW_WORK`]) in
/// this process's view of waiting work, so that an attempt's end still nudges the pool while
/// they wait. A nudge missed here (a reconnect) costs at most a sweep: the sweeper re-reads
/// the queue every `sweep_interval_ms`.
pub(crate) async fn watch_new_work(ctx: Ctx, cancel: CancellationToken) -> anyhow::Result<()> {
    use futures::StreamExt;
    let mut sub = ctx
        .nats
        .subscribe(agentscope_bus::subjects::POOL_WORK_ALL)
        .await
        .map_err(Error::bus)?;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            m = sub.next() => m,
        };
        let Some(msg) = msg else {
            anyhow::bail!("the pools' work subscription ended");
        };
        if msg.payload.as_ref() != agentscope_bus::NEW_WORK {
            continue;
        }
        let pool =
            agentscope_bus::subjects::token(&msg.subject, 3).and_then(|p| Uuid::parse_str(p).ok());
        if let Some(pool) = pool {
            add_waiting(pool, 1);
        }
    }
}

/// New work is ready in a pool (an attempt was created, or the sweeper found one ready): wake
/// one of its hosts.
pub(crate) async fn nudge_ready(ctx: &Ctx, pool_id: Uuid) {
    add_waiting(pool_id, 1);
    publish_nudge(ctx, pool_id).await;
}

/// Capacity may have freed in a pool (an attempt ended): wake one of its hosts, if work waits
/// there as far as this process knows.
pub(crate) async fn nudge(ctx: &Ctx, pool_id: Uuid) {
    let waiting = waiting_view()
        .lock()
        .expect("waiting view")
        .get(&pool_id)
        .copied();
    if waiting == Some(0) {
        return;
    }
    publish_nudge(ctx, pool_id).await;
}

/// Publishes a pool's nudge. Hosts with a free slot listen in one queue group, so one nudge
/// wakes one host that can take work (see svc-host's claim loop). The subject names the pool's
/// workspace, so that NATS lets only that workspace's hosts hear it.
async fn publish_nudge(ctx: &Ctx, pool_id: Uuid) {
    static WORKSPACES: std::sync::OnceLock<std::sync::Mutex<HashMap<Uuid, Uuid>>> =
        std::sync::OnceLock::new();
    let cache = WORKSPACES.get_or_init(Default::default);
    let known = cache.lock().expect("pool cache").get(&pool_id).copied();
    let workspace_id = match known {
        Some(w) => w,
        None => {
            // A pool never changes workspace: one look-up per pool and process.
            let row = sqlx::query_scalar!("SELECT workspace_id FROM pools WHERE id = $1", pool_id)
                .fetch_optional(&ctx.db)
                .await;
            let Ok(Some(w)) = row else { return };
            cache.lock().expect("pool cache").insert(pool_id, w);
            w
        }
    };
    ctx.metrics.inc("agentscope_nudges_total", &[]);
    let _ = ctx
        .nats
        .publish(
            agentscope_bus::subjects::pool_work(&workspace_id.to_string(), &pool_id.to_string()),
            bytes::Bytes::new(),
        )
        .await;
}
