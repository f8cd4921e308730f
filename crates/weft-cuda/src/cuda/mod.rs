//! The CUDA implementation (feature `cuda`).

#[allow(unsafe_code)]
mod copy;
#[allow(unsafe_code)]
mod gpu;
#[allow(unsafe_code)]
mod ipc;
#[allow(unsafe_code)]
mod kernels;
#[allow(unsafe_code)]
mod mapped;
#[allow(unsafe_code)]
mod memory;
#[allow(unsafe_code)]
mod module;
#[allow(unsafe_code)]
mod peer;
#[allow(unsafe_code)]
mod probe;
#[allow(unsafe_code)]
mod stream;

pub use copy::CudaCopy;
pub use gpu::Gpu;
pub use ipc::{Exported, ImportCache, Imported};
pub use kernels::{Kernels, ProbeOrdering, DTYPE_CU, KERNELS_CU};
pub use mapped::{HostFlag, WatchWord};
pub use memory::DeviceBuffer;
pub use module::{Event, Function, MappedBuffer, Module};
pub use peer::CudaPeerMemory;
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
