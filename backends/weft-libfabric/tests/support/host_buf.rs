//! The buffer the engine tests register with their engines: a
//! [`HostBuffer`] with panicking constructors. Shared by `engine_tcp.rs` and
//! `engine_xproc.rs`.

use std::ops::Deref;
use weft_transport::HostBuffer;

/// A [`HostBuffer`] (all its methods through `Deref`) built infallibly.
pub struct HostBuf(HostBuffer);

impl HostBuf {
    /// `len` zero bytes.
    pub fn new(len: usize) -> Self {
        Self(weft_testkit::mem::zeroed(len))
    }

    /// `len` bytes, byte `i` being `f(i)`.
    pub fn from_fn(len: usize, f: impl Fn(usize) -> u8) -> Self {
        Self(weft_testkit::mem::from_fn(len, f))
    }
}

impl Deref for HostBuf {
    type Target = HostBuffer;

    fn deref(&self) -> &HostBuffer {
        &self.0
    }
}
