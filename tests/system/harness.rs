//! The harness itself: what it starts does not outlive it.

use agentscope_system_tests::*;
use std::time::Duration;

/// A process the harness started is killed by the kernel once the thread that started it ends,
/// without any drop running (as when a test or the benchmark is killed by a timeout): no stack
/// is left running behind a killed test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_the_harness_started_dies_with_the_thread_that_started_it() {
    let dir = kit::TempDir::new("harness");
    let path = dir.path.clone();
    let pid = std::thread::spawn(move || {
        let p = kit::Proc::spawn(
            "sleeper",
            std::path::Path::new("/bin/sleep"),
            &["600"],
            &[],
            &path,
        )
        .unwrap();
        let pid = p.pid().unwrap() as i32;
        // Leaked, as a killed test leaks it: no drop kills it.
        std::mem::forget(p);
        pid
    })
    .join()
    .unwrap();
    kit::wait_for(
        "the sleeper to be gone",
        Duration::from_secs(10),
        || async move {
            // Reaped by nobody (its parent, this process, does not wait for it): gone means no
            // process, or a zombie.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next());
            matches!(state, None | Some("Z")).then_some(())
        },
    )
    .await
    .unwrap();
}
