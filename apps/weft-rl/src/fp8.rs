//! bf16 → fp8 (e4m3fn) block quantisation, as DeepSeek-V3 / Kimi-K2 FP8
//! checkpoints store weights: one f32 scale per `block × block` tile,
//! `scale = amax(|x|) / 448` (1 for an all-zero tile), `q = e4m3(x / scale)`
//! rounded to nearest, ties to even, saturating at ±448; the dequantised
//! value is `q * scale` (the checkpoints' `weight_scale_inv`).

pub use weft::dtype::{bf16_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e4m3, E4M3_MAX};

/// Quantises a row-major `rows × cols` bf16 box (little-endian bytes in
/// `src`) into `q` (`rows*cols` e4m3 bytes) and `scales`
/// (`ceil(rows/block) * ceil(cols/block)` f32 little-endian, row-major).
/// The tiles start at the box's top-left corner.
///
/// Returns `false` (writing nothing) when the slices have the wrong sizes.
pub fn quantize_block(
    src: &[u8],
    rows: usize,
    cols: usize,
    block: usize,
    q: &mut [u8],
    scales: &mut [u8],
) -> bool {
    let (br, bc) = (rows.div_ceil(block.max(1)), cols.div_ceil(block.max(1)));
    if block == 0
        || src.len() != rows * cols * 2
        || q.len() != rows * cols
        || scales.len() != br * bc * 4
    {
        return false;
    }
    let x = |r: usize, c: usize| {
        let i = (r * cols + c) * 2;
        bf16_to_f32(u16::from_le_bytes([src[i], src[i + 1]]))
    };
    for ti in 0..br {
        for tj in 0..bc {
            let (r0, r1) = (ti * block, ((ti + 1) * block).min(rows));
            let (c0, c1) = (tj * block, ((tj + 1) * block).min(cols));
            let mut amax = 0f32;
            for r in r0..r1 {
                for c in c0..c1 {
                    amax = amax.max(x(r, c).abs());
                }
            }
            let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            let k = (ti * bc + tj) * 4;
            scales[k..k + 4].copy_from_slice(&scale.to_le_bytes());
            for r in r0..r1 {
                for c in c0..c1 {
                    q[r * cols + c] = f32_to_e4m3(x(r, c) / scale);
                }
            }
        }
    }
    true
}
