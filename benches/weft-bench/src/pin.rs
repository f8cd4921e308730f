//! Thread placement (`--pin`): every thread of a measured row on a fixed
//! CPU, the same CPU for the same role in weft's rounds and in the
//! baseline's rounds.
//!
//! Roles, in the order an explicit `--pin` list assigns them:
//!
//! | role | weft rounds | baseline rounds |
//! |---|---|---|
//! | `initiator` | the sender engine's worker (it posts and polls) | the raw loop (posts, polls the initiator, and the target where it needs polling); the floor's consumer |
//! | `target` | the receiver engine's worker | the raw target poller of `drive_split` (libfabric) |
//! | `submitter` | the bench thread (submits, waits on the counter) | idle; the floor's producer |
//! | `tx-aux` | the sender engine's callback and UVM-watcher threads | — |
//! | `rx-aux` | the receiver engine's callback and UVM-watcher threads | — |
//!
//! Workers get their CPU through [`weft::DomainGroupSpec::cpu`]; callback
//! and watcher threads are not pinned by the engine and inherit the
//! affinity of the thread that builds the engine, so the bench builds each
//! engine while pinned to that engine's aux CPU.

use std::fmt;
use std::str::FromStr;

/// `auto` pins only on hosts with at least this many CPUs: on smaller ones
/// five distinct CPUs do not exist and the rows run unpinned.
pub const AUTO_MIN_CPUS: usize = 8;

/// The roles of [`Placement`], in `--pin` list order.
pub const ROLES: [&str; 5] = ["initiator", "target", "submitter", "tx-aux", "rx-aux"];

/// The `--pin` setting.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PinMode {
    /// Distinct CPUs chosen from the topology when the process may use at
    /// least [`AUTO_MIN_CPUS`] CPUs, unpinned otherwise.
    #[default]
    Auto,
    /// No pinning: threads go where the scheduler puts them (engine workers
    /// still pin themselves when their NIC's NUMA node is known).
    Off,
    /// These CPUs, one per role in [`ROLES`] order (a CPU may repeat: for
    /// trying the option on a small host).
    Cpus(Vec<usize>),
}

impl FromStr for PinMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(PinMode::Auto),
            "off" | "none" => Ok(PinMode::Off),
            list => {
                let cpus = weft::parse_cpulist(list)
                    .map_err(|e| format!("--pin: {e} (auto, off, or CPUs such as 2,3,5-7)"))?;
                if cpus.len() < ROLES.len() {
                    return Err(format!(
                        "--pin needs {} CPUs ({}), got {}",
                        ROLES.len(),
                        ROLES.join(", "),
                        cpus.len()
                    ));
                }
                Ok(PinMode::Cpus(cpus))
            }
        }
    }
}

impl fmt::Display for PinMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinMode::Auto => f.write_str("auto"),
            PinMode::Off => f.write_str("off"),
            PinMode::Cpus(c) => {
                let v: Vec<String> = c.iter().map(|x| x.to_string()).collect();
                f.write_str(&v.join(","))
            }
        }
    }
}

/// One CPU per role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The sender engine's worker; the raw loop.
    pub initiator: usize,
    /// The receiver engine's worker; the raw target poller.
    pub target: usize,
    /// The bench thread while weft's rounds run.
    pub submitter: usize,
    /// The sender engine's callback and watcher threads.
    pub tx_aux: usize,
    /// The receiver engine's callback and watcher threads.
    pub rx_aux: usize,
}

impl Placement {
    /// The placement `mode` asks for on this machine: `None` when
    /// unpinned, an error for a list naming CPUs this process may not use.
    pub fn resolve(mode: &PinMode) -> Result<Option<Self>, String> {
        let allowed = allowed_cpus();
        match mode {
            PinMode::Off => Ok(None),
            PinMode::Auto if allowed.len() < AUTO_MIN_CPUS => Ok(None),
            PinMode::Auto => Self::from_list(&auto_order(&allowed, &Topology::read)).map(Some),
            PinMode::Cpus(c) => {
                if let Some(bad) = c.iter().find(|x| !allowed.contains(x)) {
                    return Err(format!(
                        "--pin: CPU {bad} is not one this process may run on ({})",
                        PinMode::Cpus(allowed.clone())
                    ));
                }
                Self::from_list(c).map(Some)
            }
        }
    }

    fn from_list(c: &[usize]) -> Result<Self, String> {
        match c {
            [initiator, target, submitter, tx_aux, rx_aux, ..] => Ok(Placement {
                initiator: *initiator,
                target: *target,
                submitter: *submitter,
                tx_aux: *tx_aux,
                rx_aux: *rx_aux,
            }),
            _ => Err(format!(
                "thread placement needs {} CPUs, only {} available",
                ROLES.len(),
                c.len()
            )),
        }
    }

    /// CPUs in [`ROLES`] order.
    pub fn cpus(&self) -> [usize; 5] {
        [
            self.initiator,
            self.target,
            self.submitter,
            self.tx_aux,
            self.rx_aux,
        ]
    }

    /// `initiator 2 target 4 submitter 6 tx-aux 8 rx-aux 10`: what the
    /// rows record.
    pub fn label(&self) -> String {
        ROLES
            .iter()
            .zip(self.cpus())
            .map(|(r, c)| format!("{r} {c}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// What a row records for an optional placement.
pub fn label(p: Option<&Placement>) -> String {
    p.map_or_else(|| "unpinned".into(), Placement::label)
}

/// Where a CPU sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// NUMA node.
    pub node: usize,
    /// The lowest CPU of its physical core (its SMT siblings share it).
    pub core: usize,
    /// Its rank among its core's SMT siblings (0 for the first).
    pub sibling: usize,
}

impl Topology {
    /// From sysfs; each CPU its own core on node 0 where sysfs says nothing.
    pub fn read(cpu: usize) -> Topology {
        let base = format!("/sys/devices/system/cpu/cpu{cpu}");
        let sib = std::fs::read_to_string(format!("{base}/topology/thread_siblings_list"))
            .ok()
            .and_then(|s| weft::parse_cpulist(&s).ok())
            .filter(|v| v.contains(&cpu))
            .unwrap_or_else(|| vec![cpu]);
        let node = std::fs::read_dir(&base)
            .ok()
            .and_then(|d| {
                d.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
                    .next()
            })
            .unwrap_or(0);
        Topology {
            node,
            core: sib.iter().copied().min().unwrap_or(cpu),
            sibling: sib.iter().filter(|&&c| c < cpu).count(),
        }
    }
}

/// `allowed` ordered for `auto`: one CPU per physical core before any SMT
/// sibling; cores of the node with the most allowed CPUs first; the core
/// of CPU 0 (interrupts, housekeeping) last among its rank.
pub fn auto_order(allowed: &[usize], topo: &dyn Fn(usize) -> Topology) -> Vec<usize> {
    let t: Vec<(usize, Topology)> = allowed.iter().map(|&c| (c, topo(c))).collect();
    let mut per_node = std::collections::BTreeMap::<usize, usize>::new();
    for (_, x) in &t {
        *per_node.entry(x.node).or_default() += 1;
    }
    // Most CPUs first; the lowest node among equals.
    let home = per_node
        .iter()
        .max_by_key(|(n, k)| (**k, std::cmp::Reverse(**n)))
        .map_or(0, |(n, _)| *n);
    let core0 = t.iter().find(|(c, _)| *c == 0).map(|(_, x)| x.core);
    let mut v = t;
    v.sort_by_key(|(c, x)| (x.sibling, x.node != home, Some(x.core) == core0, x.core, *c));
    v.into_iter().map(|(c, _)| c).collect()
}

/// The CPUs the calling thread may run on (its affinity mask).
#[cfg(target_os = "linux")]
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `cpu_set_t` is plain data (zeroed = empty set);
    // sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes into
    // it, and CPU_ISSET reads inside it (i < CPU_SETSIZE).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return fallback_cpus();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&i| libc::CPU_ISSET(i, &set))
            .collect()
    }
}

/// The CPUs the calling thread may run on: all of them, as far as this OS
/// tells.
#[cfg(not(target_os = "linux"))]
pub fn allowed_cpus() -> Vec<usize> {
    fallback_cpus()
}

fn fallback_cpus() -> Vec<usize> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..n).collect()
}

/// Restricts the calling thread to `cpus`. Returns whether it worked.
#[cfg(target_os = "linux")]
pub fn set_affinity(cpus: &[usize]) -> bool {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return false;
    }
    // SAFETY: `cpu_set_t` is plain data; CPU_SET writes inside it (each
    // cpu < CPU_SETSIZE, checked above); sched_setaffinity only reads
    // `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Pinning is not supported on this OS.
#[cfg(not(target_os = "linux"))]
pub fn set_affinity(_cpus: &[usize]) -> bool {
    false
}

/// Pins the calling thread to one CPU while it lives and gives it back its
/// previous affinity when dropped. `None`: does nothing.
#[derive(Debug)]
#[must_use = "the thread is unpinned again when the guard drops"]
pub struct PinGuard {
    prev: Option<Vec<usize>>,
}

impl PinGuard {
    /// Pins the calling thread to `cpu` (if any).
    pub fn new(cpu: Option<usize>) -> Self {
        let prev = cpu.and_then(|c| {
            let prev = allowed_cpus();
            set_affinity(&[c]).then_some(prev)
        });
        PinGuard { prev }
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(p) = self.prev.take() {
            set_affinity(&p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse::<PinMode>(), Ok(PinMode::Auto));
        assert_eq!("off".parse::<PinMode>(), Ok(PinMode::Off));
        assert_eq!(
            "3,1-2,9,9".parse::<PinMode>(),
            Ok(PinMode::Cpus(vec![3, 1, 2, 9, 9]))
        );
        assert!("1,2".parse::<PinMode>().is_err());
        assert!("1,x,3,4,5".parse::<PinMode>().is_err());
        assert!("4-2,1,1,1".parse::<PinMode>().is_err());
        assert_eq!(PinMode::Cpus(vec![1, 2]).to_string(), "1,2");
    }

    #[test]
    fn auto_prefers_distinct_cores_of_one_node_away_from_cpu0() {
        // 2 nodes x 4 cores x 2 threads: node 0 has cores {0,8},{1,9},
        // {2,10},{3,11}; node 1 has {4,12}..{7,15}; only node 0's CPUs and
        // CPU 4 allowed, so node 0 is home.
        let topo = |c: usize| Topology {
            node: usize::from(c % 8 >= 4),
            core: c % 8,
            sibling: c / 8,
        };
        let allowed = [0, 1, 2, 3, 4, 8, 9, 10, 11];
        let o = auto_order(&allowed, &topo);
        assert_eq!(o, vec![1, 2, 3, 0, 4, 9, 10, 11, 8]);
        let p = Placement::from_list(&o).unwrap();
        assert_eq!(p.cpus(), [1, 2, 3, 0, 4]);
        assert_eq!(
            p.label(),
            "initiator 1 target 2 submitter 3 tx-aux 0 rx-aux 4"
        );
    }

    #[test]
    fn guard_pins_and_restores() {
        let before = allowed_cpus();
        let cpu = *before.last().unwrap();
        std::thread::spawn(move || {
            let before = allowed_cpus();
            {
                let _g = PinGuard::new(Some(cpu));
                assert_eq!(allowed_cpus(), vec![cpu]);
                // A thread spawned now inherits the pin.
                let inner = std::thread::spawn(allowed_cpus).join().unwrap();
                assert_eq!(inner, vec![cpu]);
            }
            assert_eq!(allowed_cpus(), before);
            let _none = PinGuard::new(None);
            assert_eq!(allowed_cpus(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn lists_outside_the_mask_are_refused() {
        let far = allowed_cpus().last().unwrap() + 1000;
        let m = PinMode::Cpus(vec![far; 5]);
        assert!(Placement::resolve(&m).unwrap_err().contains("may run on"));
        assert_eq!(Placement::resolve(&PinMode::Off), Ok(None));
    }
}
