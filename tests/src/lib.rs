//! Whole-system harness: starts the real service binaries against a nats-server and a database
//! of their own, and talks to them through the public API.

use agentscope_testkit::{Nats, Proc, TempDir, TestDb, bin, wait_for, wait_http_ok};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use agentscope_testkit as kit;

/// One series of the Prometheus page at `base` + `/metrics`: the value on the line that starts
/// with `series` (a name, with its labels if it has any, e.g.
/// `agentscope_dispatch_total{result="offered"}`), 0 while the page has no such line; None when
/// the page cannot be read.
pub async fn metric(base: &str, series: &str) -> Option<f64> {
    let text = kit::http_client()
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0),
    )
}

/// The benchmark's stamp without libc (tests/stamp_bare, compiled by tests/build.rs): prints
/// `stamp <unix nanoseconds>` read first thing after its `execve`. Empty where it is not built
/// (other than x86_64 Linux).
pub const BENCH_STAMP_BARE: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/agentscope-bench-stamp-bare"));

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub token: String,
    pub client: reqwest::Client,
}

impl Api {
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value)> {
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req
            .send()
            .await
            .with_context(|| format!("request {path}"))?;
        let status = res.status().as_u16();
        let text = res.text().await?;
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, v))
    }

    /// An Artifact's content, as served (headers included).
    pub async fn artifact_content(&self, artifact_id: &str) -> Result<reqwest::Response> {
        Ok(self
            .client
            .get(format!("{}/v1/artifacts/{artifact_id}/content", self.base))
            .bearer_auth(&self.token)
            .send()
            .await?)
    }

    pub async fn get(&self, path: &str) -> Result<Value> {
        let (st, v) = self.send(reqwest::Method::GET, path, None).await?;
        if st != 200 {
            bail!("GET {path} -> {st}: {v}");
        }
        Ok(v)
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<Value> {
        let (st, v) = self.send(reqwest::Method::POST, path, Some(body)).await?;
        if !(200..300).contains(&st) {
            bail!("POST {path} -> {st}: {v}");
        }
        Ok(v)
    }

    pub fn with_token(&self, token: &str) -> Api {
        Api {
            token: token.to_string(),
            ..self.clone()
        }
    }
}

/// The Vault key of test stacks (gateway and dataplane).
pub const VAULT_KEYS: &str =
    "test1:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

pub struct StackOptions {
    pub lease_ttl_ms: u64,
    pub sweep_interval_ms: u64,
    pub heartbeat_ttl_ms: u64,
    /// Extra AGENTSCOPE_* settings for the gateway.
    pub gateway_env: Vec<(String, String)>,
    /// Extra AGENTSCOPE_* settings for the dataplane replicas (e.g. the model server).
    pub dataplane_env: Vec<(String, String)>,
    /// Extra AGENTSCOPE_* settings for the scheduler.
    pub scheduler_env: Vec<(String, String)>,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            lease_ttl_ms: 3_000,
            sweep_interval_ms: 250,
            heartbeat_ttl_ms: 3_000,
            gateway_env: vec![],
            dataplane_env: vec![],
            scheduler_env: vec![],
        }
    }
}

/// NATS, a database, svc-gateway, svc-scheduler and svc-dataplane, plus a workspace.
pub struct Stack {
    pub nats: Nats,
    pub db: TestDb,
    pub pg: sqlx::PgPool,
    pub gateway: Proc,
    pub scheduler: Proc,
    pub dataplane: Proc,
    pub api: Api,
    pub host_token: String,
    pub workspace_id: String,
    pub scheduler_health: String,
    /// A directory providers may write to: they run as an unprivileged user when tests run as
    /// root.
    pub shared: PathBuf,
    scheduler_env: Vec<(String, String)>,
    dataplane_env: Vec<(String, String)>,
    // Dropped last: keeps logs of a failed test.
    pub dir: TempDir,
}

fn common_env(nats: &Nats, db: &TestDb, service: &str) -> Vec<(String, String)> {
    let mut env = nats.service_env(service);
    env.extend([
        ("AGENTSCOPE_DATABASE_URL".into(), db.url()),
        (
            "RUST_LOG".into(),
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        ),
    ]);
    env
}

impl Stack {
    pub async fn start(label: &str, opts: StackOptions) -> Result<Stack> {
        let dir = TempDir::new(label);
        let nats = Nats::start(&dir.path).await?;
        let db = TestDb::create().await?;
        // Kept if start-up fails (removed below once everything is up).
        std::fs::write(dir.path.join(".keep"), "start-up failed")?;
        let mut env = common_env(&nats, &db, "gateway");
        env.push(("AGENTSCOPE_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()));
        env.push(("AGENTSCOPE_VAULT_KEYS".into(), VAULT_KEYS.into()));
        env.push((
            "AGENTSCOPE_HOST_OFFLINE_AFTER_MS".into(),
            opts.heartbeat_ttl_ms.to_string(),
        ));
        env.extend(opts.gateway_env.iter().cloned());
        // Start the scheduler first: it runs the migrations the gateway also checks.
        let mut senv = common_env(&nats, &db, "scheduler");
        senv.push((
            "AGENTSCOPE_LEASE_TTL_MS".into(),
            opts.lease_ttl_ms.to_string(),
        ));
        senv.push((
            "AGENTSCOPE_SWEEP_INTERVAL_MS".into(),
            opts.sweep_interval_ms.to_string(),
        ));
        senv.push((
            "AGENTSCOPE_HEARTBEAT_TTL_MS".into(),
            opts.heartbeat_ttl_ms.to_string(),
        ));
        senv.extend(opts.scheduler_env.iter().cloned());
        let with_addr = |base: &Vec<(String, String)>, key: &str, port: u16| {
            let mut e = base.clone();
            e.push((key.to_string(), format!("127.0.0.1:{port}")));
            e
        };
        let (scheduler, sched_port) = kit::spawn_on_free_port(
            "scheduler",
            &bin("svc-scheduler")?,
            |port| with_addr(&senv, "AGENTSCOPE_HEALTH_ADDR", port),
            "/readyz",
            &dir.path,
        )
        .await?;
        senv.push((
            "AGENTSCOPE_HEALTH_ADDR".into(),
            format!("127.0.0.1:{sched_port}"),
        ));
        let scheduler_health = format!("http://127.0.0.1:{sched_port}");
        let (gateway, gw_port) = kit::spawn_on_free_port(
            "gateway",
            &bin("svc-gateway")?,
            |port| with_addr(&env, "AGENTSCOPE_HTTP_ADDR", port),
            "/readyz",
            &dir.path,
        )
        .await?;
        let mut denv = common_env(&nats, &db, "dataplane");
        denv.push((
            "AGENTSCOPE_SESSIONS_DIR".into(),
            dir.path.join("sessions").to_string_lossy().into_owned(),
        ));
        denv.push((
            "AGENTSCOPE_REMOTE_DIR".into(),
            dir.path
                .join("shared-storage")
                .to_string_lossy()
                .into_owned(),
        ));
        denv.push(("AGENTSCOPE_SESSION_LEASE_TTL_MS".into(), "3000".into()));
        denv.push(("AGENTSCOPE_SWEEP_INTERVAL_MS".into(), "250".into()));
        denv.push(("AGENTSCOPE_MODEL_MAX_RETRIES".into(), "2".into()));
        denv.push(("AGENTSCOPE_VAULT_KEYS".into(), VAULT_KEYS.into()));
        denv.extend(opts.dataplane_env.iter().cloned());
        let mut first = denv.clone();
        first.push(("AGENTSCOPE_REPLICA_ID".into(), "dp-0".into()));
        let (dataplane, _) = kit::spawn_on_free_port(
            "dataplane",
            &bin("svc-dataplane")?,
            |port| with_addr(&first, "AGENTSCOPE_HEALTH_ADDR", port),
            "/readyz",
            &dir.path,
        )
        .await?;
        let base = format!("http://127.0.0.1:{gw_port}");
        let pg = db.pool().await?;
        let admin = Api {
            base: base.clone(),
            token: ADMIN_TOKEN.into(),
            client: kit::http_client(),
        };
        let ws = admin
            .post("/v1/workspaces", json!({"name": format!("ws-{label}")}))
            .await?;
        let api = admin.with_token(ws["api_token"].as_str().context("api_token")?);
        let ht = api
            .post("/v1/host-tokens", json!({"name": "test-hosts"}))
            .await?;
        let _ = std::fs::remove_file(dir.path.join(".keep"));
        Ok(Stack {
            nats,
            db,
            pg,
            gateway,
            scheduler,
            dataplane,
            api,
            host_token: ht["token"].as_str().context("host token")?.to_string(),
            workspace_id: ws["workspace"]["id"]
                .as_str()
                .context("workspace id")?
                .to_string(),
            scheduler_health,
            shared: {
                use std::os::unix::fs::PermissionsExt;
                let shared = dir.path.join("shared");
                std::fs::create_dir_all(&shared)?;
                std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777))?;
                shared
            },
            scheduler_env: senv,
            dataplane_env: denv,
            dir,
        })
    }

    /// Another svc-dataplane replica named `name`, with the stack's dataplane settings; ready.
    pub async fn spawn_dataplane(&self, name: &str) -> Result<Proc> {
        let mut env = self.dataplane_env.clone();
        env.push(("AGENTSCOPE_REPLICA_ID".into(), name.into()));
        let (p, _) = kit::spawn_on_free_port(
            &format!("dataplane-{name}"),
            &bin("svc-dataplane")?,
            |port| {
                let mut e = env.clone();
                e.push(("AGENTSCOPE_HEALTH_ADDR".into(), format!("127.0.0.1:{port}")));
                e
            },
            "/readyz",
            &self.dir.path,
        )
        .await?;
        Ok(p)
    }

    /// Another svc-scheduler replica named `name`, with the stack's scheduler settings; ready.
    /// Returns it and the base URL of its health listener (`/metrics`).
    pub async fn spawn_scheduler(&self, name: &str) -> Result<(Proc, String)> {
        let env = self.scheduler_env.clone();
        let (p, port) = kit::spawn_on_free_port(
            &format!("scheduler-{name}"),
            &bin("svc-scheduler")?,
            |port| {
                let mut e = env.clone();
                e.push(("AGENTSCOPE_HEALTH_ADDR".into(), format!("127.0.0.1:{port}")));
                e
            },
            "/readyz",
            &self.dir.path,
        )
        .await?;
        Ok((p, format!("http://127.0.0.1:{port}")))
    }

    /// Stops the scheduler (SIGKILL when `crash`, else SIGTERM) and starts a new one.
    pub async fn restart_scheduler(&mut self, crash: bool) -> Result<()> {
        if crash {
            self.scheduler.kill9();
        } else {
            self.scheduler.terminate(Duration::from_secs(20));
        }
        self.scheduler = Proc::spawn(
            "scheduler",
            &bin("svc-scheduler")?,
            &[],
            &self.scheduler_env,
            &self.dir.path,
        )?;
        wait_http_ok(
            &format!("{}/readyz", self.scheduler_health),
            Duration::from_secs(60),
        )
        .await
    }

    /// Spawns svc-host; `state_dir` keeps its identity across restarts.
    pub fn spawn_host(
        &self,
        name: &str,
        pool: &str,
        capacity: u32,
        state_dir: &Path,
        extra: &[(&str, &str)],
    ) -> Result<Proc> {
        let mut env = vec![
            ("AGENTSCOPE_NATS_URL".to_string(), self.nats.url()),
            ("AGENTSCOPE_HEALTH_ADDR".into(), "127.0.0.1:0".into()),
            (
                "AGENTSCOPE_STATE_DIR".into(),
                state_dir.to_string_lossy().to_string(),
            ),
            ("AGENTSCOPE_HOST_TOKEN".into(), self.host_token.clone()),
            ("AGENTSCOPE_POOL".into(), pool.into()),
            ("AGENTSCOPE_CAPACITY".into(), capacity.to_string()),
            ("AGENTSCOPE_NAME".into(), name.into()),
            ("AGENTSCOPE_POLL_INTERVAL_MS".into(), "500".into()),
            ("AGENTSCOPE_KILL_GRACE_MS".into(), "2000".into()),
            ("AGENTSCOPE_API_URL".into(), self.api.base.clone()),
            // Agent CLIs are discovered only where a test asks for them (`extra`).
            ("AGENTSCOPE_PROVIDERS".into(), "command".into()),
            (
                "RUST_LOG".into(),
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            ),
        ];
        for (k, v) in extra {
            env.push((k.to_string(), v.to_string()));
        }
        Proc::spawn(
            &format!("host-{name}"),
            &bin("svc-host")?,
            &[],
            &env,
            &self.dir.path,
        )
    }

    /// Spawns a host and waits until the API shows it online and ready for dispatch.
    pub async fn host(&self, name: &str, pool: &str, capacity: u32) -> Result<(Proc, PathBuf)> {
        let state = self.dir.path.join(format!("host-{name}-state"));
        let p = self.spawn_host(name, pool, capacity, &state, &[])?;
        self.wait_host_ready(name).await?;
        Ok((p, state))
    }

    pub async fn wait_host_ready(&self, name: &str) -> Result<Value> {
        let api = self.api.clone();
        let name = name.to_string();
        wait_for(
            &format!("host {name} ready"),
            Duration::from_secs(30),
            || {
                let api = api.clone();
                let name = name.clone();
                async move {
                    let hosts = api.get("/v1/hosts").await.ok()?;
                    hosts["items"]
                        .as_array()?
                        .iter()
                        .find(|h| {
                            h["name"] == name.as_str()
                                && h["online"] == true
                                && h["checks"]["dispatch_readiness"]["ok"] == true
                        })
                        .cloned()
                }
            },
        )
        .await
    }

    /// A pool, a command runtime profile, an agent and its binding. Returns (agent_id, pool_id).
    pub async fn command_agent(
        &self,
        name: &str,
        pool: &str,
        command: &[&str],
        agent_limit: Option<i32>,
    ) -> Result<(String, String)> {
        let pool_v = match self.api.post("/v1/pools", json!({"name": pool})).await {
            Ok(v) => v,
            Err(_) => {
                let pools = self.api.get("/v1/pools").await?;
                pools["items"]
                    .as_array()
                    .context("pools")?
                    .iter()
                    .find(|p| p["name"] == pool)
                    .cloned()
                    .context("pool")?
            }
        };
        let profile = self
            .api
            .post("/v1/runtime-profiles", json!({"name": format!("{name}-profile"), "provider": "command", "params": {"command": command}}))
            .await?;
        let agent = self
            .api
            .post(
                "/v1/agents",
                json!({"name": name, "provider": "command", "instructions": "run the command"}),
            )
            .await?;
        self.api
            .post(
                "/v1/bindings",
                json!({"agent_id": agent["id"], "pool_id": pool_v["id"], "runtime_profile_id": profile["id"],
                       "max_concurrency": agent_limit, "max_attempts": 3, "retry_backoff_ms": 100}),
            )
            .await?;
        Ok((
            agent["id"].as_str().context("agent id")?.into(),
            pool_v["id"].as_str().context("pool id")?.into(),
        ))
    }

    /// Submits a task (`POST /v1/tasks` with `body`, as the caller wrote it): its id.
    pub async fn submit(&self, body: Value) -> Result<String> {
        let t = self.api.post("/v1/tasks", body).await?;
        Ok(t["id"].as_str().context("task id")?.to_string())
    }

    pub async fn task(&self, id: &str) -> Result<Value> {
        self.api.get(&format!("/v1/tasks/{id}")).await
    }

    /// Waits until the task reaches `status` (or any terminal status other than it: error).
    /// Cancels task `id` and waits until it ends `cancelled` with that class.
    pub async fn cancel_task(&self, id: &str, within: Duration) -> Result<Value> {
        self.api
            .post(&format!("/v1/tasks/{id}/cancel"), json!({}))
            .await?;
        let t = self.wait_task(id, "cancelled", within).await?;
        if t["attempts"][0]["failure_class"] != "cancelled" {
            bail!("task {id} ended cancelled without the class: {t}");
        }
        Ok(t)
    }

    pub async fn wait_task(&self, id: &str, status: &str, within: Duration) -> Result<Value> {
        let api = self.api.clone();
        let path = format!("/v1/tasks/{id}");
        let got = wait_for(&format!("task {id} to end"), within, || {
            let api = api.clone();
            let path = path.clone();
            async move {
                let t = api.get(&path).await.ok()?;
                matches!(
                    t["status"].as_str(),
                    Some("succeeded" | "failed" | "cancelled")
                )
                .then_some(t)
            }
        })
        .await?;
        if got["status"] != status {
            bail!(
                "task {id} ended {} instead of {status}: {got:#}",
                got["status"]
            );
        }
        Ok(got)
    }

    pub async fn wait_attempt(
        &self,
        task: &str,
        number: usize,
        status: &str,
        within: Duration,
    ) -> Result<Value> {
        let api = self.api.clone();
        let path = format!("/v1/tasks/{task}");
        let status = status.to_string();
        wait_for(
            &format!("attempt {number} of {task} to be {status}"),
            within,
            || {
                let api = api.clone();
                let path = path.clone();
                let status = status.clone();
                async move {
                    let t = api.get(&path).await.ok()?;
                    let a = t["attempts"].as_array()?.get(number - 1)?.clone();
                    (a["status"] == status.as_str()).then_some(a)
                }
            },
        )
        .await
    }

    /// Every event of a task through the JSON API, page by page.
    pub async fn events(&self, path: &str) -> Result<Vec<Value>> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let url = match &after {
                Some(a) => format!("{path}?after={a}"),
                None => path.to_string(),
            };
            let page = self.api.get(&url).await?;
            let items = page["items"].as_array().context("items")?.clone();
            if items.is_empty() {
                return Ok(out);
            }
            after = page["next"].as_str().map(str::to_string);
            out.extend(items);
        }
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path.join(format!("{name}.log"))).unwrap_or_default()
    }
}

/// A git repository with a `main` branch and a `feature` branch that adds FEATURE.txt.
pub fn git_fixture(dir: &Path) -> Result<PathBuf> {
    let repo = dir.join("fixture-repo");
    std::fs::create_dir_all(&repo)?;
    let git = |args: &[&str]| -> Result<()> {
        let out = std::process::Command::new("git")
            .args([
                "-c",
                "user.name=test",
                "-c",
                "user.email=test@example.com",
                "-c",
                "init.defaultBranch=main",
            ])
            .args(args)
            .current_dir(&repo)
            .output()?;
        if !out.status.success() {
            bail!("git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    git(&["init", "-q"])?;
    std::fs::write(repo.join("README.md"), "fixture\n")?;
    git(&["add", "."])?;
    git(&["commit", "-q", "-m", "initial"])?;
    git(&["checkout", "-q", "-b", "feature"])?;
    std::fs::write(repo.join("FEATURE.txt"), "feature-branch-marker\n")?;
    git(&["add", "."])?;
    git(&["commit", "-q", "-m", "feature"])?;
    git(&["checkout", "-q", "main"])?;
    Ok(repo)
}

/// Processes whose environment names this attempt: the provider's whole tree.
pub fn processes_of_attempt(attempt_id: &str) -> Vec<u32> {
    let needle = format!("AGENTSCOPE_ATTEMPT_ID={attempt_id}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let state_ok = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.split_whitespace().next().unwrap_or("Z").to_string())
                })
                .is_some_and(|st| st != "Z" && st != "X");
            state_ok
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
                    .unwrap_or(false)
        })
        .collect()
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq)]
pub struct Sse {
    pub id: String,
    pub event: String,
    pub data: String,
}

/// Reads an SSE stream until an `end` event, `max` events, or `within` passes.
pub async fn sse_collect(
    api: &Api,
    path: &str,
    last_event_id: Option<&str>,
    max: Option<usize>,
    within: Duration,
) -> Result<Vec<Sse>> {
    use futures::StreamExt;
    let mut req = api
        .client
        .get(format!("{}{path}", api.base))
        .bearer_auth(&api.token)
        .header("accept", "text/event-stream");
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id);
    }
    let res = req.send().await?;
    if res.status() != 200 {
        bail!("SSE {path} -> {}", res.status());
    }
    let mut body = res.bytes_stream();
    let mut parser = agentscope_api::sse::SseParser::default();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .context("SSE stream did not end in time")?;
        let Some(chunk) = chunk else { return Ok(out) };
        for ev in parser.feed(&chunk?) {
            let done = ev.event == "end";
            out.push(Sse {
                id: ev.id.unwrap_or_default(),
                event: ev.event,
                data: ev.data,
            });
            if done || max.is_some_and(|m| out.len() >= m) {
                return Ok(out);
            }
        }
    }
}

/// The shared shape of the fault tests: work whose side effects land in a directory every
/// attempt's uid may write, submitted in bulk, checked for "once".
pub mod faults {
    use super::*;

    /// A directory under the stack's shared one that any attempt's uid may append to.
    pub fn effects_dir(stack: &Stack) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let effects = stack.shared.join("effects");
        std::fs::create_dir_all(&effects).expect("create the effects directory");
        std::fs::set_permissions(&effects, std::fs::Permissions::from_mode(0o777))
            .expect("open the effects directory");
        effects
    }

    /// A command agent whose attempt prints `tick 1..=ticks` a second apart, then appends `run`
    /// to `effects/<task id>` once per run.
    pub async fn ticker(stack: &Stack, effects: &Path, ticks: u32) -> String {
        let script = format!(
            "for i in $(seq 1 {ticks}); do echo tick $i; sleep 1; done; echo run >> {}/$AGENTSCOPE_TASK_ID; echo ok",
            effects.display()
        );
        let (agent, _) = stack
            .command_agent("ticker", "pool", &["sh", "-c", &script], None)
            .await
            .expect("the ticker agent");
        agent
    }

    /// Submits `n` tasks to `agent`; returns their ids.
    pub async fn submit(stack: &Stack, agent: &str, n: usize) -> Vec<String> {
        let mut ids = Vec::new();
        for i in 0..n {
            ids.push(
                stack
                    .submit(json!({"agent_id": agent, "input": i.to_string()}))
                    .await
                    .expect("submit a task"),
            );
        }
        ids
    }

    /// Waits until every task of `ids` is running at the same time.
    pub async fn wait_all_running(stack: &Stack, ids: &[String]) {
        let api = stack.api.clone();
        let all = ids.to_vec();
        wait_for("every attempt to run", Duration::from_secs(60), || {
            let api = api.clone();
            let all = all.clone();
            async move {
                for id in &all {
                    let t = api.get(&format!("/v1/tasks/{id}")).await.ok()?;
                    if t["status"] != "running" {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await
        .expect("every attempt running");
    }

    /// Every task succeeded with exactly one attempt, its events contiguous with every tick
    /// once, and its side effect once.
    pub async fn assert_each_once(stack: &Stack, ids: &[String], effects: &Path, ticks: usize) {
        for id in ids {
            let t = stack
                .wait_task(id, "succeeded", Duration::from_secs(120))
                .await
                .expect("the task succeeds");
            let attempts = t["attempts"].as_array().expect("attempts");
            assert_eq!(attempts.len(), 1, "a healthy attempt was lost: {t:#}");
            let events = stack
                .events(&format!(
                    "/v1/attempts/{}/events",
                    attempts[0]["id"].as_str().expect("attempt id")
                ))
                .await
                .expect("events");
            let seqs: Vec<i64> = events
                .iter()
                .map(|e| e["seq"].as_i64().unwrap_or(0))
                .collect();
            assert_eq!(
                seqs,
                (1..=seqs.len() as i64).collect::<Vec<_>>(),
                "events lost or duplicated"
            );
            let seen = events
                .iter()
                .filter(|e| {
                    e["payload"]["text"]
                        .as_str()
                        .is_some_and(|t| t.starts_with("tick "))
                })
                .count();
            assert_eq!(seen, ticks, "every line once: {events:?}");
            let runs = std::fs::read_to_string(effects.join(id)).unwrap_or_default();
            assert_eq!(runs.lines().count(), 1, "the work ran once: {runs:?}");
        }
    }
}
