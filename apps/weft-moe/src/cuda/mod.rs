//! The GPU path (feature `cuda`): NVRTC kernels for the four device
//! operations ([`MoeKernels`]), one rank's GPU buffers and signal words
//! ([`GpuRank`]) and two ways to run N ranks on one GPU, each with a proxy
//! thread per rank ([`ProxyGroup`]):
//!
//! - [`EngineGroup`] (the real path): every rank has its own
//!   [`weft::TransferEngine`] on one loopback fabric that copies GPU memory;
//!   each proxy runs the shared [`crate::RankCore`] and posts its scatters,
//!   writes and barriers on the engine, completing rounds on immediate
//!   counts (`proxy.rs`);
//! - [`LocalGroup`] (a baseline): the proxies move the same bytes with their
//!   own device-to-device copies and count arrivals in shared memory, no
//!   engine and no fabric; it shows what the kernels and proxies cost
//!   without the engine (`local.rs`).
//!
//! Signals (kernel → proxy): watch words bumped once per step by the last
//! block of each kernel: `counted` (the route row is in host-mapped
//! memory), `packed`, `unpacked`, `combine_packed`, `summed`. Flags (proxy
//! → kernel): `dispatch_ready` and `combine_ready`, raised to the step
//! number; the recv kernels wait on them with system-scope acquire loads.
//! The step number lives in device memory (the count kernel advances it),
//! so the four launches of a step can be captured into a CUDA graph.

mod engine;
// Kernel launches pass raw parameter pointers to the driver.
#[allow(unsafe_code)]
mod kernels;
mod kernels_cu;
mod local;
mod proxy;

pub use engine::{EngineGroup, EngineGroupConfig, EngineRank, HostFn};
pub use kernels::MoeKernels;
pub use kernels_cu::MOE_CU;
pub use local::{LocalGroup, ProxyTimes};

use crate::config::Dims;
use crate::error::{MoeError, Phase};
use crate::expert::{ExpertTokens, RankInput, TopkWeights};
use std::sync::Arc;
use std::time::Duration;
use weft_cuda::{CudaError, DeviceBuffer, Gpu, HostFlag, MappedBuffer, Stream, WatchWord};

/// Errors of the GPU path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// A CUDA call failed.
    #[error("rank {rank:?}, phase {phase:?}: {source}")]
    Cuda {
        /// The rank (None: not rank-specific, e.g. compiling).
        rank: Option<u32>,
        /// The phase.
        phase: Phase,
        /// The CUDA error.
        #[source]
        source: CudaError,
    },
    /// A shape, routing or plan error (same checks as the CPU path).
    #[error(transparent)]
    Moe(#[from] MoeError),
    /// A proxy waited too long for a peer or a kernel signal.
    #[error("rank {rank}, phase {phase:?}: waited {waited:?} for {what}")]
    Timeout {
        /// The rank whose proxy waited.
        rank: u32,
        /// The phase.
        phase: Phase,
        /// What it waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// A receive kernel gave up waiting for its flag.
    #[error("rank {rank}: a receive kernel timed out waiting for its flag ({state})")]
    KernelTimeout {
        /// The rank.
        rank: u32,
        /// Control block, flags and signal words at the time of the check.
        state: String,
    },
    /// A proxy thread stopped with an error or panicked.
    #[error("rank {rank}: proxy failed: {what}")]
    Proxy {
        /// The rank.
        rank: u32,
        /// What happened.
        what: String,
    },
}

impl GpuError {
    pub(crate) fn cuda(rank: Option<u32>, phase: Phase) -> impl FnOnce(CudaError) -> GpuError {
        move |source| GpuError::Cuda {
            rank,
            phase,
            source,
        }
    }
}

/// N ranks on one GPU with a proxy thread each: [`EngineGroup`] or
/// [`LocalGroup`]. Launch each rank's kernels on its own stream in step
/// order; the group's proxies do the rest.
pub trait ProxyGroup: Send + Sync {
    /// Rank `r`'s GPU state (for launching its kernels and reading results).
    fn rank(&self, r: u32) -> Option<&Arc<GpuRank>>;
    /// Takes the timestamps rank `r`'s proxy recorded so far.
    fn take_times(&self, r: u32) -> Vec<ProxyTimes>;
    /// Whether every proxy is still running (a stopped one failed).
    fn healthy(&self) -> bool;
    /// Stops the proxies and returns the first error one of them hit.
    fn shutdown(self: Box<Self>) -> Result<(), GpuError>;
}

/// Bytes of the control block (see the kernels' source).
const CTL_BYTES: usize = 64;

/// One rank's GPU state: inputs, send/recv buffers, the host-mapped route
/// buffer (N rows of E little-endian u32), the outputs, and the signal
/// words and flags. Several ranks can live on one GPU.
pub struct GpuRank {
    pub(crate) dims: Dims,
    pub(crate) rank: u32,
    pub(crate) tokens: DeviceBuffer,
    pub(crate) ids: DeviceBuffer,
    pub(crate) weights: DeviceBuffer,
    pub(crate) ctl: DeviceBuffer,
    pub(crate) slots: DeviceBuffer,
    pub(crate) row_dev: DeviceBuffer,
    pub(crate) cnt_dev: DeviceBuffer,
    pub(crate) send: Arc<DeviceBuffer>,
    pub(crate) recv: Arc<DeviceBuffer>,
    pub(crate) out_tokens: DeviceBuffer,
    pub(crate) offsets: DeviceBuffer,
    pub(crate) src_rank: DeviceBuffer,
    pub(crate) src_pair: DeviceBuffer,
    pub(crate) expert_outputs: DeviceBuffer,
    pub(crate) combined: DeviceBuffer,
    pub(crate) route: MappedBuffer,
    pub(crate) sig_counted: WatchWord,
    pub(crate) sig_packed: WatchWord,
    pub(crate) sig_unpacked: WatchWord,
    pub(crate) sig_cpacked: WatchWord,
    pub(crate) sig_summed: WatchWord,
    pub(crate) dispatch_ready: HostFlag,
    pub(crate) combine_ready: HostFlag,
}

impl std::fmt::Debug for GpuRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRank")
            .field("rank", &self.rank)
            .field("ranks", &self.dims.ranks)
            .finish()
    }
}

fn usz(v: u64, rank: u32) -> Result<usize, GpuError> {
    usize::try_from(v)
        .map_err(|_| {
            GpuError::Moe(MoeError::Shape {
                what: "GPU buffer size",
                got: v,
                want: usize::MAX as u64,
            })
        })
        .map(|n| n.max(16))
        .inspect_err(|_| tracing::warn!(rank, v, "buffer too large"))
}

impl GpuRank {
    /// Allocates rank `rank`'s buffers on `gpu`: the send and receive
    /// buffers of [`Dims`], and outputs for the receive bound of N·T·R rows.
    /// `rank` is the protocol's rank: with masked ranks
    /// (`MoeConfig::masked`), the index among the active ranks
    /// ([`crate::RankMask::active_index`]), else the rank in the group.
    /// [`EngineRank::new`] takes the whole-group rank and maps it.
    pub fn new(gpu: &Gpu, dims: &Dims, rank: u32) -> Result<GpuRank, GpuError> {
        if rank >= dims.ranks {
            return Err(MoeError::NoSuchRank {
                rank,
                ranks: dims.ranks,
            }
            .into());
        }
        let pairs = dims.max_pairs();
        let rows = u64::from(dims.ranks) * pairs;
        let tb = u64::from(dims.token_bytes);
        let alloc = |len: u64| -> Result<DeviceBuffer, GpuError> {
            gpu.alloc(usz(len, rank)?)
                .map_err(GpuError::cuda(Some(rank), Phase::Setup))
        };
        let cu = GpuError::cuda(Some(rank), Phase::Setup);
        let word = || {
            gpu.watch_word()
                .map_err(GpuError::cuda(Some(rank), Phase::Setup))
        };
        let flag = || {
            gpu.host_flag()
                .map_err(GpuError::cuda(Some(rank), Phase::Setup))
        };
        Ok(GpuRank {
            tokens: alloc(u64::from(dims.max_tokens) * dims.in_row_bytes())?,
            ids: alloc(pairs * 4)?,
            weights: alloc(pairs * 4)?,
            ctl: alloc(CTL_BYTES as u64)?,
            slots: alloc(pairs * 4)?,
            row_dev: alloc(u64::from(dims.experts) * 4)?,
            cnt_dev: alloc(u64::from(dims.experts) * 4)?,
            send: Arc::new(alloc(dims.send_buf_len)?),
            recv: Arc::new(alloc(dims.recv_buf_len)?),
            out_tokens: alloc(rows * tb)?,
            offsets: alloc((u64::from(dims.local) + 1) * 4)?,
            src_rank: alloc(rows * 4)?,
            src_pair: alloc(rows * 4)?,
            expert_outputs: alloc(rows * dims.out_row_bytes())?,
            combined: alloc(u64::from(dims.max_tokens) * dims.out_row_bytes())?,
            route: MappedBuffer::new(gpu, usz(dims.route_buf_len(), rank)?).map_err(cu)?,
            sig_counted: word()?,
            sig_packed: word()?,
            sig_unpacked: word()?,
            sig_cpacked: word()?,
            sig_summed: word()?,
            dispatch_ready: flag()?,
            combine_ready: flag()?,
            dims: dims.clone(),
            rank,
        })
    }

    /// The protocol's rank (the index among the active ranks when some are
    /// masked).
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The rank in the whole group, masked ranks included.
    pub fn global_rank(&self) -> u32 {
        self.dims.mask.global_rank(self.rank)
    }

    /// The shape.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// Steps whose weighted sum has finished (steps count from 1).
    pub fn steps_done(&self) -> u64 {
        self.sig_summed.value()
    }

    /// The host-mapped route buffer (N rows of E little-endian u32): the
    /// count kernel writes row `rank`, the proxy the peers' rows.
    pub fn route_buffer(&self) -> &MappedBuffer {
        &self.route
    }

    /// The flag the dispatch-recv kernel waits on (raised to the step).
    pub fn dispatch_ready(&self) -> &HostFlag {
        &self.dispatch_ready
    }

    /// The flag the combine-recv kernel waits on (raised to the step).
    pub fn combine_ready(&self) -> &HostFlag {
        &self.combine_ready
    }

    fn cu(&self, phase: Phase) -> impl FnOnce(CudaError) -> GpuError {
        GpuError::cuda(Some(self.rank), phase)
    }

    /// Uploads the step's inputs (checked as on the CPU path; the kernels
    /// trust the ids). Synchronous; call it while no kernel of this rank
    /// runs. Returns T_r.
    pub fn set_inputs(&self, input: &RankInput<'_>) -> Result<u32, GpuError> {
        let mut active = Vec::new();
        let d = &self.dims;
        let input = if d.mask.is_empty() {
            *input
        } else {
            // Ids name the whole group's experts: renumbered for the active
            // group, a masked rank's expert dropped (as on the CPU path).
            d.mask
                .map_ids(d.local, d.topk, input.topk_ids, &mut active)?;
            RankInput {
                topk_ids: &active,
                ..*input
            }
        };
        let t = input.check(d)?;
        let ph = Phase::Setup;
        self.tokens.write(0, input.tokens).map_err(self.cu(ph))?;
        let ids: Vec<u8> = input
            .topk_ids
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        self.ids.write(0, &ids).map_err(self.cu(ph))?;
        let w: Vec<u8> = input
            .topk_weights
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        self.weights.write(0, &w).map_err(self.cu(ph))?;
        self.ctl
            .write(0, &u64::from(t).to_le_bytes())
            .map_err(self.cu(ph))?;
        Ok(t)
    }

    /// Replaces the step's top-k weights (`T_r · R`, token-major, as given
    /// to [`GpuRank::set_inputs`]) before the combine: DeepEP's API passes
    /// them to combine. Synchronous, and not ordered with the rank's
    /// stream: call it while no kernel of this rank runs (as
    /// [`GpuRank::set_inputs`]), after the dispatch and before the combine.
    /// f32 or bf16 ([`TopkWeights`]: bf16 is widened exactly to the f32 the
    /// kernels sum with).
    pub fn set_weights<'w>(&self, weights: impl Into<TopkWeights<'w>>) -> Result<(), GpuError> {
        let weights = weights.into();
        let mut scratch = Vec::new();
        let weights = weights.as_f32(&mut scratch);
        let mut b = [0u8; 8];
        self.ctl.read(0, &mut b).map_err(self.cu(Phase::Combine))?;
        let want = u64::from_le_bytes(b) * u64::from(self.dims.topk);
        if weights.len() as u64 != want {
            return Err(MoeError::Shape {
                what: "topk_weights",
                got: weights.len() as u64,
                want,
            }
            .into());
        }
        let w: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.weights.write(0, &w).map_err(self.cu(Phase::Combine))
    }

    /// Rows received by the last unpack (the expert layout's length).
    pub fn received_rows(&self) -> Result<u32, GpuError> {
        let mut b = [0u8; 4];
        let off = self.dims.local as usize * 4;
        self.offsets
            .read(off, &mut b)
            .map_err(self.cu(Phase::Dispatch))?;
        Ok(u32::from_le_bytes(b))
    }

    /// Uploads the expert outputs for the combine: one row of
    /// `hidden · size(out_dtype)` bytes per expert-layout row.
    pub fn set_expert_outputs(&self, y: &[u8]) -> Result<(), GpuError> {
        let want = u64::from(self.received_rows()?) * self.dims.out_row_bytes();
        if y.len() as u64 != want {
            return Err(MoeError::Shape {
                what: "expert outputs",
                got: y.len() as u64,
                want,
            }
            .into());
        }
        self.expert_outputs
            .write(0, y)
            .map_err(self.cu(Phase::Combine))
    }

    /// Reads the expert layout the last unpack produced. Source ranks are
    /// whole-group ranks (masked ranks included in the numbering).
    pub fn read_expert_tokens(&self) -> Result<ExpertTokens, GpuError> {
        let ph = Phase::Dispatch;
        let l = self.dims.local as usize;
        let mut ob = vec![0u8; (l + 1) * 4];
        self.offsets.read(0, &mut ob).map_err(self.cu(ph))?;
        let expert_offsets: Vec<u32> = ob
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let rows = expert_offsets.last().copied().unwrap_or(0) as usize;
        let mut data = vec![0u8; rows * self.dims.token_bytes as usize];
        self.out_tokens.read(0, &mut data).map_err(self.cu(ph))?;
        let read_u32s = |b: &DeviceBuffer| -> Result<Vec<u32>, GpuError> {
            let mut raw = vec![0u8; rows * 4];
            b.read(0, &mut raw).map_err(self.cu(ph))?;
            Ok(raw
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let (mut source_rank, source_pair) =
            (read_u32s(&self.src_rank)?, read_u32s(&self.src_pair)?);
        // Pair indices came from peers: checked as the CPU path checks them.
        let max = self.dims.max_pairs();
        if let Some((row, (&rank, &pair))) = source_rank
            .iter()
            .zip(&source_pair)
            .enumerate()
            .find(|(_, (_, &p))| u64::from(p) >= max)
        {
            let e = MoeError::BadOrigin {
                rank,
                row: row as u32,
                pair,
                max,
            };
            return Err(self.dims.mask.globalise(e).into());
        }
        self.dims.mask.globalise_ranks(&mut source_rank);
        Ok(ExpertTokens {
            data,
            token_bytes: self.dims.token_bytes,
            expert_offsets,
            source_rank,
            source_pair,
            topk: self.dims.topk,
            max_tokens: self.dims.max_tokens,
        })
    }

    /// Reads the combined tokens of the last step (`tokens` = T_r rows).
    pub fn read_combined(&self, tokens: u32) -> Result<Vec<u8>, GpuError> {
        let mut out = vec![0u8; tokens as usize * self.dims.out_row_bytes() as usize];
        self.combined
            .read(0, &mut out)
            .map_err(self.cu(Phase::BarrierC))?;
        Ok(out)
    }

    /// Fails with [`GpuError::KernelTimeout`] if a receive kernel of this
    /// rank gave up waiting for its flag.
    pub fn check_kernels(&self) -> Result<(), GpuError> {
        let mut b = [0u8; 8];
        self.ctl.read(16, &mut b).map_err(self.cu(Phase::Setup))?;
        if u64::from_le_bytes(b) != 0 {
            return Err(GpuError::KernelTimeout {
                rank: self.rank,
                state: self.state(),
            });
        }
        Ok(())
    }

    /// The control block (tokens, step, error bits, tickets), the flags and
    /// the signal words, for diagnostics.
    pub fn state(&self) -> String {
        let mut b = [0u8; CTL_BYTES];
        let ctl = match self.ctl.read(0, &mut b) {
            Ok(()) => format!(
                "{:?}",
                b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect::<Vec<_>>()
            ),
            Err(e) => format!("unreadable: {e}"),
        };
        format!(
            "ctl {ctl}, dispatch_ready {}, combine_ready {}, counted {}, packed {}, unpacked {}, combine_packed {}, summed {}",
            self.dispatch_ready.value(),
            self.combine_ready.value(),
            self.sig_counted.value(),
            self.sig_packed.value(),
            self.sig_unpacked.value(),
            self.sig_cpacked.value(),
            self.sig_summed.value()
        )
    }

    /// Marks every buffer as used by work enqueued now (graph capture).
    pub(crate) fn keep_alive(&self, stream: &Stream) {
        for b in [
            &self.tokens,
            &self.ids,
            &self.weights,
            &self.ctl,
            &self.slots,
            &self.row_dev,
            &self.cnt_dev,
            &*self.send,
            &*self.recv,
            &self.out_tokens,
            &self.offsets,
            &self.src_rank,
            &self.src_pair,
            &self.expert_outputs,
            &self.combined,
        ] {
            stream.keep_alive(b);
        }
        stream.keep_alive_mapped(&self.route);
    }
}
