//! Element conversions of the combine path. The weighted sum is defined
//! bit-exactly: bf16 → f32 is exact, the accumulation is a fused
//! multiply-add in k order, f32 → bf16 rounds to nearest even.

use crate::config::OutDtype;

/// bf16 bits to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Reads element `h` of a row of `dtype` elements (little-endian); 0.0 when
/// the row is too short.
pub fn read_elem(dtype: OutDtype, row: &[u8], h: usize) -> f32 {
    match dtype {
        OutDtype::F32 => row
            .get(h * 4..h * 4 + 4)
            .map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        OutDtype::Bf16 => row
            .get(h * 2..h * 2 + 2)
            .map_or(0.0, |b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
    }
}

/// Writes `x` as one `dtype` element (little-endian) into `out`, which is
/// exactly one element long.
pub fn put_elem(dtype: OutDtype, out: &mut [u8], x: f32) {
    match dtype {
        OutDtype::F32 => out.copy_from_slice(&x.to_le_bytes()),
        OutDtype::Bf16 => out.copy_from_slice(&f32_to_bf16(x).to_le_bytes()),
    }
}

/// Appends `x` as one `dtype` element (little-endian).
pub fn push_elem(dtype: OutDtype, out: &mut Vec<u8>, x: f32) {
    match dtype {
        OutDtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        OutDtype::Bf16 => out.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for b in [0u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x8000] {
            assert_eq!(f32_to_bf16(bf16_to_f32(b)), b);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even (up).
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 128.0 + 1.0 / 4096.0), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn elements() {
        let mut v = Vec::new();
        push_elem(OutDtype::F32, &mut v, 1.5);
        push_elem(OutDtype::F32, &mut v, -2.0);
        assert_eq!(read_elem(OutDtype::F32, &v, 1), -2.0);
        assert_eq!(read_elem(OutDtype::F32, &v, 2), 0.0);
        let mut v = Vec::new();
        push_elem(OutDtype::Bf16, &mut v, 3.0);
        assert_eq!(read_elem(OutDtype::Bf16, &v, 0), 3.0);
    }
}
