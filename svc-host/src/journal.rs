//! What the host keeps on disk: its identity and, per Attempt, the lease fencing token and the
//! checkpoint of events already reported.
//!
//! Attempts' entries live in slot files (`slot-<n>.jnl`), one attempt at a time each, reused:
//! a host creates about as many as it runs attempts at once, and never an inode per save nor per
//! attempt. A slot holds a chain of framed records from its start (length, the chain's nonce,
//! checksum, compact JSON of a whole [`Entry`]); the chain's last complete record is the entry.
//! A save appends a record (one `pwrite`); the first save of an attempt starts a chain with a new
//! nonce at offset 0 of a free slot; removing it zeroes what the slot held (entries carry the
//! task credential), its first header first. A record cut short (the process killed during its
//! write) fails its checksum and the one before it stands; bytes of an earlier chain after the
//! current one carry another nonce and are not read. A chain grown past [`COMPACT_AT`] is written
//! whole to a temp file and renamed over its slot.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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
    create_atomic(path, bytes, durable).map(drop)
}

/// [`write_atomic`], returning the file (open for writing) now at `path`.
fn create_atomic(path: &Path, bytes: &[u8], durable: bool) -> Result<File, Error> {
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
    Ok(f)
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

/// A chain past this size is rewritten with its newest record only (at the next save).
const COMPACT_AT: u64 = 64 << 10;
/// Slot files' extension.
const EXT: &str = "jnl";
/// The earlier form: one pretty-printed JSON entry per attempt, replaced whole at each save. Read
/// (and moved to a slot) when a host finds them at start-up.
const OLD_EXT: &str = "json";
/// Bytes before each record's payload: its length (u32), the chain's nonce (u64) and the
/// checksum of both and the payload (u64), little-endian. All zero: a free slot.
const HEADER: usize = 20;

#[derive(Clone)]
pub struct Journal {
    dir: PathBuf,
    slots: Arc<Mutex<Slots>>,
    /// The journal's flush thread (durable saves are flushed there, not on the caller's thread,
    /// a tokio worker); None if it could not start (they are flushed in place then).
    syncs: Option<std::sync::mpsc::Sender<Flush>>,
}

/// A durable save's flush, asked of the flush thread.
struct Flush {
    file: Arc<File>,
    /// The slot's removals (`Slot::removals`) when the save was made: a slot removed since
    /// needs no flush (its entry is gone, and a removal is never flushed either).
    removals: Arc<AtomicU64>,
    at: u64,
}

/// How long the flush thread gathers durable saves before it flushes them: an attempt removed
/// meanwhile (a short one, ended and reported) needs none, and several saves of one slot need
/// one.
const FLUSH_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Default)]
struct Slots {
    /// Slots holding an attempt's chain, by attempt. A slot being written is out of the map.
    used: HashMap<String, Slot>,
    free: Vec<Slot>,
    /// Slot files this process knows of (the next one created gets a new number).
    count: u64,
    /// Nonces of new chains: a random start, then counted.
    nonce: u64,
}

struct Slot {
    path: PathBuf,
    file: Arc<File>,
    /// Where the chain ends (the next record goes there).
    len: u64,
    nonce: u64,
    /// Bytes from the start that may be other than zero (records with task credentials): a
    /// removal clears them all.
    size: u64,
    /// How often an entry was removed from the slot.
    removals: Arc<AtomicU64>,
}

impl Journal {
    pub fn open(state_dir: &Path) -> Result<Self, Error> {
        let dir = state_dir.join("journal");
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        // It holds task credentials: the host's user only.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod", &dir))?;
        let (tx, rx) = std::sync::mpsc::channel::<Flush>();
        // Ends when the last clone of the journal is gone.
        let syncs = std::thread::Builder::new()
            .name("journal-sync".into())
            .spawn(move || {
                while let Ok(f) = rx.recv() {
                    std::thread::sleep(FLUSH_AFTER);
                    let mut batch = vec![f];
                    batch.extend(rx.try_iter());
                    batch.retain(|f| f.removals.load(Ordering::Acquire) == f.at);
                    // Several durable saves of one slot need one flush.
                    batch.sort_by_key(|f| Arc::as_ptr(&f.file) as usize);
                    batch.dedup_by_key(|f| Arc::as_ptr(&f.file) as usize);
                    for f in batch {
                        flush(&f.file);
                    }
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "start the journal's flush thread"))
            .ok()
            .map(|_| tx);
        let j = Self {
            dir,
            slots: Arc::new(Mutex::new(Slots {
                nonce: Uuid::new_v4().as_u64_pair().0,
                ..Default::default()
            })),
            syncs,
        };
        j.scan()?;
        Ok(j)
    }

    /// Takes in the slot files a previous run left: chains become used slots, the rest free ones.
    fn scan(&self) -> Result<(), Error> {
        let mut slots = self.slots.lock().expect("journal");
        for f in std::fs::read_dir(&self.dir).map_err(io("read", &self.dir))? {
            let path = f.map_err(io("read", &self.dir))?.path();
            let Some(n) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("slot-"))
                .and_then(|n| n.strip_suffix(".jnl"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            slots.count = slots.count.max(n + 1);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io("open", &path))?;
            let bytes = std::fs::read(&path).map_err(io("read", &path))?;
            let (chain, len, nonce) = read_chain(&bytes);
            let slot = Slot {
                path: path.clone(),
                file: Arc::new(file),
                len,
                nonce,
                size: bytes.len() as u64,
                removals: Default::default(),
            };
            match chain {
                Some(e) => {
                    let newer = slots
                        .used
                        .get(&e.attempt_id)
                        .is_none_or(|o| saved_at(o) < e.saved_at_ms);
                    if !newer {
                        release(&mut slots, slot);
                    } else if let Some(old) = slots.used.insert(e.attempt_id.clone(), slot) {
                        release(&mut slots, old);
                    }
                }
                None => {
                    if bytes.iter().any(|b| *b != 0) && bytes.len() >= HEADER {
                        tracing::warn!(path = %path.display(), "journal slot without a complete entry; reused");
                    }
                    release(&mut slots, slot)
                }
            }
        }
        Ok(())
    }

    /// Checkpoints survive a crash of the host process (the case they exist for) once `save`
    /// returns. `durable` state changes are also flushed to disk, by the journal's own thread
    /// within [`FLUSH_AFTER`] (not at all when the entry is removed before: an ended attempt
    /// needs no entry): a machine that loses power before that loses the attempt's newest
    /// state, which the lease's expiry covers as for an attempt never journaled.
    pub fn save(&self, e: &Entry, durable: bool) -> Result<(), Error> {
        // An attempt's saves come one at a time (from its publisher): its slot is out of the map
        // while it is written, and no lock is held meanwhile.
        let (slot, nonce) = {
            let mut slots = self.slots.lock().expect("journal");
            match slots.used.remove(&e.attempt_id) {
                Some(s) => (Some(s), None),
                None => {
                    slots.nonce = slots.nonce.wrapping_add(1);
                    let nonce = slots.nonce;
                    match slots.free.pop() {
                        Some(s) => (Some(Slot { len: 0, nonce, ..s }), None),
                        None => {
                            slots.count += 1;
                            (None, Some((nonce, slots.count - 1)))
                        }
                    }
                }
            }
        };
        let slot = match (slot, nonce) {
            (Some(s), _) => s,
            (None, Some((nonce, n))) => self.create(n, nonce)?,
            (None, None) => unreachable!("a slot or a new one"),
        };
        let slot = match self.append(slot, e) {
            Ok(s) => s,
            Err((s, err)) => {
                // Its chain is as it was (or ends at a record cut short): written again next time.
                self.slots
                    .lock()
                    .expect("journal")
                    .used
                    .insert(e.attempt_id.clone(), s);
                return Err(err);
            }
        };
        let sync = durable.then(|| Flush {
            file: slot.file.clone(),
            removals: slot.removals.clone(),
            at: slot.removals.load(Ordering::Acquire),
        });
        self.slots
            .lock()
            .expect("journal")
            .used
            .insert(e.attempt_id.clone(), slot);
        if let Some(f) = sync {
            match &self.syncs {
                Some(tx) => {
                    if let Err(std::sync::mpsc::SendError(f)) = tx.send(f) {
                        flush(&f.file);
                    }
                }
                None => flush(&f.file),
            }
        }
        Ok(())
    }

    /// A new, empty slot file.
    fn create(&self, n: u64, nonce: u64) -> Result<Slot, Error> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut n = n;
        loop {
            let path = self.dir.join(format!("slot-{n}.{EXT}"));
            match std::fs::OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(f) => {
                    return Ok(Slot {
                        path,
                        file: Arc::new(f),
                        len: 0,
                        nonce,
                        size: 0,
                        removals: Default::default(),
                    });
                }
                // Not counted yet (made after the scan): the next number.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    n += 1;
                    let mut slots = self.slots.lock().expect("journal");
                    slots.count = slots.count.max(n + 1);
                }
                Err(e) => return Err(io("create", &path)(e)),
            }
        }
    }

    /// Adds `e` to the slot's chain, or starts the slot again with it (a new nonce) when the
    /// chain is long.
    fn append(&self, mut slot: Slot, e: &Entry) -> Result<Slot, (Slot, Error)> {
        use std::os::unix::fs::FileExt;
        let bytes = record(e, slot.nonce);
        let n = bytes.len() as u64;
        if slot.len == 0 || slot.len + n <= COMPACT_AT.max(8 * n) {
            slot.size = slot.size.max(slot.len + n);
            if let Err(err) = slot.file.write_all_at(&bytes, slot.len) {
                let err = io("write", &slot.path)(err);
                return Err((slot, err));
            }
            slot.len += n;
            return Ok(slot);
        }
        let nonce = slot.nonce.wrapping_add(0x9e37_79b9_7f4a_7c15);
        match create_atomic(&slot.path, &record(e, nonce), false) {
            Ok(f) => Ok(Slot {
                file: Arc::new(f),
                len: n,
                nonce,
                size: n,
                ..slot
            }),
            Err(err) => Err((slot, err)),
        }
    }

    pub fn remove(&self, attempt_id: &str) -> Result<(), Error> {
        let Some(slot) = self.slots.lock().expect("journal").used.remove(attempt_id) else {
            return Ok(());
        };
        // Cleared from the start: a removal cut short frees the slot all the same.
        let res = clear(&slot);
        let mut slots = self.slots.lock().expect("journal");
        match res {
            Ok(()) => {
                slot.removals.fetch_add(1, Ordering::AcqRel);
                slots.free.push(Slot {
                    len: 0,
                    size: 0,
                    ..slot
                })
            }
            Err(e) => {
                slots.used.insert(attempt_id.to_string(), slot);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Entries left by a previous run. Entries of the earlier form (a file per attempt) are
    /// moved to slots.
    pub fn entries(&self) -> Result<Vec<Entry>, Error> {
        let mut old = Vec::new();
        for f in std::fs::read_dir(&self.dir).map_err(io("read", &self.dir))? {
            let path = f.map_err(io("read", &self.dir))?.path();
            if path.extension().is_some_and(|e| e == OLD_EXT) {
                old.push(path);
            }
        }
        for path in old {
            let Some(e) = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Entry>(&b).ok())
            else {
                tracing::warn!(path = %path.display(), "unreadable journal entry skipped");
                continue;
            };
            if !self
                .slots
                .lock()
                .expect("journal")
                .used
                .contains_key(&e.attempt_id)
            {
                self.save(&e, true)?;
            }
            let _ = std::fs::remove_file(&path);
        }
        let mut out = Vec::new();
        let slots = self.slots.lock().expect("journal");
        for slot in slots.used.values() {
            let bytes = std::fs::read(&slot.path).map_err(io("read", &slot.path))?;
            if let (Some(e), _, _) = read_chain(&bytes) {
                out.push(e);
            }
        }
        Ok(out)
    }
}

/// A slot found free (or holding an older copy of an attempt's entry) at start-up, cleared.
fn release(slots: &mut Slots, slot: Slot) {
    if let Err(e) = clear(&slot) {
        tracing::warn!(error = %e, "clear a journal slot");
    }
    slots.free.push(Slot {
        len: 0,
        size: 0,
        ..slot
    });
}

/// Zeroes whatever the slot may hold.
fn clear(slot: &Slot) -> Result<(), Error> {
    use std::os::unix::fs::FileExt;
    if slot.size == 0 {
        return Ok(());
    }
    slot.file
        .write_all_at(&vec![0u8; slot.size as usize], 0)
        .map_err(io("clear", &slot.path))
}

/// When a used slot's entry was saved (for two slots of one attempt: the newer stands).
fn saved_at(slot: &Slot) -> i64 {
    std::fs::read(&slot.path)
        .ok()
        .and_then(|b| read_chain(&b).0)
        .map_or(i64::MIN, |e| e.saved_at_ms)
}

fn flush(f: &File) {
    if let Err(e) = f.sync_data() {
        tracing::error!(error = %e, "flush a journal file");
    }
}

/// One record: the entry's compact JSON after its header.
fn record(e: &Entry, nonce: u64) -> Vec<u8> {
    let mut out = vec![0u8; HEADER];
    serde_json::to_writer(&mut out, e).expect("journal entry serializes");
    let len = (out.len() - HEADER) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out[4..12].copy_from_slice(&nonce.to_le_bytes());
    let sum = checksum(&out[..12], &out[HEADER..]);
    out[12..HEADER].copy_from_slice(&sum.to_le_bytes());
    out
}

/// A slot's chain: its newest entry, where it ends, and its nonce. Records are read from the
/// start up to the first incomplete or damaged one, or one of another chain.
fn read_chain(b: &[u8]) -> (Option<Entry>, u64, u64) {
    let mut last = None;
    let mut at = 0usize;
    let mut chain = None;
    while let Some(h) = b.get(at..at + HEADER) {
        let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
        let nonce = u64::from_le_bytes(h[4..12].try_into().expect("8 bytes"));
        let sum = u64::from_le_bytes(h[12..HEADER].try_into().expect("8 bytes"));
        let Some(payload) = b.get(at + HEADER..at + HEADER + len) else {
            break;
        };
        if len == 0 || chain.is_some_and(|c| c != nonce) || checksum(&h[..12], payload) != sum {
            break;
        }
        match serde_json::from_slice::<Entry>(payload) {
            Ok(e) => last = Some(e),
            Err(_) => break,
        }
        chain = Some(nonce);
        at += HEADER + len;
    }
    (last, at as u64, chain.unwrap_or(0))
}

/// FNV-1a (64 bits) of the header's first fields and the payload: enough to tell a whole record
/// from one cut short or never written.
fn checksum(head: &[u8], payload: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in head.iter().chain(payload) {
        h ^= x as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
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

    fn entry(id: &str, last_seq: u64) -> Entry {
        Entry {
            attempt_id: id.into(),
            task_id: "t1".into(),
            lease_key: format!("attempt.{id}"),
            lease_token: 7,
            last_seq,
            state: agentscope_domain::AttemptStatus::Running,
            provider_session_id: String::new(),
            provider: String::new(),
            assignment_hex: "ab".repeat(400),
            saved_at_ms: 0,
        }
    }

    fn temp_dir() -> PathBuf {
        std::env::temp_dir().join(format!("agentscope-j-{}", Uuid::new_v4()))
    }

    /// The one slot file of a journal with one attempt.
    fn slot_file(dir: &Path) -> PathBuf {
        let mut slots: Vec<PathBuf> = std::fs::read_dir(dir.join("journal"))
            .unwrap()
            .map(|f| f.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == EXT))
            .collect();
        assert_eq!(slots.len(), 1, "{slots:?}");
        slots.pop().unwrap()
    }

    #[test]
    fn the_newest_save_wins_across_compactions() {
        let dir = temp_dir();
        let j = Journal::open(&dir).unwrap();
        for seq in 1..=500 {
            j.save(&entry("a1", seq), seq % 7 == 0).unwrap();
        }
        let len = std::fs::metadata(slot_file(&dir)).unwrap().len();
        assert!(len <= COMPACT_AT.max(8 * record(&entry("a1", 500), 1).len() as u64));
        // A new process (a fresh journal) reads what this one wrote, and goes on with it.
        let again = Journal::open(&dir).unwrap();
        let got = again.entries().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].last_seq, 500);
        again.save(&entry("a1", 501), false).unwrap();
        assert_eq!(
            Journal::open(&dir).unwrap().entries().unwrap()[0].last_seq,
            501
        );
        again.remove("a1").unwrap();
        assert!(again.entries().unwrap().is_empty());
        assert!(Journal::open(&dir).unwrap().entries().unwrap().is_empty());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn slots_are_reused_and_an_earlier_chain_is_not_read() {
        let dir = temp_dir();
        let j = Journal::open(&dir).unwrap();
        for seq in 1..=5 {
            j.save(&entry("a1", seq), false).unwrap();
        }
        j.remove("a1").unwrap();
        // Nothing of the removed entry (its assignment holds the task credential) is left.
        assert!(
            std::fs::read(slot_file(&dir))
                .unwrap()
                .iter()
                .all(|b| *b == 0)
        );
        // The same slot, a shorter chain over the longer one of the same sizes.
        j.save(&entry("a2", 1), true).unwrap();
        j.save(&entry("a2", 2), false).unwrap();
        slot_file(&dir);
        let got = Journal::open(&dir).unwrap().entries().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].attempt_id.as_str(), got[0].last_seq), ("a2", 2));
        // Attempts at once get a slot each.
        j.save(&entry("a3", 1), false).unwrap();
        let mut got: Vec<_> = Journal::open(&dir)
            .unwrap()
            .entries()
            .unwrap()
            .into_iter()
            .map(|e| (e.attempt_id, e.last_seq))
            .collect();
        got.sort();
        assert_eq!(got, vec![("a2".into(), 2), ("a3".into(), 1)]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_record_cut_short_leaves_the_one_before() {
        let dir = temp_dir();
        let j = Journal::open(&dir).unwrap();
        j.save(&entry("a1", 1), true).unwrap();
        j.save(&entry("a1", 2), false).unwrap();
        let path = slot_file(&dir);
        let full = std::fs::read(&path).unwrap();
        let second = record(&entry("a1", 2), 1).len();
        for cut in [1, HEADER - 1, HEADER, second / 2, second - 1] {
            std::fs::write(&path, &full[..full.len() - cut]).unwrap();
            let got = Journal::open(&dir).unwrap().entries().unwrap();
            assert_eq!(got.len(), 1, "cut {cut}");
            assert_eq!(got[0].last_seq, 1, "cut {cut}");
        }
        // A damaged byte inside the newest record: the one before stands.
        let mut bad = full.clone();
        let at = full.len() - second / 2;
        bad[at] ^= 0x20;
        std::fs::write(&path, &bad).unwrap();
        let again = Journal::open(&dir).unwrap();
        assert_eq!(again.entries().unwrap()[0].last_seq, 1);
        // The next process goes on from the last whole record: its saves are read back.
        again.save(&entry("a1", 3), false).unwrap();
        again.save(&entry("a1", 4), false).unwrap();
        assert_eq!(
            Journal::open(&dir).unwrap().entries().unwrap()[0].last_seq,
            4
        );
        // A first record cut short: no entry, and the slot is free again.
        std::fs::write(&path, &record(&entry("a9", 1), 5)[..HEADER + 3]).unwrap();
        let third = Journal::open(&dir).unwrap();
        assert!(third.entries().unwrap().is_empty());
        third.save(&entry("a5", 1), false).unwrap();
        assert_eq!(slot_file(&dir), path);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn entries_of_the_earlier_form_are_read_and_moved() {
        let dir = temp_dir();
        let j = Journal::open(&dir).unwrap();
        let old = dir.join("journal").join("a2.json");
        std::fs::write(&old, serde_json::to_vec_pretty(&entry("a2", 9)).unwrap()).unwrap();
        std::fs::write(dir.join("journal").join("junk.json"), b"{").unwrap();
        let got = j.entries().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].last_seq, 9);
        assert!(!old.exists());
        assert_eq!(
            Journal::open(&dir).unwrap().entries().unwrap()[0].last_seq,
            9
        );
        j.remove("a2").unwrap();
        std::fs::remove_file(dir.join("journal").join("junk.json")).unwrap();
        assert!(Journal::open(&dir).unwrap().entries().unwrap().is_empty());
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
