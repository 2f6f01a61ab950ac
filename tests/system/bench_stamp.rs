//! The benchmark's two stamps (the provider or tool whose start `agentscope-bench` measures):
//! each prints `stamp <unix nanoseconds>` read at its start, and exits 0.

use agentscope_system_tests::*;
use std::time::{SystemTime, UNIX_EPOCH};

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Runs `program` and returns the time it printed, checking it lies between its start and end.
fn stamp_of(program: &std::path::Path) -> u128 {
    let before = now_ns();
    let out = std::process::Command::new(program)
        .env_clear()
        .output()
        .unwrap();
    let after = now_ns();
    assert!(out.status.success(), "{}: {:?}", program.display(), out);
    let text = String::from_utf8(out.stdout).unwrap();
    let ns: u128 = text
        .strip_prefix("stamp ")
        .and_then(|r| r.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("{}: {text:?}", program.display()))
        .parse()
        .unwrap();
    assert!(
        before <= ns && ns <= after,
        "{}: {ns} outside [{before}, {after}]",
        program.display()
    );
    ns
}

#[test]
fn both_stamps_print_the_wall_clock_of_their_start_and_exit_0() {
    let dir = kit::TempDir::new("stamps");
    let bare = dir.path.join("agentscope-bench-stamp-bare");
    std::fs::write(&bare, BENCH_STAMP_BARE).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bare, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // Static and without an interpreter: nothing is loaded before its first instruction.
    assert_eq!(&BENCH_STAMP_BARE[..4], b"\x7fELF");
    assert!(
        !BENCH_STAMP_BARE
            .windows(b"ld-linux".len())
            .any(|w| w == b"ld-linux"),
        "the bare stamp names a dynamic loader"
    );
    let first = stamp_of(&bare);
    assert!(stamp_of(&bare) >= first);
    // With an argument: a no-op that prints nothing.
    let quiet = std::process::Command::new(&bare)
        .arg("quiet")
        .output()
        .unwrap();
    assert!(
        quiet.status.success() && quiet.stdout.is_empty(),
        "{quiet:?}"
    );
    stamp_of(&kit::bin("agentscope-bench-stamp").unwrap());
}
