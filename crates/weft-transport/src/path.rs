//! What a domain's data path really is: which provider and fabric, how
//! device memory reaches the NIC, its size limits and who drives progress.
//! Filled in by each backend ([`crate::Domain::data_path`]), reported by the
//! engine, so a slow or staged path is visible instead of silent.

use std::fmt;

/// How memory of a CUDA device reaches a NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceMemoryPath {
    /// The NIC reads and writes GPU memory itself.
    Direct(DirectKind),
    /// GPU memory can be registered, but its bytes go through host memory
    /// (a provider's bounce buffers, a simulated copy); `how` says which.
    Staged {
        /// The staging mechanism.
        how: String,
    },
    /// Registering GPU memory fails on this NIC.
    Unsupported,
}

/// The mechanism of a [`DeviceMemoryPath::Direct`] path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirectKind {
    /// GPUDirect RDMA through a peer-memory client (`nvidia_peermem`).
    PeerMemory,
    /// GPUDirect RDMA through a dma-buf exported by the CUDA driver.
    DmaBuf,
    /// libfabric `FI_HMEM` on a provider whose NIC accesses GPU memory
    /// (EFA, verbs-based providers).
    FiHmem,
    /// Another process's device memory mapped into the initiator (CUDA
    /// IPC) and written by the initiator's copy engines: same-host peers.
    PeerMapped,
    /// The backend says direct without saying how.
    Unspecified,
}

/// Who moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProgressMode {
    /// The NIC moves data without the host (RC, EFA, the simulator's
    /// global progress).
    Hardware,
    /// Data moves only while the domain is polled (libfabric manual data
    /// progress: tcp, shm); see [`crate::Capabilities::software_progress`].
    Software,
}

/// One domain's data path (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DataPath {
    /// Backend and provider (`loopback`, `libfabric:efa`, `verbs`).
    pub provider: String,
    /// The fabric / device the domain runs on (libfabric's fabric name, the
    /// verbs device, `simulated`).
    pub fabric: String,
    /// How GPU memory reaches this NIC.
    pub device_memory: DeviceMemoryPath,
    /// Largest WRITE in one WR.
    pub max_write_len: u64,
    /// Largest SEND.
    pub max_send_len: u64,
    /// Who drives progress.
    pub progress: ProgressMode,
    /// Whether the fabric happens to deliver in order.
    pub ordered: bool,
}

impl DataPath {
    /// A path with the limits and progress mode of `caps`; device memory
    /// [`DirectKind::Unspecified`] if `caps.device_memory`, else
    /// [`DeviceMemoryPath::Unsupported`]. Backends refine the result.
    pub fn from_capabilities(provider: &str, fabric: &str, caps: &crate::Capabilities) -> Self {
        DataPath {
            provider: provider.to_string(),
            fabric: fabric.to_string(),
            device_memory: if caps.device_memory {
                DeviceMemoryPath::Direct(DirectKind::Unspecified)
            } else {
                DeviceMemoryPath::Unsupported
            },
            max_write_len: caps.max_write_len,
            max_send_len: caps.max_send_len,
            progress: if caps.software_progress {
                ProgressMode::Software
            } else {
                ProgressMode::Hardware
            },
            ordered: caps.ordered,
        }
    }

    /// Sets [`DataPath::device_memory`].
    pub fn with_device_memory(mut self, path: DeviceMemoryPath) -> Self {
        self.device_memory = path;
        self
    }

    /// Whether GPU memory registered here is accessed by the NIC itself.
    pub fn device_memory_direct(&self) -> bool {
        matches!(self.device_memory, DeviceMemoryPath::Direct(_))
    }
}

impl fmt::Display for DeviceMemoryPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceMemoryPath::Direct(k) => write!(f, "direct ({k})"),
            DeviceMemoryPath::Staged { how } => write!(f, "staged ({how})"),
            DeviceMemoryPath::Unsupported => f.write_str("unsupported"),
        }
    }
}

impl fmt::Display for DirectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DirectKind::PeerMemory => "GPUDirect RDMA, peer memory",
            DirectKind::DmaBuf => "GPUDirect RDMA, dma-buf",
            DirectKind::FiHmem => "FI_HMEM",
            DirectKind::PeerMapped => "peer memory mapped (CUDA IPC), copy engines",
            DirectKind::Unspecified => "unspecified",
        })
    }
}

impl fmt::Display for ProgressMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProgressMode::Hardware => "hardware",
            ProgressMode::Software => "software (polled)",
        })
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "provider {} fabric {}: GPU memory {}, max write {} B, max send {} B, progress {}, {}",
            self.provider,
            self.fabric,
            self.device_memory,
            self.max_write_len,
            self.max_send_len,
            self.progress,
            if self.ordered { "ordered" } else { "unordered" }
        )
    }
}
