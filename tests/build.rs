//! Builds the benchmark's stamp without libc (`stamp_bare/main.rs`), which the library carries
//! (`BENCH_STAMP_BARE`, for `agentscope-bench --stamp bare`), as svc-host's build.rs builds its
//! sentinel.

include!("../shared/build/nolibc.rs");

fn main() {
    let src = "stamp_bare/main.rs";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-changed=../shared/build/nolibc.rs");
    println!("cargo:rerun-if-changed=../shared/build/nolibc_rt.rs");
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let out = std::path::PathBuf::from(var("OUT_DIR")).join("agentscope-bench-stamp-bare");
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        // Elsewhere the benchmark has only the ordinary stamp.
        std::fs::write(&out, b"").expect("write an empty stamp");
        return;
    }
    build_nolibc(src, "agentscope_bench_stamp_bare", &out);
}
