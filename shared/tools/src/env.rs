//! Environments: where a managed session's file and shell tools run (helper-owned), in the
//! dataplane and in a self-hosted Worker alike.
//!
//! Every variant shares one contract: every path a tool receives is relative to the session
//! directory (`root`) and is confined to it, and `shell` runs `sh -c` with cwd = root, exactly the
//! environment it is given (plus PATH/HOME/LANG), a wall-clock timeout that kills the whole
//! process tree, and stdout+stderr captured through a single pipe so they interleave as written.
//!
//! Identity: each session has its own unprivileged uid/gid ([`Identity`], allocated from the
//! configured range by [`prepare_session_dir`]). The session directory is 0700 and owned by it,
//! the sessions root 0711. Tool code never runs as root: the shell (and bubblewrap) is started
//! under the session's uid with its limits set by `setrlimit` in the child before `exec` (or a
//! cgroup v2 when one is delegated), and file tools do their I/O on a thread whose filesystem
//! uid/gid is the session's, resolving paths with `openat2(RESOLVE_BENEATH)` so no symlink (and
//! no race swapping one in) leads them out of the session directory.
//!
//! * [`Environment::Local`] runs directly on the dataplane's machine (a trusted single-user
//!   install; refused unless the deployment enables it). A plain program call (`cargo test -q`,
//!   an absolute path with arguments: no quoting, expansion, operator or builtin) is started
//!   without `sh -c` when `/bin/sh` is dash, with exactly sh's result (environment, exit codes,
//!   messages): it saves the shell's start-up, about half a millisecond, on every call.
//! * [`Environment::Sandbox`] runs the shell under bubblewrap: no bind of `/`, a minimal
//!   read-only root (toolchain directories, TLS certificates, a generated `/etc/passwd` and
//!   `/etc/group` naming only the sandbox user), the session directory as the only writable path
//!   plus a private `/tmp`, new user/pid/ipc/uts/net/cgroup namespaces, its own `/proc`, a minimal
//!   `/dev`, the session's uid inside, all capabilities dropped, a new session, and
//!   `--die-with-parent`.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::io::{ErrorKind, Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt as _;

use crate::spawn::{self, ChildSetup};

/// How long output is still drained after the shell has exited (or was killed) and its process
/// group has been killed. Only matters when something escaped the process group (e.g. `setsid`)
/// and still holds the output pipe open; normally the pipe reaches EOF immediately.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The variables a tool's shell gets besides the Vault-injected ones (the allow-list): nothing
/// of the dataplane's own environment is ever passed on.
pub const SHELL_ENV_ALLOW_LIST: [&str; 3] = ["PATH", "HOME", "LANG"];

/// cpu.max of a session's cgroup: one CPU.
const CGROUP_CPU_MAX: &str = "100000 100000";

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

fn unavailable(message: impl Into<String>) -> ToolError {
    ToolError::new("sandbox_unavailable", message)
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
    /// RLIMIT_AS of the shell (or memory.max of its cgroup), set in the child before exec.
    pub memory_bytes: Option<u64>,
    /// RLIMIT_NPROC (or pids.max of the cgroup). RLIMIT_NPROC counts every process of the uid,
    /// so it is applied only when the shell runs under a session's own uid.
    pub max_processes: Option<u32>,
    /// RLIMIT_CPU: CPU seconds of each process.
    pub cpu_secs: Option<u64>,
}

/// A session's own unprivileged identity (uid, gid), from the configured range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// The configured range of session uids, inclusive (`AGENTSCOPE_SESSION_UIDS=first-last`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

impl UidRange {
    pub fn parse(s: &str) -> Result<UidRange, String> {
        let bad = || format!("session_uids must be `first-last` (e.g. 700000-765535), not `{s}`");
        let (a, b) = s.trim().split_once('-').ok_or_else(bad)?;
        let first: u32 = a.trim().parse().map_err(|_| bad())?;
        let last: u32 = b.trim().parse().map_err(|_| bad())?;
        if first < 1000 {
            return Err(format!(
                "session_uids must start at 1000 or above, away from system users, not {first}"
            ));
        }
        if last < first || (first..=last).contains(&65_534) {
            return Err(format!(
                "session_uids `{s}` is empty or contains nobody (65534)"
            ));
        }
        if last >= u32::MAX - 1 {
            return Err(format!("session_uids `{s}` reaches the reserved uid -1"));
        }
        Ok(UidRange { first, last })
    }

    pub fn len(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

/// How the session limits are enforced on this machine (decided once at start-up).
#[derive(Debug, Clone, PartialEq)]
pub enum LimitMode {
    /// A delegated, writable cgroup v2 directory: each shell call gets a child cgroup with
    /// pids.max, memory.max and cpu.max.
    Cgroup(PathBuf),
    /// setrlimit in the child (RLIMIT_NPROC, RLIMIT_AS, RLIMIT_CPU) of the non-root session uid.
    Rlimits,
}

/// What the bubblewrap sandbox needs besides the session directory.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub bwrap: PathBuf,
    /// Where the generated `/etc/passwd` and `/etc/group` of each session uid are written
    /// (root-owned, readable).
    pub etc_dir: PathBuf,
    /// Extra read-only directories (configured) besides the toolchain directories.
    pub extra_ro: Vec<PathBuf>,
    pub limit_mode: LimitMode,
}

/// Where tools run. `root` is the session directory; every path argument is relative to it.
/// `identity` is the session's own uid/gid; `None` runs as this process's own user, which is
/// refused for the sandbox when that user is root (the dataplane always gives one).
#[derive(Debug, Clone)]
pub enum Environment {
    /// Directly in the session directory on the dataplane's machine.
    Local {
        root: PathBuf,
        identity: Option<Identity>,
    },
    /// bubblewrap: see the module documentation.
    Sandbox {
        root: PathBuf,
        identity: Option<Identity>,
        spec: Arc<SandboxSpec>,
    },
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn current_identity() -> Identity {
    // SAFETY: getuid/getgid have no preconditions and cannot fail.
    unsafe {
        Identity {
            uid: libc::getuid(),
            gid: libc::getgid(),
        }
    }
}

impl Environment {
    pub fn root(&self) -> &Path {
        match self {
            Environment::Local { root, .. } | Environment::Sandbox { root, .. } => root,
        }
    }

    fn identity(&self) -> Option<Identity> {
        match self {
            Environment::Local { identity, .. } | Environment::Sandbox { identity, .. } => {
                *identity
            }
        }
    }

    /// Runs `f` on a fresh thread whose filesystem identity is the session's (when this process
    /// is root): permission checks are the session uid's and created files are its own.
    async fn as_session<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Path) -> Result<T, ToolError> + Send + 'static,
    ) -> Result<T, ToolError> {
        let identity = self.identity();
        let root = self.root().to_path_buf();
        if identity.is_none() && is_root() && matches!(self, Environment::Sandbox { .. }) {
            return Err(unavailable(
                "the sandbox has no session identity and never runs tools as root",
            ));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("session-file-tool".into())
            .spawn(move || {
                let r = switch_thread_fs_identity(identity).and_then(|()| f(&root));
                let _ = tx.send(r);
            })
            .map_err(|e| io_err("start a file tool thread", e))?;
        rx.await
            .map_err(|_| ToolError::new("io", "the file tool thread failed"))?
    }

    pub async fn read_file(&self, path: &str, limits: &Limits) -> Result<String, ToolError> {
        let (path, max) = (path.to_owned(), limits.max_file);
        let bytes = self
            .as_session(move |root| read_sync(root, &path, max))
            .await?;
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
        let (path, content) = (path.to_owned(), content.as_bytes().to_vec());
        self.as_session(move |root| write_sync(root, &path, &content))
            .await
    }

    /// Replaces exactly one occurrence of `old` (no_match if none, ambiguous_match if several).
    pub async fn edit_file(
        &self,
        path: &str,
        old: &str,
        new: &str,
        limits: &Limits,
    ) -> Result<(), ToolError> {
        let (p, max) = (path.to_owned(), limits.max_file);
        let bytes = self
            .as_session(move |root| read_sync(root, &p, max))
            .await?;
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
        let p = path.to_owned();
        self.as_session(move |root| write_sync(root, &p, edited.as_bytes()))
            .await
    }

    /// Entries of a directory ("" or "." = root), sorted, directories suffixed with '/'.
    pub async fn list_files(&self, path: &str) -> Result<Vec<String>, ToolError> {
        let path = path.to_owned();
        self.as_session(move |root| list_sync(root, &path)).await
    }

    /// `sh -c command` with cwd = root and exactly the environment `env` (plus
    /// PATH=/usr/local/bin:/usr/bin:/bin, HOME=root, LANG=C.UTF-8; entries in `env` override
    /// these), under the session's uid. The command runs in its own process group; when the
    /// shell exits or the timeout fires, the whole group is killed (so background processes do
    /// not outlive the call).
    ///
    /// In the Local environment a plain program call (see [`plain_program_call`]) is started
    /// without the shell, with the same result as sh's (see [`direct_program`]).
    pub async fn shell(
        &self,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
    ) -> Result<ShellOutput, ToolError> {
        self.shell_after(command, env, limits, None).await
    }

    /// [`Environment::shell`] once `gate` (if any) opens: everything before the program's
    /// `execve` (checks, the program's lookup, in Local its process, held before its identity
    /// change) is done
    /// meanwhile. A gate that stays shut fails the call with `not_started`, and nothing of the
    /// command has run.
    pub async fn shell_after(
        &self,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
        gate: Option<Gate>,
    ) -> Result<ShellOutput, ToolError> {
        self.shell_routed(command, env, limits, true, gate)
            .await
            .map(|(out, _)| out)
    }

    /// [`Environment::shell`], saying how the command was started; `allow_direct: false`
    /// always starts `sh -c`.
    ///
    /// In the Sandbox, the processes of the session's previous command may still be on their
    /// way out when this one starts: bubblewrap reports the command's end as soon as its own
    /// process ends, while the kernel is still killing the rest of its pid namespace, and until
    /// then those count against the session uid's process limit. bubblewrap then cannot fork,
    /// before anything of the command has run: it is tried again, a few times within a second.
    async fn shell_routed(
        &self,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
        allow_direct: bool,
        mut gate: Option<Gate>,
    ) -> Result<(ShellOutput, Route), ToolError> {
        let mut pause = Duration::from_millis(10);
        for _ in 0..6 {
            // The gate opens once, before the first try's program: a later try follows it.
            match self
                .shell_once(command, env, limits, allow_direct, &mut gate)
                .await
            {
                Err(ToolError::Failed { code, message })
                    if code == "sandbox_unavailable" && is_fork_refused(&message) =>
                {
                    tracing::debug!(%message, "bubblewrap could not fork; trying again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                r => return r,
            }
        }
        self.shell_once(command, env, limits, allow_direct, &mut gate)
            .await
    }

    async fn shell_once(
        &self,
        command: &str,
        env: &[(String, String)],
        limits: &Limits,
        allow_direct: bool,
        gate: &mut Option<Gate>,
    ) -> Result<(ShellOutput, Route), ToolError> {
        let root = self.root().to_path_buf();
        // Only Local starts a program without sh. In the Sandbox the program would be exec'd by
        // bubblewrap: its failure to exec it would be indistinguishable from a failure to set up
        // the sandbox (both are bwrap's own message and exit code 1), and the program's path
        // resolves inside bwrap's mount namespace, not on the host where it would be checked.
        let words = match self {
            Environment::Local { .. } if allow_direct => plain_program_call(command)
                .filter(|_| env_passes_through_sh(env))
                .map(|w| w.into_iter().map(str::to_owned).collect::<Vec<_>>()),
            _ => None,
        };
        let path_var = env
            .iter()
            .rev()
            .find(|(k, _)| k == "PATH")
            .map_or(DEFAULT_PATH, |(_, v)| v.as_str())
            .to_owned();
        // Checked and resolved (and the program looked up) in one trip to the blocking pool.
        let (root, direct) = tokio::task::spawn_blocking(move || {
            match std::fs::metadata(&root) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => return Err(ToolError::new("io", "session directory is not a directory")),
                Err(e) => return Err(io_err("session directory", e)),
            }
            let root = std::fs::canonicalize(&root).map_err(|e| io_err("session directory", e))?;
            let direct = words.and_then(|words| direct_program(words, &root, &path_var));
            Ok((root, direct))
        })
        .await
        .map_err(|e| io_err("session directory", std::io::Error::other(e)))??;
        // Who the tool code runs as: the session's uid, never root.
        let (run_as, switch) = match (self.identity(), is_root()) {
            (Some(id), _) if id.uid == 0 || id.gid == 0 => {
                return Err(unavailable("a session identity is never root"));
            }
            (Some(id), true) => (Some(id), true),
            (Some(_), false) | (None, false) => (None, false),
            (None, true) => match self {
                Environment::Sandbox { .. } => {
                    return Err(unavailable(
                        "the sandbox has no session identity and never runs tools as root",
                    ));
                }
                // A self-hosted Worker running as root on its owner's machine: its choice.
                Environment::Local { .. } => (None, false),
            },
        };
        let mut cgroup = None;
        // The program and argv of the shell's route: sh itself, or bubblewrap around it.
        let (sh_program, sh_argv, sandboxed): (PathBuf, Vec<OsString>, bool) = match self {
            Environment::Local { .. } => (
                PathBuf::from("/bin/sh"),
                vec!["/bin/sh".into(), "-c".into(), command.into()],
                false,
            ),
            Environment::Sandbox { spec, .. } => {
                match tokio::fs::metadata(&spec.bwrap).await {
                    Ok(m) if m.is_file() => {}
                    _ => {
                        return Err(unavailable(format!(
                            "bubblewrap not found at {}",
                            spec.bwrap.display()
                        )));
                    }
                }
                let inside = run_as.unwrap_or_else(current_identity);
                let etc = write_sandbox_etc(&spec.etc_dir, inside, &root)
                    .map_err(|e| unavailable(format!("cannot write the sandbox's /etc: {e}")))?;
                if let LimitMode::Cgroup(parent) = &spec.limit_mode {
                    cgroup = Some(SessionCgroup::create(parent, inside, limits).map_err(|e| {
                        unavailable(format!(
                            "cannot set up the session's cgroup under {}: {e}",
                            parent.display()
                        ))
                    })?);
                }
                // The child changes directory before its exec: a relative path is this
                // process's.
                let bwrap = std::path::absolute(&spec.bwrap)
                    .map_err(|e| unavailable(format!("cannot start bubblewrap: {e}")))?;
                let mut argv = vec![spec.bwrap.clone().into_os_string()];
                argv.extend(bwrap_args(&root, inside, &etc, &spec.extra_ro));
                argv.extend(["/bin/sh".into(), "-c".into(), command.into()]);
                (bwrap, argv, true)
            }
        };
        let setup = ChildSetup {
            memory: if cgroup.is_none() {
                limits.memory_bytes
            } else {
                None
            },
            nproc: if cgroup.is_none() && switch {
                limits.max_processes.map(u64::from)
            } else {
                None
            },
            cpu: limits.cpu_secs,
            cgroup_procs: cgroup.as_ref().map(|c| c.procs.as_raw_fd()),
        };
        // What both ways of starting the command share: cwd, environment, identity, limits.
        let mut vars: BTreeMap<OsString, OsString> = BTreeMap::new();
        vars.insert("PATH".into(), DEFAULT_PATH.into());
        vars.insert("HOME".into(), root.clone().into_os_string());
        vars.insert("LANG".into(), "C.UTF-8".into());
        for (k, v) in env {
            vars.insert(k.into(), v.into());
        }
        let identity = run_as.filter(|_| switch);
        // A held start (see `start_held`) when the child needs nothing of this future's past
        // its start: not a cgroup's descriptor.
        let mut hold = match gate.take() {
            Some(g) if cgroup.is_none() => Some(g),
            Some(g) => {
                g.wait().await?;
                None
            }
            None => None,
        };
        let mut started = None;
        if let Some(direct) = &direct {
            let mut vars = vars.clone();
            // sh exports the working directory it found (it was given no PWD).
            vars.insert("PWD".into(), root.clone().into_os_string());
            let spec = spawn::Spec {
                program: direct.path.clone(),
                argv: direct.argv.iter().map(OsString::from).collect(),
                env: vars,
                cwd: root.clone(),
                identity,
                setup,
                held: None,
                signals: spawn::Signals::Reset,
            };
            let r = match hold.take() {
                Some(g) => start_held(spec, g).await?,
                None => start(spec),
            };
            match r {
                Ok(s) => started = Some((s, Route::Direct)),
                // The check ran as this process's user, the exec as the session's, and the file
                // may have changed since: whatever made the exec fail, sh now tries and reports
                // it (its message, 126 or 127). Nothing of the attempt is left: `spawn` reaps
                // the child that failed to exec, and with it its process group; its limits were
                // its own; Local has no cgroup (it would be the sandbox's, whose child writes
                // itself into it before its exec).
                Err(e) => {
                    tracing::debug!(error = %e, "a direct program call did not start; running it with sh")
                }
            }
        }
        let (started, route) = match started {
            Some(s) => s,
            None => {
                let spec = spawn::Spec {
                    program: sh_program,
                    argv: sh_argv,
                    env: vars,
                    cwd: root,
                    identity,
                    setup,
                    held: None,
                    signals: spawn::Signals::Reset,
                };
                let r = match hold.take() {
                    Some(g) => start_held(spec, g).await?,
                    None => start(spec),
                };
                match r {
                    Ok(s) => (s, Route::Shell),
                    Err(e) if sandboxed => {
                        return Err(unavailable(format!("cannot start bubblewrap: {e}")));
                    }
                    Err(e) => {
                        return Err(unavailable(format!(
                            "cannot start the shell under the session's identity and limits: {e}"
                        )));
                    }
                }
            }
        };
        let out = collect(started, limits, route == Route::Direct).await;
        drop(cgroup);
        let out = out?;
        if sandboxed
            && out.exit_code == Some(1)
            && !out.output.is_empty()
            && out.output.lines().all(|l| l.starts_with("bwrap: "))
        {
            return Err(unavailable(format!(
                "bubblewrap could not set up the sandbox: {}",
                out.output.trim()
            )));
        }
        Ok((out, route))
    }
}

/// A sandbox that could not start for a moment (EAGAIN: bubblewrap's fork, or its own exec,
/// refused by the uid's process limit or the machine's), as opposed to one that cannot be set up
/// at all. Either way nothing of the command has run.
fn is_fork_refused(report: &str) -> bool {
    report.contains("Resource temporarily unavailable")
}

/// How [`Environment::shell`] started a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `sh -c command` (in the Sandbox: under bubblewrap).
    Shell,
    /// The program itself, without sh: see [`direct_program`].
    Direct,
}

// ---------------------------------------------------------------------------------------------
// Plain program calls: started without sh (Local only)
// ---------------------------------------------------------------------------------------------

/// Most words a plain program call may have; a longer command goes through sh.
const PLAIN_CALL_MAX_WORDS: usize = 4096;

/// Reserved words (of dash and, to be safe, bash and ksh), separated by spaces: never a
/// program as a first word.
const SH_RESERVED_WORDS: &str = "\
    ! { } [[ ]] case coproc do done elif else esac fi for function if in select then time until \
    while";

/// Builtins, separated by spaces: dash's (all of them: dash runs `echo`, `printf`, `test`,
/// `kill`, `pwd`, `true` and `false` itself) and, to be safe, bash's, ksh's and busybox ash's.
const SH_BUILTINS: &str = "\
    . : [ alias autoload bg bind break builtin caller cd chdir command compgen complete compopt \
    continue declare dirs disown echo enable eval exec exit export false fc fg getopts hash \
    help history jobs kill let local logout mapfile newgrp popd print printf pushd pwd read \
    readarray readonly return set shift shopt source suspend test times trap true type typeset \
    ulimit umask unalias unset wait whence";

/// Whether sh runs `word`, as a first word, itself: a reserved word or a builtin.
fn is_sh_own_word(word: &str) -> bool {
    SH_RESERVED_WORDS
        .split_ascii_whitespace()
        .chain(SH_BUILTINS.split_ascii_whitespace())
        .any(|w| w == word)
}

/// Bytes a word of a plain program call may have: none that sh treats specially anywhere in a
/// word (no quoting, expansion, globbing, tilde, comment, operator, redirection or grouping).
fn is_plain_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"/._-+=,:@%".contains(&b)
}

/// The words of `command` when what POSIX sh does with it is exactly `execve` of a program with
/// these words as its argv: words of [`is_plain_byte`]s separated by spaces and tabs only
/// (leading and trailing ones allowed), at most [`PLAIN_CALL_MAX_WORDS`] of them, the first no
/// assignment (`NAME=value prog`; any `=` is refused) and, without a `/`, not a word sh runs
/// itself ([`is_sh_own_word`]). Nor `setsid` (by its last path component): started without sh,
/// the program leads its own process group, so setsid(1) would fork first, return at once and
/// leave its command running outside the group. `None` for anything else, the empty command
/// included: when in doubt, sh runs it.
fn plain_program_call(command: &str) -> Option<Vec<&str>> {
    let mut words = Vec::new();
    for word in command.split([' ', '\t']).filter(|w| !w.is_empty()) {
        if words.len() == PLAIN_CALL_MAX_WORDS || !word.bytes().all(is_plain_byte) {
            return None;
        }
        words.push(word);
    }
    let first = *words.first()?;
    let last_component = first.rsplit('/').next().unwrap_or(first);
    if first.contains('=')
        || (!first.contains('/') && is_sh_own_word(first))
        || last_component == "setsid"
    {
        return None;
    }
    Some(words)
}

/// Variables sh sets, rewrites or reads at start-up (dash and, to be safe, bash), separated by
/// spaces: with one of them in the environment, the program's environment under sh may differ
/// from the one given.
const SH_OWN_VARIABLES: &str =
    "PWD OLDPWD PPID OPTIND IFS LINENO ENV SHELLOPTS EXECIGNORE PS4 SHLVL _";

/// Whether sh hands every variable of `env` to the program unchanged (and adds only PWD): each
/// is a valid name (dash drops the others), none is one of [`SH_OWN_VARIABLES`] nor starts with
/// `BASH` (bash's functions, options and start-up file).
fn env_passes_through_sh(env: &[(String, String)]) -> bool {
    env.iter().all(|(k, _)| {
        let mut bytes = k.bytes();
        bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !SH_OWN_VARIABLES.split(' ').any(|v| v == k)
            && !k.starts_with("BASH")
    })
}

/// Whether `/bin/sh` is dash, whose behaviour the direct start reproduces (the environment it
/// passes on, how it reports a command killed by a signal). Any other sh runs every command.
fn sh_is_dash() -> bool {
    static DASH: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DASH.get_or_init(|| {
        std::fs::canonicalize("/bin/sh").is_ok_and(|p| p.file_name().is_some_and(|n| n == "dash"))
    })
}

/// A program to start without sh.
#[derive(Debug, PartialEq)]
struct DirectProgram {
    /// Where it was found (absolute).
    path: PathBuf,
    /// Its argv, `argv[0]` as written (as sh passes it).
    argv: Vec<String>,
}

/// Whether a plain program call's words can start without sh with the same result, and where
/// the program is. The program is found as sh finds it: with a `/`, relative to the session
/// directory (the command's cwd); otherwise in the first directory of `path_var` (the
/// command's PATH) holding a regular file of that name, where an empty, relative or
/// `%`-suffixed (dash's `%builtin`) entry before it sends the command to sh. The file must be a
/// regular file that starts with `#!` or the ELF magic: anything else sh would run as a script
/// when the exec fails with ENOEXEC. These checks run as this process's user; the exec runs as
/// the session's, and if it fails the command is handed to sh after all (see `shell`).
fn direct_program(words: Vec<String>, root: &Path, path_var: &str) -> Option<DirectProgram> {
    if !sh_is_dash() {
        return None;
    }
    let program = words.first()?;
    let path = if program.contains('/') {
        let path = root.join(program);
        match kernel_executable(&path) {
            Ok(true) => path,
            _ => return None,
        }
    } else {
        let mut found = None;
        for dir in path_var.split(':') {
            if !dir.starts_with('/') || dir.contains('%') {
                return None;
            }
            let path = Path::new(dir).join(program);
            match kernel_executable(&path) {
                Ok(true) => {
                    found = Some(path);
                    break;
                }
                // A regular file sh would pick, but run as a script.
                Ok(false) => return None,
                // sh skips what is missing and what is not a regular file.
                Err(e)
                    if e.kind() == ErrorKind::NotFound
                        || e.raw_os_error() == Some(libc::ENOTDIR)
                        || e.kind() == ErrorKind::InvalidInput => {}
                Err(_) => return None,
            }
        }
        found?
    };
    Some(DirectProgram { path, argv: words })
}

/// `Ok(true)` for a regular file with an execute bit that starts with `#!` or the ELF magic,
/// `Ok(false)` for another regular file, `InvalidInput` for what is not a regular file. The
/// file is opened `O_PATH` and checked before it is opened for reading (through that
/// descriptor), so a device or FIFO swapped in for it is never opened; nor is a file nobody may
/// execute (its exec would fail anyway), so a session cannot make this process read, say,
/// `/proc/kmsg`.
fn kernel_executable(path: &Path) -> std::io::Result<bool> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(ErrorKind::InvalidInput.into());
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Ok(false);
    }
    let mut head = [0u8; 4];
    let mut readable = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let mut len = 0;
    while len < head.len() {
        match readable.read(&mut head[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let head = &head[..len];
    Ok(head.starts_with(b"#!") || head == b"\x7fELF")
}

/// What dash prints on stderr when a foreground command dies of `signal`: its description
/// (strsignal, at most 32 bytes) and " (core dumped)", nothing for SIGINT and SIGPIPE.
fn sh_signal_note(signal: i32, core_dumped: bool) -> Option<String> {
    if signal == libc::SIGINT || signal == libc::SIGPIPE {
        return None;
    }
    // SAFETY: strsignal returns a NUL-terminated string (a static description, or this
    // thread's buffer for an unknown signal), copied at once.
    let description = unsafe { std::ffi::CStr::from_ptr(libc::strsignal(signal)) };
    let mut note: Vec<u8> = description.to_bytes().iter().take(32).copied().collect();
    if core_dumped {
        note.extend_from_slice(b" (core dumped)");
    }
    note.push(b'\n');
    Some(String::from_utf8_lossy(&note).into_owned())
}

// ---------------------------------------------------------------------------------------------
// Session identity and directory
// ---------------------------------------------------------------------------------------------

/// Creates (or finds) `<base>/<session>` for a session and its own identity: the directory is
/// 0700 and owned by a uid of `range` that no other session directory under `base` has (a
/// marker `<base>/.uids/<uid>` holding the session id claims it, with `O_EXCL`, so replicas
/// sharing `base` never hand one uid to two sessions); `base` is 0711, so a session can reach
/// its own directory and list no other. A directory from before identities existed (owned by
/// someone else) gets an identity and is handed over, symlinks not followed.
///
/// Returns `None` for the identity when this process is not root: it cannot switch users, and
/// every session runs as the dataplane's own user (logged at start-up).
pub fn prepare_session_dir(
    base: &Path,
    session: uuid::Uuid,
    range: UidRange,
) -> Result<(PathBuf, Option<Identity>), ToolError> {
    let root = base.join(session.to_string());
    std::fs::create_dir_all(base).map_err(|e| io_err("sessions directory", e))?;
    if !is_root() {
        std::fs::create_dir_all(&root).map_err(|e| io_err("session directory", e))?;
        return Ok((root, None));
    }
    let base_meta = std::fs::symlink_metadata(base).map_err(|e| io_err("sessions directory", e))?;
    if base_meta.permissions().mode() & 0o7777 != 0o711 {
        std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| io_err("sessions directory", e))?;
    }
    let existing = match std::fs::symlink_metadata(&root) {
        Ok(m) if m.is_dir() => Some(m),
        Ok(_) => {
            return Err(ToolError::new(
                "io",
                format!("{} is not a directory", root.display()),
            ));
        }
        Err(e) if e.kind() == ErrorKind::NotFound => None,
        Err(e) => return Err(io_err("session directory", e)),
    };
    use std::os::unix::fs::MetadataExt as _;
    if let Some(m) = &existing
        && range.contains(m.uid())
        && m.uid() == m.gid()
    {
        return Ok((
            root,
            Some(Identity {
                uid: m.uid(),
                gid: m.gid(),
            }),
        ));
    }
    let id = allocate_uid(base, session, range)?;
    match existing {
        None => {
            match std::fs::create_dir(&root) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err("session directory", e)),
            }
            std::os::unix::fs::lchown(&root, Some(id.uid), Some(id.gid))
                .map_err(|e| io_err("session directory", e))?;
        }
        Some(_) => chown_tree(&root, id).map_err(|e| io_err("session directory", e))?,
    }
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err("session directory", e))?;
    Ok((root, Some(id)))
}

fn allocate_uid(base: &Path, session: uuid::Uuid, range: UidRange) -> Result<Identity, ToolError> {
    let markers = base.join(".uids");
    std::fs::create_dir_all(&markers).map_err(|e| io_err("session uid markers", e))?;
    std::fs::set_permissions(&markers, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err("session uid markers", e))?;
    let start = (session.as_u128() % u128::from(range.len())) as u64;
    let me = session.to_string();
    for k in 0..range.len() {
        let uid = range.first + ((start + k) % range.len()) as u32;
        let marker = markers.join(uid.to_string());
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&marker)
        {
            Ok(mut f) => {
                f.write_all(me.as_bytes())
                    .and_then(|()| f.sync_all())
                    .map_err(|e| io_err("session uid marker", e))?;
                return Ok(Identity { uid, gid: uid });
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                // Ours already (a crash between the marker and the directory)?
                if std::fs::read_to_string(&marker).is_ok_and(|s| s == me) {
                    return Ok(Identity { uid, gid: uid });
                }
            }
            Err(e) => return Err(io_err("session uid marker", e)),
        }
    }
    Err(unavailable(format!(
        "every session uid of {}-{} is taken; widen session_uids",
        range.first, range.last
    )))
}

/// lchown of a whole tree, never following a symlink.
fn chown_tree(path: &Path, id: Identity) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(id.uid), Some(id.gid))?;
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), id)?;
        }
    }
    Ok(())
}

/// Switches this thread's filesystem identity (fsuid, fsgid, no supplementary groups) to the
/// session's. Raw syscalls: they change only the calling thread, which ends after the tool.
fn switch_thread_fs_identity(identity: Option<Identity>) -> Result<(), ToolError> {
    let Some(id) = identity else {
        return Ok(());
    };
    if !is_root() {
        return Ok(());
    }
    if id.uid == 0 || id.gid == 0 {
        return Err(unavailable("a session identity is never root"));
    }
    // SAFETY: raw credential syscalls with plain integer arguments (a null list of 0 groups).
    let ok = unsafe {
        libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0 && {
            libc::syscall(libc::SYS_setfsgid, id.gid);
            libc::syscall(libc::SYS_setfsuid, id.uid);
            // setfs*id report the previous value; asking with an invalid id reads it back.
            libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 == id.uid
                && libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32 == id.gid
        }
    };
    if ok {
        Ok(())
    } else {
        Err(unavailable(
            "cannot switch the file tool to the session's uid",
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Path confinement: openat2(RESOLVE_BENEATH) from the session directory
// ---------------------------------------------------------------------------------------------

/// Checks `rel` (no absolute path, no `..`) and returns it as plain components.
fn relative(rel: &str, allow_root: bool) -> Result<PathBuf, ToolError> {
    let escape = |why: &str| ToolError::new("path_escape", format!("{rel}: {why}"));
    let mut out = PathBuf::new();
    for component in Path::new(rel).components() {
        match component {
            Component::Normal(p) => out.push(p),
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
    if out.as_os_str().is_empty() && !allow_root {
        return Err(ToolError::new(
            "not_a_file",
            format!("'{rel}' names the session directory, not a file"),
        ));
    }
    Ok(out)
}

fn open_root(root: &Path) -> Result<OwnedFd, ToolError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(root)
        .map(OwnedFd::from)
        .map_err(|e| io_err("session directory", e))
}

/// openat2 relative to `dir` that never leaves it: no absolute symlinks, no `..` above it, no
/// /proc magic links, no mount crossing (EXDEV / ELOOP otherwise).
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    let path = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(ErrorKind::InvalidInput))?;
    // SAFETY: open_how is plain old data; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    // openat2 refuses flags O_PATH does not take (EINVAL).
    let extra = if flags & libc::O_PATH != 0 {
        libc::O_CLOEXEC
    } else {
        libc::O_CLOEXEC | libc::O_NOCTTY
    };
    how.flags = (flags | extra) as u64;
    how.mode = if flags & libc::O_CREAT != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS | libc::RESOLVE_NO_XDEV;
    // SAFETY: valid fd, NUL-terminated path and a correctly sized open_how.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: openat2 returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn open_error(shown: &str, e: std::io::Error, what: &str) -> ToolError {
    match e.raw_os_error() {
        Some(libc::EXDEV) | Some(libc::ELOOP) => ToolError::new(
            "path_escape",
            format!("{shown}: a symlink on this path leads outside the session directory"),
        ),
        Some(libc::ENOENT) => ToolError::new("not_found", format!("{shown}: no such {what}")),
        Some(libc::ENOTDIR) => ToolError::new(
            "not_found",
            format!("{shown}: a parent component is not a directory"),
        ),
        Some(libc::EISDIR) => ToolError::new("not_a_file", format!("{shown}: is a directory")),
        Some(libc::ENXIO) => ToolError::new("not_a_file", format!("{shown}: not a regular file")),
        Some(libc::EACCES) | Some(libc::EPERM) => ToolError::new(
            "io",
            format!("{shown}: permission denied (the session's uid cannot access it)"),
        ),
        _ => io_err(shown, e),
    }
}

fn read_sync(root: &Path, rel: &str, max: usize) -> Result<Vec<u8>, ToolError> {
    let path = relative(rel, false)?;
    let dir = open_root(root)?;
    // O_NONBLOCK: a FIFO planted by the agent cannot hang the tool.
    let fd = open_beneath(&dir, &path, libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map_err(|e| open_error(rel, e, "file"))?;
    let file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(|e| io_err(rel, e))?;
    if !meta.is_file() {
        return Err(ToolError::new(
            "not_a_file",
            format!("{rel}: not a regular file"),
        ));
    }
    let too_large = |len: u64| {
        ToolError::new(
            "too_large",
            format!("{rel}: file is {len} bytes, the limit is {max}"),
        )
    };
    if meta.len() > max as u64 {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_err(rel, e))?;
    if bytes.len() > max {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

fn write_sync(root: &Path, rel: &str, content: &[u8]) -> Result<(), ToolError> {
    let path = relative(rel, false)?;
    let dir = open_root(root)?;
    if let Some(parent) = path.parent() {
        let mut prefix = PathBuf::new();
        for part in parent.components() {
            let next = prefix.join(part);
            match open_beneath(&dir, &next, libc::O_PATH | libc::O_DIRECTORY, 0) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    let at = open_beneath(&dir, &prefix, libc::O_PATH | libc::O_DIRECTORY, 0)
                        .map_err(|e| open_error(rel, e, "directory"))?;
                    let name = CString::new(part.as_os_str().as_bytes())
                        .map_err(|_| ToolError::new("io", format!("{rel}: invalid name")))?;
                    // SAFETY: valid directory fd and NUL-terminated name; mkdirat never follows
                    // a symlink in its last component.
                    if unsafe { libc::mkdirat(at.as_raw_fd(), name.as_ptr(), 0o755) } != 0 {
                        let e = std::io::Error::last_os_error();
                        if e.kind() != ErrorKind::AlreadyExists {
                            return Err(open_error(rel, e, "directory"));
                        }
                    }
                    open_beneath(&dir, &next, libc::O_PATH | libc::O_DIRECTORY, 0)
                        .map_err(|e| open_error(rel, e, "directory"))?;
                }
                Err(e) => return Err(open_error(rel, e, "directory")),
            }
            prefix = next;
        }
    }
    let fd = open_beneath(
        &dir,
        &path,
        libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK,
        0o644,
    )
    .map_err(|e| open_error(rel, e, "file"))?;
    let mut file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(|e| io_err(rel, e))?;
    if !meta.is_file() {
        return Err(ToolError::new(
            "not_a_file",
            format!("{rel}: not a regular file"),
        ));
    }
    file.set_len(0).map_err(|e| io_err(rel, e))?;
    file.write_all(content).map_err(|e| io_err(rel, e))
}

fn list_sync(root: &Path, rel: &str) -> Result<Vec<String>, ToolError> {
    let path = relative(rel, true)?;
    let shown = if rel.is_empty() { "." } else { rel };
    let dir = open_root(root)?;
    let fd =
        open_beneath(&dir, &path, libc::O_RDONLY | libc::O_DIRECTORY, 0).map_err(|e| {
            match e.raw_os_error() {
                Some(libc::ENOTDIR) => ToolError::new("io", format!("{shown}: not a directory")),
                _ => open_error(shown, e, "directory"),
            }
        })?;
    // Read through this thread's own descriptor: the directory that was checked, not a path.
    let via = format!("/proc/thread-self/fd/{}", fd.as_raw_fd());
    let reader = std::fs::read_dir(&via).map_err(|e| io_err(shown, e))?;
    let mut entries = Vec::new();
    for entry in reader {
        let entry = entry.map_err(|e| io_err(shown, e))?;
        let mut name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = match entry.file_type() {
            Ok(t) if t.is_dir() => true,
            Ok(t) if t.is_symlink() => open_beneath(
                &dir,
                &path.join(entry.file_name()),
                libc::O_PATH | libc::O_DIRECTORY,
                0,
            )
            .is_ok(),
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

// ---------------------------------------------------------------------------------------------
// Sandbox
// ---------------------------------------------------------------------------------------------

/// The generated `/etc/passwd` and `/etc/group` of a sandbox: only the sandbox user.
fn sandbox_etc_files(id: Identity, home: &Path) -> (String, String) {
    (
        format!(
            "agent:x:{}:{}:agentscope session:{}:/bin/sh\n",
            id.uid,
            id.gid,
            home.display()
        ),
        format!("agent:x:{}:\n", id.gid),
    )
}

/// Writes `<etc_dir>/<uid>/{passwd,group}` (root-owned, world-readable) when they differ.
fn write_sandbox_etc(etc_dir: &Path, id: Identity, home: &Path) -> std::io::Result<PathBuf> {
    let dir = etc_dir.join(id.uid.to_string());
    std::fs::create_dir_all(&dir)?;
    let (passwd, group) = sandbox_etc_files(id, home);
    for (name, text) in [("passwd", passwd), ("group", group)] {
        let path = dir.join(name);
        if std::fs::read_to_string(&path).is_ok_and(|t| t == text) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, &text)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(dir)
}

/// Toolchain directories bound read-only (a symlink, as on merged-/usr systems, is recreated).
const SANDBOX_ROOT_DIRS: [&str; 7] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// Host files of /etc the toolchain needs (TLS certificates, the loader cache, alternatives);
/// bound read-only when present.
const SANDBOX_ETC: [&str; 9] = [
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
];

fn bwrap_args(root: &Path, id: Identity, etc: &Path, extra_ro: &[PathBuf]) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |items: &[&OsStr]| args.extend(items.iter().map(|s| s.to_os_string()));
    let (uid, gid) = (id.uid.to_string(), id.gid.to_string());
    push(&[
        "--unshare-user".as_ref(),
        "--uid".as_ref(),
        uid.as_ref(),
        "--gid".as_ref(),
        gid.as_ref(),
        "--unshare-pid".as_ref(),
        "--unshare-ipc".as_ref(),
        "--unshare-uts".as_ref(),
        "--unshare-net".as_ref(),
        "--unshare-cgroup".as_ref(),
        "--hostname".as_ref(),
        "sandbox".as_ref(),
        "--die-with-parent".as_ref(),
        "--new-session".as_ref(),
        "--cap-drop".as_ref(),
        "ALL".as_ref(),
    ]);
    for dir in SANDBOX_ROOT_DIRS {
        match std::fs::symlink_metadata(dir) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(dir) {
                    push(&["--symlink".as_ref(), target.as_os_str(), dir.as_ref()]);
                }
            }
            Ok(m) if m.is_dir() => push(&["--ro-bind".as_ref(), dir.as_ref(), dir.as_ref()]),
            _ => {}
        }
    }
    for path in SANDBOX_ETC {
        push(&["--ro-bind-try".as_ref(), path.as_ref(), path.as_ref()]);
    }
    for path in extra_ro {
        push(&["--ro-bind".as_ref(), path.as_os_str(), path.as_os_str()]);
    }
    let (passwd, group) = (etc.join("passwd"), etc.join("group"));
    push(&[
        "--ro-bind".as_ref(),
        passwd.as_os_str(),
        "/etc/passwd".as_ref(),
        "--ro-bind".as_ref(),
        group.as_os_str(),
        "/etc/group".as_ref(),
        "--dev".as_ref(),
        "/dev".as_ref(),
        "--proc".as_ref(),
        "/proc".as_ref(),
        // Before binding root, which may live below /tmp.
        "--tmpfs".as_ref(),
        "/tmp".as_ref(),
        "--bind".as_ref(),
        root.as_os_str(),
        root.as_os_str(),
        "--remount-ro".as_ref(),
        "/".as_ref(),
        "--chdir".as_ref(),
        root.as_os_str(),
        "--".as_ref(),
    ]);
    args
}

// ---------------------------------------------------------------------------------------------
// Limits: cgroup v2 when delegated, rlimits otherwise
// ---------------------------------------------------------------------------------------------

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Decides how limits are enforced: `configured` = "off" forces rlimits; a path must be a
/// usable delegated cgroup v2 directory (else an error: never a silently weaker setup); empty
/// probes `/sys/fs/cgroup` and `/sys/fs/cgroup/unified`. Returns the mode and, for rlimits,
/// why no cgroup is used.
pub fn detect_limit_mode(configured: &str) -> Result<(LimitMode, String), String> {
    match configured.trim() {
        "off" => Ok((LimitMode::Rlimits, "sandbox_cgroup is off".into())),
        "" => {
            let mut why = vec![];
            for candidate in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                match usable_cgroup(Path::new(candidate)) {
                    Ok(()) => return Ok((LimitMode::Cgroup(candidate.into()), String::new())),
                    Err(e) => why.push(format!("{candidate}: {e}")),
                }
            }
            Ok((LimitMode::Rlimits, why.join("; ")))
        }
        path => usable_cgroup(Path::new(path))
            .map(|()| (LimitMode::Cgroup(path.into()), String::new()))
            .map_err(|e| format!("sandbox_cgroup {path} cannot be used: {e}")),
    }
}

/// A directory is usable when it is cgroup v2, offers pids, memory and cpu to its children
/// (enabling them in `cgroup.subtree_control` if needed) and a child can be created in it.
pub fn usable_cgroup(dir: &Path) -> Result<(), String> {
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| "invalid path".to_string())?;
    // SAFETY: statfs fills a zeroed struct from a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    #[allow(clippy::unnecessary_cast)]
    if st.f_type as i64 != CGROUP2_SUPER_MAGIC {
        return Err("not a cgroup2 filesystem".into());
    }
    let controllers = std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map_err(|e| format!("cgroup.controllers: {e}"))?;
    let missing: Vec<&str> = ["pids", "memory", "cpu"]
        .into_iter()
        .filter(|c| !controllers.split_whitespace().any(|x| x == *c))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "the controllers {} are not delegated here",
            missing.join(", ")
        ));
    }
    let subtree = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    if !["pids", "memory", "cpu"]
        .iter()
        .all(|c| subtree.split_whitespace().any(|x| x == *c))
    {
        std::fs::write(dir.join("cgroup.subtree_control"), "+pids +memory +cpu")
            .map_err(|e| format!("cannot enable pids, memory and cpu for children: {e}"))?;
    }
    let probe = dir.join(format!("agentscope-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).map_err(|e| format!("cannot create a child cgroup: {e}"))?;
    let _ = std::fs::remove_dir(&probe);
    Ok(())
}

/// The values written to a session cgroup's limit files.
fn cgroup_limit_files(limits: &Limits) -> Vec<(&'static str, String)> {
    let or_max = |v: Option<u64>| v.map_or_else(|| "max".to_string(), |v| v.to_string());
    vec![
        ("pids.max", or_max(limits.max_processes.map(u64::from))),
        ("memory.max", or_max(limits.memory_bytes)),
        ("memory.swap.max", "0".into()),
        ("cpu.max", CGROUP_CPU_MAX.into()),
    ]
}

/// One shell call's cgroup: created with its limits, removed (after its processes are gone)
/// when dropped.
struct SessionCgroup {
    dir: PathBuf,
    /// `cgroup.procs`, opened by the dataplane; the child writes itself into it before exec.
    procs: std::fs::File,
}

impl SessionCgroup {
    fn create(parent: &Path, id: Identity, limits: &Limits) -> std::io::Result<SessionCgroup> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let dir = parent.join(format!(
            "agentscope-{}-{}-{}",
            id.uid,
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir)?;
        for (file, value) in cgroup_limit_files(limits) {
            if let Err(e) = std::fs::write(dir.join(file), &value) {
                // memory.swap.max is absent without swap accounting; the rest must hold.
                if file != "memory.swap.max" {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(std::io::Error::new(e.kind(), format!("{file}: {e}")));
                }
            }
        }
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))?;
        Ok(SessionCgroup { dir, procs })
    }
}

impl Drop for SessionCgroup {
    fn drop(&mut self) {
        // Whatever is left is killed first (cgroup.kill, Linux 5.14+), then the cgroup removed.
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Kills a process group with SIGKILL (a group already gone is no error).
fn kill_group(pgid: u32) {
    // Never signal 0 (our own group) or 1 (`kill -1` = every process we may signal).
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill has no memory arguments; a negative pid names the process group.
    if unsafe { libc::kill(-pgid, libc::SIGKILL) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            tracing::warn!(pgid, error = %e, "could not kill a shell tool's process group");
        }
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

/// A started command: its process (the leader of its own process group) and the read end of
/// its output pipe.
struct Started {
    child: spawn::Child,
    output: tokio::net::unix::pipe::Receiver,
}

/// Starts `spec` in its own process group, stdin from /dev/null, stdout and stderr into one
/// pipe. An error means the child did not get to run its program (see [`spawn::spawn`]).
fn start(spec: spawn::Spec) -> std::io::Result<Started> {
    // One pipe for both stdout and stderr, so output interleaves exactly as it was written.
    let (reader, writer) = std::io::pipe()?;
    let child = spawn::spawn(spec, &OwnedFd::from(writer))?;
    // Our copy of the write end is closed above, so EOF arrives once the command's are.
    let output = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader))?;
    Ok(Started { child, output })
}

/// [`start`] with the child held (before its identity change) until `gate` opens: the start runs on the
/// blocking pool (the starting thread waits for the child's exec) while the caller's commit runs.
/// `Err` when the gate stays shut: the child exited before its program, and is reaped. Dropped
/// while it waits, the hold's release is dropped too, and the child exits the same way.
async fn start_held(
    mut spec: spawn::Spec,
    gate: Gate,
) -> Result<std::io::Result<Started>, ToolError> {
    let (held, release) = spawn::hold();
    spec.held = Some(held);
    let starting = tokio::task::spawn_blocking(move || start(spec));
    let go = gate.opened().await;
    if go {
        release.go();
    } else {
        drop(release);
    }
    let r = starting
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    if !go {
        // ECANCELED (or an earlier step's error): nothing ran.
        drop(r);
        return Err(not_started());
    }
    Ok(r)
}

fn not_started() -> ToolError {
    ToolError::new(
        "not_started",
        "the call's start was not recorded, so it was not run",
    )
}

/// What a tool call waits for before anything of it takes effect: its caller's word that the
/// call's start is recorded (see [`gate`]).
pub struct Gate(tokio::sync::oneshot::Receiver<()>);

/// Opens its [`Gate`]. Dropped without [`GateKey::open`], the gate stays shut: the call does not
/// run.
pub struct GateKey(tokio::sync::oneshot::Sender<()>);

/// A gate and its key: the caller commits a call's start while the call gets ready (see
/// [`Environment::shell_after`]), then opens the gate, or drops the key if the commit failed.
pub fn gate() -> (GateKey, Gate) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    (GateKey(tx), Gate(rx))
}

impl GateKey {
    pub fn open(self) {
        let _ = self.0.send(());
    }
}

impl Gate {
    /// Whether the gate opened (false: its key was dropped).
    pub async fn opened(self) -> bool {
        self.0.await.is_ok()
    }

    /// Returns once the gate opens; `not_started` if it stays shut.
    pub async fn wait(self) -> Result<(), ToolError> {
        if self.opened().await {
            Ok(())
        } else {
            Err(not_started())
        }
    }
}

/// Collects the output of a started command until it exits (or the timeout fires), killing its
/// process group then. `as_sh_reports_it`: the process is the program itself, started without
/// sh, so its death by a signal is reported as sh (dash) reports a foreground command's: exit
/// code 128 + the signal and, except for SIGINT and SIGPIPE, the signal's description on stderr.
async fn collect(
    started: Started,
    limits: &Limits,
    as_sh_reports_it: bool,
) -> Result<ShellOutput, ToolError> {
    let Started {
        mut child,
        output: mut rx,
    } = started;
    let pgid = child
        .id()
        .ok_or_else(|| ToolError::new("io", "shell exited before it could be tracked"))?;
    let mut guard = GroupGuard { pgid, armed: true };

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

    let mut exit_code = status.code();
    if as_sh_reports_it
        && !timed_out
        && let Some(signal) = status.signal()
    {
        exit_code = Some(128 + signal);
        if let Some(note) = sh_signal_note(signal, status.core_dumped()) {
            out.push(note.as_bytes());
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
        exit_code: if timed_out { None } else { exit_code },
        output,
        timed_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spawn::tests::{before_exec_children_of, held_child};
    use std::os::unix::fs::MetadataExt as _;
    use std::sync::atomic::{AtomicU64, Ordering};

    const BWRAP: &str = "/usr/bin/bwrap";

    /// A sessions base (0711, root's) with one session directory `.0` (0700, owned by `id`).
    struct TempDir(PathBuf, Identity);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let base = std::env::temp_dir().join(format!(
                "svc-dataplane-env-{name}-{}-{nanos}-{n}",
                std::process::id(),
            ));
            std::fs::create_dir_all(&base).unwrap();
            std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o711)).unwrap();
            let root = base.join("session");
            std::fs::create_dir(&root).unwrap();
            let uid = 720_000 + (std::process::id() % 4000) * 64 + (n % 64) as u32;
            let id = Identity { uid, gid: uid };
            if is_root() {
                std::os::unix::fs::lchown(&root, Some(uid), Some(uid)).unwrap();
                std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
            }
            TempDir(root, id)
        }

        fn base(&self) -> &Path {
            self.0.parent().unwrap()
        }

        fn unique(&self) -> String {
            self.base()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.base());
        }
    }

    fn limits() -> Limits {
        Limits {
            timeout: Duration::from_secs(30),
            max_output: 64 * 1024,
            max_file: 1024 * 1024,
            memory_bytes: None,
            max_processes: None,
            cpu_secs: None,
        }
    }

    fn local(dir: &TempDir) -> Environment {
        Environment::Local {
            root: dir.0.clone(),
            identity: Some(dir.1),
        }
    }

    fn spec(dir: &TempDir, bwrap: PathBuf) -> Arc<SandboxSpec> {
        Arc::new(SandboxSpec {
            bwrap,
            etc_dir: dir.base().join("etc"),
            extra_ro: vec![],
            limit_mode: LimitMode::Rlimits,
        })
    }

    fn sandbox(dir: &TempDir) -> Environment {
        assert!(
            Path::new(BWRAP).is_file(),
            "bubblewrap is not installed at {BWRAP}; the Sandbox environment tests require it \
             (install the `bubblewrap` package; the project's setup scripts do)"
        );
        Environment::Sandbox {
            root: dir.0.clone(),
            identity: Some(dir.1),
            spec: spec(dir, PathBuf::from(BWRAP)),
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
            // A (relative) symlink that stays inside root is fine.
            std::os::unix::fs::symlink("a/b", dir.0.join("inner")).unwrap();
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_after_a_gate_runs_once_it_opens_and_never_if_it_stays_shut() {
        for (dir, env) in both("gate") {
            let l = limits();
            // A program started without sh, and a command sh runs (in the Sandbox, bubblewrap:
            // these sandboxes set limits without a cgroup, so their start is held too).
            for (n, command) in ["touch ran-0", "touch ran-1 && true"].iter().enumerate() {
                let marker = dir.0.join(format!("ran-{n}"));
                let (key, shut) = gate();
                let opens = async {
                    // Ready before the gate opens: its process waits, not exec'd yet.
                    held_child().await;
                    assert!(!marker.exists(), "{command} ran before its gate opened");
                    key.open();
                };
                let (out, ()) = tokio::join!(env.shell_after(command, &[], &l, Some(shut)), opens);
                let out = out.unwrap();
                assert_eq!(out.exit_code, Some(0), "{out:?}");
                assert!(marker.exists(), "{command}");

                std::fs::remove_file(&marker).unwrap();
                let (key, shut) = gate();
                let shuts = async {
                    held_child().await;
                    drop(key);
                };
                let (out, ()) = tokio::join!(env.shell_after(command, &[], &l, Some(shut)), shuts);
                assert_eq!(code(out), "not_started");
                assert!(
                    !marker.exists(),
                    "{command} ran though its gate stayed shut"
                );
                assert!(before_exec_children_of(std::process::id()).is_empty());
            }
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
            identity: Some(dir.1),
            spec: spec(&dir, dir.0.join("no-such-bwrap")),
        };
        assert_eq!(
            code(env.shell("echo hi", &[], &limits()).await),
            "sandbox_unavailable"
        );
    }

    #[test]
    fn sessions_get_their_own_uid_and_a_private_directory() {
        let dir = TempDir::new("ids");
        let base = dir.base().join("sessions");
        let range = UidRange {
            first: 730_000,
            last: 730_001,
        };
        let (s1, s2, s3) = (
            uuid::Uuid::new_v4(),
            uuid::Uuid::new_v4(),
            uuid::Uuid::new_v4(),
        );
        let (r1, i1) = prepare_session_dir(&base, s1, range).unwrap();
        let (r2, i2) = prepare_session_dir(&base, s2, range).unwrap();
        let (i1, i2) = (i1.unwrap(), i2.unwrap());
        assert_ne!(i1, i2, "one identity per session");
        assert!(range.contains(i1.uid) && range.contains(i2.uid));
        assert_eq!(i1.uid, i1.gid);
        for (root, id) in [(&r1, i1), (&r2, i2)] {
            let m = std::fs::metadata(root).unwrap();
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (id.uid, id.gid, 0o700)
            );
        }
        assert_eq!(std::fs::metadata(&base).unwrap().mode() & 0o7777, 0o711);
        // The same session keeps its identity (a restart, another replica on the same storage).
        assert_eq!(prepare_session_dir(&base, s1, range).unwrap().1, Some(i1));
        // The range is exhausted: a clear error, never a shared uid.
        assert_eq!(
            prepare_session_dir(&base, s3, range).unwrap_err().code(),
            "sandbox_unavailable"
        );
        // A directory from before identities is handed over, symlinks not followed.
        let legacy = uuid::Uuid::new_v4();
        let wide = UidRange {
            first: 730_100,
            last: 730_199,
        };
        let old = base.join(legacy.to_string());
        std::fs::create_dir_all(old.join("sub")).unwrap();
        std::fs::write(old.join("sub/f"), "x").unwrap();
        let victim = dir.base().join("victim");
        std::fs::write(&victim, "root's").unwrap();
        std::os::unix::fs::symlink(&victim, old.join("link")).unwrap();
        let (_, id) = prepare_session_dir(&base, legacy, wide).unwrap();
        let id = id.unwrap();
        assert_eq!(std::fs::metadata(old.join("sub/f")).unwrap().uid(), id.uid);
        assert_eq!(
            std::fs::metadata(&victim).unwrap().uid(),
            0,
            "symlink not followed"
        );
        assert!(UidRange::parse("0-100").is_err());
        assert!(UidRange::parse("60000-70000").is_err(), "contains nobody");
        assert!(UidRange::parse("9-3").is_err());
        assert_eq!(UidRange::parse("700000-765535").unwrap().len(), 65_536);
    }

    #[tokio::test]
    async fn file_tools_do_their_io_as_the_session_uid() {
        for (dir, env) in both("fsuid") {
            let l = limits();
            env.write_file("new/dir/f.txt", "mine", &l).await.unwrap();
            for p in ["new", "new/dir", "new/dir/f.txt"] {
                assert_eq!(
                    std::fs::metadata(dir.0.join(p)).unwrap().uid(),
                    dir.1.uid,
                    "{p}"
                );
            }
            // A root-only file inside the directory stays root's: the tool is not root.
            std::fs::write(dir.0.join("root-only"), "secret").unwrap();
            std::fs::set_permissions(
                dir.0.join("root-only"),
                std::fs::Permissions::from_mode(0o600),
            )
            .unwrap();
            assert_eq!(code(env.read_file("root-only", &l).await), "io");
            assert_eq!(code(env.write_file("root-only", "x", &l).await), "io");
            assert_eq!(
                std::fs::read_to_string(dir.0.join("root-only")).unwrap(),
                "secret"
            );
            // A FIFO cannot hang a tool.
            let fifo = CString::new(dir.0.join("fifo").as_os_str().as_bytes()).unwrap();
            // SAFETY: NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
            std::fs::set_permissions(dir.0.join("fifo"), std::fs::Permissions::from_mode(0o666))
                .unwrap();
            assert_eq!(code(env.read_file("fifo", &l).await), "not_a_file");
            assert_eq!(code(env.write_file("fifo", "x", &l).await), "not_a_file");
        }
    }

    #[tokio::test]
    async fn symlinks_cannot_turn_the_file_tools_against_the_dataplane() {
        let other = TempDir::new("symlink-other");
        std::fs::write(other.0.join("tok.txt"), "other session's secret").unwrap();
        for (dir, env) in both("symlink") {
            let l = limits();
            let sibling = other.0.to_str().unwrap().to_owned();
            let rel_sibling = format!("../../{}/session", other.unique());
            let planted = [
                ("shadow", "/etc/shadow"),
                ("abs-sib", sibling.as_str()),
                ("rel-sib", rel_sibling.as_str()),
                ("up", ".."),
                ("proc", "/proc/self/root"),
            ];
            for (name, target) in planted {
                std::os::unix::fs::symlink(target, dir.0.join(name)).unwrap();
            }
            assert_eq!(code(env.read_file("shadow", &l).await), "path_escape");
            assert_eq!(code(env.write_file("shadow", "x", &l).await), "path_escape");
            for d in ["abs-sib", "rel-sib", "up", "proc"] {
                assert_eq!(code(env.list_files(d).await), "path_escape", "{d}");
                assert_eq!(
                    code(env.read_file(&format!("{d}/tok.txt"), &l).await),
                    "path_escape",
                    "{d}"
                );
                assert_eq!(
                    code(env.write_file(&format!("{d}/planted.txt"), "x", &l).await),
                    "path_escape",
                    "{d}"
                );
                assert_eq!(
                    code(
                        env.edit_file(&format!("{d}/tok.txt"), "other", "x", &l)
                            .await
                    ),
                    "path_escape",
                    "{d}"
                );
            }
            // A symlinked parent directory deeper in the path, and one swapped in for a
            // directory between two calls (what a racing agent would do).
            std::fs::create_dir_all(dir.0.join("a/b")).unwrap();
            std::os::unix::fs::symlink("../../up", dir.0.join("a/b/c")).unwrap();
            assert_eq!(
                code(env.write_file("a/b/c/x", "x", &l).await),
                "path_escape"
            );
            env.write_file("work/f.txt", "1", &l).await.unwrap();
            std::fs::rename(dir.0.join("work"), dir.0.join("work-old")).unwrap();
            std::os::unix::fs::symlink(&sibling, dir.0.join("work")).unwrap();
            assert_eq!(code(env.read_file("work/f.txt", &l).await), "path_escape");
            assert_eq!(
                code(env.write_file("work/tok.txt", "x", &l).await),
                "path_escape"
            );
            assert_eq!(
                std::fs::read_to_string(other.0.join("tok.txt")).unwrap(),
                "other session's secret"
            );
            assert!(!other.0.join("planted.txt").exists());
            assert!(!other.base().join("planted.txt").exists());
            // The listing shows a symlink to outside as a plain entry, never its contents.
            let listed = env.list_files("").await.unwrap();
            assert!(listed.contains(&"abs-sib".to_string()), "{listed:?}");
        }
    }

    #[tokio::test]
    async fn the_sandbox_shows_only_what_the_work_needs() {
        let other = TempDir::new("sbx-other");
        std::fs::write(other.0.join("tok.txt"), "other").unwrap();
        let dir = TempDir::new("sbx-view");
        let env = sandbox(&dir);
        let l = limits();
        let probe = format!(
            "id -u; id -g; cat /etc/passwd; cat /etc/shadow 2>&1 | head -c 0 ; test -e /etc/shadow && echo SHADOW; \
             cat {}/tok.txt 2>/dev/null && echo SIBLING; ls /proc | grep -c '^[0-9]'; ls /; \
             tr '\\0' '\\n' < /proc/1/environ | grep -c AGENTSCOPE_ ; hostname",
            other.0.display()
        );
        let out = env.shell(&probe, &[], &l).await.unwrap();
        let lines: Vec<&str> = out.output.lines().collect();
        assert_eq!(lines[0], dir.1.uid.to_string(), "{out:?}");
        assert_eq!(lines[1], dir.1.gid.to_string(), "{out:?}");
        assert_eq!(
            lines[2],
            format!(
                "agent:x:{}:{}:agentscope session:{}:/bin/sh",
                dir.1.uid,
                dir.1.gid,
                std::fs::canonicalize(&dir.0).unwrap().display()
            ),
            "only the sandbox user: {out:?}"
        );
        assert!(!out.output.contains("root:"), "{out:?}");
        assert!(
            !out.output.contains("SHADOW") && !out.output.contains("SIBLING"),
            "{out:?}"
        );
        let procs: u32 = lines[3].parse().unwrap();
        assert!(procs <= 4, "its own /proc: {out:?}");
        let top: Vec<&str> = lines[4..lines.len() - 2].to_vec();
        for forbidden in ["root", "home", "var", "opt", "srv", "work", "run", "boot"] {
            assert!(
                !top.contains(&forbidden),
                "/{forbidden} is visible: {out:?}"
            );
        }
        assert!(
            top.contains(&"usr") && top.contains(&"etc") && top.contains(&"tmp"),
            "{out:?}"
        );
        assert_eq!(lines[lines.len() - 2], "0", "{out:?}");
        assert_eq!(lines[lines.len() - 1], "sandbox", "{out:?}");
    }

    #[tokio::test]
    async fn local_runs_as_the_session_uid_without_the_dataplanes_environment() {
        let dir = TempDir::new("local-env");
        let out = local(&dir)
            .shell(
                "id -u; tr '\\0' '\\n' 2>/dev/null </proc/$PPID/environ >/dev/null && echo PARENT-ENV || echo refused; \
                 ulimit -p 2>/dev/null || ulimit -u",
                &[],
                &Limits {
                    max_processes: Some(77),
                    ..limits()
                },
            )
            .await
            .unwrap();
        assert_eq!(
            out.output,
            format!("{}\nrefused\n77\n", dir.1.uid),
            "{out:?}"
        );
    }

    #[test]
    fn bubblewrap_never_binds_the_host_root() {
        let id = Identity {
            uid: 700_001,
            gid: 700_001,
        };
        let args: Vec<String> = bwrap_args(
            Path::new("/var/lib/agentscope/sessions/s"),
            id,
            Path::new("/var/lib/agentscope/sessions/.etc/700001"),
            &[PathBuf::from("/opt/toolchain")],
        )
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
        let joined = args.join(" ");
        assert!(
            !joined.contains("--bind / /") && !joined.contains("--ro-bind / /"),
            "{joined}"
        );
        for flag in [
            "--unshare-user --uid 700001 --gid 700001",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
            "--unshare-cgroup",
            "--die-with-parent",
            "--new-session",
            "--cap-drop ALL",
            "--proc /proc",
            "--dev /dev",
            "--tmpfs /tmp",
            "--ro-bind /opt/toolchain /opt/toolchain",
            "--ro-bind /var/lib/agentscope/sessions/.etc/700001/passwd /etc/passwd",
            "--bind /var/lib/agentscope/sessions/s /var/lib/agentscope/sessions/s --remount-ro /",
        ] {
            assert!(joined.contains(flag), "missing `{flag}` in {joined}");
        }
        // The session directory is the only writable bind.
        assert_eq!(args.iter().filter(|a| *a == "--bind").count(), 1);
        assert!(!joined.contains("/etc/shadow"));
    }

    #[test]
    fn cgroup_limits_are_used_only_where_a_cgroup_is_delegated() {
        // Not cgroup2 at all.
        let dir = TempDir::new("cg");
        let err = usable_cgroup(dir.base()).unwrap_err();
        assert!(err.contains("not a cgroup2"), "{err}");
        assert!(detect_limit_mode(dir.base().to_str().unwrap()).is_err());
        assert_eq!(detect_limit_mode("off").unwrap().0, LimitMode::Rlimits);
        // Auto-detection picks a cgroup only when it is usable; otherwise it says why.
        match detect_limit_mode("").unwrap() {
            (LimitMode::Cgroup(p), _) => usable_cgroup(&p).unwrap(),
            (LimitMode::Rlimits, why) => assert!(why.contains("/sys/fs/cgroup"), "{why}"),
        }
        let files = cgroup_limit_files(&Limits {
            memory_bytes: Some(256 << 20),
            max_processes: Some(64),
            ..limits()
        });
        assert_eq!(
            files,
            vec![
                ("pids.max", "64".to_string()),
                ("memory.max", (256u64 << 20).to_string()),
                ("memory.swap.max", "0".to_string()),
                ("cpu.max", "100000 100000".to_string()),
            ]
        );
        assert_eq!(cgroup_limit_files(&limits())[0].1, "max");
    }

    #[tokio::test]
    async fn a_fork_bomb_in_the_sandbox_stops_at_the_process_limit() {
        let dir = TempDir::new("bomb");
        let l = Limits {
            max_processes: Some(24),
            ..limits()
        };
        let out = sandbox(&dir)
            .shell(
                "bash -c 'f() { while :; do f & done; }; f' >/dev/null 2>&1 & max=0; n=0; \
                 while [ $n -lt 100 ]; do c=0; for p in /proc/[0-9]*; do \
                 read -r st 2>/dev/null < $p/stat || continue; \
                 case $st in *') Z '*|*') X '*) ;; *) c=$((c+1));; esac; done; \
                 [ $c -gt $max ] && max=$c; [ $max -ge 18 ] && n=$((n+1)); done; echo $max",
                &[],
                &l,
            )
            .await
            .unwrap();
        let max: u32 = out
            .output
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("{out:?}"));
        assert!((18..=24).contains(&max), "{out:?}");
    }

    /// A command right after one whose processes filled the session's process limit runs:
    /// whatever of the bomb the kernel is still tearing down when the next command starts does
    /// not make it fail.
    #[tokio::test]
    async fn a_command_right_after_a_fork_bomb_runs() {
        let dir = TempDir::new("after-bomb");
        let l = Limits {
            max_processes: Some(24),
            ..limits()
        };
        let env = sandbox(&dir);
        for round in 0..5 {
            let bomb = env
                .shell(
                    "bash -c 'f() { while :; do f & done; }; f' >/dev/null 2>&1 & \
                     while :; do c=0; for p in /proc/[0-9]*; do c=$((c+1)); done; \
                     [ $c -ge 20 ] && break; done; echo full",
                    &[],
                    &l,
                )
                .await
                .unwrap();
            assert!(bomb.output.contains("full"), "round {round}: {bomb:?}");
            let next = env.shell("echo next", &[], &l).await;
            let next = next.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(
                (next.exit_code, next.output.trim()),
                (Some(0), "next"),
                "round {round}"
            );
        }
    }

    // -----------------------------------------------------------------------------------------
    // Plain program calls started without sh
    // -----------------------------------------------------------------------------------------

    #[test]
    fn plain_program_calls_are_told_apart_from_what_sh_interprets() {
        let plain = plain_program_call;
        assert_eq!(plain("/bin/echo a b"), Some(vec!["/bin/echo", "a", "b"]));
        assert_eq!(plain(" \tls\t -a  "), Some(vec!["ls", "-a"]));
        assert_eq!(
            plain("cargo build -p a_b.c+d,e:f@g%h --x=1"),
            Some(vec!["cargo", "build", "-p", "a_b.c+d,e:f@g%h", "--x=1"])
        );
        // An `=` after the first word is an argument; a builtin's name with a `/` is a path.
        assert_eq!(plain("./run.sh x=1"), Some(vec!["./run.sh", "x=1"]));
        assert_eq!(plain("/bin/echo"), Some(vec!["/bin/echo"]));
        assert_eq!(plain("bin/kill -9"), Some(vec!["bin/kill", "-9"]));
        let many = format!("prog{}", " x".repeat(PLAIN_CALL_MAX_WORDS - 1));
        assert_eq!(plain(&many).map(|w| w.len()), Some(PLAIN_CALL_MAX_WORDS));
        assert_eq!(plain(&format!("{many} x")), None, "too many words");
        let not_plain = [
            "",
            "  \t ",
            // Assignment prefixes.
            "FOO=1 env",
            "a=b",
            "/x=y/prog",
            // Quoting, escapes, expansions, globs, tilde, comments.
            "'ls'",
            "\"ls\" -a",
            "l\\s",
            "ls \\*",
            "echo$HOME",
            "ls $HOME",
            "ls ${HOME}",
            "ls `pwd`",
            "ls $(pwd)",
            "ls *",
            "ls a?",
            "ls [ab]",
            "ls ~",
            "ls ~/x",
            "ls a#b",
            "ls # comment",
            // Operators, redirections, grouping.
            "a;b",
            "a ;",
            "a &",
            "a && b",
            "a || b",
            "a | b",
            "a > f",
            "a>f",
            "a 2>&1",
            "a < f",
            "(a)",
            "{ a; }",
            "a !",
            "! a",
            // Other whitespace and bytes.
            "ls\nrm x",
            "ls\r",
            "ls\x0b-a",
            "ls\x0c-a",
            "ls\0",
            "ls é",
            // Programs that would not behave as under sh.
            "setsid sleep 1",
            "/usr/bin/setsid sleep 1",
        ];
        for command in not_plain {
            assert_eq!(plain(command), None, "{command:?}");
        }
        for word in SH_RESERVED_WORDS
            .split_ascii_whitespace()
            .chain(SH_BUILTINS.split_ascii_whitespace())
        {
            assert_eq!(plain(word), None, "{word}");
            assert_eq!(plain(&format!("{word} x y")), None, "{word}");
        }
        for builtin in [
            "cd", "echo", "printf", "test", "true", "false", "kill", "pwd", "exec", "eval", ".",
            ":", "source", "export", "exit", "set", "unset", "read", "wait", "trap", "umask",
            "ulimit", "type", "command", "hash", "getopts", "jobs", "fg", "bg", "times", "if",
            "then", "fi", "for", "while", "do", "done", "case", "esac", "in", "function",
        ] {
            assert!(is_sh_own_word(builtin), "{builtin}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever plain_program_call accepts, sh splits into exactly the same words.
        #[test]
        fn a_plain_call_has_the_words_sh_gives_it(
            command in "[a-zA-Z0-9/._+=,:@%\\- \t]{0,40}",
        ) {
            if let Some(words) = plain_program_call(&command) {
                let out = std::process::Command::new("/bin/sh")
                    .arg("-c")
                    .arg(format!("set -- {command}; printf '%s\\n' \"$@\""))
                    .output()
                    .unwrap();
                let seen = String::from_utf8(out.stdout).unwrap();
                proptest::prop_assert_eq!(seen.lines().collect::<Vec<_>>(), words);
            }
        }
    }

    #[test]
    fn only_variables_sh_passes_on_unchanged_allow_a_direct_start() {
        let vars = |names: &[&str]| -> Vec<(String, String)> {
            names
                .iter()
                .map(|n| ((*n).to_owned(), "v".to_owned()))
                .collect()
        };
        assert!(env_passes_through_sh(&[]));
        assert!(env_passes_through_sh(&vars(&[
            "FOO", "PATH", "HOME", "LANG", "_A1", "a_b", "API_KEY"
        ])));
        for bad in SH_OWN_VARIABLES.split(' ').chain([
            "BASH_FUNC_ls%%",
            "BASH_ENV",
            "BASHOPTS",
            "A-B",
            "1A",
            "",
            "A B",
            "É",
        ]) {
            assert!(!env_passes_through_sh(&vars(&["FOO", bad])), "{bad:?}");
        }
    }

    /// The route a plain call takes: direct where /bin/sh is dash, else sh.
    fn direct_route() -> Route {
        if sh_is_dash() {
            Route::Direct
        } else {
            Route::Shell
        }
    }

    /// Runs `command` both ways (direct if it may, and with sh only) and returns both.
    async fn both_ways(
        env: &Environment,
        command: &str,
        vars: &[(String, String)],
        l: &Limits,
    ) -> ((ShellOutput, Route), ShellOutput) {
        let direct = env
            .shell_routed(command, vars, l, true, None)
            .await
            .unwrap();
        let (sh, route) = env
            .shell_routed(command, vars, l, false, None)
            .await
            .unwrap();
        assert_eq!(route, Route::Shell);
        (direct, sh)
    }

    fn sorted_lines(s: &str) -> Vec<&str> {
        let mut lines: Vec<&str> = s.lines().collect();
        lines.sort();
        lines
    }

    fn script(dir: &TempDir, name: &str, text: &str, mode: u32) {
        std::fs::write(dir.0.join(name), text).unwrap();
        std::fs::set_permissions(dir.0.join(name), std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[tokio::test]
    async fn plain_calls_start_without_sh_with_the_output_sh_gives() {
        let dir = TempDir::new("direct");
        let env = local(&dir);
        let l = limits();
        let root = std::fs::canonicalize(&dir.0).unwrap();
        std::fs::write(dir.0.join("b.txt"), "bee\n").unwrap();
        std::fs::write(dir.0.join(".hidden"), "").unwrap();
        for command in [
            "/bin/echo a  b",
            "ls -a",
            "ls -la b.txt",
            "id -u",
            "cat b.txt",
            "cat missing.txt",
            "sleep 0",
        ] {
            let ((direct, route), sh) = both_ways(&env, command, &[], &l).await;
            assert_eq!(route, direct_route(), "{command}");
            assert_eq!(direct, sh, "{command}");
        }
        let ((out, route), sh) = both_ways(&env, "cat missing.txt", &[], &l).await;
        assert_eq!(route, direct_route());
        assert_eq!(
            (out.exit_code, out.output.as_str()),
            (Some(1), "cat: missing.txt: No such file or directory\n")
        );
        assert_eq!(out, sh);

        // The environment is exactly what sh passes on: the given one, the defaults, PWD.
        let r = root.display();
        let given = vec![
            ("FOO".to_owned(), "bar baz".to_owned()),
            ("LANG".to_owned(), "C".to_owned()),
        ];
        let path = vec![("PATH".to_owned(), "/bin:/usr/bin".to_owned())];
        let cases = [
            ("/usr/bin/env", vec![], DEFAULT_PATH, "C.UTF-8", None),
            ("env", given.clone(), DEFAULT_PATH, "C", Some("bar baz")),
            ("env", path, "/bin:/usr/bin", "C.UTF-8", None),
        ];
        for (command, vars, path, lang, foo) in cases {
            let ((out, route), sh) = both_ways(&env, command, &vars, &l).await;
            assert_eq!(route, direct_route(), "{command} {vars:?}");
            let mut expected = vec![
                format!("HOME={r}"),
                format!("LANG={lang}"),
                format!("PATH={path}"),
                format!("PWD={r}"),
            ];
            if let Some(foo) = foo {
                expected.insert(0, format!("FOO={foo}"));
            }
            assert_eq!(sorted_lines(&out.output), expected, "{out:?}");
            assert_eq!(sorted_lines(&out.output), sorted_lines(&sh.output));
            assert_eq!((out.exit_code, sh.exit_code), (Some(0), Some(0)));
        }
    }

    #[tokio::test]
    async fn commands_sh_interprets_still_run_with_sh() {
        let dir = TempDir::new("via-sh");
        let env = local(&dir);
        let l = limits();
        let root = std::fs::canonicalize(&dir.0).unwrap().display().to_string();
        std::fs::write(dir.0.join("a.txt"), "").unwrap();
        std::fs::write(dir.0.join("b.txt"), "").unwrap();
        let cases = [
            ("echo $HOME", format!("{root}\n")),
            ("/bin/echo ~", format!("{root}\n")),
            ("cd / && pwd", "/\n".to_owned()),
            ("ls *", "a.txt\nb.txt\n".to_owned()),
            ("ls | /usr/bin/wc -l", "2\n".to_owned()),
            ("echo hi", "hi\n".to_owned()),
            ("'/bin/echo' 'a  b'", "a  b\n".to_owned()),
            ("/bin/echo a # not an argument", "a\n".to_owned()),
            ("/bin/echo x > out.txt", String::new()),
            ("FOO=1 /usr/bin/env", String::new()),
        ];
        for (command, expected) in cases {
            let (out, route) = env
                .shell_routed(command, &[], &l, true, None)
                .await
                .unwrap();
            assert_eq!(route, Route::Shell, "{command}");
            assert_eq!(out.exit_code, Some(0), "{command}: {out:?}");
            if command.starts_with("FOO=1") {
                assert!(out.output.lines().any(|l| l == "FOO=1"), "{out:?}");
            } else {
                assert_eq!(out.output, expected, "{command}");
            }
        }
        assert_eq!(
            std::fs::read_to_string(dir.0.join("out.txt")).unwrap(),
            "x\n"
        );
        // A variable sh rewrites keeps the command with sh: dash replaces a PWD that is not its
        // working directory.
        let vars = [("PWD".to_owned(), "/".to_owned())];
        let (out, route) = env
            .shell_routed("env", &vars, &l, true, None)
            .await
            .unwrap();
        assert_eq!(route, Route::Shell);
        assert!(
            out.output.lines().any(|l| l == format!("PWD={root}")),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn a_program_that_cannot_run_gets_shs_message_and_exit_code() {
        let dir = TempDir::new("direct-fail");
        let env = local(&dir);
        let l = limits();
        // Not found: decided before anything is started.
        for (command, word) in [
            ("no-such-program-agentscope a", "no-such-program-agentscope"),
            ("./missing", "./missing"),
            ("/nonexistent/prog x", "/nonexistent/prog"),
        ] {
            let ((out, route), sh) = both_ways(&env, command, &[], &l).await;
            assert_eq!(route, Route::Shell, "{command}");
            assert_eq!(out.exit_code, Some(127), "{command}");
            assert_eq!(out.output, format!("/bin/sh: 1: {word}: not found\n"));
            assert_eq!(out, sh);
        }
        // A program with no execute permission for anyone (left to sh at once), and one only
        // root may execute (it passes the check, made as this process's user, the session's
        // exec fails, and sh reports it).
        std::fs::copy("/bin/true", dir.0.join("noexec")).unwrap();
        std::fs::set_permissions(dir.0.join("noexec"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        std::fs::copy("/bin/true", dir.0.join("rootonly")).unwrap();
        std::fs::set_permissions(
            dir.0.join("rootonly"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        let mut denied = vec!["./noexec"];
        if is_root() {
            denied.push("./rootonly");
        }
        for command in denied {
            assert_eq!(
                direct_program(vec![command.to_owned()], &dir.0, DEFAULT_PATH).is_some(),
                sh_is_dash() && command == "./rootonly"
            );
            let ((out, route), sh) = both_ways(&env, command, &[], &l).await;
            assert_eq!(route, Route::Shell, "{command}");
            assert_eq!(out.exit_code, Some(126), "{command}");
            assert_eq!(
                out.output,
                format!("/bin/sh: 1: {command}: Permission denied\n")
            );
            assert_eq!(out, sh);
        }
        // The first match in PATH cannot be executed by the session (root's, or nobody's when
        // not root): sh goes on to the next one.
        let root = std::fs::canonicalize(&dir.0).unwrap();
        let first = if is_root() { 0o700 } else { 0o644 };
        for (sub, mode) in [("bin1", first), ("bin2", 0o755)] {
            std::fs::create_dir(dir.0.join(sub)).unwrap();
            std::fs::copy("/bin/true", dir.0.join(sub).join("mytool")).unwrap();
            std::fs::set_permissions(
                dir.0.join(sub).join("mytool"),
                std::fs::Permissions::from_mode(mode),
            )
            .unwrap();
        }
        let vars = [(
            "PATH".to_owned(),
            format!("{r}/bin1:{r}/bin2:/usr/bin:/bin", r = root.display()),
        )];
        let ((out, route), sh) = both_ways(&env, "mytool x", &vars, &l).await;
        assert_eq!(route, Route::Shell);
        assert_eq!((out.exit_code, out.output.as_str()), (Some(0), ""));
        assert_eq!(out, sh);
    }

    #[tokio::test]
    async fn scripts_run_as_sh_runs_them() {
        let dir = TempDir::new("direct-scripts");
        let env = local(&dir);
        let l = limits();
        // Without a shebang: sh runs it itself (the kernel would refuse it).
        script(&dir, "plain", "echo from $0 $1\n", 0o755);
        let ((out, route), sh) = both_ways(&env, "./plain x", &[], &l).await;
        assert_eq!(route, Route::Shell);
        assert_eq!(
            (out.exit_code, out.output.as_str()),
            (Some(0), "from ./plain x\n")
        );
        assert_eq!(out, sh);
        // With one: started directly, so its parent is this process, not a shell.
        script(&dir, "ppid", "#!/bin/sh\necho $PPID\n", 0o755);
        let ((out, route), sh) = both_ways(&env, "./ppid", &[], &l).await;
        assert_eq!(route, direct_route());
        let me = std::process::id().to_string();
        assert_eq!(out.output.trim() == me, sh_is_dash(), "{out:?}");
        assert_ne!(sh.output.trim(), me, "{sh:?}");
        // An interpreter that does not exist: the exec fails, sh reports it.
        script(&dir, "badshebang", "#!/nonexistent/interp\n", 0o755);
        let ((out, route), sh) = both_ways(&env, "./badshebang", &[], &l).await;
        assert_eq!(route, Route::Shell);
        assert_eq!(
            (out.exit_code, out.output.as_str()),
            (Some(127), "/bin/sh: 1: ./badshebang: not found\n")
        );
        assert_eq!(out, sh);
    }

    #[tokio::test]
    async fn a_program_killed_by_a_signal_is_reported_as_sh_reports_it() {
        let dir = TempDir::new("direct-signal");
        let env = local(&dir);
        let l = limits();
        for (signal, code, note) in [
            ("SEGV", 139, "Segmentation fault\n"),
            ("TERM", 143, "Terminated\n"),
            ("KILL", 137, "Killed\n"),
            ("USR1", 138, "User defined signal 1\n"),
            ("INT", 130, ""),
            ("PIPE", 141, ""),
        ] {
            let name = format!("kill-{signal}");
            script(
                &dir,
                &name,
                &format!("#!/bin/sh\necho before\nkill -{signal} $$\necho after\n"),
                0o755,
            );
            let ((out, route), sh) = both_ways(&env, &format!("./{name}"), &[], &l).await;
            assert_eq!(route, direct_route(), "{signal}");
            assert_eq!(out.exit_code, Some(code), "{signal}: {out:?}");
            assert_eq!(out.output, format!("before\n{note}"), "{signal}");
            assert_eq!(out, sh, "{signal}");
        }
    }

    #[tokio::test]
    async fn a_direct_start_keeps_the_identity_limits_and_process_group() {
        let dir = TempDir::new("direct-limits");
        let env = local(&dir);
        let l = Limits {
            max_processes: Some(77),
            memory_bytes: Some(1 << 30),
            cpu_secs: Some(30),
            ..limits()
        };
        let (out, route) = env
            .shell_routed(
                "cat /proc/self/status /proc/self/limits",
                &[],
                &l,
                true,
                None,
            )
            .await
            .unwrap();
        assert_eq!(route, direct_route());
        let field = |name: &str| -> Vec<String> {
            let line = out
                .output
                .lines()
                .find(|line| line.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {out:?}"));
            line[name.len()..]
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        };
        if is_root() {
            let (uid, gid) = (dir.1.uid.to_string(), dir.1.gid.to_string());
            assert_eq!(field("Uid:"), vec![uid.as_str(); 4]);
            assert_eq!(field("Gid:"), vec![gid.as_str(); 4]);
            assert!(field("Groups:").is_empty(), "{out:?}");
            assert_eq!(field("Max processes")[..2], ["77", "77"]);
        }
        assert_eq!(
            field("Max address space")[..2],
            ["1073741824", "1073741824"]
        );
        assert_eq!(field("Max cpu time")[..2], ["30", "30"]);
        // The program itself leads the process group that is killed at the end (under sh, the
        // shell does).
        assert_eq!(field("NSpgid:") == field("NSpid:"), sh_is_dash(), "{out:?}");
        // Its signal state is a fresh program's: nothing blocked, SIGPIPE back to its default
        // (std ignores it in this process).
        assert_eq!(field("SigBlk:"), ["0000000000000000"], "{out:?}");
        let ignored = u64::from_str_radix(&field("SigIgn:")[0], 16).unwrap();
        assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "{out:?}");

        // Its background children do not outlive the call; a timeout kills it.
        let marker = format!("1011{}", std::process::id() % 1000);
        script(
            &dir,
            "bg",
            &format!("#!/bin/sh\n/bin/sleep {marker} &\necho bg\n"),
            0o755,
        );
        let (out, route) = env
            .shell_routed("./bg", &[], &limits(), true, None)
            .await
            .unwrap();
        assert_eq!(route, direct_route());
        assert_eq!((out.exit_code, out.output.as_str()), (Some(0), "bg\n"));
        let left = processes_with(&marker);
        assert!(left.is_empty(), "background process survived: {left:?}");

        let marker = format!("1013{}", std::process::id() % 1000);
        let short = Limits {
            timeout: Duration::from_millis(500),
            ..limits()
        };
        let (out, route) = env
            .shell_routed(&format!("sleep {marker}"), &[], &short, true, None)
            .await
            .unwrap();
        assert_eq!(route, direct_route());
        assert!(out.timed_out && out.exit_code.is_none(), "{out:?}");
        let left = processes_with(&marker);
        assert!(left.is_empty(), "the timed-out program survived: {left:?}");
    }
}
