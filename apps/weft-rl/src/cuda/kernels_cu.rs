//! CUDA C++ source of the weight-update kernels (compiled at run time with
//! NVRTC, no fast-math: IEEE division, no flush-to-zero).
//!
//! - `rl_copy_boxes`: a batch of strided 2-D bf16 box copies, one box per
//!   `blockIdx.y` (the unshard and the projection-fusion stages are both
//!   tables of such boxes, see `kernels.rs`); 16-byte vectors when a box's
//!   pointers and strides allow, 2-byte elements otherwise.
//! - `rl_quant_fp8_128`: bf16 → e4m3fn with one f32 scale per 128×128
//!   tile, one thread block per tile, the tile held in registers between
//!   the amax and the quantisation (needs `cols % 8 == 0` and aligned
//!   pointers; partial edge tiles are fine).
//! - `rl_quant_fp8`: the same for any tile edge and any shape (two passes
//!   over global memory).
//!
//! Both quantisers are the arithmetic of `crate::fp8::quantize_block`,
//! operation for operation: `amax` is `fmaxf` over `|x|` from `+0` (NaN
//! inputs ignored, as `f32::max` does), `scale = amax / 448` (IEEE
//! division; `1` when `amax` is not `> 0`), `q = e4m3(x / scale)` with the
//! same integer rounding code as `fp8::f32_to_e4m3` (`weft_e4m3` of
//! `weft_cuda::DTYPE_CU`, prepended; ties to even,
//! saturating to ±448, NaN → 0x7F).

/// The kernels' source.
pub const RL_CU: &str = r#"
typedef unsigned long long rl_u64;
typedef unsigned short rl_u16;
typedef unsigned char rl_u8;

#define RL_MAX_BOXES 16

struct RlBox {
    rl_u64 src;      // device address of the box's first element
    rl_u64 dst;      // device address of its first destination element
    rl_u64 src_ld;   // elements between source rows
    rl_u64 dst_ld;   // elements between destination rows
    rl_u64 rows;
    rl_u64 cols;
};

struct RlBoxTable {
    RlBox box[RL_MAX_BOXES];
};

extern "C" __global__ void rl_copy_boxes(RlBoxTable t) {
    const RlBox b = t.box[blockIdx.y];
    const rl_u64 tid = (rl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const rl_u64 stride = (rl_u64)gridDim.x * blockDim.x;
    const bool vec = ((b.src | b.dst) & 15) == 0 && (b.src_ld & 7) == 0
                     && (b.dst_ld & 7) == 0 && (b.cols & 7) == 0;
    if (vec) {
        const rl_u64 w = b.cols / 8, n = b.rows * w;
        for (rl_u64 i = tid; i < n; i += stride) {
            const rl_u64 r = i / w, c = i - r * w;
            const uint4* s = (const uint4*)(b.src + 2 * (r * b.src_ld + 8 * c));
            uint4* d = (uint4*)(b.dst + 2 * (r * b.dst_ld + 8 * c));
            *d = *s;
        }
    } else {
        const rl_u64 n = b.rows * b.cols;
        for (rl_u64 i = tid; i < n; i += stride) {
            const rl_u64 r = i / b.cols, c = i - r * b.cols;
            ((rl_u16*)b.dst)[r * b.dst_ld + c] = ((const rl_u16*)b.src)[r * b.src_ld + c];
        }
    }
}

__device__ __forceinline__ float rl_bf16(rl_u16 b) {
    return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ float rl_scale_of(float amax) {
    return amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
}

// Block-wide fmaxf; every thread gets the result. `sh` holds 32 floats.
__device__ __forceinline__ float rl_block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned nw = (blockDim.x + 31) / 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float m = 0.0f;
    for (unsigned w = 0; w < nw; w++) m = fmaxf(m, sh[w]);
    return m;
}

// 128x128 tiles, 256 threads: thread t covers 8 columns (one 16-byte
// vector) at column chunk t % 16 of rows t / 16 + 16 k, k = 0..7.
extern "C" __global__ void __launch_bounds__(256)
rl_quant_fp8_128(const rl_u16* __restrict__ src, rl_u64 rows, rl_u64 cols,
                 rl_u8* __restrict__ q, float* __restrict__ scales) {
    __shared__ float sh[32];
    const rl_u64 r0 = (rl_u64)blockIdx.y * 128, c0 = (rl_u64)blockIdx.x * 128;
    const rl_u64 c = c0 + 8 * (threadIdx.x % 16);
    const unsigned rr = threadIdx.x / 16;
    uint4 v[8];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const rl_u64 r = r0 + rr + 16 * k;
        if (r < rows && c < cols) {
            v[k] = *(const uint4*)(src + r * cols + c);
            const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                amax = fmaxf(amax, fabsf(rl_bf16((rl_u16)(w[j] & 0xFFFF))));
                amax = fmaxf(amax, fabsf(rl_bf16((rl_u16)(w[j] >> 16))));
            }
        }
    }
    amax = rl_block_max(amax, sh);
    const float scale = rl_scale_of(amax);
    if (threadIdx.x == 0) scales[blockIdx.y * gridDim.x + blockIdx.x] = scale;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const rl_u64 r = r0 + rr + 16 * k;
        if (r < rows && c < cols) {
            const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
            unsigned out[2] = {0, 0};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const unsigned lo = weft_e4m3(__fdiv_rn(rl_bf16((rl_u16)(w[j] & 0xFFFF)), scale));
                const unsigned hi = weft_e4m3(__fdiv_rn(rl_bf16((rl_u16)(w[j] >> 16)), scale));
                out[j / 2] |= (lo | (hi << 8)) << (16 * (j % 2));
            }
            *(uint2*)(q + r * cols + c) = make_uint2(out[0], out[1]);
        }
    }
}

// Any tile edge, any shape: block (x, y) quantises tile (y, x).
extern "C" __global__ void rl_quant_fp8(const rl_u16* __restrict__ src, rl_u64 rows,
                                        rl_u64 cols, rl_u64 block, rl_u8* __restrict__ q,
                                        float* __restrict__ scales) {
    __shared__ float sh[32];
    const rl_u64 r0 = (rl_u64)blockIdx.y * block, c0 = (rl_u64)blockIdx.x * block;
    const rl_u64 h = rows - r0 < block ? rows - r0 : block;
    const rl_u64 w = cols - c0 < block ? cols - c0 : block;
    float amax = 0.0f;
    for (rl_u64 i = threadIdx.x; i < h * w; i += blockDim.x) {
        const rl_u64 r = r0 + i / w, c = c0 + i % w;
        amax = fmaxf(amax, fabsf(rl_bf16(src[r * cols + c])));
    }
    amax = rl_block_max(amax, sh);
    const float scale = rl_scale_of(amax);
    if (threadIdx.x == 0) scales[blockIdx.y * gridDim.x + blockIdx.x] = scale;
    for (rl_u64 i = threadIdx.x; i < h * w; i += blockDim.x) {
        const rl_u64 r = r0 + i / w, c = c0 + i % w;
        q[r * cols + c] = weft_e4m3(__fdiv_rn(rl_bf16(src[r * cols + c]), scale));
    }
}
"#;
