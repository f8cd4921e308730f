//! fp8 dispatch ([`DispatchFormat::Fp8`](crate::DispatchFormat::Fp8)):
//! DeepEP's low-latency quantisation of one bf16 token, per 128 columns,
//! in f32:
//!
//! * `amax = max(|x|)` over the 128 values, at least `1e-4` (NaN if any
//!   value is NaN: then the scale is the quiet NaN `0x7fc00000` and every
//!   value of the group becomes e4m3's NaN, unlike DeepEP's `fmaxf`, which
//!   skips NaNs);
//! * `scale = amax · f32(1/448)`;
//! * without `round_scale`: `q = e4m3(clamp(x · (448 / amax), ±448))`;
//! * with `round_scale`: `scale = 2^ceil(log2(scale))` (exact, from the
//!   bits, as DeepEP's `fast_log2_ceil`), `q = e4m3(clamp(x / scale, ±448))`.
//!
//! e4m3 conversion rounds to nearest, ties to even ([`weft::dtype`]). The
//! received row is the `hidden` e4m3 bytes, then the `hidden / 128` scales
//! as little-endian f32 (`x ≈ q · scale`). The GPU send kernel
//! (`moe_pack_fp8`) computes the same bits.

use weft::dtype::{bf16_to_f32, f32_to_e4m3, E4M3_MAX};

/// Columns per scale.
pub const GROUP: usize = 128;

/// The bits of the scale of a group holding a NaN.
pub const CANONICAL_NAN: u32 = 0x7fc0_0000;

/// `2^ceil(log2(s))` for a positive normal or subnormal `s` (NaN and
/// infinities pass through), from the bits.
pub fn pow2_ceil(s: f32) -> f32 {
    if !s.is_finite() || s <= 0.0 {
        return s;
    }
    let bits = s.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: the bits are the value in units of 2^-149, so the next
        // power of two of them is the answer (2^23 of them: 2^-126).
        return f32::from_bits(man.next_power_of_two());
    }
    if man == 0 {
        return s;
    }
    if exp >= 254 {
        return f32::INFINITY;
    }
    f32::from_bits(((exp + 1) as u32) << 23)
}

/// Quantises one token: `row` holds `hidden` bf16 values (little-endian
/// bytes, `hidden % 128 == 0`), `out` receives `hidden` e4m3 bytes then
/// `hidden / 128` f32 scales. Returns `false` (writing nothing) when the
/// sizes do not fit that.
pub fn quantize_token(row: &[u8], round_scale: bool, out: &mut [u8]) -> bool {
    let hidden = row.len() / 2;
    if !row.len().is_multiple_of(2 * GROUP) || out.len() != hidden + hidden / 32 {
        return false;
    }
    let (q, scales) = out.split_at_mut(hidden);
    let inv_max = (1.0f64 / f64::from(E4M3_MAX)) as f32;
    for (g, (src, dst)) in row
        .chunks_exact(2 * GROUP)
        .zip(q.chunks_exact_mut(GROUP))
        .enumerate()
    {
        let x = |i: usize| bf16_to_f32(u16::from_le_bytes([src[2 * i], src[2 * i + 1]]));
        let mut amax = 0.0f32;
        for i in 0..GROUP {
            let a = x(i).abs();
            if a.is_nan() || a > amax {
                amax = a;
            }
            if amax.is_nan() {
                break;
            }
        }
        if !amax.is_nan() && amax < 1e-4 {
            amax = 1e-4;
        }
        // A NaN scale is the canonical quiet NaN, whatever the input's
        // payload (the GPU kernel writes the same bits).
        let mut scale = if amax.is_nan() {
            f32::from_bits(CANONICAL_NAN)
        } else {
            amax * inv_max
        };
        if round_scale {
            scale = pow2_ceil(scale);
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f32_to_e4m3((x(i) / scale).clamp(-E4M3_MAX, E4M3_MAX));
            }
        } else {
            let mul = E4M3_MAX / amax;
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f32_to_e4m3((x(i) * mul).clamp(-E4M3_MAX, E4M3_MAX));
            }
        }
        scales[4 * g..4 * g + 4].copy_from_slice(&scale.to_le_bytes());
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft::dtype::{e4m3_to_f32, f32_to_bf16};

    fn token(vals: &[f32]) -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
            .collect()
    }

    fn scale_of(out: &[u8], hidden: usize, g: usize) -> f32 {
        let at = hidden + 4 * g;
        f32::from_le_bytes(out[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn pow2_ceil_is_exact() {
        assert_eq!(pow2_ceil(1.0), 1.0);
        assert_eq!(pow2_ceil(1.000_000_1), 2.0);
        assert_eq!(pow2_ceil(0.75), 1.0);
        assert_eq!(pow2_ceil(3.0e-7), 2f32.powi(-21));
        assert_eq!(pow2_ceil(2f32.powi(-22)), 2f32.powi(-22));
        let sub = f32::from_bits(3); // subnormal
        assert_eq!(pow2_ceil(sub), f32::from_bits(4));
        assert_eq!(pow2_ceil(f32::from_bits(4)), f32::from_bits(4));
        assert!(pow2_ceil(f32::NAN).is_nan());
        assert_eq!(pow2_ceil(f32::MAX), f32::INFINITY);
    }

    #[test]
    fn a_group_maps_its_amax_to_448() {
        let mut v = vec![0.0f32; 256];
        v[3] = -2.0;
        v[7] = 1.0;
        v[200] = 0.5;
        let mut out = vec![0u8; 256 + 8];
        assert!(quantize_token(&token(&v), false, &mut out));
        assert_eq!(out[3], f32_to_e4m3(-448.0));
        assert_eq!(e4m3_to_f32(out[7]), 224.0);
        assert_eq!(scale_of(&out, 256, 0), 2.0 * ((1.0f64 / 448.0) as f32));
        assert_eq!(e4m3_to_f32(out[200]), 448.0);
        assert_eq!(scale_of(&out, 256, 1), 0.5 * ((1.0f64 / 448.0) as f32));
        // Dequantised, every value is back within e4m3's precision.
        for (i, &want) in v.iter().enumerate() {
            let got = e4m3_to_f32(out[i]) * scale_of(&out, 256, i / 128);
            assert!(
                (got - want).abs() <= want.abs() / 8.0,
                "{i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn zeros_take_the_floor_and_round_scale_gives_powers_of_two() {
        let mut out = vec![0u8; 128 + 4];
        assert!(quantize_token(&token(&[0.0; 128]), false, &mut out));
        assert!(out[..128].iter().all(|&b| b == 0));
        assert_eq!(scale_of(&out, 128, 0), 1e-4 * ((1.0f64 / 448.0) as f32));
        let mut v = vec![0.1f32; 128];
        v[0] = 3.0;
        assert!(quantize_token(&token(&v), true, &mut out));
        let s = scale_of(&out, 128, 0);
        assert_eq!(s, pow2_ceil(3.0 * ((1.0f64 / 448.0) as f32)));
        assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{s} is a power of two");
        assert_eq!(e4m3_to_f32(out[0]) * s, 3.0);
    }

    #[test]
    fn nan_and_wrong_sizes() {
        let mut v = vec![1.0f32; 128];
        v[5] = f32::NAN;
        let mut out = vec![0u8; 132];
        assert!(quantize_token(&token(&v), false, &mut out));
        assert_eq!(scale_of(&out, 128, 0).to_bits(), CANONICAL_NAN);
        assert!(out[..128].iter().all(|&q| q == 0x7f));
        // A signalling bf16 NaN's payload does not leak into the scale.
        let mut raw = token(&[1.0; 128]);
        raw[10..12].copy_from_slice(&0x7f81u16.to_le_bytes());
        assert!(quantize_token(&raw, true, &mut out));
        assert_eq!(scale_of(&out, 128, 0).to_bits(), CANONICAL_NAN);
        assert!(!quantize_token(&token(&v[..64]), false, &mut out));
        assert!(!quantize_token(&token(&v), false, &mut out[..131]));
    }
}
