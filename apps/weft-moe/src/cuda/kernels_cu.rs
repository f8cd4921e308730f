//! CUDA C++ source of the MoE kernels (compiled at run time with NVRTC,
//! after `weft_cuda::KERNELS_CU` and `weft_cuda::DTYPE_CU`, whose device
//! functions it uses).
//!
//! Every kernel reads its step-dependent values (token count, step number)
//! from the rank's device-side control block, so a launch sequence can be
//! captured into a CUDA graph and replayed. Control block (`ctl`, u64s):
//! `[0]` tokens this step (T_r), `[1]` step number (the count kernel adds
//! one), `[2]` error bits (1: a recv kernel timed out waiting for its flag),
//! `[3..8]` completion tickets of the multi-block kernels.
//!
//! The formulas are those of `plan.rs`, `routes.rs` and `pack.rs`; the
//! weighted sum is `__fmaf_rn` in k order from +0 and bf16
//! round-to-nearest-even, which is bit-identical to `pack::weighted_sum`.

/// The MoE kernels' source (without the `KERNELS_CU` prefix).
pub const MOE_CU: &str = r#"
typedef unsigned int moe_u32;

#define MOE_CTL_TOKENS 0
#define MOE_CTL_STEP 1
#define MOE_CTL_ERR 2
#define MOE_TICKET_PACK 3
#define MOE_TICKET_UNPACK 4
#define MOE_TICKET_CPACK 5
#define MOE_TICKET_SUM 6

// Copies `bytes` bytes, element idx, idx+stride, ... (16-byte vectors when
// everything is 16-aligned, bytes otherwise). Vectors go in batches of 8
// loads before 8 stores, so a lane has 8 loads in flight instead of one.
__device__ __forceinline__ void moe_copy(unsigned char* __restrict__ dst,
                                         const unsigned char* __restrict__ src,
                                         weft_u64 bytes, unsigned idx, unsigned stride) {
    if ((((weft_u64)dst | (weft_u64)src | bytes) & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        weft_u64 n = bytes / 16, i = idx;
        for (; i + 7 * (weft_u64)stride < n; i += 8 * (weft_u64)stride) {
            uint4 v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = s[i + j * stride];
#pragma unroll
            for (int j = 0; j < 8; j++) d[i + j * stride] = v[j];
        }
        for (; i < n; i += stride) d[i] = s[i];
    } else {
        for (weft_u64 i = idx; i < bytes; i += stride) dst[i] = src[i];
    }
}

// Exclusive prefix sum of in[0..n) into out[0..n) (distinct arrays, shared
// or global), using part[blockDim.x] of shared scratch. All threads call it.
__device__ void moe_block_scan(const moe_u32* in, moe_u32* out, unsigned n, moe_u32* part) {
    unsigned tid = threadIdx.x, bd = blockDim.x;
    unsigned per = (n + bd - 1) / bd;
    unsigned lo = min(tid * per, n), hi = min(lo + per, n);
    moe_u32 s = 0;
    for (unsigned i = lo; i < hi; i++) s += in[i];
    part[tid] = s;
    __syncthreads();
    for (unsigned off = 1; off < bd; off <<= 1) {
        moe_u32 v = tid >= off ? part[tid - off] : 0;
        __syncthreads();
        part[tid] += v;
        __syncthreads();
    }
    moe_u32 acc = tid > 0 ? part[tid - 1] : 0;
    for (unsigned i = lo; i < hi; i++) { moe_u32 c = in[i]; out[i] = acc; acc += c; }
    __syncthreads();
}

// Last block to arrive (ticket in device memory, reset for the next launch)
// bumps the watch word. Every thread's writes are fenced at system scope
// first, so the host (and copy engines) see them once they see the bump.
__device__ void moe_finish(weft_u64* ticket, weft_u64* sig, weft_u64* shadow) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        weft_u64 prev = atomicAdd(ticket, 1ull);
        if (prev == gridDim.x - 1) {
            *ticket = 0;
            __threadfence_system();
            weft_bump(sig, shadow, 1);
        }
    }
}

// dispatch-send, part 1 (one block): counts pairs per expert in shared
// memory, writes the route row to host-mapped memory (and a device copy),
// gives every pair its send-order slot (expert, then t, then k: a stable
// counting sort, no atomics order involved), advances the step, signals.
// Shared: 2·E + blockDim u32.
extern "C" __global__ void moe_count(const moe_u32* ids, weft_u64* ctl, unsigned R, unsigned E,
                                     moe_u32* row_mapped, moe_u32* row_dev, moe_u32* slots,
                                     weft_u64* sig, weft_u64* shadow) {
    extern __shared__ moe_u32 sh[];
    moe_u32* cnt = sh;
    moe_u32* cur = sh + E;
    moe_u32* part = sh + 2 * E;
    unsigned tid = threadIdx.x, bd = blockDim.x;
    unsigned n = (unsigned)ctl[MOE_CTL_TOKENS] * R;
    for (unsigned e = tid; e < E; e += bd) cnt[e] = 0;
    __syncthreads();
    // An id of 0xffffffff (no expert) is neither counted nor given a slot.
    for (unsigned i = tid; i < n; i += bd) {
        if (ids[i] != 0xffffffffu) atomicAdd(&cnt[ids[i]], 1u);
    }
    __syncthreads();
    moe_block_scan(cnt, cur, E, part);
    for (unsigned e = tid; e < E; e += bd) { row_mapped[e] = cnt[e]; row_dev[e] = cnt[e]; }
    // Stable ranks inside a chunk of blockDim pairs: lanes of a warp with
    // the same id find each other with __match_any_sync (rank = earlier
    // lanes in the group); warps take turns in index order, and the lowest
    // lane of each group advances the expert's cursor. blockDim is a
    // multiple of 32.
    unsigned lane = tid & 31, warp = tid >> 5, nwarps = bd >> 5;
    for (unsigned base = 0; base < n; base += bd) {
        unsigned i = base + tid;
        moe_u32 id = i < n ? ids[i] : 0xffffffffu;
        unsigned mask = __match_any_sync(0xffffffffu, id);
        unsigned before = __popc(mask & ((1u << lane) - 1u));
        unsigned leader = __ffs(mask) - 1;
        for (unsigned w = 0; w < nwarps && base + w * 32 < n; w++) {
            if (warp == w) {
                bool some = i < n && id != 0xffffffffu;
                moe_u32 slot = some ? cur[id] + before : 0xffffffffu;
                __syncwarp();
                if (some && lane == leader) cur[id] += __popc(mask);
                if (i < n) slots[i] = slot;
            }
            __syncthreads();
        }
    }
    if (tid == 0) ctl[MOE_CTL_STEP] += 1;
    __threadfence_system();
    __syncthreads();
    if (tid == 0) weft_bump(sig, shadow, 1);
}

// dispatch-send, part 2 (grid: one block per token slot 0..T): copies token
// t into the send-order slots of its R pairs, each followed by its pair
// index t·R + k (little-endian u32, the row's origin); the last block
// signals.
extern "C" __global__ void moe_pack(const unsigned char* tokens, weft_u64* ctl, const moe_u32* slots,
                                    unsigned R, weft_u64 tb, weft_u64 b_in, unsigned char* send,
                                    weft_u64* sig, weft_u64* shadow) {
    unsigned t = blockIdx.x;
    if (t < (unsigned)ctl[MOE_CTL_TOKENS]) {
        const unsigned char* src = tokens + (weft_u64)t * tb;
        for (unsigned k = 0; k < R; k++) {
            moe_u32 s = slots[t * R + k];
            if (s == 0xffffffffu) continue;
            unsigned char* dst = send + (weft_u64)s * b_in;
            moe_copy(dst, src, tb, threadIdx.x, blockDim.x);
            if (threadIdx.x < 4) dst[tb + threadIdx.x] = (unsigned char)((t * R + k) >> (8 * threadIdx.x));
        }
    }
    moe_finish(&ctl[MOE_TICKET_PACK], sig, shadow);
}

// quant.rs's arithmetic, operation for operation (no contraction: the
// __f*_rn intrinsics), for fp8 dispatch.
__device__ __forceinline__ float moe_nanmax(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

// quant::pow2_ceil.
__device__ __forceinline__ float moe_pow2_ceil(float s) {
    if (!(s > 0.0f) || isinf(s)) return s;
    const unsigned b = __float_as_uint(s), e = (b >> 23) & 0xff, m = b & 0x7fffff;
    if (e == 0) {
        unsigned p = 1;
        while (p < m) p <<= 1;
        return __uint_as_float(p);
    }
    if (m == 0) return s;
    if (e >= 254) return __int_as_float(0x7f800000);
    return __uint_as_float((e + 1) << 23);
}

// f32::clamp(-448, 448): NaN stays NaN.
__device__ __forceinline__ float moe_clamp448(float y) {
    return y != y ? y : (y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y));
}

// fp8 dispatch-send, part 2 (grid: one block per token slot 0..T, whole
// warps): quantises bf16 token t (H = 128·G values) per 128 columns, one
// warp per group, and writes the H e4m3 bytes and G f32 scales into the
// send-order slots of its R pairs, each followed by its pair index; the
// last block signals.
extern "C" __global__ void moe_pack_fp8(const unsigned char* tokens, weft_u64* ctl,
                                        const moe_u32* slots, unsigned R, unsigned H,
                                        unsigned round_scale, weft_u64 b_in, unsigned char* send,
                                        weft_u64* sig, weft_u64* shadow) {
    unsigned t = blockIdx.x;
    if (t < (unsigned)ctl[MOE_CTL_TOKENS]) {
        const unsigned short* x = (const unsigned short*)(tokens + (weft_u64)t * 2 * H);
        const unsigned lane = threadIdx.x & 31, warps = blockDim.x >> 5;
        const float inv448 = (float)(1.0 / 448.0);
        for (unsigned g = threadIdx.x >> 5; g < H / 128; g += warps) {
            // Lane l: columns 4l .. 4l + 3 of the group (one 8-byte load,
            // one 4-byte store per slot).
            const uint2 w = *(const uint2*)(x + g * 128 + 4 * lane);
            float v[4] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                          __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u)};
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) amax = moe_nanmax(amax, fabsf(v[j]));
            for (int o = 16; o > 0; o >>= 1)
                amax = moe_nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            if (!(amax != amax) && amax < 1e-4f) amax = 1e-4f;
            // quant::CANONICAL_NAN for a group holding a NaN.
            float scale = amax != amax ? __int_as_float(0x7fc00000) : __fmul_rn(amax, inv448);
            unsigned q = 0;
            if (round_scale) {
                scale = moe_pow2_ceil(scale);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    q |= (unsigned)weft_e4m3(moe_clamp448(__fdiv_rn(v[j], scale))) << (8 * j);
            } else {
                const float mul = __fdiv_rn(448.0f, amax);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    q |= (unsigned)weft_e4m3(moe_clamp448(__fmul_rn(v[j], mul))) << (8 * j);
            }
            // Slots start 16-aligned (B_in is a multiple of 16), and so do
            // the groups (H is a multiple of 128).
            for (unsigned k = 0; k < R; k++) {
                moe_u32 s = slots[t * R + k];
                if (s == 0xffffffffu) continue;
                unsigned char* dst = send + (weft_u64)s * b_in;
                *(unsigned*)(dst + g * 128 + 4 * lane) = q;
                if (lane == 0) *(float*)(dst + H + 4 * g) = scale;
            }
        }
        const weft_u64 tb = (weft_u64)H + H / 32;
        for (unsigned k = 0; k < R; k++) {
            moe_u32 s = slots[t * R + k];
            if (s == 0xffffffffu) continue;
            unsigned char* dst = send + (weft_u64)s * b_in;
            if (threadIdx.x < 4) dst[tb + threadIdx.x] = (unsigned char)((t * R + k) >> (8 * threadIdx.x));
        }
    }
    moe_finish(&ctl[MOE_TICKET_PACK], sig, shadow);
}

// The receive-side plan of rank r in shared memory, from the N×L counts of
// its local experts (cnt[s·L + l] = n(s → r·L + l)) and its own route row:
// run[l·N + s] = first output row of (expert l, source s) (E + 1 entries),
// i0[s·L + l] = index of that run inside s's segment for r, nsr[s] = n(s→r),
// offs[s] = off(s→r) (overflow start), cst[s] = cstart(s) (combine send
// start), *seg = seg(r) of the own row. Shared layout (u32):
// cnt E | i0 E | tmp E | run E+1 | nsr N | offs N | cst N | seg 1 | part blockDim.
struct MoePlan {
    moe_u32 *cnt, *i0, *run, *nsr, *offs, *cst, *seg;
};

__device__ MoePlan moe_plan(moe_u32* sh, const moe_u32* cnt_src, weft_u64 src_stride,
                            const moe_u32* row_dev, unsigned N, unsigned E, unsigned L,
                            unsigned rank, unsigned P) {
    MoePlan p;
    p.cnt = sh; p.i0 = sh + E;
    moe_u32* tmp = sh + 2 * E;
    p.run = sh + 3 * E; p.nsr = p.run + E + 1; p.offs = p.nsr + N; p.cst = p.offs + N;
    p.seg = p.cst + N;
    moe_u32* part = p.seg + 1;
    unsigned tid = threadIdx.x, bd = blockDim.x;
    if (tid == 0) *p.seg = 0;
    for (unsigned x = tid; x < N * L; x += bd) {
        unsigned s = x / L, l = x % L;
        p.cnt[x] = cnt_src[(weft_u64)s * src_stride + l];
    }
    __syncthreads();
    moe_u32 own = 0;
    for (unsigned e = tid; e < rank * L; e += bd) own += row_dev[e];
    if (own) atomicAdd(p.seg, own);
    for (unsigned s = tid; s < N; s += bd) {
        moe_u32 acc = 0;
        for (unsigned l = 0; l < L; l++) { p.i0[s * L + l] = acc; acc += p.cnt[s * L + l]; }
        p.nsr[s] = acc;
    }
    for (unsigned x = tid; x < N * L; x += bd) {
        unsigned l = x / N, s = x % N;
        tmp[x] = p.cnt[s * L + l];
    }
    __syncthreads();
    if (tid == 0) {
        moe_u32 o = 0, c = 0;
        for (unsigned s = 0; s < N; s++) {
            p.offs[s] = o; p.cst[s] = c;
            if (s == rank) continue;
            o += p.nsr[s] > P ? p.nsr[s] - P : 0;
            c += p.nsr[s];
        }
    }
    moe_block_scan(tmp, p.run, N * L, part);
    if (tid == 0) p.run[N * L] = p.run[N * L - 1] + tmp[N * L - 1];
    __syncthreads();
    return p;
}

// Run index x of output row o: the last x with run[x] <= o (runs may be empty).
__device__ __forceinline__ unsigned moe_find_run(const moe_u32* run, unsigned runs, moe_u32 o) {
    unsigned lo = 0, hi = runs;  // run[lo] <= o < run[hi]
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (run[mid] <= o) lo = mid; else hi = mid;
    }
    return lo;
}

// Wait kernel before dispatch-recv (one block): spins until the proxy
// raised `flag` to this step, then copies the local columns of the
// host-mapped route matrix into device memory (cnt_dev[s·L + l]), so the
// gather kernel's blocks never read across PCIe and only one block spins.
extern "C" __global__ void moe_wait_routes(const weft_u64* flag, weft_u64* ctl, weft_u64 timeout_ns,
                                           const moe_u32* route, moe_u32* cnt_dev, unsigned N,
                                           unsigned E, unsigned rank) {
    unsigned L = E / N;
    if (!weft_block_wait_flag(flag, ctl[MOE_CTL_STEP], timeout_ns)) {
        if (threadIdx.x == 0) atomicOr(&ctl[MOE_CTL_ERR], 1ull);
        return;
    }
    for (unsigned x = threadIdx.x; x < N * L; x += blockDim.x) {
        unsigned s = x / L, l = x % L;
        cnt_dev[x] = route[(weft_u64)s * E + rank * L + l];
    }
}

// Wait kernel before combine-recv (one block).
extern "C" __global__ void moe_wait(const weft_u64* flag, weft_u64* ctl, weft_u64 timeout_ns) {
    if (!weft_block_wait_flag(flag, ctl[MOE_CTL_STEP], timeout_ns)) {
        if (threadIdx.x == 0) atomicOr(&ctl[MOE_CTL_ERR], 1ull);
    }
}

// dispatch-recv (after moe_wait_routes): gathers every received row into
// the expert layout (out, token_bytes per row), writes the expert offsets
// (L + 1), source ranks and source pair indices, signals.
extern "C" __global__ void moe_unpack(weft_u64* ctl, const moe_u32* cnt_dev, const moe_u32* row_dev,
                                      unsigned N, unsigned E, unsigned rank, unsigned P,
                                      weft_u64 tb, weft_u64 b_in, weft_u64 contig_off,
                                      const unsigned char* send, const unsigned char* recv,
                                      unsigned char* out, moe_u32* offsets, moe_u32* src_rank,
                                      moe_u32* src_pair, weft_u64* sig, weft_u64* shadow) {
    extern __shared__ moe_u32 sh[];
    unsigned L = E / N;
    MoePlan p = moe_plan(sh, cnt_dev, L, row_dev, N, E, L, rank, P);
    if (blockIdx.x == 0) {
        for (unsigned l = threadIdx.x; l <= L; l += blockDim.x) offsets[l] = p.run[l * N];
    }
    unsigned lane = threadIdx.x & 31, warps = blockDim.x / 32;
    moe_u32 total = p.run[N * L];
    for (moe_u32 o = blockIdx.x * warps + threadIdx.x / 32; o < total; o += gridDim.x * warps) {
        unsigned x = moe_find_run(p.run, N * L, o);
        unsigned l = x / N, s = x % N;
        moe_u32 i = p.i0[s * L + l] + (o - p.run[x]);
        const unsigned char* src;
        if (s == rank) src = send + (weft_u64)(*p.seg + i) * b_in;
        else if (i < P) src = recv + (weft_u64)(s * P + i) * b_in;
        else src = recv + contig_off + (weft_u64)(p.offs[s] + i - P) * b_in;
        moe_copy(out + (weft_u64)o * tb, src, tb, lane, 32);
        if (lane == 0) {
            src_rank[o] = s;
            src_pair[o] = (moe_u32)src[tb] | ((moe_u32)src[tb + 1] << 8) |
                          ((moe_u32)src[tb + 2] << 16) | ((moe_u32)src[tb + 3] << 24);
        }
    }
    moe_finish(&ctl[MOE_TICKET_UNPACK], sig, shadow);
}

// combine-send: expert-layout row o of source s goes to send slot
// cstart(s) + i (s remote) or to the own combine slot seg(r) + i of recv.
extern "C" __global__ void moe_combine_pack(weft_u64* ctl, const moe_u32* cnt_dev,
                                            const moe_u32* row_dev, unsigned N, unsigned E,
                                            unsigned rank, weft_u64 ob, weft_u64 b_out,
                                            const unsigned char* y, unsigned char* send,
                                            unsigned char* recv, weft_u64* sig, weft_u64* shadow) {
    extern __shared__ moe_u32 sh[];
    unsigned L = E / N;
    MoePlan p = moe_plan(sh, cnt_dev, L, row_dev, N, E, L, rank, 0);
    unsigned lane = threadIdx.x & 31, warps = blockDim.x / 32;
    moe_u32 total = p.run[N * L];
    for (moe_u32 o = blockIdx.x * warps + threadIdx.x / 32; o < total; o += gridDim.x * warps) {
        unsigned x = moe_find_run(p.run, N * L, o);
        unsigned l = x / N, s = x % N;
        moe_u32 i = p.i0[s * L + l] + (o - p.run[x]);
        unsigned char* dst = s == rank ? recv + (weft_u64)(*p.seg + i) * b_out
                                       : send + (weft_u64)(p.cst[s] + i) * b_out;
        moe_copy(dst, y + (weft_u64)o * ob, ob, lane, 32);
    }
    moe_finish(&ctl[MOE_TICKET_CPACK], sig, shadow);
}

__device__ __forceinline__ unsigned short moe_f32_to_bf16(float x) {
    unsigned bits = __float_as_uint(x);
    if (x != x) return (unsigned short)((bits >> 16) | 0x0040);
    unsigned round = 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)((bits + round) >> 16);
}

// combine-recv (after moe_wait; blocks stride over the tokens):
// out[t] = Σ_k w[t,k]·y(slot(t,k)) with __fmaf_rn in k order from +0,
// stored as f32 (dtype 0) or bf16 round-to-nearest-even (dtype 1). Rows are
// read 16 bytes at a time when aligned, with all R loads issued before the
// multiply-adds (R <= MOE_MAX_R on that path).
#define MOE_MAX_R 16
__device__ __forceinline__ float moe_elem(const unsigned char* row, unsigned h, unsigned dtype) {
    return dtype == 0 ? ((const float*)row)[h]
                      : __uint_as_float(((unsigned)((const unsigned short*)row)[h]) << 16);
}

__device__ __forceinline__ void moe_store(unsigned char* out, weft_u64 idx, float acc, unsigned dtype) {
    if (dtype == 0) ((float*)out)[idx] = acc;
    else ((unsigned short*)out)[idx] = moe_f32_to_bf16(acc);
}

extern "C" __global__ void moe_combine_sum(weft_u64* ctl, const moe_u32* slots,
                                           const float* weights, unsigned R, unsigned hidden,
                                           unsigned dtype, weft_u64 b_out,
                                           const unsigned char* recv, unsigned char* out,
                                           weft_u64* sig, weft_u64* shadow) {
    unsigned ntok = (unsigned)ctl[MOE_CTL_TOKENS];
    unsigned esz = dtype == 0 ? 4 : 2, per = 16 / esz;
    bool vec = R <= MOE_MAX_R && (hidden * esz) % 16 == 0 && b_out % 16 == 0;
    for (unsigned t = blockIdx.x; t < ntok; t += gridDim.x) {
        if (vec) {
            // Pairs without an expert are skipped (not weighted by zero:
            // 0 · NaN and -0 + 0 would change the sum's bits).
            const unsigned char* rows[MOE_MAX_R];
            float w[MOE_MAX_R];
            unsigned m = 0;
            for (unsigned k = 0; k < R; k++) {
                moe_u32 s = slots[t * R + k];
                if (s == 0xffffffffu) continue;
                rows[m] = recv + (weft_u64)s * b_out;
                w[m] = weights[t * R + k];
                m++;
            }
            unsigned nv = hidden / per;
            for (unsigned v = threadIdx.x; v < nv; v += blockDim.x) {
                uint4 x[MOE_MAX_R];
#pragma unroll
                for (unsigned k = 0; k < MOE_MAX_R; k++) {
                    if (k < m) x[k] = ((const uint4*)rows[k])[v];
                }
                float acc[8];
#pragma unroll
                for (unsigned j = 0; j < 8; j++) acc[j] = 0.0f;
#pragma unroll
                for (unsigned k = 0; k < MOE_MAX_R; k++) {
                    if (k < m) {
                        const unsigned char* b = (const unsigned char*)&x[k];
#pragma unroll
                        for (unsigned j = 0; j < 8; j++) {
                            if (j < per) acc[j] = __fmaf_rn(w[k], moe_elem(b, j, dtype), acc[j]);
                        }
                    }
                }
                uint4 o;
                unsigned* ow = (unsigned*)&o;
#pragma unroll
                for (unsigned j = 0; j < 4; j++) {
                    ow[j] = dtype == 0 ? __float_as_uint(acc[j])
                                       : (unsigned)moe_f32_to_bf16(acc[2 * j]) |
                                             ((unsigned)moe_f32_to_bf16(acc[2 * j + 1]) << 16);
                }
                ((uint4*)(out + (weft_u64)t * hidden * esz))[v] = o;
            }
        } else {
            for (unsigned h = threadIdx.x; h < hidden; h += blockDim.x) {
                float acc = 0.0f;
                for (unsigned k = 0; k < R; k++) {
                    moe_u32 s = slots[t * R + k];
                    if (s == 0xffffffffu) continue;
                    const unsigned char* row = recv + (weft_u64)s * b_out;
                    acc = __fmaf_rn(weights[t * R + k], moe_elem(row, h, dtype), acc);
                }
                moe_store(out, (weft_u64)t * hidden + h, acc, dtype);
            }
        }
    }
    moe_finish(&ctl[MOE_TICKET_SUM], sig, shadow);
}
"#;
