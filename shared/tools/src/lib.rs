//! agentscope-tools: what a managed session's file and shell tools run on, shared by the
//! dataplane (svc-dataplane) and the self-hosted Worker (`agentscope worker`, in the cli crate),
//! so that neither links the other.
//!
//! - [`env`]: Environments (`local`, and the bubblewrap `sandbox`), each session's own uid and
//!   directory, file tools confined with `openat2(RESOLVE_BENEATH)`, shell runs with limits.
//! - [`ops`]: the file and shell tools as a model calls them (JSON input, capped text output).
//! - [`spawn`]: starting a process without copying the caller's memory (the shell tools', and
//!   svc-host's attempt sentinels).
//! - [`worker`]: the Worker process: registration, presence beats, operations run at most once
//!   by id, results kept for a dataplane that asks again.

pub mod env;
pub mod ops;
pub mod spawn;
pub mod worker;

pub use env::{Gate, GateKey, gate};
pub use ops::{MAX_OUTPUT, ToolOutput, run, run_after};
