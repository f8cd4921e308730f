//! [`TestMemory`]: the memory the suites allocate, fill, read and register
//! — host memory by default, device memory where a harness supplies it
//! (the cross-process harnesses ask [`crate::xproc::XprocBackend::alloc`]).

use std::ops::Range;
use weft_transport::{HostBuffer, MemRegion};

/// A zeroed buffer the suites read and write through copies (so it may
/// live on a device), and register through [`TestMemory::sub_region`].
pub trait TestMemory: Send + Sync {
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `data` in at `offset`; `false` when it does not fit (or the
    /// copy failed).
    fn write(&self, offset: usize, data: &[u8]) -> bool;
    /// Copies `len` bytes out from `offset`; `None` when outside (or the
    /// copy failed).
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>>;
    /// The region of `range`, for registration; `None` when outside. The
    /// memory outlives every registration of it (the suites keep it).
    fn sub_region(&self, range: Range<usize>) -> Option<MemRegion>;
}

impl TestMemory for HostBuffer {
    fn len(&self) -> usize {
        HostBuffer::len(self)
    }
    fn write(&self, offset: usize, data: &[u8]) -> bool {
        HostBuffer::write(self, offset, data)
    }
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        HostBuffer::read(self, offset, len)
    }
    fn sub_region(&self, range: Range<usize>) -> Option<MemRegion> {
        HostBuffer::sub_region(self, range)
    }
}

/// Zeroed host memory of `len` bytes, as a [`TestMemory`].
pub fn host_memory(len: usize) -> Result<Box<dyn TestMemory>, String> {
    HostBuffer::new(len)
        .map(|b| Box::new(b) as Box<dyn TestMemory>)
        .map_err(|e| format!("host buffer of {len} bytes: {e}"))
}
