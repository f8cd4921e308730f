//! [`Run`]s and [`Xfer`]s: contiguous or regularly strided byte ranges,
//! and copies between two of the same shape.

use crate::meta::Box2;

/// `count` pages of `page_len` bytes, page `i` at `offset + i * stride`.
/// Contiguous when `count == 1` or `stride == page_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// Byte offset of page 0.
    pub offset: u64,
    /// Bytes per page.
    pub page_len: u64,
    /// Distance between pages.
    pub stride: u64,
    /// Pages.
    pub count: u64,
}

impl Run {
    /// One contiguous range.
    pub fn contiguous(offset: u64, len: u64) -> Run {
        Run {
            offset,
            page_len: len,
            stride: len,
            count: 1,
        }
    }
    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.page_len * self.count
    }
    /// Whether one single write carries it.
    pub fn is_contiguous(&self) -> bool {
        self.count <= 1 || self.stride == self.page_len
    }
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        if self.count == 0 {
            self.offset
        } else {
            self.offset + (self.count - 1) * self.stride + self.page_len
        }
    }
}

/// A copy between a source run and a destination run of the same shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Xfer {
    /// Where the bytes come from.
    pub src: Run,
    /// Where they go.
    pub dst: Run,
}

impl Xfer {
    /// One `submit_single_write` (both sides contiguous); otherwise one
    /// `submit_paged_writes` of `dst.count` pages.
    pub fn is_single(&self) -> bool {
        self.src.is_contiguous() && self.dst.is_contiguous()
    }
}

/// A strided run over a 2-D row-major matrix of `width` elements of `elem`
/// bytes at byte `base`: the sub-box `b` whose top-left is `(r0, c0)`
/// relative to the matrix.
pub(crate) fn box_run(base: u64, width: u64, elem: u64, r0: u64, c0: u64, b: &Box2) -> Run {
    let h = b.height();
    let w = b.width();
    let contiguous = w == width || h == 1;
    let offset = base + ((b.rows.start - r0) * width + (b.cols.start - c0)) * elem;
    if contiguous {
        Run::contiguous(offset, h * w * elem)
    } else {
        Run {
            offset,
            page_len: w * elem,
            stride: width * elem,
            count: h,
        }
    }
}

/// A transfer between two runs of the same bytes: when one side is strided
/// and the other contiguous, the contiguous one is expressed as pages of the
/// same length (stride = page length), so both sides have one shape.
pub(crate) fn pair(src: Run, dst: Run) -> Xfer {
    let reshape = |r: Run, like: &Run| {
        if r.is_contiguous() && !like.is_contiguous() {
            Run {
                offset: r.offset,
                page_len: like.page_len,
                stride: like.page_len,
                count: like.count,
            }
        } else {
            r
        }
    };
    Xfer {
        src: reshape(src, &dst),
        dst: reshape(dst, &src),
    }
}
