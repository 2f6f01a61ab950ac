//! Builds `agentscope-sentinel` (`sentinel/main.rs`): a program without libc or std that svc-host
//! starts once per attempt and carries in its own binary (`isolation::SENTINEL_ELF`).
//!
//! It is compiled here, by the same rustc, because it needs `panic = "abort"`, which the
//! workspace's profiles cannot set for one binary, and because it must not link anything: it is
//! static, has its own entry point and makes its system calls itself.

include!("../shared/build/nolibc.rs");

fn main() {
    let src = ["sentinel/main.rs", "sentinel/args.rs"];
    for s in src {
        println!("cargo:rerun-if-changed={s}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../shared/build/nolibc.rs");
    println!("cargo:rerun-if-changed=../shared/build/nolibc_rt.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        panic!(
            "svc-host runs on x86_64 Linux (its sentinel makes x86_64 Linux system calls), not {}",
            var("TARGET")
        );
    }
    let out = std::path::PathBuf::from(var("OUT_DIR")).join("agentscope-sentinel");
    build_nolibc(src[0], "agentscope_sentinel", &out);
}
