//! Deterministic data patterns and comparisons that say where they differ.
//!
//! Byte `i` of the pattern of `tag` is [`pattern_byte`]`(tag, i)`: byte
//! `i % 8` (little-endian) of the `i / 8 + 1`-th output of splitmix64 seeded
//! with `tag`. Any byte can be computed on its own (a child process can check
//! a slice without generating what comes before), and different tags give
//! unrelated streams.

use std::fmt;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `k`-th (0-based) 8-byte word of the pattern of `tag`.
fn word(tag: u64, k: u64) -> u64 {
    mix(tag.wrapping_add(k.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Byte `i` of the pattern of `tag`.
pub fn pattern_byte(tag: u64, i: u64) -> u8 {
    word(tag, i / 8).to_le_bytes()[(i % 8) as usize]
}

/// The first `len` bytes of the pattern of `tag`.
pub fn pattern(tag: u64, len: usize) -> Vec<u8> {
    pattern_at(tag, 0, len)
}

/// `len` bytes of the pattern of `tag`, starting at byte `start`.
pub fn pattern_at(tag: u64, start: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 16);
    let mut k = start / 8;
    let skip = (start % 8) as usize;
    while out.len() < len + skip {
        out.extend_from_slice(&word(tag, k).to_le_bytes());
        k += 1;
    }
    out.drain(..skip);
    out.truncate(len);
    out
}

/// Where two byte strings differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// Offset of the first differing byte (the shorter length when only the
    /// lengths differ).
    pub offset: usize,
    /// The byte found there (`None` past the end of what was read).
    pub got: Option<u8>,
    /// The byte expected there (`None` past the end of what was expected).
    pub want: Option<u8>,
    /// How many bytes differ over the common length.
    pub count: usize,
    /// Length read.
    pub got_len: usize,
    /// Length expected.
    pub want_len: usize,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.got_len != self.want_len {
            return write!(f, "read {} bytes, expected {}", self.got_len, self.want_len);
        }
        let hex = |b: Option<u8>| b.map_or_else(|| "none".to_string(), |b| format!("{b:#04x}"));
        write!(
            f,
            "{} of {} bytes wrong; first at offset {}: got {}, expected {}",
            self.count,
            self.want_len,
            self.offset,
            hex(self.got),
            hex(self.want)
        )
    }
}

impl std::error::Error for Mismatch {}

/// Compares `got` with `want`: `Err` with the first difference (and how many
/// bytes differ) unless they are equal.
pub fn compare(got: &[u8], want: &[u8]) -> Result<(), Mismatch> {
    if got == want {
        return Ok(());
    }
    let mut first = None;
    let mut count = 0usize;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            count += 1;
            first.get_or_insert(i);
        }
    }
    let offset = first.unwrap_or(got.len().min(want.len()));
    Err(Mismatch {
        offset,
        got: got.get(offset).copied(),
        want: want.get(offset).copied(),
        count,
        got_len: got.len(),
        want_len: want.len(),
    })
}

/// Checks that `got` is the pattern of `tag` from byte `start` on.
pub fn check_pattern(tag: u64, start: u64, got: &[u8]) -> Result<(), Mismatch> {
    compare(got, &pattern_at(tag, start, got.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_and_repeat() {
        assert_eq!(pattern(1, 33), pattern(1, 33));
        assert_ne!(pattern(1, 33), pattern(2, 33));
        assert_eq!(pattern(5, 0).len(), 0);
        assert_eq!(&pattern(7, 100)[..13], &pattern(7, 13)[..]);
    }

    #[test]
    fn bytes_and_windows_agree_with_the_whole() {
        let whole = pattern(42, 100);
        for (i, &b) in whole.iter().enumerate() {
            assert_eq!(pattern_byte(42, i as u64), b);
        }
        for start in 0..20 {
            assert_eq!(pattern_at(42, start, 50), whole[start as usize..][..50]);
        }
    }

    #[test]
    fn is_splitmix64() {
        // The first output of splitmix64 seeded with 0.
        assert_eq!(
            pattern(0, 8),
            0xe220_a839_7b1d_cdafu64.to_le_bytes().to_vec()
        );
    }

    #[test]
    fn reports_first_mismatch() {
        assert!(compare(b"abc", b"abc").is_ok());
        let e = compare(b"xbd", b"abc").unwrap_err();
        assert_eq!((e.offset, e.count), (0, 2));
        assert!(e.to_string().contains("offset 0"), "{e}");
        let e = compare(b"ab", b"abc").unwrap_err();
        assert_eq!((e.offset, e.got, e.want), (2, None, Some(b'c')));
        let mut p = pattern(3, 64);
        assert!(check_pattern(3, 0, &p).is_ok());
        assert!(check_pattern(3, 8, &p[8..]).is_ok());
        p[40] ^= 1;
        assert_eq!(check_pattern(3, 0, &p).unwrap_err().offset, 40);
    }
}
