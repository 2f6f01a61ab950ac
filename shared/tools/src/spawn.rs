//! Starting a process without copying the caller's address space: a shell tool's (here, for the
//! dataplane and the Worker), and svc-host's attempt sentinel.
//!
//! std (and so tokio) starts a process with `posix_spawn` only when no uid, gid or `pre_exec`
//! closure is set. A tool runs under the session's uid with limits set before `exec`, so std
//! would `fork`: the kernel then copies the page tables of the whole service (tens of MB mapped,
//! many threads), and every page either side writes afterwards is copied once more. [`spawn`]
//! does what glibc's `posix_spawn` does instead: `clone(CLONE_VM | CLONE_VFORK)` on a small stack
//! of its own. The child shares the caller's memory until it calls `execve`, while the calling
//! thread waits, so it runs only async-signal-safe code on values prepared beforehand, and it
//! changes its identity with raw system calls (glibc's `setuid` coordinates the change with the
//! threads of the process it believes it is in: the caller's).
//!
//! The child's steps are std's: standard streams, signal dispositions reset and every other
//! descriptor marked close-on-exec (both before a hold, see [`hold`], so that a held child's start
//! does not pay for them; std leaves descriptors as they are), supplementary groups, gid, uid,
//! working directory, a process group of its own, the caller's limits (see [`ChildSetup`]), the
//! signal mask cleared, `execve`. A program that sets its own signal dispositions and mask first
//! thing (svc-host's sentinel) can skip both ([`Spec::signals`]): it then starts with every signal
//! blocked and the caller's ignored signals ignored, its handlers reset by `execve`, and the
//! child spends no system call on the 64 signals (glibc's `posix_spawn`, which std uses, spends
//! two each). The first step that fails writes its errno where the caller reads it, and
//! [`spawn_with`] returns that error having reaped the child, as std does.
//!
//! The caller waits on a pidfd (`CLONE_PIDFD`, Linux 5.3 or later) and reaps with `waitpid`. A
//! kernel without pidfds ignores the flag (or refuses it): the caller then waits for SIGCHLD.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use tokio::io::unix::AsyncFd;

use crate::env::Identity;

/// The child's stack: it runs a handful of system calls, no allocation and no formatting.
const STACK_SIZE: usize = 64 * 1024;

/// Limits the child applies to itself after switching to the session's identity, before
/// `execve`, so the command cannot skip them.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChildSetup {
    pub memory: Option<u64>,
    pub nproc: Option<u64>,
    pub cpu: Option<u64>,
    /// An open `cgroup.procs` of the cgroup the child moves itself into first.
    pub cgroup_procs: Option<RawFd>,
}

/// What to start: `program` (a path; no PATH lookup) with `argv`, exactly the environment
/// `env`, in `cwd`, optionally as `identity` (dropping every supplementary group).
pub struct Spec {
    pub program: PathBuf,
    pub argv: Vec<OsString>,
    pub env: BTreeMap<OsString, OsString>,
    pub cwd: PathBuf,
    pub identity: Option<Identity>,
    pub setup: ChildSetup,
    /// Holds the child before its `execve` until its [`Release`] says (see [`hold`]).
    pub held: Option<Held>,
    /// What the child does about signals before its `execve`.
    pub signals: Signals,
}

/// What a child does about signals before its `execve`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Signals {
    /// As std: every handled signal (and SIGPIPE) back to its default, the mask cleared.
    #[default]
    Reset,
    /// Nothing: the program starts with every signal blocked and must set its own mask (and
    /// SIGPIPE's disposition, which the caller ignores) before anything else.
    LeftToTheProgram,
}

/// The child's standard streams: descriptors of the caller, each duplicated onto 0, 1 and 2 in
/// the child (the caller closes its own copies once [`spawn_with`] returns).
#[derive(Clone, Copy, Debug)]
pub struct Streams {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
}

/// A child's hold, shared with its [`Release`]: held, go, or stop.
pub struct Held(Arc<AtomicU32>);

/// Lets a held child run its program, or (dropped without [`Release::go`]) stops it.
pub struct Release(Arc<AtomicU32>);

const HELD: u32 = 0;
const GO: u32 = 1;
const STOP: u32 = 2;

/// A hold for a child, and its release. A child started with [`Spec::held`] is created with its
/// standard streams and then waits, before it changes its identity (as the caller, so nothing of
/// the identity it is about to take can signal it), until the release goes (it then does the
/// rest of its start and execs) or is dropped (it exits, and [`spawn`] fails with ECANCELED).
/// [`spawn`] returns only once the child has decided, so a held spawn runs on a thread that may
/// block: the caller starts it there, does what must come first (a commit that the program
/// runs), and then lets it go. The child dies with the caller's process.
pub fn hold() -> (Held, Release) {
    let state = Arc::new(AtomicU32::new(HELD));
    (Held(state.clone()), Release(state))
}

impl Release {
    pub fn go(self) {
        self.decide(GO);
    }

    fn decide(&self, to: u32) {
        if self
            .0
            .compare_exchange(HELD, to, Ordering::Release, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: FUTEX_WAKE on our own live atomic; it reads nothing else.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.0.as_ptr(),
                    libc::FUTEX_WAKE,
                    i32::MAX,
                    std::ptr::null::<libc::timespec>(),
                )
            };
        }
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        self.decide(STOP);
    }
}

/// A started process: the leader of its own process group, not reaped until [`Child::wait`]
/// returns (until then its pid cannot be reused). Dropped before that, it is killed and reaped
/// in the background, as tokio's `kill_on_drop`.
pub struct Child {
    pid: libc::pid_t,
    exited: Exited,
    status: Option<ExitStatus>,
}

/// How the caller learns that the child may have exited.
enum Exited {
    /// Its pidfd turns readable.
    Pidfd(AsyncFd<OwnedFd>),
    /// A kernel without pidfds: some child of this process changed state (created before the
    /// first look at the child, so no exit is missed between the two).
    Sigchld(tokio::signal::unix::Signal),
}

/// Tests set this to have the child keep descriptors from the program as an older kernel
/// makes it: 1, without `CLOSE_RANGE_CLOEXEC`; 2, without `close_range`.
#[cfg(test)]
static OLD_KERNEL: AtomicU32 = AtomicU32::new(0);

/// Tests set this to start children as a kernel without pidfds would.
#[cfg(test)]
static WITHOUT_PIDFD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Everything the child reads, prepared by the caller; `err` is the one thing it writes.
struct ChildArgs {
    program: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    cwd: CString,
    streams: Streams,
    signals: Signals,
    identity: Option<Identity>,
    setup: ChildSetup,
    /// The hold's state (in memory the child shares), or null.
    held: *const AtomicU32,
    /// This process, the child's parent.
    parent: libc::pid_t,
    err: AtomicI32,
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "nul byte found in provided data",
        )
    })
}

/// Starts `spec` with stdin from /dev/null and stdout and stderr into `output` (the write end
/// of a pipe; the caller drops its own copy). An error means the program did not start, and
/// nothing of the child is left.
pub(crate) fn spawn(spec: Spec, output: &OwnedFd) -> io::Result<Child> {
    spawn_with(
        spec,
        Streams {
            stdin: dev_null()?,
            stdout: output.as_raw_fd(),
            stderr: output.as_raw_fd(),
        },
    )
}

/// `/dev/null`, opened once (close-on-exec) for the children's stdin: a descriptor to pass in
/// [`Streams`].
pub fn dev_null() -> io::Result<RawFd> {
    static DEV_NULL: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();
    if let Some(f) = DEV_NULL.get() {
        return Ok(f.as_raw_fd());
    }
    let f = std::fs::File::open("/dev/null")?;
    Ok(DEV_NULL.get_or_init(|| f).as_raw_fd())
}

/// Starts `spec` with `streams` as its standard streams. An error means the program did not
/// start, and nothing of the child is left.
pub fn spawn_with(spec: Spec, streams: Streams) -> io::Result<Child> {
    let program = cstring(spec.program.as_os_str())?;
    let argv_owned = spec
        .argv
        .iter()
        .map(|a| cstring(a))
        .collect::<io::Result<Vec<_>>>()?;
    let envp_owned = spec
        .env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone();
            kv.push("=");
            kv.push(v);
            cstring(&kv)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let mut argv: Vec<*const libc::c_char> = argv_owned.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = envp_owned.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let args = ChildArgs {
        program,
        argv,
        envp,
        cwd: cstring(spec.cwd.as_os_str())?,
        streams,
        signals: spec.signals,
        identity: spec.identity,
        setup: spec.setup,
        held: spec
            .held
            .as_ref()
            .map_or(std::ptr::null(), |h| Arc::as_ptr(&h.0)),
        // SAFETY: no arguments.
        parent: unsafe { libc::getpid() },
        err: AtomicI32::new(0),
    };
    let stack = Stack::take()?;

    let flags = libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD;
    #[cfg(test)]
    let flags = if WITHOUT_PIDFD.load(Ordering::Relaxed) {
        flags & !libc::CLONE_PIDFD
    } else {
        flags
    };
    let (pid, pidfd) = match clone_child(&args, &stack, flags) {
        // A kernel older than pidfds may refuse the flag rather than ignore it.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            clone_child(&args, &stack, flags & !libc::CLONE_PIDFD)?
        }
        r => r?,
    };
    // The child has exec'd or exited (CLONE_VFORK): its stack is free for the next one.
    stack.give_back();
    // SAFETY: a descriptor CLONE_PIDFD stored, which nothing else owns.
    let pidfd = (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) });
    let failed = args.err.load(Ordering::Acquire);
    if failed != 0 {
        // The child has exited (with 127); reap it.
        reap_blocking(pid);
        return Err(io::Error::from_raw_os_error(failed));
    }
    let exited = match pidfd {
        // SAFETY: the AsyncFd owns the pidfd, which nothing replaces or closes while it does.
        Some(fd) => unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map(Exited::Pidfd)
            .map_err(io::Error::from),
        None => tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())
            .map(Exited::Sigchld),
    };
    match exited {
        Ok(exited) => Ok(Child {
            pid,
            exited,
            status: None,
        }),
        Err(e) => {
            // SAFETY: kill has no memory arguments; the child is ours and not reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            reap_blocking(pid);
            Err(e)
        }
    }
}

/// `clone(flags)` running [`child_main`] on `stack`: the child's pid and its pidfd (-1 if the
/// kernel gave none).
fn clone_child(
    args: &ChildArgs,
    stack: &Stack,
    flags: libc::c_int,
) -> io::Result<(libc::pid_t, libc::c_int)> {
    let mut pidfd: libc::c_int = -1;
    // SAFETY: sigset_t is plain data, initialised by sigfillset before use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: every pointer passed is valid for the call. Signals stay blocked in this thread
    // while the child shares its memory (no handler may run in the child on the caller's
    // data), and the child sets its own mask before execve. `child_main` gets `args`, which
    // outlives the clone: with CLONE_VFORK this thread resumes only once the child has called
    // execve or exited. The stack is ours and is freed after that.
    let (pid, clone_err) = unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child_main,
            stack.top(),
            flags,
            std::ptr::from_ref(args).cast_mut().cast(),
            &mut pidfd as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::pid_t>(),
        );
        let clone_err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        (pid, clone_err)
    };
    if pid < 0 {
        return Err(clone_err);
    }
    Ok((pid, pidfd))
}

/// The child's stack: anonymous memory with a guard page below it.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

// SAFETY: a mapping of this process, used by one child at a time (the one started on it, while
// its starting thread waits); any thread may free it.
unsafe impl Send for Stack {}

/// Stacks of children that have exec'd, for the next ones: unmapping one costs every other
/// CPU running this process a TLB shootdown (an inter-processor interrupt, a hypervisor exit on
/// a virtual machine), and mapping one three more system calls.
static FREE_STACKS: std::sync::Mutex<Vec<Stack>> = std::sync::Mutex::new(Vec::new());

/// How many free stacks are kept (one per thread starting children at the same time).
const KEPT_STACKS: usize = 8;

impl Stack {
    /// A free stack, or a new one.
    fn take() -> io::Result<Stack> {
        let free = FREE_STACKS.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match free {
            Some(s) => Ok(s),
            None => Stack::new(),
        }
    }

    /// Keeps this stack for a later child (or frees it when enough are kept).
    fn give_back(self) {
        let mut free = FREE_STACKS.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < KEPT_STACKS {
            free.push(self);
        }
    }

    fn new() -> io::Result<Stack> {
        let page = 4096;
        let len = STACK_SIZE + page;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the first page of our own mapping.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of our mapping; the stack grows down from there, and the
        // mapping's length keeps it 16-byte aligned.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer in use.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// The child, between clone and execve. It shares the caller's memory, so it only makes
/// system calls on what `ChildArgs` holds, and never returns into Rust code of the caller.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the caller's `ChildArgs`, alive until this process execs or exits.
    let a = unsafe { &*arg.cast::<ChildArgs>() };
    let err = child_setup(a);
    a.err
        .store(if err == 0 { libc::EINVAL } else { err }, Ordering::Release);
    // SAFETY: ends this process (exit_group) without running anything of the caller's.
    unsafe { libc::_exit(127) }
}

/// The child's `cgroup.procs` descriptor, when it has one above the standard streams.
fn cgroup_fd(a: &ChildArgs) -> Option<libc::c_uint> {
    a.setup
        .cgroup_procs
        .and_then(|fd| libc::c_uint::try_from(fd).ok())
        .filter(|&fd| fd >= 3)
}

/// Runs the child's steps and execs; returns the errno of the step that failed.
fn child_setup(a: &ChildArgs) -> libc::c_int {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // SAFETY (this whole function): system calls on descriptors, strings and arrays the caller
    // prepared; none allocates, locks or touches another thread.
    unsafe {
        let io = a.streams;
        if libc::dup2(io.stdin, 0) < 0
            || libc::dup2(io.stdout, 1) < 0
            || libc::dup2(io.stderr, 2) < 0
        {
            return errno();
        }
        if a.signals == Signals::Reset {
            // Handlers are the caller's code: none may run here, and execve would reset them
            // anyway. SIGPIPE, which std ignores in the caller, is the default again, as std
            // does for its children; what else is ignored stays ignored, as with std. Done
            // while every signal is still blocked, and before a hold: a held child's start
            // (once its caller lets it go) does not wait for these 64 system calls.
            for sig in 1..=64 {
                if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                    continue;
                }
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
                    continue;
                }
                if old.sa_sigaction != libc::SIG_DFL
                    && (old.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE)
                {
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(sig, &dfl, std::ptr::null_mut());
                }
            }
        }
        // No descriptor of the caller but the three streams reaches the program: every other
        // one of this child's table (a copy of the caller's) closes at `execve`, also one the
        // service inherited without close-on-exec from whoever started it. Marked, not closed:
        // the cgroup's `cgroup.procs` is written below. Before a hold, like the signals.
        #[cfg(not(test))]
        let kernel = 0;
        // What a test says this kernel lacks: 1, CLOSE_RANGE_CLOEXEC (before 5.11); 2,
        // close_range (before 5.9).
        #[cfg(test)]
        let kernel = OLD_KERNEL.load(Ordering::Relaxed);
        let range = |from: libc::c_uint, to: libc::c_uint, flags: libc::c_uint| {
            from > to || libc::syscall(libc::SYS_close_range, from, to, flags) == 0
        };
        let marked = kernel < 1 && range(3, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC);
        // Closed now instead, but for the cgroup's.
        let closed = marked
            || kernel < 2
                && match cgroup_fd(a) {
                    Some(cg) => range(3, cg - 1, 0) && range(cg + 1, libc::c_uint::MAX, 0),
                    None => range(3, libc::c_uint::MAX, 0),
                };
        if !closed {
            // One by one, up to the descriptor limit (at most 65,536 of them).
            let mut lim: libc::rlimit = std::mem::zeroed();
            let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                lim.rlim_cur.min(1 << 16) as libc::c_int
            } else {
                1024
            };
            for fd in 3..top {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
        // Held: wait (signals still blocked) until the caller says, still as the caller's own
        // identity: no process of the session's uid (a tool left running) may stop, kill or
        // attach to it, which would keep the caller's thread waiting for ever. The caller may
        // die meanwhile; its thread that started this child cannot end before the child execs
        // or exits (CLONE_VFORK), so the child is told by the parent-death signal (unset once
        // it goes on; the identity change would clear it too).
        if !a.held.is_null() {
            let held = &*a.held;
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return errno();
            }
            if libc::getppid() != a.parent {
                return libc::ECANCELED;
            }
            loop {
                match held.load(Ordering::Acquire) {
                    HELD => {
                        // Returns at once if the state moved on since the load.
                        libc::syscall(
                            libc::SYS_futex,
                            held.as_ptr(),
                            libc::FUTEX_WAIT,
                            HELD,
                            std::ptr::null::<libc::timespec>(),
                        );
                    }
                    GO => break,
                    _ => return libc::ECANCELED,
                }
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, 0) != 0 {
                return errno();
            }
        }
        if let Some(id) = a.identity {
            // Raw system calls: glibc's wrappers coordinate the change with the threads of the
            // process whose memory this is.
            if libc::syscall(SYS_SETGROUPS, 0, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(SYS_SETGID, id.gid) != 0
                || libc::syscall(SYS_SETUID, id.uid) != 0
            {
                return errno();
            }
            // Until its `execve` this process shares the caller's memory while it runs as the
            // session's uid: no process of that uid may attach to it or read it through /proc
            // (environ, mem). The uid change makes the memory non-dumpable only where
            // fs.suid_dumpable is 0; this does it everywhere. `execve` sets the program's own.
            if libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 {
                return errno();
            }
        }
        if libc::chdir(a.cwd.as_ptr()) != 0 || libc::setpgid(0, 0) != 0 {
            return errno();
        }
        let s = a.setup;
        if let Some(fd) = s.cgroup_procs {
            // "0" moves the writing process; the fd was opened (and checked) by the caller.
            if libc::write(fd, b"0\n".as_ptr().cast(), 2) != 2 {
                return errno();
            }
        }
        for (resource, value) in [
            (libc::RLIMIT_AS, s.memory),
            (libc::RLIMIT_NPROC, s.nproc),
            (libc::RLIMIT_CPU, s.cpu),
        ] {
            if let Some(v) = value {
                let lim = libc::rlimit {
                    rlim_cur: v,
                    rlim_max: v,
                };
                if libc::setrlimit(resource, &lim) != 0 {
                    return errno();
                }
            }
        }
        if a.signals == Signals::Reset {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        }
        libc::execve(a.program.as_ptr(), a.argv.as_ptr(), a.envp.as_ptr());
        errno()
    }
}

#[cfg(target_pointer_width = "64")]
const SYS_SETGROUPS: libc::c_long = libc::SYS_setgroups;
#[cfg(target_pointer_width = "64")]
const SYS_SETGID: libc::c_long = libc::SYS_setgid;
#[cfg(target_pointer_width = "64")]
const SYS_SETUID: libc::c_long = libc::SYS_setuid;
#[cfg(target_pointer_width = "32")]
const SYS_SETGROUPS: libc::c_long = libc::SYS_setgroups32;
#[cfg(target_pointer_width = "32")]
const SYS_SETGID: libc::c_long = libc::SYS_setgid32;
#[cfg(target_pointer_width = "32")]
const SYS_SETUID: libc::c_long = libc::SYS_setuid32;

/// `waitpid(pid, WNOHANG)`: the status once `pid` has exited (and is reaped).
fn try_reap(pid: libc::pid_t) -> io::Result<Option<ExitStatus>> {
    loop {
        let mut status = 0;
        // SAFETY: writes the status into our own integer.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 => return Ok(None),
            p if p == pid => return Ok(Some(ExitStatus::from_raw(status))),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Blocks until `pid` (ours, killed or exiting) is reaped.
fn reap_blocking(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: writes the status into our own integer.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}

impl Child {
    /// The pid (= process group id) until the process is reaped.
    pub fn id(&self) -> Option<u32> {
        match self.status {
            None => u32::try_from(self.pid).ok(),
            Some(_) => None,
        }
    }

    /// Waits for the process to exit and reaps it. Cancel-safe.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        loop {
            match &mut self.exited {
                Exited::Pidfd(fd) => {
                    let mut ready = fd.readable().await?;
                    if let Some(status) = try_reap(self.pid)? {
                        self.status = Some(status);
                        return Ok(status);
                    }
                    ready.clear_ready();
                }
                Exited::Sigchld(signal) => {
                    if let Some(status) = try_reap(self.pid)? {
                        self.status = Some(status);
                        return Ok(status);
                    }
                    signal.recv().await;
                }
            }
        }
    }

    /// Sends SIGKILL unless the process has been reaped.
    pub fn start_kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: kill has no memory arguments; the pid is ours and not reaped.
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        let _ = self.start_kill();
        let pid = self.pid;
        if let Ok(Some(_)) = try_reap(pid) {
            return;
        }
        let reap = move || reap_blocking(pid);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(reap);
            }
            Err(_) => {
                let _ = std::thread::Builder::new()
                    .name("reap-tool".into())
                    .spawn(reap);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Read as _;
    use std::path::Path;

    fn spec(program: &Path, argv: &[&str], identity: Option<Identity>) -> Spec {
        Spec {
            program: program.to_owned(),
            argv: argv.iter().map(OsString::from).collect(),
            env: BTreeMap::from([("PATH".into(), "/usr/bin:/bin".into())]),
            cwd: PathBuf::from("/"),
            identity,
            setup: ChildSetup::default(),
            held: None,
            signals: Signals::Reset,
        }
    }

    fn run(spec: Spec) -> io::Result<(Child, std::io::PipeReader)> {
        let (reader, writer) = std::io::pipe()?;
        let child = spawn(spec, &OwnedFd::from(writer))?;
        Ok((child, reader))
    }

    /// No child of this process is left unreaped (nextest runs each test in its own process).
    fn no_children_left() -> bool {
        let mut status = 0;
        // SAFETY: writes the status into our own integer.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
    }

    /// A process's /proc stat after its `(comm)`: state, ppid, ...
    fn stat_fields(pid: u32) -> Option<Vec<String>> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The comm may hold spaces and parentheses: read after its last ')'.
        let (_, rest) = stat.rsplit_once(')')?;
        Some(rest.split_whitespace().map(str::to_owned).collect())
    }

    /// Waits (with a deadline) until a child of this process waits before its `execve`; its pid.
    pub(crate) async fn held_child() -> u32 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Some(p) = before_exec_children_of(std::process::id()).first() {
                return *p;
            }
            assert!(std::time::Instant::now() < deadline, "no held child");
            tokio::task::yield_now().await;
        }
    }

    /// Children of `parent` that still run this test binary (they have not called `execve`).
    pub(crate) fn before_exec_children_of(parent: u32) -> Vec<u32> {
        let me = std::env::current_exe().unwrap();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&p| {
                stat_fields(p).is_some_and(|s| s[1] == parent.to_string())
                    && std::fs::read_link(format!("/proc/{p}/exe")).ok().as_ref() == Some(&me)
            })
            .collect()
    }

    /// The effective uids of every thread of this process.
    fn thread_uids() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .map(|t| {
                let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap();
                let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
                line.split_whitespace().nth(2).unwrap().to_owned()
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
    async fn a_child_gets_its_identity_and_the_callers_threads_keep_theirs() {
        let before = thread_uids();
        assert!(before.len() > 3, "{before:?}");
        let is_root = unsafe { libc::geteuid() } == 0;
        let id = is_root.then_some(Identity {
            uid: 731_001,
            gid: 731_002,
        });
        let (mut child, mut out) = run(spec(
            Path::new("/bin/cat"),
            &["cat", "/proc/self/status"],
            id,
        ))
        .unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status:?}");
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        if is_root {
            let field = |name: &str| -> Vec<&str> {
                let line = text.lines().find(|l| l.starts_with(name)).unwrap();
                line[name.len()..].split_whitespace().collect()
            };
            assert_eq!(field("Uid:"), ["731001"; 4], "{text}");
            assert_eq!(field("Gid:"), ["731002"; 4], "{text}");
            assert!(field("Groups:").is_empty(), "{text}");
        }
        assert_eq!(thread_uids(), before);
        assert!(child.id().is_none());
        assert!(no_children_left());
    }

    #[tokio::test]
    async fn a_program_that_cannot_start_is_an_error_and_leaves_no_child() {
        let err = run(spec(Path::new("/nonexistent/program"), &["x"], None))
            .err()
            .unwrap();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert!(no_children_left());
        // A working directory that does not exist fails the start the same way.
        let mut s = spec(Path::new("/bin/true"), &["true"], None);
        s.cwd = PathBuf::from("/nonexistent-directory");
        let err = run(s).err().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert!(no_children_left());
        let err = run(spec(Path::new("/bin/true"), &["a\0b"], None))
            .err()
            .unwrap();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }

    #[tokio::test]
    async fn a_child_dropped_before_it_exits_is_killed_and_reaped() {
        let (child, _out) = run(spec(Path::new("/bin/sleep"), &["sleep", "1000"], None)).unwrap();
        let pid = child.id().unwrap();
        drop(child);
        // The reap runs on the blocking pool: wait for it, with a deadline.
        let reaped = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while !no_children_left() {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(reaped.is_ok(), "{pid} was not reaped");
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }

    /// Children started at the same time from several threads each get a stack of their own
    /// (each runs its own program with its own arguments), and the stacks kept for later
    /// children stay few.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn children_started_at_once_from_several_threads_each_run_their_own_program() {
        let rt = tokio::runtime::Handle::current();
        let threads: Vec<_> = (0..6)
            .map(|t| {
                let rt = rt.clone();
                std::thread::spawn(move || {
                    let _in = rt.enter();
                    for i in 0..40 {
                        let word = format!("t{t}-{i}");
                        let (child, mut out) =
                            run(spec(Path::new("/bin/echo"), &["echo", &word], None)).unwrap();
                        let mut text = String::new();
                        out.read_to_string(&mut text).unwrap();
                        assert_eq!(text, format!("{word}\n"));
                        drop(child);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let kept = FREE_STACKS.lock().unwrap().len();
        assert!((1..=KEPT_STACKS).contains(&kept), "{kept} stacks kept");
    }

    /// The program gets the three standard streams and no other descriptor of the caller:
    /// neither one it opened without close-on-exec (as one inherited from whoever started the
    /// service would be) nor another start's pipe, also when the child was held, and also on a
    /// kernel without `CLOSE_RANGE_CLOEXEC`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_gets_no_descriptor_but_its_standard_streams() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        // SAFETY: dup of our own open descriptor; the copy has no FD_CLOEXEC.
        let inheritable = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(inheritable > 2);
        let (_other, _other_out) =
            run(spec(Path::new("/bin/sleep"), &["sleep", "30"], None)).unwrap();
        let rt = tokio::runtime::Handle::current();
        // (signals, held, what the kernel lacks, with a cgroup descriptor written before exec)
        let cases = [
            (Signals::Reset, false, 0, false),
            (Signals::Reset, true, 0, true),
            (Signals::LeftToTheProgram, false, 0, false),
            (Signals::LeftToTheProgram, true, 0, false),
            (Signals::Reset, false, 1, false),
            (Signals::Reset, true, 1, true),
            (Signals::Reset, false, 2, false),
            (Signals::Reset, false, 2, true),
        ];
        for (signals, held, old_kernel, cgroup) in cases {
            OLD_KERNEL.store(old_kernel, Ordering::Relaxed);
            let mut s = spec(Path::new("/bin/ls"), &["ls", "/proc/self/fd"], None);
            s.signals = signals;
            // A pipe stands in for `cgroup.procs`: the child writes "0\n" to it before exec.
            let procs = cgroup.then(|| std::io::pipe().unwrap());
            s.setup.cgroup_procs = procs.as_ref().map(|(_, w)| w.as_raw_fd());
            let release = held.then(|| {
                let (h, r) = hold();
                s.held = Some(h);
                r
            });
            let rt = rt.clone();
            let started = std::thread::spawn(move || {
                let _in = rt.enter();
                run(s)
            });
            if let Some(r) = release {
                r.go();
            }
            let case = format!("{signals:?}, held {held}, kernel {old_kernel}, cgroup {cgroup}");
            let (mut child, mut out) = started.join().unwrap().expect(&case);
            let mut text = String::new();
            out.read_to_string(&mut text).unwrap();
            assert!(child.wait().await.unwrap().success(), "{case}");
            // ls's own descriptor for the directory it reads is 3.
            assert_eq!(text, "0\n1\n2\n3\n", "{case}");
            if let Some((mut r, w)) = procs {
                drop(w);
                let mut written = String::new();
                r.read_to_string(&mut written).unwrap();
                assert_eq!(written, "0\n", "{case}");
            }
        }
        OLD_KERNEL.store(0, Ordering::Relaxed);
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(inheritable) };
    }

    /// A signal mask of `/proc/<pid>/status` (`field` = "SigBlk:", "SigIgn:").
    fn mask(status: &str, field: &str) -> u64 {
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        u64::from_str_radix(line[field.len()..].trim(), 16).unwrap()
    }

    /// `Signals::Reset` starts the program as std does (nothing blocked, SIGPIPE, which this
    /// test binary ignores, at its default), also when the child was held;
    /// `Signals::LeftToTheProgram` leaves every signal blocked and the ignored ones ignored.
    #[tokio::test]
    async fn a_child_starts_with_its_signals_reset_or_left_to_it() {
        let pipe = 1u64 << (libc::SIGPIPE - 1);
        let status = |signals: Signals, held: bool| {
            let mut s = spec(Path::new("/bin/cat"), &["cat", "/proc/self/status"], None);
            s.signals = signals;
            let release = held.then(|| {
                let (h, r) = hold();
                s.held = Some(h);
                r
            });
            // A held start blocks its thread until the release (the runtime registers the
            // child's pidfd there).
            let rt = tokio::runtime::Handle::current();
            let started = std::thread::spawn(move || {
                let _in = rt.enter();
                run(s)
            });
            if let Some(r) = release {
                r.go();
            }
            let (child, mut out) = started.join().unwrap().unwrap();
            let mut text = String::new();
            out.read_to_string(&mut text).unwrap();
            drop(child);
            text
        };
        for held in [false, true] {
            let reset = status(Signals::Reset, held);
            assert_eq!(mask(&reset, "SigBlk:"), 0, "{reset}");
            assert_eq!(mask(&reset, "SigIgn:") & pipe, 0, "{reset}");
        }
        let left = status(Signals::LeftToTheProgram, false);
        // Every standard signal but SIGKILL and SIGSTOP, which cannot be blocked (glibc keeps
        // two of its own real-time signals out of every mask it sets).
        let standard = (1u64 << 31) - 1;
        let unblockable = 1u64 << (libc::SIGKILL - 1) | 1u64 << (libc::SIGSTOP - 1);
        assert_eq!(
            mask(&left, "SigBlk:") & standard,
            standard & !unblockable,
            "{left}"
        );
        assert_eq!(mask(&left, "SigIgn:") & pipe, pipe, "{left}");
    }

    #[tokio::test]
    async fn a_killed_child_reports_its_signal() {
        let (mut child, _out) =
            run(spec(Path::new("/bin/sleep"), &["sleep", "1000"], None)).unwrap();
        child.start_kill().unwrap();
        let status = child.wait().await.unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // Once reaped, the pid is no longer ours to signal.
        child.start_kill().unwrap();
        assert_eq!(child.wait().await.unwrap().signal(), Some(libc::SIGKILL));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_child_runs_its_program_once_released_and_never_if_stopped() {
        for go in [true, false] {
            let (held, release) = hold();
            let mut s = spec(Path::new("/bin/echo"), &["echo", "ran"], None);
            s.held = Some(held);
            let starting = tokio::task::spawn_blocking(move || run(s));
            // The child waits before its exec, and the start with it.
            held_child().await;
            assert!(!starting.is_finished());
            if go {
                release.go();
            } else {
                drop(release);
            }
            match starting.await.unwrap() {
                Ok((mut child, mut out)) => {
                    assert!(go);
                    assert!(child.wait().await.unwrap().success());
                    let mut text = String::new();
                    out.read_to_string(&mut text).unwrap();
                    assert_eq!(text, "ran\n");
                }
                Err(e) => {
                    assert!(!go);
                    assert_eq!(e.raw_os_error(), Some(libc::ECANCELED), "{e}");
                }
            }
            assert!(no_children_left());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_child_is_out_of_reach_of_the_uid_it_runs_as() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: switching identity needs root");
            return;
        }
        let id = Identity {
            uid: 731_101,
            gid: 731_101,
        };
        let (held, release) = hold();
        let mut s = spec(Path::new("/bin/true"), &["true"], Some(id));
        s.held = Some(held);
        let starting = tokio::task::spawn_blocking(move || run(s));
        let pid = held_child().await;
        // A process of the same uid (a tool of the session left running, say) looks at it: its
        // environment and memory are this process's.
        let probe = format!(
            "cat /proc/{pid}/environ >/dev/null 2>&1 && echo environ; \
             head -c 1 /proc/{pid}/mem >/dev/null 2>&1 && echo mem; \
             cat /proc/{pid}/maps 2>/dev/null | head -c 1 | grep -q . && echo maps; echo done"
        );
        let (mut child, mut out) =
            run(spec(Path::new("/bin/sh"), &["sh", "-c", &probe], Some(id))).unwrap();
        assert!(child.wait().await.unwrap().success());
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        assert_eq!(text, "done\n", "the held child was readable by its uid");
        drop(release);
        let err = starting.await.unwrap().err().unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::ECANCELED), "{err}");
        assert!(no_children_left());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_child_cannot_be_stopped_or_killed_by_the_uid_it_will_run_as() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: switching identity needs root");
            return;
        }
        let id = Identity {
            uid: 731_102,
            gid: 731_102,
        };
        let (held, release) = hold();
        let mut s = spec(Path::new("/bin/echo"), &["echo", "ran"], Some(id));
        s.held = Some(held);
        let starting = tokio::task::spawn_blocking(move || run(s));
        let pid = held_child().await;
        // A process of the session's uid (a tool left running) signals it: stopped, the held
        // child would keep its caller's thread (and the call) waiting for ever.
        let probe = format!(
            "kill -STOP {pid} 2>/dev/null && echo stopped; \
             kill -KILL {pid} 2>/dev/null && echo killed; echo done"
        );
        let (mut child, mut out) =
            run(spec(Path::new("/bin/sh"), &["sh", "-c", &probe], Some(id))).unwrap();
        assert!(child.wait().await.unwrap().success());
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        assert_eq!(text, "done\n", "the held child was signalled by its uid");
        release.go();
        let (mut child, mut out) = starting.await.unwrap().unwrap();
        assert!(child.wait().await.unwrap().success());
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        assert_eq!(text, "ran\n");
    }

    /// Run by [`a_held_child_dies_with_the_process_that_holds_it`] as a process of its own:
    /// holds a child and never releases it.
    #[test]
    fn holds_a_child_forever() {
        if std::env::var_os("AGENTSCOPE_TEST_HOLD_FOREVER").is_none() {
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _in = rt.enter();
        let (held, release) = hold();
        let mut s = spec(Path::new("/bin/true"), &["true"], None);
        s.held = Some(held);
        std::mem::forget(release);
        let _ = run(s);
        unreachable!("a held child was let go");
    }

    #[test]
    fn a_held_child_dies_with_the_process_that_holds_it() {
        let me = std::env::current_exe().unwrap();
        let mut holder = std::process::Command::new(&me)
            .args(["spawn::tests::holds_a_child_forever", "--exact"])
            .env("AGENTSCOPE_TEST_HOLD_FOREVER", "1")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let held = loop {
            if let Some(p) = before_exec_children_of(holder.id()).first() {
                break *p;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the holder held no child"
            );
            std::thread::yield_now();
        };
        holder.kill().unwrap();
        holder.wait().unwrap();
        // Gone, or a zombie its new parent has not reaped yet.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while let Some(s) = stat_fields(held) {
            if s[0] == "Z" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the held child {held} outlived its holder: {s:?}"
            );
            std::thread::yield_now();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_pidfds_a_child_is_awaited_by_sigchld() {
        WITHOUT_PIDFD.store(true, Ordering::Relaxed);
        let (mut quick, _out) =
            run(spec(Path::new("/bin/sh"), &["sh", "-c", "exit 3"], None)).unwrap();
        assert!(matches!(quick.exited, Exited::Sigchld(_)));
        let (mut slow, _out2) =
            run(spec(Path::new("/bin/sleep"), &["sleep", "1000"], None)).unwrap();
        // Another child's exit wakes the wait of this one, which goes on waiting.
        assert_eq!(quick.wait().await.unwrap().code(), Some(3));
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(100), slow.wait()).await;
        assert!(pending.is_err(), "{pending:?}");
        slow.start_kill().unwrap();
        assert_eq!(slow.wait().await.unwrap().signal(), Some(libc::SIGKILL));
        assert!(no_children_left());
    }
}
