// Included (`include!`) by the programs without libc: svc-host's sentinel and the benchmark's
// bare stamp (tests/stamp_bare). Each defines `entry` and `exit`; this is the rest every such
// program needs.

// The kernel starts the process here with the stack as argc, argv..., 0, envp..., 0, auxv;
// `entry` gets a pointer to it.
core::arch::global_asm!(
    ".globl _start",
    ".type _start,@function",
    "_start:",
    "xor ebp, ebp",
    "mov rdi, rsp",
    "and rsp, -16",
    "call {entry}",
    "ud2",
    entry = sym entry,
);

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    exit(134)
}

/// Named by the unwind tables of the precompiled `core` (built for unwinding); never called,
/// since a panic here exits.
#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() {}

// Without libc, the few routines the compiler may emit calls to (copies of arrays, slice
// comparisons), each in its own section so that the linker drops the unused ones.
core::arch::global_asm!(
    ".section .text.memcpy,\"ax\",@progbits",
    ".globl memcpy",
    ".type memcpy,@function",
    "memcpy:",
    "mov rax, rdi",
    "mov rcx, rdx",
    "rep movsb",
    "ret",
    ".section .text.memmove,\"ax\",@progbits",
    ".globl memmove",
    ".type memmove,@function",
    "memmove:",
    "mov rax, rdi",
    "mov rcx, rdx",
    "cmp rdi, rsi",
    "jbe 2f",
    "lea rsi, [rsi + rcx - 1]",
    "lea rdi, [rdi + rcx - 1]",
    "std",
    "rep movsb",
    "cld",
    "ret",
    "2:",
    "rep movsb",
    "ret",
    ".section .text.memset,\"ax\",@progbits",
    ".globl memset",
    ".type memset,@function",
    "memset:",
    "mov r8, rdi",
    "mov eax, esi",
    "mov rcx, rdx",
    "rep stosb",
    "mov rax, r8",
    "ret",
    ".section .text.memcmp,\"ax\",@progbits",
    ".globl memcmp",
    ".globl bcmp",
    ".type memcmp,@function",
    ".type bcmp,@function",
    "memcmp:",
    "bcmp:",
    "xor eax, eax",
    "test rdx, rdx",
    "jz 3f",
    "2:",
    "movzx eax, byte ptr [rdi]",
    "movzx ecx, byte ptr [rsi]",
    "sub eax, ecx",
    "jnz 3f",
    "inc rdi",
    "inc rsi",
    "dec rdx",
    "jnz 2b",
    "3:",
    "ret",
    ".text",
);
