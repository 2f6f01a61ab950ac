//! The machine's own prices, measured just before every round, so that figures taken minutes
//! apart on a shared virtual machine can be read against what the machine gave at the time
//! (docs/BENCHMARKS.md): each is measured with the CPUs left idle for a millisecond before each
//! turn, as between one low-load task's hops.
//! - `wakeup_round_trip_us`: two threads take turns over a pipe, each blocked in `read` until
//!   the other writes; a round trip is two wake-ups (one task's path is about seven).
//! - `fdatasync_us`: an 8 KiB write and `fdatasync` of a file in the temporary directory (the
//!   price of every durable commit, PostgreSQL's included, when it is on the same disk).
//! - `cpu_hash_ms`: the fastest of five passes of a fixed computation over 4 MiB (the CPU's
//!   speed as this machine gets it, in user space).
//! - `syscall_pair_us`: a one-byte pipe write and its read in one thread, the median of 20
//!   batches of 1,000 (the kernel's speed as this machine gets it: the services' work is
//!   mostly system calls, and a hypervisor's interference shows here first).
//! - `program_start_us`: `true` (W1 bulk's provider) started and reaped 100 times, one after the
//!   other: `cpu`, its own CPU time (user and system, from `wait4`'s usage of that child: the
//!   start, glibc's loading and initialisation, the exit), and `wall`, spawn to reaped. The floor
//!   of any attempt whose provider is an ordinary program: on a virtual machine, glibc's start-up
//!   asks the CPU about its caches with dozens of `cpuid` instructions, each a trap to the
//!   hypervisor (docs/BENCHMARKS.md, session 36).
//!
//! And one figure taken over the round itself ([`Steal`]): `steal_during_round`, the share of
//! the CPUs' time the hypervisor gave to other guests while the round ran (`steal` in
//! `/proc/stat`), and those milliseconds. Small as it is (a fraction of a percent), it marks the
//! minutes when the host machine is contended: W1 low's p50 moved with it by a third on this
//! machine kind (docs/BENCHMARKS.md, session 33).

use crate::stats::summary;
use anyhow::Result;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Round trips measured.
const TURNS: usize = 300;
/// Idle time before each.
const IDLE: Duration = Duration::from_millis(1);

/// Durable writes measured.
const SYNCS: usize = 100;

/// Programs started.
const STARTS: usize = 100;

/// `{"wakeup_round_trip_us", "fdatasync_us", "cpu_hash_ms", "syscall_pair_us",
/// "program_start_us"}`. The idle
/// millisecond before each turn is part of what is measured (the CPUs left to go idle), not a
/// wait for anything.
pub async fn probe() -> Result<Value> {
    tokio::task::spawn_blocking(|| {
        Ok(json!({
            "wakeup_round_trip_us": wakeups()?,
            "fdatasync_us": syncs()?,
            "cpu_hash_ms": crate::stats::num(cpu()),
            "syscall_pair_us": crate::stats::num(syscalls()?),
            "program_start_us": program_starts()?,
        }))
    })
    .await?
}

/// The CPUs' time counters at the start of a round (`/proc/stat`, summed over the CPUs).
pub struct Steal {
    start: Option<Ticks>,
}

/// Clock ticks: stolen by the hypervisor, and in all (every state, stolen included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticks {
    steal: u64,
    total: u64,
}

impl Steal {
    pub fn start() -> Steal {
        Steal {
            start: read_ticks(),
        }
    }

    /// `{"share", "ms"}` since [`Steal::start`]; null where `/proc/stat` cannot be read.
    pub fn finish(self) -> Value {
        let (Some(a), Some(b)) = (self.start, read_ticks()) else {
            return Value::Null;
        };
        let (steal, total) = (b.steal - a.steal, b.total - a.total);
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        json!({
            "share": crate::stats::num(if total == 0 { 0.0 } else { steal as f64 / total as f64 }),
            "ms": crate::stats::num(steal as f64 * 1000.0 / hz),
        })
    }
}

fn read_ticks() -> Option<Ticks> {
    parse_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// The aggregate `cpu` line: user nice system idle iowait irq softirq steal (guest and
/// guest_nice are counted in user and nice already). None unless all eight are there.
fn parse_ticks(stat: &str) -> Option<Ticks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    (v.len() == 8).then(|| Ticks {
        steal: v[7],
        total: v.iter().sum(),
    })
}

fn syncs() -> Result<Value> {
    let path = std::env::temp_dir().join(format!("agentscope-bench-sync-{}", std::process::id()));
    let file = std::fs::File::create(&path)?;
    let block = [0x5au8; 8192];
    let mut us = Vec::with_capacity(SYNCS);
    for i in 0..SYNCS {
        std::thread::sleep(IDLE);
        std::os::unix::fs::FileExt::write_all_at(&file, &block, (i % 16) as u64 * 8192)?;
        let t = Instant::now();
        file.sync_data()?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(summary(&us))
}

fn cpu() -> f64 {
    let data: Vec<u64> = (0..(4 << 20) / 8).collect();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            // FNV-1a over the words; black_box keeps the work from being folded away.
            let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, w| {
                (h ^ std::hint::black_box(*w)).wrapping_mul(0x0000_0100_0000_01b3)
            });
            std::hint::black_box(h);
            t.elapsed().as_secs_f64() * 1000.0
        })
        .fold(f64::INFINITY, f64::min)
}

fn syscalls() -> Result<f64> {
    let (mut r, mut w) = std::io::pipe()?;
    let mut b = [0u8; 1];
    let mut per = Vec::with_capacity(20);
    for _ in 0..20 {
        let t = Instant::now();
        for _ in 0..1000 {
            w.write_all(b"x")?;
            r.read_exact(&mut b)?;
        }
        per.push(t.elapsed().as_secs_f64() * 1e3);
    }
    per.sort_by(f64::total_cmp);
    Ok(per[per.len() / 2])
}

fn program_starts() -> Result<Value> {
    use std::process::{Command, Stdio};
    let (mut cpu, mut wall) = (Vec::with_capacity(STARTS), Vec::with_capacity(STARTS));
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    for _ in 0..STARTS {
        let t = Instant::now();
        let child = Command::new("true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let pid = child.id() as libc::pid_t;
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: reaps our own child (std's handle does not wait for it when dropped).
        let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        wall.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(
            reaped == pid,
            "wait4 for `true`: {}",
            std::io::Error::last_os_error()
        );
        cpu.push(us(usage.ru_utime) + us(usage.ru_stime));
    }
    Ok(json!({"cpu": summary(&cpu), "wall": summary(&wall)}))
}

fn wakeups() -> Result<Value> {
    let (mut echo_in, mut to_echo) = std::io::pipe()?;
    let (mut back, mut echo_out) = std::io::pipe()?;
    let echo = std::thread::spawn(move || {
        let mut b = [0u8; 1];
        // Ends when the writer closes its end.
        while echo_in.read_exact(&mut b).is_ok() {
            if echo_out.write_all(&b).is_err() {
                break;
            }
        }
    });
    let mut rtt_us = Vec::with_capacity(TURNS);
    let mut b = [0u8; 1];
    for _ in 0..TURNS {
        std::thread::sleep(IDLE);
        let t = Instant::now();
        to_echo.write_all(b"x")?;
        back.read_exact(&mut b)?;
        rtt_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(to_echo);
    let _ = echo.join();
    Ok(summary(&rtt_us))
}

#[cfg(test)]
mod tests {
    /// Every price is measured: round trips and syncs each as many as said, and the two
    /// passes as positive durations.
    #[tokio::test]
    async fn the_probe_measures_every_price() {
        let m = super::probe().await.unwrap();
        assert_eq!(m["wakeup_round_trip_us"]["n"], super::TURNS, "{m}");
        assert_eq!(m["fdatasync_us"]["n"], super::SYNCS, "{m}");
        assert_eq!(m["program_start_us"]["cpu"]["n"], super::STARTS, "{m}");
        // A program's start takes some of the CPU's time, and at least that long on the clock.
        let (cpu, wall) = (
            m["program_start_us"]["cpu"]["max"].as_f64().unwrap(),
            m["program_start_us"]["wall"]["max"].as_f64().unwrap(),
        );
        assert!(cpu > 0.0 && wall > 0.0, "{m}");
        for k in ["cpu_hash_ms", "syscall_pair_us"] {
            assert!(m[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {m}");
        }
        assert!(
            m["wakeup_round_trip_us"]["p50"].as_f64().unwrap() > 0.0,
            "{m}"
        );
    }

    /// The stolen ticks are the eighth counter of the aggregate line, the total all eight
    /// (guest time is already in user time); a line cut short is no reading.
    #[test]
    fn steal_is_read_from_the_aggregate_cpu_line() {
        let stat = "cpu  100 2 30 800 4 5 6 7 50 0\ncpu0 50 1 15 400 2 2 3 3 25 0\nintr 1\n";
        assert_eq!(
            super::parse_ticks(stat),
            Some(super::Ticks {
                steal: 7,
                total: 100 + 2 + 30 + 800 + 4 + 5 + 6 + 7
            })
        );
        assert_eq!(super::parse_ticks("cpu  1 2 3\n"), None);
        assert_eq!(super::parse_ticks("intr 1\n"), None);
    }

    /// Over a stretch of work, the share is a fraction and the milliseconds are not negative.
    #[test]
    fn a_round_reports_the_share_of_time_stolen() {
        let s = super::Steal::start();
        std::hint::black_box(super::cpu());
        let v = s.finish();
        let share = v["share"].as_f64().expect("a share");
        assert!((0.0..=1.0).contains(&share), "{v}");
        assert!(v["ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{v}");
    }
}
