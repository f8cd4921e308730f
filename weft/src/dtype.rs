//! Element formats of LLM payloads that several systems convert on the
//! host: bf16 and fp8 e4m3fn (the OCP "fn" variant: no infinities, one NaN
//! pattern per sign, largest finite value 448). The GPU kernels of the
//! apps implement the same rounding line for line, so host and device
//! results are bit-identical.

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
