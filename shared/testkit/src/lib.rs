//! Test support: a real nats-server per test on a free port with its own store directory, a
//! fresh PostgreSQL database per test, and service processes spawned like omicron runs its
//! database: argv and env recorded, output captured to files, readiness awaited with a deadline,
//! the whole process group killed on drop.

use anyhow::{Context, Result, bail};
use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Quiet unless TEST_LOG=1; then service output also goes to the terminal.
pub fn verbose() -> bool {
    std::env::var("TEST_LOG").is_ok_and(|v| v == "1")
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// A directory for one test's files; kept when the test fails (so logs can be read).
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        let base = std::env::var("AGENTSCOPE_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| std::env::temp_dir().join("agentscope-tests"));
        let path = base.join(format!("{label}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path).expect("create test dir");
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() || self.path.join(".keep").exists() {
            eprintln!("test files kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Polls `cond` until it yields Some or `within` passes.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut cond: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = cond().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {within:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until a statement of `pool`'s database whose text contains `part` waits on a lock
/// (another transaction holds what it needs): the point where a test lets that transaction go.
pub async fn wait_for_lock(pool: &sqlx::PgPool, part: &str) -> Result<()> {
    wait_for(
        &format!("a statement with `{part}` to wait on a lock"),
        Duration::from_secs(30),
        || {
            let pool = pool.clone();
            async move {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'
                       AND strpos(query, $1) > 0",
                )
                .bind(part)
                .fetch_one(&pool)
                .await
                .ok()?;
                (n > 0).then_some(())
            }
        },
    )
    .await
}

/// The environment a nats-server sharing its machine with the rest of the stack runs with:
/// `GOMAXPROCS` at half the cores, at least one, unless the environment sets it already. Go's
/// scheduler otherwise wakes a second thread for every goroutine made ready and lets it spin
/// looking for work, CPU that PostgreSQL and the services need on a small machine: on two cores
/// nats-server's CPU per attempt fell by 10–30 % with one (docs/BENCHMARKS.md, session 37).
/// `scripts/demo.sh` does the same.
pub fn nats_server_env() -> Vec<(String, String)> {
    if std::env::var_os("GOMAXPROCS").is_some() {
        return Vec::new();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    vec![("GOMAXPROCS".to_string(), (cores / 2).max(1).to_string())]
}

/// The nats-server to use: AGENTSCOPE_NATS_SERVER, else `nats-server` on PATH if it is 2.11+.
pub fn nats_server_bin() -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = std::env::var_os("AGENTSCOPE_NATS_SERVER")
        .map(|p| vec![PathBuf::from(p)])
        .unwrap_or_else(|| {
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("nats-server"))
                        .collect()
                })
                .unwrap_or_default()
        });
    for c in &candidates {
        let Ok(out) = Command::new(c).arg("--version").output() else {
            continue;
        };
        let v = String::from_utf8_lossy(&out.stdout).to_string();
        // "nats-server: v2.15.1"
        let nums: Vec<u32> = v
            .trim()
            .rsplit('v')
            .next()
            .unwrap_or("")
            .split('.')
            .filter_map(|s| s.parse().ok())
            .collect();
        if nums.len() >= 2 && (nums[0], nums[1]) >= (2, 11) {
            return Ok(c.clone());
        }
    }
    bail!(
        "no nats-server 2.11+ found (checked {candidates:?}); run scripts/ensure-deps.sh or set AGENTSCOPE_NATS_SERVER"
    )
}

fn kill_group(child: &mut Child, signal: i32) {
    let pid = child.id() as i32;
    // SAFETY: signals the process group we created for this child.
    unsafe {
        libc::kill(-pid, signal);
    }
}

/// A child process in its own process group, killed (group-wide) on drop, and killed by the
/// kernel if the thread that started it ends first (`PR_SET_PDEATHSIG`): a test or benchmark that
/// is itself killed (a timeout, a signal) leaves no stack running behind it.
pub struct Proc {
    pub name: String,
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[&str],
        envs: &[(String, String)],
        dir: &Path,
    ) -> Result<Proc> {
        use std::os::unix::process::CommandExt;
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0);
        // SAFETY: getpid before the fork; prctl, getppid and raise are async-signal-safe.
        let parent = unsafe { libc::getpid() };
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The parent may have ended before the death signal was armed.
                if libc::getppid() != parent {
                    libc::raise(libc::SIGKILL);
                }
                Ok(())
            });
        }
        if verbose() {
            cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
        } else {
            cmd.stdout(file.try_clone()?).stderr(file);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {name}: {} {args:?}", program.display()))?;
        Ok(Proc {
            name: name.to_string(),
            child: Some(child),
            log,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL to the process group, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c, libc::SIGKILL);
            let _ = c.wait();
        }
    }

    /// SIGKILL to the process only (its children, like a provider, stay behind).
    pub fn kill9_leader(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for a graceful exit.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        // SAFETY: plain signal to our child.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            if Instant::now() > deadline {
                kill_group(&mut c, libc::SIGKILL);
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c, libc::SIGKILL);
            let _ = c.wait();
        }
    }
}

/// A nats-server with JetStream on a free port and its own store directory, with
/// authentication on as in production: the services as configured users, hosts and workers
/// through the scheduler's auth callout.
pub struct Nats {
    pub port: u16,
    pub store: PathBuf,
    pub auth: agentscope_bus::auth::Setup,
    proc: Proc,
    dir: PathBuf,
}

impl Nats {
    pub async fn start(dir: &Path) -> Result<Nats> {
        Self::start_with(dir, true).await
    }

    /// A nats-server that lets anyone in, as a careless install would run it.
    pub async fn start_open(dir: &Path) -> Result<Nats> {
        Self::start_with(dir, false).await
    }

    async fn start_with(dir: &Path, with_auth: bool) -> Result<Nats> {
        let store = dir.join("nats-store");
        let auth = agentscope_bus::auth::Setup::generate();
        // A free port can be taken by a parallel test before we bind it: try again elsewhere.
        let mut last = None;
        for _ in 0..5 {
            let port = free_port();
            Self::write_config(port, &store, dir, with_auth.then_some(&auth))?;
            let proc = Self::spawn(dir)?;
            let mut nats = Nats {
                port,
                store: store.clone(),
                auth: auth.clone(),
                proc,
                dir: dir.to_path_buf(),
            };
            match nats.wait_ready().await {
                Ok(()) => return Ok(nats),
                Err(e) => {
                    nats.proc.kill9();
                    let _ = std::fs::rename(
                        &nats.proc.log,
                        dir.join(format!("nats-failed-{port}.log")),
                    );
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("nats-server did not start")))
    }

    fn write_config(
        port: u16,
        store: &Path,
        dir: &Path,
        auth: Option<&agentscope_bus::auth::Setup>,
    ) -> Result<()> {
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n{}",
            store.display(),
            auth.map(|a| a.server_config()).unwrap_or_default()
        );
        std::fs::write(dir.join("nats.conf"), conf)?;
        Ok(())
    }

    fn spawn(dir: &Path) -> Result<Proc> {
        let bin = nats_server_bin()?;
        let conf = dir.join("nats.conf").to_string_lossy().to_string();
        Proc::spawn("nats", &bin, &["-c", &conf], &nats_server_env(), dir)
    }

    /// A service's settings for this server (`gateway`, `scheduler` or `dataplane`); the
    /// scheduler's include the auth callout's issuer seed.
    pub fn service_env(&self, user: &str) -> Vec<(String, String)> {
        let mut env = vec![
            ("AGENTSCOPE_NATS_URL".to_string(), self.url()),
            ("AGENTSCOPE_NATS_USER".to_string(), user.to_string()),
            (
                "AGENTSCOPE_NATS_PASSWORD".to_string(),
                self.auth.password(user).to_string(),
            ),
        ];
        if user == "scheduler" {
            env.push((
                "AGENTSCOPE_NATS_CALLOUT_SEED".to_string(),
                self.auth.issuer.seed(),
            ));
        }
        env
    }

    /// A raw client with a service's credentials, for tests that play a service.
    pub async fn service_client(&self, user: &str) -> Result<async_nats::Client> {
        Ok(async_nats::ConnectOptions::new()
            .user_and_password(user.into(), self.auth.password(user).into())
            .connect(self.url())
            .await?)
    }

    /// Ready when our own process says so (a port that answers could be another test's server).
    async fn wait_ready(&mut self) -> Result<()> {
        let log = self.proc.log.clone();
        let proc = &mut self.proc;
        wait_for("nats-server to be ready", Duration::from_secs(20), || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            std::future::ready(if proc.exited().is_some() {
                Some(Err(anyhow::anyhow!("nats-server exited: {text}")))
            } else {
                text.contains("Server is ready").then_some(Ok(()))
            })
        })
        .await?
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        self.proc.kill9();
    }

    /// Starts it again on the same port with the same store.
    pub async fn restart(&mut self) -> Result<()> {
        self.proc.kill9();
        let _ = std::fs::remove_file(&self.proc.log);
        self.proc = Self::spawn(&self.dir)?;
        self.wait_ready().await
    }
}

/// A fresh database on the machine's PostgreSQL, dropped after the test.
pub struct TestDb {
    pub name: String,
    admin_url: String,
}

impl TestDb {
    pub fn admin_url() -> String {
        std::env::var("AGENTSCOPE_TEST_PG")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    pub async fn create() -> Result<TestDb> {
        use sqlx::Connection;
        let admin_url = Self::admin_url();
        let name = format!("agentscope_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin_url)
            .await
            .with_context(|| format!("connect to {admin_url}; run scripts/ensure-deps.sh"))?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await?;
        Ok(TestDb { name, admin_url })
    }

    pub fn url(&self) -> String {
        match self.admin_url.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{}", self.name),
            None => format!("{}/{}", self.admin_url, self.name),
        }
    }

    pub async fn pool(&self) -> Result<sqlx::PgPool> {
        Ok(sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&self.url())
            .await?)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test database kept: {}", self.name);
            return;
        }
        let name = self.name.clone();
        let admin = self.admin_url.clone();
        // Drop needs async I/O; do it on a thread of its own so any runtime state is fine.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async move {
                    use sqlx::Connection;
                    if let Ok(mut c) = sqlx::PgConnection::connect(&admin).await {
                        let _ =
                            sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                                .execute(&mut c)
                                .await;
                    }
                });
            }
        })
        .join();
    }
}

/// Where the workspace's binaries are: AGENTSCOPE_BIN_DIR, else next to the test executable.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("AGENTSCOPE_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/system-xxxx (a test) or target/debug/agentscope-bench (a binary)
    let dir = exe.parent().expect("executable's directory");
    if dir.ends_with("deps") {
        dir.parent().expect("target dir").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

pub fn bin(name: &str) -> Result<PathBuf> {
    let p = bin_dir().join(name);
    if !p.exists() {
        bail!(
            "{} is missing: build the workspace's binaries first (cargo build --workspace --bins)",
            p.display()
        );
    }
    Ok(p)
}

/// Spawns a service on a fresh port (`env_for(port)` builds its environment) until it answers
/// 200 at `http://127.0.0.1:PORT{ready_path}` while our own process is alive: a port taken by a
/// parallel test between picking and binding it is retried elsewhere.
/// Whether a service's log says it listens on `addr`: a line naming the address with
/// "listening" (a failure to bind names the address too, and must not count).
fn says_listening(log: &str, addr: &str) -> bool {
    let names = |l: &str| {
        l.match_indices(addr).any(|(i, _)| {
            !l[i + addr.len()..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
    };
    log.lines().any(|l| l.contains(" listening") && names(l))
}

pub async fn spawn_on_free_port(
    name: &str,
    program: &Path,
    env_for: impl Fn(u16) -> Vec<(String, String)>,
    ready_path: &str,
    dir: &Path,
) -> Result<(Proc, u16)> {
    let client = http_client();
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port();
        let mut proc = Proc::spawn(name, program, &[], &env_for(port), dir)?;
        let url = format!("http://127.0.0.1:{port}{ready_path}");
        // Ours only if our own process says it listens there (a process that failed to bind
        // exits instead, and the port may answer for a parallel test's service). Its failure
        // names the address too ("bind health listener 127.0.0.1:<port>"), and is printed
        // before it exits: only a line saying it listens counts.
        let addr = format!("127.0.0.1:{port}");
        let ready = wait_for(
            &format!("{name} to be ready"),
            Duration::from_secs(60),
            || {
                let exited = proc.exited().is_some();
                let listening = says_listening(&proc.log_text(), &addr);
                let (client, url) = (client.clone(), url.clone());
                async move {
                    if exited {
                        return Some(false);
                    }
                    let answers = listening
                        && client
                            .get(&url)
                            .send()
                            .await
                            .is_ok_and(|r| r.status().is_success());
                    answers.then_some(true)
                }
            },
        )
        .await
        .map_err(|_| anyhow::anyhow!("{name} did not become ready in 60 s: {}", proc.log_text()))?;
        if ready {
            return Ok((proc, port));
        }
        last = proc.log_text();
        let _ = std::fs::rename(&proc.log, dir.join(format!("{name}-failed-{port}.log")));
    }
    bail!("{name} did not start: {last}")
}

/// An HTTP client for tests (with the TLS provider installed first, as the binaries do).
pub fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// Waits until `url` answers 200.
pub async fn wait_http_ok(url: &str, within: Duration) -> Result<()> {
    let client = http_client();
    wait_for(&format!("{url} to answer 200"), within, || {
        let client = client.clone();
        async move {
            match client.get(url).send().await {
                Ok(r) if r.status().is_success() => Some(()),
                _ => None,
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::says_listening;

    #[test]
    fn only_a_listening_line_counts_not_a_failure_to_bind_the_same_address() {
        let addr = "127.0.0.1:43025";
        let failed = "INFO async_nats: event: closed\nError: bind health listener 127.0.0.1:43025\n\nCaused by:\n    Address already in use (os error 98)\n";
        assert!(!says_listening(failed, addr));
        let up = "INFO svc_scheduler: svc-scheduler listening for health checks health_addr=127.0.0.1:43025\n";
        assert!(says_listening(up, addr));
        assert!(
            !says_listening(up, "127.0.0.1:4302"),
            "another port is not this one"
        );
    }
}
