//! Builds `agentscope-sentinel` (`sentinel/main.rs`): a program without libc or std that svc-host
//! starts once per attempt and carries in its own binary (`isolation::SENTINEL_ELF`).
//!
//! It is compiled here, by the same rustc, because it needs `panic = "abort"`, which the
//! workspace's profiles cannot set for one binary, and because it must not link anything: it is
//! static, has its own entry point and makes its system calls itself.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = ["sentinel/main.rs", "sentinel/args.rs"];
    for s in src {
        println!("cargo:rerun-if-changed={s}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        panic!(
            "svc-host runs on x86_64 Linux (its sentinel makes x86_64 Linux system calls), not {}",
            var("TARGET")
        );
    }
    let out = PathBuf::from(var("OUT_DIR")).join("agentscope-sentinel");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.args(["--edition", "2024", "--crate-type", "bin"])
        .args(["--crate-name", "agentscope_sentinel"])
        .args(["--target", &var("TARGET")])
        .args([
            "-C",
            "panic=abort",
            "-C",
            "opt-level=2",
            "-C",
            "debuginfo=0",
        ])
        .args(["-C", "strip=symbols", "-C", "relocation-model=static"])
        .args(["-C", "link-arg=-nostartfiles", "-C", "link-arg=-nostdlib"])
        .args([
            "-C",
            "link-arg=-static",
            "-C",
            "link-arg=-Wl,--build-id=none",
        ])
        .args(["-D", "warnings"]);
    if let Some(linker) = std::env::var_os("RUSTC_LINKER") {
        let mut arg = std::ffi::OsString::from("linker=");
        arg.push(linker);
        cmd.arg("-C").arg(arg);
    }
    cmd.arg(src[0]).arg("-o").arg(&out);
    let result = cmd
        .output()
        .unwrap_or_else(|e| panic!("run rustc for agentscope-sentinel: {e}"));
    if !result.status.success() {
        panic!(
            "agentscope-sentinel does not build:\n{}",
            String::from_utf8_lossy(&result.stderr)
        );
    }
}
