//! `weft.kv`: the KvCache decoder and prefiller on user-owned tensors (host
//! or CUDA). Requests and offers end asynchronously; serving loops call
//! `poll()` every step — no Python callback runs on the hot path.

mod decoder;
mod prefiller;

pub use decoder::PyKvDecoder;
pub use prefiller::PyKvPrefiller;

use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Duration;
use weft_kvcache::{CacheRegions, HeadOrder, Heartbeat, KvConfig, KvError, KvLayout};

use crate::errors;
use crate::memory::{self, RegKeep};
use crate::types::PyPeerAddress;

/// The shape of one rank's paged KV cache: `layers` layers, each of
/// `kv_heads` heads of `num_pages` pages of `page_len` bytes, in `order`
/// (`"heads_before_pages"`: `[layer][head][page]`, or
/// `"pages_before_heads"`), plus `tail_slots` tail slots of `tail_len`
/// bytes (logits or hidden states, written last; 0 for none).
#[pyclass(name = "KvLayout", module = "weft._weft", frozen, from_py_object)]
#[derive(Clone)]
pub struct PyKvLayout {
    pub(crate) inner: KvLayout,
}

#[pymethods]
impl PyKvLayout {
    #[new]
    #[pyo3(signature = (layers, kv_heads, page_len, num_pages, tail_len = 0, tail_slots = 0, order = "heads_before_pages"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: u32,
        kv_heads: u32,
        page_len: u64,
        num_pages: u32,
        tail_len: u64,
        tail_slots: u32,
        order: &str,
    ) -> PyResult<Self> {
        let order = match order {
            "heads_before_pages" => HeadOrder::HeadsBeforePages,
            "pages_before_heads" => HeadOrder::PagesBeforeHeads,
            o => {
                return Err(errors::invalid(
                    py,
                    format!(
                        "order must be 'heads_before_pages' or 'pages_before_heads', not {o:?}"
                    ),
                ))
            }
        };
        let inner = KvLayout {
            layers,
            kv_heads,
            page_len,
            tail_len,
            num_pages,
            tail_slots,
            order,
        };
        inner.validate().map_err(|e| kv_err(py, &e))?;
        Ok(Self { inner })
    }

    /// Layers.
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    /// KV heads per layer on this rank.
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    /// Bytes of one page of one head.
    #[getter]
    fn page_len(&self) -> u64 {
        self.inner.page_len
    }
    /// Pages per head.
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.num_pages
    }
    /// Bytes of a request's tail.
    #[getter]
    fn tail_len(&self) -> u64 {
        self.inner.tail_len
    }
    /// Tail slots.
    #[getter]
    fn tail_slots(&self) -> u32 {
        self.inner.tail_slots
    }
    /// Bytes of one layer (what a per-layer tensor must hold).
    #[getter]
    fn layer_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        self.inner.layer_bytes().map_err(|e| kv_err(py, &e))
    }
    /// Bytes of every layer (what a single KV tensor must hold).
    #[getter]
    fn kv_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        self.inner.kv_bytes().map_err(|e| kv_err(py, &e))
    }
    /// Steps of a complete request: the layers, plus one for the tail.
    #[getter]
    fn steps(&self) -> u64 {
        u64::from(self.inner.layers) + u64::from(self.inner.tail_len > 0)
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "KvLayout(layers={}, kv_heads={}, page_len={}, num_pages={}, tail_len={}, tail_slots={})",
            l.layers, l.kv_heads, l.page_len, l.num_pages, l.tail_len, l.tail_slots
        )
    }
}

/// How many decode ranks read prefill rank `prefill_rank` when the model's
/// `kv_heads` are split over `prefill_tp` prefill and `decode_tp` decode
/// ranks (MLA: `kv_heads=1`; `seed` as the decoders pass to `request_tp`):
/// the `requests` a prefill rank's offer serves.
#[pyfunction]
#[pyo3(signature = (kv_heads, prefill_tp, decode_tp, prefill_rank, seed = 0))]
pub fn tp_readers(
    py: Python<'_>,
    kv_heads: u32,
    prefill_tp: u32,
    decode_tp: u32,
    prefill_rank: u32,
    seed: u64,
) -> PyResult<u32> {
    let shape = weft_kvcache::TpShape {
        kv_heads,
        prefill_tp,
        decode_tp,
    };
    let plan = shape.plan(seed).map_err(|e| kv_err(py, &e))?;
    let n = plan
        .iter()
        .filter(|rank| rank.iter().any(|s| s.prefill_rank == prefill_rank))
        .count();
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// `weft.KvError` for a KvCache error; `kind` is the variant in snake_case
/// (`"prefiller_dead"`, `"refused"`, `"cancelled"`, `"page_taken"`, ...).
pub(crate) fn kv_err(py: Python<'_>, e: &KvError) -> PyErr {
    errors::new_err(py, "KvError", &snake(e.kind()), e.to_string())
}

/// `"PrefillerDead"` -> `"prefiller_dead"`.
pub(crate) fn snake(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 4);
    for (i, c) in s.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// A peer address given as `PeerAddress` or its bytes.
pub(crate) fn address(py: Python<'_>, a: &Bound<'_, PyAny>) -> PyResult<weft::GroupAddress> {
    if let Ok(p) = a.cast::<PyPeerAddress>() {
        return Ok(p.get().inner.clone());
    }
    let b: Vec<u8> = a
        .extract()
        .map_err(|_| errors::invalid(py, "an address is a weft.PeerAddress or its bytes"))?;
    crate::types::from_wire(py, &b, "PeerAddress")
}

/// The cache's memory: `kv` one tensor/buffer (every layer) or a list of
/// them (one per layer), `tail` an optional one. Returns the regions and
/// the keep-alives of the objects.
pub(crate) fn regions(
    py: Python<'_>,
    kv: &Bound<'_, PyAny>,
    tail: Option<&Bound<'_, PyAny>>,
    writable: bool,
) -> PyResult<(CacheRegions, Vec<Arc<RegKeep>>)> {
    let want = writable.then_some(true);
    let mut keep = Vec::new();
    let mut layers = Vec::new();
    let list = kv
        .cast::<pyo3::types::PyList>()
        .ok()
        .map(|l| l.iter().collect::<Vec<_>>());
    let tuple = kv
        .cast::<pyo3::types::PyTuple>()
        .ok()
        .map(|t| t.iter().collect::<Vec<_>>());
    match list.or(tuple) {
        Some(items) => {
            if items.is_empty() {
                return Err(errors::invalid(py, "kv: an empty list of layers"));
            }
            for it in items {
                let r = memory::resolve(&it, None, want, None)?;
                layers.push(r.region);
                keep.push(r.keep);
            }
        }
        None => {
            let r = memory::resolve(kv, None, want, None)?;
            layers.push(r.region);
            keep.push(r.keep);
        }
    }
    let mut regions = CacheRegions::per_layer(layers);
    if let Some(t) = tail {
        let r = memory::resolve(t, None, want, None)?;
        regions = regions.with_tail(r.region);
        keep.push(r.keep);
    }
    Ok((regions, keep))
}

/// Settings from keyword arguments (seconds).
pub(crate) fn config(interval: Option<f64>, timeout: Option<f64>) -> PyResult<KvConfig> {
    let mut cfg = KvConfig::default();
    let secs = |v: f64, what: &str| -> PyResult<Duration> {
        if v.is_finite() && v > 0.0 && v <= 1e6 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{what} must be in (0, 1e6] seconds, not {v}"
            )))
        }
    };
    let mut hb: Heartbeat = cfg.heartbeat;
    if let Some(v) = interval {
        hb.interval = secs(v, "heartbeat_interval")?;
    }
    if let Some(v) = timeout {
        hb.timeout = secs(v, "heartbeat_timeout")?;
    }
    if hb.timeout <= hb.interval {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "heartbeat_timeout must be longer than heartbeat_interval",
        ));
    }
    cfg.heartbeat = hb;
    Ok(cfg)
}

/// `(kind, message)` of an outcome's error, for `poll()`.
pub(crate) fn failure(e: &KvError) -> (String, String) {
    (snake(e.kind()), e.to_string())
}
