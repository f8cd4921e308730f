//! `RecvQueue`: a receive pool the caller polls (`TransferEngine.recv_queue`),
//! so a serving loop takes messages on its own thread, without a Python
//! callback per message.

use crate::errors;
use crate::transfer::SIGNAL_SLICE;
use crate::types::PyPeerAddress;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::time::{Duration, Instant};

/// Messages received into a polled pool, oldest first
/// (`TransferEngine.recv_queue(nbytes, count)`). `try_recv()` returns the
/// next message as `bytes` or `None`; `recv(timeout)` waits for one with
/// the GIL released. A receive error is raised (as the engine's exception)
/// in the message's place. `close()` (or dropping the queue) discards what
/// it holds and every later message; peers' SENDs still complete. Safe to
/// use from several threads.
#[pyclass(name = "RecvQueue", module = "weft._weft", frozen)]
pub struct PyRecvQueue {
    inner: weft::RecvQueue,
}

impl PyRecvQueue {
    pub(crate) fn new(q: weft::RecvQueue) -> Self {
        Self { inner: q }
    }

    /// The next message, waiting up to `timeout` with the GIL released,
    /// in slices between which Python's signal handlers run (Ctrl-C
    /// interrupts the wait).
    fn wait(
        &self,
        py: Python<'_>,
        timeout: Duration,
    ) -> PyResult<Option<Result<weft::RecvMsg, weft::EngineError>>> {
        let q = self.open()?;
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let now = Instant::now();
            let slice = deadline.map_or(SIGNAL_SLICE, |d| {
                d.saturating_duration_since(now).min(SIGNAL_SLICE)
            });
            if let Some(r) = py.detach(|| q.recv_timeout(slice)) {
                return Ok(Some(r));
            }
            if q.is_closed() {
                return Err(closed());
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
        }
    }

    fn open(&self) -> PyResult<&weft::RecvQueue> {
        if self.inner.is_closed() {
            Err(closed())
        } else {
            Ok(&self.inner)
        }
    }
}

/// Which of `peers` sent `m` (the first that matches), if any.
fn sender_index(m: &weft::RecvMsg, peers: &[PyRef<'_, PyPeerAddress>]) -> Option<usize> {
    peers.iter().position(|p| m.is_from(&p.inner))
}

/// The seconds of a `timeout` argument (`None`: without bound).
fn timeout_of(timeout: Option<f64>) -> PyResult<Duration> {
    match timeout {
        None => Ok(Duration::from_secs(u64::from(u32::MAX))),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s.min(4e9))),
        Some(s) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "timeout must be a finite number of seconds >= 0, got {s}"
        ))),
    }
}

/// The message as `bytes`, or the receive error raised.
fn deliver(
    py: Python<'_>,
    r: Option<Result<weft::RecvMsg, weft::EngineError>>,
) -> PyResult<Option<Py<PyBytes>>> {
    match r {
        None => Ok(None),
        Some(Ok(m)) => Ok(Some(PyBytes::new(py, &m).unbind())),
        Some(Err(e)) => Err(errors::engine_err(py, &e)),
    }
}

/// [`deliver`] with the sender's index in `peers`.
fn deliver_from(
    py: Python<'_>,
    r: Option<Result<weft::RecvMsg, weft::EngineError>>,
    peers: &[PyRef<'_, PyPeerAddress>],
) -> PyResult<Option<(Py<PyBytes>, Option<usize>)>> {
    match r {
        None => Ok(None),
        Some(Ok(m)) => Ok(Some((
            PyBytes::new(py, &m).unbind(),
            sender_index(&m, peers),
        ))),
        Some(Err(e)) => Err(errors::engine_err(py, &e)),
    }
}

#[pymethods]
impl PyRecvQueue {
    /// The next message, or `None` when none is waiting.
    fn try_recv(&self, py: Python<'_>) -> PyResult<Option<Py<PyBytes>>> {
        deliver(py, self.open()?.try_recv())
    }

    /// The next message, waiting up to `timeout` seconds (`None`: without
    /// bound) with the GIL released; `None` when none came in time.
    /// Raises `ShutDownError` once the engine is shut down and nothing is
    /// left.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyBytes>>> {
        let r = self.wait(py, timeout_of(timeout)?)?;
        deliver(py, r)
    }

    /// `recv`, also saying who sent the message: `(bytes, i)` where `i`
    /// is the index in `peers` (a list of `PeerAddress`) of the engine the
    /// message came from, or `None` when it is none of them. The sender is
    /// the NIC the fabric attributes the message to plus the incarnation
    /// its frame names (docs/engine.md: how far that can be trusted).
    #[pyo3(signature = (peers, timeout=None))]
    fn recv_from(
        &self,
        py: Python<'_>,
        peers: Vec<PyRef<'_, PyPeerAddress>>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(Py<PyBytes>, Option<usize>)>> {
        let r = self.wait(py, timeout_of(timeout)?)?;
        deliver_from(py, r, &peers)
    }

    /// `try_recv` with the sender, as `recv_from` gives it.
    fn try_recv_from(
        &self,
        py: Python<'_>,
        peers: Vec<PyRef<'_, PyPeerAddress>>,
    ) -> PyResult<Option<(Py<PyBytes>, Option<usize>)>> {
        deliver_from(py, self.open()?.try_recv(), &peers)
    }

    /// Messages (and errors) waiting now.
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The largest message the pool's buffers hold, in bytes.
    #[getter]
    fn max_message(&self) -> PyResult<u64> {
        Ok(self.inner.max_message())
    }

    /// Discards what is queued and every later message; a `recv` waiting
    /// in another thread raises. Idempotent.
    fn close(&self) {
        self.inner.close();
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    fn __repr__(&self) -> String {
        if self.inner.is_closed() {
            return "RecvQueue(closed)".into();
        }
        format!(
            "RecvQueue(queued={}, max_message={})",
            self.inner.len(),
            self.inner.max_message()
        )
    }
}

fn closed() -> PyErr {
    pyo3::exceptions::PyValueError::new_err("this RecvQueue is closed")
}
