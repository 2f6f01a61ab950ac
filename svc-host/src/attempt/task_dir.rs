//! The attempt's task directory: a fresh one (clone, input material), or the one an earlier run
//! of this host prepared.

use super::sink::EventSink;
use super::{Assignment, Spec};
use crate::Ctx;
use crate::isolation;
use crate::process;
use crate::provider::TaskDir;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The task directory an earlier run of this host prepared for the attempt.
pub fn existing_task_dir(ctx: &Ctx, a: &Assignment) -> TaskDir {
    let root = ctx.tasks_dir.join(&a.attempt_id);
    let repo = root.join("repo");
    TaskDir {
        repo: repo.is_dir().then_some(repo),
        input_dir: root.join("input"),
        home: root.join("home"),
        tmp: root.join("tmp"),
        root,
    }
}

/// The input material in a task directory's `input/`.
pub(super) const INPUT_FILES: [&str; 3] = ["INPUT.md", "ISSUE.md", "INSTRUCTIONS.md"];

/// Creates a fresh directory for the attempt, clones the named repository and branch, and writes
/// the input material. Never uses the host's own checkout.
pub(super) async fn prepare(
    ctx: &Ctx,
    a: &Assignment,
    sink: &mut EventSink,
    cancel: &CancellationToken,
) -> Result<TaskDir, String> {
    let spec = &a.spec;
    let root = ctx.tasks_dir.join(&a.attempt_id);
    // A fresh directory: one left by an earlier run of this attempt is cleared first.
    let mut dir = match make_dirs(&root) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            tokio::fs::remove_dir_all(&root)
                .await
                .map_err(|e| format!("clear {}: {e}", root.display()))?;
            make_dirs(&root).map_err(|e| format!("create {}: {e}", root.display()))?
        }
        r => r.map_err(|e| format!("create {}: {e}", root.display()))?,
    };
    if !spec.repository.is_empty() {
        let dest = root.join("repo");
        clone(&spec.repository, &spec.branch, &dest, cancel).await?;
        sink.diag(
            "info",
            "cloned",
            format!(
                "cloned {} branch {}",
                spec.repository,
                if spec.branch.is_empty() {
                    "(default)"
                } else {
                    &spec.branch
                }
            ),
        )
        .await;
        dir.repo = Some(dest);
    }
    write_input(&dir, spec)?;
    Ok(dir)
}

/// A new task directory at `root` (0700, `AlreadyExists` if it is there) with its empty `home`,
/// `tmp` and `input`: the attempt's only (given to its uid before it starts).
fn make_dirs(root: &Path) -> std::io::Result<TaskDir> {
    isolation::create_private_dir_new(root)?;
    let dir = TaskDir {
        repo: None,
        input_dir: root.join("input"),
        home: root.join("home"),
        tmp: root.join("tmp"),
        root: root.to_path_buf(),
    };
    for d in [&dir.home, &dir.tmp, &dir.input_dir] {
        isolation::create_private_dir(d)?;
    }
    Ok(dir)
}

/// The input material, as new files of a fresh directory (nobody reads them before the provider
/// starts).
fn write_input(dir: &TaskDir, spec: &Spec) -> Result<(), String> {
    let issue = format!("# {}\n\n{}\n", spec.issue_title, spec.issue_body);
    for (name, body) in INPUT_FILES.iter().zip([
        spec.input.as_str(),
        issue.as_str(),
        spec.instructions.as_str(),
    ]) {
        let p = dir.input_dir.join(name);
        isolation::write_new_private(&p, body.as_bytes())
            .map_err(|e| format!("write {}: {e}", p.display()))?;
    }
    Ok(())
}

/// Gives a fresh directory without a repository to `who`: its entries are known (no walk),
/// deepest first.
pub(super) fn give_plain(dir: &TaskDir, who: crate::provider::RunAs) -> std::io::Result<()> {
    INPUT_FILES
        .iter()
        .map(|f| dir.input_dir.join(f))
        .chain([
            dir.input_dir.clone(),
            dir.home.clone(),
            dir.tmp.clone(),
            dir.root.clone(),
        ])
        .try_for_each(|p| std::os::unix::fs::lchown(p, Some(who.uid), Some(who.gid)))
}

/// An attempt's task directory prepared on the gateway's early word
/// (`ClaimOffer.prepare_only`), before the attempt is claimed, and given to the uid it holds for
/// it: the offer or claim that brings the attempt starts its provider there without preparing.
pub struct Prepared {
    attempt_id: String,
    /// What the directory was made from: it is used only for an offer of the same input.
    spec: Spec,
    pub(super) dir: TaskDir,
    pub(super) lease: Option<isolation::Lease>,
    /// When it is removed if nothing has brought its attempt.
    until: std::time::Instant,
}

/// How long a preparation waits for its attempt: the gateway's offer follows its statement's
/// commit within milliseconds, and it gives up on an offer's answer after 2 s.
const PREPARED_FOR: Duration = Duration::from_secs(3);

/// On the gateway's early word: prepares `a`'s task directory if this host can take it (`free`:
/// a slot free, not stopping), the attempt is new here and fresh (attempt 1, no repository to
/// clone: a clone is not worth starting for a word), and a uid is free at once.
/// One preparation at a time: an older one is removed first.
pub(crate) fn prepare_ahead(ctx: &Ctx, a: Assignment, free: bool) {
    discard_prepared(ctx, false);
    let fresh = a.attempt_number == 1
        && a.spec.repository.is_empty()
        && a.spec.resume_session_id.is_empty()
        && uuid::Uuid::parse_str(&a.attempt_id).is_ok_and(|u| u.to_string() == a.attempt_id);
    if !free || !fresh || ctx.adapter(&a.spec.provider).is_none() {
        tracing::debug!(free, fresh, attempt_id = %a.attempt_id, "not prepared ahead");
        return;
    }
    if ctx.state.lock().expect("host state").knows(&a.attempt_id) {
        tracing::debug!(attempt_id = %a.attempt_id, "not prepared ahead: known here");
        return;
    }
    let lease = match &ctx.identities {
        None => None,
        // Passing over a few uids that need a scan first (which stays the run's to make).
        Some(ids) => match ids.acquire_clean(8) {
            Ok(Some(l)) => Some(l),
            _ => {
                tracing::debug!(attempt_id = %a.attempt_id, "not prepared ahead: no uid free at once");
                return;
            }
        },
    };
    let root = ctx.tasks_dir.join(&a.attempt_id);
    let made = match make_dirs(&root) {
        // Not this preparation's to touch.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err((false, e)),
        Err(e) => Err((true, e)),
        Ok(dir) => write_input(&dir, &a.spec)
            .map_err(std::io::Error::other)
            .and_then(|()| match &lease {
                None => Ok(()),
                Some(l) => give_plain(&dir, l.who),
            })
            .map(|()| dir)
            .map_err(|e| (true, e)),
    };
    let dir = match made {
        Ok(dir) => dir,
        Err((ours, e)) => {
            // Nothing half made is left.
            if ours {
                let _ = std::fs::remove_dir_all(&root);
            }
            if let (Some(ids), Some(l)) = (&ctx.identities, lease) {
                ids.release(l, true);
            }
            tracing::debug!(error = %e, attempt_id = %a.attempt_id, "not prepared ahead");
            return;
        }
    };
    ctx.state.lock().expect("host state").prepared = Some(Prepared {
        attempt_id: a.attempt_id,
        spec: a.spec,
        dir,
        lease,
        until: std::time::Instant::now() + PREPARED_FOR,
    });
}

/// When the directory prepared ahead expires, if one is.
pub(crate) fn prepared_until(ctx: &Ctx) -> Option<std::time::Instant> {
    ctx.state
        .lock()
        .expect("host state")
        .prepared
        .as_ref()
        .map(|p| p.until)
}

impl Prepared {
    pub fn is_for(&self, attempt_id: &str) -> bool {
        self.attempt_id == attempt_id
    }
}

/// The directory prepared for `a`, if one was and from the same input.
pub(super) fn take_prepared(ctx: &Ctx, a: &Assignment) -> Option<Prepared> {
    let mut st = ctx.state.lock().expect("host state");
    if st.prepared.as_ref()?.attempt_id != a.attempt_id {
        return None;
    }
    let p = st.prepared.take()?;
    drop(st);
    fn made_from(s: &Spec) -> [&str; 7] {
        [
            &s.provider,
            &s.input,
            &s.instructions,
            &s.issue_title,
            &s.issue_body,
            &s.repository,
            &s.resume_session_id,
        ]
    }
    if made_from(&p.spec) == made_from(&a.spec) && a.attempt_number == 1 {
        Some(p)
    } else {
        tracing::debug!(attempt_id = %a.attempt_id, "the directory prepared ahead was made from other input");
        remove(ctx, p);
        None
    }
}

/// Removes the preparation nothing brought (`expired_only`: only once its time is up), and gives
/// its uid back.
pub(crate) fn discard_prepared(ctx: &Ctx, expired_only: bool) {
    let p = {
        let mut st = ctx.state.lock().expect("host state");
        match &st.prepared {
            Some(p) if !expired_only || p.until <= std::time::Instant::now() => st.prepared.take(),
            _ => None,
        }
    };
    if let Some(p) = p {
        remove(ctx, p);
    }
}

fn remove(ctx: &Ctx, p: Prepared) {
    // Nothing ever ran as its uid: the directory goes, then the uid.
    if let Err(e) = std::fs::remove_dir_all(&p.dir.root) {
        tracing::warn!(error = %e, attempt_id = %p.attempt_id, "remove a directory prepared ahead");
    }
    if let (Some(ids), Some(l)) = (&ctx.identities, p.lease) {
        ids.release(l, true);
    }
}

async fn clone(
    repository: &str,
    branch: &str,
    dest: &Path,
    cancel: &CancellationToken,
) -> Result<(), String> {
    if repository.starts_with('-') || branch.starts_with('-') {
        return Err("repository and branch must not start with '-'".into());
    }
    let mut cmd = tokio::process::Command::new("git");
    cmd.arg("clone").arg("--quiet").arg("--single-branch");
    if !branch.is_empty() {
        cmd.arg("--branch").arg(branch);
    }
    cmd.arg("--").arg(repository).arg(dest);
    // Its own process group, so that a cancel stops git's helpers too; none of the host's
    // environment (its token) but a PATH.
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LANG", "C.UTF-8")
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| format!("run git: {e}"))?;
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    let out = tokio::select! {
        out = child.wait_with_output() => out.map_err(|e| format!("run git: {e}"))?,
        _ = cancel.cancelled() => {
            process::kill_group(pgid).await;
            return Err("cancelled during git clone".into());
        }
        _ = tokio::time::sleep(Duration::from_secs(600)) => {
            process::kill_group(pgid).await;
            return Err("git clone timed out after 600 s".into());
        }
    };
    if !out.status.success() {
        return Err(format!(
            "git clone {repository} (branch {branch}) failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}
