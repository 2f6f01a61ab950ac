//! Static consistency checks of the deployment files against each other and
//! against the workspace: `docker-compose.yml`, `docker/Dockerfile` and
//! `scripts/ensure-deps.sh`. Nothing here starts a container or a process; the
//! tests only read files, so they run anywhere without Docker.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde_yaml::{Mapping, Value};

const WORKSPACE_ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const COMPOSE_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docker-compose.yml");
const DOCKERFILE: &str = "docker/Dockerfile";
const ENSURE_DEPS: &str = "scripts/ensure-deps.sh";

/// Services the stack must define.
const REQUIRED_SERVICES: [&str; 6] = [
    "nats",
    "postgres",
    "gateway",
    "scheduler",
    "dataplane",
    "host",
];
/// Services built from this workspace (the others use upstream images).
const AGENTSCOPE_SERVICES: [&str; 4] = ["gateway", "scheduler", "dataplane", "host"];
const ENV_PREFIX: &str = "AGENTSCOPE_";

// ---------------------------------------------------------------------------
// helpers: files
// ---------------------------------------------------------------------------

fn root() -> PathBuf {
    PathBuf::from(WORKSPACE_ROOT)
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// `*.rs` files directly inside `dir` (not recursive), sorted.
fn rust_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|ext| ext == "rs"))
        .collect();
    files.sort();
    files
}

/// `shared/*/src/*.rs` of the workspace.
fn shared_sources() -> Vec<PathBuf> {
    let shared = root().join("shared");
    let mut crates: Vec<PathBuf> = fs::read_dir(&shared)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", shared.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    crates.sort();
    crates
        .iter()
        .flat_map(|c| rust_files_in(&c.join("src")))
        .collect()
}

/// True if `key` occurs in `text` as a whole identifier (not as part of a
/// longer identifier such as `db_pool` for `pool`).
fn contains_identifier(text: &str, key: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(key).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + key.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

// ---------------------------------------------------------------------------
// helpers: docker-compose.yml
// ---------------------------------------------------------------------------

fn compose() -> Value {
    let text = read(Path::new(COMPOSE_FILE));
    serde_yaml::from_str(&text)
        .unwrap_or_else(|e| panic!("docker-compose.yml does not parse as YAML: {e}"))
}

fn services(doc: &Value) -> &Mapping {
    doc.get("services")
        .and_then(Value::as_mapping)
        .expect("docker-compose.yml has no `services` mapping")
}

/// (name, definition) of every service, in file order.
fn service_list(doc: &Value) -> Vec<(String, &Value)> {
    services(doc)
        .iter()
        .map(|(k, v)| {
            let name = k
                .as_str()
                .unwrap_or_else(|| panic!("service key {k:?} is not a string"))
                .to_owned();
            (name, v)
        })
        .collect()
}

fn service<'a>(doc: &'a Value, name: &str) -> &'a Value {
    services(doc)
        .get(name)
        .unwrap_or_else(|| panic!("docker-compose.yml has no service `{name}`"))
}

/// A compose "string or list of strings" field (`command`, healthcheck `test`).
fn string_list(v: Option<&Value>) -> Vec<String> {
    match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                other => panic!("expected a string in list, got {other:?}"),
            })
            .collect(),
        Some(other) => panic!("expected a string or a list of strings, got {other:?}"),
    }
}

fn command(svc: &Value) -> Vec<String> {
    string_list(svc.get("command"))
}

/// Variable names of a service's `environment` (mapping or `KEY=value` list).
fn env_var_names(svc: &Value) -> Vec<String> {
    match svc.get("environment") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Mapping(m)) => m
            .iter()
            .map(|(k, _)| {
                k.as_str()
                    .expect("environment key is not a string")
                    .to_owned()
            })
            .collect(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|i| {
                let entry = i.as_str().expect("environment entry is not a string");
                entry.split('=').next().unwrap_or(entry).to_owned()
            })
            .collect(),
        Some(other) => panic!("`environment` must be a mapping or a list, got {other:?}"),
    }
}

/// Services named in a service's `depends_on` (list or mapping form).
fn depends_on(svc: &Value) -> Vec<String> {
    match svc.get("depends_on") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .expect("depends_on entry is not a string")
                    .to_owned()
            })
            .collect(),
        Some(Value::Mapping(m)) => m
            .iter()
            .map(|(k, _)| {
                k.as_str()
                    .expect("depends_on key is not a string")
                    .to_owned()
            })
            .collect(),
        Some(other) => panic!("`depends_on` must be a list or a mapping, got {other:?}"),
    }
}

/// Named volumes a service mounts (bind mounts and tmpfs excluded).
fn named_volumes(svc: &Value) -> Vec<String> {
    let Some(Value::Sequence(items)) = svc.get("volumes") else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| match item {
            Value::String(spec) => {
                let (source, _) = spec.split_once(':')?;
                let is_path = source.is_empty()
                    || source.starts_with('/')
                    || source.starts_with('.')
                    || source.starts_with('~')
                    || source.starts_with('$');
                (!is_path).then(|| source.to_owned())
            }
            Value::Mapping(m) => {
                let kind = m.get("type").and_then(Value::as_str).unwrap_or("volume");
                if kind != "volume" {
                    return None;
                }
                m.get("source").and_then(Value::as_str).map(str::to_owned)
            }
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------
// helpers: Dockerfile
// ---------------------------------------------------------------------------

/// One Dockerfile instruction: upper-cased keyword and its (continuation-joined)
/// arguments.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    args: String,
}

fn dockerfile_path() -> PathBuf {
    root().join(DOCKERFILE)
}

fn dockerfile_instructions() -> Vec<Instruction> {
    let text = read(&dockerfile_path());
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        // Comment lines (also allowed in the middle of a continued instruction)
        // and blank lines carry nothing.
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        let full = std::mem::take(&mut current);
        let full = full.trim();
        if full.is_empty() {
            continue;
        }
        let (keyword, args) = full.split_once(char::is_whitespace).unwrap_or((full, ""));
        out.push(Instruction {
            keyword: keyword.to_ascii_uppercase(),
            args: args.trim().to_owned(),
        });
    }
    if !current.trim().is_empty() {
        panic!("{DOCKERFILE} ends inside a line continuation: {current}");
    }
    out
}

/// Instructions of the final (runtime) stage and of everything before it.
fn dockerfile_stages() -> (Vec<Instruction>, Vec<Instruction>) {
    let all = dockerfile_instructions();
    let last_from = all
        .iter()
        .rposition(|i| i.keyword == "FROM")
        .unwrap_or_else(|| panic!("{DOCKERFILE} has no FROM instruction"));
    let (build, runtime) = all.split_at(last_from);
    (build.to_vec(), runtime.to_vec())
}

/// Source and destination operands of a COPY/ADD, flags (`--from=...`) dropped.
fn copy_operands(args: &str) -> Vec<String> {
    let args = args.trim();
    let words: Vec<&str> = args
        .split_whitespace()
        .filter(|w| !w.starts_with("--"))
        .collect();
    let rest = words.join(" ");
    if rest.starts_with('[') {
        serde_json::from_str::<Vec<String>>(&rest)
            .unwrap_or_else(|e| panic!("bad JSON-form COPY in {DOCKERFILE}: {rest}: {e}"))
    } else {
        words.into_iter().map(str::to_owned).collect()
    }
}

fn basename(path: &str) -> &str {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
}

/// Executables the runtime stage copies onto PATH (`/usr/local/bin`).
fn binaries_copied_by_runtime_stage(runtime: &[Instruction]) -> BTreeSet<String> {
    let mut bins = BTreeSet::new();
    for ins in runtime
        .iter()
        .filter(|i| i.keyword == "COPY" || i.keyword == "ADD")
    {
        let ops = copy_operands(&ins.args);
        let Some((dest, sources)) = ops.split_last() else {
            continue;
        };
        if !dest.starts_with("/usr/local/bin") {
            continue;
        }
        if dest.ends_with('/') || dest.trim_end_matches('/') == "/usr/local/bin" {
            bins.extend(sources.iter().map(|s| basename(s).to_owned()));
        } else {
            bins.insert(basename(dest).to_owned());
        }
    }
    bins
}

/// Packages passed to `apt-get install` in the given instructions.
fn apt_packages(instructions: &[Instruction]) -> BTreeSet<String> {
    let mut pkgs = BTreeSet::new();
    for ins in instructions.iter().filter(|i| i.keyword == "RUN") {
        let words: Vec<&str> = ins.args.split_whitespace().collect();
        let mut i = 0;
        while i < words.len() {
            let is_install = (words[i] == "apt-get" || words[i] == "apt")
                && words.get(i + 1).is_some_and(|w| *w == "install");
            if !is_install {
                i += 1;
                continue;
            }
            i += 2;
            while i < words.len() && !matches!(words[i], "&&" | ";" | "||" | "|") {
                let w = words[i].trim_end_matches(';');
                if !w.starts_with('-') && !w.is_empty() {
                    pkgs.insert(w.to_owned());
                }
                if words[i].ends_with(';') {
                    break;
                }
                i += 1;
            }
        }
    }
    pkgs
}

// ---------------------------------------------------------------------------
// helpers: workspace manifests (line-based; no toml crate in dev-deps)
// ---------------------------------------------------------------------------

/// Value of a `key = "value"` line, if `line` is one.
fn toml_string_value(line: &str, key: &str) -> Option<String> {
    let rest = line
        .trim()
        .strip_prefix(key)?
        .trim_start()
        .strip_prefix('=')?
        .trim();
    let rest = rest.split(" #").next().unwrap_or(rest).trim();
    let unquoted = rest
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .or_else(|| rest.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')))?;
    Some(unquoted.to_owned())
}

/// Member directories listed in the root `Cargo.toml` `members = [...]`.
fn workspace_members() -> Vec<String> {
    let manifest = read(&root().join("Cargo.toml"));
    let start = manifest
        .find("members")
        .expect("root Cargo.toml has no `members` list");
    let after = &manifest[start..];
    let open = after.find('[').expect("`members` is not followed by `[`");
    let close = after[open..]
        .find(']')
        .expect("`members` list is not closed")
        + open;
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

/// Every binary target of the workspace, mapped to its member directory
/// (relative to the workspace root). Covers `[[bin]] name = ...`, the implicit
/// `src/main.rs` binary named after the package, and `src/bin/*.rs`.
fn workspace_binaries() -> BTreeMap<String, String> {
    let mut bins = BTreeMap::new();
    for member in workspace_members() {
        let dir = root().join(&member);
        let manifest_path = dir.join("Cargo.toml");
        let manifest = read(&manifest_path);
        let mut section = String::new();
        let mut package_name = None;
        let mut autobins = true;
        for line in manifest.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('[') {
                section = trimmed.to_owned();
                continue;
            }
            match section.as_str() {
                "[package]" => {
                    if let Some(name) = toml_string_value(trimmed, "name") {
                        package_name = Some(name);
                    }
                    if trimmed.replace(' ', "") == "autobins=false" {
                        autobins = false;
                    }
                }
                "[[bin]]" => {
                    if let Some(name) = toml_string_value(trimmed, "name") {
                        bins.insert(name, member.clone());
                    }
                }
                _ => {}
            }
        }
        let package_name = package_name
            .unwrap_or_else(|| panic!("{} has no [package] name", manifest_path.display()));
        if autobins {
            if dir.join("src/main.rs").is_file() {
                bins.insert(package_name, member.clone());
            }
            for file in rust_files_in(&dir.join("src/bin")) {
                if let Some(stem) = file.file_stem().and_then(|s| s.to_str()) {
                    bins.insert(stem.to_owned(), member.clone());
                }
            }
        }
    }
    bins
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

#[test]
fn compose_parses_and_defines_required_services() {
    let doc = compose();
    assert!(
        doc.get("version").is_none(),
        "docker-compose.yml should follow the Compose spec without the obsolete top-level `version:` key"
    );
    let names: BTreeSet<String> = service_list(&doc).into_iter().map(|(n, _)| n).collect();
    let missing: Vec<&str> = REQUIRED_SERVICES
        .iter()
        .copied()
        .filter(|s| !names.contains(*s))
        .collect();
    assert!(
        missing.is_empty(),
        "docker-compose.yml is missing services {missing:?} (has {names:?})"
    );
}

#[test]
fn every_service_has_a_healthcheck() {
    let doc = compose();
    let mut failures = Vec::new();
    for (name, svc) in service_list(&doc) {
        let Some(hc) = svc.get("healthcheck") else {
            failures.push(format!("`{name}` has no healthcheck"));
            continue;
        };
        if hc.get("disable").and_then(Value::as_bool) == Some(true) {
            failures.push(format!("`{name}` disables its healthcheck"));
            continue;
        }
        let test = string_list(hc.get("test"));
        if test.is_empty() || test[0] == "NONE" {
            failures.push(format!("`{name}` healthcheck has no `test` command"));
        }
    }
    assert!(
        failures.is_empty(),
        "healthcheck problems:\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn depends_on_targets_exist() {
    let doc = compose();
    let names: BTreeSet<String> = service_list(&doc).into_iter().map(|(n, _)| n).collect();
    let mut failures = Vec::new();
    for (name, svc) in service_list(&doc) {
        for target in depends_on(svc) {
            if !names.contains(&target) {
                failures.push(format!("`{name}` depends_on unknown service `{target}`"));
            }
            if target == name {
                failures.push(format!("`{name}` depends on itself"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "depends_on problems:\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn agentscope_services_build_from_the_dockerfile_and_run_workspace_binaries() {
    let doc = compose();
    let (build_stages, runtime) = dockerfile_stages();
    let copied = binaries_copied_by_runtime_stage(&runtime);
    let declared = workspace_binaries();
    let build_text: String = build_stages
        .iter()
        .map(|i| format!("{} {}\n", i.keyword, i.args))
        .collect();

    let mut failures = Vec::new();
    for name in AGENTSCOPE_SERVICES {
        let svc = service(&doc, name);
        match svc.get("build") {
            Some(Value::Mapping(build)) => {
                let context = build.get("context").and_then(Value::as_str).unwrap_or(".");
                let dockerfile = build
                    .get("dockerfile")
                    .and_then(Value::as_str)
                    .unwrap_or("Dockerfile");
                let path = root().join(context).join(dockerfile);
                if dockerfile.trim_start_matches("./") != DOCKERFILE
                    || context.trim_end_matches('/') != "."
                {
                    failures.push(format!(
                        "`{name}` builds {context}/{dockerfile}; expected context `.` and dockerfile `{DOCKERFILE}`"
                    ));
                }
                if !path.is_file() {
                    failures.push(format!(
                        "`{name}` builds from {}, which does not exist",
                        path.display()
                    ));
                }
            }
            other => failures.push(format!(
                "`{name}` needs `build: {{context: ., dockerfile: {DOCKERFILE}}}`, has {other:?}"
            )),
        }

        let cmd = command(svc);
        let Some(bin) = cmd.first() else {
            failures.push(format!(
                "`{name}` has no `command` naming the binary to run"
            ));
            continue;
        };
        let bin = basename(bin);
        if !copied.contains(bin) {
            failures.push(format!(
                "`{name}` runs `{bin}`, but the runtime stage of {DOCKERFILE} only copies {copied:?} to /usr/local/bin"
            ));
        }
        if !declared.contains_key(bin) {
            failures.push(format!(
                "`{name}` runs `{bin}`, which is no binary target of the workspace (binaries: {:?})",
                declared.keys().collect::<Vec<_>>()
            ));
        }
    }

    // Everything the image ships must be built by `cargo build --bins` and
    // produced by the builder stage.
    for bin in &copied {
        if !declared.contains_key(bin) {
            failures.push(format!(
                "{DOCKERFILE} copies `{bin}`, which is no binary target of the workspace"
            ));
        }
        if !contains_identifier(&build_text.replace('-', "_"), &bin.replace('-', "_")) {
            failures.push(format!(
                "{DOCKERFILE} runtime stage copies `{bin}`, but the builder stage never mentions it"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "image/binary problems:\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn agentscope_env_vars_are_read_by_the_service_config() {
    let doc = compose();
    let declared = workspace_binaries();
    let shared: Vec<(PathBuf, String)> = shared_sources()
        .into_iter()
        .map(|p| {
            let text = read(&p);
            (p, text)
        })
        .collect();

    let mut failures = Vec::new();
    for name in AGENTSCOPE_SERVICES {
        let svc = service(&doc, name);
        let cmd = command(svc);
        let Some(bin) = cmd.first().map(|b| basename(b).to_owned()) else {
            failures.push(format!(
                "`{name}` has no `command`; cannot tell which crate reads its environment"
            ));
            continue;
        };
        let Some(member) = declared.get(&bin) else {
            failures.push(format!(
                "`{name}` runs `{bin}`, which is no workspace binary"
            ));
            continue;
        };
        let config_path = root().join(member).join("src/config.rs");
        let config_text = fs::read_to_string(&config_path).ok();

        for var in env_var_names(svc) {
            let Some(suffix) = var.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let key = suffix.to_ascii_lowercase();
            let found_in =
                |text: &str| contains_identifier(text, &key) || text.contains(var.as_str());
            let in_config = config_text.as_deref().is_some_and(found_in);
            let in_shared = shared.iter().any(|(_, text)| found_in(text.as_str()));
            if !in_config && !in_shared {
                failures.push(format!(
                    "`{name}` sets {var}, but config key `{key}` appears neither in {member}/src/config.rs{} nor in shared/*/src/*.rs",
                    if config_text.is_none() { " (file missing)" } else { "" }
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "environment variables set in docker-compose.yml that no service config reads:\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn nats_runs_with_jetstream() {
    let doc = compose();
    let nats = service(&doc, "nats");
    let cmd = command(nats);
    assert!(
        cmd.iter().any(|a| a == "-js" || a == "--jetstream"),
        "nats must run with JetStream enabled (`-js`), command is {cmd:?}"
    );
    let image = nats
        .get("image")
        .and_then(Value::as_str)
        .unwrap_or_default();
    assert!(
        image.starts_with("nats:"),
        "nats service should use the official `nats` image, has `{image}`"
    );
}

#[test]
fn referenced_volumes_are_declared() {
    let doc = compose();
    let declared: BTreeSet<String> = match doc.get("volumes") {
        Some(Value::Mapping(m)) => m
            .iter()
            .filter_map(|(k, _)| k.as_str().map(str::to_owned))
            .collect(),
        None | Some(Value::Null) => BTreeSet::new(),
        Some(other) => panic!("top-level `volumes` must be a mapping, got {other:?}"),
    };
    let mut failures = Vec::new();
    for (name, svc) in service_list(&doc) {
        for vol in named_volumes(svc) {
            if !declared.contains(&vol) {
                failures.push(format!(
                    "`{name}` mounts volume `{vol}`, not declared under top-level `volumes`"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "undeclared volumes (declared: {declared:?}):\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn agentscope_containers_know_what_to_run() {
    let doc = compose();
    let (_, runtime) = dockerfile_stages();
    let has_entrypoint = runtime.iter().any(|i| i.keyword == "ENTRYPOINT");
    let without_command: Vec<&str> = AGENTSCOPE_SERVICES
        .iter()
        .copied()
        .filter(|name| command(service(&doc, name)).is_empty())
        .collect();
    assert!(
        has_entrypoint || without_command.is_empty(),
        "the runtime stage of {DOCKERFILE} has no ENTRYPOINT and services {without_command:?} set no `command`"
    );
}

#[test]
fn runtime_image_has_the_tools_healthchecks_use() {
    let doc = compose();
    let (_, runtime) = dockerfile_stages();
    let installed = apt_packages(&runtime);
    let mut failures = Vec::new();
    for name in AGENTSCOPE_SERVICES {
        let hc = service(&doc, name).get("healthcheck");
        let test = string_list(hc.and_then(|h| h.get("test")));
        // ["CMD", "curl", ...] / ["CMD-SHELL", "curl ..."]
        let tool = test
            .get(1)
            .and_then(|t| t.split_whitespace().next())
            .map(|t| basename(t).to_owned());
        let Some(tool) = tool else { continue };
        if matches!(tool.as_str(), "curl" | "wget") && !installed.contains(&tool) {
            failures.push(format!(
                "`{name}` healthcheck runs `{tool}`, which the runtime stage does not install (apt packages: {installed:?})"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "healthcheck tool problems:\n  {}",
        failures.join("\n  ")
    );
}

/// Compose interpolates the whole file before applying profiles, so a
/// `${VAR:?err}` in an opt-in service would break a plain `docker compose up`.
#[test]
fn profile_gated_services_do_not_require_variables() {
    let doc = compose();
    let host_profiles = string_list(service(&doc, "host").get("profiles"));
    assert!(
        !host_profiles.is_empty(),
        "`host` needs a host token that only exists after the stack is up, so it should be behind a compose profile"
    );
    let mut failures = Vec::new();
    for (name, svc) in service_list(&doc) {
        if string_list(svc.get("profiles")).is_empty() {
            continue;
        }
        let text = serde_yaml::to_string(svc).expect("re-serialising a service cannot fail");
        let mut rest = text.as_str();
        while let Some(start) = rest.find("${") {
            let tail = &rest[start + 2..];
            let end = tail.find('}').unwrap_or(tail.len());
            let expr = &tail[..end];
            if expr.contains('?') {
                failures.push(format!(
                    "`{name}` uses required-variable syntax `${{{expr}}}`"
                ));
            }
            rest = &tail[end..];
        }
    }
    assert!(
        failures.is_empty(),
        "profile-gated services must not use ${{VAR:?}} (compose checks it even when the profile is off):\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn ensure_deps_script_exists_and_is_executable() {
    let path = root().join(ENSURE_DEPS);
    let meta = fs::metadata(&path).unwrap_or_else(|e| panic!("{} is missing: {e}", path.display()));
    assert!(meta.is_file(), "{} is not a regular file", path.display());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode();
        assert!(
            mode & 0o111 != 0,
            "{} is not executable (mode {mode:o}); run `chmod +x {ENSURE_DEPS}`",
            path.display()
        );
    }
    let text = read(&path);
    let first = text.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("#!") && first.contains("bash"),
        "{ENSURE_DEPS} should start with a bash shebang, starts with {first:?}"
    );
    assert!(
        text.lines().any(|l| l.trim() == "set -euo pipefail"),
        "{ENSURE_DEPS} should run with `set -euo pipefail`"
    );
}

#[test]
fn the_gateway_needs_a_chosen_admin_token_and_listens_on_loopback_by_default() {
    let doc = compose();
    let text = serde_yaml::to_string(service(&doc, "gateway")).unwrap();
    assert!(
        text.contains("${AGENTSCOPE_ADMIN_TOKEN:?"),
        "compose must refuse to start without an admin token:\n{text}"
    );
    assert!(!text.contains("change-me-admin-token"), "{text}");
    let ports = string_list(service(&doc, "gateway").get("ports"));
    assert!(
        ports
            .iter()
            .all(|p| p.starts_with("${AGENTSCOPE_PUBLISH_ADDR:-127.0.0.1}:")),
        "the API is published on 127.0.0.1 unless told otherwise: {ports:?}"
    );
}

#[test]
fn nats_runs_with_authentication_and_every_service_has_its_credentials() {
    let doc = compose();
    let cmd = command(service(&doc, "nats"));
    let conf_at = cmd
        .iter()
        .position(|a| a == "-c")
        .expect("nats runs with -c");
    assert_eq!(cmd[conf_at + 1], "/etc/nats/nats.conf");
    let conf = read(&root().join("docker/nats.conf"));
    assert!(conf.contains("include \"auth/auth.conf\""), "{conf}");
    assert!(
        command(service(&doc, "nats-auth"))
            .windows(2)
            .any(|w| w[0] == "agentscope" && w[1] == "nats-auth")
    );
    for name in ["gateway", "scheduler", "dataplane"] {
        let env = env_var_names(service(&doc, name));
        for var in ["AGENTSCOPE_NATS_USER", "AGENTSCOPE_NATS_PASSWORD_FILE"] {
            assert!(env.iter().any(|e| e == var), "{name} lacks {var}");
        }
        assert!(
            !env.iter().any(|e| e == "AGENTSCOPE_NATS_ALLOW_OPEN"),
            "{name} must not accept an open NATS"
        );
    }
    assert!(
        env_var_names(service(&doc, "scheduler"))
            .iter()
            .any(|e| e == "AGENTSCOPE_NATS_CALLOUT_SEED_FILE"),
        "the scheduler serves the auth callout"
    );
}
