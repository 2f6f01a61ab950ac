//! `agentscope-sentinel`: the process that keeps one attempt's provider tree together and ends it
//! (see `svc_host::isolation::sentinel_main`). Started only by svc-host, once per attempt: no
//! Rust runtime set-up (`no_main`; it would read /proc/self/maps for a stack guard), which is a
//! good part of the cost of starting it.
#![no_main]

#[unsafe(no_mangle)]
extern "C" fn main(
    _argc: std::ffi::c_int,
    _argv: *const *const std::ffi::c_char,
) -> std::ffi::c_int {
    svc_host::isolation::sentinel_main()
}
