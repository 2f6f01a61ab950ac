//! `agentscope-bench-stamp`: the benchmark's no-op provider and tool. The first thing it does is
//! read the wall clock (CLOCK_REALTIME, the clock the benchmark's own timestamps use), then it
//! prints `stamp <unix nanoseconds>` and exits 0. "Provider started" and "tool started" in the
//! benchmark mean this reading: the first instruction of the process's `main`, after its exec.

fn main() {
    let now = std::time::SystemTime::now();
    let ns = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    println!("stamp {ns}");
}
