//! Which NICs and CPU cores are closest to each GPU, read from sysfs, and
//! the domain groups that follow from it.
//!
//! [`Topology::detect`] reads `/sys` (PCI devices with their NUMA nodes and
//! PCI paths, RDMA and network devices, NUMA nodes' CPU lists; GPUs are PCI
//! class 0x0302/0x0300 devices of vendor 0x10de, numbered in PCI order as
//! CUDA does with `CUDA_DEVICE_ORDER=PCI_BUS_ID`). [`Topology::placements`]
//! gives each GPU its closest NICs — those sharing the deepest PCI
//! ancestor with it (a PCIe switch beats a root complex), ties broken by
//! NUMA node — and a core of its NUMA node to pin its worker to.
//! [`Topology::plan`] maps that onto a provider's NICs, and
//! [`Topology::groups`] gives the [`DomainGroupSpec`]s for
//! [`crate::EngineBuilder::group`]. The manual builder stays available.
//!
//! **Fallback**: with no GPU found, or no GPU's NICs known to the provider,
//! the plan is one host-memory group over all the provider's NICs (capped
//! at the engine's 8 per group), and [`Plan::fallback`] says why.

mod sysfs;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use weft_engine::DomainGroupSpec;
use weft_transport::{Device, Provider, TransportError};

/// Most NICs one domain group takes.
const MAX_GROUP_NICS: usize = 8;

/// A GPU found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Its CUDA ordinal in PCI bus order.
    pub ordinal: u32,
    /// PCI address (`0000:19:00.0`).
    pub pci: String,
    /// NUMA node, when known.
    pub numa: Option<u32>,
    /// PCI components from the root bus down to the GPU.
    pub pci_path: Vec<String>,
}

/// What kind of device a [`Nic`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NicKind {
    /// An RDMA device (`/sys/class/infiniband`: ConnectX, EFA, ...).
    Rdma,
    /// A network interface with a PCI device and no RDMA device.
    Ethernet,
}

/// A NIC found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// RDMA device name (`mlx5_0`, `rdmap16s27`) or interface name.
    pub name: String,
    /// RDMA or plain network device.
    pub kind: NicKind,
    /// Its network interfaces.
    pub netdevs: Vec<String>,
    /// PCI address, when it has one.
    pub pci: Option<String>,
    /// NUMA node, when known.
    pub numa: Option<u32>,
    /// PCI components from the root bus down to the NIC.
    pub pci_path: Vec<String>,
}

impl Nic {
    /// Whether a provider's NIC called `provider_name` is this NIC: the
    /// same name, one of its interfaces, or its name followed by `-` (a
    /// libfabric domain such as `rdmap16s27-rdm`).
    pub fn matches(&self, provider_name: &str) -> bool {
        provider_name == self.name
            || self.netdevs.iter().any(|n| n == provider_name)
            || provider_name
                .strip_prefix(self.name.as_str())
                .is_some_and(|rest| rest.starts_with('-'))
    }
}

/// A NUMA node and its CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// Node id.
    pub id: u32,
    /// Its CPUs, ascending.
    pub cpus: Vec<usize>,
}

/// Where one GPU's traffic should go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The GPU's ordinal.
    pub gpu: u32,
    /// Names of its closest NICs (see the module docs).
    pub nics: Vec<String>,
    /// Its NUMA node.
    pub numa: Option<u32>,
    /// The core to pin its worker to (on its NUMA node).
    pub cpu: Option<usize>,
}

/// One planned domain group, in a provider's NIC indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    /// The device the group serves.
    pub device: Device,
    /// Indices into the provider's `nics()`.
    pub nics: Vec<usize>,
    /// The core to pin the worker to.
    pub cpu: Option<usize>,
    /// The NUMA node of the worker.
    pub numa: Option<u32>,
}

/// The groups for one provider, from [`Topology::plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// One group per GPU, or the single fallback group.
    pub groups: Vec<GroupPlan>,
    /// Why the fallback (one group, all NICs) was used, if it was.
    pub fallback: Option<String>,
}

/// GPUs, NICs and NUMA nodes of a host (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    /// GPUs in ordinal order.
    pub gpus: Vec<Gpu>,
    /// NICs: RDMA devices by name, then other PCI network interfaces.
    pub nics: Vec<Nic>,
    /// NUMA nodes by id.
    pub numa: Vec<NumaNode>,
    /// The root the tree was read from.
    pub root: PathBuf,
}

fn common_depth(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Topology {
    /// Reads this host's `/sys`.
    pub fn detect() -> Topology {
        Self::detect_at("/")
    }

    /// Reads the sysfs tree under `root` (`root/sys/...`); missing parts
    /// give an empty topology, never an error.
    pub fn detect_at(root: impl AsRef<Path>) -> Topology {
        let root = root.as_ref();
        let t = Topology {
            gpus: sysfs::gpus(root),
            nics: sysfs::nics(root),
            numa: sysfs::numa_nodes(root),
            root: root.to_path_buf(),
        };
        tracing::debug!(gpus = t.gpus.len(), nics = t.nics.len(), numa_nodes = t.numa.len(), root = %root.display(), "topology detected");
        t
    }

    /// The closest NICs of `gpu` (see the module docs); every NIC when
    /// nothing distinguishes them.
    fn closest(&self, gpu: &Gpu) -> Vec<String> {
        let key = |n: &Nic| {
            (
                common_depth(&gpu.pci_path, &n.pci_path),
                u8::from(gpu.numa.is_some() && gpu.numa == n.numa),
            )
        };
        let Some(best) = self.nics.iter().map(key).max() else {
            return Vec::new();
        };
        self.nics
            .iter()
            .filter(|n| key(n) == best)
            .map(|n| n.name.clone())
            .collect()
    }

    /// Per GPU: its closest NICs, NUMA node and a core to pin to. GPUs of
    /// one node get distinct cores, in GPU order, starting at the node's
    /// second CPU (the first is left to the system) when there are enough.
    pub fn placements(&self) -> Vec<Placement> {
        let mut used_on_node: Vec<(u32, usize)> = Vec::new();
        self.gpus
            .iter()
            .map(|g| {
                let cpu = g.numa.and_then(|node| {
                    let cpus = &self.numa.iter().find(|n| n.id == node)?.cpus;
                    let k = match used_on_node.iter_mut().find(|(n, _)| *n == node) {
                        Some((_, k)) => {
                            *k += 1;
                            *k
                        }
                        None => {
                            used_on_node.push((node, 0));
                            0
                        }
                    };
                    let skip = usize::from(cpus.len() > 1);
                    let usable = cpus.len() - skip;
                    (usable > 0).then(|| cpus[skip + k % usable])
                });
                Placement {
                    gpu: g.ordinal,
                    nics: self.closest(g),
                    numa: g.numa,
                    cpu,
                }
            })
            .collect()
    }

    /// The groups for a provider whose NICs are called `provider_nics` (in
    /// its index order): one per GPU over its closest NICs that the
    /// provider has, or the fallback.
    pub fn plan(&self, provider_nics: &[String]) -> Plan {
        let all: Vec<usize> = (0..provider_nics.len().min(MAX_GROUP_NICS)).collect();
        let fallback = |why: String| Plan {
            groups: vec![GroupPlan {
                device: Device::Host,
                nics: all.clone(),
                cpu: None,
                numa: None,
            }],
            fallback: Some(why),
        };
        if self.gpus.is_empty() {
            return fallback(format!(
                "no NVIDIA GPU under {}",
                self.root.join("sys/bus/pci/devices").display()
            ));
        }
        let mut groups = Vec::new();
        for p in self.placements() {
            let idx: Vec<usize> = provider_nics
                .iter()
                .enumerate()
                .filter(|(_, pn)| {
                    p.nics
                        .iter()
                        .any(|name| self.nics.iter().any(|n| &n.name == name && n.matches(pn)))
                })
                .map(|(i, _)| i)
                .take(MAX_GROUP_NICS)
                .collect();
            if idx.is_empty() {
                continue;
            }
            groups.push(GroupPlan {
                device: Device::Cuda(p.gpu),
                nics: idx,
                cpu: p.cpu,
                numa: p.numa,
            });
        }
        if groups.is_empty() {
            return fallback(format!(
                "none of the provider's NICs {provider_nics:?} is a GPU's closest NIC"
            ));
        }
        Plan {
            groups,
            fallback: None,
        }
    }

    /// [`Topology::plan`] for `provider`, as [`DomainGroupSpec`]s ready for
    /// the engine builder. Logs the plan (and the fallback reason) at info.
    pub fn groups(
        &self,
        provider: Arc<dyn Provider>,
    ) -> Result<Vec<DomainGroupSpec>, TransportError> {
        let names: Vec<String> = provider.nics()?.into_iter().map(|n| n.name).collect();
        let plan = self.plan(&names);
        if let Some(why) = &plan.fallback {
            tracing::info!(provider = provider.name(), reason = %why, nics = names.len(), "topology: one group over all NICs");
        }
        Ok(plan
            .groups
            .into_iter()
            .map(|g| {
                tracing::info!(provider = provider.name(), device = %g.device, nics = ?g.nics.iter().filter_map(|&i| names.get(i)).collect::<Vec<_>>(), cpu = ?g.cpu, numa = ?g.numa, "topology: domain group");
                let mut s = DomainGroupSpec::new(provider.clone(), g.nics).device(g.device);
                if let Some(c) = g.cpu {
                    s = s.cpu(c);
                } else if let Some(n) = g.numa {
                    s = s.numa_node(n);
                }
                s
            })
            .collect())
    }
}
