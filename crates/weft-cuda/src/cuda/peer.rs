//! [`CudaPeerMemory`]: the [`PeerMemory`] of one GPU — device memory
//! exported with CUDA IPC (legacy handles or POSIX descriptors), peers'
//! exports mapped once per peer and allocation, copies on one stream per
//! peer with an event per copy.

use super::drv;
use crate::{CudaCopy, CudaError, Gpu, ImportCache, SharedMemory};
use cudarc::driver::{result, sys};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use weft_transport::{CopyTicket, Device, DeviceCopy, Exported, PeerMemory, TransportError};

/// Peer memory of one GPU (see the module docs), for the same-host backend
/// (`weft_nvlink::NvlinkConfig::with_peer_memory`).
pub struct CudaPeerMemory {
    gpu: Gpu,
    cache: ImportCache,
    local: CudaCopy,
    streams: Mutex<BTreeMap<u64, sys::CUstream>>,
    events: Mutex<BTreeMap<u64, sys::CUevent>>,
    next: Mutex<u64>,
}

// SAFETY: stream and event handles are driver objects usable from any
// thread once the context is bound (every method binds it); the maps are
// behind mutexes.
unsafe impl Send for CudaPeerMemory {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaPeerMemory {}

impl std::fmt::Debug for CudaPeerMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPeerMemory")
            .field("device", &self.gpu.inner.label)
            .field("mappings", &self.cache.mappings())
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// This GPU's [`PeerMemory`]: what the same-host backend needs to
    /// register its memory and to write into peers' memory one-sidedly.
    pub fn peer_memory(&self) -> Result<CudaPeerMemory, CudaError> {
        Ok(CudaPeerMemory {
            gpu: self.clone(),
            cache: ImportCache::new(self),
            local: CudaCopy::new(self)?,
            streams: Mutex::new(BTreeMap::new()),
            events: Mutex::new(BTreeMap::new()),
            next: Mutex::new(1),
        })
    }
}

impl CudaPeerMemory {
    fn err(&self, what: String) -> TransportError {
        TransportError::Unsupported {
            nic: self.gpu.inner.label.clone(),
            what,
        }
    }

    fn stream(&self, peer: u64) -> Result<sys::CUstream, CudaError> {
        let mut s = self.streams.lock();
        if let Some(&raw) = s.get(&peer) {
            return Ok(raw);
        }
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv(&self.gpu.inner.label, "cuStreamCreate"))?;
        s.insert(peer, raw);
        Ok(raw)
    }
}

impl PeerMemory for CudaPeerMemory {
    fn name(&self) -> &str {
        "cuda-ipc"
    }

    fn serves(&self, device: Device) -> bool {
        device == self.gpu.device()
    }

    fn export(&self, addr: u64, len: u64, device: Device) -> Result<Exported, TransportError> {
        if !self.serves(device) {
            return Err(self.err(format!(
                "{device} memory (this serves {})",
                self.gpu.device()
            )));
        }
        let e = self.gpu.export(addr, len)?;
        Ok(Exported {
            desc: e.shared().to_bytes(),
            keep: Box::new(e),
        })
    }

    fn import(&self, peer: u64, desc: &[u8]) -> Result<u64, TransportError> {
        let shared = SharedMemory::from_bytes(desc)?;
        Ok(self.cache.import(peer, &shared)?.device_ptr())
    }

    fn forget_peer(&self, peer: u64) {
        if let Some(raw) = self.streams.lock().remove(&peer) {
            if self.gpu.inner.bind().is_ok() {
                // SAFETY: the stream belongs to this context; it is
                // synchronised before it is destroyed, so no copy into the
                // peer's mappings is left running when they are unmapped.
                unsafe {
                    let _ = result::stream::synchronize(raw);
                    let _ = result::stream::destroy(raw);
                }
            }
        }
        self.cache.forget_peer(peer);
    }

    fn start_copy(
        &self,
        peer: u64,
        dst: u64,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<CopyTicket, TransportError> {
        let g = &self.gpu.inner;
        g.bind()?;
        let n = usize::try_from(len).map_err(|_| self.err(format!("copy of {len} bytes")))?;
        let stream = self.stream(peer)?;
        let label = &g.label;
        // SAFETY: `dst` is an imported peer range (or this process's
        // device memory) of at least `len` bytes from `dst`, checked by
        // the caller against the peer's published registration; `src` lies
        // in registered memory of `src_dev`; the stream belongs to this
        // context. The event is recorded after the copy and queried before
        // anyone is told the bytes landed.
        let ev = unsafe {
            match src_dev {
                Device::Host => sys::cuMemcpyHtoDAsync_v2(dst, src as usize as *const _, n, stream)
                    .result()
                    .map_err(drv(label, "cuMemcpyHtoDAsync"))?,
                _ => result::memcpy_dtod_async(dst, src, n, stream)
                    .map_err(drv(label, "cuMemcpyDtoDAsync"))?,
            }
            let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(drv(label, "cuEventCreate"))?;
            if let Err(e) = result::event::record(ev, stream) {
                let _ = result::event::destroy(ev);
                return Err(drv(label, "cuEventRecord")(e).into());
            }
            ev
        };
        let mut next = self.next.lock();
        let t = *next;
        *next += 1;
        self.events.lock().insert(t, ev);
        Ok(CopyTicket(t))
    }

    fn copy_done(&self, ticket: CopyTicket) -> Result<bool, TransportError> {
        let g = &self.gpu.inner;
        let Some(&ev) = self.events.lock().get(&ticket.0) else {
            return Err(self.err(format!("unknown copy ticket {}", ticket.0)));
        };
        g.bind()?;
        // SAFETY: the event is live (in the map) and of this context.
        let rc = unsafe { sys::cuEventQuery(ev) };
        let done = match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
            e => Err(drv(&g.label, "cuEventQuery")(result::DriverError(e)).into()),
        };
        self.events.lock().remove(&ticket.0);
        // SAFETY: the event completed (or failed) and is no longer in the map.
        let _ = unsafe { result::event::destroy(ev) };
        done
    }
}

impl DeviceCopy for CudaPeerMemory {
    fn copy(
        &self,
        dst: u64,
        dst_dev: Device,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<(), TransportError> {
        self.local.copy(dst, dst_dev, src, src_dev, len)
    }
}

impl Drop for CudaPeerMemory {
    fn drop(&mut self) {
        if self.gpu.inner.bind().is_err() {
            return;
        }
        for (_, raw) in std::mem::take(self.streams.get_mut()) {
            // SAFETY: streams of this context, synchronised before they are
            // destroyed.
            unsafe {
                let _ = result::stream::synchronize(raw);
                let _ = result::stream::destroy(raw);
            }
        }
        for (_, ev) in std::mem::take(self.events.get_mut()) {
            // SAFETY: events of this context; their streams are idle.
            let _ = unsafe { result::event::destroy(ev) };
        }
    }
}
