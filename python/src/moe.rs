//! `weft.moe`: MoE dispatch/combine (weft-moe's CPU driver, [`MoeRank`])
//! from Python. One rank per engine, in any process: each rank gives its
//! `info()` to every other rank (`weft.dist.all_gather_bytes` over a
//! `torch.distributed` group, a rendezvous store, anything), `connect`s with
//! everyone's, then calls `dispatch` and `combine` per MoE layer. Token rows
//! are opaque bytes (fp8 data and scales, bf16, ...); expert outputs and
//! combined tokens are bf16 or f32.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;
use std::time::Duration;
use weft_moe::{
    Dims, DispatchFormat, ExpertTokens, Layout, MoeConfig, MoeError, MoeRank, OutDtype, RankInfo,
    NO_EXPERT,
};

use crate::buffer_ffi::BufferGuard;
use crate::engine::PyTransferEngine;
use crate::errors;

/// `weft.MoeError` with a `kind` naming the variant.
fn moe_err(py: Python<'_>, e: &MoeError) -> PyErr {
    let kind = match e {
        MoeError::Config(_) => "config",
        MoeError::Shape { .. } => "shape",
        MoeError::TooManyTokens { .. } => "too_many_tokens",
        MoeError::ExpertOutOfRange { .. } => "expert_out_of_range",
        MoeError::BadRoutes { .. } | MoeError::RecvOverflow { .. } | MoeError::BadOrigin { .. } => {
            "bad_routes"
        }
        MoeError::Engine { .. } => "engine",
        MoeError::Timeout { .. } | MoeError::SubmitTimeout { .. } => "timeout",
        MoeError::Poisoned => "poisoned",
        MoeError::NotConnected => "not_connected",
        MoeError::PeerInfo { .. } => "peer_info",
        MoeError::StaleLayout { .. } => "stale_layout",
        MoeError::OutOfOrder { .. } => "out_of_order",
        MoeError::Masked { .. } => "masked",
        _ => "moe",
    };
    errors::new_err(py, "MoeError", kind, e.to_string())
}

fn shape_err(py: Python<'_>, what: &'static str, got: u64, want: u64) -> PyErr {
    moe_err(py, &MoeError::Shape { what, got, want })
}

/// Reads a buffer of little-endian items of `size` bytes each (formats
/// `allowed`) into `T` with `conv`.
fn read_items<T>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
    allowed: &[(&str, usize)],
    conv: impl Fn(&[u8]) -> Option<T>,
) -> PyResult<Vec<T>> {
    let mut g = BufferGuard::acquire(obj)?;
    let fmt = g.format();
    let fmt = fmt.trim_start_matches(['<', '=', '@']);
    let size = allowed.iter().find(|(f, _)| *f == fmt).map(|(_, s)| *s);
    let out = size.and_then(|s| {
        g.as_slice()
            .chunks(s)
            .map(|c| if c.len() == s { conv(c) } else { None })
            .collect::<Option<Vec<T>>>()
    });
    g.release(py);
    let Some(size) = size else {
        let names: Vec<&str> = allowed.iter().map(|(f, _)| *f).collect();
        return Err(errors::refused(
            py,
            "unsupported_dtype",
            format!("{what}: buffer format {fmt:?}, expected one of {names:?}"),
        ));
    };
    out.ok_or_else(|| {
        errors::invalid(
            py,
            format!("{what}: not a whole number of {size}-byte items"),
        )
    })
}

/// Top-k ids from int64/int32/uint32 items; `-1` is "no expert".
fn read_ids(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let bad = std::cell::Cell::new(None);
    let v = read_items(
        py,
        obj,
        "topk_ids",
        &[("q", 8), ("l", 8), ("i", 4), ("I", 4)],
        |c| {
            let x: i64 = match c.len() {
                8 => i64::from_le_bytes(c.try_into().ok()?),
                _ => i64::from(i32::from_le_bytes(c.try_into().ok()?)),
            };
            match x {
                -1 => Some(NO_EXPERT),
                0..=0xffff_fffe => Some(x as u32),
                _ => {
                    bad.set(Some(x));
                    Some(NO_EXPERT)
                }
            }
        },
    )?;
    if let Some(x) = bad.get() {
        return Err(errors::invalid(
            py,
            format!("topk_ids: {x} is neither an expert nor -1 (no expert)"),
        ));
    }
    Ok(v)
}

fn out_dtype_of(py: Python<'_>, name: &str) -> PyResult<OutDtype> {
    match name {
        "bf16" => Ok(OutDtype::Bf16),
        "f32" => Ok(OutDtype::F32),
        other => Err(errors::refused(
            py,
            "unsupported_dtype",
            format!("out_dtype {other:?}: \"bf16\" or \"f32\""),
        )),
    }
}

fn dispatch_of(py: Python<'_>, name: &str) -> PyResult<DispatchFormat> {
    match name {
        "raw" => Ok(DispatchFormat::Raw),
        "fp8" => Ok(DispatchFormat::Fp8 { round_scale: false }),
        "fp8_round_scale" => Ok(DispatchFormat::Fp8 { round_scale: true }),
        other => Err(errors::invalid(
            py,
            format!("dispatch {other:?}: \"raw\", \"fp8\" or \"fp8_round_scale\""),
        )),
    }
}

fn read_weights(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    read_items(py, obj, "topk_weights", &[("f", 4)], |c| {
        Some(f32::from_le_bytes(c.try_into().ok()?))
    })
}

/// What `MoeRank.dispatch` returns: rows, expert offsets, source ranks,
/// layout.
type Dispatched<'py> = (
    Bound<'py, PyBytes>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    PyMoeLayout,
);

/// What `combine` needs of a step: opaque; from `MoeRank.dispatch`.
#[pyclass(name = "MoeLayout", module = "weft._weft", frozen)]
pub struct PyMoeLayout {
    layout: Layout,
    /// T_r · R: the weights `combine` may be given.
    pairs: usize,
    /// Whether dispatch was given weights (else combine must be).
    weighted: bool,
}

#[pymethods]
impl PyMoeLayout {
    /// The step this layout belongs to.
    #[getter]
    fn step(&self) -> u64 {
        self.layout.step()
    }

    fn __repr__(&self) -> String {
        format!(
            "MoeLayout(step={}, pairs={})",
            self.layout.step(),
            self.pairs
        )
    }
}

/// One rank of a MoE group on an engine, CPU data path (weft-moe's
/// `MoeRank`): buffers are allocated and registered once; then `connect`
/// with every rank's `info()`, and `dispatch` / `combine` per layer. Every
/// rank of a group must be created with the same shape. A failed step
/// (a peer dead or stalled past `timeout`) leaves the rank poisoned:
/// later calls raise `MoeError` of kind `poisoned`.
#[pyclass(name = "MoeRank", module = "weft._weft", frozen)]
pub struct PyMoeRank {
    rank: Mutex<Option<MoeRank>>,
    /// The last dispatch's rows, kept for the next one to reuse (taken
    /// for the call, put back after; never locked across a GIL change).
    spare: Mutex<ExpertTokens>,
    info: RankInfo,
    dims: Dims,
    _engine: Py<PyTransferEngine>,
}

impl PyMoeRank {
    fn with<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut MoeRank) -> Result<R, MoeError> + Send,
    ) -> PyResult<R>
    where
        R: Send,
    {
        let r = py.detach(|| {
            let mut g = self.rank.lock();
            g.as_mut().map(f)
        });
        match r {
            Some(r) => r.map_err(|e| moe_err(py, &e)),
            None => Err(errors::shut_down(py)),
        }
    }
}

#[pymethods]
impl PyMoeRank {
    /// Rank `rank` of `ranks` on `engine`: `experts` (divisible by
    /// `ranks`), top-`topk`, at most `max_tokens` tokens of `token_bytes`
    /// bytes per step, expert outputs of `hidden` elements of `out_dtype`
    /// (`"bf16"` or `"f32"`); `private_tokens` speculative slots per peer
    /// (default `min(32, max_tokens·topk)`); `instance` picks the reserved
    /// immediates (one per MoE group on an engine); `timeout` (seconds)
    /// bounds every round. `dispatch`: `"raw"` sends the `token_bytes`
    /// as given; `"fp8"` / `"fp8_round_scale"` take bf16 tokens of
    /// `hidden` elements and send them as e4m3 with one f32 scale per 128
    /// columns (`token_bytes` must be `hidden + hidden // 32`: the row the
    /// experts receive), DeepEP's low-latency rule, the second with scales
    /// rounded up to powers of two. `masked`: ranks the group goes on
    /// without (a dead rank, after the others rebuilt under a new
    /// `instance`); pairs naming their experts are dropped, the other
    /// ranks connect among themselves (`connect` takes the active ranks'
    /// infos, in rank order), and ids and `source_rank` keep whole-group
    /// numbers.
    #[new]
    #[pyo3(signature = (engine, rank, ranks, experts, topk, max_tokens, token_bytes, hidden, *, out_dtype = "bf16", private_tokens = None, instance = 0, timeout = 10.0, dispatch = "raw", masked = None))]
    // One parameter per Python argument.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: Py<PyTransferEngine>,
        rank: u32,
        ranks: u32,
        experts: u32,
        topk: u32,
        max_tokens: u32,
        token_bytes: u32,
        hidden: u32,
        out_dtype: &str,
        private_tokens: Option<u32>,
        instance: u32,
        timeout: f64,
        dispatch: &str,
        masked: Option<Vec<u32>>,
    ) -> PyResult<Self> {
        let mut cfg = MoeConfig::new(ranks, experts, topk, max_tokens, token_bytes, hidden);
        cfg.out_dtype = out_dtype_of(py, out_dtype)?;
        cfg.dispatch = dispatch_of(py, dispatch)?;
        cfg.masked = masked.unwrap_or_default();
        cfg.private_tokens = private_tokens;
        cfg.instance = instance;
        if !(timeout.is_finite() && timeout > 0.0 && timeout <= 1e6) {
            return Err(errors::invalid(
                py,
                format!("timeout {timeout}: seconds in (0, 1e6]"),
            ));
        }
        cfg.step_timeout = Duration::from_secs_f64(timeout);
        let dims = cfg
            .validate()
            .map_err(|e| moe_err(py, &MoeError::Config(e)))?;
        let eng = Arc::new(engine.get().engine.clone());
        let (r, info) = py
            .detach(|| MoeRank::prepare(eng, &cfg, rank))
            .map_err(|e| moe_err(py, &e))?;
        Ok(Self {
            rank: Mutex::new(Some(r)),
            spare: Mutex::new(ExpertTokens::default()),
            info,
            dims,
            _engine: engine,
        })
    }

    /// What this rank tells the others (bytes; give every rank's, in rank
    /// order, to `connect`).
    fn info<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.info.to_bytes())
    }

    /// Checks every rank's `info()` (untrusted: garbled bytes, another
    /// shape or wrong ranks raise `MoeError` of kind `peer_info` or
    /// `shape`) and connects to the peers.
    fn connect(&self, py: Python<'_>, infos: Vec<Vec<u8>>) -> PyResult<()> {
        let all = infos
            .iter()
            .enumerate()
            .map(|(r, b)| {
                RankInfo::from_bytes(b).map_err(|e| match e {
                    MoeError::PeerInfo { what, .. } => MoeError::PeerInfo {
                        rank: r as u32,
                        what,
                    },
                    other => other,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| moe_err(py, &e))?;
        self.with(py, |r| r.connect(&all))
    }

    /// Dispatches this rank's tokens: `tokens` is `T` rows of `token_bytes`
    /// bytes, or of `hidden` bf16 values with fp8 dispatch (any
    /// C-contiguous buffer), `topk_ids` `T·topk` ids (int64,
    /// int32 or uint32; `-1` = no expert), `topk_weights` `T·topk` float32
    /// (the combine's weights unless `combine` is given others). Returns
    /// `(rows, expert_offsets, source_rank, source_pair, layout)`: the
    /// received rows (bytes, `token_bytes` each), expert-major (local expert
    /// `e` owns rows `expert_offsets[e]..expert_offsets[e+1]`, by source
    /// rank, then the source's token order), each row's source rank, each
    /// row's pair index at its source (`token · topk + k`, checked to be
    /// below `max_tokens · topk`), and the layout for `combine`.
    #[pyo3(signature = (tokens, topk_ids, topk_weights = None))]
    fn dispatch<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        topk_ids: &Bound<'py, PyAny>,
        topk_weights: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Dispatched<'py>> {
        let ids = read_ids(py, topk_ids)?;
        let weighted = topk_weights.is_some();
        let weights = match topk_weights {
            Some(w) => read_weights(py, w)?,
            None => vec![0.0; ids.len()],
        };
        // The tokens are read in place: the export pins them while the GIL
        // is released (as numpy's own GIL-free operations, a thread that
        // writes them meanwhile races with the call).
        let mut g = BufferGuard::acquire(tokens)?;
        let toks = g.as_slice();
        let pairs = ids.len();
        // Into the last call's rows: no new allocation per step once they
        // are large enough.
        let mut x = std::mem::take(&mut *self.spare.lock());
        let r = self.with(py, |r| {
            r.dispatch_into(
                &weft_moe::RankInput {
                    tokens: toks,
                    topk_ids: &ids,
                    topk_weights: &weights,
                },
                &mut x,
            )
        });
        g.release(py);
        let layout = r?;
        let out = (
            PyBytes::new(py, &x.data),
            x.expert_offsets.clone(),
            x.source_rank.clone(),
            x.source_pair.clone(),
            PyMoeLayout {
                layout,
                pairs,
                weighted,
            },
        );
        *self.spare.lock() = x;
        Ok(out)
    }

    /// Sends the expert outputs back (`outputs`: one row of `hidden`
    /// elements of `out_dtype` per received row, in dispatch's order) and
    /// returns this rank's `T` combined tokens (bytes):
    /// `Σ_k w[t,k]·y(t,k)` over the pairs with an expert, in f32 with a
    /// fused multiply-add in k order. `topk_weights` (float32, `T·topk`)
    /// replaces the weights given to `dispatch`.
    #[pyo3(signature = (outputs, layout, topk_weights = None))]
    fn combine<'py>(
        &self,
        py: Python<'py>,
        outputs: &Bound<'py, PyAny>,
        layout: &PyMoeLayout,
        topk_weights: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let weights = topk_weights.map(|w| read_weights(py, w)).transpose()?;
        if weights.is_none() && !layout.weighted {
            return Err(errors::invalid(
                py,
                "combine: topk_weights were given neither to dispatch nor here",
            ));
        }
        if let Some(w) = &weights {
            if w.len() != layout.pairs {
                return Err(shape_err(
                    py,
                    "topk_weights",
                    w.len() as u64,
                    layout.pairs as u64,
                ));
            }
        }
        // Read in place, as dispatch's tokens.
        let mut g = BufferGuard::acquire(outputs)?;
        let fmt = g.format();
        let fmt = fmt.trim_start_matches(['<', '=', '@']).to_string();
        // Raw bytes, or elements of the rank's output type (bf16 has no
        // buffer format: its 16-bit patterns).
        let ok: &[&str] = match self.dims.out_dtype {
            OutDtype::F32 => &["f", "B", "b"],
            _ => &["H", "h", "B", "b"],
        };
        if !ok.contains(&fmt.as_str()) {
            return Err(errors::refused(
                py,
                "unsupported_dtype",
                format!(
                    "outputs: buffer format {fmt:?} for {:?} outputs (expected one of {ok:?})",
                    self.dims.out_dtype
                ),
            ));
        }
        let l = &layout.layout;
        let ys = g.as_slice();
        let out = self.with(py, |r| match &weights {
            Some(w) => r.combine_with_weights(ys, l, w),
            None => r.combine(ys, l),
        });
        g.release(py);
        Ok(PyBytes::new(py, &out?))
    }

    /// Waits for the last round, frees the immediates and unregisters the
    /// buffers. Later calls raise `ShutDownError`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        // The lock may be held by a step in flight: wait for it without
        // the GIL.
        let r = py.detach(|| self.rank.lock().take().map(MoeRank::shutdown));
        match r {
            Some(r) => r.map_err(|e| moe_err(py, &e)),
            None => Ok(()),
        }
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.dims.mask.global_rank(self.info.rank)
    }

    /// The shape: `(ranks, experts, topk, max_tokens, token_bytes, hidden,
    /// private_tokens)`.
    #[getter]
    fn shape(&self) -> (u32, u32, u32, u32, u32, u32, u32) {
        let d = &self.dims;
        (
            d.mask.global_ranks(),
            d.mask.global_ranks() * d.local,
            d.topk,
            d.max_tokens,
            d.token_bytes,
            d.hidden,
            d.private,
        )
    }

    /// Bytes one rank registers for this shape (send, receive and route
    /// buffers), without creating it.
    #[staticmethod]
    #[pyo3(signature = (ranks, experts, topk, max_tokens, token_bytes, hidden, *, out_dtype = "bf16", private_tokens = None))]
    // One parameter per Python argument.
    #[allow(clippy::too_many_arguments)]
    fn buffer_bytes(
        py: Python<'_>,
        ranks: u32,
        experts: u32,
        topk: u32,
        max_tokens: u32,
        token_bytes: u32,
        hidden: u32,
        out_dtype: &str,
        private_tokens: Option<u32>,
    ) -> PyResult<u64> {
        let mut cfg = MoeConfig::new(ranks, experts, topk, max_tokens, token_bytes, hidden);
        cfg.out_dtype = out_dtype_of(py, out_dtype)?;
        cfg.private_tokens = private_tokens;
        let d = cfg
            .validate()
            .map_err(|e| moe_err(py, &MoeError::Config(e)))?;
        Ok(d.send_buf_len + d.recv_buf_len + d.route_buf_len())
    }

    /// Experts hosted by each rank (`experts / ranks`).
    #[getter]
    fn local_experts(&self) -> u32 {
        self.dims.local
    }

    fn __repr__(&self) -> String {
        let d = &self.dims;
        format!(
            "MoeRank(rank={}, ranks={}, experts={}, topk={}, max_tokens={}, token_bytes={}, hidden={})",
            self.info.rank, d.ranks, d.experts, d.topk, d.max_tokens, d.token_bytes, d.hidden
        )
    }
}

/// Registers the classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMoeRank>()?;
    m.add_class::<PyMoeLayout>()?;
    Ok(())
}
