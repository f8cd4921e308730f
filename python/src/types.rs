//! Plain value types: [`PyMrDesc`] (a memory descriptor, to/from bytes) and
//! [`PyImmCounts`].

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::errors;

/// Decodes a wire value; bad input raises `DescriptorError` naming `what`.
pub(crate) fn from_wire<T: serde::de::DeserializeOwned>(
    py: Python<'_>,
    data: &[u8],
    what: &str,
) -> PyResult<T> {
    weft::decode::<T>(data)
        .map_err(|e| errors::new_err(py, "DescriptorError", "wire", format!("bad {what}: {e}")))
}

/// Encodes a wire value as Python bytes; a failure raises `DescriptorError`.
fn to_wire<'py, T: serde::Serialize>(
    py: Python<'py>,
    value: &T,
    what: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let b = weft::encode(value).map_err(|e| {
        errors::new_err(
            py,
            "DescriptorError",
            "wire",
            format!("encoding {what}: {e}"),
        )
    })?;
    Ok(PyBytes::new(py, &b))
}

/// What a peer needs to write into a registered region: its address, length
/// and one remote key per NIC. Send it to the peer with `to_bytes()` and
/// rebuild it there with `MrDesc.from_bytes(b)`.
#[pyclass(name = "MrDesc", module = "weft._weft", frozen, from_py_object)]
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
        from_wire(py, data, "MrDesc").map(|inner| PyMrDesc { inner })
    }

    /// The descriptor as bytes (stable wire encoding).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        to_wire(py, &self.inner, "MrDesc")
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

    /// The owner engine's incarnation.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.inner.incarnation.0
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

/// Parses a scatter mode name.
pub(crate) fn scatter_mode(py: Python<'_>, mode: &str) -> PyResult<weft::ScatterMode> {
    match mode {
        "by_peer" => Ok(weft::ScatterMode::ByPeer),
        "by_bytes" => Ok(weft::ScatterMode::ByBytes),
        other => Err(errors::invalid(
            py,
            format!("mode must be \"by_peer\" or \"by_bytes\", got {other:?}"),
        )),
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

    /// Immediates destination `nbytes` of a scatter delivers (`mode`:
    /// `"by_peer"` or `"by_bytes"`).
    #[pyo3(signature = (nbytes, mode="by_peer"))]
    fn scatter_dst(&self, py: Python<'_>, nbytes: u64, mode: &str) -> PyResult<u64> {
        Ok(self.inner.scatter_dst(nbytes, scatter_mode(py, mode)?))
    }

    /// Immediates one barrier delivers to each member.
    fn barrier(&self) -> u64 {
        self.inner.barrier()
    }

    /// NICs of the group.
    #[getter]
    fn nics(&self) -> usize {
        self.inner.nics
    }
}

/// The address of a peer engine (its main domain group): give it to the
/// peers that `submit_send` to it or put it in a peer group. `to_bytes()` /
/// `PeerAddress.from_bytes(b)` carry it between processes.
#[pyclass(name = "PeerAddress", module = "weft._weft", frozen)]
#[derive(Clone)]
pub struct PyPeerAddress {
    pub(crate) inner: weft::GroupAddress,
}

#[pymethods]
impl PyPeerAddress {
    /// Decodes `to_bytes()` output; bad input raises `DescriptorError`.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        from_wire(py, data, "PeerAddress").map(|inner| PyPeerAddress { inner })
    }

    /// The address as bytes (stable wire encoding).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        to_wire(py, &self.inner, "PeerAddress")
    }

    /// Number of NICs of the peer's group.
    #[getter]
    fn nic_count(&self) -> usize {
        self.inner.nics.len()
    }

    /// The peer engine's incarnation.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.inner.incarnation.0
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyPeerAddress>()
            .map(|o| o.get().inner == self.inner)
            .unwrap_or(false)
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.inner.hash(&mut h);
        h.finish()
    }

    fn __repr__(&self) -> String {
        let nics: Vec<String> = self.inner.nics.iter().map(|a| a.to_string()).collect();
        format!("PeerAddress({})", nics.join(", "))
    }
}

/// A set of peers resolved by one engine (`add_peer_group`), for
/// `submit_scatter` and `submit_barrier`: member `j` receives destination
/// `j`.
#[pyclass(name = "PeerGroup", module = "weft._weft", frozen)]
pub struct PyPeerGroup {
    pub(crate) inner: weft::PeerGroupHandle,
}

#[pymethods]
impl PyPeerGroup {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("PeerGroup({} members)", self.inner.len())
    }
}

/// One destination of `submit_scatter`: `nbytes` bytes from the source at
/// `src_offset` into `dst` at `dst_offset`.
#[pyclass(name = "ScatterDst", module = "weft._weft", frozen)]
#[derive(Clone)]
pub struct PyScatterDst {
    pub(crate) inner: weft::ScatterDst,
}

#[pymethods]
impl PyScatterDst {
    #[new]
    #[pyo3(signature = (dst, nbytes, *, src_offset=0, dst_offset=0))]
    fn new(dst: PyRef<'_, PyMrDesc>, nbytes: u64, src_offset: u64, dst_offset: u64) -> Self {
        PyScatterDst {
            inner: weft::ScatterDst {
                len: nbytes,
                src_offset,
                dst: dst.inner.clone(),
                dst_offset,
            },
        }
    }

    /// Bytes to write.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.len
    }

    fn __repr__(&self) -> String {
        format!(
            "ScatterDst(nbytes={}, src_offset={}, dst_offset={})",
            self.inner.len, self.inner.src_offset, self.inner.dst_offset
        )
    }
}

/// Scatter destinations checked once by `TransferEngine.scatter_targets`,
/// for `submit_scatter_to`.
#[pyclass(name = "ScatterTargets", module = "weft._weft", frozen)]
pub struct PyScatterTargets {
    pub(crate) inner: weft::ScatterTargets,
}

#[pymethods]
impl PyScatterTargets {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// How many NICs (rkeys) every destination has: the source
    /// registration's group needs as many.
    #[getter]
    fn nics(&self) -> usize {
        self.inner.nics()
    }

    /// Whether every destination matched its member (then a submit does
    /// no per-destination look-up).
    #[getter]
    fn matched(&self) -> bool {
        self.inner.matched()
    }

    fn __repr__(&self) -> String {
        format!(
            "ScatterTargets({} destinations, {} NICs, matched={})",
            self.inner.len(),
            self.inner.nics(),
            self.inner.matched()
        )
    }
}

/// Scatter slices from a sequence of `(src_offset, dst_offset, nbytes)`
/// tuples or lists, or a 2-D `(n, 3)` array (numpy, or anything with
/// `shape` and `tolist()`); every value an int in `0..2**64`.
pub(crate) fn scatter_slices(rows: &Bound<'_, PyAny>) -> PyResult<Vec<weft::ScatterSlice>> {
    use pyo3::exceptions::PyTypeError;
    use pyo3::types::{PyBool, PyFloat, PyList, PyTuple};
    let py = rows.py();
    const SHAPE: &str = "scatter slices must be (src_offset, dst_offset, nbytes) per destination";
    let list = if rows.hasattr("shape")? && rows.hasattr("tolist")? {
        let shape: Vec<usize> = rows.getattr("shape")?.extract()?;
        if shape.len() != 2 || shape[1] != 3 {
            return Err(errors::invalid(
                py,
                format!("{SHAPE}: an array of shape (n, 3), got shape {shape:?}"),
            ));
        }
        rows.call_method0("tolist")?
    } else {
        rows.clone()
    };
    const FIELDS: [&str; 3] = ["src_offset", "dst_offset", "nbytes"];
    let mut out = Vec::new();
    for (j, row) in list.try_iter()?.enumerate() {
        let row = row?;
        if !row.is_instance_of::<PyTuple>() && !row.is_instance_of::<PyList>() {
            return Err(PyTypeError::new_err(format!(
                "{SHAPE}: slice {j} is a {}, not a tuple or list",
                row.get_type().name()?
            )));
        }
        if row.len()? != 3 {
            return Err(errors::invalid(
                py,
                format!("{SHAPE}: slice {j} has {} values", row.len()?),
            ));
        }
        let mut v = [0u64; 3];
        for (n, slot) in v.iter_mut().enumerate() {
            let x = row.get_item(n)?;
            if x.is_instance_of::<PyFloat>() || x.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err(format!(
                    "scatter slice {j}: {} must be an int, got {}",
                    FIELDS[n],
                    x.get_type().name()?
                )));
            }
            // An int too large even for i128 is out of range too.
            let k: Option<i128> = match x.extract::<i128>() {
                Ok(k) => Some(k),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) => None,
                Err(e) => return Err(e),
            };
            *slot = k.and_then(|k| u64::try_from(k).ok()).ok_or_else(|| {
                errors::invalid(
                    py,
                    format!("scatter slice {j}: {} = {x} is outside 0..2**64", FIELDS[n]),
                )
            })?;
        }
        out.push(weft::ScatterSlice {
            src_offset: v[0],
            dst_offset: v[1],
            len: v[2],
        });
    }
    Ok(out)
}

/// `Pages` from a list of ints or a 1-D integer numpy array of indices.
pub(crate) fn pages(indices: &Bound<'_, PyAny>, stride: u64, offset: u64) -> PyResult<weft::Pages> {
    let py = indices.py();
    let list = if indices.hasattr("dtype")? {
        let kind: String = indices.getattr("dtype")?.getattr("kind")?.extract()?;
        if kind != "i" && kind != "u" {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "page indices must be integers, got an array of dtype kind {kind:?}"
            )));
        }
        indices.call_method0("tolist")?
    } else {
        indices.clone()
    };
    let mut out = Vec::new();
    for (i, v) in list.try_iter()?.enumerate() {
        let v = v?;
        if v.is_instance_of::<pyo3::types::PyFloat>() || v.is_instance_of::<pyo3::types::PyBool>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "page index {i} must be an int, got {}",
                v.get_type().name()?
            )));
        }
        let n: i128 = v.extract()?;
        let n = u32::try_from(n).map_err(|_| {
            errors::invalid(
                py,
                format!("page index {i} = {n} is outside 0..=4294967295"),
            )
        })?;
        out.push(n);
    }
    Ok(weft::Pages {
        indices: out,
        stride,
        offset,
    })
}
