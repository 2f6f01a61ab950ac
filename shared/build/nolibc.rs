// Included (`include!`) by the build scripts that compile a program without libc: svc-host's
// sentinel and the benchmark's bare stamp (tests/). Not a crate: a build script's own code.

/// Compiles `src` (a `#![no_std]`, `#![no_main]` program with its own `_start`) with the rustc
/// that builds this package, for its target, into `out`: static, `panic=abort` (which the
/// workspace's profiles cannot give one binary), linked against nothing. Panics, with rustc's
/// messages, if it does not build.
fn build_nolibc(src: &str, crate_name: &str, out: &std::path::Path) {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = std::process::Command::new(rustc);
    cmd.args(["--edition", "2024", "--crate-type", "bin"])
        .args(["--crate-name", crate_name])
        .args(["--target", &var("TARGET")])
        .args(["-C", "panic=abort", "-C", "opt-level=2", "-C", "debuginfo=0"])
        .args(["-C", "strip=symbols", "-C", "relocation-model=static"])
        .args(["-C", "link-arg=-nostartfiles", "-C", "link-arg=-nostdlib"])
        .args(["-C", "link-arg=-static", "-C", "link-arg=-Wl,--build-id=none"])
        .args(["-D", "warnings"]);
    if let Some(linker) = std::env::var_os("RUSTC_LINKER") {
        let mut arg = std::ffi::OsString::from("linker=");
        arg.push(linker);
        cmd.arg("-C").arg(arg);
    }
    cmd.arg(src).arg("-o").arg(out);
    let result = cmd
        .output()
        .unwrap_or_else(|e| panic!("run rustc for {crate_name}: {e}"));
    if !result.status.success() {
        panic!(
            "{crate_name} does not build:\n{}",
            String::from_utf8_lossy(&result.stderr)
        );
    }
}
