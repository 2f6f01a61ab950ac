//! Links `agentscope-sentinel` statically (glibc, static PIE) when the toolchain has the static
//! libraries: it starts once per attempt, and a dynamically linked one spends most of its start
//! in the dynamic loader (mapping and relocating libc and libgcc_s). Otherwise, or when
//! `AGENTSCOPE_SENTINEL_DYNAMIC` is set, it stays dynamic (the same program, started slower).
//!
//! rustc links std's libraries (`-lgcc_s -lc …`) after `-Bdynamic`, which no flag of ours can
//! come before; a directory searched first gives those names as linker scripts that point to
//! the static archives instead, and `-static-pie` picks the static start-up files.

use std::path::{Path, PathBuf};

const BIN: &str = "agentscope-sentinel";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=AGENTSCOPE_SENTINEL_DYNAMIC");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if std::env::var_os("AGENTSCOPE_SENTINEL_DYNAMIC").is_some()
        || var("CARGO_CFG_TARGET_OS") != "linux"
        || var("CARGO_CFG_TARGET_ENV") != "gnu"
        || var("TARGET") != var("HOST")
    {
        return;
    }
    match static_libs() {
        Ok(dir) => {
            println!("cargo:rustc-link-arg-bin={BIN}=-static-pie");
            println!("cargo:rustc-link-arg-bin={BIN}=-L{}", dir.display());
        }
        Err(why) => println!("cargo:warning={BIN} is linked dynamically: {why}"),
    }
}

/// A directory of linker scripts named as std's shared libraries, each naming static archives.
fn static_libs() -> Result<PathBuf, String> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("no OUT_DIR")?).join("static-libs");
    std::fs::create_dir_all(&out).map_err(|e| format!("create {}: {e}", out.display()))?;
    let libc = archive("libc.a")?;
    let libgcc = archive("libgcc.a")?;
    let libgcc_eh = archive("libgcc_eh.a")?;
    archive("rcrt1.o")?;
    let mut scripts = vec![
        (
            "libc.so".to_string(),
            format!("GROUP ( {libc} {libgcc} {libgcc_eh} )\n"),
        ),
        (
            "libgcc_s.so".to_string(),
            format!("INPUT ( {libgcc_eh} )\n"),
        ),
    ];
    for lib in ["util", "rt", "pthread", "m", "dl"] {
        let a = archive(&format!("lib{lib}.a"))?;
        scripts.push((format!("lib{lib}.so"), format!("INPUT ( {a} )\n")));
    }
    for (name, script) in scripts {
        let p = out.join(name);
        std::fs::write(&p, script).map_err(|e| format!("write {}: {e}", p.display()))?;
    }
    Ok(out)
}

/// Where the C compiler (rustc's linker) finds `name`.
fn archive(name: &str) -> Result<String, String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .arg(format!("-print-file-name={name}"))
        .output()
        .map_err(|e| format!("run {cc}: {e}"))?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || !Path::new(&path).is_absolute() || !Path::new(&path).exists() {
        return Err(format!("{cc} does not find {name}"));
    }
    if path.contains(|c: char| c.is_whitespace() || c == ')' || c == '(') {
        return Err(format!("{path}: a path a linker script cannot name"));
    }
    Ok(path)
}
