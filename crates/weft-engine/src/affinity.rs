//! Thread pinning. NUMA topology comes from sysfs
//! (`/sys/devices/system/node/node<N>/cpulist`); when it is unknown the
//! worker is simply not pinned.

/// A cpulist that does not parse ([`parse_cpulist`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{part}` is not a CPU number or an ascending range of at most 65536 CPUs")]
#[non_exhaustive]
pub struct CpuListError {
    /// The comma-separated part that is wrong.
    pub part: String,
}

/// Parses a Linux cpulist such as `0-3,8,10-11` (what sysfs and
/// `taskset -c` use): CPUs in the order written, ranges ascending, repeats
/// kept. Blank parts are skipped; surrounding whitespace (a trailing
/// newline) is ignored.
pub fn parse_cpulist(s: &str) -> Result<Vec<usize>, CpuListError> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || CpuListError { part: part.into() };
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.trim().parse().map_err(|_| bad())?;
                let b: usize = b.trim().parse().map_err(|_| bad())?;
                if a > b || b - a >= 1 << 16 {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(out)
}

/// The CPUs of NUMA node `node`, if the topology is known.
pub(crate) fn numa_cpus(node: u32) -> Option<Vec<usize>> {
    let s = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    let v = parse_cpulist(&s).ok()?;
    (!v.is_empty()).then_some(v)
}

/// Chooses a CPU: the explicit one, else the `nth` CPU of the NUMA node.
pub(crate) fn pick_cpu(cpu: Option<usize>, numa: Option<u32>, nth: usize) -> Option<usize> {
    if cpu.is_some() {
        return cpu;
    }
    let cpus = numa_cpus(numa?)?;
    cpus.get(nth % cpus.len()).copied()
}

/// Pins the calling thread to `cpu`. Returns whether it worked.
#[cfg(target_os = "linux")]
pub(crate) fn pin_current(cpu: usize) -> bool {
    if cpu >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: `cpu_set_t` is plain data; zeroed is the empty set, CPU_SET
    // writes inside it (cpu < CPU_SETSIZE checked), and sched_setaffinity
    // only reads `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Pinning is not supported on this OS.
#[cfg(not(target_os = "linux"))]
pub(crate) fn pin_current(_cpu: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulist() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Ok(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(" 5, 2 ,5,,"), Ok(vec![5, 2, 5]));
        assert_eq!(parse_cpulist(""), Ok(Vec::new()));
        for bad in ["x,5", "3-1", "1-", "-1", "0-70000", "1.5"] {
            let e = parse_cpulist(bad).unwrap_err();
            assert!(bad.contains(&e.part), "{bad}: {e}");
        }
    }
}
