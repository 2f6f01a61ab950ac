//! `agentscope-sentinel`: the process that keeps one attempt's provider tree together and ends
//! it. svc-host starts one per attempt (`agentscope_tools::spawn`, no copy of the host's memory)
//! in the provider's new process group, with the provider's environment, directory and pipes.
//!
//! It starts the provider's process (`clone(CLONE_VM | CLONE_VFORK)` on a stack of its own: no copy
//! of its memory), which drops privileges and executes; the sentinel stays behind as a child
//! subreaper, so that every descendant of the provider, also one that left the process
//! group or daemonized, stays below it:
//! - when the host dies, however it dies, `PR_SET_PDEATHSIG` wakes it and it kills every process
//!   of the attempt's uid (`kill(-1)` as that uid), or its process group and children without
//!   one; the provider dies with it (`PR_SET_PDEATHSIG(SIGKILL)`);
//! - when the provider ends and nothing else of the attempt is left, it exits with the
//!   provider's status; if something is left it waits for the host's `SIGUSR1` ("the output is
//!   read, end the rest"; sent early when the host stops the attempt), kills it all and reaps
//!   it. So its exit means that no process of the attempt is left, without any /proc scan.
//!
//! Cancellation still signals the process group: the provider handles it, the sentinel ignores
//! it.
//!
//! No libc and no std: raw system calls from its own entry point, so that starting it costs an
//! `execve` and two page faults. glibc's start-up alone (its CPU feature detection traps to the
//! hypervisor on some virtual machines) cost about 0.25 ms per attempt. svc-host's build.rs
//! compiles this file with `panic=abort` (which the workspace's profile cannot give one binary)
//! and svc-host carries the result (`isolation::SENTINEL_ELF`). x86_64 Linux only.
#![no_std]
#![no_main]

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
compile_error!("agentscope-sentinel is written for x86_64 Linux");

mod args;

use core::arch::asm;

const EXEC_NOT_FOUND: i32 = 127;
const EXEC_FAILED: i32 = 126;

// --------------------------------------------------------------------------- system calls

mod nr {
    pub const READ: usize = 0;
    pub const WRITE: usize = 1;
    pub const CLOSE: usize = 3;
    pub const RT_SIGACTION: usize = 13;
    pub const RT_SIGPROCMASK: usize = 14;
    pub const GETPID: usize = 39;
    pub const CLONE: usize = 56;
    pub const EXECVE: usize = 59;
    pub const WAIT4: usize = 61;
    pub const KILL: usize = 62;
    pub const UMASK: usize = 95;
    pub const GETUID: usize = 102;
    pub const SETUID: usize = 105;
    pub const GETEUID: usize = 107;
    pub const GETPPID: usize = 110;
    pub const SETGROUPS: usize = 116;
    pub const SETRESUID: usize = 117;
    pub const SETRESGID: usize = 119;
    pub const RT_SIGTIMEDWAIT: usize = 128;
    pub const PRCTL: usize = 157;
    pub const EXIT_GROUP: usize = 231;
    pub const OPENAT: usize = 257;
    pub const CLOSE_RANGE: usize = 436;
}

/// A system call with up to four arguments (the fifth and sixth are zero); the result as the
/// kernel returns it (-errno on failure).
unsafe fn syscall(n: usize, a: [usize; 4]) -> isize {
    let ret: isize;
    // SAFETY: the caller passes arguments valid for system call `n`.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            // Zero, not whatever the registers held: `prctl` checks its unused arguments.
            in("r8") 0usize,
            in("r9") 0usize,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

fn sys(n: usize, a: [usize; 4]) -> isize {
    // SAFETY: every call site passes plain integers or pointers to live, initialized memory of
    // the size the call reads or writes.
    unsafe { syscall(n, a) }
}

fn exit(code: i32) -> ! {
    sys(nr::EXIT_GROUP, [code as usize, 0, 0, 0]);
    // SAFETY: exit_group does not return.
    unsafe { core::hint::unreachable_unchecked() }
}

fn write_all(fd: usize, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        let n = sys(nr::WRITE, [fd, bytes.as_ptr() as usize, bytes.len(), 0]);
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

const SIGHUP: usize = 1;
const SIGINT: usize = 2;
const SIGQUIT: usize = 3;
const SIGKILL: usize = 9;
const SIGPIPE: usize = 13;
const SIGUSR1: usize = 10;
const SIGUSR2: usize = 12;
const SIGTERM: usize = 15;
const SIGCHLD: usize = 17;

const SIG_UNBLOCK: usize = 1;
const SIG_SETMASK: usize = 2;
const SIG_DFL: usize = 0;
const SIG_IGN: usize = 1;

const PR_SET_PDEATHSIG: usize = 1;
const PR_SET_DUMPABLE: usize = 4;
const PR_SET_CHILD_SUBREAPER: usize = 36;
const PR_SET_NO_NEW_PRIVS: usize = 38;

/// The kernel's signal set (64 signals).
fn sigset(sigs: &[usize]) -> u64 {
    sigs.iter().fold(0, |s, sig| s | 1 << (sig - 1))
}

fn sigprocmask(how: usize, set: u64) {
    sys(nr::RT_SIGPROCMASK, [how, &set as *const u64 as usize, 0, 8]);
}

/// The kernel's `struct sigaction` on x86_64.
#[repr(C)]
struct SigAction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

fn set_disposition(sig: usize, handler: usize) {
    let act = SigAction {
        handler,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    sys(
        nr::RT_SIGACTION,
        [sig, &act as *const SigAction as usize, 0, 8],
    );
}

fn prctl(option: usize, value: usize) -> isize {
    sys(nr::PRCTL, [option, value, 0, 0])
}

fn getpid() -> i32 {
    sys(nr::GETPID, [0; 4]) as i32
}

fn getppid() -> i32 {
    sys(nr::GETPPID, [0; 4]) as i32
}

fn kill(pid: i32, sig: usize) {
    sys(nr::KILL, [pid as isize as usize, sig, 0, 0]);
}

fn switch_identity(uid: u32, gid: u32) -> bool {
    sys(nr::SETRESGID, [gid as usize, gid as usize, gid as usize, 0]) == 0
        && sys(nr::SETRESUID, [uid as usize, uid as usize, uid as usize, 0]) == 0
}

// ------------------------------------------------------------------------------ start-up

// `_start` (shared/build/nolibc_rt.rs) calls `entry` with the stack the kernel started it with.

/// The C string at `p` (no NUL), up to 64 KiB.
///
/// # Safety
/// `p` points to a NUL-terminated string.
unsafe fn c_str<'a>(p: *const u8) -> &'a [u8] {
    let mut n = 0;
    // SAFETY: reads up to the NUL the caller promises.
    unsafe {
        while n < 65536 && *p.add(n) != 0 {
            n += 1;
        }
        core::slice::from_raw_parts(p, n)
    }
}

unsafe extern "C" fn entry(sp: *const usize) -> ! {
    // SAFETY: the layout the kernel gives every new process.
    unsafe {
        let argc = *sp;
        let argv = sp.add(1) as *const *const u8;
        let envp = argv.add(argc + 1);
        main(argc, argv, envp)
    }
}

unsafe fn main(argc: usize, argv: *const *const u8, envp: *const *const u8) -> ! {
    // SAFETY: argv holds argc valid C strings, then NULL.
    let arg = |i: usize| unsafe { c_str(*argv.add(i + 1)) };
    let parsed = match args::parse(argc.saturating_sub(1), arg) {
        Ok(p) => p,
        Err(e) => {
            write_all(2, b"agentscope-sentinel: ");
            write_all(2, e.as_bytes());
            write_all(2, b"\n");
            exit(2);
        }
    };
    let program = unsafe { *argv.add(4) };
    let provider_argv = unsafe { argv.add(5) };

    // The host starts this with every signal blocked and its own ignored ones ignored
    // (`Signals::LeftToTheProgram`): the mask is set here, not added to, and SIGPIPE (which
    // the host ignores) is the default again for the sentinel and its provider.
    let watched = sigset(&[SIGUSR1, SIGUSR2, SIGCHLD]);
    sigprocmask(SIG_SETMASK, watched);
    set_disposition(SIGPIPE, SIG_DFL);
    if prctl(PR_SET_PDEATHSIG, SIGUSR2) != 0
        || getppid() != parsed.host
        || prctl(PR_SET_CHILD_SUBREAPER, 1) != 0
    {
        exit(137);
    }
    let start = Start {
        who: parsed.who,
        me: getpid(),
        program,
        argv: provider_argv,
        envp,
    };
    let provider = spawn_provider(&start) as i32;
    if provider < 0 {
        exit(EXEC_FAILED);
    }
    // Cancellation signals the whole group: the provider handles them, not the sentinel.
    for sig in [SIGTERM, SIGINT, SIGHUP, SIGQUIT] {
        set_disposition(sig, SIG_IGN);
    }
    // The pipes are the provider's: the end of output must mean the provider's end.
    if sys(nr::CLOSE_RANGE, [0, u32::MAX as usize, 0, 0]) != 0 {
        for fd in 0..3 {
            sys(nr::CLOSE, [fd, 0, 0, 0]);
        }
    }
    watch(provider, parsed.who, watched)
}

/// What the provider's process needs until its `execve`, read from the sentinel's memory (which
/// it shares until then).
struct Start {
    who: Option<(u32, u32)>,
    /// The sentinel's pid.
    me: i32,
    program: *const u8,
    argv: *const *const u8,
    envp: *const *const u8,
}

const CLONE_VM: usize = 0x100;
const CLONE_VFORK: usize = 0x4000;
const CHILD_STACK_SIZE: usize = 32 * 1024;

/// The provider's stack until its `execve`. One is enough: the sentinel is suspended meanwhile.
#[repr(C, align(16))]
struct ChildStack([u8; CHILD_STACK_SIZE]);
static mut CHILD_STACK: ChildStack = ChildStack([0; CHILD_STACK_SIZE]);

/// Starts the provider's process: `provider_main(start)` on a stack of its own, in a new process
/// that shares the sentinel's memory until it executes or exits, the sentinel suspended until
/// then (`clone(CLONE_VM | CLONE_VFORK)`, as glibc's `posix_spawn` does). Unlike a fork it copies
/// no page tables and leaves none to tear down at its `execve`. Its pid, or -errno.
fn spawn_provider(start: &Start) -> isize {
    // SAFETY: one past the end of the static stack, 16-byte aligned; nothing else uses it.
    let top = unsafe { (&raw mut CHILD_STACK).cast::<u8>().add(CHILD_STACK_SIZE) };
    let ret: isize;
    // SAFETY: the child starts on its own stack and never comes back here (`provider_main`
    // executes or exits); the registers it reads survive `syscall` (all but rax, rcx, r11);
    // `start` stays valid while it runs, since this process is suspended until it has executed
    // or exited.
    unsafe {
        asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            // The child, on the new stack (16-byte aligned before the call, as the ABI wants).
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") nr::CLONE as isize => ret,
            in("rdi") CLONE_VM | CLONE_VFORK | SIGCHLD,
            in("rsi") top,
            in("rdx") 0usize,
            in("r10") 0usize,
            in("r8") 0usize,
            in("r12") start as *const Start,
            in("r13") provider_main as extern "C" fn(*const Start) -> ! as usize,
            lateout("rcx") _,
            lateout("r11") _,
        );
    }
    ret
}

/// The provider's process until its `execve`: every signal unblocked, privileges dropped, bound
/// to the sentinel's life.
extern "C" fn provider_main(start: *const Start) -> ! {
    // SAFETY: `spawn_provider` passes a live `Start` and keeps it alive until this executes.
    let s = unsafe { &*start };
    sigprocmask(SIG_SETMASK, 0);
    // Until its `execve` this process shares the sentinel's (root's) memory: once it runs as
    // the attempt's uid, no process of that uid may attach to it (ptrace, /proc/<pid>/mem). The
    // kernel marks the memory so on the uid switch only while `fs.suid_dumpable` is 0 or 2; this
    // does it whatever that setting. The `execve` gives the provider memory of its own, dumpable
    // again.
    if s.who.is_some() && prctl(PR_SET_DUMPABLE, 0) != 0 {
        exit(EXEC_FAILED);
    }
    if let Some((uid, gid)) = s.who
        && !drop_privileges(uid, gid)
    {
        exit(EXEC_FAILED);
    }
    // Set after the credential change, which clears it.
    if prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != s.me {
        exit(137);
    }
    let err = -sys(
        nr::EXECVE,
        [s.program as usize, s.argv as usize, s.envp as usize, 0],
    );
    write_all(2, b"agentscope-sentinel: cannot run `");
    // SAFETY: argument 3 is a C string (checked by parse).
    write_all(2, unsafe { c_str(s.program) });
    write_all(2, b"`: ");
    write_all(2, describe(err));
    write_all(2, b"\n");
    exit(if err == 2 {
        EXEC_NOT_FOUND
    } else {
        EXEC_FAILED
    });
}

/// Supplementary groups cleared, then gid and uid (real, effective and saved) switched, a check
/// that root cannot be regained, no new privileges through set-uid binaries, umask 077.
fn drop_privileges(uid: u32, gid: u32) -> bool {
    sys(nr::SETGROUPS, [0; 4]) == 0
        && switch_identity(uid, gid)
        && sys(nr::SETUID, [0; 4]) != 0
        && sys(nr::GETUID, [0; 4]) == uid as isize
        && sys(nr::GETEUID, [0; 4]) == uid as isize
        && prctl(PR_SET_NO_NEW_PRIVS, 1) == 0
        && {
            sys(nr::UMASK, [0o077, 0, 0, 0]);
            true
        }
}

/// The sentinel's loop: reap, mirror the provider's end once nothing is left, end the rest on
/// the host's word, end everything when the host dies.
fn watch(provider: i32, who: Option<(u32, u32)>, watched: u64) -> ! {
    let mut status: Option<i32> = None;
    let mut end = false;
    let mut uid_killed = false;
    loop {
        // Reap whatever ended: the provider, and orphans of its tree adopted by us.
        loop {
            let mut st: i32 = 0;
            let pid = sys(
                nr::WAIT4,
                [
                    usize::MAX,
                    &mut st as *mut i32 as usize,
                    1, /* WNOHANG */
                    0,
                ],
            );
            if pid > 0 {
                if pid as i32 == provider {
                    status = Some(st);
                }
                continue;
            }
            if pid < 0
                && let Some(st) = status
            {
                // No child left: the provider and everything it started are gone.
                mirror(st);
            }
            break;
        }
        if status.is_some() && end {
            // The provider is gone and the host has read its output: end the rest.
            match who {
                Some((uid, gid)) if !uid_killed => {
                    uid_killed = kill_uid_as(uid, gid);
                    if !uid_killed {
                        kill_children();
                    }
                }
                Some(_) => {}
                None => kill_children(),
            }
        }
        let mut info = [0u64; 16]; // siginfo_t: 128 bytes
        let sig = sys(
            nr::RT_SIGTIMEDWAIT,
            [
                &watched as *const u64 as usize,
                info.as_mut_ptr() as usize,
                0,
                8,
            ],
        );
        match sig as usize {
            SIGUSR2 => {
                // The host is gone: end the attempt's every process.
                if !who.is_some_and(|(uid, gid)| kill_uid_as(uid, gid)) {
                    kill_children();
                    kill(0, SIGKILL);
                }
                exit(137);
            }
            SIGUSR1 => end = true,
            _ => {}
        }
    }
}

/// Becomes `uid`/`gid` and SIGKILLs every process of that uid but itself (atomically: no process
/// of the uid can fork past it). False when the switch failed.
fn kill_uid_as(uid: u32, gid: u32) -> bool {
    if !switch_identity(uid, gid) {
        return false;
    }
    kill(-1, SIGKILL);
    true
}

/// SIGKILLs the sentinel's children (the provider's orphans it adopted).
fn kill_children() {
    // "/proc/<pid>/task/<pid>/children", NUL-terminated.
    let mut path = [0u8; 64];
    let mut len = 0;
    let mut push = |bytes: &[u8]| {
        path[len..len + bytes.len()].copy_from_slice(bytes);
        len += bytes.len();
    };
    let mut digits = [0u8; 10];
    let me = decimal(getpid() as u32, &mut digits);
    push(b"/proc/");
    push(me);
    push(b"/task/");
    push(me);
    push(b"/children\0");
    let fd = sys(
        nr::OPENAT,
        [
            -100isize as usize, /* AT_FDCWD */
            path.as_ptr() as usize,
            0o2000000, /* O_RDONLY | O_CLOEXEC */
            0,
        ],
    );
    if fd < 0 {
        return;
    }
    // Space-separated pids; a number may straddle two reads.
    let mut buf = [0u8; 4096];
    let mut pid: u32 = 0;
    let mut in_number = false;
    loop {
        let n = sys(
            nr::READ,
            [fd as usize, buf.as_mut_ptr() as usize, buf.len(), 0],
        );
        if n <= 0 {
            break;
        }
        for c in &buf[..n as usize] {
            if c.is_ascii_digit() {
                pid = pid.saturating_mul(10).saturating_add((c - b'0') as u32);
                in_number = true;
            } else if in_number {
                kill_child(pid);
                (pid, in_number) = (0, false);
            }
        }
    }
    if in_number {
        kill_child(pid);
    }
    sys(nr::CLOSE, [fd as usize, 0, 0, 0]);
}

fn kill_child(pid: u32) {
    if pid > 0 && pid <= i32::MAX as u32 {
        kill(pid as i32, SIGKILL);
    }
}

/// `n` in decimal, in `buf`.
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Ends the sentinel as its provider ended: the same exit status, or the same signal.
fn mirror(st: i32) -> ! {
    let sig = (st & 0x7f) as usize;
    if sig != 0 && sig != 0x7f {
        set_disposition(sig, SIG_DFL);
        sigprocmask(SIG_UNBLOCK, sigset(&[sig]));
        kill(getpid(), sig);
        exit(128 + sig as i32);
    }
    exit((st >> 8) & 0xff)
}

/// What an `execve` error means, as glibc's `strerror` says it.
fn describe(errno: isize) -> &'static [u8] {
    match errno {
        1 => b"Operation not permitted",
        2 => b"No such file or directory",
        5 => b"Input/output error",
        7 => b"Argument list too long",
        8 => b"Exec format error",
        12 => b"Cannot allocate memory",
        13 => b"Permission denied",
        14 => b"Bad address",
        20 => b"Not a directory",
        21 => b"Is a directory",
        22 => b"Invalid argument",
        24 => b"Too many open files",
        26 => b"Text file busy",
        36 => b"File name too long",
        40 => b"Too many levels of symbolic links",
        80 => b"Can not access a needed shared library",
        _ => b"Unknown error",
    }
}

include!("../../shared/build/nolibc_rt.rs");
