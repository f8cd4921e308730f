//! CUDA support for the loopback backend: its simulated NICs copy device
//! memory with weft-cuda's copy engine (libcuda is loaded at run time; the
//! extension links nothing CUDA).

use pyo3::prelude::*;
use std::sync::Arc;

use crate::errors;

/// Gives a loopback backend's fabric a copy engine for GPU `ordinal` (other
/// backends register device memory with their NICs directly).
pub(crate) fn attach_copy(py: Python<'_>, backend: &weft::Backend, ordinal: u32) -> PyResult<()> {
    let Some(fabric) = backend.loopback_fabric() else {
        return Ok(());
    };
    let copy = py
        .detach(|| weft_cuda::Gpu::open(ordinal).and_then(|g| g.copy_engine()))
        .map_err(|e| {
            errors::new_err(
                py,
                "ProviderUnavailableError",
                "no_device",
                format!("cuda:{ordinal} for the loopback fabric: {e}"),
            )
        })?;
    fabric.set_device_copy(Arc::new(copy));
    Ok(())
}
