//! weft's rendezvous from Python (`weft.rendezvous`): stores (`mem`,
//! `dir:<path>`, `etcd:<endpoints>`), sessions holding a lease, namespaces
//! of peer and memory-region records, and watches of the peers.
//!
//! Records read from a store are untrusted: a record that does not decode
//! is skipped (counted in `Namespace.skipped_records`) or raises
//! `RendezvousError`, never crashes; every blocking call releases the GIL.

use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Duration;

use pyo3::types::PyBytes;
use weft::rendezvous::{
    self, Namespace, PeerEvent, PeerRecord, Records, Session, Store, StoreError,
};

use crate::engine::PyTransferEngine;
use crate::errors::new_err;
use crate::types::{PyMrDesc, PyPeerAddress};

/// The Python exception for a store error (classes in `weft/_errors.py`).
pub(crate) fn store_err(py: Python<'_>, e: &StoreError) -> PyErr {
    let (class, kind) = match e {
        StoreError::Unavailable { .. } => ("StoreUnavailableError", "unavailable"),
        StoreError::LeaseNotFound { .. } => ("LeaseLostError", "lease_not_found"),
        StoreError::Timeout { .. } => ("RendezvousTimeoutError", "timeout"),
        StoreError::Spec { .. } => ("InvalidRendezvousArgumentError", "spec"),
        StoreError::InvalidKey { .. } => ("InvalidRendezvousArgumentError", "invalid_key"),
        StoreError::Protocol { .. } => ("RendezvousError", "protocol"),
        StoreError::Io { .. } => ("RendezvousError", "io"),
        StoreError::Record { .. } => ("RendezvousError", "record"),
        StoreError::WatchClosed { .. } => ("RendezvousError", "watch_closed"),
        _ => ("RendezvousError", "rendezvous"),
    };
    new_err(py, class, kind, e.to_string())
}

/// The longest timeout or lease accepted (about 31 years): longer ones
/// would overflow the clock arithmetic behind them.
const MAX_SECONDS: f64 = 1e9;

/// Seconds from Python as a `Duration` (finite, not negative, at most
/// [`MAX_SECONDS`]).
fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    if s > MAX_SECONDS {
        return Err(crate::errors::invalid(
            py,
            format!("{what} must be at most {MAX_SECONDS} seconds, got {s}"),
        ));
    }
    Duration::try_from_secs_f64(s).map_err(|_| {
        crate::errors::invalid(
            py,
            format!("{what} must be a finite, non-negative number of seconds, got {s}"),
        )
    })
}

/// A rendezvous store: where processes publish and find each other.
#[pyclass(name = "Store", module = "weft._weft", frozen)]
pub struct PyStore {
    inner: Arc<dyn Store>,
}

#[pymethods]
impl PyStore {
    /// The store's endpoint (`mem`, the directory, the etcd endpoints).
    #[getter]
    fn endpoint(&self) -> String {
        self.inner.endpoint().to_string()
    }

    fn __repr__(&self) -> String {
        format!("Store({})", self.inner.endpoint())
    }
}

/// Opens a store from its spec: `mem` (this process only), `dir:<path>`
/// (processes of one host sharing a directory) or
/// `etcd:http://host:2379[,http://...]`.
#[pyfunction]
pub fn open_store(py: Python<'_>, spec: &str) -> PyResult<PyStore> {
    let parsed = spec.parse().map_err(|e: StoreError| store_err(py, &e))?;
    let inner = py
        .detach(|| rendezvous::open(&parsed))
        .map_err(|e| store_err(py, &e))?;
    Ok(PyStore { inner })
}

/// A lease on the store, kept alive by a background thread: what a
/// session publishes disappears when it is closed or its process dies
/// (after `ttl` seconds). Context manager = `close()`.
#[pyclass(name = "Session", module = "weft._weft")]
pub struct PySession {
    inner: Option<Session>,
}

impl PySession {
    fn get(&self, py: Python<'_>) -> PyResult<&Session> {
        self.inner.as_ref().ok_or_else(|| {
            new_err(
                py,
                "RendezvousError",
                "closed",
                "the session is closed".into(),
            )
        })
    }
}

impl Drop for PySession {
    fn drop(&mut self) {
        // Closing revokes the lease (a store round trip): never with the
        // GIL held.
        if let Some(s) = self.inner.take() {
            let _ = Python::try_attach(|py| py.detach(|| drop(s)));
        }
    }
}

#[pymethods]
impl PySession {
    /// A session on `store` with a lease of `ttl` seconds.
    #[new]
    #[pyo3(signature = (store, ttl=10.0))]
    fn new(py: Python<'_>, store: &PyStore, ttl: f64) -> PyResult<Self> {
        let ttl = seconds(py, "ttl", ttl)?;
        let s = Arc::clone(&store.inner);
        let inner = py
            .detach(|| Session::new(s, ttl))
            .map_err(|e| store_err(py, &e))?;
        Ok(PySession { inner: Some(inner) })
    }

    /// The lease id.
    #[getter]
    fn lease(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get(py)?.lease().0)
    }

    /// Whether the lease is being kept alive.
    #[getter]
    fn healthy(&self) -> bool {
        self.inner.as_ref().is_some_and(Session::is_healthy)
    }

    /// Revokes the lease: everything published under it disappears
    /// (idempotent).
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        match self.inner.take() {
            Some(s) => py.detach(|| s.close()).map_err(|e| store_err(py, &e)),
            None => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        _args: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

/// One process's engine as others find it in a namespace.
#[pyclass(name = "PeerRecord", module = "weft._weft", frozen)]
pub struct PyPeerRecord {
    inner: PeerRecord,
}

#[pymethods]
impl PyPeerRecord {
    /// The peer's name in the namespace.
    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    /// The peer engine's incarnation (bumped when the process restarts).
    #[getter]
    fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// How many domain groups the peer's engine has.
    #[getter]
    fn group_count(&self) -> usize {
        self.inner.groups.len()
    }

    /// The address of the peer's group `group`, for `add_peer_group`,
    /// `submit_send` or `remove_peer`.
    #[pyo3(signature = (group=0))]
    fn address(&self, py: Python<'_>, group: usize) -> PyResult<PyPeerAddress> {
        rendezvous::group_address(&self.inner, group)
            .map(|inner| PyPeerAddress { inner })
            .ok_or_else(|| {
                crate::errors::invalid(
                    py,
                    format!(
                        "peer {} has {} groups, no group {group}",
                        self.inner.name,
                        self.inner.groups.len()
                    ),
                )
            })
    }

    fn __repr__(&self) -> String {
        format!(
            "PeerRecord(name={:?}, generation={:#x}, groups={})",
            self.inner.name,
            self.inner.generation,
            self.inner.groups.len()
        )
    }
}

/// A change among a namespace's peers: `kind` is `"join"` (a peer
/// appeared, or was there when the watch started), `"update"` (it
/// republished, e.g. restarted) or `"leave"` (its record went: withdrawn,
/// session closed or lease expired); `record` is set except on leave.
#[pyclass(name = "PeerEvent", module = "weft._weft", frozen, get_all)]
pub struct PyPeerEvent {
    /// `"join"`, `"update"` or `"leave"`.
    kind: &'static str,
    /// The peer's name.
    name: String,
    /// The peer's record (`None` on leave).
    record: Option<Py<PyPeerRecord>>,
}

#[pymethods]
impl PyPeerEvent {
    fn __repr__(&self) -> String {
        format!("PeerEvent({}, {:?})", self.kind, self.name)
    }
}

/// A watch of a namespace's peers (see `Namespace.watch_peers`).
#[pyclass(name = "PeerWatch", module = "weft._weft", frozen)]
pub struct PyPeerWatch {
    /// One receiver at a time (the watch is not `Sync`).
    inner: parking_lot::Mutex<rendezvous::PeerWatch>,
}

#[pymethods]
impl PyPeerWatch {
    /// The next change, waiting up to `timeout` seconds; `None` if none came.
    #[pyo3(signature = (timeout=1.0))]
    fn recv(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<PyPeerEvent>> {
        let t = seconds(py, "timeout", timeout)?;
        let ev = py
            .detach(|| self.inner.lock().recv_timeout(t))
            .map_err(|e| store_err(py, &e))?;
        let record = |r: PeerRecord| Py::new(py, PyPeerRecord { inner: r });
        Ok(match ev {
            None => None,
            Some(PeerEvent::Joined(r)) => Some(PyPeerEvent {
                kind: "join",
                name: r.name.clone(),
                record: Some(record(r)?),
            }),
            Some(PeerEvent::Updated(r)) => Some(PyPeerEvent {
                kind: "update",
                name: r.name.clone(),
                record: Some(record(r)?),
            }),
            Some(PeerEvent::Left { name }) => Some(PyPeerEvent {
                kind: "leave",
                name,
                record: None,
            }),
            Some(_) => None,
        })
    }
}

/// A namespace of a store: the peers and memory regions of one job.
#[pyclass(name = "Namespace", module = "weft._weft", frozen)]
pub struct PyNamespace {
    inner: Namespace,
}

#[pymethods]
impl PyNamespace {
    /// Namespace `name` of `store` (non-empty, no `/` in it).
    #[new]
    fn new(py: Python<'_>, store: &PyStore, name: &str) -> PyResult<Self> {
        if name.is_empty() || name.contains('/') {
            return Err(store_err(
                py,
                &StoreError::InvalidKey {
                    endpoint: store.inner.endpoint().to_string(),
                    key: name.to_string(),
                    reason: "a namespace must be non-empty and contain no '/'",
                },
            ));
        }
        Ok(PyNamespace {
            inner: Namespace::new(Arc::clone(&store.inner), name),
        })
    }

    /// The namespace's name.
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    /// Records read from the store that did not decode and were skipped.
    #[getter]
    fn skipped_records(&self) -> u64 {
        self.inner.skipped_records()
    }

    /// Publishes `engine`'s addresses as peer `name` under `session`'s
    /// lease, with the engine's incarnation as the record's generation.
    fn publish_engine(
        &self,
        py: Python<'_>,
        session: &PySession,
        name: &str,
        engine: &PyTransferEngine,
    ) -> PyResult<()> {
        let s = session.get(py)?;
        py.detach(|| rendezvous::publish_engine(&self.inner, s, name, &engine.engine))
            .map_err(|e| store_err(py, &e))
    }

    /// Publishes descriptor `desc` as region `mr` of peer `name` under
    /// `session`'s lease (the descriptor's incarnation is the generation).
    fn publish_mr(
        &self,
        py: Python<'_>,
        session: &PySession,
        name: &str,
        mr: &str,
        desc: &PyMrDesc,
    ) -> PyResult<()> {
        let s = session.get(py)?;
        let gen = desc.inner.incarnation.0;
        py.detach(|| self.inner.publish_mr(s, name, mr, gen, &desc.inner))
            .map_err(|e| store_err(py, &e))
    }

    /// Peer `name`'s record, or `None`.
    fn peer(&self, py: Python<'_>, name: &str) -> PyResult<Option<PyPeerRecord>> {
        py.detach(|| self.inner.peer(name))
            .map(|r| r.map(|inner| PyPeerRecord { inner }))
            .map_err(|e| store_err(py, &e))
    }

    /// Every peer's record (records that do not decode are skipped).
    fn peers(&self, py: Python<'_>) -> PyResult<Vec<PyPeerRecord>> {
        py.detach(|| self.inner.peers())
            .map(|v| v.into_iter().map(|inner| PyPeerRecord { inner }).collect())
            .map_err(|e| store_err(py, &e))
    }

    /// Waits up to `timeout` seconds for peer `name` to publish.
    #[pyo3(signature = (name, timeout=30.0))]
    fn wait_peer(&self, py: Python<'_>, name: &str, timeout: f64) -> PyResult<PyPeerRecord> {
        let t = seconds(py, "timeout", timeout)?;
        py.detach(|| self.inner.wait_peer(name, t))
            .map(|inner| PyPeerRecord { inner })
            .map_err(|e| store_err(py, &e))
    }

    /// Region `mr` of peer `name`, or `None`.
    fn mr(&self, py: Python<'_>, name: &str, mr: &str) -> PyResult<Option<PyMrDesc>> {
        py.detach(|| self.inner.mr(name, mr))
            .map(|r| r.map(|r| PyMrDesc { inner: r.desc }))
            .map_err(|e| store_err(py, &e))
    }

    /// Waits up to `timeout` seconds for peer `name` to publish region `mr`.
    #[pyo3(signature = (name, mr, timeout=30.0))]
    fn wait_mr(&self, py: Python<'_>, name: &str, mr: &str, timeout: f64) -> PyResult<PyMrDesc> {
        let t = seconds(py, "timeout", timeout)?;
        py.detach(|| self.inner.wait_mr(name, mr, t))
            .map(|r| PyMrDesc { inner: r.desc })
            .map_err(|e| store_err(py, &e))
    }

    /// Publishes `data` as record `name` of kind `kind` (an application's
    /// own bytes: a plan input, a role) under `session`'s lease; it
    /// disappears when the session closes or its lease runs out. Readers
    /// must treat the bytes as untrusted.
    fn publish_record(
        &self,
        py: Python<'_>,
        session: &PySession,
        kind: &str,
        name: &str,
        data: Vec<u8>,
    ) -> PyResult<()> {
        let s = session.get(py)?;
        let records: Records<Vec<u8>> = Records::new(&self.inner, kind);
        py.detach(|| records.publish(s, name, &data))
            .map_err(|e| store_err(py, &e))
    }

    /// Record `name` of kind `kind`, or `None`.
    fn record<'py>(
        &self,
        py: Python<'py>,
        kind: &str,
        name: &str,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let records: Records<Vec<u8>> = Records::new(&self.inner, kind);
        py.detach(|| records.get(name))
            .map(|r| r.map(|b| PyBytes::new(py, &b)))
            .map_err(|e| store_err(py, &e))
    }

    /// Waits up to `timeout` seconds for record `name` of kind `kind`.
    #[pyo3(signature = (kind, name, timeout=30.0))]
    fn wait_record<'py>(
        &self,
        py: Python<'py>,
        kind: &str,
        name: &str,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let t = seconds(py, "timeout", timeout)?;
        let records: Records<Vec<u8>> = Records::new(&self.inner, kind);
        py.detach(|| records.wait(name, t))
            .map(|b| PyBytes::new(py, &b))
            .map_err(|e| store_err(py, &e))
    }

    /// Watches the peers: first a `"join"` for each present, then changes.
    fn watch_peers(&self, py: Python<'_>) -> PyResult<PyPeerWatch> {
        py.detach(|| self.inner.watch_peers())
            .map(|w| PyPeerWatch {
                inner: parking_lot::Mutex::new(w),
            })
            .map_err(|e| store_err(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "Namespace({:?} on {})",
            self.inner.name(),
            self.inner.store().endpoint()
        )
    }
}
