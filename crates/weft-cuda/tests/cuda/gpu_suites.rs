//! The conformance suite and the engine scenario suite, unchanged, across
//! processes with **device memory**: every buffer the suites allocate in a
//! child process (what the parent fills, reads and registers there; an
//! engine peer's buffer) is GPU memory on cuda:0.
//!
//! - `nvlink::*`: the same-host backend with CUDA peer memory (WRITEs
//!   copied one-sidedly into the target's IPC-mapped memory, SEND/RECV and
//!   WRITEs of host sources staged through the rings);
//! - `shm::*`: libfabric `shm` with FI_HMEM (staged through the provider's
//!   bounce buffers) — needs a libfabric built with CUDA
//!   (`WEFT_LIBFABRIC_PATH`); skipped with the distro's unless
//!   `WEFT_REQUIRE_CUDA_LIBFABRIC=1`.
//!
//! Skipped without a GPU (failed under `WEFT_CUDA_REQUIRE_GPU=1`).

#![cfg(feature = "cuda")]

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;
use weft_conformance::xproc::XprocBackend;
use weft_conformance::{HarnessError, TestMemory};
use weft_cuda::{DeviceBuffer, Gpu};
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_nvlink::{NvlinkConfig, NvlinkProvider};
use weft_transport::{Device, Domain, MemRegion, Provider};

/// Zeroed device memory as the suites' memory.
struct DeviceMemory {
    buf: DeviceBuffer,
    len: usize,
}

impl TestMemory for DeviceMemory {
    fn len(&self) -> usize {
        self.len
    }
    fn write(&self, offset: usize, data: &[u8]) -> bool {
        offset
            .checked_add(data.len())
            .is_some_and(|e| e <= self.len)
            && (data.is_empty() || self.buf.write(offset, data).is_ok())
    }
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return None;
        }
        let mut v = vec![0u8; len];
        if len > 0 {
            self.buf.read(offset, &mut v).ok()?;
        }
        Some(v)
    }
    fn sub_region(&self, range: std::ops::Range<usize>) -> Option<MemRegion> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        let ptr = NonNull::new((self.buf.device_ptr() as usize + range.start) as *mut u8)?;
        // SAFETY: inside a live device allocation on cuda:0 that the suites
        // keep until every registration of it is gone.
        Some(unsafe { MemRegion::new(ptr, range.end - range.start, Device::Cuda(0)) })
    }
}

fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "1")
}

/// Backends whose suites run on device memory (profiles `nvlink`, `shm`).
pub struct GpuXproc {
    profile: String,
    gpu: Gpu,
}

impl GpuXproc {
    fn provider(&self, lanes: usize) -> Result<Arc<dyn Provider>, String> {
        Ok(match self.profile.as_str() {
            "nvlink" => {
                let pm = self.gpu.peer_memory().map_err(|e| e.to_string())?;
                Arc::new(NvlinkProvider::new(
                    NvlinkConfig::default()
                        .with_lanes(lanes)
                        .with_rnr_timeout(Duration::from_millis(200))
                        .with_peer_memory(Arc::new(pm)),
                ))
            }
            _ => Arc::new(
                LibfabricProvider::with_config(
                    LibfabricConfig::new("shm")
                        .with_domains(vec!["shm"; lanes])
                        .with_hmem(true),
                )
                .map_err(|e| e.to_string())?,
            ),
        })
    }
}

impl XprocBackend for GpuXproc {
    fn from_profile(profile: &str) -> Result<Self, HarnessError> {
        let gpu = match Gpu::open(0) {
            Ok(g) => g,
            Err(e) if !required("WEFT_CUDA_REQUIRE_GPU") => {
                return Err(HarnessError::Unsupported(format!(
                    "no usable CUDA GPU: {e}"
                )))
            }
            Err(e) => {
                return Err(HarnessError::Failed(format!(
                    "WEFT_CUDA_REQUIRE_GPU=1: {e}"
                )))
            }
        };
        let b = GpuXproc {
            profile: profile.to_string(),
            gpu,
        };
        if profile == "shm" {
            // The distro's libfabric advertises FI_HMEM but cannot register
            // CUDA memory: probe with one registration.
            let p = b.provider(1).map_err(HarnessError::Unsupported)?;
            let mut d = p
                .open(0)
                .map_err(|e| HarnessError::Unsupported(e.to_string()))?;
            let m = b.alloc(4096).map_err(HarnessError::Failed)?;
            let r = m.sub_region(0..4096).expect("inside");
            if let Err(e) = d.register(&r, weft_transport::Access::RemoteWrite) {
                let why = format!("this libfabric cannot register CUDA memory on shm: {e}");
                return Err(if required("WEFT_REQUIRE_CUDA_LIBFABRIC") {
                    HarnessError::Failed(why)
                } else {
                    HarnessError::Unsupported(why)
                });
            }
        }
        Ok(b)
    }
    fn name(&self) -> String {
        format!("{}+cuda", self.profile)
    }
    fn max_nics(&self) -> usize {
        2
    }
    fn open_domains(&self, nics: usize) -> Result<Vec<Box<dyn Domain>>, String> {
        let p = self.provider(nics)?;
        (0..nics)
            .map(|i| p.open(i).map_err(|e| format!("open {i}: {e}")))
            .collect()
    }
    fn engine(&self) -> Result<TransferEngine, String> {
        let mut cfg = EngineConfig::default();
        cfg.idle_sleep = Some(Duration::from_micros(200));
        TransferEngine::builder()
            .group(DomainGroupSpec::new(self.provider(2)?, vec![0, 1]).device(Device::Cuda(0)))
            .config(cfg)
            .build()
            .map_err(|e| format!("engine: {e}"))
    }
    fn unreachable_addr(&mut self) -> Result<weft_transport::NetAddr, HarnessError> {
        if self.profile != "nvlink" {
            return Err(HarnessError::Unsupported(
                "no way to name an address nobody listens on".into(),
            ));
        }
        // A domain opened and closed again: nobody listens at its address.
        let d = self
            .provider(1)
            .map_err(HarnessError::Failed)?
            .open(0)
            .map_err(|e| HarnessError::Failed(e.to_string()))?;
        Ok(d.local_addr().clone())
    }
    fn alloc(&self, len: usize) -> Result<Box<dyn TestMemory>, String> {
        let buf = self.gpu.alloc(len.max(1)).map_err(|e| e.to_string())?;
        buf.fill(0).map_err(|e| e.to_string())?;
        Ok(Box::new(DeviceMemory { buf, len }))
    }
}

/// Entry point of the child processes of these suites (this binary
/// re-executed); run directly, it checks the proxy codec.
#[test]
fn peer_process_entry() {
    weft_conformance::xproc::child_entry::<GpuXproc>();
}

mod nvlink {
    weft_conformance::conformance_tests!(
        |seed| weft_conformance::xproc::CrossProcess::<super::GpuXproc>::new("nvlink", seed),
        seeds = 0..1u64,
        heavy_seeds = 0..1u64
    );
    /// Without the stop hook: a stopped (SIGSTOP) victim still receives
    /// one-sided GPU copies, so `peer_death` kills a running victim in
    /// mid-stream instead.
    mod engine {
        weft_conformance::engine_scenarios!(
            |seed| weft_conformance::xproc::XprocEngines::<super::super::GpuXproc>::new(
                "nvlink", seed
            )
            .without_stop_hook(),
            seeds = [1u64]
        );
    }
}

/// libfabric shm on GPU memory: every case. WRITEs go through the
/// provider's FI_HMEM copies; the message layer stages a SEND from device
/// memory through a host buffer and copies a message up into a RECV buffer
/// in device memory (CUDA runtime copies on a stream of its own).
mod shm {
    fn run(case: &str) {
        weft_conformance::run_case_for_seeds(
            &|seed| weft_conformance::xproc::CrossProcess::<super::GpuXproc>::new("shm", seed),
            case,
            [0u64],
        );
    }
    macro_rules! cases {
        ($($name:ident),*) => {
            $(#[test] fn $name() { run(stringify!($name)); })*
            #[test]
            fn every_case_listed() {
                let mut listed = vec![$(stringify!($name),)*];
                listed.sort_unstable();
                let mut all: Vec<&str> = weft_conformance::cases().iter().map(|c| c.name).collect();
                all.sort_unstable();
                assert_eq!(listed, all, "conformance case list out of date");
            }
        };
    }
    cases!(
        capabilities_sane,
        write_sizes,
        write_large,
        imm_only_writes,
        batch_writes_queue_full,
        imm_exactly_once,
        payload_visible_at_imm,
        concurrent_writes,
        remote_access_violations,
        deregistered_memory,
        unknown_peer,
        peer_removal,
        send_recv_sizes,
        recv_buffer_pool,
        message_too_long,
        receiver_not_ready,
        multi_nic,
        local_access_errors,
        usable_after_remote_error,
        peer_death
    );
    mod engine {
        weft_conformance::engine_scenarios!(
            |seed| weft_conformance::xproc::XprocEngines::<super::super::GpuXproc>::new(
                "shm", seed
            ),
            seeds = [1u64]
        );
    }
}
