//! One run of the provider, in stages: the task directory ([`task_dir`], and [`reuse_session`]
//! when a retry continues the previous attempt's provider session), the launch ([`launch`]), the
//! output and the approvals while it runs ([`pump`]), and the outcome ([`outcome`]).

use super::approvals::{answer, denied_outcome, request_approval, write_lines};
use super::limits::{ModelWatch, run_limit};
use super::scope::{scope_ids, scoped_id};
use super::sink::EventSink;
use super::task_dir::{existing_task_dir, give_plain, prepare};
use super::{Assignment, Outcome, Spec, Stops, failed};
use crate::Ctx;
use crate::isolation;
use crate::process;
use crate::provider::{self, Launch, RunAs, TaskDir};
use agentscope_domain::{AttemptStatus, FailureClass};
use agentscope_schemas::v1::{ApprovalDecision, execution_event::Body};
use std::time::Duration;
use tokio::io::BufReader;

/// A provider process started through its sentinel (the leader of its own process group), and
/// the host's ends of its standard streams.
struct Started {
    child: agentscope_tools::spawn::Child,
    stdin: Option<tokio::net::unix::pipe::Sender>,
    stdout: tokio::net::unix::pipe::Receiver,
    stderr: tokio::net::unix::pipe::Receiver,
    pgid: i32,
}

/// What a run saw, for its outcome.
struct Pumped {
    status: std::io::Result<std::process::ExitStatus>,
    /// Why the host stopped the provider before it ended by itself.
    stop: Option<Outcome>,
    /// The provider rejected the session resume.
    rejected: bool,
    /// The last `Result` seen: Some(None) a success, Some(Some(text)) a failure.
    result_error: Option<Option<String>>,
    /// The last denied tool request, until a later one is allowed: a turn that ends after it
    /// ended because of it (`tool_denied`, or `approval_timeout` when nobody decided).
    denial: Option<(FailureClass, String)>,
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn execute(
    ctx: &Ctx,
    a: &Assignment,
    sink: &mut EventSink,
    stops: &Stops,
    decisions: &mut tokio::sync::mpsc::Receiver<ApprovalDecision>,
    resume: Option<&str>,
    fresh_only: bool,
    ready: Option<TaskDir>,
    who: Option<RunAs>,
    gone: &mut bool,
) -> Outcome {
    // Nothing of this launch runs until its sentinel does.
    *gone = true;
    let spec = &a.spec;
    let Some(adapter) = ctx.adapter(&spec.provider) else {
        return failed(
            FailureClass::ProviderLogin,
            format!("provider `{}` is not available on this host", spec.provider),
        );
    };
    // Given to the uid already when prepared ahead.
    let given = ready.is_some();
    let dir = match task_dir(ctx, a, sink, stops, resume, ready).await {
        Ok(dir) => dir,
        Err(outcome) => return outcome,
    };
    // A retry continues the previous attempt's provider session when it exists on this host;
    // its HOME, where the session lives, is carried over.
    let reuse = if resume.is_none() && !fresh_only && !spec.resume_session_id.is_empty() {
        reuse_session(ctx, adapter, spec, &dir, sink).await
    } else {
        None
    };
    let resumed_session = resume.map(str::to_string).or(reuse);
    // The journal's entry is written before the provider starts.
    sink.saved().await;
    let (launch, started) = match launch(
        ctx,
        a,
        adapter,
        spec,
        &dir,
        resumed_session.as_deref(),
        who,
        given,
    )
    .await
    {
        Ok(l) => l,
        Err(outcome) => return outcome,
    };
    *gone = false;
    let pgid = started.pgid;
    // Every process of the provider's tree carries this, even one that left the process group.
    let marker = format!("AGENTSCOPE_ATTEMPT_ID={}", a.attempt_id);
    // A resumed or restarted provider session may number its items from the start again (Codex's
    // `item_0`): its call and approval ids get the launch's first seq as a prefix, so they stay
    // unique within the attempt. The first launch keeps the provider's own ids.
    let scope = (resume.is_some() || fresh_only).then(|| format!("g{}", sink.entry.last_seq + 1));
    let mut pumped = pump(
        ctx,
        a,
        sink,
        stops,
        decisions,
        adapter,
        spec,
        &launch,
        started,
        &marker,
        resumed_session.is_some(),
        scope.as_deref(),
    )
    .await;
    if let Some(outcome) = pumped.stop.take() {
        return outcome;
    }
    // The sentinel exits by itself only once nothing of the provider's tree is left (no scan
    // needed); one that ended by a signal may have been killed before it could end the rest.
    *gone = pumped.status.as_ref().is_ok_and(|s| s.code().is_some());
    if !*gone {
        process::stop_tree(pgid, None, &marker).await;
    }
    let turn_failed = launch.result_decides && !matches!(pumped.result_error, Some(None));
    if pumped.rejected
        && !fresh_only
        && (turn_failed || !pumped.status.as_ref().is_ok_and(|s| s.success()))
    {
        sink.diag("warn", "resume_rejected", "the provider rejected the session resume; starting a fresh session in this attempt, once").await;
        return Box::pin(execute(
            ctx, a, sink, stops, decisions, None, true, None, who, gone,
        ))
        .await;
    }
    outcome(pumped, turn_failed)
}

/// The task directory: the one an earlier run of this host prepared (`resume`), the one
/// prepared ahead of the offer (`ready`), or a fresh one. Err: the attempt ends here (cancelled,
/// the host shutting down, or no directory).
async fn task_dir(
    ctx: &Ctx,
    a: &Assignment,
    sink: &mut EventSink,
    stops: &Stops,
    resume: Option<&str>,
    ready: Option<TaskDir>,
) -> Result<TaskDir, Outcome> {
    let dir = if let Some(dir) = ready {
        sink.diag("info", "preparing", "preparing task directory")
            .await;
        dir
    } else if let Some(session) = resume {
        sink.diag(
            "info",
            "resuming",
            format!(
                "the host restarted; resuming provider session {session} in the same task directory"
            ),
        )
        .await;
        existing_task_dir(ctx, a)
    } else {
        sink.diag("info", "preparing", "preparing task directory")
            .await;
        match prepare(ctx, a, sink, &stops.cancel).await {
            Ok(d) => d,
            Err(_) if stops.cancel.is_cancelled() => {
                return Err((
                    AttemptStatus::Cancelled,
                    Some(FailureClass::Cancelled),
                    "cancelled while preparing the task directory".into(),
                    None,
                ));
            }
            Err(detail) => return Err(failed(FailureClass::TaskDir, detail)),
        }
    };
    if stops.cancel.is_cancelled() {
        return Err((
            AttemptStatus::Cancelled,
            Some(FailureClass::Cancelled),
            "cancelled before start".into(),
            None,
        ));
    }
    if stops.shutdown.is_cancelled() {
        return Err(failed(
            FailureClass::HostRestart,
            "the host shut down before the provider started",
        ));
    }
    Ok(dir)
}

/// Copies the previous attempt's provider state into `dir` when its session can continue here.
/// Returns the session to continue, or None (a fresh session).
async fn reuse_session(
    ctx: &Ctx,
    adapter: &dyn provider::Adapter,
    spec: &Spec,
    dir: &TaskDir,
    sink: &mut EventSink,
) -> Option<String> {
    let prev_root = ctx.tasks_dir.join(&spec.resume_from_attempt_id);
    let prev = TaskDir {
        repo: None,
        input_dir: prev_root.join("input"),
        home: prev_root.join("home"),
        tmp: prev_root.join("tmp"),
        root: prev_root,
    };
    let can = ctx.descriptor(adapter.name()).is_some_and(|d| d.resume)
        && !spec.resume_from_attempt_id.contains(['/', '.'])
        && adapter.session_exists(&prev, &spec.resume_session_id);
    // The provider's state: HOME, and CODEX_HOME where Codex keeps it.
    let mut copied = can;
    for (from, to) in [
        (prev.home.clone(), dir.home.clone()),
        (prev.root.join("codex-home"), dir.root.join("codex-home")),
    ] {
        if copied && from.is_dir() {
            let _ = tokio::fs::create_dir_all(&to).await;
            copied = tokio::process::Command::new("cp")
                .arg("-a")
                .arg(from.join("."))
                .arg(&to)
                .status()
                .await
                .is_ok_and(|s| s.success());
        }
    }
    if copied {
        sink.diag(
            "info",
            "reusing_session",
            format!(
                "this retry continues provider session {} of the previous attempt",
                spec.resume_session_id
            ),
        )
        .await;
        Some(spec.resume_session_id.clone())
    } else {
        sink.diag("info", "fresh_session", format!("provider session {} of the previous attempt is not available on this host; starting a fresh session", spec.resume_session_id)).await;
        None
    }
}

/// The provider's command line, files and environment from its adapter, the task directory given
/// to the attempt's uid, and the provider started through the sentinel. Err: the attempt ends
/// here.
#[allow(clippy::too_many_arguments)]
async fn launch(
    ctx: &Ctx,
    a: &Assignment,
    adapter: &dyn provider::Adapter,
    spec: &Spec,
    dir: &TaskDir,
    resumed_session: Option<&str>,
    who: Option<RunAs>,
    given: bool,
) -> Result<(Launch, Started), Outcome> {
    let launch_ctx = provider::LaunchCtx {
        spec,
        dir,
        attempt_id: &a.attempt_id,
        api_url: &ctx.config.api_url,
        task_token: &a.task_token,
        cli: ctx.cli_path(),
    };
    let launched = match resumed_session {
        Some(session) => adapter
            .resume_launch(&launch_ctx, session)
            .unwrap_or_else(|| {
                Err(provider::Refusal {
                    class: FailureClass::HostRestart,
                    detail: "this provider cannot resume".into(),
                })
            }),
        None => adapter.launch(&launch_ctx),
    };
    let launch = match launched {
        Ok(l) => l,
        Err(r) => return Err(failed(r.class, r.detail)),
    };
    for (rel, content) in &launch.files {
        let path = dir.root.join(rel);
        if !path.starts_with(&dir.root)
            || rel
                .components()
                .any(|c| c == std::path::Component::ParentDir)
        {
            return Err(failed(
                FailureClass::Internal,
                format!("adapter file {} escapes the task directory", rel.display()),
            ));
        }
        if let Some(parent) = path.parent()
            && let Err(e) = isolation::create_private_dir(parent)
        {
            return Err(failed(
                FailureClass::TaskDir,
                format!("create {}: {e}", parent.display()),
            ));
        }
        // Adapter files hold the task credential (MCP configurations): owner only.
        if let Err(e) = isolation::write_private(&path, content.as_bytes()) {
            return Err(failed(
                FailureClass::TaskDir,
                format!("write {}: {e}", path.display()),
            ));
        }
    }
    // Exactly what `prepare` made, nothing added: its entries are known, no walk is needed.
    let plain = resumed_session.is_none() && dir.repo.is_none() && launch.files.is_empty();
    if !plain {
        use std::os::unix::fs::PermissionsExt;
        if let Err(e) = std::fs::set_permissions(&dir.root, std::fs::Permissions::from_mode(0o700))
        {
            return Err(failed(
                FailureClass::TaskDir,
                format!("chmod {}: {e}", dir.root.display()),
            ));
        }
    }
    // The whole directory is the attempt's: also an earlier attempt's copied HOME, or the
    // directory a restarted host resumes in.
    if let Some(who) = who
        && !(plain && given)
    {
        let owned = if plain {
            give_plain(dir, who)
        } else {
            let root = dir.root.clone();
            tokio::task::spawn_blocking(move || isolation::chown_tree(&root, who))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        };
        if let Err(e) = owned {
            return Err(failed(
                FailureClass::TaskDir,
                format!("give the task directory to uid {}: {e}", who.uid),
            ));
        }
    }
    let user = isolation::user_name(who);
    let mut env = launch.env.clone();
    for (k, v) in [
        ("USER", user.clone()),
        ("LOGNAME", user),
        ("AGENTSCOPE_TASK_ID", a.task_id.clone()),
        ("AGENTSCOPE_ATTEMPT_ID", a.attempt_id.clone()),
        ("AGENTSCOPE_WORKSPACE_ID", a.workspace_id.clone()),
        (
            "AGENTSCOPE_TASK_DIR",
            dir.root.to_string_lossy().into_owned(),
        ),
        (
            "AGENTSCOPE_INPUT_DIR",
            dir.input_dir.to_string_lossy().into_owned(),
        ),
        ("AGENTSCOPE_API", ctx.config.api_url.clone()),
        ("AGENTSCOPE_TASK_TOKEN", a.task_token.clone()),
        ("PATH", ctx.executor_path().to_string_lossy().into_owned()),
    ] {
        env.push((k.to_string(), v));
    }
    // Nothing of the host's own environment (its token, its settings) leaks through: the
    // environment is cleared and only allow-listed variables are set.
    let (env, refused) = isolation::filter_env(env);
    if !refused.is_empty() {
        tracing::error!(
            ?refused,
            "variables outside the allow-list not passed to the provider"
        );
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let Some(program) = isolation::resolve_program(&launch.argv[0], path.as_ref(), &launch.cwd)
    else {
        return Err(failed(
            FailureClass::ToolDependency,
            format!("`{}` was not found on this host", launch.argv[0]),
        ));
    };
    // The sentinel (spawned without copying the host's memory) starts the provider under the
    // attempt's uid, keeps its whole tree below it, and ends it with the host.
    let Some(sentinel) = isolation::sentinel_path() else {
        return Err(failed(
            FailureClass::Internal,
            "the sentinel was not written (svc-host starts providers only through it)",
        ));
    };
    let mut argv = vec![sentinel.as_os_str().to_owned()];
    argv.extend(isolation::sentinel_args(
        std::process::id(),
        who,
        &program,
        &launch.argv,
    ));
    let spec = agentscope_tools::spawn::Spec {
        program: sentinel.to_owned(),
        argv,
        env: env.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
        cwd: launch.cwd.clone(),
        identity: None,
        setup: Default::default(),
        held: None,
        // The sentinel sets its own mask and SIGPIPE's disposition first thing.
        signals: agentscope_tools::spawn::Signals::LeftToTheProgram,
    };
    match start_sentinel(spec, launch.stdin.is_some()) {
        Ok(started) => Ok((launch, started)),
        Err(e) => Err(failed(
            FailureClass::Internal,
            format!("start {}: {e}", sentinel.display()),
        )),
    }
}

/// Starts the sentinel in a process group of its own (without copying the host's memory, as
/// std's `posix_spawn` does, and without its per-signal system calls), stdout and stderr into
/// pipes, stdin from a pipe or /dev/null. Dropped before it is reaped, the child is killed.
fn start_sentinel(
    spec: agentscope_tools::spawn::Spec,
    stdin_piped: bool,
) -> std::io::Result<Started> {
    use std::os::fd::{AsRawFd, OwnedFd};
    use tokio::net::unix::pipe;
    let (out_r, out_w) = std::io::pipe()?;
    let (err_r, err_w) = std::io::pipe()?;
    let (in_r, in_w): (Option<OwnedFd>, Option<OwnedFd>) = if stdin_piped {
        let (r, w) = std::io::pipe()?;
        (Some(r.into()), Some(w.into()))
    } else {
        (None, None)
    };
    let child = agentscope_tools::spawn::spawn_with(
        spec,
        agentscope_tools::spawn::Streams {
            stdin: match &in_r {
                Some(r) => r.as_raw_fd(),
                None => agentscope_tools::spawn::dev_null()?,
            },
            stdout: out_w.as_raw_fd(),
            stderr: err_w.as_raw_fd(),
        },
    )?;
    // The child's ends close here: EOF on the output once the provider's tree has closed its.
    drop((in_r, out_w, err_w));
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    Ok(Started {
        child,
        stdin: in_w.map(pipe::Sender::from_owned_fd).transpose()?,
        stdout: pipe::Receiver::from_owned_fd(out_r.into())?,
        stderr: pipe::Receiver::from_owned_fd(err_r.into())?,
        pgid,
    })
}

/// Runs the provider to its end: its output becomes events, its tool requests Approvals, and a
/// cancel, a lost lease, the host's shutdown, the run timeout, an unreachable model or a fatal
/// line stop it.
#[allow(clippy::too_many_arguments)]
async fn pump(
    ctx: &Ctx,
    a: &Assignment,
    sink: &mut EventSink,
    stops: &Stops,
    decisions: &mut tokio::sync::mpsc::Receiver<ApprovalDecision>,
    adapter: &dyn provider::Adapter,
    spec: &Spec,
    launch: &Launch,
    started: Started,
    marker: &str,
    resumed: bool,
    scope: Option<&str>,
) -> Pumped {
    let Started {
        mut child,
        mut stdin,
        stdout,
        stderr,
        pgid,
    } = started;
    // Providers driven over stdin keep it open (approvals); others get their input and EOF.
    if let (Some(text), Some(pipe)) = (launch.stdin.clone(), stdin.as_mut()) {
        use tokio::io::AsyncWriteExt;
        let _ = pipe.write_all(text.as_bytes()).await;
        let _ = pipe.flush().await;
    }
    if !launch.keep_stdin_open {
        stdin = None;
    }
    let mut rejected = false;
    // The last `Result` seen: Some(None) a success, Some(Some(text)) a failure.
    let mut result_error: Option<Option<String>> = None;
    let mut pending: std::collections::HashMap<String, provider::ControlRequest> =
        Default::default();
    // "Allow always" lives in this attempt's memory only: it never outlives the task.
    let mut always: std::collections::HashSet<String> = Default::default();
    // The last denied tool request, until a later one is allowed: a turn that ends after it
    // ended because of it (`tool_denied`, or `approval_timeout` when nobody decided).
    let mut denial: Option<(FailureClass, String)> = None;
    let mut parser = adapter.parser_for(launch);
    let mut watch = ModelWatch::default();
    if let Some(d) = ctx.descriptor(adapter.name()) {
        if !d.live_stream {
            sink.diag(
                "info",
                "no_live_stream",
                format!(
                    "{} has no live event stream: its events arrive when the run ends",
                    d.name
                ),
            )
            .await;
        }
        if !d.resume {
            sink.diag(
                "info",
                "no_resume",
                format!(
                    "{} has no session resume: a retry starts a fresh session",
                    d.name
                ),
            )
            .await;
        }
    }
    sink.lifecycle(
        AttemptStatus::Running,
        None,
        format!("started {} (pgid {pgid})", adapter.name()),
        None,
    )
    .await;

    // Both output streams feed one channel so events keep their arrival order.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(&'static str, String, bool)>(256);
    for (name, max, pipe) in [
        ("stdout", adapter.max_line_bytes(), stdout),
        ("stderr", ctx.config.max_line_bytes, stderr),
    ] {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut r = BufReader::new(pipe);
            while let Ok(Some((line, truncated))) = process::read_line_bounded(&mut r, max).await {
                if tx.send((name, line, truncated)).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);

    let (timeout, limit) = run_limit(spec);
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let grace = Duration::from_millis(ctx.config.kill_grace_ms);
    let mut stop: Option<Outcome> = None;
    let mut output_open = true;
    let status = loop {
        tokio::select! {
            biased;
            _ = stops.lease_lost.cancelled(), if stop.is_none() => {
                let left = process::stop_tree(pgid, None, marker).await;
                stop = Some(failed(FailureClass::LeaseLost, format!("lease lost; provider killed ({} left)", left.len())));
            }
            _ = stops.cancel.cancelled(), if stop.is_none() => {
                sink.diag("info", "cancelling", format!("SIGTERM to process group {pgid}, SIGKILL after {} ms", grace.as_millis())).await;
                let left = process::stop_tree(pgid, Some(grace), marker).await;
                stop = Some(if left.is_empty() {
                    (AttemptStatus::Cancelled, Some(FailureClass::Cancelled), "cancelled; the provider's process tree is gone".into(), None)
                } else {
                    failed(FailureClass::Internal, format!("cancel left processes {left:?}"))
                });
            }
            _ = stops.shutdown.cancelled(), if stop.is_none() => {
                sink.diag("warn", "host_shutdown", "the host is shutting down; stopping the provider").await;
                let left = process::stop_tree(pgid, Some(grace), marker).await;
                stop = Some(failed(FailureClass::HostRestart, format!("the host shut down during the attempt ({} processes left)", left.len())));
            }
            _ = &mut deadline, if stop.is_none() => {
                let left = process::stop_tree(pgid, Some(grace), marker).await;
                stop = Some(failed(FailureClass::Timeout, format!("timed out after {} s: {limit} ({} processes left)", timeout.as_secs(), left.len())));
            }
            line = rx.recv(), if output_open => match line {
                Some(("stdout", text, truncated)) => {
                    if resumed && adapter.resume_rejected(&text) {
                        rejected = true;
                    }
                    if let Some(req) = (!truncated).then(|| adapter.control_request(&text)).flatten() {
                        let key = scoped_id(scope, &req.request_id);
                        if always.contains(&req.tool_name) {
                            answer(&mut stdin, adapter, sink, &req, &key, true, "allowed for the rest of this task", "always_for_task", "").await;
                            denial = None;
                        } else {
                            request_approval(ctx, a, sink, &req, &key, launch.approval_timeout_ms).await;
                            pending.insert(key, req);
                        }
                        continue;
                    }
                    if stop.is_none() && adapter.model_connection_error(&text) {
                        for body in parser.line(&text, truncated) {
                            sink.emit(scope_ids(body, scope)).await;
                        }
                        let limit = (ctx.config.model_retry_limit, Duration::from_secs(ctx.config.model_retry_secs));
                        if let Some((errors, secs)) = watch.connection_error(limit.0, limit.1) {
                            let detail = format!("the provider could not connect to its model endpoint {}: {errors} connection errors in a row over {secs} s, no response", adapter.model_endpoint());
                            sink.diag("error", FailureClass::ModelUnreachable.as_str(), detail.clone()).await;
                            let left = process::stop_tree(pgid, Some(grace), marker).await;
                            stop = Some(failed(FailureClass::ModelUnreachable, format!("{detail} ({} processes left)", left.len())));
                        }
                        continue;
                    }
                    let fatal = if stop.is_none() { adapter.fatal(&text) } else { None };
                    if let Some((class, detail)) = fatal {
                        for body in parser.line(&text, truncated) {
                            sink.emit(scope_ids(body, scope)).await;
                        }
                        sink.diag("error", class.as_str(), detail.clone()).await;
                        let left = process::stop_tree(pgid, Some(grace), marker).await;
                        stop = Some(failed(class, format!("{detail} ({} processes left)", left.len())));
                        continue;
                    }
                    let mut end = false;
                    for body in parser.line(&text, truncated) {
                        // The provider's final result ends its work: stdin closes (providers
                        // driven over stdin exit then).
                        end |= matches!(body, Body::Result(_));
                        if let Body::Result(r) = &body {
                            result_error = Some(r.is_error.then(|| r.text.clone()));
                        }
                        if matches!(body, Body::AssistantMessage(_) | Body::ToolCall(_) | Body::Result(_) | Body::Usage(_)) {
                            watch.progress();
                        }
                        sink.emit(scope_ids(body, scope)).await;
                    }
                    write_lines(&mut stdin, parser.replies()).await;
                    if end {
                        stdin = None;
                    }
                }
                Some((stream, text, truncated)) => {
                    if resumed && adapter.resume_rejected(&text) {
                        rejected = true;
                    }
                    sink.emit(Body::Output(agentscope_schemas::v1::Output { stream: stream.into(), text, truncated })).await;
                }
                None => {
                    output_open = false;
                    // The output is read: once the provider is gone, its sentinel ends the rest.
                    isolation::end_rest(pgid);
                }
            },
            d = decisions.recv(), if !pending.is_empty() => {
                let Some(d) = d else { continue };
                let Some(req) = pending.remove(&d.request_id) else { continue };
                let class = if d.decided_by == "policy" { FailureClass::ApprovalTimeout.as_str() } else { "" };
                if d.allow && d.always_for_task {
                    always.insert(req.tool_name.clone());
                }
                answer(&mut stdin, adapter, sink, &req, &d.request_id, d.allow, &d.reason, &d.decided_by, class).await;
                denial = denied_outcome(&req, &d);
                if !d.allow {
                    parser.denied(&req.tool_name, &d.reason);
                }
            }
            st = child.wait(), if !output_open || stop.is_some() => break st,
        }
    };
    if !stops.lease_lost.is_cancelled() {
        for body in parser.finish() {
            sink.emit(scope_ids(body, scope)).await;
        }
    }
    Pumped {
        status,
        stop,
        rejected,
        result_error,
        denial,
    }
}

/// The outcome of a run whose provider ended by itself.
fn outcome(run: Pumped, turn_failed: bool) -> Outcome {
    let Pumped {
        status,
        result_error,
        denial,
        ..
    } = run;
    match status {
        Ok(s) if s.success() && turn_failed => (
            AttemptStatus::Failed,
            Some(FailureClass::AgentError),
            match result_error {
                Some(Some(text)) => format!("the agent's turn failed: {text}"),
                _ => "the provider ended without finishing its turn".into(),
            },
            Some(0),
        ),
        Ok(s) if s.success() => match denial {
            // The work asked for did not happen: not a plain success.
            Some((class, detail)) => (AttemptStatus::Failed, Some(class), detail, Some(0)),
            None => (
                AttemptStatus::Succeeded,
                None,
                "exit status 0".into(),
                Some(0),
            ),
        },
        Ok(s) => match s.code() {
            Some(code) => (
                AttemptStatus::Failed,
                Some(FailureClass::ExitNonzero),
                format!("exit status {code}"),
                Some(code),
            ),
            None => failed(
                FailureClass::ProviderCrash,
                format!("provider ended by a signal: {s}"),
            ),
        },
        Err(e) => failed(
            FailureClass::ProviderCrash,
            format!("wait for provider: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The kernel's signal masks of a process, from its `/proc/<pid>/status`.
    fn mask(status: &str, field: &str) -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap_or_else(|| panic!("no {field} in {status}"));
        u64::from_str_radix(line[field.len()..].trim(), 16).unwrap()
    }

    /// The sentinel as an attempt starts it: its provider gets the environment, directory and
    /// stdin given, writes stdout and stderr to their own pipes, and runs with no signal
    /// blocked and SIGPIPE at its default although the host ignores it (the host's spawn
    /// leaves both to the sentinel); the sentinel leads its own process group and mirrors the
    /// provider's status.
    #[tokio::test]
    async fn the_sentinel_starts_its_provider_with_its_streams_and_clean_signals() {
        let state = std::env::temp_dir().join(format!("agentscope-start-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&state).unwrap();
        let sentinel = isolation::publish_sentinel(&state).unwrap();
        // The test harness, like every std program, ignores SIGPIPE: the provider must not.
        // SAFETY: reads this process's disposition of SIGPIPE into a zeroed struct.
        let host_ignores_sigpipe = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old);
            old.sa_sigaction == libc::SIG_IGN
        };
        assert!(host_ignores_sigpipe);
        let script = "read line; echo \"out $line $SEEN $(pwd)\"; echo err >&2; echo \"sentinel $(grep SigBlk /proc/$PPID/status)\"; exec cat /proc/self/status";
        let argv: Vec<String> = ["sh", "-c", script].iter().map(|s| s.to_string()).collect();
        let mut args = vec![sentinel.as_os_str().to_owned()];
        args.extend(isolation::sentinel_args(
            std::process::id(),
            None,
            Path::new("/bin/sh"),
            &argv,
        ));
        let spec = agentscope_tools::spawn::Spec {
            program: sentinel.clone(),
            argv: args,
            env: [
                ("PATH".into(), "/usr/bin:/bin".into()),
                ("SEEN".into(), "seen".into()),
            ]
            .into(),
            cwd: state.join("bin"),
            identity: None,
            setup: Default::default(),
            held: None,
            signals: agentscope_tools::spawn::Signals::LeftToTheProgram,
        };
        let Started {
            mut child,
            stdin,
            mut stdout,
            mut stderr,
            pgid,
        } = start_sentinel(spec, true).unwrap();
        assert_eq!(Some(pgid as u32), child.id());
        // SAFETY: getpgid has no memory arguments.
        assert_eq!(unsafe { libc::getpgid(pgid) }, pgid);
        let mut stdin = stdin.unwrap();
        stdin.write_all(b"hello\n").await.unwrap();
        drop(stdin);
        let (mut out, mut err) = (String::new(), String::new());
        let (o, e) = tokio::join!(
            stdout.read_to_string(&mut out),
            stderr.read_to_string(&mut err)
        );
        o.unwrap();
        e.unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status:?}: {out} {err}");
        let bin = state.join("bin").canonicalize().unwrap();
        assert!(
            out.starts_with(&format!("out hello seen {}\n", bin.display())),
            "{out}"
        );
        assert_eq!(err, "err\n");
        assert_eq!(mask(&out, "SigBlk:"), 0, "{out}");
        // The sentinel blocks what it waits for and nothing else: while it waits for them
        // (rt_sigtimedwait) the kernel unblocks them, so nothing shows as blocked. (A mask only
        // added to would show the host's whole blocked set here.)
        assert_eq!(mask(&out, "sentinel SigBlk:"), 0, "{out}");
        assert_eq!(mask(&out, "SigIgn:") & 1 << (libc::SIGPIPE - 1), 0, "{out}");
        std::fs::remove_dir_all(&state).unwrap();
    }
}
