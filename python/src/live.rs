//! The live engines of the process: shut down at interpreter exit
//! (`atexit`, registered by the module) so that weft's threads stop calling
//! into Python before the interpreter finalizes, and listed by
//! `weft.metrics_text()`. Keyed by a per-object serial.

use parking_lot::Mutex;
use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::transfer::BindingStats;

type Entry = (u64, weft::TransferEngine, Arc<BindingStats>);

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static SERIAL: AtomicU64 = AtomicU64::new(0);

/// A fresh serial for a new engine object.
pub(crate) fn next_serial() -> u64 {
    SERIAL.fetch_add(1, Ordering::Relaxed)
}

/// Lists engine `serial`.
pub(crate) fn add(serial: u64, engine: &weft::TransferEngine, stats: &Arc<BindingStats>) {
    LIVE.lock()
        .push((serial, engine.clone(), Arc::clone(stats)));
}

/// Forgets engine `serial` (shut down or dropped).
pub(crate) fn remove(serial: u64) {
    LIVE.lock().retain(|(s, _, _)| *s != serial);
}

/// The live engines and their binding counters, in creation order.
pub(crate) fn live() -> Vec<(weft::TransferEngine, Arc<BindingStats>)> {
    LIVE.lock()
        .iter()
        .map(|(_, e, s)| (e.clone(), Arc::clone(s)))
        .collect()
}

/// Shuts down every live engine (the module's `atexit` hook).
#[pyfunction]
pub fn _shutdown_all(py: Python<'_>) {
    let all = std::mem::take(&mut *LIVE.lock());
    py.detach(|| {
        for (_, e, _) in &all {
            e.shutdown();
        }
    });
}
