//! The compiled MoE kernels and their launch wrappers. Every wrapper only
//! enqueues work on a stream (no host synchronisation), so a sequence of
//! them can be captured into a CUDA graph and replayed.

use super::kernels_cu::MOE_CU;
use super::{GpuError, GpuRank};
use crate::config::{DispatchFormat, OutDtype};
use crate::error::Phase;
use std::ffi::c_void;
use weft_cuda::{Function, Gpu, Module, Stream, DTYPE_CU, KERNELS_CU};

const THREADS: u32 = 256;
const COUNT_THREADS: u32 = 1024;

/// The MoE kernels (dispatch-send = count + pack, dispatch-recv = unpack,
/// combine-send = combine pack, combine-recv = weighted sum), compiled with
/// NVRTC for one GPU.
#[derive(Debug, Clone)]
pub struct MoeKernels {
    module: Module,
    count: Function,
    pack: Function,
    pack_fp8: Function,
    unpack: Function,
    cpack: Function,
    sum: Function,
    wait_routes: Function,
    wait: Function,
    /// How long a recv kernel waits for its flag before giving up (and
    /// setting the error bit the rank reports); 0 waits forever.
    pub timeout_ns: u64,
    /// Blocks of the unpack and combine-pack kernels.
    pub gather_blocks: u32,
    /// Blocks of the weighted-sum kernel.
    pub sum_blocks: u32,
}

fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl MoeKernels {
    /// Compiles the kernels for `gpu` (needs NVRTC).
    pub fn compile(gpu: &Gpu) -> Result<MoeKernels, GpuError> {
        let src = format!("{KERNELS_CU}\n{DTYPE_CU}\n{MOE_CU}");
        let names = [
            "moe_count",
            "moe_pack",
            "moe_pack_fp8",
            "moe_unpack",
            "moe_combine_pack",
            "moe_combine_sum",
            "moe_wait_routes",
            "moe_wait",
        ];
        let module = Module::compile(gpu, "weft-moe kernels", &src, &names)
            .map_err(GpuError::cuda(None, Phase::Setup))?;
        let f = |n| {
            module
                .function(n)
                .map_err(GpuError::cuda(None, Phase::Setup))
        };
        Ok(MoeKernels {
            count: f("moe_count")?,
            pack: f("moe_pack")?,
            pack_fp8: f("moe_pack_fp8")?,
            unpack: f("moe_unpack")?,
            cpack: f("moe_combine_pack")?,
            sum: f("moe_combine_sum")?,
            wait_routes: f("moe_wait_routes")?,
            wait: f("moe_wait")?,
            module,
            timeout_ns: 10_000_000_000,
            gather_blocks: 132,
            sum_blocks: 128,
        })
    }

    /// Launches `f` with `grid` blocks of `block` threads and `shared`
    /// bytes of dynamic shared memory.
    ///
    /// # Safety
    /// `params` match kernel `f`; the memory they reference belongs to `r`,
    /// which outlives the work (its buffers synchronise the device on drop;
    /// captured launches keep them alive through `keep_alive`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn go(
        &self,
        f: Function,
        r: &GpuRank,
        stream: &Stream,
        phase: Phase,
        grid: u32,
        block: u32,
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.module
                .launch(f, stream, (grid, 1, 1), (block, 1, 1), shared, params)
        }
        .map_err(GpuError::cuda(Some(r.rank), phase))?;
        r.keep_alive(stream);
        Ok(())
    }

    /// Dispatch-send: count the pairs (route row to host-mapped memory,
    /// `SIG_COUNTED`), then pack the tokens into send-order slots
    /// (`SIG_PACKED`).
    pub fn dispatch_send(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        self.dispatch_count(stream, r)?;
        self.dispatch_pack(stream, r)
    }

    /// The first half of dispatch-send: count, route row, slots,
    /// `SIG_COUNTED`.
    pub fn dispatch_count(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        let d = &r.dims;
        let (ids, ctl, slots, row_dev) = (
            r.ids.device_ptr(),
            r.ctl.device_ptr(),
            r.slots.device_ptr(),
            r.row_dev.device_ptr(),
        );
        let row_mapped = r.route.device_ptr() + u64::from(r.rank) * d.route_row_len();
        let (w, s) = (
            r.sig_counted.device_ptr(),
            r.sig_counted.shadow_device_ptr(),
        );
        let (rr, e) = (d.topk, d.experts);
        let shared = (2 * e + COUNT_THREADS) * 4;
        let mut p = [
            arg(&ids),
            arg(&ctl),
            arg(&rr),
            arg(&e),
            arg(&row_mapped),
            arg(&row_dev),
            arg(&slots),
            arg(&w),
            arg(&s),
        ];
        // SAFETY: matches `moe_count(const u32*, u64*, u32, u32, u32*, u32*,
        // u32*, u64*, u64*)`; the row lies inside the route buffer.
        unsafe {
            self.go(
                self.count,
                r,
                stream,
                Phase::Route,
                1,
                COUNT_THREADS,
                shared,
                &mut p,
            )
        }
    }

    /// The second half of dispatch-send: pack the tokens (quantised with
    /// fp8 dispatch), `SIG_PACKED`.
    pub fn dispatch_pack(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        let d = &r.dims;
        let (ctl, slots, rr) = (r.ctl.device_ptr(), r.slots.device_ptr(), d.topk);
        let (tok, send) = (r.tokens.device_ptr(), r.send.device_ptr());
        let (tb, b_in) = (u64::from(d.token_bytes), d.b_in);
        let (w, s) = (r.sig_packed.device_ptr(), r.sig_packed.shadow_device_ptr());
        let blocks = d.max_tokens.max(1);
        if let DispatchFormat::Fp8 { round_scale } = d.dispatch {
            let (h, rs) = (d.hidden, u32::from(round_scale));
            let mut p = [
                arg(&tok),
                arg(&ctl),
                arg(&slots),
                arg(&rr),
                arg(&h),
                arg(&rs),
                arg(&b_in),
                arg(&send),
                arg(&w),
                arg(&s),
            ];
            // SAFETY: matches `moe_pack_fp8(const u8*, u64*, const u32*,
            // u32, u32, u32, u64, u8*, u64*, u64*)`; the tokens buffer holds
            // T rows of 2·H bytes and slots < T·R of B_in ≥ H + H/32 + 4
            // bytes fit in the send buffer (Dims::validate checked H).
            return unsafe {
                self.go(
                    self.pack_fp8,
                    r,
                    stream,
                    Phase::Dispatch,
                    blocks,
                    THREADS,
                    0,
                    &mut p,
                )
            };
        }
        let mut p = [
            arg(&tok),
            arg(&ctl),
            arg(&slots),
            arg(&rr),
            arg(&tb),
            arg(&b_in),
            arg(&send),
            arg(&w),
            arg(&s),
        ];
        // SAFETY: matches `moe_pack(const u8*, u64*, const u32*, u32, u64,
        // u64, u8*, u64*, u64*)`; slots < T·R fit in the send buffer.
        unsafe {
            self.go(
                self.pack,
                r,
                stream,
                Phase::Dispatch,
                blocks,
                THREADS,
                0,
                &mut p,
            )
        }
    }

    fn plan_shared(r: &GpuRank) -> u32 {
        (4 * r.dims.experts + 2 + 3 * r.dims.ranks + THREADS) * 4
    }

    /// Dispatch-recv: a one-block kernel waits for `DISPATCH_READY` to reach
    /// the step and copies the route columns to device memory, then the
    /// gather kernel builds the expert layout (`SIG_UNPACKED`).
    pub fn dispatch_recv(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        let d = &r.dims;
        let (flag, ctl, route, cnt, row) = (
            r.dispatch_ready.device_ptr(),
            r.ctl.device_ptr(),
            r.route.device_ptr(),
            r.cnt_dev.device_ptr(),
            r.row_dev.device_ptr(),
        );
        let (n, e, rank, pp) = (d.ranks, d.experts, r.rank, d.private);
        let mut p = [
            arg(&flag),
            arg(&ctl),
            arg(&self.timeout_ns),
            arg(&route),
            arg(&cnt),
            arg(&n),
            arg(&e),
            arg(&rank),
        ];
        // SAFETY: matches `moe_wait_routes(const u64*, u64*, u64, const u32*,
        // u32*, u32, u32, u32)`; cnt_dev holds E = N·L u32.
        unsafe {
            self.go(
                self.wait_routes,
                r,
                stream,
                Phase::Dispatch,
                1,
                THREADS,
                0,
                &mut p,
            )?
        };
        let (tb, b_in, coff) = (u64::from(d.token_bytes), d.b_in, d.contig_offset());
        let (send, recv, out, offs, src, pair) = (
            r.send.device_ptr(),
            r.recv.device_ptr(),
            r.out_tokens.device_ptr(),
            r.offsets.device_ptr(),
            r.src_rank.device_ptr(),
            r.src_pair.device_ptr(),
        );
        let (w, s) = (
            r.sig_unpacked.device_ptr(),
            r.sig_unpacked.shadow_device_ptr(),
        );
        let mut p = [
            arg(&ctl),
            arg(&cnt),
            arg(&row),
            arg(&n),
            arg(&e),
            arg(&rank),
            arg(&pp),
            arg(&tb),
            arg(&b_in),
            arg(&coff),
            arg(&send),
            arg(&recv),
            arg(&out),
            arg(&offs),
            arg(&src),
            arg(&pair),
            arg(&w),
            arg(&s),
        ];
        // SAFETY: matches `moe_unpack`'s signature; output buffers hold the
        // receive bound N·T·R rows (GpuRank::new).
        unsafe {
            self.go(
                self.unpack,
                r,
                stream,
                Phase::Dispatch,
                self.gather_blocks.max(1),
                THREADS,
                Self::plan_shared(r),
                &mut p,
            )
        }
    }

    /// Combine-send: places the expert outputs (`GpuRank::expert_outputs`)
    /// into combine slots (`SIG_COMBINE_PACKED`).
    pub fn combine_send(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        let d = &r.dims;
        let (ctl, cnt, row) = (
            r.ctl.device_ptr(),
            r.cnt_dev.device_ptr(),
            r.row_dev.device_ptr(),
        );
        let (n, e, rank) = (d.ranks, d.experts, r.rank);
        let (ob, b_out) = (d.out_row_bytes(), d.b_out);
        let (y, send, recv) = (
            r.expert_outputs.device_ptr(),
            r.send.device_ptr(),
            r.recv.device_ptr(),
        );
        let (w, s) = (
            r.sig_cpacked.device_ptr(),
            r.sig_cpacked.shadow_device_ptr(),
        );
        let mut p = [
            arg(&ctl),
            arg(&cnt),
            arg(&row),
            arg(&n),
            arg(&e),
            arg(&rank),
            arg(&ob),
            arg(&b_out),
            arg(&y),
            arg(&send),
            arg(&recv),
            arg(&w),
            arg(&s),
        ];
        // SAFETY: matches `moe_combine_pack`'s signature.
        unsafe {
            self.go(
                self.cpack,
                r,
                stream,
                Phase::Combine,
                self.gather_blocks.max(1),
                THREADS,
                Self::plan_shared(r),
                &mut p,
            )
        }
    }

    /// Combine-recv: a one-block kernel waits for `COMBINE_READY`, then the
    /// weighted sum into `GpuRank::combined` (`SIG_SUMMED`).
    pub fn combine_recv(&self, stream: &Stream, r: &GpuRank) -> Result<(), GpuError> {
        let d = &r.dims;
        let (flag, ctl, slots, wts) = (
            r.combine_ready.device_ptr(),
            r.ctl.device_ptr(),
            r.slots.device_ptr(),
            r.weights.device_ptr(),
        );
        let mut p = [arg(&flag), arg(&ctl), arg(&self.timeout_ns)];
        // SAFETY: matches `moe_wait(const u64*, u64*, u64)`.
        unsafe { self.go(self.wait, r, stream, Phase::Combine, 1, 32, 0, &mut p)? };
        let (rr, hidden, b_out) = (d.topk, d.hidden, d.b_out);
        let dtype: u32 = match d.out_dtype {
            OutDtype::F32 => 0,
            OutDtype::Bf16 => 1,
        };
        let (recv, out) = (r.recv.device_ptr(), r.combined.device_ptr());
        let (w, s) = (r.sig_summed.device_ptr(), r.sig_summed.shadow_device_ptr());
        let mut p = [
            arg(&ctl),
            arg(&slots),
            arg(&wts),
            arg(&rr),
            arg(&hidden),
            arg(&dtype),
            arg(&b_out),
            arg(&recv),
            arg(&out),
            arg(&w),
            arg(&s),
        ];
        // SAFETY: matches `moe_combine_sum`'s signature; `combined` holds
        // T·hidden elements.
        unsafe {
            self.go(
                self.sum,
                r,
                stream,
                Phase::BarrierC,
                self.sum_blocks.max(1),
                THREADS,
                0,
                &mut p,
            )
        }
    }
}
