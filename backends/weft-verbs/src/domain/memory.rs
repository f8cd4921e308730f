//! Memory registrations: the domain's table of MRs and their lkeys, and the
//! lookup that turns a [`LocalSlice`] into an lkey.

use super::VerbsDomain;
use crate::ops::*;
use std::collections::BTreeMap;
use weft_transport::{Access, Device, LocalMr, LocalSlice, MemRegion, MrKey, Rkey, TransportError};

/// The domain's registrations by [`MrKey`] value.
pub(super) struct MrTable {
    pub(super) by_key: BTreeMap<u64, MrEntry>,
    /// The key the next registration gets.
    pub(super) next: u64,
}

pub(super) struct MrEntry {
    pub(super) mr: Mr,
    pub(super) lkey: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// Registers `region` (host memory, or GPU memory through a dma-buf or a
    /// peer-memory client) and records its lkey.
    pub(super) fn register_region(
        &mut self,
        region: &MemRegion,
        acc: Access,
    ) -> Result<LocalMr, TransportError> {
        let mut flags = access::LOCAL_WRITE | access::RELAXED_ORDERING;
        if acc == Access::RemoteWrite {
            flags |= access::REMOTE_WRITE;
        }
        let addr = region.addr();
        let len = region.len() as u64;
        let res = match region.device() {
            Device::Host => self.ops.reg_mr(self.pd, addr, len, flags),
            dev @ Device::Cuda(_) => match self.cfg.dmabuf.clone() {
                Some(exp) => {
                    let (fd, off) = exp.export(addr, len, dev)?;
                    match self.ops.reg_dmabuf_mr(self.pd, off, len, addr, fd, flags) {
                        Ok(r) => Ok(r),
                        Err(e) if self.ops.peer_memory() => {
                            tracing::debug!(nic = %self.nic, error = %e, "dma-buf registration failed; using peer memory");
                            self.ops.reg_mr(self.pd, addr, len, flags)
                        }
                        Err(e) => Err(e),
                    }
                }
                None if self.ops.peer_memory() => self.ops.reg_mr(self.pd, addr, len, flags),
                None => {
                    return Err(TransportError::Unsupported {
                        nic: self.nic.clone(),
                        what: format!(
                            "{dev} memory: no dma-buf exporter configured and no peer-memory client"
                        ),
                    })
                }
            },
        };
        let (mr, lkey, rkey) = res.map_err(|e| {
            if e.code == 95 {
                TransportError::Unsupported {
                    nic: self.nic.clone(),
                    what: format!("registering {} memory: {e}", region.device()),
                }
            } else {
                self.verr(e)
            }
        })?;
        let key = self.mrs.next;
        self.mrs.next += 1;
        self.mrs.by_key.insert(
            key,
            MrEntry {
                mr,
                lkey,
                addr,
                len,
            },
        );
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(u64::from(rkey)),
            addr,
            len,
            device: region.device(),
        })
    }

    /// Deregisters a registration made by [`Self::register_region`].
    pub(super) fn deregister_key(&mut self, mr: MrKey) -> Result<(), TransportError> {
        let e = self
            .mrs
            .by_key
            .remove(&mr.0)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!("unknown registration {mr:?}"),
            })?;
        self.ops.dereg_mr(e.mr).map_err(|e| self.verr(e))
    }

    pub(super) fn resolve_local(&self, s: &LocalSlice) -> Result<u32, TransportError> {
        let m = self
            .mrs
            .by_key
            .get(&s.mr.0)
            .ok_or_else(|| TransportError::LocalAccess {
                nic: self.nic.clone(),
                what: format!("unknown or deregistered key {:?}", s.mr),
            })?;
        let end = s.addr.checked_add(s.len);
        let mend = m.addr.checked_add(m.len);
        match (end, mend) {
            (Some(e), Some(me)) if s.addr >= m.addr && e <= me => Ok(m.lkey),
            _ => Err(TransportError::LocalAccess {
                nic: self.nic.clone(),
                what: format!(
                    "[{:#x}, +{}) outside registration {:?} [{:#x}, +{})",
                    s.addr, s.len, s.mr, m.addr, m.len
                ),
            }),
        }
    }
}
