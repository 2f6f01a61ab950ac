//! The attempt's task directory: a fresh one (clone, input material), or the one an earlier run
//! of this host prepared.

use super::Assignment;
use super::sink::EventSink;
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
    if let Err(e) = isolation::create_private_dir_new(&root) {
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(format!("create {}: {e}", root.display()));
        }
        tokio::fs::remove_dir_all(&root)
            .await
            .map_err(|e| format!("clear {}: {e}", root.display()))?;
        isolation::create_private_dir(&root)
            .map_err(|e| format!("create {}: {e}", root.display()))?;
    }
    let input_dir = root.join("input");
    let home = root.join("home");
    let tmp = root.join("tmp");
    // The task directory is its attempt's only (0700; given to the attempt's uid before start).
    for d in [&home, &tmp, &input_dir] {
        isolation::create_private_dir(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let repo = if spec.repository.is_empty() {
        None
    } else {
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
        Some(dest)
    };
    let issue = format!("# {}\n\n{}\n", spec.issue_title, spec.issue_body);
    // A fresh directory: plain new files (nobody reads them before the provider starts).
    for (name, body) in INPUT_FILES.iter().zip([
        spec.input.as_str(),
        issue.as_str(),
        spec.instructions.as_str(),
    ]) {
        let p = input_dir.join(name);
        isolation::write_new_private(&p, body.as_bytes())
            .map_err(|e| format!("write {}: {e}", p.display()))?;
    }
    Ok(TaskDir {
        root,
        repo,
        input_dir,
        home,
        tmp,
    })
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
