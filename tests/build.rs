//! Builds the benchmark's stamp without libc (`stamp_bare/main.rs`), which `agentscope-bench`
//! carries (`--stamp bare`). Compiled here, by the same rustc, as svc-host's build.rs compiles
//! its sentinel: it needs `panic = "abort"` and must link nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "stamp_bare/main.rs";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let out = PathBuf::from(var("OUT_DIR")).join("agentscope-bench-stamp-bare");
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        // Elsewhere the benchmark has only the ordinary stamp.
        std::fs::write(&out, b"").expect("write an empty stamp");
        return;
    }
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.args(["--edition", "2024", "--crate-type", "bin"])
        .args(["--crate-name", "agentscope_bench_stamp_bare"])
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
    cmd.arg(src).arg("-o").arg(&out);
    let result = cmd
        .output()
        .unwrap_or_else(|e| panic!("run rustc for the bare stamp: {e}"));
    if !result.status.success() {
        panic!(
            "the bare stamp does not build:\n{}",
            String::from_utf8_lossy(&result.stderr)
        );
    }
}
