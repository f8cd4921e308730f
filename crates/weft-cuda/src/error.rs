//! The crate's error type.

use thiserror::Error;
use weft_transport::TransportError;

/// Everything that can go wrong in weft-cuda. Every variant says which device
/// or library it concerns.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The crate was built without the `cuda` feature.
    #[error("weft-cuda was built without CUDA support; rebuild with `--features cuda`")]
    NotBuilt,
    /// `libcuda.so.1` is missing, lacks a symbol weft needs, or `cuInit`
    /// failed (no GPU, driver/kernel-module mismatch, ...).
    #[error("CUDA driver unavailable: {reason}")]
    DriverUnavailable {
        /// What the probe saw.
        reason: String,
    },
    /// NVRTC (runtime kernel compilation) could not be loaded.
    #[error("NVRTC unavailable: {reason}")]
    NvrtcUnavailable {
        /// What the probe saw.
        reason: String,
    },
    /// The requested device ordinal does not exist.
    #[error("no CUDA device cuda:{ordinal} (the driver reports {count} devices)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices the driver reports.
        count: u32,
    },
    /// A driver call failed.
    #[error("{device}: {op} failed: {name} (CUresult {code})")]
    Driver {
        /// The device (`cuda:0`) or `cuda-driver` for device-less calls.
        device: String,
        /// The driver call, e.g. `cuMemAlloc`.
        op: &'static str,
        /// The CUresult code.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
    },
    /// NVRTC could not compile a kernel source.
    #[error("{device}: NVRTC compilation of {what} failed: {log}")]
    Compile {
        /// The device the code was compiled for.
        device: String,
        /// Which source.
        what: String,
        /// The compiler log or error.
        log: String,
    },
    /// Memory that cannot be shared with another process: not device
    /// memory of this process, a range past its allocation, or a
    /// virtual-memory allocation made without POSIX file-descriptor handles.
    #[error("{device}: cannot share memory with another process: {what}")]
    NotShareable {
        /// The device concerned.
        device: String,
        /// Why.
        what: String,
    },
    /// A peer's shared memory could not be mapped into this process (a
    /// forged or stale description, a peer that is gone, no permission to
    /// take its descriptor, a range outside its allocation).
    #[error("{device}: cannot map a peer's memory: {what}")]
    ImportFailed {
        /// The device importing.
        device: String,
        /// What failed.
        what: String,
    },
    /// A caller error: bad length, offset out of range, wrong device.
    #[error("{device}: invalid argument: {what}")]
    InvalidArgument {
        /// The device concerned.
        device: String,
        /// What was wrong.
        what: String,
    },
}

impl From<CudaError> for TransportError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::NotBuilt => TransportError::Unsupported {
                nic: "cuda".into(),
                what: e.to_string(),
            },
            CudaError::DriverUnavailable { .. } => TransportError::LibraryUnavailable {
                library: "libcuda.so.1".into(),
                reason: e.to_string(),
            },
            CudaError::NvrtcUnavailable { .. } => TransportError::LibraryUnavailable {
                library: "libnvrtc".into(),
                reason: e.to_string(),
            },
            CudaError::NoDevice { .. } => TransportError::NoDevice {
                what: e.to_string(),
            },
            CudaError::Driver {
                device,
                op,
                code,
                name,
            } => TransportError::Provider {
                nic: device,
                op,
                code: i64::from(code),
                message: name,
            },
            CudaError::Compile { ref device, .. } => TransportError::Failed {
                nic: device.clone(),
                wr: None,
                what: e.to_string(),
            },
            CudaError::NotShareable { device, what } => TransportError::Unsupported {
                nic: device,
                what: format!("sharing memory with another process: {what}"),
            },
            CudaError::ImportFailed { ref device, .. } => TransportError::Failed {
                nic: device.clone(),
                wr: None,
                what: e.to_string(),
            },
            CudaError::InvalidArgument { device, what } => {
                TransportError::InvalidArgument { nic: device, what }
            }
        }
    }
}
