//! `weft.KvPrefiller`: the prefill side, serving offered prompts by key
//! (`weft_kvcache::Offers`).

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;
use std::time::Duration;
use weft_kvcache::{KvError, Offers, Prefiller};

use super::{config, failure, kv_err, regions, PyKvLayout};
use crate::engine::PyTransferEngine;
use crate::memory::RegKeep;
use crate::types::PyPeerAddress;

/// The prefill side of KvCache transfer over a `TransferEngine`: registers
/// the KV cache (`kv`: one tensor for every layer, or a list with one per
/// layer; `tail`: optional) and serves decoders' requests from prompts the
/// application *offers* under a key (the decoder's request carries the key
/// as its `meta`). An offer serves one request, from the offered blocks
/// only; a request for a key not offered waits up to `hold` seconds for
/// the offer, then is refused. The prefiller takes the engine's receives:
/// give it an engine of its own. Thread-safe; every call that may block
/// releases the GIL.
#[pyclass(name = "KvPrefiller", module = "weft._weft", frozen)]
pub struct PyKvPrefiller {
    offers: Mutex<Offers>,
    pre: Arc<Prefiller>,
    layout: PyKvLayout,
    _engine: Py<PyTransferEngine>,
    keep: Mutex<Vec<Arc<RegKeep>>>,
}

fn secs(py: Python<'_>, v: f64, what: &str) -> PyResult<Duration> {
    if v.is_finite() && (0.0..=1e9).contains(&v) {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(crate::errors::invalid(
            py,
            format!("{what} must be in [0, 1e9] seconds, not {v}"),
        ))
    }
}

#[pymethods]
impl PyKvPrefiller {
    #[new]
    #[pyo3(signature = (engine, layout, kv, tail = None, hold = 30.0, heartbeat_interval = None, heartbeat_timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: Py<PyTransferEngine>,
        layout: PyKvLayout,
        kv: &Bound<'_, PyAny>,
        tail: Option<&Bound<'_, PyAny>>,
        hold: f64,
        heartbeat_interval: Option<f64>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let cfg = config(heartbeat_interval, heartbeat_timeout)?;
        let hold = secs(py, hold, "hold")?;
        let (regions, keep) = regions(py, kv, tail, false)?;
        let eng = Arc::new(engine.get().engine.clone());
        let l = layout.inner;
        let (pre, offers) = py
            .detach(|| -> Result<_, KvError> {
                let pre = Arc::new(Prefiller::new(eng, l, regions, cfg)?);
                let offers = Offers::new(pre.clone(), hold)?;
                Ok((pre, offers))
            })
            .map_err(|e| kv_err(py, &e))?;
        Ok(Self {
            offers: Mutex::new(offers),
            pre,
            layout,
            _engine: engine,
            keep: Mutex::new(keep),
        })
    }

    /// This prefiller's address (what decoders add).
    #[getter]
    fn address(&self) -> PyPeerAddress {
        PyPeerAddress {
            inner: self.pre.address(),
        }
    }

    /// The cache's layout.
    #[getter]
    fn layout(&self) -> PyKvLayout {
        self.layout.clone()
    }

    /// Offers the prompt in block ids `pages` (prompt order) and tail slot
    /// `tail_slot` under `key`. `ready`: steps already computed (default:
    /// all — every layer, and the tail if the layout has one); report more
    /// with `ready()` for layer-wise transfer. A request for fewer blocks
    /// takes the first ones. Unless a request took it, it expires after
    /// `ttl` seconds. The blocks must stay untouched until `poll()` reports
    /// the key. `requests`: how many requests it serves (one per decode rank
    /// that reads this rank under a TP mismatch or MLA: `tp_readers`); it
    /// ends once all of them ended.
    #[pyo3(signature = (key, pages, tail_slot = 0, ready = None, ttl = 120.0, requests = 1))]
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &self,
        py: Python<'_>,
        key: Vec<u8>,
        pages: Vec<u32>,
        tail_slot: u32,
        ready: Option<u64>,
        ttl: f64,
        requests: u32,
    ) -> PyResult<()> {
        let ttl = secs(py, ttl, "ttl")?;
        let all = self.layout.steps();
        let ready = ready.unwrap_or(all).min(all);
        py.detach(|| {
            self.offers
                .lock()
                .offer_to(key, pages, tail_slot, ready, ttl, requests)
        })
        .map_err(|e| kv_err(py, &e))
    }

    /// Steps `0..steps` of the offer `key` are computed (layers, then the
    /// tail): posted at once if a request took the offer.
    fn ready(&self, py: Python<'_>, key: Vec<u8>, steps: u64) -> PyResult<()> {
        py.detach(|| self.offers.lock().ready(&key, steps))
            .map_err(|e| kv_err(py, &e))
    }

    /// Withdraws an offer no request took yet: `True`, its blocks are the
    /// caller's at once. `False` if it is being served (it ends on its own
    /// and `poll()` reports it) or unknown.
    fn withdraw(&self, py: Python<'_>, key: Vec<u8>) -> bool {
        py.detach(|| self.offers.lock().withdraw(&key))
    }

    /// Offers that ended since the last call: `(done, failed)`, `done` the
    /// keys whose every write was delivered, `failed` `(key, kind,
    /// message)` tuples (`kind == "expired"`: nobody asked in time). Each
    /// once, and only when no write from its blocks is in flight. Never
    /// blocks.
    #[allow(clippy::type_complexity)]
    fn poll<'py>(
        &self,
        py: Python<'py>,
    ) -> (
        Vec<Bound<'py, PyBytes>>,
        Vec<(Bound<'py, PyBytes>, String, String)>,
    ) {
        let done = self.offers.lock().take_done();
        let (mut ok, mut failed) = (Vec::new(), Vec::new());
        for d in done {
            let key = PyBytes::new(py, &d.key);
            match d.outcome {
                Ok(()) => ok.push(key),
                Err(e) => {
                    let (kind, msg) = failure(&e);
                    failed.push((key, kind, msg));
                }
            }
        }
        (ok, failed)
    }

    /// Offers not ended yet.
    #[getter]
    fn pending(&self) -> usize {
        self.offers.lock().pending()
    }

    /// Forgets the decoder at `address` (the application knows it is
    /// gone): what it was served fails once no write of it is in flight.
    fn remove_decoder(&self, py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = super::address(py, address)?;
        py.detach(|| self.pre.remove_decoder(&a, weft_kvcache::PeerLoss::Removed));
        Ok(())
    }

    /// Requests served and how they ended: a dict with `taken`,
    /// `completed` and `failed` (by kind).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        super::decoder::outcomes_dict(py, self.pre.outcomes())
    }

    /// Refuses new requests, ends those being served (waiting up to `drain`
    /// seconds for their writes) and deregisters the cache. Idempotent.
    #[pyo3(signature = (drain = 5.0))]
    fn shutdown(&self, py: Python<'_>, drain: f64) -> PyResult<()> {
        let drain = secs(py, drain, "drain")?;
        py.detach(|| {
            self.offers.lock().stop();
            self.pre.shutdown(drain);
        });
        let keep = std::mem::take(&mut *self.keep.lock());
        drop(keep);
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py, 5.0)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("KvPrefiller({})", self.layout.__repr__())
    }
}

impl Drop for PyKvPrefiller {
    fn drop(&mut self) {
        let _ = Python::try_attach(|py| {
            py.detach(|| {
                self.offers.lock().stop();
                self.pre.shutdown(Duration::from_secs(5));
            })
        });
    }
}
