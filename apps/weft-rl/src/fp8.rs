//! bf16 → fp8 (e4m3fn) block quantisation, as DeepSeek-V3 / Kimi-K2 FP8
//! checkpoints store weights: one f32 scale per `block × block` tile,
//! `scale = amax(|x|) / 448` (1 for an all-zero tile), `q = e4m3(x / scale)`
//! rounded to nearest, ties to even, saturating at ±448; the dequantised
//! value is `q * scale` (the checkpoints' `weight_scale_inv`).

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// bf16 bits → f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16 bits, round to nearest even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let b = x.to_bits();
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// f32 → e4m3fn, round to nearest even, saturating to ±448; NaN → 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) as i32) - 127;
    if exp < -6 {
        // Subnormal range of e4m3: multiples of 2^-9.
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q.min(8);
    }
    let mut e = (exp + 7) as u32;
    let m = bits & 0x7F_FFFF;
    let mut r = m >> 20;
    let rem = m & 0xF_FFFF;
    if rem > 0x8_0000 || (rem == 0x8_0000 && r & 1 == 1) {
        r += 1;
    }
    if r == 8 {
        r = 0;
        e += 1;
    }
    if e > 15 || (e == 15 && r == 7) {
        return sign | 0x7E;
    }
    sign | ((e as u8) << 3) | r as u8
}

/// e4m3fn → f32.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xF);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * (2f32).powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * (2f32).powi(e - 7)
    }
}

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
