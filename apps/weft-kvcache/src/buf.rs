//! The host buffers NICs write into (the stand-in for GPU memory).

/// A page-aligned, zeroed host buffer, accessed only through raw-pointer
/// copies (`read`/`write`) while registered, so remote WRITEs may land in it
/// while it is shared. Reads are only meaningful once a completion (imm
/// count, on_done) said the bytes are final; the apps only read after such a
/// signal.
pub use weft_transport::HostBuffer as HostBuf;

/// A zeroed buffer of `len` bytes (at least 1, so that even an empty layout
/// registers a valid region); `what` names it in the error.
pub(crate) fn host_buf(len: usize, what: &str) -> Result<HostBuf, crate::KvError> {
    HostBuf::new(len.max(1)).map_err(|e| crate::KvError::Size(format!("{what}: {e}")))
}

/// Deterministic content of byte `i` of stream `tag` (test/demo patterns).
pub fn pattern(tag: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 29) as u8
}
