//! Throughput of the weight-update kernels on DeepSeek-V3 / Kimi-K2 weight
//! shapes: the fp8 block quantisation alone and the unshard + fuse +
//! quantise chain (each fused part FSDP `Shard(0)` over `--fsdp` ranks,
//! torch `chunk` splits), in GB/s of bf16 input, timed with CUDA events.
//! `bench/quant_torch.py` runs the same shapes with a straightforward torch
//! reference and prints the ratio; `--dump DIR` writes inputs and outputs
//! of the check shapes for its bit-exactness comparison.
//!
//! ```text
//! gpu_quant_bench [--iters N] [--fsdp N] [--out results.tsv] [--dump DIR]
//! ```

use std::io::Write;
use std::path::PathBuf;

use weft_cuda::{DeviceBuffer, Event, Gpu, Stream};
use weft_rl::cuda::{DevMat, RlKernels};

/// One benchmarked tensor: fused parts (rows each) of one width.
struct Shape {
    name: &'static str,
    parts: Vec<u64>,
    cols: u64,
    /// Dump inputs/outputs for the torch bit-exactness check.
    check: bool,
}

fn shapes() -> Vec<Shape> {
    // DeepSeek-V3: hidden 7168, moe_inter 2048, dense inter 18432, 128
    // heads, q_lora 1536, kv_lora 512, qk 128+64, v 128. Kimi-K2: the
    // same with 64 heads.
    let s = |name, parts: &[u64], cols, check| Shape {
        name,
        parts: parts.to_vec(),
        cols,
        check,
    };
    vec![
        s("expert.w13 (gate|up) 4096x7168", &[2048, 2048], 7168, true),
        s("expert.w2 7168x2048", &[7168], 2048, true),
        s("8 experts w13 stacked 32768x7168", &[2048; 16], 7168, false),
        s(
            "dsv3 dense gate_up 36864x7168",
            &[18432, 18432],
            7168,
            false,
        ),
        s("dsv3 q_b_proj 24576x1536", &[24576], 1536, false),
        s("dsv3 kv_b_proj 32768x512", &[32768], 512, false),
        s("dsv3 o_proj 7168x16384", &[7168], 16384, false),
        s("kimi q_b_proj 12288x1536", &[12288], 1536, false),
        s("kimi kv_b_proj 16384x512", &[16384], 512, false),
        s("kimi o_proj 7168x8192", &[7168], 8192, false),
        s("partial tiles 1000x1000", &[1000], 1000, true),
    ]
}

/// torch `chunk` sizes of `ext` over `n`.
fn chunks(ext: u64, n: u64) -> Vec<u64> {
    let c = ext.div_ceil(n.max(1));
    (0..n)
        .map(|i| ext.saturating_sub(i * c).min(c))
        .filter(|&x| x > 0)
        .collect()
}

/// Deterministic bf16 weights of trained-model magnitudes (|x| mostly in
/// 2^-12 .. 2^-3, some outliers up to 2^3), xorshift-generated.
fn weights(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let exp = if x.is_multiple_of(997) {
            127 + (x >> 40) % 4
        } else {
            115 + (x >> 40) % 10
        };
        let b = (((x >> 63) << 15) | (exp << 7) | ((x >> 20) & 0x7F)) as u16;
        out.extend_from_slice(&b.to_le_bytes());
    }
    out
}

struct Args {
    iters: u32,
    fsdp: u64,
    out: Option<PathBuf>,
    dump: Option<PathBuf>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        iters: 20,
        fsdp: 16,
        out: None,
        dump: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--iters" => a.iters = v()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--fsdp" => a.fsdp = v()?.parse().map_err(|e| format!("--fsdp: {e}"))?,
            "--out" => a.out = Some(v()?.into()),
            "--dump" => a.dump = Some(v()?.into()),
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    Ok(a)
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Milliseconds per run of `f` (`iters` runs after 3 warm-ups).
fn time(gpu: &Gpu, s: &Stream, iters: u32, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..3 {
        f()?;
    }
    let (a, b) = (Event::new(gpu)?, Event::new(gpu)?);
    a.record(s)?;
    for _ in 0..iters {
        f()?;
    }
    b.record(s)?;
    b.synchronize()?;
    Ok(f64::from(b.elapsed_ms_since(&a)?) / f64::from(iters))
}

fn main() -> Res<()> {
    let a = args()?;
    let gpu = Gpu::open(0)?;
    let k = RlKernels::compile(&gpu)?;
    let s = gpu.stream()?;
    if let Some(dir) = &a.dump {
        let _ = std::fs::remove_file(dir.join("index.tsv"));
    }
    println!(
        "# weft-rl GPU kernels on {} (cc {:?}), {} iterations, FSDP {} Shard(0)",
        gpu.name(),
        gpu.compute_capability(),
        a.iters,
        a.fsdp
    );
    let mut tsv = String::from(
        "shape\tparts\trows\tcols\tbf16_bytes\tquant_ms\tquant_gbps\tchain_ms\tchain_gbps\n",
    );
    println!(
        "{:<36} {:>10} {:>10} {:>10} {:>10}",
        "shape", "quant ms", "GB/s", "chain ms", "GB/s"
    );
    for (si, sh) in shapes().iter().enumerate() {
        let cols = sh.cols;
        let rows: u64 = sh.parts.iter().sum();
        let n = (rows * cols) as usize;
        let input = weights(0x5eed + si as u64, n);
        // The fused tensor, the shards (each part's chunks back to back in
        // part order, i.e. the same bytes), full parts, fp8 and scales.
        let fused = gpu.alloc(2 * n)?;
        fused.write(0, &input)?;
        let shards = gpu.alloc(2 * n)?;
        shards.write(0, &input)?;
        let full = gpu.alloc(2 * n)?;
        let q = gpu.alloc(n)?;
        let nsc = (rows.div_ceil(128) * cols.div_ceil(128) * 4) as usize;
        let sc = gpu.alloc(nsc)?;
        let fm = DevMat::dense(&fused, 0, rows, cols);
        let quant_ms = time(&gpu, &s, a.iters, || {
            Ok(k.quantize(&s, &fm, 128, (&q, 0), (&sc, 0))?)
        })?;
        if sh.check {
            if let Some(dir) = &a.dump {
                s.synchronize()?;
                dump(dir, si, rows, cols, &input, &q, &sc)?;
            }
        }
        // Chain: unshard each part from its shards, fuse the parts, quantise.
        let mut part_shards: Vec<Vec<DevMat<'_>>> = Vec::new();
        let mut parts = Vec::new();
        let mut at = 0u64;
        for &pr in &sh.parts {
            let mut v = Vec::new();
            let mut r = 0;
            for c in chunks(pr, a.fsdp) {
                v.push(DevMat::dense(
                    &shards,
                    (2 * (at + r) * cols) as usize,
                    c,
                    cols,
                ));
                r += c;
            }
            part_shards.push(v);
            parts.push(DevMat::dense(&full, (2 * at * cols) as usize, pr, cols));
            at += pr;
        }
        let chain_ms = time(&gpu, &s, a.iters, || {
            for (sv, p) in part_shards.iter().zip(&parts) {
                k.unshard(&s, 0, sv, p)?;
            }
            k.fuse(&s, &parts, &fm)?;
            Ok(k.quantize(&s, &fm, 128, (&q, 0), (&sc, 0))?)
        })?;
        // The chain's output must equal the quant-only output (same bytes in).
        if sh.check {
            if let Some(dir) = &a.dump {
                s.synchronize()?;
                let qa = std::fs::read(dir.join(format!("{si}.q.bin")))?;
                if qa != q.to_vec()? {
                    return Err(format!("{}: chain output differs from quant-only", sh.name).into());
                }
            }
        }
        let gb = (2 * n) as f64 / 1e9;
        let (qg, cg) = (gb / (quant_ms / 1e3), gb / (chain_ms / 1e3));
        println!(
            "{:<36} {:>10.4} {:>10.1} {:>10.4} {:>10.1}",
            sh.name, quant_ms, qg, chain_ms, cg
        );
        tsv += &format!(
            "{}\t{}\t{rows}\t{cols}\t{}\t{quant_ms:.5}\t{qg:.2}\t{chain_ms:.5}\t{cg:.2}\n",
            sh.name,
            sh.parts
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(","),
            2 * n
        );
    }
    if let Some(p) = &a.out {
        std::fs::write(p, &tsv)?;
    }
    Ok(())
}

fn dump(
    dir: &std::path::Path,
    si: usize,
    rows: u64,
    cols: u64,
    input: &[u8],
    q: &DeviceBuffer,
    sc: &DeviceBuffer,
) -> Res<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(format!("{si}.in.bf16")), input)?;
    std::fs::write(dir.join(format!("{si}.q.bin")), q.to_vec()?)?;
    std::fs::write(dir.join(format!("{si}.scales.f32")), sc.to_vec()?)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("index.tsv"))?;
    writeln!(f, "{si}\t{rows}\t{cols}")?;
    Ok(())
}
