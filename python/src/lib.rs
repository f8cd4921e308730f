//! `weft._weft`: the Python extension module of weft.
//!
//! The public API is re-exported by the pure-Python package `weft`
//! (`python/weft/__init__.py`); see `python/weft/_weft.pyi` for the typed
//! signatures. Every blocking call runs with the GIL released; engine
//! threads take it only to drop the last reference to registered memory.

#![deny(unsafe_code)]

mod buffer_ffi;
mod cuda;
mod dlpack;
mod engine;
mod errors;
mod imm;
mod items;
mod kv;
mod live;
mod memory;
mod metrics;
mod moe;
mod provider;
mod recvq;
mod rendezvous;
mod rl;
mod transfer;
mod types;
mod watcher;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _weft(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(provider::providers, m)?)?;
    m.add_function(wrap_pyfunction!(provider::provider, m)?)?;
    m.add_class::<provider::PyProviderStatus>()?;
    m.add_class::<provider::PyBackend>()?;
    m.add_class::<engine::PyTransferEngine>()?;
    m.add_class::<memory::PyRegistration>()?;
    m.add_class::<imm::PyImm>()?;
    m.add_class::<types::PyMrDesc>()?;
    m.add_class::<types::PyImmCounts>()?;
    m.add_class::<transfer::PyTransfer>()?;
    m.add_class::<types::PyPeerAddress>()?;
    m.add_class::<types::PyPeerGroup>()?;
    m.add_class::<types::PyScatterDst>()?;
    m.add_class::<types::PyScatterTargets>()?;
    m.add_class::<watcher::PyUvmWatcher>()?;
    m.add_class::<recvq::PyRecvQueue>()?;
    m.add_class::<kv::PyKvLayout>()?;
    m.add_class::<kv::PyKvDecoder>()?;
    m.add_class::<kv::PyKvPrefiller>()?;
    m.add_function(wrap_pyfunction!(kv::tp_readers, m)?)?;
    m.add_class::<rl::PyRlPlan>()?;
    m.add_class::<rl::PyRlDirectory>()?;
    m.add_class::<rl::PyRlTrainer>()?;
    m.add_class::<rl::PyRlInference>()?;
    moe::register(m)?;
    m.add_class::<metrics::PyMetricsServer>()?;
    m.add_class::<rendezvous::PyStore>()?;
    m.add_class::<rendezvous::PySession>()?;
    m.add_class::<rendezvous::PyNamespace>()?;
    m.add_class::<rendezvous::PyPeerRecord>()?;
    m.add_class::<rendezvous::PyPeerEvent>()?;
    m.add_class::<rendezvous::PyPeerWatch>()?;
    m.add_function(wrap_pyfunction!(rendezvous::open_store, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metrics_text, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::serve_metrics, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let shutdown_all = wrap_pyfunction!(live::_shutdown_all, m)?;
    m.add_function(shutdown_all.clone())?;
    // Engines stop (and their threads stop entering Python) before the
    // interpreter finalizes.
    m.py()
        .import("atexit")?
        .call_method1("register", (shutdown_all,))?;
    Ok(())
}
