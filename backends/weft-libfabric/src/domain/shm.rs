//! `shm` specifics: region names under `/dev/shm`, stale regions of dead
//! processes, and what an shm endpoint name says about its peer.

use crate::ffi;

/// The shm provider (1.17) names an endpoint's region
/// `/dev/shm/<pid>:<domain>:<endpoint>` and fails `fi_enable` with `EBUSY`
/// when that file exists. A process killed with SIGKILL leaves its regions
/// behind, so a later process that happens to get the same pid could not
/// open shm endpoints at all. Before this process opens its first shm
/// endpoint, no region named after its pid can be its own: those files are
/// left over from a dead process, and are removed (once per process).
pub(super) fn remove_stale_shm_regions() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prefix = format!("{}:", std::process::id());
        let Ok(dir) = std::fs::read_dir("/dev/shm") else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            // Only the provider's own `<pid>:<n>:<n>` names.
            let number = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
            let ours = rest
                .split_once(':')
                .is_some_and(|(d, e)| number(d) && number(e));
            if !ours {
                continue;
            }
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(region = %name, "removed a stale shm region of a dead process with this pid"),
                Err(e) => tracing::warn!(region = %name, error = %e, "could not remove a stale shm region"),
            }
        }
    });
}

/// For an `shm` address (`fi_shm://<pid>:...`): the peer's pid, and whether
/// it is already known unreachable (its region is gone: the 1.17 shm
/// provider crashes when posting to such an address, so it must never be
/// used).
pub(super) fn shm_peer(addr: &[u8]) -> (Option<i32>, Option<String>) {
    let Some(rest) = addr.strip_prefix(b"fi_shm://") else {
        return (None, Some("not an shm endpoint name (fi_shm://...)".into()));
    };
    let name: Vec<u8> = rest.iter().copied().take_while(|&b| b != 0).collect();
    let name = String::from_utf8_lossy(&name).into_owned();
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
