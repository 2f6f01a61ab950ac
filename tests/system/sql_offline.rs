//! The offline data of sqlx's checked queries (`<crate>/.sqlx/query-*.json`, written by
//! `scripts/sqlx-prepare.sh`) is what `cargo build` checks every `query!`, `query_as!` and
//! `query_scalar!` against (`SQLX_OFFLINE=true`, `.cargo/config.toml`): no database at build time.
//! These tests keep that data true to the migrations without building anything: each stored query
//! is described again by a freshly migrated database, exactly as the macros describe it
//! (`Executor::describe`), and its parameter types, column names and types and nullability must be
//! what the file records. They also check that every crate using the macros has its data, and
//! that the Docker build sees it.

use agentscope_testkit::TestDb;
use serde_json::Value;
use sqlx::{Column, Connection, Either, Executor, TypeInfo};
use std::fs;
use std::path::{Path, PathBuf};

const WORKSPACE_ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn root() -> PathBuf {
    Path::new(WORKSPACE_ROOT)
        .canonicalize()
        .expect("workspace root")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Member directories listed in the root `Cargo.toml` `members = [...]`.
fn members() -> Vec<String> {
    let manifest = read(&root().join("Cargo.toml"));
    let start = manifest.find("members").expect("no `members` list");
    let after = &manifest[start..];
    let open = after.find('[').expect("`members` without `[`");
    let close = after[open..].find(']').expect("`members` not closed") + open;
    after[open + 1..close]
        .split(',')
        .map(|m| {
            m.lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .collect::<String>()
        })
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

/// `*.rs` under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The names of sqlx's checked-query macros (built at run time, so this file names none).
fn checked_macros() -> Vec<String> {
    let bases = ["query", "query_as", "query_scalar"];
    let mut names = Vec::new();
    for b in bases {
        for variant in ["", "_unchecked"] {
            names.push(format!("{b}{variant}!"));
        }
    }
    for f in ["query_file", "query_file_as", "query_file_scalar"] {
        for variant in ["", "_unchecked"] {
            names.push(format!("{f}{variant}!"));
        }
    }
    names
}

/// Whether `text` (comments left out) invokes one of sqlx's checked-query macros.
fn uses_checked_macros(text: &str, macros: &[String]) -> bool {
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    macros.iter().any(|m| {
        code.match_indices(m.as_str()).any(|(i, _)| {
            // A whole identifier: not the tail of a longer one (`my_query!`).
            let before = code[..i].chars().next_back();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

/// The crates that have offline data: `(member dir, its .sqlx dir)`.
fn sqlx_dirs() -> Vec<(String, PathBuf)> {
    let root = root();
    members()
        .into_iter()
        .map(|m| {
            let d = root.join(&m).join(".sqlx");
            (m, d)
        })
        .filter(|(_, d)| d.is_dir())
        .collect()
}

/// The `query-*.json` files of one `.sqlx` directory, sorted.
fn query_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("query-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    files
}

/// A type as the offline data writes it: the name of sqlx's `PgType` variant (`"Uuid"`,
/// `"TextArray"`), which is also how it prints with `Debug` inside `PgTypeInfo(..)`.
fn stored_type(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        // A type sqlx knows only by name or oid, e.g. {"Custom": {...}}: its variant and body.
        Value::Object(o) if o.len() == 1 => {
            let (k, body) = o.iter().next().expect("one key");
            format!("{k}({body})")
        }
        other => other.to_string(),
    }
}

fn live_type(t: &sqlx::postgres::PgTypeInfo) -> String {
    let d = format!("{t:?}");
    d.strip_prefix("PgTypeInfo(")
        .and_then(|s| s.strip_suffix(')'))
        .map(str::to_owned)
        .unwrap_or(d)
}

/// Whether a stored and a live type are the same: equal names, or for a type sqlx knows only by
/// name or oid, the same variant (its body prints differently).
fn same_type(stored: &str, live: &str) -> bool {
    stored == live
        || stored
            .split_once('(')
            .is_some_and(|(variant, _)| live.starts_with(&format!("{variant}(")))
}

/// The differences between what `file` records and what the database says of its query now.
async fn check_file(conn: &mut sqlx::PgConnection, file: &Path) -> Vec<String> {
    let path = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let data: Value = match serde_json::from_str(&read(file)) {
        Ok(v) => v,
        Err(e) => return vec![format!("{path}: not JSON: {e}")],
    };
    let mut problems = Vec::new();
    if data["db_name"] != "PostgreSQL" {
        problems.push(format!(
            "{path}: db_name is {}, not PostgreSQL",
            data["db_name"]
        ));
    }
    let Some(sql) = data["query"].as_str() else {
        return vec![format!("{path}: no `query`")];
    };
    let describe = &data["describe"];
    let live = match conn.describe(sql).await {
        Ok(d) => d,
        Err(e) => {
            return vec![format!(
                "{path}: the query no longer prepares against the migrated schema: {e}\n    {sql}"
            )];
        }
    };

    // Parameters.
    let stored_params: Vec<String> = describe["parameters"]["Left"]
        .as_array()
        .map(|a| a.iter().map(stored_type).collect())
        .unwrap_or_default();
    let live_params: Vec<String> = match live.parameters() {
        Some(Either::Left(p)) => p.iter().map(live_type).collect(),
        Some(Either::Right(n)) => vec!["?".into(); n],
        None => Vec::new(),
    };
    if stored_params.len() != live_params.len()
        || stored_params
            .iter()
            .zip(&live_params)
            .any(|(s, l)| !same_type(s, l))
    {
        problems.push(format!(
            "{path}: parameters recorded {stored_params:?}, the database says {live_params:?}"
        ));
    }

    // Columns: names, types, nullability.
    let stored_cols = describe["columns"].as_array().cloned().unwrap_or_default();
    let stored_nullable = describe["nullable"].as_array().cloned().unwrap_or_default();
    let live_cols = live.columns();
    if stored_cols.len() != live_cols.len() {
        problems.push(format!(
            "{path}: {} columns recorded, the database says {}",
            stored_cols.len(),
            live_cols.len()
        ));
    }
    for (i, (s, l)) in stored_cols.iter().zip(live_cols).enumerate() {
        let s_name = s["name"].as_str().unwrap_or_default();
        if s_name != l.name() {
            problems.push(format!(
                "{path}: column {i} recorded as `{s_name}`, the database says `{}`",
                l.name()
            ));
        }
        let s_type = stored_type(&s["type_info"]);
        let l_type = live_type(l.type_info());
        if !same_type(&s_type, &l_type) {
            problems.push(format!(
                "{path}: column {i} `{s_name}` recorded as {s_type}, the database says {l_type} ({})",
                l.type_info().name()
            ));
        }
        let s_null = stored_nullable.get(i).and_then(Value::as_bool);
        let l_null = live.nullable(i);
        if s_null != l_null {
            problems.push(format!(
                "{path}: column {i} `{s_name}` recorded nullable {s_null:?}, the database says {l_null:?}"
            ));
        }
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_offline_data_matches_the_migrated_schema() {
    let files: Vec<PathBuf> = sqlx_dirs()
        .iter()
        .flat_map(|(_, d)| query_files(d))
        .collect();
    assert!(
        !files.is_empty(),
        "no .sqlx/query-*.json in any workspace crate"
    );

    let db = TestDb::create().await.expect("test database");
    let pool = db.pool().await.expect("pool");
    let migrations = root().join("shared/store/migrations");
    sqlx::migrate::Migrator::new(migrations.as_path())
        .await
        .expect("read the migrations")
        .run(&pool)
        .await
        .expect("migrate the test database");
    pool.close().await;
    let mut conn = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("connect to the test database");

    let mut problems = Vec::new();
    for f in &files {
        problems.extend(check_file(&mut conn, f).await);
    }
    conn.close().await.ok();
    assert!(
        problems.is_empty(),
        "{} of {} offline query files disagree with the migrations; run scripts/sqlx-prepare.sh \
         (and check the queries it names):\n  {}",
        problems.len(),
        files.len(),
        problems.join("\n  ")
    );
}

#[test]
fn every_crate_using_checked_queries_has_its_offline_data() {
    let root = root();
    let macros = checked_macros();
    let mut missing = Vec::new();
    let mut users = Vec::new();
    for m in members() {
        let mut files = Vec::new();
        for sub in ["src", "tests", "benches", "examples"] {
            rust_files(&root.join(&m).join(sub), &mut files);
        }
        let using: Vec<&PathBuf> = files
            .iter()
            .filter(|f| uses_checked_macros(&read(f), &macros))
            .collect();
        if using.is_empty() {
            continue;
        }
        users.push(m.clone());
        let dir = root.join(&m).join(".sqlx");
        if !dir.is_dir() || query_files(&dir).is_empty() {
            missing.push(format!(
                "{m} uses sqlx's checked queries (e.g. {}) but has no {m}/.sqlx/query-*.json; run scripts/sqlx-prepare.sh {m}",
                using[0].strip_prefix(&root).unwrap_or(using[0]).display()
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
    assert!(
        users.iter().any(|m| m == "svc-gateway"),
        "the search for checked queries found none in svc-gateway; is it still looking for the right macros?"
    );
}

#[test]
fn builds_are_offline_by_default_and_the_image_sees_the_offline_data() {
    let root = root();
    let config = read(&root.join(".cargo/config.toml"));
    assert!(
        config
            .lines()
            .any(|l| l.replace(' ', "") == "SQLX_OFFLINE=\"true\""),
        ".cargo/config.toml must set SQLX_OFFLINE = \"true\" in [env]"
    );

    // The builder stage's COPY sources (the runtime stage copies `--from=builder`).
    let dockerfile = read(&root.join("docker/Dockerfile"));
    let sources: Vec<String> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|l| l.to_ascii_uppercase().starts_with("COPY ") && !l.contains("--from"))
        .flat_map(|l| {
            let ops: Vec<&str> = l.split_whitespace().skip(1).collect();
            ops[..ops.len().saturating_sub(1)]
                .iter()
                .map(|s| s.trim_start_matches("./").trim_end_matches('/').to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    let copied = |rel: &str| {
        sources
            .iter()
            .any(|s| s == "." || s == rel || rel.starts_with(&format!("{s}/")))
    };
    let ignored = fs::read_to_string(root.join(".dockerignore")).unwrap_or_default();
    let mut missing = Vec::new();
    let mut wanted = vec![".cargo".to_string()];
    wanted.extend(sqlx_dirs().into_iter().map(|(m, _)| format!("{m}/.sqlx")));
    for rel in &wanted {
        if !copied(rel) {
            missing.push(format!("docker/Dockerfile does not COPY {rel}"));
        }
        let name = rel.rsplit('/').next().unwrap_or(rel);
        if ignored.lines().any(|l| l.contains(name)) {
            missing.push(format!(".dockerignore leaves out {rel}"));
        }
    }
    assert!(
        missing.is_empty(),
        "the image build would not see the offline data (copied: {sources:?}):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn the_macro_search_finds_invocations_and_skips_comments_and_other_names() {
    let m = checked_macros();
    let q = |s: &str| s.replace("Q", "query");
    assert!(uses_checked_macros(
        &q("let r = sqlx::Q!(\"SELECT 1\")"),
        &m
    ));
    assert!(uses_checked_macros(&q("sqlx::Q_as!(T, \"SELECT 1\")"), &m));
    assert!(uses_checked_macros(&q("Q_scalar!(\"SELECT 1\")"), &m));
    assert!(!uses_checked_macros(&q("// sqlx::Q!(\"SELECT 1\")"), &m));
    assert!(!uses_checked_macros(&q("my_Q!(\"x\")"), &m));
    assert!(!uses_checked_macros(&q("sqlx::Q(\"SELECT 1\")"), &m));
}
