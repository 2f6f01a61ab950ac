//! CPU time of the whole stack, from /proc.
//!
//! Attribution:
//! - every direct child of the benchmark process (nats-server, the services, the hosts): its
//!   `utime + stime + cutime + cstime`, so the providers and sentinels a host started and reaped
//!   count as that host's;
//! - PostgreSQL: the backends connected to the run's database (`pg_stat_activity.datname`),
//!   except the benchmark's own (application name `agentscope-bench`), sampled every 250 ms so a
//!   backend that leaves mid-run counts up to its last sample. The server's shared processes
//!   (WAL writer, checkpointer, background writer) serve every database of the machine and are
//!   left out.
//!
//! Resolution is the kernel's clock tick (10 ms); figures are over whole runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// CPU seconds of `pid` (self plus reaped children), or None when it is gone.
pub fn proc_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    // Fields after the command: state(3) ppid(4) ... utime(14) stime(15) cutime(16) cstime(17).
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i - 3).and_then(|v| v.parse::<f64>().ok());
    let hz = clock_ticks();
    Some((tick(14)? + tick(15)? + tick(16)? + tick(17)?) / hz)
}

fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// The benchmark's direct children: (pid, command name).
pub fn children() -> Vec<(u32, String)> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| ppid(*pid) == Some(me))
        .map(|pid| (pid, comm(pid)))
        .collect()
}

/// Resident set size of `pid` in MiB (VmRSS).
pub fn rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmRSS:")
}

/// The anonymous part of `pid`'s resident set in MiB (RssAnon): its own memory, without the
/// pages of its executable and libraries, which count more or less depending on how recently
/// the file was written (a binary copied just before it runs has more of its pages mapped).
pub fn rss_anon_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "RssAnon:")
}

/// A `/proc/<pid>/status` field given in kB, in MiB.
fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Threads of `pid`.
pub fn threads(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Threads:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The key of the benchmark process's own CPU (the client: HTTP calls, SSE parsing, the
/// in-process model server of W3/W4).
pub const CLIENT: &str = "client";

/// CPU accounting over one measured window.
pub struct Probe {
    start: HashMap<u32, (String, f64)>,
    client: f64,
    pg_first: Arc<Mutex<HashMap<u32, (f64, f64)>>>,
    sampler: tokio::task::JoinHandle<()>,
    stop: Arc<tokio::sync::Notify>,
}

async fn pg_backends(pg: &sqlx::PgPool, db: &str) -> Vec<u32> {
    sqlx::query_scalar::<_, i32>(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name <> 'agentscope-bench' AND backend_type = 'client backend'",
    )
    .bind(db)
    .fetch_all(pg)
    .await
    .unwrap_or_default()
    .into_iter()
    .map(|p| p as u32)
    .collect()
}

impl Probe {
    /// Starts counting: the children's CPU now, and a sampler of the database's backends.
    pub async fn start(pg: &sqlx::PgPool, db: &str) -> Probe {
        let start = children()
            .into_iter()
            .filter_map(|(pid, name)| Some((pid, (name, proc_cpu(pid)?))))
            .collect();
        let pg_first: Arc<Mutex<HashMap<u32, (f64, f64)>>> = Arc::default();
        for pid in pg_backends(pg, db).await {
            if let Some(c) = proc_cpu(pid) {
                pg_first.lock().unwrap().insert(pid, (c, c));
            }
        }
        let stop = Arc::new(tokio::sync::Notify::new());
        let sampler = {
            let pg = pg.clone();
            let db = db.to_string();
            let map = pg_first.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                loop {
                    for pid in pg_backends(&pg, &db).await {
                        if let Some(c) = proc_cpu(pid) {
                            // A backend first seen mid-run: all its CPU is the run's.
                            map.lock()
                                .unwrap()
                                .entry(pid)
                                .and_modify(|e| e.1 = c)
                                .or_insert((0.0, c));
                        }
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                        _ = stop.notified() => return,
                    }
                }
            })
        };
        Probe {
            start,
            client: proc_cpu(std::process::id()).unwrap_or(0.0),
            pg_first,
            sampler,
            stop,
        }
    }

    /// Stops counting; CPU seconds per process kind (`nats-server`, `svc-gateway`,
    /// `svc-scheduler`, `svc-dataplane`, `svc-host`, `postgres`), and the benchmark's own as
    /// [`CLIENT`] (not the stack's).
    pub async fn stop(self) -> HashMap<String, f64> {
        self.stop.notify_one();
        let _ = self.sampler.await;
        let mut out: HashMap<String, f64> = HashMap::new();
        for (pid, name) in children() {
            let Some(now) = proc_cpu(pid) else { continue };
            let before = self.start.get(&pid).map(|s| s.1).unwrap_or(0.0);
            *out.entry(name).or_default() += now - before;
        }
        let map = self.pg_first.lock().unwrap().clone();
        let mut pg = 0.0;
        for (pid, (first, last)) in map {
            let now = proc_cpu(pid).unwrap_or(last).max(last);
            pg += now - first;
        }
        out.insert("postgres".into(), pg);
        out.insert(
            CLIENT.into(),
            proc_cpu(std::process::id()).unwrap_or(0.0) - self.client,
        );
        out
    }
}
