//! Times `Environment::shell` calls of a Local environment, as root with a session uid (731000):
//! `cargo run --release -p agentscope-tools --example shell_loop -- /bin/true 2000` prints the
//! wall time per call (p50, p99, mean) and the CPU per call (this process and its children).
//! `'/bin/true;'` is the same call through `sh -c`.
use agentscope_tools::env::{Environment, Identity, Limits};
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

fn cpu() -> f64 {
    let mut total = 0.0;
    for who in [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN] {
        // SAFETY: getrusage fills a zeroed plain-data struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(who, &mut ru) };
        for tv in [ru.ru_utime, ru.ru_stime] {
            total += tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
        }
    }
    total
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (command, n): (&str, usize) = (&args[1], args[2].parse().unwrap());
    let base = std::env::temp_dir().join(format!("shell-loop-{}", std::process::id()));
    let root = base.join("session");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o711)).unwrap();
    let id = Identity {
        uid: 731_000,
        gid: 731_000,
    };
    std::os::unix::fs::lchown(&root, Some(id.uid), Some(id.gid)).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
    let env = Environment::Local {
        root,
        identity: Some(id),
    };
    let limits = Limits {
        timeout: Duration::from_secs(30),
        max_output: 64 * 1024,
        max_file: 1 << 20,
        memory_bytes: None,
        max_processes: Some(256),
        cpu_secs: None,
    };
    for _ in 0..50 {
        env.shell(command, &[], &limits).await.unwrap();
    }
    let (cpu0, t0) = (cpu(), Instant::now());
    let mut each = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let out = env.shell(command, &[], &limits).await.unwrap();
        each.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(out.exit_code, Some(0), "{out:?}");
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu() - cpu0;
    each.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{command:?} x{n}: wall/call p50 {:.3} ms p99 {:.3} ms mean {:.3} ms; cpu/call {:.3} ms",
        each[n / 2],
        each[n * 99 / 100],
        wall * 1e3 / n as f64,
        cpu * 1e3 / n as f64
    );
    let _ = std::fs::remove_dir_all(&base);
}
