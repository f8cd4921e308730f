//! `Imm`: an immediate value taken from an engine's allocator, returned
//! when the object is released or garbage-collected.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::PyTuple;

use crate::errors;

/// An immediate value of an engine (`TransferEngine.alloc_imm` or
/// `reserve_imm`). Use it wherever an `imm` is taken (it is an integer by
/// `int()`/`operator.index`); the value returns to the engine's allocator
/// on `release()`, at the end of a `with` block, or when the object is
/// garbage-collected. A round armed with `expect_imm_count(imm, ...)`
/// keeps the object alive until the round ends.
#[pyclass(name = "Imm", module = "weft._weft", frozen)]
pub struct PyImm {
    value: u32,
    /// `None` once released.
    lease: Mutex<Option<weft::ImmLease>>,
}

impl PyImm {
    pub(crate) fn new(lease: weft::ImmLease) -> Self {
        PyImm {
            value: lease.value(),
            lease: Mutex::new(Some(lease)),
        }
    }

    /// The value of `obj`: an `Imm` or anything `int()` accepts as an
    /// unsigned 32-bit value.
    pub(crate) fn value_of(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
        match obj.cast::<PyImm>() {
            Ok(i) => Ok(i.get().value),
            Err(_) => obj.extract::<u32>(),
        }
    }
}

#[pymethods]
impl PyImm {
    /// The immediate value.
    #[getter]
    fn value(&self) -> u32 {
        self.value
    }

    /// Whether the value is still held (not released).
    #[getter]
    fn held(&self) -> bool {
        self.lease.lock().is_some()
    }

    /// Returns the value to the allocator now (idempotent). Arrivals no
    /// round consumed are reported as excess; a round still armed on it
    /// fails, and this raises `InvalidArgumentError` saying so.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some(lease) = self.lease.lock().take() else {
            return Ok(());
        };
        py.detach(|| lease.release())
            .map_err(|e| errors::engine_err(py, &e))
    }

    fn __index__(&self) -> u32 {
        self.value
    }

    fn __int__(&self) -> u32 {
        self.value
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<bool> {
        let Ok(v) = PyImm::value_of(other) else {
            return match op {
                CompareOp::Eq => Ok(false),
                CompareOp::Ne => Ok(true),
                _ => Err(pyo3::exceptions::PyTypeError::new_err(
                    "an Imm compares with integers and other Imm values only",
                )),
            };
        };
        Ok(op.matches(self.value.cmp(&v)))
    }

    fn __hash__(&self) -> u64 {
        u64::from(self.value)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("Imm({}, held={})", self.value, self.held())
    }
}
