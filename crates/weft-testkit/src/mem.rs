//! Test helpers for [`HostBuffer`]: constructors that panic instead of
//! returning errors, and accessors that panic when out of bounds (a test
//! bug).

use crate::pattern::pattern;
use weft_transport::HostBuffer;

/// `len` zero bytes.
pub fn zeroed(len: usize) -> HostBuffer {
    HostBuffer::new(len).unwrap_or_else(|e| panic!("test buffer of {len} bytes: {e}"))
}

/// `len` bytes, each `byte`.
pub fn filled(len: usize, byte: u8) -> HostBuffer {
    from_bytes(&vec![byte; len])
}

/// `len` bytes, byte `i` being `f(i)`.
pub fn from_fn(len: usize, f: impl FnMut(usize) -> u8) -> HostBuffer {
    from_bytes(&(0..len).map(f).collect::<Vec<_>>())
}

/// A buffer holding a copy of `data`.
pub fn from_bytes(data: &[u8]) -> HostBuffer {
    let b = zeroed(data.len());
    b.put(0, data);
    b
}

/// `len` bytes of the pattern of `tag` ([`crate::pattern()`]).
pub fn patterned(tag: u64, len: usize) -> HostBuffer {
    from_bytes(&pattern(tag, len))
}

/// Panicking accessors for tests.
pub trait HostBufferExt {
    /// A copy of `len` bytes at `offset`; panics when out of bounds.
    fn bytes(&self, offset: usize, len: usize) -> Vec<u8>;
    /// A copy of the whole buffer.
    fn snapshot(&self) -> Vec<u8>;
    /// Copies `data` in at `offset`; panics when out of bounds.
    fn put(&self, offset: usize, data: &[u8]);
}

impl HostBufferExt for HostBuffer {
    fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        self.read(offset, len).unwrap_or_else(|| {
            panic!(
                "read [{offset}, +{len}) outside a buffer of {} bytes",
                self.len()
            )
        })
    }

    fn snapshot(&self) -> Vec<u8> {
        self.bytes(0, self.len())
    }

    fn put(&self, offset: usize, data: &[u8]) {
        assert!(
            self.write(offset, data),
            "write [{offset}, +{}) outside a buffer of {} bytes",
            data.len(),
            self.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_and_accessors() {
        assert_eq!(filled(3, 7).snapshot(), vec![7; 3]);
        assert_eq!(from_fn(4, |i| i as u8).snapshot(), vec![0, 1, 2, 3]);
        assert_eq!(patterned(9, 20).snapshot(), pattern(9, 20));
        let b = zeroed(10);
        b.put(8, &[1, 2]);
        assert_eq!(b.bytes(7, 3), vec![0, 1, 2]);
    }

    #[test]
    #[should_panic(expected = "outside a buffer of 10 bytes")]
    fn out_of_bounds_panics() {
        zeroed(10).bytes(5, 6);
    }
}
