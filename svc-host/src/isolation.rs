//! Isolation of hosted work from other tasks and from the host: one unprivileged identity per
//! attempt (uid and gid from a configured range, exclusive on the machine while the attempt's
//! processes live), the explicit environment allow-list of provider processes, the permissions of
//! the host's state and task directories, and redaction of credentials from recorded events.
//! Architecture invariant: a provider process never runs as root when the host is root, never
//! shares its uid with another running attempt, and never sees a variable outside the
//! allow-list.

use crate::provider::RunAs;
use agentscope_schemas::v1::execution_event::Body;
use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "no free uid in {first}-{last}: every one is held by a running attempt on this machine"
    )]
    Exhausted { first: u32, last: u32 },
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

// ------------------------------------------------------------------------------ uid range

/// The uids (and equal gids) attempts run under: `first-last`, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

/// Far above login users (1000-60000), systemd's dynamic and container ranges and the default
/// `/etc/subuid` allocations, below 2^31.
pub const DEFAULT_UID_RANGE: &str = "1900000000-1900004095";

impl UidRange {
    /// Parses `first-last`. System uids (< 1000), `nobody` (65534), 65535 and 2^32-1 are refused.
    pub fn parse(s: &str) -> Result<UidRange, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("run_as_uids must be `first-last`, not `{s}`"))?;
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("run_as_uids: `{}` is not a uid", t.trim()))
        };
        let r = UidRange {
            first: num(a)?,
            last: num(b)?,
        };
        if r.first > r.last {
            return Err(format!("run_as_uids: {} is above {}", r.first, r.last));
        }
        if r.first < 1000 {
            return Err("run_as_uids must start at 1000 or above (system users below)".into());
        }
        for reserved in [65534, 65535, u32::MAX] {
            if (r.first..=r.last).contains(&reserved) {
                return Err(format!("run_as_uids must not contain {reserved}"));
            }
        }
        Ok(r)
    }

    pub fn len(&self) -> u32 {
        self.last - self.first + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

// ------------------------------------------------------------------------- identities

/// Hands out uids of the range, each to one attempt at a time. A uid is held in this process
/// and by an exclusive `flock` on `lock_dir/<uid>`, so that hosts sharing the machine (and the
/// lock directory) never hand out the same uid together; a host that dies releases its locks.
pub struct Identities {
    pub range: UidRange,
    lock_dir: PathBuf,
    inner: Mutex<Inner>,
}

struct Inner {
    /// Offset of the next uid to try: uids are handed out round-robin, so a returned uid is
    /// reused as late as possible.
    next: u32,
    held: HashSet<u32>,
    /// Locks of uids whose processes could not be killed: never handed out again.
    quarantined: Vec<File>,
}

/// One attempt's identity, held until [`Identities::release`].
pub struct Lease {
    pub who: RunAs,
    lock: File,
}

impl Identities {
    pub fn open(range: UidRange, lock_dir: &Path, seed: u32) -> Result<Identities, Error> {
        std::fs::create_dir_all(lock_dir).map_err(io("create", lock_dir))?;
        std::fs::set_permissions(lock_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod", lock_dir))?;
        Ok(Identities {
            range,
            lock_dir: lock_dir.to_path_buf(),
            inner: Mutex::new(Inner {
                next: seed % range.len(),
                held: HashSet::new(),
                quarantined: Vec::new(),
            }),
        })
    }

    /// [`Identities::acquire`] without blocking, for the common case: the next free uid, when
    /// its last holder released it clean (nothing of it left to kill). None when that uid needs
    /// the scan for leftovers (`acquire` then takes it from there) or none is free.
    pub fn acquire_quick(&self) -> Result<Option<Lease>, Error> {
        self.quick(0)
    }

    /// [`Identities::acquire_quick`] passing over up to `pass` uids that need the scan for
    /// leftovers (hosts of this machine that died leave them so), which stay next for
    /// `acquire`: for work that can do without a uid (a directory prepared ahead).
    pub fn acquire_clean(&self, pass: usize) -> Result<Option<Lease>, Error> {
        self.quick(pass)
    }

    fn quick(&self, pass: usize) -> Result<Option<Lease>, Error> {
        let len = self.range.len();
        let mut inner = self.inner.lock().expect("identities");
        let mut unclean = None;
        let mut passed = 0;
        for _ in 0..len {
            let off = inner.next % len;
            inner.next = (off + 1) % len;
            let uid = self.range.first + off;
            if inner.held.contains(&uid) {
                continue;
            }
            let path = self.lock_dir.join(uid.to_string());
            let lock = open_lock(&path)?;
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            let mark = read_mark(&lock);
            if !(mark.is_empty() || mark == CLEAN) {
                // Unlocked as `lock` closes; the blocking path starts at the first such uid.
                let first = *unclean.get_or_insert(off);
                if passed == pass {
                    inner.next = first;
                    return Ok(None);
                }
                passed += 1;
                continue;
            }
            write_mark(&lock, HELD).map_err(io("mark", &path))?;
            inner.held.insert(uid);
            if let Some(first) = unclean {
                inner.next = first;
            }
            return Ok(Some(Lease {
                who: RunAs { uid, gid: uid },
                lock,
            }));
        }
        Ok(None)
    }

    /// A uid no running attempt on this machine holds. Leftover processes of a uid nobody holds
    /// (orphans of a host that died) are killed before it is handed out. Blocking.
    pub fn acquire(&self) -> Result<Lease, Error> {
        let len = self.range.len();
        let mut tried = 0;
        while tried < len {
            // Pick and lock a candidate under the mutex; look for leftovers outside it, so that
            // other attempts starting on this host do not wait on that scan.
            let (uid, lock) = {
                let mut inner = self.inner.lock().expect("identities");
                let mut found = None;
                while tried < len && found.is_none() {
                    let off = inner.next % len;
                    inner.next = (off + 1) % len;
                    tried += 1;
                    let uid = self.range.first + off;
                    if inner.held.contains(&uid) {
                        continue;
                    }
                    let path = self.lock_dir.join(uid.to_string());
                    let lock = open_lock(&path)?;
                    // SAFETY: flock on a descriptor we own.
                    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0
                    {
                        continue;
                    }
                    inner.held.insert(uid);
                    found = Some((uid, lock));
                }
                match found {
                    Some(f) => f,
                    None => break,
                }
            };
            // A uid its last holder released cleanly (every process gone, checked) has nothing
            // left to kill, nor has one nobody ever held (an empty lock file: the mark is
            // written before a uid is handed out); one whose holder died may have orphans.
            let mark = read_mark(&lock);
            let clean = mark.is_empty() || mark == CLEAN;
            let left = if clean {
                vec![]
            } else {
                kill_uid(uid, Duration::from_secs(5)).survivors
            };
            if !left.is_empty() {
                tracing::error!(
                    uid,
                    ?left,
                    "processes of a free uid survive SIGKILL; uid skipped"
                );
                // Keep it held (never handed out) and locked by this process.
                self.inner
                    .lock()
                    .expect("identities")
                    .quarantined
                    .push(lock);
                continue;
            }
            if let Err(e) = write_mark(&lock, HELD) {
                let path = self.lock_dir.join(uid.to_string());
                self.inner.lock().expect("identities").held.remove(&uid);
                return Err(io("mark", &path)(e));
            }
            return Ok(Lease {
                who: RunAs { uid, gid: uid },
                lock,
            });
        }
        Err(Error::Exhausted {
            first: self.range.first,
            last: self.range.last,
        })
    }

    /// Returns the lease's uid to the free set. `gone`: the attempt's sentinel saw every process
    /// of its tree end (nothing of the uid can be left: its processes cannot leave that tree).
    /// Otherwise whatever still runs under the uid is killed first (processes that left the
    /// process group and cleared the marker included), from a /proc scan. A uid whose processes
    /// survive is never handed out again. Blocking when not `gone`.
    pub fn release(&self, lease: Lease, gone: bool) -> Left {
        let left = if gone {
            Left::default()
        } else {
            kill_uid(lease.who.uid, Duration::from_secs(10))
        };
        let mut inner = self.inner.lock().expect("identities");
        if left.survivors.is_empty() {
            inner.held.remove(&lease.who.uid);
            let _ = write_mark(&lease.lock, CLEAN);
            drop(lease.lock);
        } else {
            tracing::error!(
                uid = lease.who.uid,
                survivors = ?left.survivors,
                "processes of an attempt survive SIGKILL; its uid is retired"
            );
            inner.quarantined.push(lease.lock);
        }
        left
    }
}

/// What killing a uid's processes found: how many it signalled, and which survived.
#[derive(Debug, Default)]
pub struct Left {
    pub killed: usize,
    pub survivors: Vec<i32>,
}

/// Live (not zombie) processes with `uid` as real, effective, saved or filesystem uid.
pub fn uid_processes(uid: u32) -> Vec<i32> {
    let me = std::process::id() as i32;
    crate::process::proc_pids()
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                return false;
            };
            let mut live = false;
            let mut ours = false;
            for line in status.lines() {
                if let Some(s) = line.strip_prefix("State:") {
                    live = !matches!(s.trim_start().chars().next(), Some('Z' | 'X'));
                } else if let Some(u) = line.strip_prefix("Uid:") {
                    ours = u.split_whitespace().any(|v| v.parse::<u32>() == Ok(uid));
                }
            }
            live && ours
        })
        .collect()
}

/// A uid's lock file, created if missing.
fn open_lock(path: &Path) -> Result<File, Error> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(io("open", path))
}

/// What a uid's lock file says of it: held by a running attempt, or released with every process
/// gone. Both are as long as the longest mark ever written (an earlier version wrote `held`
/// and truncated), so each covers the one before it without truncating the file. An empty file
/// was never held; anything else but `CLEAN` may have left processes.
const HELD: &[u8] = b"held\n";
const CLEAN: &[u8] = b"clean";

fn read_mark(lock: &File) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 16];
    let n = lock.read_at(&mut buf, 0).unwrap_or(0);
    buf[..n].to_vec()
}

fn write_mark(lock: &File, mark: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    lock.write_all_at(mark, 0)
}

/// SIGKILLs every process of `uid` until none is left or `within` passes.
pub fn kill_uid(uid: u32, within: Duration) -> Left {
    let deadline = Instant::now() + within;
    let mut killed = 0;
    loop {
        let left = uid_processes(uid);
        if left.is_empty() || Instant::now() >= deadline {
            return Left {
                killed,
                survivors: left,
            };
        }
        for pid in &left {
            // SAFETY: plain signal to a process of this uid.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        killed += left.len();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs in the forked child before exec (async-signal-safe calls only, no allocation):
/// supplementary groups cleared, then gid and uid (real, effective and saved) switched, a check
/// that root cannot be regained, no new privileges through set-uid binaries, umask 077.
pub fn drop_privileges(who: RunAs) -> std::io::Result<()> {
    let err = std::io::Error::last_os_error;
    // SAFETY: plain system calls on the calling (child) process.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(err());
        }
        if libc::setresgid(who.gid, who.gid, who.gid) != 0 {
            return Err(err());
        }
        if libc::setresuid(who.uid, who.uid, who.uid) != 0 {
            return Err(err());
        }
        if libc::setuid(0) == 0 || libc::getuid() != who.uid || libc::geteuid() != who.uid {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(err());
        }
        libc::umask(0o077);
    }
    Ok(())
}

// --------------------------------------------------------------------------- sentinel

/// The sentinel's program name.
pub const SENTINEL: &str = "agentscope-sentinel";

/// Exit status of the sentinel when its provider could not be executed (as a shell says it).
pub const EXEC_NOT_FOUND: i32 = 127;
pub const EXEC_FAILED: i32 = 126;

/// `agentscope-sentinel` (svc-host's `sentinel/main.rs`, built by its build.rs): static, without
/// libc, started once per attempt. [`publish_sentinel`] writes it where the host starts it from.
pub const SENTINEL_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/agentscope-sentinel"));

static SENTINEL_PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Writes the sentinel to `<state>/bin/agentscope-sentinel` (root's, 0755: every attempt's uid
/// may read it, none may change it) unless the same bytes are there, and starts every later
/// attempt's provider through it. The file is replaced by a rename, never rewritten in place:
/// a running sentinel keeps its own copy.
pub fn publish_sentinel(state_dir: &Path) -> std::io::Result<PathBuf> {
    let dir = state_dir.join("bin");
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    let dst = dir.join(SENTINEL);
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let current = std::fs::symlink_metadata(&dst).is_ok_and(|m| {
        m.is_file()
            && m.uid() == me
            && m.permissions().mode() & 0o7777 == 0o755
            && std::fs::read(&dst).is_ok_and(|b| b == SENTINEL_ELF)
    });
    if !current {
        use std::io::Write;
        let tmp = dir.join(format!(".{SENTINEL}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o755)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(SENTINEL_ELF)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        f.sync_all()?;
        // Closed before anything executes it (an open writer makes exec fail with ETXTBSY).
        drop(f);
        std::fs::rename(&tmp, &dst)?;
    }
    // It must run here (a `noexec` mount would fail every attempt later): without arguments it
    // prints its usage and exits 2.
    let run = || {
        std::process::Command::new(&dst)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
    };
    let mut ran = run();
    // A process forked meanwhile by another thread may still hold the written file open until
    // it executes (ETXTBSY): briefly.
    for _ in 0..50 {
        match &ran {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(Duration::from_millis(10));
                ran = run();
            }
            _ => break,
        }
    }
    match ran {
        Ok(st) if st.code() == Some(2) => {}
        Ok(st) => {
            return Err(std::io::Error::other(format!(
                "{} does not run as it should ({st})",
                dst.display()
            )));
        }
        Err(e) => {
            return Err(std::io::Error::new(
                e.kind(),
                format!(
                    "{} cannot be executed (a noexec mount?): {e}",
                    dst.display()
                ),
            ));
        }
    }
    let _ = SENTINEL_PATH.set(dst.clone());
    Ok(dst)
}

/// Where attempts' sentinels are started from: set by [`publish_sentinel`]. None before it ran
/// (never a bare name that a PATH lookup could resolve to another program).
pub fn sentinel_path() -> Option<&'static Path> {
    SENTINEL_PATH.get().map(PathBuf::as_path)
}

/// The sentinel's command line for one provider: `HOST_PID UID:GID|- -- PROGRAM ARGV0 ARGS...`
/// (PROGRAM is the path to execute, resolved by the host; ARGV0 and ARGS its argv).
pub fn sentinel_args(
    host_pid: u32,
    who: Option<RunAs>,
    program: &Path,
    argv: &[String],
) -> Vec<std::ffi::OsString> {
    let mut v: Vec<std::ffi::OsString> = vec![
        host_pid.to_string().into(),
        match who {
            Some(w) => format!("{}:{}", w.uid, w.gid).into(),
            None => "-".into(),
        },
        "--".into(),
        program.as_os_str().to_os_string(),
    ];
    v.extend(argv.iter().map(Into::into));
    v
}

/// Asks an attempt's sentinel (the leader of process group `pgid`) to end every process of the
/// attempt left once its provider is gone.
pub fn end_rest(sentinel: i32) {
    if sentinel > 0 {
        // SAFETY: a plain signal to our own child.
        unsafe {
            libc::kill(sentinel, libc::SIGUSR1);
        }
    }
}

/// The program `name` names for a provider whose PATH is `path`, resolved like `execvp`: a
/// name with a slash is taken as it is (relative to `cwd`), others are searched in PATH. None:
/// not found (or not executable).
///
/// A name found along a PATH of absolute directories is remembered for [`RESOLVED_FOR`]: within
/// that time the same name and PATH check only the file found (still there, a regular file,
/// executable) instead of every directory before it (ten or so `statx` per attempt on a usual
/// PATH). A program installed meanwhile in an earlier directory is found once that time has
/// passed (a shell's `hash` remembers until told to forget).
pub fn resolve_program(name: &str, path: &std::ffi::OsStr, cwd: &Path) -> Option<PathBuf> {
    if name.is_empty() {
        return None;
    }
    if name.contains('/') {
        let p = cwd.join(name);
        return executable(&p).then_some(p);
    }
    // A relative directory (or an empty entry, the working directory) depends on `cwd`.
    let absolute = std::env::split_paths(path).all(|d| d.is_absolute());
    if absolute && let Some(p) = RESOLVED.found(name, path, Instant::now()) {
        return Some(p);
    }
    let found = std::env::split_paths(path)
        .map(|d| {
            if d.as_os_str().is_empty() {
                cwd.join(name)
            } else {
                cwd.join(d).join(name)
            }
        })
        .find(|p| executable(p));
    if absolute && let Some(p) = &found {
        RESOLVED.keep(name, path, p, Instant::now());
    }
    found
}

fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// How long [`resolve_program`] trusts what it found along a PATH.
pub const RESOLVED_FOR: Duration = Duration::from_secs(1);

static RESOLVED: Resolved = Resolved(Mutex::new(Vec::new()));

/// Programs found along a PATH lately: name, PATH, the file, when it was found. A handful at most
/// (one per provider program); the oldest goes beyond [`Resolved::MAX`].
struct Resolved(Mutex<Vec<(String, std::ffi::OsString, PathBuf, Instant)>>);

impl Resolved {
    const MAX: usize = 16;

    /// The file found for `name` along `path` within [`RESOLVED_FOR`] before `now`, if it is
    /// still an executable file.
    fn found(&self, name: &str, path: &std::ffi::OsStr, now: Instant) -> Option<PathBuf> {
        let p = {
            let kept = self.0.lock().expect("resolved programs");
            let (.., p, at) = kept.iter().find(|(n, pa, ..)| n == name && pa == path)?;
            (now.saturating_duration_since(*at) < RESOLVED_FOR).then(|| p.clone())?
        };
        executable(&p).then_some(p)
    }

    fn keep(&self, name: &str, path: &std::ffi::OsStr, p: &Path, at: Instant) {
        let mut kept = self.0.lock().expect("resolved programs");
        kept.retain(|(n, pa, ..)| !(n == name && pa == path));
        if kept.len() >= Self::MAX {
            kept.remove(0);
        }
        kept.push((name.into(), path.into(), p.into(), at));
    }
}

// ------------------------------------------------------------------------- permissions

/// Makes the `agentscope` CLI next to svc-host reachable by every attempt's uid: a hard link
/// (a copy across file systems) in `<state>/bin`, which is world-traversable like the state
/// directory. `None` when there is no CLI next to svc-host (executors then get the plain path).
pub fn publish_cli(state_dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let Some(src) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("agentscope")))
        .filter(|p| p.is_file())
    else {
        return Ok(None);
    };
    let dir = state_dir.join("bin");
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    let dst = dir.join("agentscope");
    match std::fs::remove_file(&dst) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    if std::fs::hard_link(&src, &dst).is_err() {
        std::fs::copy(&src, &dst)?;
    }
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755))?;
    Ok(Some(dir))
}

/// The host's state: the state directory and the task directories' parent are traversable but
/// not listable by others (0711: a task reaches its own directory by its path and cannot find
/// the others'); the journal (assignments with task credentials) and the identity are the
/// host's only (0700 / 0600).
pub fn secure_state(state_dir: &Path, tasks_dir: &Path) -> Result<(), Error> {
    let set = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(io("chmod", p))
    };
    set(state_dir, 0o711)?;
    set(tasks_dir, 0o711)?;
    set(&state_dir.join("journal"), 0o700)?;
    let id = state_dir.join("host_id");
    if id.exists() {
        set(&id, 0o600)?;
    }
    Ok(())
}

/// Writes a file only its owner may read (credentials, configuration with the task token).
pub fn write_private(path: &Path, content: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)?;
    // An existing file (a resumed directory) keeps its inode: its mode is set again.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(content)
}

/// Creates a new file only its owner may read, with `content` (fails if it exists).
pub fn write_new_private(path: &Path, content: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)?
        .write_all(content)
}

/// Creates `dir` with mode 0700, its parents missing too; fails with `AlreadyExists` if it is
/// there.
pub fn create_private_dir_new(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create_private_dir(dir),
        r => r,
    }
}

/// Creates `dir` and its missing parents with mode 0700.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Gives the whole tree at `root` to `who` (symlinks themselves, never their targets). Regular
/// files with several links are left as they are: a hard link to a file outside the tree (a
/// local clone's objects, or a link an earlier attempt made) must not change that file's owner.
pub fn chown_tree(root: &Path, who: RunAs) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(root)?;
    if meta.is_file() && meta.nlink() > 1 {
        return Ok(());
    }
    std::os::unix::fs::lchown(root, Some(who.uid), Some(who.gid))?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(root)? {
            chown_tree(&entry?.path(), who)?;
        }
    }
    Ok(())
}

/// Gives an ended attempt's task directory back to the host: its root only. The root is 0700,
/// so nothing below it can be reached by the uid's next holder (every process of the uid is
/// gone by then, holding no descriptor into it).
pub fn take_back(root: &Path) -> std::io::Result<()> {
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    std::os::unix::fs::lchown(root, Some(uid), Some(gid))
}

// ------------------------------------------------------------------------- environment

/// Variables a provider process may receive, and nothing else (the host's own environment,
/// with its host token, NATS address and other settings, never reaches it):
/// - set by the platform for every provider: its HOME, TMPDIR, USER, LOGNAME, LANG, PATH and the
///   executor's variables (`AGENTSCOPE_API`, `AGENTSCOPE_TASK_TOKEN`, the task's ids and dirs);
/// - set by an adapter to a fixed value or a path in the task directory (telemetry and update
///   switches, `CODEX_HOME`, `PWD`, opencode's generated configuration);
/// - copied from the host's environment when set: [`HOST_ENV_PASSED`].
pub const PLATFORM_ENV: &[&str] = &[
    "HOME",
    "TMPDIR",
    "USER",
    "LOGNAME",
    "LANG",
    "PATH",
    "AGENTSCOPE_TASK_ID",
    "AGENTSCOPE_ATTEMPT_ID",
    "AGENTSCOPE_WORKSPACE_ID",
    "AGENTSCOPE_TASK_DIR",
    "AGENTSCOPE_INPUT_DIR",
    "AGENTSCOPE_API",
    "AGENTSCOPE_TASK_TOKEN",
];

/// Fixed switches and task-directory paths adapters set.
pub const ADAPTER_ENV: &[&str] = &[
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
    "DISABLE_TELEMETRY",
    "DISABLE_AUTOUPDATER",
    "DISABLE_ERROR_REPORTING",
    "ENABLE_TOOL_SEARCH",
    "CODEX_HOME",
    "PWD",
    "OPENCODE_DISABLE_MODELS_FETCH",
    "OPENCODE_DISABLE_AUTOUPDATE",
    "OPENCODE_CONFIG_CONTENT",
    "npm_config_registry",
    "OPENCLAW_NO_AUTO_UPDATE",
    "DO_NOT_TRACK",
];

/// The only variables copied from the host's own environment: the terminal and time zone, and
/// the model provider's credentials and endpoint the CLIs need.
pub const HOST_ENV_PASSED: &[&str] = &[
    "TERM",
    "TZ",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
];

/// Whether a provider may receive variable `name`.
pub fn env_allowed(name: &str) -> bool {
    PLATFORM_ENV.contains(&name) || ADAPTER_ENV.contains(&name) || HOST_ENV_PASSED.contains(&name)
}

/// Keeps the allowed variables of `env` (later entries win), and names the refused ones.
pub fn filter_env(env: Vec<(String, String)>) -> (Vec<(String, String)>, Vec<String>) {
    let mut kept: Vec<(String, String)> = Vec::new();
    let mut refused = Vec::new();
    for (k, v) in env {
        if !env_allowed(&k) {
            refused.push(k);
            continue;
        }
        kept.retain(|(n, _)| *n != k);
        kept.push((k, v));
    }
    (kept, refused)
}

/// USER and LOGNAME for a provider: a name derived from its uid (no passwd entry is needed), or
/// the host's own user's when it does not switch.
pub fn user_name(who: Option<RunAs>) -> String {
    match who {
        Some(w) => format!("agentscope-{}", w.uid),
        None => std::env::var("USER").unwrap_or_else(|_| "agentscope".into()),
    }
}

// --------------------------------------------------------------------------- redaction

/// The secrets kept out of one attempt's recorded events. Their matcher (one pass over a text for
/// every encoded form of every secret) takes a tenth of a millisecond to build, more than a
/// no-op attempt's events take to redact, so it is built only for a text that holds one of the
/// forms, or once the attempt's texts add up to [`CHECK_BYTES`]; until then each text is
/// searched for each form. A text that holds no form is left as it is either way, so the result
/// is the matcher's.
pub struct Secrets {
    values: Vec<(String, String)>,
    /// Every form the matcher looks for (`Redactor`'s needles): those of this attempt's own
    /// secrets, and those shared by every attempt (the host's own, made once).
    forms: Vec<memchr::memmem::Finder<'static>>,
    shared: &'static [memchr::memmem::Finder<'static>],
    /// The shortest form's length: a shorter text holds none.
    shortest: usize,
    redactor: std::sync::OnceLock<agentscope_domain::vault::Redactor>,
    /// Bytes searched form by form so far.
    checked: std::sync::atomic::AtomicUsize,
}

/// Bytes of an attempt's texts searched form by form before its matcher is built instead.
const CHECK_BYTES: usize = 16 << 10;

impl Secrets {
    pub fn new(values: Vec<(String, String)>) -> Secrets {
        let own = values.len();
        Secrets::with_shared(values, own, &[])
    }

    /// `values`: the first `own` of them this attempt's (their forms are made here), the rest
    /// those whose forms are `shared`.
    fn with_shared(
        values: Vec<(String, String)>,
        own: usize,
        shared: &'static [memchr::memmem::Finder<'static>],
    ) -> Secrets {
        let forms = forms_of(&values[..own]);
        let shortest = forms
            .iter()
            .chain(shared)
            .map(|f| f.needle().len())
            .min()
            .unwrap_or(0);
        Secrets {
            values,
            forms,
            shared,
            shortest,
            redactor: std::sync::OnceLock::new(),
            checked: Default::default(),
        }
    }

    /// The matcher, built on first use. One per attempt: quick to build (the default DFA took
    /// a tenth of the host's CPU per no-op attempt to build).
    fn redactor(&self) -> &agentscope_domain::vault::Redactor {
        self.redactor
            .get_or_init(|| agentscope_domain::vault::Redactor::new_quick(&self.values))
    }

    /// Whether the matcher must look at `text`: false only when no form is in it.
    fn may_hold(&self, text: &str) -> bool {
        use std::sync::atomic::Ordering;
        if (self.forms.is_empty() && self.shared.is_empty()) || text.len() < self.shortest {
            return false;
        }
        if self.redactor.get().is_some()
            || self.checked.fetch_add(text.len(), Ordering::Relaxed) + text.len() > CHECK_BYTES
        {
            return true;
        }
        self.forms
            .iter()
            .chain(self.shared)
            .any(|f| f.find(text.as_bytes()).is_some())
    }

    /// `text` with every form of every secret replaced by `[REDACTED:NAME]`.
    fn redact(&self, text: &str) -> String {
        if self.may_hold(text) {
            self.redactor().redact(text)
        } else {
            text.to_string()
        }
    }
}

/// Secrets kept out of recorded events: the attempt's task credential and the host's
/// credentials (the host token and the model keys passed to providers).
pub fn secrets_of_attempt(task_token: &str) -> Secrets {
    let host = host_secrets();
    let mut values = vec![("TASK_TOKEN".to_string(), task_token.to_string())];
    values.extend(host.values.iter().cloned());
    Secrets::with_shared(values, 1, &host.forms)
}

/// The host's own credentials, read once from its environment (which does not change while it
/// runs), with their forms made once.
struct HostSecrets {
    values: Vec<(String, String)>,
    forms: Vec<memchr::memmem::Finder<'static>>,
}

fn host_secrets() -> &'static HostSecrets {
    static HOST: std::sync::OnceLock<HostSecrets> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let mut values = Vec::new();
        for name in [
            "AGENTSCOPE_HOST_TOKEN",
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_AUTH_TOKEN",
            "OPENAI_API_KEY",
        ] {
            if let Ok(v) = std::env::var(name)
                && v.len() >= 8
            {
                values.push((name.to_string(), v));
            }
        }
        let forms = forms_of(&values);
        HostSecrets { values, forms }
    })
}

/// Every form of every secret the matcher looks for (`Redactor`'s needles, duplicates aside).
fn forms_of(values: &[(String, String)]) -> Vec<memchr::memmem::Finder<'static>> {
    values
        .iter()
        .filter(|(_, v)| v.len() >= agentscope_domain::vault::MIN_SECRET_LEN)
        .flat_map(|(_, v)| agentscope_domain::vault::encoded_forms(v.as_bytes()))
        .map(|f| memchr::memmem::Finder::new(&f).into_owned())
        .collect()
}

/// Shortest secret prefix removed from the end of a text (a line cut inside a secret).
const MIN_TAIL: usize = 8;

/// `text` with every secret replaced by `[REDACTED:NAME]` (the Vault's redaction), and a tail
/// that is the beginning of a secret (a line cut inside it) removed too.
pub fn redact_text(text: &str, secrets: &Secrets) -> String {
    let mut out = secrets.redact(text);
    for (name, value) in &secrets.values {
        let max = value.len().saturating_sub(1).min(out.len());
        for n in (MIN_TAIL..=max).rev() {
            if value.is_char_boundary(n) && out.ends_with(&value[..n]) {
                out.truncate(out.len() - n);
                out.push_str(&format!("[REDACTED:{name}]"));
                break;
            }
        }
    }
    out
}

/// Redacts every text field of an event.
pub fn redact_body(body: &mut Body, secrets: &Secrets) {
    let r = |s: &mut String| {
        if !s.is_empty() {
            *s = redact_text(s, secrets);
        }
    };
    match body {
        Body::Output(o) => {
            r(&mut o.stream);
            r(&mut o.text);
        }
        Body::Raw(x) => {
            r(&mut x.provider);
            r(&mut x.line);
        }
        Body::AssistantMessage(m) => r(&mut m.text),
        Body::ToolCall(t) => {
            r(&mut t.call_id);
            r(&mut t.name);
            r(&mut t.input_json);
        }
        Body::ToolResult(t) => {
            r(&mut t.call_id);
            r(&mut t.output);
        }
        Body::Result(x) => r(&mut x.text),
        Body::Error(e) => {
            r(&mut e.message);
            r(&mut e.code);
        }
        Body::Diagnostic(d) => {
            r(&mut d.level);
            r(&mut d.code);
            r(&mut d.message);
        }
        Body::Lifecycle(l) => {
            r(&mut l.detail);
            r(&mut l.failure_class);
        }
        Body::FileChange(f) => {
            r(&mut f.path);
            r(&mut f.change);
        }
        Body::ApprovalRequested(a) => {
            r(&mut a.request_id);
            r(&mut a.tool_name);
            r(&mut a.input_json);
        }
        Body::ApprovalDecided(d) => {
            r(&mut d.request_id);
            r(&mut d.reason);
            r(&mut d.decided_by);
            r(&mut d.failure_class);
        }
        Body::SessionStarted(s) => {
            r(&mut s.provider_session_id);
            r(&mut s.model);
        }
        Body::Usage(_) => {}
    }
}

/// The sentinel's command line, as the sentinel reads it (for the tests).
#[cfg(test)]
#[path = "../sentinel/args.rs"]
#[allow(dead_code)]
mod sentinel_cli;

#[cfg(test)]
mod tests {
    use super::*;
    use agentscope_schemas::v1::{Output, ToolResult};

    #[test]
    fn uid_ranges_are_parsed_and_unsafe_ones_refused() {
        assert_eq!(
            UidRange::parse(DEFAULT_UID_RANGE).unwrap(),
            UidRange {
                first: 1_900_000_000,
                last: 1_900_004_095
            }
        );
        assert_eq!(UidRange::parse(" 70000 - 70001 ").unwrap().len(), 2);
        for bad in [
            "",
            "70000",
            "a-b",
            "70001-70000",
            "0-100",
            "999-2000",
            "60000-70000",
            "4294967290-4294967295",
        ] {
            assert!(UidRange::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_sentinel_reads_back_the_command_line_the_host_writes() {
        use std::os::unix::ffi::OsStrExt;
        let parse =
            |args: &[std::ffi::OsString]| sentinel_cli::parse(args.len(), |i| args[i].as_bytes());
        let who = RunAs {
            uid: 1_900_000_007,
            gid: 1_900_000_008,
        };
        let argv = vec!["sh".to_string(), "-c".to_string(), "echo -- hi".to_string()];
        let args = sentinel_args(42, Some(who), Path::new("/bin/sh"), &argv);
        let a = parse(&args).unwrap();
        assert_eq!((a.host, a.who), (42, Some((who.uid, who.gid))));
        assert_eq!(args[3], "/bin/sh");
        assert_eq!(args[4..], ["sh", "-c", "echo -- hi"]);
        let a = parse(&sentinel_args(7, None, Path::new("/x"), &["x".into()])).unwrap();
        assert_eq!(a.who, None);
        for bad in [
            vec!["x", "-", "--", "/bin/true", "true"],
            vec!["0", "-", "--", "/bin/true", "true"],
            vec!["-1", "-", "--", "/bin/true", "true"],
            vec!["2147483648", "-", "--", "/bin/true", "true"],
            vec!["1", "1900000000", "--", "/bin/true", "true"],
            vec!["1", "1900000000:", "--", "/bin/true", "true"],
            vec!["1", "1900000000:+1", "--", "/bin/true", "true"],
            vec!["1", "4294967296:1", "--", "/bin/true", "true"],
            vec!["1", "-", "/bin/true", "true"],
            vec!["1", "-", "--", "/bin/true"],
        ] {
            let bad: Vec<std::ffi::OsString> = bad.into_iter().map(Into::into).collect();
            assert!(parse(&bad).is_err(), "{bad:?}");
        }
    }

    /// The sentinel svc-host carries: static, no dynamic loader, and it runs its provider as
    /// the host asks (status and signal mirrored, exec failures as a shell reports them, the
    /// attempt's identity when the host is root).
    #[test]
    fn the_sentinel_is_static_and_runs_its_provider() {
        let elf = SENTINEL_ELF;
        assert_eq!(&elf[..5], b"\x7fELF\x02", "a 64-bit ELF file");
        let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
        let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
        let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
        for i in 0..phnum {
            let h = phoff + i * phentsize;
            let kind = u32::from_le_bytes(elf[h..h + 4].try_into().unwrap());
            assert!(kind != 2 && kind != 3, "a PT_DYNAMIC or PT_INTERP header");
        }

        let state =
            std::env::temp_dir().join(format!("agentscope-sentinel-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&state).unwrap();
        let path = publish_sentinel(&state).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), SENTINEL_ELF);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755);
        // Published again: the same file, left as it is.
        let inode = std::fs::metadata(&path).unwrap().ino();
        assert_eq!(publish_sentinel(&state).unwrap(), path);
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode);

        let run = |who: Option<RunAs>, argv: &[&str]| {
            let argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
            let program = resolve_program(&argv[0], "/usr/bin:/bin".as_ref(), Path::new("/"))
                .unwrap_or_else(|| PathBuf::from(&argv[0]));
            std::process::Command::new(&path)
                .args(sentinel_args(std::process::id(), who, &program, &argv))
                .env_clear()
                .env("SEEN", "by the provider")
                .output()
                .unwrap()
        };
        use std::os::unix::process::ExitStatusExt;
        let out = run(
            None,
            &["sh", "-c", "echo \"$SEEN\" \"$@\"; exit 3", "sh", "a b"],
        );
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "by the provider a b\n"
        );
        let out = run(None, &["sh", "-c", "kill -TERM $$"]);
        assert_eq!(out.status.signal(), Some(libc::SIGTERM));
        let out = run(None, &["/nonexistent/provider"]);
        assert_eq!(out.status.code(), Some(EXEC_NOT_FOUND));
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            "agentscope-sentinel: cannot run `/nonexistent/provider`: No such file or directory\n"
        );
        let out = run(None, &[state.join("bin").to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(EXEC_FAILED), "{out:?}");
        // Its parent must be the host it names.
        let out = std::process::Command::new(&path)
            .args(sentinel_args(
                1,
                None,
                Path::new("/bin/true"),
                &["true".into()],
            ))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(137));
        let out = std::process::Command::new(&path).arg("x").output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("usage:"));

        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            // Outside every range an attempt is given (no host of another test holds it).
            let who = RunAs {
                uid: 1_899_990_017,
                gid: 1_899_990_018,
            };
            let out = run(
                Some(who),
                &[
                    "sh",
                    "-c",
                    "id -u; id -g; id -G; umask; grep NoNewPrivs /proc/self/status",
                ],
            );
            assert_eq!(out.status.code(), Some(0), "{out:?}");
            assert_eq!(
                String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .collect::<Vec<_>>(),
                [
                    "1899990017",
                    "1899990018",
                    "1899990018",
                    "0077",
                    "NoNewPrivs:",
                    "1"
                ]
            );
            // Its process was kept from its uid's reach until its `execve` (it shared the
            // sentinel's memory); the provider's own is its uid's again.
            let out = run(Some(who), &["stat", "-c", "%u", "/proc/self/environ"]);
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "1899990017\n",
                "{out:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&state);
    }

    #[test]
    fn programs_are_resolved_like_execvp() {
        let dir = std::env::temp_dir().join(format!("agentscope-path-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let tool = dir.join("bin/tool");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::write(dir.join("bin/plain"), "data").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path =
            std::env::join_paths(["/nonexistent", dir.join("bin").to_str().unwrap()]).unwrap();
        assert_eq!(
            resolve_program("tool", &path, Path::new("/")),
            Some(tool.clone())
        );
        assert_eq!(
            resolve_program("plain", &path, Path::new("/")),
            None,
            "not executable"
        );
        assert_eq!(resolve_program("missing", &path, Path::new("/")), None);
        assert_eq!(resolve_program("", &path, Path::new("/")), None);
        // A name with a slash is not searched, and is relative to the working directory.
        assert_eq!(
            resolve_program("bin/tool", &path, &dir),
            Some(dir.join("bin/tool"))
        );
        assert_eq!(resolve_program("./tool", &path, Path::new("/")), None);
        assert_eq!(
            resolve_program(tool.to_str().unwrap(), "".as_ref(), Path::new("/")),
            Some(tool)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_program_found_along_path_is_remembered_for_a_second_and_checked_each_time() {
        let dir = std::env::temp_dir().join(format!("agentscope-path-{}", uuid::Uuid::new_v4()));
        let (first, second) = (dir.join("first"), dir.join("second"));
        std::fs::create_dir_all(&first).unwrap();
        std::fs::create_dir_all(&second).unwrap();
        let put = |p: &Path| {
            std::fs::write(p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        let name = format!("tool-{}", uuid::Uuid::new_v4().simple());
        let path = std::env::join_paths([&first, &second]).unwrap();
        put(&second.join(&name));
        assert_eq!(
            resolve_program(&name, &path, Path::new("/")),
            Some(second.join(&name))
        );
        // Installed meanwhile in an earlier directory: the file found is still what the name
        // runs until the second has passed, then the earlier one is.
        put(&first.join(&name));
        let now = Instant::now();
        RESOLVED.keep(&name, &path, &second.join(&name), now);
        assert_eq!(RESOLVED.found(&name, &path, now), Some(second.join(&name)));
        assert_eq!(RESOLVED.found(&name, &path, now + RESOLVED_FOR), None);
        // The file found is checked on every use: gone, or not executable, it is not run.
        std::fs::remove_file(first.join(&name)).unwrap();
        std::fs::set_permissions(second.join(&name), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        assert_eq!(resolve_program(&name, &path, Path::new("/")), None);
        // A PATH with a relative directory depends on the working directory: never remembered.
        let relative = std::env::join_paths([Path::new("bin"), second.as_path()]).unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        put(&dir.join("bin").join(&name));
        assert_eq!(
            resolve_program(&name, &relative, &dir),
            Some(dir.join("bin").join(&name))
        );
        assert_eq!(RESOLVED.found(&name, &relative, Instant::now()), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_the_allow_list_reaches_a_provider() {
        let env = vec![
            ("HOME".to_string(), "/t/home".to_string()),
            (
                "AGENTSCOPE_HOST_TOKEN".to_string(),
                "agh_secret".to_string(),
            ),
            ("AGENTSCOPE_NATS_URL".to_string(), "nats://x".to_string()),
            (
                "AGENTSCOPE_DATABASE_URL".to_string(),
                "postgres://x".to_string(),
            ),
            ("LD_PRELOAD".to_string(), "/x.so".to_string()),
            ("OPENAI_API_KEY".to_string(), "sk".to_string()),
            ("HOME".to_string(), "/t/home2".to_string()),
        ];
        let (kept, refused) = filter_env(env);
        assert_eq!(
            kept,
            vec![
                ("OPENAI_API_KEY".to_string(), "sk".to_string()),
                ("HOME".to_string(), "/t/home2".to_string()),
            ]
        );
        assert_eq!(
            refused,
            [
                "AGENTSCOPE_HOST_TOKEN",
                "AGENTSCOPE_NATS_URL",
                "AGENTSCOPE_DATABASE_URL",
                "LD_PRELOAD"
            ]
        );
        for name in HOST_ENV_PASSED {
            assert!(!name.starts_with("AGENTSCOPE_"), "{name}");
        }
    }

    #[test]
    fn the_command_provider_env_is_inside_the_allow_list() {
        use crate::provider::{Adapter, LaunchCtx, TaskDir};
        use crate::providers::command::CommandProvider;
        let dir = TaskDir {
            root: "/t".into(),
            repo: None,
            input_dir: "/t/input".into(),
            home: "/t/home".into(),
            tmp: "/t/tmp".into(),
        };
        let spec = crate::attempt::Spec {
            command: vec!["env".into()],
            ..Default::default()
        };
        let ctx = LaunchCtx {
            spec: &spec,
            dir: &dir,
            attempt_id: "a",
            api_url: "http://x",
            task_token: "agt_x",
            cli: std::path::Path::new("/bin/agentscope"),
        };
        let launch = CommandProvider.launch(&ctx).unwrap();
        let (_, refused) = filter_env(launch.env);
        assert!(refused.is_empty(), "{refused:?}");
    }

    #[test]
    fn the_task_token_is_redacted_from_every_text_field_and_from_a_cut_tail() {
        let token = "agt_0123456789abcdefghijklmnopqrstuvwxyz";
        let secrets = Secrets::new(vec![("TASK_TOKEN".to_string(), token.to_string())]);
        let mut out = Body::Output(Output {
            stream: "stdout".into(),
            text: format!("AGENTSCOPE_TASK_TOKEN={token} and again {token}"),
            truncated: false,
        });
        redact_body(&mut out, &secrets);
        let Body::Output(o) = out else { panic!() };
        assert_eq!(
            o.text,
            "AGENTSCOPE_TASK_TOKEN=[REDACTED:TASK_TOKEN] and again [REDACTED:TASK_TOKEN]"
        );
        let mut res = Body::ToolResult(ToolResult {
            call_id: "c".into(),
            output: format!("cut here: {}", &token[..20]),
            is_error: false,
        });
        redact_body(&mut res, &secrets);
        let Body::ToolResult(t) = res else { panic!() };
        assert_eq!(t.output, "cut here: [REDACTED:TASK_TOKEN]");
        // Short prefixes and ordinary text stay.
        assert_eq!(
            redact_text("agt_ is a prefix", &secrets),
            "agt_ is a prefix"
        );
        assert_eq!(redact_text("ends agt_012", &secrets), "ends agt_012");
    }

    #[test]
    fn secrets_are_redacted_as_the_matcher_does_whether_or_not_it_was_built() {
        let token = "agt_0123456789abcdefghijklmnopqrstuvwxyz";
        let values = vec![
            ("TASK_TOKEN".to_string(), token.to_string()),
            ("HOST".to_string(), "agh_host secret/+?".to_string()),
        ];
        let matcher = agentscope_domain::vault::Redactor::new_quick(&values);
        let secrets = Secrets::new(values.clone());
        let plain = ["preparing task directory", "exit status 0", "", "agt_012"];
        for text in plain {
            assert_eq!(redact_text(text, &secrets), matcher.redact(text));
        }
        assert!(
            secrets.redactor.get().is_none(),
            "built for texts without a secret"
        );
        let forms = agentscope_domain::vault::encoded_forms(token.as_bytes());
        for form in &forms {
            let text = format!("before {} after", String::from_utf8_lossy(form));
            assert_eq!(
                redact_text(&text, &Secrets::new(values.clone())),
                matcher.redact(&text)
            );
            assert!(!redact_text(&text, &Secrets::new(values.clone())).contains(token));
        }
        // Past CHECK_BYTES the matcher is built and used for every text.
        let long = "x".repeat(CHECK_BYTES + 1);
        assert_eq!(redact_text(&long, &secrets), long);
        assert!(secrets.redactor.get().is_some());
        let text = format!("later {token}");
        assert_eq!(redact_text(&text, &secrets), matcher.redact(&text));
        // The host's secrets' forms made once and shared by attempts.
        let shared: &'static [memchr::memmem::Finder<'static>] =
            Box::leak(forms_of(&values[1..]).into_boxed_slice());
        for form in agentscope_domain::vault::encoded_forms(b"agh_host secret/+?") {
            let text = format!("host {} secret", String::from_utf8_lossy(&form));
            let shared = Secrets::with_shared(values.clone(), 1, shared);
            assert_eq!(redact_text(&text, &shared), matcher.redact(&text));
            assert!(
                redact_text(&text, &shared).contains("[REDACTED:HOST]"),
                "{text}"
            );
        }
    }

    #[test]
    fn chown_leaves_hard_linked_files_alone() {
        let dir = std::env::temp_dir().join(format!("agentscope-iso-{}", uuid::Uuid::new_v4()));
        create_private_dir(&dir.join("sub")).unwrap();
        write_private(&dir.join("sub/own.txt"), b"x").unwrap();
        let outside = std::env::temp_dir().join(format!("agentscope-out-{}", uuid::Uuid::new_v4()));
        std::fs::write(&outside, b"y").unwrap();
        std::fs::hard_link(&outside, dir.join("link")).unwrap();
        let before = std::fs::metadata(&outside).unwrap().uid();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let who = RunAs {
                uid: 1_900_009_999,
                gid: 1_900_009_999,
            };
            chown_tree(&dir, who).unwrap();
            assert_eq!(
                std::fs::metadata(dir.join("sub/own.txt")).unwrap().uid(),
                who.uid
            );
            assert_eq!(std::fs::metadata(&outside).unwrap().uid(), before);
        }
        assert_eq!(
            std::fs::metadata(dir.join("sub/own.txt")).unwrap().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(dir.join("sub")).unwrap().mode() & 0o777,
            0o700
        );
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_file(&outside).unwrap();
    }

    #[test]
    fn two_hosts_sharing_the_lock_dir_never_hand_out_one_uid_twice() {
        let dir = std::env::temp_dir().join(format!("agentscope-locks-{}", uuid::Uuid::new_v4()));
        let range = UidRange {
            first: 1_900_009_000,
            last: 1_900_009_002,
        };
        // Both start at the same uid.
        let h1 = Identities::open(range, &dir, 0).unwrap();
        let h2 = Identities::open(range, &dir, 0).unwrap();
        let a = h1.acquire().unwrap();
        let b = h2.acquire().unwrap();
        let c = h1.acquire().unwrap();
        let mut uids = vec![a.who.uid, b.who.uid, c.who.uid];
        uids.sort();
        assert_eq!(uids, [1_900_009_000, 1_900_009_001, 1_900_009_002]);
        assert!(matches!(h2.acquire(), Err(Error::Exhausted { .. })));
        let freed = b.who.uid;
        assert!(h2.release(b, false).survivors.is_empty());
        assert_eq!(
            h1.acquire().unwrap().who.uid,
            freed,
            "a released uid is free again"
        );
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_uid_left_held_is_taken_only_after_the_scan_for_its_leftovers() {
        let dir = std::env::temp_dir().join(format!("agentscope-locks-{}", uuid::Uuid::new_v4()));
        let range = UidRange {
            first: 1_900_009_100,
            last: 1_900_009_101,
        };
        std::fs::create_dir_all(&dir).unwrap();
        // A host that died holding it (the earlier, shorter mark).
        std::fs::write(dir.join("1900009100"), b"held").unwrap();
        let ids = Identities::open(range, &dir, 0).unwrap();
        assert!(
            ids.acquire_quick().unwrap().is_none(),
            "no scan on the quick path"
        );
        let a = ids.acquire().unwrap();
        assert_eq!(
            a.who.uid, 1_900_009_100,
            "the blocking path starts at that uid"
        );
        assert_eq!(std::fs::read(dir.join("1900009100")).unwrap(), HELD);
        assert!(ids.release(a, true).survivors.is_empty());
        assert_eq!(std::fs::read(dir.join("1900009100")).unwrap(), CLEAN);
        // A uid never held is taken at once, and marked held.
        let b = ids.acquire_quick().unwrap().expect("a clean uid");
        assert_eq!(b.who.uid, 1_900_009_101);
        assert_eq!(std::fs::read(dir.join("1900009101")).unwrap(), HELD);
        let c = ids.acquire_quick().unwrap().expect("released clean");
        assert_eq!(c.who.uid, 1_900_009_100);
        assert!(ids.acquire_quick().unwrap().is_none(), "none free");
        assert!(matches!(ids.acquire(), Err(Error::Exhausted { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clean_uid_is_taken_past_ones_left_held_which_stay_next_for_the_scan() {
        let dir = std::env::temp_dir().join(format!("agentscope-locks-{}", uuid::Uuid::new_v4()));
        let range = UidRange {
            first: 1_900_009_200,
            last: 1_900_009_203,
        };
        std::fs::create_dir_all(&dir).unwrap();
        for uid in ["1900009200", "1900009201"] {
            std::fs::write(dir.join(uid), b"held").unwrap();
        }
        let ids = Identities::open(range, &dir, 0).unwrap();
        assert!(
            ids.acquire_clean(1).unwrap().is_none(),
            "two left held, one may be passed"
        );
        let a = ids.acquire_clean(2).unwrap().expect("past two left held");
        assert_eq!(a.who.uid, 1_900_009_202);
        // Those left held are still unmarked and come next, for the blocking path's scan.
        assert_eq!(std::fs::read(dir.join("1900009200")).unwrap(), b"held");
        assert!(ids.acquire_quick().unwrap().is_none());
        let b = ids.acquire().unwrap();
        assert_eq!(b.who.uid, 1_900_009_200);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_provider_process_runs_without_groups_or_a_way_back_to_root() {
        use std::os::unix::process::CommandExt;
        let who = RunAs {
            uid: 1_900_009_500,
            gid: 1_900_009_500,
        };
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args([
            "-c",
            "id -u; id -G; grep NoNewPrivs /proc/self/status; umask",
        ])
        .env_clear()
        .env("PATH", "/usr/bin:/bin");
        // SAFETY: drop_privileges makes only async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || drop_privileges(who));
        }
        let out = cmd.output();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(out.is_err(), "only root can switch");
            return;
        }
        let out = out.unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        assert_eq!(
            lines,
            ["1900009500", "1900009500", "NoNewPrivs:\t1", "0077"],
            "{text}"
        );
    }
}
