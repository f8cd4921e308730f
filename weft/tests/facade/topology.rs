//! `weft::Topology` on fake sysfs trees: an H200-like host (8 GPUs, 8 RDMA
//! NICs, 2 NUMA nodes, one GPU and one NIC behind each PCIe switch, plus a
//! management NIC), GPUs with unknown NUMA, and an empty tree.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use weft::topology::{GroupPlan, NicKind};
use weft::{Device, Domain, NetAddr, NicInfo, Provider, Topology, TransportError};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A temporary directory holding a fake `sys/` tree.
struct Tree(PathBuf);

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Tree {
    fn new() -> Tree {
        let p = std::env::temp_dir().join(format!(
            "weft-topo-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Tree(p)
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn link(&self, rel: &str, target: &Path) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        symlink(target, p).unwrap();
    }

    /// A PCI device at `chain` (under sys/devices) with class, vendor and
    /// NUMA node; linked from sys/bus/pci/devices.
    fn pci(&self, chain: &[&str], class: &str, vendor: &str, numa: i32) -> PathBuf {
        let rel = format!("sys/devices/{}", chain.join("/"));
        self.write(&format!("{rel}/class"), &format!("{class}\n"));
        self.write(&format!("{rel}/vendor"), &format!("{vendor}\n"));
        self.write(&format!("{rel}/numa_node"), &format!("{numa}\n"));
        let dir = self.0.join(&rel);
        self.link(
            &format!("sys/bus/pci/devices/{}", chain.last().unwrap()),
            &dir,
        );
        dir
    }

    fn rdma(&self, name: &str, netdev: &str, dev: &Path) {
        self.link(&format!("sys/class/infiniband/{name}/device"), dev);
        std::fs::create_dir_all(dev.join("net").join(netdev)).unwrap();
        self.link(&format!("sys/class/net/{netdev}/device"), dev);
    }

    fn node(&self, id: u32, cpus: &str) {
        self.write(
            &format!("sys/devices/system/node/node{id}/cpulist"),
            &format!("{cpus}\n"),
        );
    }
}

const GPU_BUSES: [u32; 8] = [0x19, 0x3b, 0x4c, 0x5d, 0x9b, 0xbb, 0xcb, 0xdb];

/// 8 GPU + NIC pairs, each behind its own PCIe switch on its own root
/// complex; pairs 0-3 on NUMA node 0, 4-7 on node 1; a management NIC
/// (plain Ethernet) on node 0's first root complex; a loopback interface.
fn h200_host() -> Tree {
    let t = Tree::new();
    t.node(0, "0-47,96-143");
    t.node(1, "48-95,144-191");
    for (i, bus) in GPU_BUSES.iter().enumerate() {
        let numa = if i < 4 { 0 } else { 1 };
        let root = format!("pci0000:{:02x}", bus - 3);
        let port = format!("0000:{:02x}:01.0", bus - 3);
        let up = format!("0000:{:02x}:00.0", bus - 2);
        let down_gpu = format!("0000:{:02x}:00.0", bus - 1);
        let down_nic = format!("0000:{:02x}:01.0", bus - 1);
        let gpu = format!("0000:{bus:02x}:00.0");
        let nic = format!("0000:{:02x}:00.0", bus + 1);
        t.pci(
            &[&root, &port, &up, &down_gpu, &gpu],
            "0x030200",
            "0x10de",
            numa,
        );
        let nic_dir = t.pci(
            &[&root, &port, &up, &down_nic, &nic],
            "0x020700",
            "0x15b3",
            numa,
        );
        t.rdma(
            &format!("mlx5_{i}"),
            &format!("ibp{:x}s0", bus + 1),
            &nic_dir,
        );
    }
    let mgmt = t.pci(
        &["pci0000:00", "0000:00:1c.0", "0000:02:00.0"],
        "0x020000",
        "0x8086",
        0,
    );
    t.link("sys/class/net/eno1/device", &mgmt);
    std::fs::create_dir_all(t.0.join("sys/class/net/lo")).unwrap();
    // A non-NVIDIA display device is not a GPU.
    t.pci(&["pci0000:00", "0000:00:02.0"], "0x030000", "0x102b", 0);
    t
}

#[test]
fn h200_like_host_pairs_each_gpu_with_its_switch_nic() {
    let t = h200_host();
    let topo = Topology::detect_at(&t.0);
    assert_eq!(topo.gpus.len(), 8);
    assert_eq!(topo.gpus[0].pci, "0000:19:00.0");
    assert_eq!(topo.gpus[7].numa, Some(1));
    assert_eq!(topo.nics.len(), 9, "{:?}", topo.nics);
    assert_eq!(topo.nics[0].kind, NicKind::Rdma);
    assert_eq!(topo.nics[0].netdevs, vec!["ibp1as0".to_string()]);
    let eno = topo.nics.iter().find(|n| n.name == "eno1").unwrap();
    assert_eq!(eno.kind, NicKind::Ethernet);
    assert_eq!(topo.numa.len(), 2);
    assert_eq!(topo.numa[1].cpus.len(), 96);

    let p = topo.placements();
    for (i, pl) in p.iter().enumerate() {
        assert_eq!(pl.gpu, i as u32);
        assert_eq!(pl.nics, vec![format!("mlx5_{i}")], "GPU {i}");
    }
    // Distinct cores on each node, skipping the node's first CPU.
    let cpus: Vec<Option<usize>> = p.iter().map(|pl| pl.cpu).collect();
    assert_eq!(cpus, [1, 2, 3, 4, 49, 50, 51, 52].map(Some).to_vec());

    // A verbs-like provider lists the RDMA devices (in another order).
    let names: Vec<String> = (0..8).rev().map(|i| format!("mlx5_{i}")).collect();
    let plan = topo.plan(&names);
    assert_eq!(plan.fallback, None);
    assert_eq!(plan.groups.len(), 8);
    assert_eq!(
        plan.groups[0],
        GroupPlan {
            device: Device::Cuda(0),
            nics: vec![7],
            cpu: Some(1),
            numa: Some(0)
        }
    );
    assert_eq!(plan.groups[7].nics, vec![0]);
    // libfabric domain names (`<dev>-rdm`) and interface names match too.
    let fi: Vec<String> = (0..8).map(|i| format!("mlx5_{i}-rdm")).collect();
    assert_eq!(topo.plan(&fi).groups[3].nics, vec![3]);
    let tcp = vec!["eno1".to_string(), "ibp1as0".to_string()];
    let plan = topo.plan(&tcp);
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(plan.groups[0].device, Device::Cuda(0));
    assert_eq!(plan.groups[0].nics, vec![1]);
}

#[test]
fn two_nics_on_one_switch_both_serve_its_gpu_and_numa_breaks_ties() {
    let t = Tree::new();
    t.node(0, "0-3");
    t.node(1, "4-7");
    let a = ["pci0000:10", "0000:10:01.0", "0000:11:00.0"];
    t.pci(
        &[a[0], a[1], a[2], "0000:12:00.0", "0000:13:00.0"],
        "0x030200",
        "0x10de",
        0,
    );
    for (i, d) in ["0000:12:01.0", "0000:12:02.0"].iter().enumerate() {
        let bdf = format!("0000:{:02x}:00.0", 0x20 + i);
        let dev = t.pci(&[a[0], a[1], a[2], d, &bdf], "0x020000", "0x1d0f", 0);
        t.rdma(&format!("rdmap{i}"), &format!("ens{i}"), &dev);
    }
    // A GPU on node 1 with no NIC on its root complex: the node-1 NIC wins
    // over the node-0 ones.
    t.pci(
        &["pci0000:80", "0000:80:01.0", "0000:81:00.0"],
        "0x030200",
        "0x10de",
        1,
    );
    let dev = t.pci(
        &["pci0000:90", "0000:90:01.0", "0000:91:00.0"],
        "0x020000",
        "0x1d0f",
        1,
    );
    t.rdma("rdmap9", "ens9", &dev);
    let topo = Topology::detect_at(&t.0);
    let p = topo.placements();
    assert_eq!(p[0].nics, vec!["rdmap0".to_string(), "rdmap1".to_string()]);
    assert_eq!(p[1].nics, vec!["rdmap9".to_string()]);
    assert_eq!((p[0].cpu, p[1].cpu), (Some(1), Some(5)));
}

#[test]
fn unknown_numa_still_pairs_by_pci_and_pins_nothing() {
    let t = Tree::new();
    t.pci(
        &["pci0000:00", "0000:00:01.0", "0000:01:00.0"],
        "0x030200",
        "0x10de",
        -1,
    );
    let dev = t.pci(
        &["pci0000:00", "0000:00:01.0", "0000:02:00.0"],
        "0x020000",
        "0x15b3",
        -1,
    );
    t.rdma("mlx5_0", "eth0", &dev);
    let topo = Topology::detect_at(&t.0);
    let p = topo.placements();
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].numa, p[0].cpu), (None, None));
    assert_eq!(p[0].nics, vec!["mlx5_0".to_string()]);
}

#[test]
fn empty_tree_falls_back_to_one_group_of_all_nics() {
    let t = Tree::new();
    let topo = Topology::detect_at(&t.0);
    assert!(topo.gpus.is_empty() && topo.nics.is_empty() && topo.numa.is_empty());
    let plan = topo.plan(&["a".into(), "b".into()]);
    assert_eq!(
        plan.groups,
        vec![GroupPlan {
            device: Device::Host,
            nics: vec![0, 1],
            cpu: None,
            numa: None
        }]
    );
    assert!(plan.fallback.unwrap().contains("no NVIDIA GPU"));
    // A root that does not exist at all is just as empty.
    assert_eq!(Topology::detect_at(t.0.join("missing")).gpus.len(), 0);
}

#[test]
fn provider_without_the_gpus_nics_falls_back() {
    let t = h200_host();
    let topo = Topology::detect_at(&t.0);
    let plan = topo.plan(&["lo/host0/nic0".into()]);
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(plan.groups[0].device, Device::Host);
    assert!(plan.fallback.unwrap().contains("closest NIC"));
}

/// A provider that only lists NICs (the builder input needs no domain).
struct Listed(Vec<String>);

impl Provider for Listed {
    fn name(&self) -> &str {
        "listed"
    }
    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        Ok(self
            .0
            .iter()
            .map(|n| NicInfo {
                name: n.clone(),
                addr: NetAddr(vec![]),
                numa_node: None,
                link_gbps: None,
            })
            .collect())
    }
    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        Err(TransportError::NoDevice {
            what: format!("listed NIC {nic}"),
        })
    }
}

#[test]
fn groups_are_engine_builder_input() {
    let t = h200_host();
    let topo = Topology::detect_at(&t.0);
    let names: Vec<String> = (0..8).map(|i| format!("mlx5_{i}")).collect();
    let specs = topo.groups(Arc::new(Listed(names))).unwrap();
    assert_eq!(specs.len(), 8);
    let d = format!("{:?}", specs[5]);
    assert!(
        d.contains("nics: [5]") && d.contains("Cuda(5)") && d.contains("cpu: Some(50)"),
        "{d}"
    );
    // The real host: whatever it has, detection does not fail and the
    // plan for its loopback provider is the fallback or per-GPU groups.
    let here = Topology::detect();
    let plan = here.plan(&["x".into()]);
    assert!(!plan.groups.is_empty());
}
