//! The crate graph of ARCHITECTURE.md ("Crate graph"), read from `cargo metadata`: no service
//! crate depends on another service crate, shared crates depend on no service and no client,
//! test-support crates are only dev-dependencies outside the tests crate, and the Dockerfile
//! copies every workspace member. Nothing here starts a process but `cargo metadata`.

use serde_json::Value;
use std::path::{Path, PathBuf};

const WORKSPACE_ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// What a workspace member is, by where it lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `schemas`, `shared/domain`: the contracts and the pure domain; no workspace dependency.
    Foundation,
    /// `shared/*`: libraries the services share (bus, store, telemetry, tools, ...).
    Shared,
    /// `shared/testkit`, `shared/modelsim`: what tests run against.
    TestSupport,
    /// `svc-*`: one deployable service each.
    Service,
    /// `cli`: the `agentscope` binary.
    Client,
    /// `tests`: whole-system tests and the benchmark.
    Tests,
}

fn kind_of(dir: &str) -> Option<Kind> {
    Some(match dir {
        "schemas" | "shared/domain" => Kind::Foundation,
        "shared/testkit" | "shared/modelsim" => Kind::TestSupport,
        "cli" => Kind::Client,
        "tests" => Kind::Tests,
        d if d.starts_with("shared/") && d.matches('/').count() == 1 => Kind::Shared,
        d if d.starts_with("svc-") && !d.contains('/') => Kind::Service,
        _ => return None,
    })
}

/// A workspace member: its package name, directory (relative to the workspace root) and its
/// dependencies on other members as (name, kind: "normal", "dev" or "build").
#[derive(Debug, Clone)]
struct Member {
    name: String,
    dir: String,
    deps: Vec<(String, String)>,
}

fn root() -> PathBuf {
    Path::new(WORKSPACE_ROOT)
        .canonicalize()
        .expect("workspace root")
}

/// The workspace's members from `cargo metadata --no-deps` (no network, no resolution).
fn members() -> Vec<Member> {
    let cargo = std::env::var("CARGO")
        .ok()
        .or(option_env!("CARGO").map(str::to_owned))
        .unwrap_or_else(|| "cargo".into());
    let root = root();
    let out = std::process::Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .unwrap_or_else(|e| panic!("run {cargo} metadata: {e}"));
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .map(|p| {
            let manifest = PathBuf::from(p["manifest_path"].as_str().expect("manifest_path"));
            let dir = manifest
                .parent()
                .expect("manifest's directory")
                .strip_prefix(&root)
                .expect("a member inside the workspace")
                .to_string_lossy()
                .into_owned();
            let deps = p["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|d| {
                    let name = d["name"].as_str()?;
                    names.contains(&name).then(|| {
                        let kind = d["kind"].as_str().unwrap_or("normal").to_string();
                        (name.to_string(), kind)
                    })
                })
                .collect();
            Member {
                name: p["name"].as_str().expect("name").to_string(),
                dir,
                deps,
            }
        })
        .collect()
}

/// Every edge of `members` that the crate graph forbids, as a sentence each.
fn violations(members: &[Member]) -> Vec<String> {
    let kind = |name: &str| {
        members
            .iter()
            .find(|m| m.name == name)
            .and_then(|m| kind_of(&m.dir))
    };
    let mut found = Vec::new();
    for m in members {
        let Some(from) = kind_of(&m.dir) else {
            found.push(format!(
                "{} ({}) is in no layer of the crate graph: place it in ARCHITECTURE.md and in tests/system/crate_graph.rs",
                m.name, m.dir
            ));
            continue;
        };
        for (dep, dep_kind) in &m.deps {
            let Some(to) = kind(dep) else { continue };
            let dev = dep_kind == "dev";
            let why = match (from, to) {
                (Kind::Service, Kind::Service) => {
                    Some("a service crate never depends on another service crate")
                }
                (_, Kind::Client) => Some("nothing depends on the cli crate"),
                (_, Kind::Tests) => Some("nothing depends on the tests crate"),
                (Kind::Foundation, _) => {
                    Some("schemas and shared/domain depend on no workspace crate")
                }
                (Kind::Shared | Kind::TestSupport, Kind::Service) => {
                    Some("a shared crate never depends on a service crate")
                }
                (Kind::Shared | Kind::Service | Kind::Client, Kind::TestSupport) if !dev => {
                    Some("test-support crates are dev-dependencies only (outside the tests crate)")
                }
                _ => None,
            };
            if let Some(why) = why {
                found.push(format!("{} -> {dep} ({dep_kind}): {why}", m.name));
            }
        }
    }
    found
}

#[test]
fn no_service_crate_depends_on_another_and_the_crate_graph_holds() {
    let members = members();
    for expected in ["svc-gateway", "svc-scheduler", "svc-host", "svc-dataplane"] {
        assert!(
            members
                .iter()
                .any(|m| m.name == expected && kind_of(&m.dir) == Some(Kind::Service)),
            "{expected} is not a service member of the workspace: {members:?}"
        );
    }
    let found = violations(&members);
    assert!(
        found.is_empty(),
        "the crate graph (ARCHITECTURE.md) is broken:\n  {}",
        found.join("\n  ")
    );
}

/// The rules themselves refuse what they name: a service depending on another (even as a
/// dev-dependency), a shared crate on a service, a service on the test kit outside dev.
#[test]
fn the_crate_graph_rules_refuse_forbidden_edges() {
    let member = |name: &str, dir: &str, deps: &[(&str, &str)]| Member {
        name: name.into(),
        dir: dir.into(),
        deps: deps
            .iter()
            .map(|(d, k)| (d.to_string(), k.to_string()))
            .collect(),
    };
    let graph = vec![
        member(
            "svc-a",
            "svc-a",
            &[("svc-b", "normal"), ("testkit", "normal")],
        ),
        member(
            "svc-b",
            "svc-b",
            &[("svc-a", "dev"), ("testkit", "dev"), ("tools", "normal")],
        ),
        member(
            "tools",
            "shared/tools",
            &[("svc-a", "normal"), ("schemas", "normal")],
        ),
        member("schemas", "schemas", &[]),
        member("testkit", "shared/testkit", &[]),
        member("agentscope-cli", "cli", &[("tools", "normal")]),
        member("stray", "elsewhere", &[]),
    ];
    let found = violations(&graph);
    let has = |s: &str| found.iter().any(|f| f.starts_with(s));
    assert!(has("svc-a -> svc-b (normal)"), "{found:?}");
    assert!(has("svc-b -> svc-a (dev)"), "{found:?}");
    assert!(has("svc-a -> testkit (normal)"), "{found:?}");
    assert!(has("tools -> svc-a (normal)"), "{found:?}");
    assert!(has("stray (elsewhere)"), "{found:?}");
    assert_eq!(found.len(), 5, "only the forbidden edges: {found:?}");
}

/// The image's builder stage copies every member's top-level directory (else `cargo build
/// --locked` in docker/Dockerfile cannot find a workspace member).
#[test]
fn the_dockerfile_copies_every_workspace_member() {
    let dockerfile = std::fs::read_to_string(root().join("docker/Dockerfile")).expect("Dockerfile");
    let copied: Vec<String> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|l| !l.starts_with("--"))
        .filter_map(|l| l.split_whitespace().next())
        .map(|s| s.trim_end_matches('/').to_string())
        .collect();
    let missing: Vec<String> = members()
        .into_iter()
        .map(|m| m.dir.split('/').next().unwrap_or_default().to_string())
        .filter(|top| !copied.contains(top))
        .collect();
    assert!(
        missing.is_empty(),
        "docker/Dockerfile copies {copied:?} but not the members' directories {missing:?}"
    );
}
