//! `agentscope-bench-stamp` without libc (`agentscope-bench --stamp bare`): it reads the wall
//! clock (CLOCK_REALTIME) as its first instruction after `execve`, prints `stamp <unix
//! nanoseconds>` and exits 0. With any argument it only exits 0: a no-op provider without libc
//! (`bulk --provider bare`). The default stamp is an ordinary program (glibc, dynamically
//! linked), so its "started" includes its own loading: on virtual machines where glibc's CPU
//! feature probing traps to the hypervisor, that is 0.5–0.9 ms of the provider's own, which this
//! one leaves out. A run with each tells the platform's time from the program's.
//!
//! tests/build.rs compiles this file (static, `panic=abort`, its own entry point) and the
//! benchmark carries it. x86_64 Linux only.
#![no_std]
#![no_main]

use core::arch::asm;

const CLOCK_GETTIME: usize = 228;
const WRITE: usize = 1;
const EXIT_GROUP: usize = 231;

/// A system call of up to three arguments; the result as the kernel returns it.
///
/// # Safety
/// The arguments are valid for system call `n`.
unsafe fn syscall(n: usize, a: usize, b: usize, c: usize) -> isize {
    let ret: isize;
    // SAFETY: the caller passes arguments valid for system call `n`.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}


/// `sp`: the stack the kernel started the process with (argc first).
extern "C" fn entry(sp: *const usize) -> ! {
    // SAFETY: the kernel puts argc at the top of the initial stack.
    if unsafe { *sp } > 1 {
        exit(0);
    }
    let mut ts = [0i64; 2];
    // SAFETY: `ts` is a live timespec.
    unsafe { syscall(CLOCK_GETTIME, 0, ts.as_mut_ptr() as usize, 0) };
    let mut ns = (ts[0] as u64).wrapping_mul(1_000_000_000).wrapping_add(ts[1] as u64);
    let mut line = [0u8; 32];
    line[..6].copy_from_slice(b"stamp ");
    let mut digits = [0u8; 20];
    let mut n = 0;
    loop {
        digits[n] = b'0' + (ns % 10) as u8;
        ns /= 10;
        n += 1;
        if ns == 0 {
            break;
        }
    }
    for i in 0..n {
        line[6 + i] = digits[n - 1 - i];
    }
    line[6 + n] = b'\n';
    let len = 7 + n;
    let mut off = 0;
    while off < len {
        // SAFETY: writes initialized bytes of `line`.
        let w = unsafe { syscall(WRITE, 1, line.as_ptr() as usize + off, len - off) };
        if w <= 0 {
            break;
        }
        off += w as usize;
    }
    exit(0)
}

fn exit(code: usize) -> ! {
    // SAFETY: exit_group does not return.
    unsafe {
        syscall(EXIT_GROUP, code, 0, 0);
        core::hint::unreachable_unchecked()
    }
}

include!("../../shared/build/nolibc_rt.rs");
