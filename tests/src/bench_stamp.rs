//! `agentscope-bench-stamp`: the benchmark's no-op provider and tool. The first thing it does is
//! read the wall clock (CLOCK_REALTIME, the clock the benchmark's own timestamps use), then it
//! prints `stamp <unix nanoseconds>` and exits 0. "Provider started" and "tool started" in the
//! benchmark mean this reading: the first instruction of the process's `main`, after its exec.
//!
//! `agentscope-bench-stamp lines N INTERVAL_US` instead prints the lines `1` to `N`, one every
//! `INTERVAL_US` microseconds, each written at once (a steady stream of output).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, n, interval] = args.as_slice()
        && mode == "lines"
    {
        use std::io::Write;
        let n: u64 = n.parse().expect("N lines");
        let every = std::time::Duration::from_micros(interval.parse().expect("INTERVAL_US"));
        let start = std::time::Instant::now();
        let mut out = std::io::stdout().lock();
        for i in 1..=n {
            // On a schedule, not after a sleep each: a late line does not delay the rest.
            let due = start + every * (i - 1) as u32;
            if let Some(wait) = due.checked_duration_since(std::time::Instant::now()) {
                std::thread::sleep(wait);
            }
            writeln!(out, "{i}")
                .and_then(|_| out.flush())
                .expect("stdout");
        }
        return;
    }
    let now = std::time::SystemTime::now();
    let ns = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    println!("stamp {ns}");
}
