//! The directory store: several processes on one host, no service.
//!
//! Layout under the root:
//!
//! - `kv/<key>`: one file per entry (the key percent-encoded), holding the
//!   lease id (8 bytes little-endian, 0 for none) and the value;
//! - `leases/<id>`: one file per lease: `pid starttime ttl_ms deadline_ms`
//!   (the owner's pid and its start time from `/proc`, the TTL, and the wall
//!   clock time in ms since the epoch when the lease ends unless renewed);
//! - `tmp/`: files being written; every write goes to a file there first
//!   and is renamed into place, so a reader sees the old or the new
//!   content, never a mix.
//!
//! A lease is alive while its file exists, its deadline has not passed and
//! its owner (same pid, same start time) still runs, so a killed process's
//! entries vanish at the next read. Readers remove the files of dead
//! leases. Watches poll the directory on a dedicated thread (interval
//! [`DirOptions::poll_interval`]).

use std::collections::BTreeMap;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use crate::watch::diff;
use crate::{check_key, LeaseId, Store, StoreError, Watch};

/// Settings of a [`DirStore`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DirOptions {
    /// How often a watch re-reads the directory (default 50 ms).
    pub poll_interval: Duration,
}

impl Default for DirOptions {
    fn default() -> Self {
        DirOptions {
            poll_interval: Duration::from_millis(50),
        }
    }
}

impl DirOptions {
    /// Sets [`DirOptions::poll_interval`].
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d.max(Duration::from_millis(1));
        self
    }
}

/// A store in a directory of the local file system (see the module docs).
#[derive(Debug)]
pub struct DirStore {
    root: PathBuf,
    endpoint: String,
    opts: DirOptions,
    me: Owner,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    pid: u32,
    start: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Start time (clock ticks since boot) and whether it is a zombie, of `pid`.
fn proc_start(pid: u32) -> Option<(u64, bool)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    // Field 22 of stat is the start time; `rest` starts at field 3.
    let start = fields.nth(22 - 4)?.parse().ok()?;
    Some((start, state == "Z" || state == "X"))
}

fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(name: &str) -> Option<String> {
    let b = name.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = name.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

struct LeaseFile {
    owner: Owner,
    ttl_ms: u64,
    deadline_ms: u64,
}

impl DirStore {
    /// Opens (creating if needed) a store rooted at `root`.
    pub fn open(root: impl AsRef<Path>, opts: DirOptions) -> Result<Self, StoreError> {
        let root = root.as_ref().to_path_buf();
        let endpoint = format!("dir:{}", root.display());
        for sub in ["kv", "leases", "tmp"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(|source| StoreError::Io {
                endpoint: endpoint.clone(),
                op: "create directory",
                path: p.display().to_string(),
                source,
            })?;
        }
        let pid = std::process::id();
        let start = proc_start(pid).map_or(0, |(s, _)| s);
        Ok(DirStore {
            root,
            endpoint,
            opts,
            me: Owner { pid, start },
        })
    }

    fn io(&self, op: &'static str, path: &Path, source: std::io::Error) -> StoreError {
        StoreError::Io {
            endpoint: self.endpoint.clone(),
            op,
            path: path.display().to_string(),
            source,
        }
    }

    fn key_path(&self, key: &str) -> Result<PathBuf, StoreError> {
        check_key(&self.endpoint, key)?;
        let name = escape(key);
        if name.len() > 250 {
            return Err(StoreError::InvalidKey {
                endpoint: self.endpoint.clone(),
                key: key.to_string(),
                reason: "too long for a file name once escaped",
            });
        }
        Ok(self.root.join("kv").join(name))
    }

    fn lease_path(&self, lease: u64) -> PathBuf {
        self.root.join("leases").join(format!("{lease:016x}"))
    }

    /// Writes `data` to a temporary file; its path.
    fn write_tmp(&self, data: &[u8]) -> Result<PathBuf, StoreError> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self.root.join("tmp").join(format!("{}-{n}", self.me.pid));
        fs::write(&tmp, data).map_err(|e| self.io("write", &tmp, e))?;
        Ok(tmp)
    }

    fn write_atomic(&self, path: &Path, data: &[u8]) -> Result<(), StoreError> {
        let tmp = self.write_tmp(data)?;
        fs::rename(&tmp, path).map_err(|e| self.io("rename into", path, e))
    }

    fn read_lease(&self, lease: u64) -> Option<LeaseFile> {
        let text = fs::read_to_string(self.lease_path(lease)).ok()?;
        let v: Vec<u64> = text
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        match v[..] {
            [pid, start, ttl_ms, deadline_ms] => Some(LeaseFile {
                owner: Owner {
                    pid: u32::try_from(pid).ok()?,
                    start,
                },
                ttl_ms,
                deadline_ms,
            }),
            _ => None,
        }
    }

    fn lease_alive(&self, lease: u64) -> bool {
        let Some(l) = self.read_lease(lease) else {
            return false;
        };
        if l.deadline_ms <= now_ms() {
            return false;
        }
        match proc_start(l.owner.pid) {
            Some((start, zombie)) => !zombie && (l.owner.start == 0 || start == l.owner.start),
            None => false,
        }
    }

    fn lease_tmp(&self, owner: Owner, ttl_ms: u64) -> Result<PathBuf, StoreError> {
        let text = format!(
            "{} {} {ttl_ms} {}\n",
            owner.pid,
            owner.start,
            now_ms().saturating_add(ttl_ms)
        );
        self.write_tmp(text.as_bytes())
    }

    /// Every live entry (dead leases' entries are removed on the way).
    fn snapshot(&self, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>, StoreError> {
        let dir = self.root.join("kv");
        let rd = fs::read_dir(&dir).map_err(|e| self.io("read directory", &dir, e))?;
        let mut out = BTreeMap::new();
        let mut alive: BTreeMap<u64, bool> = BTreeMap::new();
        for ent in rd {
            let ent = ent.map_err(|e| self.io("read directory", &dir, e))?;
            let name = ent.file_name();
            let Some(key) = name.to_str().and_then(unescape) else {
                continue;
            };
            if !key.starts_with(prefix) {
                continue;
            }
            let data = match fs::read(ent.path()) {
                Ok(d) => d,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(self.io("read", &ent.path(), e)),
            };
            let Some((lease, value)) = data.split_first_chunk::<8>() else {
                continue;
            };
            let lease = u64::from_le_bytes(*lease);
            if lease != 0
                && !*alive
                    .entry(lease)
                    .or_insert_with(|| self.lease_alive(lease))
            {
                self.remove_dead(lease, &ent.path());
                continue;
            }
            out.insert(key, value.to_vec());
        }
        Ok(out)
    }

    fn remove_dead(&self, lease: u64, entry: &Path) {
        tracing::debug!(store = %self.endpoint, lease, entry = %entry.display(), "removing an entry of an ended lease");
        let _ = fs::remove_file(entry);
        let _ = fs::remove_file(self.lease_path(lease));
    }
}

impl Store for DirStore {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), StoreError> {
        let path = self.key_path(key)?;
        let id = lease.map_or(0, |l| l.0);
        if id != 0 && !self.lease_alive(id) {
            return Err(StoreError::LeaseNotFound {
                endpoint: self.endpoint.clone(),
                lease: id,
            });
        }
        let mut data = Vec::with_capacity(8 + value.len());
        data.extend_from_slice(&id.to_le_bytes());
        data.extend_from_slice(value);
        self.write_atomic(&path, &data)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.key_path(key)?;
        let data = match fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io("read", &path, e)),
        };
        let Some((lease, value)) = data.split_first_chunk::<8>() else {
            return Ok(None);
        };
        let lease = u64::from_le_bytes(*lease);
        if lease != 0 && !self.lease_alive(lease) {
            self.remove_dead(lease, &path);
            return Ok(None);
        }
        Ok(Some(value.to_vec()))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self.snapshot(prefix)?.into_iter().collect())
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let path = self.key_path(key)?;
        let existed = self.get(key)?.is_some();
        match fs::remove_file(&path) {
            Ok(()) => Ok(existed),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.io("remove", &path, e)),
        }
    }

    fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::from(d.subsec_nanos()));
            let id = (u64::from(self.me.pid) << 32
                | (nanos ^ n.wrapping_mul(0x9E37_79B9)) & 0xffff_ffff)
                .max(1);
            let tmp = self.lease_tmp(self.me, ttl_ms)?;
            let path = self.lease_path(id);
            // A hard link fails if the name exists: ids are unique.
            let linked = fs::hard_link(&tmp, &path);
            let _ = fs::remove_file(&tmp);
            match linked {
                Ok(()) => return Ok(LeaseId(id)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(self.io("create lease", &path, e)),
            }
        }
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let not_found = || StoreError::LeaseNotFound {
            endpoint: self.endpoint.clone(),
            lease: lease.0,
        };
        if !self.lease_alive(lease.0) {
            return Err(not_found());
        }
        let l = self.read_lease(lease.0).ok_or_else(not_found)?;
        let tmp = self.lease_tmp(l.owner, l.ttl_ms)?;
        let path = self.lease_path(lease.0);
        fs::rename(&tmp, &path).map_err(|e| self.io("renew lease", &path, e))
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        let path = self.lease_path(lease.0);
        let existed = match fs::remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(e) => return Err(self.io("remove lease", &path, e)),
        };
        // Its entries are dead now; remove their files.
        self.snapshot("")?;
        if existed {
            Ok(())
        } else {
            Err(StoreError::LeaseNotFound {
                endpoint: self.endpoint.clone(),
                lease: lease.0,
            })
        }
    }

    fn watch(&self, prefix: &str) -> Result<Watch, StoreError> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut known = BTreeMap::new();
        let first = self.snapshot(prefix)?;
        for ev in diff(&known, &first) {
            let _ = tx.send(ev);
        }
        known = first;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let guard = StopOnDrop(stop.clone());
        let me = DirStore {
            root: self.root.clone(),
            endpoint: self.endpoint.clone(),
            opts: self.opts.clone(),
            me: self.me,
        };
        let owned_prefix = prefix.to_string();
        std::thread::Builder::new()
            .name("weft-rendezvous-dirwatch".into())
            .spawn(move || loop {
                {
                    let mut stopped = stop.0.lock();
                    if !*stopped {
                        stop.1.wait_for(&mut stopped, me.opts.poll_interval);
                    }
                    if *stopped {
                        return;
                    }
                }
                let now = match me.snapshot(&owned_prefix) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "directory watch: read failed; retrying");
                        continue;
                    }
                };
                for ev in diff(&known, &now) {
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
                known = now;
            })
            .map_err(|e| self.io("spawn watch thread", &self.root, e))?;
        Ok(Watch::new(rx, &self.endpoint, prefix, Box::new(guard)))
    }
}

struct StopOnDrop(Arc<(Mutex<bool>, Condvar)>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        *self.0 .0.lock() = true;
        self.0 .1.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_roundtrip() {
        for k in ["weft/ns/peer/a", "a%b c", "ü/x", "..", "-"] {
            assert_eq!(unescape(&escape(k)).as_deref(), Some(k));
            assert!(!escape(k).contains('/'));
        }
        assert_eq!(unescape("%zz"), None);
        assert_eq!(unescape("%4"), None);
    }

    #[test]
    fn own_process_start_time_is_readable() {
        let (start, zombie) = proc_start(std::process::id()).unwrap();
        assert!(start > 0);
        assert!(!zombie);
    }
}
