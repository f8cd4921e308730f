//! `Transfer`: the Python-visible state of one submitted transfer (or armed
//! immediate round), resolved by a Rust closure on the engine's callback
//! thread. The closure takes the GIL only when Python is attached to the
//! transfer (a done-callback or an awaiting asyncio future); a plain
//! `wait()` never makes an engine thread touch Python.

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::errors;
use crate::memory::RegKeep;

/// How long a wait sleeps with the GIL released before it checks for
/// signals (Ctrl-C), so `KeyboardInterrupt` arrives within this bound.
pub(crate) const SIGNAL_SLICE: Duration = Duration::from_millis(50);

thread_local! {
    /// Set while Python code runs from a weft callback (on the engine's
    /// callback thread), where blocking on another completion would hang.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
    /// Whether this (weft-owned) thread was given a lasting Python thread
    /// state by `engine_attach`.
    static PRIMED: Cell<bool> = const { Cell::new(false) };
}

/// `Python::try_attach` for weft's own threads (callback, watcher). The
/// first call on such a thread gives it a Python thread state that it keeps
/// (`PyGILState_Ensure` never matched by a release, then the GIL dropped),
/// so later calls only take the GIL instead of creating and destroying a
/// thread state each time (measured by python/bench/overhead.py). Never
/// primes a thread that already has a thread state (a Python thread).
pub(crate) fn engine_attach<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> Option<R> {
    if !PRIMED.with(|p| p.replace(true)) {
        // SAFETY: only when the interpreter is initialized and this thread
        // has no thread state: `PyGILState_Ensure` then creates one and
        // takes the GIL, `PyEval_SaveThread` releases the GIL keeping the
        // state (the gilstate counter stays at 1, so pyo3's later
        // Ensure/Release pairs never delete it). During finalization
        // pyo3's `PyGILState_Ensure` wrapper hangs the thread instead of
        // unwinding, as for every attach.
        #[allow(unsafe_code)]
        unsafe {
            use pyo3::ffi;
            if ffi::Py_IsInitialized() != 0 && ffi::PyGILState_GetThisThreadState().is_null() {
                let _ = ffi::PyGILState_Ensure();
                ffi::PyEval_SaveThread();
            }
        }
    }
    Python::try_attach(f)
}

/// Whether the current thread is running a Python callback for weft.
pub(crate) fn in_callback() -> bool {
    IN_CALLBACK.with(Cell::get)
}

/// Runs `f` with the in-callback flag set (restored after, even on panic
/// unwinding through pyo3).
pub(crate) fn as_callback<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_CALLBACK.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(IN_CALLBACK.with(|c| c.replace(true)));
    f()
}

/// The `CallbackDeadlockError` for a blocking call made from a callback.
pub(crate) fn deadlock_err(py: Python<'_>, what: &str) -> PyErr {
    errors::new_err(
        py,
        "CallbackDeadlockError",
        "callback_deadlock",
        format!(
            "{what} called from a weft callback would hang (callbacks run one at a time on \
             weft's callback thread): attach another callback or await instead"
        ),
    )
}

/// Counters of the binding itself, per engine.
#[derive(Default)]
pub(crate) struct BindingStats {
    /// Python callbacks that raised (reported through `sys.unraisablehook`).
    pub(crate) callback_errors: AtomicU64,
}

/// Reports an exception raised by a callback without propagating it: the
/// engine goes on.
pub(crate) fn report(py: Python<'_>, stats: &BindingStats, err: PyErr, cb: &Bound<'_, PyAny>) {
    stats.callback_errors.fetch_add(1, Ordering::Relaxed);
    err.write_unraisable(py, Some(cb));
}

/// Python attached to a pending transfer.
enum Hook {
    /// `fn(transfer)`.
    Call(Py<PyAny>, Py<PyTransfer>),
    /// An asyncio future of `loop`, resolved through
    /// `loop.call_soon_threadsafe`.
    Future(Py<PyAny>, Py<PyAny>),
}

#[derive(Default)]
struct Slot {
    result: Option<weft::DoneResult>,
    hooks: Vec<Hook>,
}

/// The result slot of one transfer.
pub(crate) struct State {
    slot: Mutex<Slot>,
    cv: Condvar,
    stats: Arc<BindingStats>,
}

impl State {
    fn get(&self) -> Option<weft::DoneResult> {
        self.slot.lock().result.clone()
    }

    /// The result, if it arrives before `until`.
    fn wait_until(&self, until: Instant) -> Option<weft::DoneResult> {
        let mut g = self.slot.lock();
        while g.result.is_none() {
            if self.cv.wait_until(&mut g, until).timed_out() {
                break;
            }
        }
        g.result.clone()
    }

    /// Stores the result and runs what Python attached (callback thread).
    fn finish(&self, r: weft::DoneResult) {
        let hooks = {
            let mut g = self.slot.lock();
            g.result = Some(r.clone());
            std::mem::take(&mut g.hooks)
        };
        self.cv.notify_all();
        if hooks.is_empty() {
            return;
        }
        // `None` during interpreter finalization: nothing left to run.
        let _ = engine_attach(|py| as_callback(|| run_hooks(py, &self.stats, hooks, &r)));
    }

    /// Attaches `hook`, unless the transfer is already done: then returns
    /// it with the result, for the caller to run.
    fn attach(&self, hook: Hook) -> Option<(Hook, weft::DoneResult)> {
        let mut g = self.slot.lock();
        match &g.result {
            Some(r) => Some((hook, r.clone())),
            None => {
                g.hooks.push(hook);
                None
            }
        }
    }
}

fn run_hooks(py: Python<'_>, stats: &BindingStats, hooks: Vec<Hook>, r: &weft::DoneResult) {
    for h in hooks {
        run_hook(py, stats, h, r);
    }
}

fn run_hook(py: Python<'_>, stats: &BindingStats, h: Hook, r: &weft::DoneResult) {
    match h {
        Hook::Call(cb, t) => {
            let cb = cb.bind(py);
            if let Err(e) = cb.call1((t,)) {
                report(py, stats, e, cb);
            }
        }
        Hook::Future(lp, fut) => {
            let exc = r
                .as_ref()
                .err()
                .map(|e| errors::engine_err(py, e).into_value(py));
            let res = py
                .import("weft._aio")
                .and_then(|m| m.getattr("_resolve"))
                .and_then(|f| {
                    lp.bind(py)
                        .call_method1("call_soon_threadsafe", (f, fut.bind(py), exc))
                });
            // A closed loop refuses with RuntimeError: nobody awaits any
            // more, nothing to report.
            if let Err(e) = res {
                if !e.is_instance_of::<pyo3::exceptions::PyRuntimeError>(py) {
                    report(py, stats, e, lp.bind(py));
                }
            }
        }
    }
}

/// A fresh state and the `OnDone` that resolves it, holding `keep` (the
/// registrations the transfer uses) until it finishes.
pub(crate) fn on_done(
    keep: Vec<Arc<RegKeep>>,
    stats: &Arc<BindingStats>,
) -> (Arc<State>, weft::OnDone) {
    let state = Arc::new(State {
        slot: Mutex::new(Slot::default()),
        cv: Condvar::new(),
        stats: Arc::clone(stats),
    });
    let s = Arc::clone(&state);
    let cb = weft::OnDone::callback(move |r| {
        s.finish(r);
        // Released after the result is visible; the last holder of a
        // registration takes the GIL in `RegKeep::drop`.
        drop(keep);
    });
    (state, cb)
}

/// The `Transfer` of a submitted request, with `callback` attached.
pub(crate) fn submitted(
    py: Python<'_>,
    id: Option<u64>,
    state: Arc<State>,
    callback: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyTransfer>> {
    let t = Py::new(py, PyTransfer { id, state })?;
    if let Some(cb) = callback {
        PyTransfer::add_done_callback(t.bind(py), cb)?;
    }
    Ok(t)
}

/// A submitted transfer (or an armed immediate round): wait for it, await
/// it, attach callbacks, or poll it. The transfer itself cannot be
/// cancelled; a wait that times out or is interrupted leaves it running.
#[pyclass(name = "Transfer", module = "weft._weft", frozen)]
pub struct PyTransfer {
    id: Option<u64>,
    state: Arc<State>,
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
        self.state.slot.lock().result.is_some()
    }

    /// The error it failed with; `None` while pending or after success.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        match self.state.get() {
            Some(Err(e)) => Some(errors::engine_err(py, &e)),
            _ => None,
        }
    }

    /// Calls `fn(transfer)` once it finishes: on weft's callback thread
    /// (holding the GIL only while `fn` runs), or at once on this thread if
    /// it already has. An exception `fn` raises goes to
    /// `sys.unraisablehook` and is counted in `stats()["callback_errors"]`;
    /// the engine goes on.
    fn add_done_callback(slf: &Bound<'_, Self>, func: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        if !func.is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "the callback must be callable",
            ));
        }
        let this = slf.get();
        let hook = Hook::Call(func.clone().unbind(), slf.clone().unbind());
        if let Some((hook, r)) = this.state.attach(hook) {
            run_hook(py, &this.state.stats, hook, &r);
        }
        Ok(())
    }

    /// Blocks until the transfer finishes, with the GIL released. Returns
    /// `None`, or raises the transfer's error; raises `WaitTimeoutError`
    /// after `timeout` seconds (the transfer goes on). Ctrl-C raises
    /// `KeyboardInterrupt` promptly. From a weft callback, waiting for an
    /// unfinished transfer raises `CallbackDeadlockError`.
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
        if let Some(r) = self.state.get() {
            return r.map_err(|e| errors::engine_err(py, &e));
        }
        if in_callback() {
            return Err(deadlock_err(py, "Transfer.wait()"));
        }
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
                    "wait_timeout",
                    format!(
                        "transfer not finished after {}s (it goes on)",
                        timeout.unwrap_or_default()
                    ),
                ));
            }
        }
    }

    /// `await transfer` in asyncio: resolves on the running loop through
    /// `loop.call_soon_threadsafe` from weft's callback thread (no thread
    /// per transfer). Cancelling the awaiting task does not cancel the
    /// transfer.
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let lp = py.import("asyncio")?.call_method0("get_running_loop")?;
        let fut = lp.call_method0("create_future")?;
        let this = slf.get();
        let hook = Hook::Future(lp.unbind(), fut.clone().unbind());
        if let Some((_, r)) = this.state.attach(hook) {
            match r {
                Ok(()) => fut.call_method1("set_result", (py.None(),))?,
                Err(e) => fut.call_method1(
                    "set_exception",
                    (errors::engine_err(py, &e).into_value(py),),
                )?,
            };
        }
        fut.call_method0("__await__")
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
