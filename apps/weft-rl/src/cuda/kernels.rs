//! [`RlKernels`]: the compiled unshard / fuse / quantise kernels and their
//! bounds-checked launch wrappers. Every wrapper only enqueues work on a
//! stream (no host synchronisation).

use std::ffi::c_void;

use weft_cuda::{DeviceBuffer, Function, Gpu, Module, Stream, DTYPE_CU};

use super::kernels_cu::RL_CU;
use super::GpuError;

/// Boxes one `rl_copy_boxes` launch takes (larger tables are split over
/// several launches).
pub const MAX_BOXES: usize = 16;
const THREADS: u32 = 256;
const MAX_COPY_BLOCKS: u64 = 1024;

/// A row-major bf16 matrix view inside a device buffer: `rows × cols`
/// elements, `ld` elements from one row to the next, the first element at
/// byte `offset`.
#[derive(Debug, Clone, Copy)]
pub struct DevMat<'a> {
    /// The buffer.
    pub buf: &'a DeviceBuffer,
    /// Byte offset of element `(0, 0)`.
    pub offset: usize,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// Leading dimension (elements between rows), `>= cols`.
    pub ld: u64,
}

impl<'a> DevMat<'a> {
    /// A dense `rows × cols` matrix at `offset` (`ld == cols`).
    pub fn dense(buf: &'a DeviceBuffer, offset: usize, rows: u64, cols: u64) -> DevMat<'a> {
        DevMat {
            buf,
            offset,
            rows,
            cols,
            ld: cols,
        }
    }

    /// The `rows × cols` sub-matrix starting at element `(r0, c0)`.
    pub fn sub(&self, r0: u64, c0: u64, rows: u64, cols: u64) -> Result<DevMat<'a>, GpuError> {
        if r0 + rows > self.rows || c0 + cols > self.cols {
            return Err(GpuError::Invalid(format!(
                "sub-matrix {rows}x{cols} at ({r0}, {c0}) outside a {}x{} view",
                self.rows, self.cols
            )));
        }
        Ok(DevMat {
            buf: self.buf,
            offset: self.offset + (2 * (r0 * self.ld + c0)) as usize,
            rows,
            cols,
            ld: self.ld,
        })
    }

    /// Device address of element `(0, 0)` after checking that every
    /// element lies inside the buffer.
    fn addr(&self) -> Result<u64, GpuError> {
        let bad = || {
            GpuError::Invalid(format!(
                "{}x{} view (ld {}) at byte {} outside a buffer of {} bytes",
                self.rows,
                self.cols,
                self.ld,
                self.offset,
                self.buf.len()
            ))
        };
        if self.ld < self.cols {
            return Err(bad());
        }
        let span = if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1)
                .checked_mul(self.ld)
                .and_then(|x| x.checked_add(self.cols))
                .and_then(|x| x.checked_mul(2))
                .ok_or_else(bad)?
        };
        let end = (self.offset as u64).checked_add(span).ok_or_else(bad)?;
        if end > self.buf.len() as u64 {
            return Err(bad());
        }
        Ok(self.buf.device_ptr() + self.offset as u64)
    }
}

/// One entry of the kernel's box table (layout of `struct RlBox`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawBox {
    src: u64,
    dst: u64,
    src_ld: u64,
    dst_ld: u64,
    rows: u64,
    cols: u64,
}

/// `struct RlBoxTable`, passed to the kernel by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawTable {
    boxes: [RawBox; MAX_BOXES],
}

/// The weight-update kernels, compiled with NVRTC for one GPU.
#[derive(Debug, Clone)]
pub struct RlKernels {
    module: Module,
    copy: Function,
    quant128: Function,
    quant: Function,
}

fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl RlKernels {
    /// Compiles the kernels for `gpu` (needs NVRTC).
    pub fn compile(gpu: &Gpu) -> Result<RlKernels, GpuError> {
        let names = ["rl_copy_boxes", "rl_quant_fp8_128", "rl_quant_fp8"];
        let src = format!("{DTYPE_CU}\n{RL_CU}");
        let module = Module::compile(gpu, "weft-rl kernels", &src, &names)
            .map_err(GpuError::cuda("compiling the weft-rl kernels"))?;
        let f = |n| module.function(n).map_err(GpuError::cuda("kernel lookup"));
        Ok(RlKernels {
            copy: f("rl_copy_boxes")?,
            quant128: f("rl_quant_fp8_128")?,
            quant: f("rl_quant_fp8")?,
            module,
        })
    }

    /// Copies every `(src, dst)` pair (same shape) with `rl_copy_boxes`,
    /// [`MAX_BOXES`] per launch.
    pub fn copy_boxes(
        &self,
        stream: &Stream,
        boxes: &[(DevMat<'_>, DevMat<'_>)],
    ) -> Result<(), GpuError> {
        let mut raw = Vec::with_capacity(boxes.len());
        for (s, d) in boxes {
            if s.rows != d.rows || s.cols != d.cols {
                return Err(GpuError::Invalid(format!(
                    "box copy {}x{} -> {}x{}",
                    s.rows, s.cols, d.rows, d.cols
                )));
            }
            if s.rows == 0 || s.cols == 0 {
                continue;
            }
            raw.push(RawBox {
                src: s.addr()?,
                dst: d.addr()?,
                src_ld: s.ld,
                dst_ld: d.ld,
                rows: s.rows,
                cols: s.cols,
            });
        }
        for chunk in raw.chunks(MAX_BOXES) {
            let mut t = RawTable {
                boxes: [RawBox::default(); MAX_BOXES],
            };
            t.boxes[..chunk.len()].copy_from_slice(chunk);
            let most = chunk.iter().map(|b| b.rows * b.cols).max().unwrap_or(1);
            let blocks = most
                .div_ceil(8 * u64::from(THREADS))
                .clamp(1, MAX_COPY_BLOCKS);
            let mut params = [arg(&t)];
            // SAFETY: `t` matches `RlBoxTable`; every box was checked to lie
            // inside its live device buffer, and the buffers synchronise
            // the device before they are freed.
            unsafe {
                self.module.launch(
                    self.copy,
                    stream,
                    (blocks as u32, chunk.len() as u32, 1),
                    (THREADS, 1, 1),
                    0,
                    &mut params,
                )
            }
            .map_err(GpuError::cuda("launching rl_copy_boxes"))?;
        }
        Ok(())
    }

    /// Unshard: assembles `dst` from `shards` that tile it in order along
    /// `dim` (0: each shard is a band of rows, 1: a band of columns); sizes
    /// may be uneven. One launch per [`MAX_BOXES`] shards.
    pub fn unshard(
        &self,
        stream: &Stream,
        dim: u8,
        shards: &[DevMat<'_>],
        dst: &DevMat<'_>,
    ) -> Result<(), GpuError> {
        let mut at = 0u64;
        let mut boxes = Vec::with_capacity(shards.len());
        for s in shards {
            let d = match dim {
                0 if s.cols == dst.cols => dst.sub(at, 0, s.rows, s.cols)?,
                1 if s.rows == dst.rows => dst.sub(0, at, s.rows, s.cols)?,
                _ => {
                    return Err(GpuError::Invalid(format!(
                        "shard {}x{} does not fit Shard({dim}) of a {}x{} tensor",
                        s.rows, s.cols, dst.rows, dst.cols
                    )))
                }
            };
            at += if dim == 0 { s.rows } else { s.cols };
            boxes.push((*s, d));
        }
        let ext = if dim == 0 { dst.rows } else { dst.cols };
        if at != ext {
            return Err(GpuError::Invalid(format!(
                "shards cover {at} of {ext} along dim {dim}"
            )));
        }
        self.copy_boxes(stream, &boxes)
    }

    /// Projection fusion: stacks `segments` (each a box of a full tensor,
    /// all as wide as `dst`) top to bottom into `dst`, as an
    /// [`crate::InferTensor`]'s segments are laid out.
    pub fn fuse(
        &self,
        stream: &Stream,
        segments: &[DevMat<'_>],
        dst: &DevMat<'_>,
    ) -> Result<(), GpuError> {
        let mut at = 0u64;
        let mut boxes = Vec::with_capacity(segments.len());
        for s in segments {
            if s.cols != dst.cols {
                return Err(GpuError::Invalid(format!(
                    "segment of width {} in a fused tensor of width {}",
                    s.cols, dst.cols
                )));
            }
            boxes.push((*s, dst.sub(at, 0, s.rows, s.cols)?));
            at += s.rows;
        }
        if at != dst.rows {
            return Err(GpuError::Invalid(format!(
                "segments fill {at} of {} rows",
                dst.rows
            )));
        }
        self.copy_boxes(stream, &boxes)
    }

    /// Copies each segment to its `(row, col)` corner of `dst` in one
    /// launch: an inference tensor's segments joined along either
    /// dimension ([`crate::meta::InferTensor::offsets`]). The segments must
    /// fill `dst`.
    pub fn fuse_at(
        &self,
        stream: &Stream,
        segments: &[(DevMat<'_>, (u64, u64))],
        dst: &DevMat<'_>,
    ) -> Result<(), GpuError> {
        let boxes = segments
            .iter()
            .map(|(s, (r0, c0))| Ok((*s, dst.sub(*r0, *c0, s.rows, s.cols)?)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        let filled: u64 = segments.iter().map(|(s, _)| s.rows * s.cols).sum();
        if filled != dst.rows * dst.cols {
            return Err(GpuError::Invalid(format!(
                "segments fill {filled} of {}x{} elements",
                dst.rows, dst.cols
            )));
        }
        self.copy_boxes(stream, &boxes)
    }

    /// Quantises the dense bf16 matrix `src` (`ld == cols`) into `q`
    /// (`rows*cols` e4m3 bytes at byte offset `q.1`) and `scales`
    /// (`ceil(rows/block) * ceil(cols/block)` f32, row-major, at byte
    /// offset `scales.1`), exactly as [`crate::fp8::quantize_block`] does.
    /// Uses the register-tiled kernel when `block == 128`, `cols % 8 == 0`
    /// and the addresses are aligned, else the generic one.
    pub fn quantize(
        &self,
        stream: &Stream,
        src: &DevMat<'_>,
        block: u64,
        q: (&DeviceBuffer, usize),
        scales: (&DeviceBuffer, usize),
    ) -> Result<(), GpuError> {
        self.quantize_with(stream, src, block, q, scales, false)
    }

    /// [`Self::quantize`] with the generic kernel always (any `block`, any
    /// shape); for tests and comparisons.
    pub fn quantize_generic(
        &self,
        stream: &Stream,
        src: &DevMat<'_>,
        block: u64,
        q: (&DeviceBuffer, usize),
        scales: (&DeviceBuffer, usize),
    ) -> Result<(), GpuError> {
        self.quantize_with(stream, src, block, q, scales, true)
    }

    fn quantize_with(
        &self,
        stream: &Stream,
        src: &DevMat<'_>,
        block: u64,
        q: (&DeviceBuffer, usize),
        scales: (&DeviceBuffer, usize),
        generic: bool,
    ) -> Result<(), GpuError> {
        let (rows, cols) = (src.rows, src.cols);
        if block == 0 || src.ld != cols {
            return Err(GpuError::Invalid(format!(
                "quantise: block {block}, ld {} of a {rows}x{cols} matrix (must be dense)",
                src.ld
            )));
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let (br, bc) = (rows.div_ceil(block), cols.div_ceil(block));
        if br > 65_535 || bc > u64::from(u32::MAX) {
            return Err(GpuError::Invalid(format!(
                "quantise: {br}x{bc} tiles exceed the launch grid"
            )));
        }
        let inside = |b: &DeviceBuffer, off: usize, len: u64, what: &str| {
            if (off as u64)
                .checked_add(len)
                .is_some_and(|e| e <= b.len() as u64)
            {
                Ok(b.device_ptr() + off as u64)
            } else {
                Err(GpuError::Invalid(format!(
                    "quantise: {what} ({len} bytes at {off}) outside a buffer of {} bytes",
                    b.len()
                )))
            }
        };
        let s = src.addr()?;
        let qp = inside(q.0, q.1, rows * cols, "fp8 output")?;
        let sp = inside(scales.0, scales.1, 4 * br * bc, "scales")?;
        if sp % 4 != 0 {
            return Err(GpuError::Invalid(format!(
                "quantise: scales at {sp:#x} not 4-byte aligned"
            )));
        }
        let fast = !generic && block == 128 && cols % 8 == 0 && s % 16 == 0 && qp % 8 == 0;
        let grid = (bc as u32, br as u32, 1);
        let r = if fast {
            let mut p = [arg(&s), arg(&rows), arg(&cols), arg(&qp), arg(&sp)];
            // SAFETY: `p` matches `rl_quant_fp8_128(src, rows, cols, q,
            // scales)`; every range the kernel touches was checked to lie
            // inside its live buffer (alignment too), and the buffers
            // synchronise the device before they are freed.
            unsafe {
                self.module
                    .launch(self.quant128, stream, grid, (256, 1, 1), 0, &mut p)
            }
        } else {
            let mut p = [
                arg(&s),
                arg(&rows),
                arg(&cols),
                arg(&block),
                arg(&qp),
                arg(&sp),
            ];
            // SAFETY: `p` matches `rl_quant_fp8(src, rows, cols, block, q,
            // scales)`; ranges checked as above.
            unsafe {
                self.module
                    .launch(self.quant, stream, grid, (256, 1, 1), 0, &mut p)
            }
        };
        r.map_err(GpuError::cuda("launching the fp8 quantisation"))
    }
}
