//! [`HostPeerMemory`]: a [`PeerMemory`] over host memory, to test the
//! one-sided path of same-host backends without a GPU. It exports any host
//! range as `(pid, address, length)`; only the exporting process can use
//! such a description (another process's import fails, and the backend
//! then stages through its rings, which tests that fallback too). Copies
//! are `memcpy`s that report done only at the second look, so callers'
//! "copy still running" paths run as well.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use weft_transport::{CopyTicket, Device, DeviceCopy, Exported, PeerMemory, TransportError};

/// See the module docs.
#[derive(Debug, Default)]
pub struct HostPeerMemory {
    tickets: Mutex<(u64, BTreeMap<u64, bool>)>,
}

impl HostPeerMemory {
    /// A new one.
    pub fn new() -> Self {
        Self::default()
    }

    fn refuse(what: String) -> TransportError {
        TransportError::Unsupported {
            nic: "host-peer-memory".into(),
            what,
        }
    }
}

impl PeerMemory for HostPeerMemory {
    fn name(&self) -> &str {
        "host (test)"
    }

    fn serves(&self, device: Device) -> bool {
        device == Device::Host
    }

    fn export(&self, addr: u64, len: u64, device: Device) -> Result<Exported, TransportError> {
        if device != Device::Host {
            return Err(Self::refuse(format!("{device} memory")));
        }
        let mut desc = std::process::id().to_le_bytes().to_vec();
        desc.extend_from_slice(&addr.to_le_bytes());
        desc.extend_from_slice(&len.to_le_bytes());
        Ok(Exported {
            desc,
            keep: Box::new(()),
        })
    }

    fn import(&self, _peer: u64, desc: &[u8]) -> Result<u64, TransportError> {
        if desc.len() != 20 {
            return Err(Self::refuse(format!(
                "a description of {} bytes",
                desc.len()
            )));
        }
        let pid = u32::from_le_bytes(desc[..4].try_into().expect("4 bytes"));
        if pid != std::process::id() {
            return Err(Self::refuse(format!("host memory of process {pid}")));
        }
        Ok(u64::from_le_bytes(desc[4..12].try_into().expect("8 bytes")))
    }

    fn forget_peer(&self, _peer: u64) {}

    fn start_copy(
        &self,
        _peer: u64,
        dst: u64,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<CopyTicket, TransportError> {
        if src_dev != Device::Host {
            return Err(Self::refuse(format!("copies from {src_dev}")));
        }
        // SAFETY: the PeerMemory contract: `dst` is a checked range of an
        // imported (here: this process's) registration and `src` lies in
        // registered host memory, both `len` bytes.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        let mut t = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        t.0 += 1;
        let id = t.0;
        t.1.insert(id, false);
        Ok(CopyTicket(id))
    }

    fn copy_done(&self, ticket: CopyTicket) -> Result<bool, TransportError> {
        let mut t = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        match t.1.get_mut(&ticket.0) {
            None => Err(Self::refuse(format!("unknown ticket {}", ticket.0))),
            Some(seen) if !*seen => {
                *seen = true;
                Ok(false)
            }
            Some(_) => {
                t.1.remove(&ticket.0);
                Ok(true)
            }
        }
    }
}

impl DeviceCopy for HostPeerMemory {
    fn copy(
        &self,
        dst: u64,
        dst_dev: Device,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<(), TransportError> {
        if dst_dev != Device::Host || src_dev != Device::Host {
            return Err(Self::refuse(format!(
                "copies between {src_dev} and {dst_dev}"
            )));
        }
        // SAFETY: both spans lie in registered host memory of this process.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        Ok(())
    }
}
