//! The CUDA implementation (feature `cuda`).

mod copy;
mod gpu;
mod kernels;
mod mapped;
mod memory;
mod probe;
mod stream;

pub use copy::CudaCopy;
pub use gpu::Gpu;
pub use kernels::{Kernels, ProbeOrdering, KERNELS_CU};
pub use mapped::{HostFlag, WatchWord};
pub use memory::DeviceBuffer;
pub use probe::{probe, probe_nvrtc};
pub use stream::{Graph, Stream};

use crate::CudaError;
use cudarc::driver::result::DriverError;

/// Maps a cudarc driver error to [`CudaError::Driver`].
pub(crate) fn drv<'a>(
    device: &'a str,
    op: &'static str,
) -> impl FnOnce(DriverError) -> CudaError + 'a {
    move |e| CudaError::Driver {
        device: device.to_string(),
        op,
        code: e.0 as u32,
        name: format!("{:?}", e.0),
    }
}
