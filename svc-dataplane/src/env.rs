//! Environments: where a managed session's file and shell tools run (helper-owned).
//!
//! Two variants share one contract: every path a tool receives is relative to the session
//! directory (`root`) and is confined to it, and `shell` runs `sh -c` with cwd = root, exactly the
//! environment it is given (plus PATH/HOME/LANG), a wall-clock timeout that kills the whole
//! process tree, and stdout+stderr captured through a single pipe so they interleave as written.
//!
//! * [`Environment::Local`] runs directly on the dataplane's machine.
//! * [`Environment::Sandbox`] runs the shell under bubblewrap: read-only `/`, a private `/tmp` and
//!   `/run`, only `root` writable, no network, its own pid/ipc/uts namespaces, all capabilities
//!   dropped, a new session, and `--die-with-parent`. File tools run on the host with the same
//!   confinement as `Local` (the sandbox matters for arbitrary commands).

use std::ffi::OsStr;
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt as _;
use tokio::process::Command;

/// How long output is still drained after the shell has exited (or was killed) and its process
/// group has been killed. Only matters when something escaped the process group (e.g. `setsid`)
/// and still holds the output pipe open; normally the pipe reaches EOF immediately.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Exit status used by the limit prologue when a resource limit cannot be applied (fail closed).
const LIMIT_FAILED_EXIT: i32 = 125;

const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ToolError {
    /// Stable code + message the model and the API see: codes "path_escape", "not_found",
    /// "not_a_file", "too_large", "no_match", "ambiguous_match", "io", "timeout",
    /// "sandbox_unavailable".
    #[error("{code}: {message}")]
    Failed { code: &'static str, message: String },
}

impl ToolError {
    fn new(code: &'static str, message: impl Into<String>) -> ToolError {
        ToolError::Failed {
            code,
            message: message.into(),
        }
    }

    /// The stable code ("path_escape", "not_found", ...).
    pub fn code(&self) -> &'static str {
        match self {
            ToolError::Failed { code, .. } => code,
        }
    }
}

fn io_err(what: &str, e: std::io::Error) -> ToolError {
    ToolError::new("io", format!("{what}: {e}"))
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShellOutput {
    pub exit_code: Option<i32>,
    /// stdout+stderr interleaved as received, capped at `max_output` bytes on a char boundary
    /// with a "[truncated]" marker.
    pub output: String,
    pub timed_out: bool,
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub max_output: usize,
    /// Largest file read/written.
    pub max_file: usize,
    /// Address-space limit (`ulimit -v`) applied by the shell prologue (both variants).
    pub memory_bytes: Option<u64>,
    /// Process limit (`ulimit -u`/`-p`, i.e. RLIMIT_NPROC) applied inside the Sandbox only.
    /// Note: the kernel does not enforce RLIMIT_NPROC for real uid 0, so this has no effect
    /// when the dataplane runs as root.
    pub max_processes: Option<u32>,
}

/// Where tools run. `root` is the session directory; every path argument is relative to it.
#[derive(Debug, Clone)]
pub enum Environment {
    /// Directly in the session directory inside the dataplane process's machine.
    Local { root: PathBuf },
    /// bubblewrap: no network (--unshare-net), only `root` writable (the rest of / read-only, a
    /// private /tmp), its own pid namespace, dies with the parent, resource limits from Limits.
    Sandbox { root: PathBuf, bwrap: PathBuf },
}

impl Environment {
    pub fn root(&self) -> &Path {
        match self {
            Environment::Local { root } | Environment::Sandbox { root, .. } => root,
        }
    }

    pub async fn read_file(&self, path: &str, limits: &Limits) -> Result<String, ToolError> {
        let target = resolve(self.root(), path, false).await?;
        let bytes = read_limited(&target, path, limits).await?;
        // Binary or mis-encoded files are shown lossily rather than refused.
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Creates parent directories as needed.
    pub async fn write_file(
        &self,
        path: &str,
        content: &str,
        limits: &Limits,
    ) -> Result<(), ToolError> {
        if content.len() > limits.max_file {
            return Err(ToolError::new(
                "too_large",
                format!(
                    "{path}: content is {} bytes, the limit is {}",
                    content.len(),
                    limits.max_file
                ),
            ));
        }
        let target = resolve(self.root(), path, false).await?;
        write_resolved(&target, path, content).await
    }

    /// Replaces exactly one occurrence of `old` (no_match if none, ambiguous_match if several).
    pub async fn edit_file(
        &self,
        path: &str,
        old: &str,
        new: &str,
        limits: &Limits,
    ) -> Result<(), ToolError> {
        let target = resolve(self.root(), path, false).await?;
        let bytes = read_limited(&target, path, limits).await?;
        let text = String::from_utf8(bytes)
            .map_err(|_| ToolError::new("io", format!("{path}: file is not valid UTF-8 text")))?;
        if old.is_empty() {
            return Err(ToolError::new(
                "no_match",
                format!("{path}: the text to replace is empty"),
            ));
        }
        let mut matches = text.match_indices(old);
        let Some((at, _)) = matches.next() else {
            return Err(ToolError::new(
                "no_match",
                format!("{path}: the text to replace was not found"),
            ));
        };
        if matches.next().is_some() {
            let count = 2 + matches.count();
            return Err(ToolError::new(
                "ambiguous_match",
                format!(
                    "{path}: the text to replace occurs {count} times; include more context so it is unique"
                ),
            ));
        }
        let mut edited = String::with_capacity(text.len() - old.len() + new.len());
        edited.push_str(&text[..at]);
        edited.push_str(new);
        edited.push_str(&text[at + old.len()..]);
        if edited.len() > limits.max_file {
            return Err(ToolError::new(
                "too_large",
                format!(
                    "{path}: the edited file would be {} bytes, the limit is {}",
                    edited.len(),
                    limits.max_file
                ),
            ));
        }
        write_resolved(&target, path, &edited).await
    }

    /// Entries of a directory ("" or "." = root), sorted, directories suffixed with '/'.
    pub async fn list_files(&self, path: &str) -> Result<Vec<String>, ToolError> {
        let dir = resolve(self.root(), path, true).await?;
        let shown = if path.is_empty() { "." } else { path };
        match tokio::fs::metadata(&dir).await {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(ToolError::new("io", format!("{shown}: not a directory")));
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(ToolError::new(
                    "not_found",
                    format!("{shown}: no such directory"),
                ));
            }
            Err(e) => return Err(io_err(shown, e)),
        }
        let mut reader = tokio::fs::read_dir(&dir)
            .await
            .map_err(|e| io_err(shown, e))?;
        let mut entries = Vec::new();
        while let Some(entry) = reader.next_entry().await.map_err(|e| io_err(shown, e))? {
            let mut name = entry.file_name().to_string_lossy().into_owned();
            let is_dir = match entry.file_type().await {
                Ok(t) if t.is_dir() => true,
                Ok(t) if t.is_symlink() => tokio::fs::metadata(entry.path())
                    .await
                    .map(|m| m.is_dir())
                    .unwrap_or(false),
                _ => false,
            };
            if is_dir {
                name.push('/');
            }
            entries.push(name);
        }
        entries.sort();
        Ok(entries)
    }

    /// `sh -c command` with cwd = root and exactly the environment `env` (plus
    /// PATH=/usr/local/bin:/usr/bin:/bin, HOME=root, LANG=C.UTF-8; entries in `env` override
    /// these). The command runs in its own process group; when the shell exits or the timeout
    /// fires, the whole group is killed (so background processes do not outlive the call).
    pub async fn shell(
        &self,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
    ) -> Result<ShellOutput, ToolError> {
        let (mut cmd, home, sandboxed) = match self {
            Environment::Local { root } => {
                ensure_root_dir(root).await?;
                let mut cmd = Command::new("/bin/sh");
                cmd.args(shell_args(command, limits, false))
                    .current_dir(root);
                (cmd, root.clone(), false)
            }
            Environment::Sandbox { root, bwrap } => {
                match tokio::fs::metadata(bwrap).await {
                    Ok(m) if m.is_file() => {}
                    _ => {
                        return Err(ToolError::new(
                            "sandbox_unavailable",
                            format!("bubblewrap not found at {}", bwrap.display()),
                        ));
                    }
                }
                ensure_root_dir(root).await?;
                let root = tokio::fs::canonicalize(root)
                    .await
                    .map_err(|e| io_err("session directory", e))?;
                let mut cmd = Command::new(bwrap);
                cmd.args(bwrap_args(&root))
                    .arg("/bin/sh")
                    .args(shell_args(command, limits, true))
                    .current_dir(&root);
                (cmd, root, true)
            }
        };
        cmd.env_clear()
            .env("PATH", DEFAULT_PATH)
            .env("HOME", &home)
            .env("LANG", "C.UTF-8");
        for (k, v) in env {
            cmd.env(k, v);
        }
        run(cmd, limits, sandboxed).await
    }
}

async fn ensure_root_dir(root: &Path) -> Result<(), ToolError> {
    match tokio::fs::metadata(root).await {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(ToolError::new("io", "session directory is not a directory")),
        Err(e) => Err(io_err("session directory", e)),
    }
}

// ---------------------------------------------------------------------------------------------
// Path confinement
// ---------------------------------------------------------------------------------------------

/// Resolves `rel` under `root`: rejects absolute paths and `..`, and follows symlinks of the
/// existing components, rejecting any that lead outside root (or do not resolve at all). Returns
/// a path whose existing prefix is canonical and whose remaining components are plain names.
///
/// The check is done before the operation, so a concurrent process swapping a component for a
/// symlink between the check and the use is not covered (the Sandbox shell cannot reach outside
/// root anyway; in Local the shell can do anything the dataplane can).
async fn resolve(root: &Path, rel: &str, allow_root: bool) -> Result<PathBuf, ToolError> {
    let escape = |why: &str| ToolError::new("path_escape", format!("{rel}: {why}"));
    let mut parts: Vec<&OsStr> = Vec::new();
    for component in Path::new(rel).components() {
        match component {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(escape("'..' is not allowed in paths"));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(escape(
                    "absolute paths are not allowed; use a path relative to the session directory",
                ));
            }
        }
    }
    if parts.is_empty() && !allow_root {
        return Err(ToolError::new(
            "not_a_file",
            format!("'{rel}' names the session directory, not a file"),
        ));
    }
    let canon_root = tokio::fs::canonicalize(root)
        .await
        .map_err(|e| io_err("session directory", e))?;
    let mut current = canon_root.clone();
    let mut consumed = 0;
    for part in &parts {
        let next = current.join(part);
        match tokio::fs::symlink_metadata(&next).await {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = tokio::fs::canonicalize(&next).await.map_err(|_| {
                    escape("a symlink on this path does not resolve inside the session directory")
                })?;
                if !target.starts_with(&canon_root) {
                    return Err(escape(
                        "a symlink on this path leads outside the session directory",
                    ));
                }
                current = target;
            }
            Ok(_) => current = next,
            Err(e) if e.kind() == ErrorKind::NotFound => break,
            Err(e) if e.kind() == ErrorKind::NotADirectory => {
                return Err(ToolError::new(
                    "not_found",
                    format!("{rel}: a parent component is not a directory"),
                ));
            }
            Err(e) => return Err(io_err(rel, e)),
        }
        consumed += 1;
    }
    for part in &parts[consumed..] {
        current.push(part);
    }
    Ok(current)
}

async fn read_limited(target: &Path, shown: &str, limits: &Limits) -> Result<Vec<u8>, ToolError> {
    let meta = match tokio::fs::metadata(target).await {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound || e.kind() == ErrorKind::NotADirectory => {
            return Err(ToolError::new(
                "not_found",
                format!("{shown}: no such file"),
            ));
        }
        Err(e) => return Err(io_err(shown, e)),
    };
    if !meta.is_file() {
        return Err(ToolError::new(
            "not_a_file",
            format!("{shown}: not a regular file"),
        ));
    }
    let too_large = |len: u64| {
        ToolError::new(
            "too_large",
            format!(
                "{shown}: file is {len} bytes, the limit is {}",
                limits.max_file
            ),
        )
    };
    if meta.len() > limits.max_file as u64 {
        return Err(too_large(meta.len()));
    }
    let bytes = tokio::fs::read(target)
        .await
        .map_err(|e| io_err(shown, e))?;
    if bytes.len() > limits.max_file {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

async fn write_resolved(target: &Path, shown: &str, content: &str) -> Result<(), ToolError> {
    if let Ok(m) = tokio::fs::metadata(target).await
        && m.is_dir()
    {
        return Err(ToolError::new(
            "not_a_file",
            format!("{shown}: is a directory"),
        ));
    }
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io_err(shown, e))?;
    }
    tokio::fs::write(target, content)
        .await
        .map_err(|e| io_err(shown, e))
}

// ---------------------------------------------------------------------------------------------
// Shell
// ---------------------------------------------------------------------------------------------

/// `-c <script> [$0]` for /bin/sh. With limits, a prologue sets them (failing closed with exit
/// 125 when one cannot be applied) and then `exec`s a fresh `sh -c` on the command, passed as
/// `$0` so it is never re-quoted.
fn shell_args(command: &str, limits: &Limits, sandboxed: bool) -> Vec<String> {
    let mut prologue = String::new();
    if let Some(bytes) = limits.memory_bytes {
        let kib = (bytes / 1024).max(1);
        prologue.push_str(&format!(
            "ulimit -v {kib} || {{ echo 'environment: cannot apply the memory limit' >&2; exit {LIMIT_FAILED_EXIT}; }}; "
        ));
    }
    // RLIMIT_NPROC counts every process of the uid, so it is only applied inside the sandbox.
    // bash spells it -u, dash -p.
    if let (true, Some(n)) = (sandboxed, limits.max_processes) {
        prologue.push_str(&format!(
            "{{ ulimit -u {n} || ulimit -p {n}; }} 2>/dev/null || {{ echo 'environment: cannot apply the process limit' >&2; exit {LIMIT_FAILED_EXIT}; }}; "
        ));
    }
    if prologue.is_empty() {
        vec!["-c".to_owned(), command.to_owned()]
    } else {
        prologue.push_str("exec /bin/sh -c \"$0\"");
        vec!["-c".to_owned(), prologue, command.to_owned()]
    }
}

fn bwrap_args(root: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut push = |items: &[&OsStr]| args.extend(items.iter().map(|s| s.to_os_string()));
    push(&[
        "--ro-bind".as_ref(),
        "/".as_ref(),
        "/".as_ref(),
        "--dev".as_ref(),
        "/dev".as_ref(),
        "--proc".as_ref(),
        "/proc".as_ref(),
        // Order matters: the tmpfs mounts must come before binding root, which may live below them.
        "--tmpfs".as_ref(),
        "/tmp".as_ref(),
    ]);
    // Hide host sockets (e.g. a container runtime's) living under /run: a read-only bind does
    // not stop connect() on a unix socket.
    if Path::new("/run").is_dir() {
        push(&["--tmpfs".as_ref(), "/run".as_ref()]);
    }
    push(&[
        "--bind".as_ref(),
        root.as_os_str(),
        root.as_os_str(),
        "--unshare-net".as_ref(),
        "--unshare-pid".as_ref(),
        "--unshare-ipc".as_ref(),
        "--unshare-uts".as_ref(),
        "--die-with-parent".as_ref(),
        "--new-session".as_ref(),
        "--cap-drop".as_ref(),
        "ALL".as_ref(),
        "--chdir".as_ref(),
        root.as_os_str(),
        "--".as_ref(),
    ]);
    args
}

/// Kills a process group with SIGKILL. Without libc the signal is sent through the shell's
/// `kill` builtin (`kill -KILL -PGID`).
fn kill_group(pgid: u32) {
    // Never signal 0 (our own group) or 1 (`kill -1` = every process we may signal).
    if pgid <= 1 {
        return;
    }
    let result = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("kill -KILL -{pgid}"))
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = result {
        tracing::warn!(pgid, error = %e, "could not run kill for a shell tool's process group");
    }
}

/// Kills the process group when dropped while armed, so a cancelled `shell` future does not
/// leave the command running.
struct GroupGuard {
    pgid: u32,
    armed: bool,
}

impl GroupGuard {
    fn kill_now(&mut self) {
        if self.armed {
            self.armed = false;
            kill_group(self.pgid);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Output collected up to `max` bytes; the rest is read and discarded so writers never block.
struct Collector {
    buf: Vec<u8>,
    max: usize,
    truncated: bool,
}

impl Collector {
    fn push(&mut self, chunk: &[u8]) {
        let room = self.max.saturating_sub(self.buf.len());
        if chunk.len() > room {
            self.truncated = true;
        }
        self.buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    fn finish(mut self) -> String {
        if self.truncated
            && let Err(e) = std::str::from_utf8(&self.buf)
            && e.error_len().is_none()
        {
            // The cut fell inside a multi-byte character: drop its first bytes.
            self.buf.truncate(e.valid_up_to());
        }
        let mut text = String::from_utf8_lossy(&self.buf).into_owned();
        if text.len() > self.max {
            // Replacement characters can make the lossy text longer than the raw bytes.
            let mut cut = self.max;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            self.truncated = true;
        }
        if self.truncated {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str("[truncated]");
        }
        text
    }
}

async fn run(mut cmd: Command, limits: &Limits, sandboxed: bool) -> Result<ShellOutput, ToolError> {
    // One pipe for both stdout and stderr, so output interleaves exactly as it was written.
    let (reader, writer) = std::io::pipe().map_err(|e| io_err("create output pipe", e))?;
    let writer2 = writer
        .try_clone()
        .map_err(|e| io_err("create output pipe", e))?;
    cmd.stdin(Stdio::null())
        .stdout(writer)
        .stderr(writer2)
        .process_group(0)
        .kill_on_drop(true);
    let spawned = cmd.spawn();
    // The Command holds our copies of the pipe's write end; drop them so EOF can arrive.
    drop(cmd);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) if sandboxed && e.kind() == ErrorKind::NotFound => {
            return Err(ToolError::new(
                "sandbox_unavailable",
                format!("cannot start bubblewrap: {e}"),
            ));
        }
        Err(e) => return Err(io_err("start shell", e)),
    };
    let pgid = child
        .id()
        .ok_or_else(|| ToolError::new("io", "shell exited before it could be tracked"))?;
    let mut guard = GroupGuard { pgid, armed: true };
    let mut rx = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader))
        .map_err(|e| io_err("read shell output", e))?;

    let mut out = Collector {
        buf: Vec::new(),
        max: limits.max_output,
        truncated: false,
    };
    let mut chunk = vec![0u8; 16 * 1024];
    let mut eof = false;
    let deadline = tokio::time::Instant::now() + limits.timeout;
    let exited = loop {
        tokio::select! {
            read = rx.read(&mut chunk), if !eof => match read {
                Ok(0) => eof = true,
                Ok(n) => out.push(&chunk[..n]),
                Err(e) => {
                    tracing::warn!(error = %e, "reading shell output failed");
                    eof = true;
                }
            },
            status = child.wait() => break Some(status),
            _ = tokio::time::sleep_until(deadline) => break None,
        }
    };
    let timed_out = exited.is_none();

    // Kill whatever is left of the group: everything on timeout, background stragglers
    // otherwise. (In the Sandbox, bwrap's death also tears down its pid namespace.)
    guard.kill_now();
    let status = match exited {
        Some(status) => status,
        None => {
            let _ = child.start_kill();
            child.wait().await
        }
    }
    .map_err(|e| io_err("wait for shell", e))?;

    // Drain what is still in the pipe. EOF arrives once every process holding it has died.
    let grace = tokio::time::Instant::now() + DRAIN_GRACE;
    while !eof {
        tokio::select! {
            read = rx.read(&mut chunk) => match read {
                Ok(0) => eof = true,
                Ok(n) => out.push(&chunk[..n]),
                Err(e) => {
                    tracing::warn!(error = %e, "reading shell output failed");
                    eof = true;
                }
            },
            _ = tokio::time::sleep_until(grace) => {
                tracing::warn!("a process outside the shell's process group still holds its output open; not waiting for it");
                break;
            }
        }
    }

    let mut output = out.finish();
    if timed_out {
        if !output.is_empty() && !output.ends_with('\n') {
            output.push('\n');
        }
        output.push_str(&format!(
            "[timed out after {:.1}s; the command and its child processes were killed]",
            limits.timeout.as_secs_f64()
        ));
    }
    Ok(ShellOutput {
        exit_code: if timed_out { None } else { status.code() },
        output,
        timed_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const BWRAP: &str = "/usr/bin/bwrap";

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "svc-dataplane-env-{name}-{}-{nanos}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn unique(&self) -> String {
            self.0.file_name().unwrap().to_string_lossy().into_owned()
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn limits() -> Limits {
        Limits {
            timeout: Duration::from_secs(30),
            max_output: 64 * 1024,
            max_file: 1024 * 1024,
            memory_bytes: None,
            max_processes: None,
        }
    }

    fn local(dir: &TempDir) -> Environment {
        Environment::Local {
            root: dir.0.clone(),
        }
    }

    fn sandbox(dir: &TempDir) -> Environment {
        assert!(
            Path::new(BWRAP).is_file(),
            "bubblewrap is not installed at {BWRAP}; the Sandbox environment tests require it \
             (install the `bubblewrap` package; the project's setup scripts do)"
        );
        Environment::Sandbox {
            root: dir.0.clone(),
            bwrap: PathBuf::from(BWRAP),
        }
    }

    fn both(name: &str) -> Vec<(TempDir, Environment)> {
        let l = TempDir::new(&format!("{name}-local"));
        let s = TempDir::new(&format!("{name}-sandbox"));
        let (le, se) = (local(&l), sandbox(&s));
        vec![(l, le), (s, se)]
    }

    fn code<T: std::fmt::Debug>(r: Result<T, ToolError>) -> &'static str {
        r.expect_err("expected a ToolError").code()
    }

    #[tokio::test]
    async fn file_round_trip() {
        for (dir, env) in both("roundtrip") {
            let l = limits();
            env.write_file("a/b/c.txt", "hello world\n", &l)
                .await
                .unwrap();
            assert_eq!(
                env.read_file("a/b/c.txt", &l).await.unwrap(),
                "hello world\n"
            );
            assert_eq!(
                std::fs::read_to_string(dir.0.join("a/b/c.txt")).unwrap(),
                "hello world\n"
            );
            env.edit_file("a/b/c.txt", "world", "there", &l)
                .await
                .unwrap();
            assert_eq!(
                env.read_file("./a/b/c.txt", &l).await.unwrap(),
                "hello there\n"
            );
            env.write_file("top.txt", "x", &l).await.unwrap();
            assert_eq!(env.list_files("").await.unwrap(), vec!["a/", "top.txt"]);
            assert_eq!(env.list_files(".").await.unwrap(), vec!["a/", "top.txt"]);
            assert_eq!(env.list_files("a").await.unwrap(), vec!["b/"]);
            assert_eq!(env.list_files("a/b").await.unwrap(), vec!["c.txt"]);
            // Overwrite.
            env.write_file("top.txt", "y", &l).await.unwrap();
            assert_eq!(env.read_file("top.txt", &l).await.unwrap(), "y");
            // A symlink that stays inside root is fine.
            std::os::unix::fs::symlink(dir.0.join("a/b"), dir.0.join("inner")).unwrap();
            assert_eq!(
                env.read_file("inner/c.txt", &l).await.unwrap(),
                "hello there\n"
            );
            assert_eq!(
                env.list_files("").await.unwrap(),
                vec!["a/", "inner/", "top.txt"]
            );

            assert_eq!(code(env.read_file("missing.txt", &l).await), "not_found");
            assert_eq!(code(env.read_file("a", &l).await), "not_a_file");
            assert_eq!(code(env.read_file("", &l).await), "not_a_file");
            assert_eq!(code(env.write_file("a", "x", &l).await), "not_a_file");
            assert_eq!(code(env.list_files("nope").await), "not_found");

            let small = Limits {
                max_file: 4,
                ..limits()
            };
            assert_eq!(code(env.read_file("a/b/c.txt", &small).await), "too_large");
            assert_eq!(
                code(env.write_file("big", "12345", &small).await),
                "too_large"
            );
            assert!(!dir.0.join("big").exists());
        }
    }

    #[tokio::test]
    async fn path_escapes_are_rejected() {
        let outside = TempDir::new("escape-outside");
        for (dir, env) in both("escape") {
            let l = limits();
            for bad in ["../x", "/etc/passwd", "a/../../x", "a/../x", ".."] {
                assert_eq!(code(env.read_file(bad, &l).await), "path_escape", "{bad}");
                assert_eq!(
                    code(env.write_file(bad, "x", &l).await),
                    "path_escape",
                    "{bad}"
                );
                assert_eq!(
                    code(env.edit_file(bad, "a", "b", &l).await),
                    "path_escape",
                    "{bad}"
                );
                assert_eq!(code(env.list_files(bad).await), "path_escape", "{bad}");
            }
            std::os::unix::fs::symlink("/etc", dir.0.join("etc")).unwrap();
            assert_eq!(code(env.read_file("etc/passwd", &l).await), "path_escape");
            assert_eq!(code(env.list_files("etc").await), "path_escape");
            assert_eq!(code(env.write_file("etc/x", "x", &l).await), "path_escape");
            std::os::unix::fs::symlink("/etc/passwd", dir.0.join("pw")).unwrap();
            assert_eq!(code(env.read_file("pw", &l).await), "path_escape");
            assert_eq!(
                code(env.edit_file("pw", "root", "x", &l).await),
                "path_escape"
            );
            // A dangling symlink pointing outside must not be written through.
            let target = outside.0.join("created-through-symlink");
            std::os::unix::fs::symlink(&target, dir.0.join("out")).unwrap();
            assert_eq!(code(env.write_file("out", "x", &l).await), "path_escape");
            assert!(!target.exists());
            // A directory symlink to a sibling directory outside root.
            std::os::unix::fs::symlink(&outside.0, dir.0.join("sib")).unwrap();
            assert_eq!(
                code(env.write_file("sib/new/f", "x", &l).await),
                "path_escape"
            );
            assert!(!outside.0.join("new").exists());
        }
    }

    #[tokio::test]
    async fn edit_requires_exactly_one_match() {
        for (_dir, env) in both("edit") {
            let l = limits();
            env.write_file("f.txt", "one two two", &l).await.unwrap();
            assert_eq!(
                code(env.edit_file("f.txt", "three", "3", &l).await),
                "no_match"
            );
            assert_eq!(
                code(env.edit_file("f.txt", "two", "2", &l).await),
                "ambiguous_match"
            );
            assert_eq!(code(env.edit_file("f.txt", "", "2", &l).await), "no_match");
            assert_eq!(
                code(env.edit_file("nope.txt", "a", "b", &l).await),
                "not_found"
            );
            assert_eq!(env.read_file("f.txt", &l).await.unwrap(), "one two two");
            env.edit_file("f.txt", "one", "1", &l).await.unwrap();
            assert_eq!(env.read_file("f.txt", &l).await.unwrap(), "1 two two");
        }
    }

    #[tokio::test]
    async fn shell_output_and_exit_code() {
        for (dir, env) in both("shell") {
            let l = limits();
            let out = env
                .shell("echo out; echo err >&2; echo again; exit 3", &[], &l)
                .await
                .unwrap();
            assert_eq!(out.output, "out\nerr\nagain\n");
            assert_eq!(out.exit_code, Some(3));
            assert!(!out.timed_out);

            let out = env.shell("pwd; echo $HOME", &[], &l).await.unwrap();
            let root = std::fs::canonicalize(&dir.0).unwrap();
            let lines: Vec<&str> = out.output.lines().collect();
            assert_eq!(std::fs::canonicalize(lines[0]).unwrap(), root);
            assert_eq!(std::fs::canonicalize(lines[1]).unwrap(), root);
            assert_eq!(out.exit_code, Some(0));

            // The shell sees files written by the file tools and vice versa.
            env.write_file("in.txt", "from tool", &l).await.unwrap();
            let out = env
                .shell("cat in.txt; echo from shell > out.txt", &[], &l)
                .await
                .unwrap();
            assert_eq!(out.output, "from tool");
            assert_eq!(env.read_file("out.txt", &l).await.unwrap(), "from shell\n");
        }
    }

    #[tokio::test]
    async fn shell_output_is_capped_on_a_char_boundary() {
        for (_dir, env) in both("cap") {
            let l = Limits {
                max_output: 100,
                ..limits()
            };
            let out = env
                .shell("head -c 100000 /dev/zero | tr '\\0' x", &[], &l)
                .await
                .unwrap();
            assert_eq!(out.output, format!("{}\n[truncated]", "x".repeat(100)));
            assert_eq!(out.exit_code, Some(0));

            let l = Limits {
                max_output: 5,
                ..limits()
            };
            let out = env
                .shell(
                    "i=0; while [ $i -lt 50 ]; do printf '\\303\\251'; i=$((i+1)); done",
                    &[],
                    &l,
                )
                .await
                .unwrap();
            assert_eq!(out.output, "éé\n[truncated]");
        }
    }

    fn processes_with(marker: &str) -> Vec<String> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            if cmdline.contains(marker) {
                found.push(format!(
                    "{}: {cmdline}",
                    entry.file_name().to_string_lossy()
                ));
            }
        }
        found
    }

    #[tokio::test]
    async fn shell_timeout_kills_the_process_tree() {
        for (i, (_dir, env)) in both("timeout").into_iter().enumerate() {
            let marker = format!("1007{}{}", std::process::id() % 1000, i);
            let l = Limits {
                timeout: Duration::from_millis(1500),
                ..limits()
            };
            let started = std::time::Instant::now();
            let out = env
                .shell(
                    &format!(
                        "sleep {marker} & sleep {marker} & (sleep {marker}; echo never) & echo started; sleep {marker}"
                    ),
                    &[],
                    &l,
                )
                .await
                .unwrap();
            assert!(out.timed_out, "{out:?}");
            assert_eq!(out.exit_code, None);
            assert!(out.output.starts_with("started\n"), "{out:?}");
            assert!(out.output.contains("timed out"), "{out:?}");
            assert!(started.elapsed() < Duration::from_secs(20));
            let left = processes_with(&marker);
            assert!(left.is_empty(), "processes survived the timeout: {left:?}");
        }
    }

    #[tokio::test]
    async fn background_processes_do_not_outlive_the_call() {
        for (i, (_dir, env)) in both("background").into_iter().enumerate() {
            let marker = format!("1009{}{}", std::process::id() % 1000, i);
            let out = env
                .shell(&format!("sleep {marker} & echo bg"), &[], &limits())
                .await
                .unwrap();
            assert_eq!(out.output, "bg\n");
            assert_eq!(out.exit_code, Some(0));
            assert!(!out.timed_out);
            let left = processes_with(&marker);
            assert!(left.is_empty(), "background process survived: {left:?}");
        }
    }

    #[tokio::test]
    async fn shell_environment_is_exactly_what_is_given() {
        let host: Vec<(String, String)> = std::env::vars().collect();
        assert!(
            host.iter()
                .any(|(k, _)| !["PATH", "HOME", "LANG"].contains(&k.as_str())),
            "the test process should have some other environment variable"
        );
        for (dir, env) in both("env") {
            let given = vec![
                ("FOO".to_owned(), "bar baz".to_owned()),
                ("LANG".to_owned(), "C".to_owned()),
            ];
            let out = env.shell("env", &given, &limits()).await.unwrap();
            assert_eq!(out.exit_code, Some(0), "{out:?}");
            let seen: std::collections::BTreeMap<&str, &str> = out
                .output
                .lines()
                .filter_map(|line| line.split_once('='))
                .collect();
            assert_eq!(seen.get("FOO"), Some(&"bar baz"));
            assert_eq!(
                seen.get("LANG"),
                Some(&"C"),
                "given entries override defaults"
            );
            assert_eq!(seen.get("PATH"), Some(&DEFAULT_PATH));
            let home = std::fs::canonicalize(seen["HOME"]).unwrap();
            assert_eq!(home, std::fs::canonicalize(&dir.0).unwrap());
            // Only what the shell itself sets may appear besides the given variables.
            for name in seen.keys() {
                assert!(
                    ["FOO", "LANG", "PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_"].contains(name),
                    "unexpected variable {name} in {out:?}"
                );
            }
            for (k, _) in &host {
                if !["PATH", "HOME", "LANG", "PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str()) {
                    assert!(!seen.contains_key(k.as_str()), "{k} leaked into the shell");
                }
            }
        }
    }

    #[tokio::test]
    async fn sandbox_cannot_write_outside_root() {
        let dir = TempDir::new("sbx-write");
        let env = sandbox(&dir);
        let outside = std::env::temp_dir().join(format!("outside-{}", dir.unique()));
        let out = env
            .shell(
                &format!("echo x > {p} && cat {p}", p = outside.display()),
                &[],
                &limits(),
            )
            .await
            .unwrap();
        // The write lands in the sandbox's private /tmp, not on the host.
        assert_eq!(out.output, "x\n", "{out:?}");
        assert!(!outside.exists(), "sandbox wrote {}", outside.display());

        let marker = format!("etc-{}", dir.unique());
        let out = env
            .shell(&format!("echo x > /etc/{marker}"), &[], &limits())
            .await
            .unwrap();
        assert_ne!(out.exit_code, Some(0), "{out:?}");
        assert!(!Path::new("/etc").join(&marker).exists());

        // Root cannot remount its way out: capabilities are dropped.
        let out = env
            .shell(
                &format!("mount -o remount,rw / 2>&1; echo x > /etc/{marker}"),
                &[],
                &limits(),
            )
            .await
            .unwrap();
        assert_ne!(out.exit_code, Some(0), "{out:?}");
        assert!(!Path::new("/etc").join(&marker).exists());

        let out = env
            .shell(
                "mkdir -p sub && echo inside > sub/f && cat sub/f",
                &[],
                &limits(),
            )
            .await
            .unwrap();
        assert_eq!(out.output, "inside\n");
        assert_eq!(out.exit_code, Some(0));
        assert_eq!(
            std::fs::read_to_string(dir.0.join("sub/f")).unwrap(),
            "inside\n"
        );
    }

    #[tokio::test]
    async fn sandbox_has_no_network() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let probe = format!("bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}'");

        // Control: the probe does connect from a Local environment.
        let dir = TempDir::new("net-local");
        let out = local(&dir).shell(&probe, &[], &limits()).await.unwrap();
        assert_eq!(out.exit_code, Some(0), "control probe failed: {out:?}");
        let (conn, _) = listener.accept().expect("control connection was accepted");
        drop(conn);

        let dir = TempDir::new("net-sandbox");
        let out = sandbox(&dir).shell(&probe, &[], &limits()).await.unwrap();
        assert_ne!(
            out.exit_code,
            Some(0),
            "sandbox reached the network: {out:?}"
        );
        match listener.accept() {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            other => panic!("the listener saw a connection from the sandbox: {other:?}"),
        }
    }

    #[tokio::test]
    async fn memory_limit_makes_large_allocations_fail() {
        // dd allocates its whole block up front.
        let alloc = "dd if=/dev/zero of=/dev/null bs=256M count=1";
        for (_dir, env) in both("mem") {
            let out = env.shell(alloc, &[], &limits()).await.unwrap();
            assert_eq!(out.exit_code, Some(0), "control allocation failed: {out:?}");
            let l = Limits {
                memory_bytes: Some(64 * 1024 * 1024),
                ..limits()
            };
            let out = env.shell(alloc, &[], &l).await.unwrap();
            assert_ne!(out.exit_code, Some(0), "{out:?}");
            assert!(out.output.contains("memory exhausted"), "{out:?}");
            // Small commands still work under the limit.
            let out = env.shell("echo ok", &[], &l).await.unwrap();
            assert_eq!((out.exit_code, out.output.as_str()), (Some(0), "ok\n"));
        }
    }

    #[tokio::test]
    async fn sandbox_process_limit_is_applied() {
        let dir = TempDir::new("nproc");
        let l = Limits {
            max_processes: Some(64),
            ..limits()
        };
        let out = sandbox(&dir)
            .shell("ulimit -u 2>/dev/null || ulimit -p", &[], &l)
            .await
            .unwrap();
        assert_eq!(out.output, "64\n", "{out:?}");
        assert_eq!(out.exit_code, Some(0));
    }

    #[tokio::test]
    async fn sandbox_without_bwrap_is_unavailable() {
        let dir = TempDir::new("nobwrap");
        let env = Environment::Sandbox {
            root: dir.0.clone(),
            bwrap: dir.0.join("no-such-bwrap"),
        };
        assert_eq!(
            code(env.shell("echo hi", &[], &limits()).await),
            "sandbox_unavailable"
        );
    }
}
