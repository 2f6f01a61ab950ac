//! Ended attempts' task directories are kept `task_dir_retention_secs` after their last change
//! (a retry on this host continues its provider session from there; an operator can look
//! inside), then removed: a host that runs attempts for months does not fill its disk.

use crate::Ctx;
use std::path::Path;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;

/// Every quarter of the retention (1 s to 10 min), removes the task directories of attempts this
/// host does not run whose last change is older than the retention.
pub(crate) async fn prune_task_dirs(ctx: Ctx, stop: CancellationToken) -> anyhow::Result<()> {
    let keep = Duration::from_secs(ctx.config.task_dir_retention_secs);
    let every = (keep / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
    loop {
        let (dir, state) = (ctx.tasks_dir.clone(), ctx.state.clone());
        let pruned = tokio::task::spawn_blocking(move || {
            prune(&dir, keep, |id| {
                let st = state.lock().expect("host state");
                st.running.contains_key(id) || st.prepared.as_ref().is_some_and(|p| p.is_for(id))
            })
        })
        .await?;
        match pruned {
            Ok(0) => {}
            Ok(n) => tracing::info!(removed = n, "removed ended attempts' task directories"),
            Err(e) => tracing::warn!(error = %e, "look for ended attempts' task directories"),
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Removes each directory of `tasks` named by an attempt id whose last change (modification or
/// status change: the end of an attempt gives its root back) is older than `keep`, unless
/// `running(id)`; returns how many it removed. Symlinks inside are removed, never followed.
/// A directory created during the pass is younger than `keep` (at least a second), so an
/// attempt starting meanwhile keeps its own.
fn prune(tasks: &Path, keep: Duration, running: impl Fn(&str) -> bool) -> std::io::Result<usize> {
    use std::os::unix::fs::MetadataExt as _;
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in std::fs::read_dir(tasks)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(id) = name.to_str().filter(|n| uuid::Uuid::parse_str(n).is_ok()) else {
            continue;
        };
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        let at = |secs: i64, nsecs: i64| secs as f64 + nsecs as f64 / 1e9;
        let changed = at(meta.mtime(), meta.mtime_nsec()).max(at(meta.ctime(), meta.ctime_nsec()));
        let age = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            - changed;
        if age < keep.as_secs_f64() || running(id) {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(attempt_id = id, error = %e, "remove a task directory"),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_old_directories_of_attempts_not_running_go() {
        let base = std::env::temp_dir().join(format!("prune-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&base).unwrap();
        let old = uuid::Uuid::new_v4().to_string();
        let running = uuid::Uuid::new_v4().to_string();
        for id in [&old, &running] {
            std::fs::create_dir_all(base.join(id).join("home/deep")).unwrap();
            std::fs::write(base.join(id).join("home/deep/f"), "x").unwrap();
        }
        // A symlink inside to something outside: removed, its target left alone.
        let outside = base.join("outside");
        std::fs::write(&outside, "keep").unwrap();
        std::os::unix::fs::symlink(&outside, base.join(&old).join("home/link")).unwrap();
        // Not an attempt's directory: left alone, however old.
        std::fs::create_dir(base.join("lost+found")).unwrap();
        // Nothing is old enough yet.
        let hour = Duration::from_secs(3600);
        assert_eq!(prune(&base, hour, |_| false).unwrap(), 0);
        // With no retention left, everything not running goes.
        let gone = prune(&base, Duration::ZERO, |id| id == running).unwrap();
        assert_eq!(gone, 1);
        assert!(!base.join(&old).exists());
        assert!(base.join(&running).join("home/deep/f").exists());
        assert!(base.join("lost+found").exists());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
