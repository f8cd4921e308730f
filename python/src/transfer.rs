//! `Transfer`: the Python-visible state of one submitted transfer (or armed
//! immediate round), resolved by a Rust closure on the engine's callback
//! thread without taking the GIL.

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::errors;
use crate::memory::RegKeep;

/// How long a wait sleeps with the GIL released before it checks for
/// signals (Ctrl-C), so `KeyboardInterrupt` arrives within this bound.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The result slot of one transfer.
#[derive(Default)]
pub(crate) struct State {
    result: Mutex<Option<weft::DoneResult>>,
    cv: Condvar,
}

impl State {
    fn set(&self, r: weft::DoneResult) {
        *self.result.lock() = Some(r);
        self.cv.notify_all();
    }

    fn get(&self) -> Option<weft::DoneResult> {
        self.result.lock().clone()
    }

    /// The result, if it arrives before `until`.
    fn wait_until(&self, until: Instant) -> Option<weft::DoneResult> {
        let mut g = self.result.lock();
        while g.is_none() {
            if self.cv.wait_until(&mut g, until).timed_out() {
                break;
            }
        }
        g.clone()
    }
}

/// A fresh state and the `OnDone` that resolves it, holding `keep` (the
/// registrations the transfer uses) until it finishes.
pub(crate) fn on_done(keep: Vec<Arc<RegKeep>>) -> (Arc<State>, weft::OnDone) {
    let state = Arc::new(State::default());
    let s = Arc::clone(&state);
    let cb = weft::OnDone::callback(move |r| {
        s.set(r);
        // Released after the result is visible; the last holder of a
        // registration takes the GIL in `RegKeep::drop`.
        drop(keep);
    });
    (state, cb)
}

/// A submitted transfer (or an armed immediate round): wait for it, or poll
/// it. The transfer itself cannot be cancelled; a wait that times out or is
/// interrupted leaves it running.
#[pyclass(name = "Transfer", module = "weft._weft", frozen)]
pub struct PyTransfer {
    id: Option<u64>,
    state: Arc<State>,
}

impl PyTransfer {
    pub(crate) fn new(id: Option<u64>, state: Arc<State>) -> Self {
        PyTransfer { id, state }
    }
}

#[pymethods]
impl PyTransfer {
    /// The engine's transfer id (`None` for an immediate round).
    #[getter]
    fn id(&self) -> Option<u64> {
        self.id
    }

    /// Whether it has finished (successfully or not).
    fn done(&self) -> bool {
        self.state.result.lock().is_some()
    }

    /// The error it failed with; `None` while pending or after success.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        match self.state.get() {
            Some(Err(e)) => Some(errors::engine_err(py, &e)),
            _ => None,
        }
    }

    /// Blocks until the transfer finishes, with the GIL released. Returns
    /// `None`, or raises the transfer's error; raises `WaitTimeoutError`
    /// after `timeout` seconds (the transfer goes on). Ctrl-C raises
    /// `KeyboardInterrupt` promptly.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = match timeout {
            None => None,
            Some(t) => {
                let d = Duration::try_from_secs_f64(t).map_err(|_| {
                    errors::invalid(py, format!("timeout must be a finite number >= 0, got {t}"))
                })?;
                Some(Instant::now() + d)
            }
        };
        loop {
            let now = Instant::now();
            let slice_end = now + SIGNAL_SLICE;
            let until = deadline.map_or(slice_end, |d| d.min(slice_end));
            let state = &self.state;
            if let Some(r) = py.detach(|| state.wait_until(until)) {
                return r.map_err(|e| errors::engine_err(py, &e));
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(errors::new_err(
                    py,
                    "WaitTimeoutError",
                    None,
                    format!(
                        "transfer not finished after {}s (it goes on)",
                        timeout.unwrap_or_default()
                    ),
                ));
            }
        }
    }

    fn __repr__(&self) -> String {
        let status = match self.state.get() {
            None => "pending",
            Some(Ok(())) => "ok",
            Some(Err(_)) => "failed",
        };
        match self.id {
            Some(id) => format!("Transfer(id={id}, {status})"),
            None => format!("Transfer(imm round, {status})"),
        }
    }
}
