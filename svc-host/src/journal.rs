//! What the host keeps on disk: its identity and, per Attempt, the lease fencing token and the
//! checkpoint of events already reported. Writes go to a temp file, fsync, then rename.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("identity file {0} does not hold a UUID")]
    BadIdentity(PathBuf),
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` atomically: a reader (or a restarted host after a crash of this
/// process) sees the old or the new content, never a mix. `durable` also survives power loss.
/// The file is its owner's only (0600).
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    f.write_all(bytes).map_err(io("write", &tmp))?;
    if durable {
        f.sync_all().map_err(io("sync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io("rename", path))?;
    Ok(())
}

/// The host's stable id: read from `state_dir/host_id`, created once.
pub fn identity(state_dir: &Path) -> Result<Uuid, Error> {
    std::fs::create_dir_all(state_dir).map_err(io("create", state_dir))?;
    let path = state_dir.join("host_id");
    match std::fs::read_to_string(&path) {
        Ok(s) => Uuid::parse_str(s.trim()).map_err(|_| Error::BadIdentity(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = Uuid::new_v4();
            write_atomic(&path, id.to_string().as_bytes(), true)?;
            Ok(id)
        }
        Err(e) => Err(io("read", &path)(e)),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub attempt_id: String,
    pub task_id: String,
    pub lease_key: String,
    pub lease_token: u64,
    /// Highest event seq the bus acknowledged.
    pub last_seq: u64,
    /// Where the attempt is (the host writes `claimed` when it takes it).
    pub state: agentscope_domain::AttemptStatus,
    #[serde(default)]
    pub provider_session_id: String,
    #[serde(default)]
    pub provider: String,
    /// The whole assignment (protobuf, hex), so a restarted host can resume the attempt.
    #[serde(default)]
    pub assignment_hex: String,
    #[serde(default)]
    pub saved_at_ms: i64,
}

#[derive(Clone)]
pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    pub fn open(state_dir: &Path) -> Result<Self, Error> {
        let dir = state_dir.join("journal");
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        // It holds task credentials: the host's user only.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod", &dir))?;
        Ok(Self { dir })
    }

    fn path(&self, attempt_id: &str) -> PathBuf {
        self.dir.join(format!("{attempt_id}.json"))
    }

    /// Checkpoints survive a crash of the host process (the case they exist for); `durable`
    /// adds an fsync for state changes that must survive the machine too.
    pub fn save(&self, e: &Entry, durable: bool) -> Result<(), Error> {
        let bytes = serde_json::to_vec_pretty(e).expect("journal entry serializes");
        write_atomic(&self.path(&e.attempt_id), &bytes, durable)
    }

    pub fn remove(&self, attempt_id: &str) -> Result<(), Error> {
        let p = self.path(attempt_id);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", &p)(e)),
            _ => Ok(()),
        }
    }

    /// Entries left by a previous run; unreadable files are skipped with a warning.
    pub fn entries(&self) -> Result<Vec<Entry>, Error> {
        let mut out = Vec::new();
        for f in std::fs::read_dir(&self.dir).map_err(io("read", &self.dir))? {
            let f = f.map_err(io("read", &self.dir))?;
            if f.path().extension().is_some_and(|e| e == "json") {
                match std::fs::read(f.path())
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                {
                    Some(e) => out.push(e),
                    None => {
                        tracing::warn!(path = %f.path().display(), "unreadable journal entry skipped")
                    }
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_stable_across_calls() {
        let dir = std::env::temp_dir().join(format!("agentscope-id-{}", Uuid::new_v4()));
        let a = identity(&dir).unwrap();
        let b = identity(&dir).unwrap();
        assert_eq!(a, b);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn journal_round_trips_entries() {
        let dir = std::env::temp_dir().join(format!("agentscope-j-{}", Uuid::new_v4()));
        let j = Journal::open(&dir).unwrap();
        let e = Entry {
            attempt_id: "a1".into(),
            task_id: "t1".into(),
            lease_key: "attempt.a1".into(),
            lease_token: 7,
            last_seq: 3,
            state: agentscope_domain::AttemptStatus::Running,
            provider_session_id: String::new(),
            provider: String::new(),
            assignment_hex: String::new(),
            saved_at_ms: 0,
        };
        j.save(&e, true).unwrap();
        let got = j.entries().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].lease_token, 7);
        j.remove("a1").unwrap();
        assert!(j.entries().unwrap().is_empty());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
