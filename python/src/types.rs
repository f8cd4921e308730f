//! Plain value types: [`PyMrDesc`] (a memory descriptor, to/from bytes) and
//! [`PyImmCounts`].

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::errors;

/// What a peer needs to write into a registered region: its address, length
/// and one remote key per NIC. Send it to the peer with `to_bytes()` and
/// rebuild it there with `MrDesc.from_bytes(b)`.
#[pyclass(name = "MrDesc", module = "weft._weft", frozen)]
#[derive(Clone)]
pub struct PyMrDesc {
    pub(crate) inner: weft::MrDesc,
}

#[pymethods]
impl PyMrDesc {
    /// Decodes a descriptor produced by `to_bytes()`. Truncated, trailing or
    /// garbage input raises `DescriptorError`.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        weft::decode::<weft::MrDesc>(data)
            .map(|inner| PyMrDesc { inner })
            .map_err(|e| {
                errors::new_err(
                    py,
                    "DescriptorError",
                    Some("wire"),
                    format!("bad MrDesc: {e}"),
                )
            })
    }

    /// The descriptor as bytes (stable wire encoding).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = weft::encode(&self.inner).map_err(|e| {
            errors::new_err(
                py,
                "DescriptorError",
                Some("wire"),
                format!("encoding MrDesc: {e}"),
            )
        })?;
        Ok(PyBytes::new(py, &b))
    }

    /// Start address of the region in its owner's address space.
    #[getter]
    fn addr(&self) -> u64 {
        self.inner.addr
    }

    /// Length of the region in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.len
    }

    /// Number of NICs (remote keys) of the owner's domain group.
    #[getter]
    fn nic_count(&self) -> usize {
        self.inner.rkeys.len()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyMrDesc>()
            .map(|o| o.get().inner == self.inner)
            .unwrap_or(false)
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.inner.hash(&mut h);
        h.finish()
    }

    fn __repr__(&self) -> String {
        format!(
            "MrDesc(addr={:#x}, nbytes={}, nic_count={})",
            self.inner.addr,
            self.inner.len,
            self.inner.rkeys.len()
        )
    }
}

/// How many immediates a submit delivers to its destination: pass the
/// result to `expect_imm_count`.
#[pyclass(name = "ImmCounts", module = "weft._weft", frozen)]
pub struct PyImmCounts {
    pub(crate) inner: weft::ImmCounts,
}

#[pymethods]
impl PyImmCounts {
    /// Immediates of one `submit_single_write` of `nbytes` bytes.
    fn single_write(&self, nbytes: u64) -> u64 {
        self.inner.single_write(nbytes)
    }

    /// Immediates of one paged write of `pages` pages of `page_len` bytes.
    fn paged_writes(&self, page_len: u64, pages: u64) -> u64 {
        self.inner.paged_writes(page_len, pages)
    }

    /// NICs of the group.
    #[getter]
    fn nics(&self) -> usize {
        self.inner.nics
    }
}
