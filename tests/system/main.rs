//! Whole-system tests: the real service binaries against a real nats-server and PostgreSQL.
//! One binary for all of them (link time); each test has its own NATS, database and services.

mod agents;
mod api_contract;
mod approvals;
mod bad_input;
mod bench_stamp;
mod cancel;
mod compose;
mod crate_graph;
mod e2e;
mod events;
mod executor;
mod explain;
mod failover;
mod faults_drain;
mod faults_edges;
mod faults_host;
mod faults_nats;
mod faults_outage;
mod faults_timeouts;
mod faults_worker;
mod harness;
mod isolation_host;
mod isolation_nats;
mod isolation_policy;
mod isolation_sandbox;
mod isolation_worker;
mod limits;
mod managed;
mod restart;
mod sql_offline;
mod submissions;
