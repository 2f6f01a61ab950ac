//! `agentscope-sentinel`: the process that keeps one attempt's provider tree together and ends it
//! (see `svc_host::isolation::sentinel_main`). Started only by svc-host.

fn main() {
    svc_host::isolation::sentinel_main()
}
