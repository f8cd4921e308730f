//! `LoopbackDomain` (one NIC) and `LoopbackProvider` (one host).

use crate::config::NicModel;
use crate::fabric::{nic_name, Loc};
use crate::{addr, Fabric, HostId};
use std::collections::BTreeMap;
use weft_transport::{
    Access, Capabilities, Completion, Domain, LocalMr, LocalSlice, MemRegion, MrKey, NetAddr,
    NicInfo, PeerId, PostError, Provider, TransportError, WrId, WriteWr,
};

/// One open NIC of the loopback fabric; implements [`Domain`].
///
/// Dropping it closes the NIC: its registrations and posted receives are
/// dropped, its own pending operations are canceled silently, and peers'
/// pending operations to it fail with `PeerUnreachable`. The NIC can then be
/// opened again with [`Fabric::open`].
pub struct LoopbackDomain {
    fabric: Fabric,
    loc: Loc,
    info: NicInfo,
    caps: Capabilities,
    /// Every peer handle handed out: location, address, and whether it
    /// was removed ([`Domain::remove_peer`]; the handle is never reused).
    peers: Vec<(Loc, NetAddr, bool)>,
    peer_ids: BTreeMap<NetAddr, PeerId>,
}

impl std::fmt::Debug for LoopbackDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackDomain")
            .field("nic", &self.info.name)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl LoopbackDomain {
    pub(crate) fn new(fabric: Fabric, loc: Loc, model: NicModel, caps: Capabilities) -> Self {
        let gbps = model.link_gbps;
        Self {
            fabric,
            loc,
            info: NicInfo {
                name: nic_name(loc),
                addr: addr::encode(loc.0, loc.1),
                numa_node: None,
                link_gbps: (gbps.is_finite() && gbps > 0.0).then_some(gbps),
            },
            caps,
            peers: Vec::new(),
            peer_ids: BTreeMap::new(),
        }
    }

    /// The host this domain's NIC belongs to.
    pub fn host(&self) -> HostId {
        HostId(self.loc.0)
    }

    /// The NIC index within its host.
    pub fn nic_index(&self) -> usize {
        self.loc.1 as usize
    }

    /// Registers `len` bytes that exist only in the simulation: no memory
    /// backs them, the fabric makes up the address. Only on a timing-only
    /// fabric ([`crate::FabricConfig::timing`]), which never copies payload;
    /// elsewhere it fails with `Unsupported`. Checks at post and at arrival
    /// (keys, bounds, access) apply to it as to any registration.
    pub fn register_virtual(
        &mut self,
        len: u64,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        self.fabric.lock().register_virtual(self.loc, len, access)
    }

    /// The fabric this domain belongs to.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    fn peer(&self, p: PeerId) -> Result<Loc, TransportError> {
        match self.peers.get(p.0 as usize) {
            Some((l, _, false)) => Ok(*l),
            Some((_, a, true)) => Err(TransportError::PeerRemoved {
                nic: self.info.name.clone(),
                peer: a.clone(),
            }),
            None => Err(TransportError::InvalidArgument {
                nic: self.info.name.clone(),
                what: format!("unknown peer handle {}", p.0),
            }),
        }
    }
}

impl Drop for LoopbackDomain {
    fn drop(&mut self) {
        self.fabric.lock().nic_down(self.loc, false);
    }
}

impl Domain for LoopbackDomain {
    fn info(&self) -> &NicInfo {
        &self.info
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn data_path(&self) -> weft_transport::DataPath {
        // Device memory goes through the fabric's DeviceCopy: a staged
        // path by construction.
        let dm = if self.caps.device_memory {
            weft_transport::DeviceMemoryPath::Staged {
                how: "simulated fabric, DeviceCopy through host memory".into(),
            }
        } else {
            weft_transport::DeviceMemoryPath::Unsupported
        };
        weft_transport::DataPath::from_capabilities("loopback", "simulated", &self.caps)
            .with_device_memory(dm)
    }

    fn register(&mut self, region: &MemRegion, access: Access) -> Result<LocalMr, TransportError> {
        self.fabric.lock().register(self.loc, region, access)
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        self.fabric.lock().deregister(self.loc, mr)
    }

    fn add_peer(&mut self, a: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(&p) = self.peer_ids.get(a) {
            return Ok(p);
        }
        let loc = addr::decode(a).ok_or_else(|| TransportError::InvalidArgument {
            nic: self.info.name.clone(),
            what: format!("{a:?} is not a loopback address"),
        })?;
        let id = u32::try_from(self.peers.len()).map_err(|_| TransportError::InvalidArgument {
            nic: self.info.name.clone(),
            what: "too many peers".into(),
        })?;
        self.peers.push((loc, a.clone(), false));
        self.peer_ids.insert(a.clone(), PeerId(id));
        Ok(PeerId(id))
    }

    /// The loopback fabric keeps no connection state: removal only retires
    /// the handle. Operations already posted complete as the fabric decides
    /// (they target the old host; a dead one fails them).
    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        if let Some(e) = self.peers.get_mut(peer.0 as usize) {
            if !e.2 {
                e.2 = true;
                self.peer_ids.remove(&e.1);
            }
        }
        Ok(())
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        let dst = self.peer(peer)?;
        let mut st = self.fabric.lock();
        st.check_alive(self.loc)?;
        if !st.has_room(self.loc) {
            return Err(TransportError::QueueFull {
                nic: self.info.name.clone(),
            });
        }
        st.post_send(self.loc, dst, wr, src)
    }

    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        let mut st = self.fabric.lock();
        st.check_alive(self.loc)?;
        st.post_recv(self.loc, wr, buf)
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let mut st = self.fabric.lock();
        st.check_alive(self.loc)
            .map_err(|error| PostError { posted: 0, error })?;
        let n = wrs.len().min(self.caps.max_batch);
        for (i, wr) in wrs.iter().take(n).enumerate() {
            if !st.has_room(self.loc) {
                return Ok(i);
            }
            let dst = self
                .peer(wr.peer)
                .map_err(|error| PostError { posted: i, error })?;
            st.post_write(self.loc, dst, wr)
                .map_err(|error| PostError { posted: i, error })?;
        }
        Ok(n)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        self.fabric.lock().drain_cq(self.loc, out)
    }
}

/// The NICs of one simulated host, as a [`Provider`] (name `"loopback"`).
#[derive(Debug, Clone)]
pub struct LoopbackProvider {
    fabric: Fabric,
    host: HostId,
}

impl LoopbackProvider {
    pub(crate) fn new(fabric: Fabric, host: HostId) -> Self {
        Self { fabric, host }
    }

    /// The host whose NICs this provider opens.
    pub fn host(&self) -> HostId {
        self.host
    }

    /// Opens NIC `nic` as a concrete [`LoopbackDomain`].
    pub fn open_loopback(&self, nic: usize) -> Result<LoopbackDomain, TransportError> {
        self.fabric.open(self.host, nic)
    }
}

impl Provider for LoopbackProvider {
    fn name(&self) -> &str {
        "loopback"
    }

    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        let n = self.fabric.nic_count(self.host);
        let gbps = self.fabric.config().nic.link_gbps;
        Ok((0..n)
            .map(|nic| {
                let loc = (self.host.0, u32::try_from(nic).unwrap_or(u32::MAX));
                NicInfo {
                    name: nic_name(loc),
                    addr: addr::encode(loc.0, loc.1),
                    numa_node: None,
                    link_gbps: (gbps.is_finite() && gbps > 0.0).then_some(gbps),
                }
            })
            .collect())
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        Ok(Box::new(self.fabric.open(self.host, nic)?))
    }
}
