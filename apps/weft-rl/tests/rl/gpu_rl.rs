//! The GPU path on one GPU: the unshard / fuse / quantise kernels against
//! host references (uneven shards along both dims, more shards than one
//! launch takes, partial 128×128 edge tiles, odd widths, NaN / ±Inf / ±0 /
//! subnormals, every bf16 value through the e4m3 conversion), and the
//! whole pipeline (trainer shards in device memory → kernels → WRITEs
//! through the TransferEngine into the inference rank's device memory)
//! checked byte for byte against the independent reference of the host
//! tests. Skips without a GPU (prints `SKIP`), fails instead when
//! `WEFT_REQUIRE_GPU=1` (or `WEFT_CUDA_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use weft::loopback::{Fabric, FabricConfig};
use weft_cuda::{Gpu, Stream};
use weft_rl::cuda::{DevMat, GpuUpdate, GpuUpdateConfig, RlKernels};
use weft_rl::fp8::quantize_block;
use weft_rl::meta::{Box2, Concat, InferTensor, Layout, ModelLayout, Quant, Segment, TrainParam};
use weft_rl::models;
use weft_rl::{plan, DType, PlanConfig};
use weft_testkit::{seeds_or, SeedGuard};

fn required() -> bool {
    ["WEFT_REQUIRE_GPU", "WEFT_CUDA_REQUIRE_GPU"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| v == "1"))
}

/// Opens GPU 0 and compiles the kernels, or skips.
fn setup(test: &str) -> Option<(Gpu, RlKernels, Stream)> {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) if !required() => {
            eprintln!("SKIP {test}: no usable CUDA GPU: {e}");
            return None;
        }
        Err(e) => panic!("{test}: WEFT_REQUIRE_GPU=1 but no usable GPU: {e}"),
    };
    let k = match RlKernels::compile(&gpu) {
        Ok(k) => k,
        Err(e) if !required() => {
            eprintln!("SKIP {test}: GPU present but kernels unavailable: {e}");
            return None;
        }
        Err(e) => panic!("{test}: kernels unavailable: {e}"),
    };
    let s = gpu.stream().expect("stream");
    Some((gpu, k, s))
}

/// Random bf16 matrix: mostly finite values over a wide exponent range,
/// with `specials` (per mille) NaN, ±Inf, ±0, bf16 subnormals; an all-zero
/// and an all-NaN 128×128 tile when the matrix has room.
fn matrix(seed: u64, rows: usize, cols: usize, specials: u64) -> Vec<u16> {
    let mut g = crate::common::Rng(seed);
    let mut v: Vec<u16> = (0..rows * cols)
        .map(|_| {
            let x = g.next();
            if x % 1000 < specials {
                [
                    0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F,
                ][(x >> 20) as usize % 8]
            } else {
                let sign = ((x >> 63) as u16) << 15;
                let exp = 90 + ((x >> 8) % 60) as u16;
                sign | (exp << 7) | ((x >> 32) & 0x7F) as u16
            }
        })
        .collect();
    if rows >= 256 && cols >= 256 {
        for r in 0..128 {
            for c in 0..128 {
                v[r * cols + c] = if r % 2 == 0 { 0x0000 } else { 0x8000 };
                v[(r + 128) * cols + 128 + c] = 0x7FC1;
            }
        }
    }
    v
}

fn bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Quantises `x` on the GPU (auto or generic kernel) and on the host; the
/// fp8 bytes and scales must be identical.
#[allow(clippy::too_many_arguments)]
fn check_quant(
    gpu: &Gpu,
    k: &RlKernels,
    s: &Stream,
    x: &[u16],
    rows: usize,
    cols: usize,
    block: usize,
    generic: bool,
) {
    let src = bytes(x);
    let (br, bc) = (rows.div_ceil(block), cols.div_ceil(block));
    let mut hq = vec![0u8; rows * cols];
    let mut hs = vec![0u8; br * bc * 4];
    assert!(quantize_block(&src, rows, cols, block, &mut hq, &mut hs));
    // Offsets away from 0 inside the buffers.
    let dsrc = gpu.alloc(src.len() + 256).unwrap();
    dsrc.write(256, &src).unwrap();
    let dq = gpu.alloc(hq.len() + 512).unwrap();
    let ds = gpu.alloc(hs.len() + 64).unwrap();
    let m = DevMat::dense(&dsrc, 256, rows as u64, cols as u64);
    let r = if generic {
        k.quantize_generic(s, &m, block as u64, (&dq, 512), (&ds, 64))
    } else {
        k.quantize(s, &m, block as u64, (&dq, 512), (&ds, 64))
    };
    r.unwrap();
    s.synchronize().unwrap();
    let mut gq = vec![0u8; hq.len()];
    let mut gs = vec![0u8; hs.len()];
    dq.read(512, &mut gq).unwrap();
    ds.read(64, &mut gs).unwrap();
    let what = format!("{rows}x{cols} block {block} generic {generic}");
    if let Some(i) = (0..hs.len() / 4).find(|&i| gs[4 * i..4 * i + 4] != hs[4 * i..4 * i + 4]) {
        panic!(
            "{what}: scale {i}: gpu {:?} host {:?}",
            f32::from_le_bytes(gs[4 * i..4 * i + 4].try_into().unwrap()),
            f32::from_le_bytes(hs[4 * i..4 * i + 4].try_into().unwrap())
        );
    }
    if let Some(i) = (0..hq.len()).find(|&i| gq[i] != hq[i]) {
        panic!(
            "{what}: element ({}, {}) bf16 {:#06x}: gpu {:#04x} host {:#04x}",
            i / cols,
            i % cols,
            x[i],
            gq[i],
            hq[i]
        );
    }
    // Nothing written outside the outputs.
    let mut pre = vec![1u8; 512];
    dq.read(0, &mut pre).unwrap();
    assert!(pre.iter().all(|&b| b == 0), "{what}: wrote before q");
}

#[test]
fn quantise_matches_host_reference_on_partial_tiles_and_specials() {
    let Some((gpu, k, s)) = setup("quantise_matches_host_reference_on_partial_tiles_and_specials")
    else {
        return;
    };
    let shapes = [
        (1, 8),
        (1, 1),
        (7, 13),
        (128, 128),
        (130, 136),
        (300, 200),
        (257, 384),
        (129, 131),
        (384, 1000),
        (513, 7),
    ];
    for seed in seeds_or([5]) {
        let _g = SeedGuard::new(seed, "rl gpu quantise");
        for (i, &(r, c)) in shapes.iter().enumerate() {
            let x = matrix(seed ^ (i as u64) << 8, r, c, 20);
            check_quant(&gpu, &k, &s, &x, r, c, 128, false);
            check_quant(&gpu, &k, &s, &x, r, c, 128, true);
            check_quant(&gpu, &k, &s, &x, r, c, 32, false);
            check_quant(&gpu, &k, &s, &x, r, c, 5, false);
        }
    }
}

/// Every bf16 value (except those above 448, which would change the tile's
/// scale) in tiles whose amax is exactly 448: scale 1, so the kernel's
/// e4m3 conversion of every value (ties included) meets the host's.
#[test]
fn quantise_every_bf16_value_at_scale_one() {
    let Some((gpu, k, s)) = setup("quantise_every_bf16_value_at_scale_one") else {
        return;
    };
    let max = weft_rl::fp8::f32_to_bf16(448.0);
    let mut vals: Vec<u16> = (0..=u16::MAX)
        .filter(|&b| {
            let f = weft_rl::fp8::bf16_to_f32(b);
            f.is_nan() || f.abs() <= 448.0
        })
        .collect();
    // One 448 at the start of every 128x128 tile (cols = 128).
    let tile = 128 * 128;
    let mut x = Vec::new();
    for chunk in vals.chunks_mut(tile - 1) {
        x.push(max);
        x.extend_from_slice(chunk);
    }
    x.resize(x.len().div_ceil(tile) * tile, max);
    let rows = x.len() / 128;
    check_quant(&gpu, &k, &s, &x, rows, 128, 128, false);
    check_quant(&gpu, &k, &s, &x, rows, 128, 128, true);
}

/// Unshard (Shard(0) and Shard(1), uneven and empty shards, more shards
/// than one launch, odd and 8-aligned widths) and fuse against host
/// copies.
#[test]
fn unshard_and_fuse_match_host() {
    let Some((gpu, k, s)) = setup("unshard_and_fuse_match_host") else {
        return;
    };
    for seed in seeds_or([9]) {
        let _g = SeedGuard::new(seed, "rl gpu unshard/fuse");
        let mut g = crate::common::Rng(seed);
        for (rows, cols, dim, n) in [
            (300, 136, 0u8, 3usize),
            (300, 136, 1, 5),
            (97, 131, 0, 20),
            (64, 203, 1, 19),
            (1, 1, 0, 2),
        ] {
            let full = matrix(g.next(), rows, cols, 0);
            let ext = if dim == 0 { rows } else { cols };
            let mut sizes = vec![0usize; n];
            for _ in 0..ext {
                sizes[g.below(n as u64) as usize] += 1;
            }
            // Each shard row-major in one buffer, at uneven offsets.
            let buf = gpu.alloc(full.len() * 2 + 64 * n + 64).unwrap();
            let mut shards = Vec::new();
            let (mut at, mut off) = (0usize, 2usize * (seed as usize % 3));
            for &sz in &sizes {
                let (h, w) = if dim == 0 { (sz, cols) } else { (rows, sz) };
                let mut v = Vec::with_capacity(h * w);
                for r in 0..h {
                    for c in 0..w {
                        let (fr, fc) = if dim == 0 { (at + r, c) } else { (r, at + c) };
                        v.push(full[fr * cols + fc]);
                    }
                }
                buf.write(off, &bytes(&v)).unwrap();
                shards.push(DevMat::dense(&buf, off, h as u64, w as u64));
                off += v.len() * 2 + 2 * (g.below(2) as usize * 7 + 1);
                at += sz;
            }
            let out = gpu.alloc(full.len() * 2).unwrap();
            let dst = DevMat::dense(&out, 0, rows as u64, cols as u64);
            k.unshard(&s, dim, &shards, &dst).unwrap();
            s.synchronize().unwrap();
            assert_eq!(
                out.to_vec().unwrap(),
                bytes(&full),
                "unshard {rows}x{cols} dim {dim} sizes {sizes:?}"
            );
            // Fuse three boxes of `full` (and of a second tensor) into
            // one, below each other.
            let other = matrix(g.next(), 40, cols + 9, 0);
            let ob = gpu.alloc(other.len() * 2).unwrap();
            ob.write(0, &bytes(&other)).unwrap();
            let om = DevMat::dense(&ob, 0, 40, (cols + 9) as u64);
            let w = (cols as u64).min(17 + g.below(cols as u64));
            let c0 = g.below(cols as u64 - w + 1);
            let h1 = 1 + g.below(rows as u64);
            let segs = [
                dst.sub(0, c0, h1, w).unwrap(),
                om.sub(3, 9, 37, w).unwrap(),
                dst.sub(rows as u64 - 1, cols as u64 - w, 1, w).unwrap(),
            ];
            let total: u64 = segs.iter().map(|m| m.rows).sum();
            let fb = gpu.alloc((total * w * 2) as usize).unwrap();
            let fm = DevMat::dense(&fb, 0, total, w);
            k.fuse(&s, &segs, &fm).unwrap();
            s.synchronize().unwrap();
            let mut want = Vec::new();
            let (c0, w) = (c0 as usize, w as usize);
            for r in 0..h1 as usize {
                want.extend_from_slice(&full[r * cols + c0..r * cols + c0 + w]);
            }
            for r in 3..40 {
                let oc = cols + 9;
                want.extend_from_slice(&other[r * oc + 9..r * oc + 9 + w]);
            }
            want.extend_from_slice(&full[(rows - 1) * cols + cols - w..rows * cols]);
            assert_eq!(fb.to_vec().unwrap(), bytes(&want), "fuse width {w}");
        }
        // Shards that do not tile the tensor are refused.
        let buf = gpu.alloc(64).unwrap();
        let d = DevMat::dense(&buf, 0, 4, 4);
        let half = DevMat::dense(&buf, 0, 2, 4);
        assert!(k.unshard(&s, 0, &[half], &d).is_err());
        assert!(k.unshard(&s, 1, &[half, half], &d).is_err());
        assert!(DevMat::dense(&buf, 40, 4, 4).sub(0, 0, 4, 4).is_ok());
        assert!(k.fuse(&s, &[DevMat::dense(&buf, 40, 4, 4)], &d).is_err());
    }
}

/// A layout with uneven Shard(0)/Shard(1) splits, replicated parameters,
/// fused fp8 q/k/v with a partial last tile and an 8-aligned partial
/// width, an odd-width fp8 tensor (generic kernel) and a fused bf16 one.
fn uneven_layout() -> ModelLayout {
    let p = |name: &str, rows, cols, layout| TrainParam {
        name: name.into(),
        rows,
        cols,
        dtype: DType::Bf16,
        mesh_group: 0,
        layout,
    };
    let params = vec![
        p(
            "q",
            300,
            136,
            Layout::Shard {
                dim: 0,
                ranks: vec![0, 1, 2],
                sizes: vec![128, 100, 72],
            },
        ),
        p(
            "k",
            130,
            136,
            Layout::Shard {
                dim: 1,
                ranks: vec![2, 0],
                sizes: vec![72, 64],
            },
        ),
        p("v", 130, 136, Layout::Replicate { ranks: vec![1, 2] }),
        p("w", 77, 131, Layout::fsdp(1, vec![0, 1, 2], 131)),
    ];
    let seg = |param, r0: u64, r1: u64, c0: u64, c1: u64| Segment {
        param,
        src: Box2 {
            rows: r0..r1,
            cols: c0..c1,
        },
    };
    let t = |name: &str, segments, quant| InferTensor {
        name: name.into(),
        segments,
        quant,
        concat: Concat::Rows,
        block: None,
    };
    ModelLayout {
        trainers: 3,
        params,
        inference: vec![vec![
            t(
                "qkv",
                vec![
                    seg(0, 0, 256, 0, 136),
                    seg(1, 0, 128, 0, 136),
                    seg(2, 0, 130, 0, 136),
                ],
                Quant::Fp8Block,
            ),
            t("w", vec![seg(3, 0, 77, 0, 131)], Quant::Fp8Block),
            t(
                "qk.bf16",
                vec![seg(0, 5, 299, 3, 120), seg(1, 1, 130, 0, 117)],
                Quant::None,
            ),
        ]],
    }
}

/// Runs two versions through a `GpuUpdate` for every inference rank of
/// `plan` and checks the inference bytes against the reference.
fn e2e(gpu: &Gpu, ml: &ModelLayout, p: weft_rl::Plan, seed: u64) {
    let p = Arc::new(p);
    for inf in 0..p.inference.len() as u32 {
        // The adversarial simulated fabric with small WRITEs (copying GPU
        // memory with the GPU's copy engine), every other run; nvlink (the
        // default) in between.
        let hosts: Option<weft_rl::cuda::RoleHosts> = (inf % 2 == 0).then(|| {
            let fabric = Fabric::new_realtime(FabricConfig {
                max_write_len: 16 << 10,
                device_copy: Some(Arc::new(gpu.copy_engine().expect("copy engine"))),
                ..FabricConfig::adversarial(seed)
            });
            let h: weft_rl::cuda::RoleHosts = Arc::new(move |_| {
                let host = fabric.add_host(2);
                Ok(Arc::new(fabric.provider(host)) as Arc<dyn weft::Provider>)
            });
            h
        });
        let cfg = GpuUpdateConfig {
            inference_rank: inf,
            hosts,
            ..GpuUpdateConfig::default()
        };
        let u = GpuUpdate::new(gpu, ml.clone(), p.clone(), cfg).expect("GpuUpdate");
        assert!(
            u.read_inference().unwrap().is_none(),
            "live before any version"
        );
        for (version, step) in [100, 101].into_iter().enumerate() {
            for t in 0..p.trainers.len() {
                u.load_trainer(t, &crate::common::trainer_image(&p, t, step))
                    .unwrap();
            }
            let st = u.step().expect("step");
            assert!(st.write_count > 0);
            let (live, got) = u.read_inference().unwrap().expect("a live version");
            assert_eq!(live, version as u64);
            let want = crate::common::reference_region(ml, &p, inf as usize, step);
            crate::common::check_region(&got, &want, &format!("inference {inf} step {step}"));
        }
    }
}

#[test]
fn pipeline_uneven_shards_partial_tiles_bit_exact() {
    let Some((gpu, _, _)) = setup("pipeline_uneven_shards_partial_tiles_bit_exact") else {
        return;
    };
    for seed in seeds_or([3]) {
        let _g = SeedGuard::new(seed, "rl gpu pipeline uneven");
        let ml = uneven_layout();
        let p = plan(&ml, &PlanConfig::default()).unwrap();
        e2e(&gpu, &ml, p, seed);
    }
}

#[test]
fn pipeline_tiny_models_bit_exact() {
    let Some((gpu, _, _)) = setup("pipeline_tiny_models_bit_exact") else {
        return;
    };
    for seed in seeds_or([4]) {
        let _g = SeedGuard::new(seed, "rl gpu pipeline tiny models");
        for (name, pp) in [("tiny-moe", 1), ("tiny-mla", 2)] {
            let m = models::model(name).unwrap();
            let (t, i) = crate::common::tiny_gpu_layouts(pp);
            let ml = models::build(&m, t, i).unwrap();
            assert!(ml.inference[0].iter().any(|t| t.quant == Quant::Fp8Block));
            let p = plan(&ml, &PlanConfig::default()).unwrap();
            e2e(&gpu, &ml, p, seed);
        }
    }
}

#[test]
fn pipeline_random_layouts_bit_exact() {
    let Some((gpu, _, _)) = setup("pipeline_random_layouts_bit_exact") else {
        return;
    };
    for seed in seeds_or(0..12) {
        let _g = SeedGuard::new(seed, "rl gpu pipeline random layouts");
        let ml = crate::common::random_layout(seed, 4);
        let pc = PlanConfig {
            block: 4,
            unit_bytes: 96,
            align: 8,
            watermark: 4096,
            ramp: 2,
            min_direct_bytes: 24,
        };
        let p = plan(&ml, &pc).unwrap();
        e2e(&gpu, &ml, p, seed);
    }
}
