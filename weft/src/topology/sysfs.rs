//! Reading the topology out of a sysfs tree (`<root>/sys/...`).

use std::fs;
use std::path::{Path, PathBuf};

use super::{Gpu, Nic, NicKind, NumaNode};

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// A PCI address (`0000:01:00.0`) or a root bus (`pci0000:00`).
fn is_pci_component(c: &str) -> bool {
    c.starts_with("pci") || (c.len() == 12 && c.as_bytes().get(4) == Some(&b':') && c.contains('.'))
}

/// The chain of PCI components from the root bus down to the device that
/// `link` (a sysfs symlink such as `class/net/eth0/device`) resolves to.
fn pci_chain(root: &Path, link: &Path) -> Option<(String, Vec<String>)> {
    let real = fs::canonicalize(link).ok()?;
    let base = fs::canonicalize(root.join("sys/devices")).ok()?;
    let rel = real.strip_prefix(&base).ok()?;
    let chain: Vec<String> = rel
        .components()
        .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
        .filter(|c| is_pci_component(c))
        .collect();
    let last = chain.last()?.clone();
    (chain.len() >= 2).then_some((last, chain))
}

fn numa_of(dev_dir: &Path) -> Option<u32> {
    read_trim(&dev_dir.join("numa_node"))
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok())
}

fn sorted_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.to_string(), e.path())))
        .collect();
    out.sort();
    out
}

pub(super) fn gpus(root: &Path) -> Vec<Gpu> {
    let mut out = Vec::new();
    for (bdf, path) in sorted_entries(&root.join("sys/bus/pci/devices")) {
        let class = read_trim(&path.join("class")).unwrap_or_default();
        let vendor = read_trim(&path.join("vendor")).unwrap_or_default();
        let display = class.starts_with("0x0302") || class.starts_with("0x0300");
        if !display || !vendor.eq_ignore_ascii_case("0x10de") {
            continue;
        }
        let chain = pci_chain(root, &path).map(|(_, c)| c).unwrap_or_default();
        out.push(Gpu {
            ordinal: u32::try_from(out.len()).unwrap_or(u32::MAX),
            pci: bdf,
            numa: numa_of(&path),
            pci_path: chain,
        });
    }
    out
}

pub(super) fn nics(root: &Path) -> Vec<Nic> {
    let mut out = Vec::new();
    for (name, path) in sorted_entries(&root.join("sys/class/infiniband")) {
        let dev = path.join("device");
        let (pci, chain) = pci_chain(root, &dev).map_or((None, Vec::new()), |(p, c)| (Some(p), c));
        let netdevs = sorted_entries(&dev.join("net"))
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        out.push(Nic {
            name,
            kind: NicKind::Rdma,
            netdevs,
            pci,
            numa: numa_of(&dev),
            pci_path: chain,
        });
    }
    for (name, path) in sorted_entries(&root.join("sys/class/net")) {
        let dev = path.join("device");
        // Virtual interfaces (lo, bridges) have no device; netdevs of an
        // RDMA NIC are already listed with it.
        let Some((pci, chain)) = pci_chain(root, &dev) else {
            continue;
        };
        if out.iter().any(|n| n.pci.as_deref() == Some(pci.as_str())) {
            continue;
        }
        out.push(Nic {
            name: name.clone(),
            kind: NicKind::Ethernet,
            netdevs: vec![name],
            pci: Some(pci),
            numa: numa_of(&dev),
            pci_path: chain,
        });
    }
    out
}

pub(super) fn numa_nodes(root: &Path) -> Vec<NumaNode> {
    let mut out: Vec<NumaNode> = sorted_entries(&root.join("sys/devices/system/node"))
        .into_iter()
        .filter_map(|(name, path)| {
            let id = name.strip_prefix("node")?.parse().ok()?;
            Some(NumaNode {
                id,
                cpus: weft_engine::parse_cpulist(&read_trim(&path.join("cpulist"))?)
                    .unwrap_or_default(),
            })
        })
        .collect();
    out.sort_by_key(|n| n.id);
    out
}
