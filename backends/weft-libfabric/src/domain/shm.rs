//! `shm` specifics: region names under `/dev/shm`, stale regions of dead
//! processes, and what an shm endpoint name says about its peer.

use crate::ffi;

/// The shm provider (1.17) names an endpoint's region
/// `/dev/shm/<pid>:<domain>:<endpoint>` and never removes it when its
/// process is killed: a SIGKILLed peer leaves its regions behind (tens of
/// MiB each), and a later process that happens to get the same pid could
/// not open shm endpoints at all (`fi_enable` fails with `EBUSY` on the name
/// clash). Before this process opens its first shm endpoint (once per
/// process), every region of that shape left by a process that no longer
/// runs is removed: those named after this process's own pid (none can be
/// its own yet), and those of other pids that have exited, when this user
/// owns the file. A region of a running process, of a pid this process may
/// not signal (another user's), or of another shape is never touched.
///
/// A pid is judged in this process's pid namespace; processes that share
/// `/dev/shm` share it too (the shm provider's cross-memory-attach copies
/// need that already).
pub(super) fn remove_stale_shm_regions() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let (removed, bytes) = reclaim_regions(std::path::Path::new("/dev/shm"));
        if removed > 0 {
            tracing::info!(
                removed,
                bytes,
                "removed shm regions left in /dev/shm by processes that exited"
            );
        }
    });
}

/// Removes from `dir` the region files (`<pid>:<n>:<n>`) of processes that
/// no longer run (see [`remove_stale_shm_regions`]); returns how many files
/// and bytes went.
pub(super) fn reclaim_regions(dir: &std::path::Path) -> (usize, u64) {
    use std::os::unix::fs::MetadataExt;
    let me = std::process::id() as i32;
    // Files this user owns: `/proc/self` belongs to the effective uid.
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    let (mut removed, mut bytes) = (0, 0);
    for entry in entries.flatten() {
        let name = entry.file_name();
        // A region, or the key table and doorbell weft keeps next to it.
        let owner = name.to_str().map(|n| {
            n.strip_prefix(ffi::KEY_TABLE_PREFIX)
                .or_else(|| n.strip_prefix(ffi::BELL_PREFIX))
                .unwrap_or(n)
        });
        let Some(pid) = owner.and_then(region_owner) else {
            continue;
        };
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        let stale = if pid == me {
            true
        } else {
            Some(meta.uid()) == uid && !ffi::process_alive(pid)
        };
        if !stale {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                tracing::debug!(region = ?name, pid, "removed a stale shm region");
                removed += 1;
                bytes += meta.len();
            }
            Err(e) => {
                tracing::warn!(region = ?name, error = %e, "could not remove a stale shm region")
            }
        }
    }
    (removed, bytes)
}

/// The owner pid of a region file named like the provider's own
/// `<pid>:<domain>:<endpoint>` (decimal numbers); `None` for any other name.
fn region_owner(name: &str) -> Option<i32> {
    let number = |p: &str| !p.is_empty() && p.len() <= 10 && p.bytes().all(|b| b.is_ascii_digit());
    let (pid, rest) = name.split_once(':')?;
    let (d, e) = rest.split_once(':')?;
    if !(number(pid) && number(d) && number(e)) {
        return None;
    }
    pid.parse::<i32>().ok().filter(|&p| p > 0)
}

/// The region file name an `shm` address (`fi_shm://<name>`) names.
pub(super) fn region_name(addr: &[u8]) -> Option<String> {
    let rest = addr.strip_prefix(b"fi_shm://")?;
    let name: Vec<u8> = rest.iter().copied().take_while(|&b| b != 0).collect();
    Some(String::from_utf8_lossy(&name).into_owned())
}

/// For an `shm` address (`fi_shm://<pid>:...`): the peer's pid, and whether
/// it is already known unreachable (its region is gone: the 1.17 shm
/// provider crashes when posting to such an address, so it must never be
/// used).
pub(super) fn shm_peer(addr: &[u8]) -> (Option<i32>, Option<String>) {
    let Some(name) = region_name(addr) else {
        return (None, Some("not an shm endpoint name (fi_shm://...)".into()));
    };
    let pid = name.split(':').next().and_then(|p| p.parse::<i32>().ok());
    let region = std::path::Path::new("/dev/shm").join(&name);
    let dead = if name.is_empty() || name.contains('/') || !region.exists() {
        Some(format!("shm region {} does not exist", region.display()))
    } else if pid.is_some_and(|p| !ffi::process_alive(p)) {
        Some("shm peer process has exited".to_string())
    } else {
        None
    };
    (pid, dead)
}

/// The shm peers (region file name → owner pid) some domain of this
/// process may write to, watched by one thread: when an owner dies holding
/// its region lock, the lock is freed (see `ffi::free_dead_owner_lock`), so
/// a worker spinning on it in `fi_writemsg` gets out and the dead peer's
/// work fails as usual instead of wedging the engine for good. Each
/// domain registers its peers with [`watch_region`] and drops them with
/// [`unwatch_region`]; the thread ends when nothing is watched.
static WATCHED: std::sync::Mutex<Option<std::collections::BTreeMap<String, (i32, usize)>>> =
    std::sync::Mutex::new(None);

/// How often the watcher looks at the watched owners.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// Locks freed since the process started.
static FREED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many region locks of dead shm peers this process freed.
pub fn freed_dead_locks() -> u64 {
    FREED.load(std::sync::atomic::Ordering::Relaxed)
}

fn watched(
) -> std::sync::MutexGuard<'static, Option<std::collections::BTreeMap<String, (i32, usize)>>> {
    WATCHED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Watches the region `name` (from the peer's `fi_shm://` address) owned
/// by `pid`; counted, so two domains may watch one region.
pub(super) fn watch_region(name: &str, pid: i32) {
    let mut w = watched();
    let start = w.is_none();
    let map = w.get_or_insert_with(Default::default);
    map.entry(name.to_string()).or_insert((pid, 0)).1 += 1;
    if start {
        let spawned = std::thread::Builder::new()
            .name("weft-shm-watch".into())
            .spawn(watch_loop);
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the shm region watcher");
            *w = None;
        }
    }
}

/// Stops watching one registration of `name`.
pub(super) fn unwatch_region(name: &str) {
    let mut w = watched();
    if let Some(map) = w.as_mut() {
        if let Some(e) = map.get_mut(name) {
            e.1 = e.1.saturating_sub(1);
            if e.1 == 0 {
                map.remove(name);
            }
        }
    }
}

fn watch_loop() {
    loop {
        std::thread::sleep(WATCH_EVERY);
        let owners: Vec<(String, i32)> = {
            let mut w = watched();
            match w.as_ref() {
                Some(map) if !map.is_empty() => {
                    map.iter().map(|(n, (pid, _))| (n.clone(), *pid)).collect()
                }
                _ => {
                    // Nothing watched: the thread ends (the next watch
                    // starts another).
                    *w = None;
                    return;
                }
            }
        };
        for (name, pid) in owners {
            if ffi::process_alive(pid) {
                continue;
            }
            let path = std::path::Path::new("/dev/shm").join(&name);
            match ffi::free_dead_owner_lock(&path, pid) {
                Ok(ffi::LockState::Freed) => {
                    FREED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(
                        region = %name,
                        pid,
                        "an shm peer died holding its region lock: freed it"
                    );
                }
                Ok(_) => {}
                // The region file is gone (the peer cleaned up, or was
                // reclaimed): nothing to free.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::debug!(region = %name, error = %e, "could not check a dead shm peer's region")
                }
            }
        }
    }
}

/// The shm endpoints (region names) open in this process. The 1.17 shm
/// provider hands a peer in the same process the owner's own mapping of
/// its region: once that engine shuts down the mapping is gone, and a
/// write to it crashes the writer. Writes to same-process peers check here
/// first.
static LOCAL: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn local() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<String>> {
    LOCAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records this process's endpoint `name` as open.
pub(super) fn local_opened(name: &str) {
    local().insert(name.to_string());
}

/// Records this process's endpoint `name` as closed.
pub(super) fn local_closed(name: &str) {
    local().remove(name);
}

/// Whether this process's endpoint `name` is open.
pub(super) fn local_open(name: &str) -> bool {
    local().contains(name)
}
