//! `weft.KvDecoder`: the decode side. Requests are started by block ids and
//! end asynchronously; `poll()` reports them once each.

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use weft_kvcache::{
    request_meta, Decoder, KvError, Outcome, PageLease, PrefillerId, RequestHandle, Route, TpShape,
};

use super::{config, failure, kv_err, regions, PyKvLayout};
use crate::engine::PyTransferEngine;
use crate::errors;
use crate::memory::RegKeep;
use crate::types::PyPeerAddress;

/// A request in flight: its handle and the lease of its pages (returned
/// to the pool when `poll()` reports it).
struct Live {
    handle: RequestHandle,
    lease: Option<PageLease>,
}

/// The decode side of KvCache transfer over a `TransferEngine`: registers
/// the KV cache (`kv`: one tensor for every layer, or a list with one per
/// layer; `tail`: optional) and fills block ids of it from prefillers.
/// The decoder takes the engine's receives: give it an engine of its own.
/// Thread-safe; every call that may block releases the GIL.
#[pyclass(name = "KvDecoder", module = "weft._weft", frozen)]
pub struct PyKvDecoder {
    dec: Decoder,
    layout: PyKvLayout,
    live: Mutex<BTreeMap<u64, Live>>,
    done_tx: Sender<u64>,
    done_rx: Receiver<u64>,
    /// The engine (kept alive as long as the decoder).
    _engine: Py<PyTransferEngine>,
    /// The cache's objects, released after the decoder deregistered them.
    keep: Mutex<Vec<Arc<RegKeep>>>,
}

impl PyKvDecoder {
    fn err(py: Python<'_>, e: KvError) -> PyErr {
        kv_err(py, &e)
    }

    fn start(
        &self,
        py: Python<'_>,
        route: impl FnOnce(&Decoder) -> Result<Route, KvError> + Send,
        pages: Vec<u32>,
        meta: Vec<u8>,
    ) -> PyResult<u64> {
        let dec = &self.dec;
        let r = py.detach(|| -> Result<(RequestHandle, PageLease), KvError> {
            let route = route(dec)?;
            let lease = dec.alloc_pages(&pages)?;
            match dec.request(&route, &lease, &meta) {
                Ok(h) => Ok((h, lease)),
                Err(e) => {
                    dec.free(lease);
                    Err(e)
                }
            }
        });
        let (handle, lease) = r.map_err(|e| Self::err(py, e))?;
        let id = handle.id();
        self.live.lock().insert(
            id,
            Live {
                handle: handle.clone(),
                lease: Some(lease),
            },
        );
        let tx = self.done_tx.clone();
        handle.on_complete(move |_| {
            let _ = tx.send(id);
        });
        Ok(id)
    }
}

fn outcome_of(o: &Outcome) -> Result<(), (String, String)> {
    o.as_ref().map(|_| ()).map_err(failure)
}

#[pymethods]
impl PyKvDecoder {
    #[new]
    #[pyo3(signature = (engine, layout, kv, tail = None, heartbeat_interval = None, heartbeat_timeout = None))]
    fn new(
        py: Python<'_>,
        engine: Py<PyTransferEngine>,
        layout: PyKvLayout,
        kv: &Bound<'_, PyAny>,
        tail: Option<&Bound<'_, PyAny>>,
        heartbeat_interval: Option<f64>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let cfg = config(heartbeat_interval, heartbeat_timeout)?;
        let (regions, keep) = regions(py, kv, tail, true)?;
        let eng = Arc::new(engine.get().engine.clone());
        let l = layout.inner;
        let dec = py
            .detach(|| Decoder::new(eng, l, regions, cfg))
            .map_err(|e| Self::err(py, e))?;
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        Ok(Self {
            dec,
            layout,
            live: Mutex::new(BTreeMap::new()),
            done_tx,
            done_rx,
            _engine: engine,
            keep: Mutex::new(keep),
        })
    }

    /// This decoder's address (what prefillers see).
    #[getter]
    fn address(&self) -> PyPeerAddress {
        PyPeerAddress {
            inner: self.dec.address(),
        }
    }

    /// The cache's layout.
    #[getter]
    fn layout(&self) -> PyKvLayout {
        self.layout.clone()
    }

    /// Starts heartbeating the prefiller at `address` (`PeerAddress` or
    /// its bytes); returns its id for `request`. Adding it again returns
    /// the same id.
    fn add_prefiller(&self, py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<u32> {
        let a = super::address(py, address)?;
        Ok(py.detach(|| self.dec.add_prefiller(a)).0)
    }

    /// Forgets the prefiller at `address`: its requests fail with
    /// `kind == "prefiller_dead"` once no write of theirs can land.
    fn remove_prefiller(&self, py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = super::address(py, address)?;
        py.detach(|| {
            self.dec
                .remove_prefiller(&a, weft_kvcache::PeerLoss::Removed)
        });
        Ok(())
    }

    /// Fills block ids `pages` with every head (and the tail) of the prompt
    /// that prefiller `prefiller` (an id from `add_prefiller`) offered under
    /// `key`, from the offer's block `first` on (a decoder holding the
    /// prompt's first blocks in its prefix cache skips them): `pages[i]`
    /// gets offered block `first + i`. Returns the request id. `pages` must
    /// not be in another request still in flight (`kind == "page_taken"`).
    #[pyo3(signature = (pages, prefiller, key, first = 0))]
    fn request(
        &self,
        py: Python<'_>,
        pages: Vec<u32>,
        prefiller: u32,
        key: Vec<u8>,
        first: u32,
    ) -> PyResult<u64> {
        let heads = self.layout.inner.kv_heads;
        self.start(
            py,
            move |_| Ok(Route::single(PrefillerId(prefiller), heads)),
            pages,
            request_meta(&key, first),
        )
    }

    /// `request` across a TP mismatch (or MLA: `kv_heads=1`), each prefill
    /// rank having offered its heads of the prompt under `key`: the model's
    /// `kv_heads` split over `prefill_tp` prefill ranks, whose ids are
    /// `prefillers` (rank order), and `decode_tp` decode ranks, this one
    /// `decode_rank`. Every decode rank must use the same `seed` (it
    /// spreads MLA's replicated latent over the prefill ranks).
    #[pyo3(signature = (pages, prefillers, key, kv_heads, prefill_tp, decode_tp, decode_rank, first = 0, seed = 0))]
    #[allow(clippy::too_many_arguments)]
    fn request_tp(
        &self,
        py: Python<'_>,
        pages: Vec<u32>,
        prefillers: Vec<u32>,
        key: Vec<u8>,
        kv_heads: u32,
        prefill_tp: u32,
        decode_tp: u32,
        decode_rank: u32,
        first: u32,
        seed: u64,
    ) -> PyResult<u64> {
        let shape = TpShape {
            kv_heads,
            prefill_tp,
            decode_tp,
        };
        let ids: Vec<PrefillerId> = prefillers.into_iter().map(PrefillerId).collect();
        self.start(
            py,
            move |_| {
                let plan = shape.plan(seed)?;
                let mine = plan
                    .get(decode_rank as usize)
                    .ok_or_else(|| KvError::InvalidRoute {
                        what: format!("decode rank {decode_rank} of {decode_tp}"),
                    })?;
                Route::from_plan(mine, &ids)
            },
            pages,
            request_meta(&key, first),
        )
    }

    /// Cancels request `request_id`; `poll()` reports it (as `cancelled`,
    /// or done if every byte landed first) once no write of it can land.
    /// Returns whether it was in flight.
    fn cancel(&self, py: Python<'_>, request_id: u64) -> bool {
        let h = self.live.lock().get(&request_id).map(|l| l.handle.clone());
        match h {
            Some(h) => {
                py.detach(|| self.dec.cancel(&h));
                true
            }
            None => false,
        }
    }

    /// Requests that ended since the last call: `(done, failed)`, `done`
    /// the ids whose every byte is in place, `failed` `(id, kind,
    /// message)` tuples. Each request is reported once, and only when no
    /// write of it can land any more: its blocks are the caller's again.
    /// Never blocks.
    #[allow(clippy::type_complexity)]
    fn poll(&self) -> (Vec<u64>, Vec<(u64, String, String)>) {
        let (mut ok, mut failed) = (Vec::new(), Vec::new());
        let ids: Vec<u64> = self.done_rx.try_iter().collect();
        for id in ids {
            let Some(mut l) = self.live.lock().remove(&id) else {
                continue;
            };
            if let Some(lease) = l.lease.take() {
                self.dec.free(lease);
            }
            match l.handle.result().as_ref().map(outcome_of) {
                Some(Ok(())) => ok.push(id),
                Some(Err((kind, msg))) => failed.push((id, kind, msg)),
                None => failed.push((id, "lost".into(), "no outcome".into())),
            }
        }
        (ok, failed)
    }

    /// Blocks (GIL released) until request `request_id` ended or `timeout`
    /// seconds passed; returns whether it ended. `poll()` still reports it.
    #[pyo3(signature = (request_id, timeout = None))]
    fn wait(&self, py: Python<'_>, request_id: u64, timeout: Option<f64>) -> PyResult<bool> {
        let Some(h) = self.live.lock().get(&request_id).map(|l| l.handle.clone()) else {
            return Err(errors::invalid(
                py,
                format!("request {request_id} is not in flight (already polled?)"),
            ));
        };
        let t = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t.min(1e9))),
            Some(t) => return Err(errors::invalid(py, format!("timeout {t}"))),
            None => None,
        };
        Ok(py.detach(|| match t {
            Some(t) => h.wait_timeout(t).is_some(),
            None => {
                let _ = h.wait();
                true
            }
        }))
    }

    /// Requests in flight (started and not yet polled).
    #[getter]
    fn pending(&self) -> usize {
        self.live.lock().len()
    }

    /// Requests started and how they ended so far: a dict with `taken`,
    /// `completed` and `failed` (by kind).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        outcomes_dict(py, self.dec.outcomes())
    }

    /// Ends every request (`kind == "shut_down"`), stops heartbeats and
    /// deregisters the cache: afterwards no write lands in it. The engine
    /// is the caller's. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.dec.shutdown());
        let keep = std::mem::take(&mut *self.keep.lock());
        drop(keep);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.shutdown(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "KvDecoder({}, pending={})",
            self.layout.__repr__(),
            self.live.lock().len()
        )
    }
}

impl Drop for PyKvDecoder {
    fn drop(&mut self) {
        let _ = Python::try_attach(|py| py.detach(|| self.dec.shutdown()));
    }
}

/// `taken`, `completed`, `failed` (by kind) of an `Outcomes`.
pub(crate) fn outcomes_dict<'py>(
    py: Python<'py>,
    o: &weft_kvcache::Outcomes,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("taken", o.taken())?;
    d.set_item("completed", o.completed())?;
    let f = pyo3::types::PyDict::new(py);
    for (k, v) in o.failed() {
        f.set_item(super::snake(k), v)?;
    }
    d.set_item("failed", f)?;
    Ok(d)
}
