//! `weft.rl`: RL weight transfer (weft-rl) from Python. Every rank builds
//! the same [`Plan`] from the same parameter and target tables (the plan is
//! deterministic: no plan travels), trainers load their shards and push a
//! version with one-sided WRITEs straight into every inference rank's
//! (double-buffered) weight memory; inference ranks count the immediates
//! and read the new tensors out.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use weft_rl::exec::{Directory, InferEndpoint, Inference, StepConfig, Trainer, TrainerEndpoint};
use weft_rl::meta::{
    Box2, Concat, Fp8Fallback, InferTensor, Layout, ModelLayout, Placement, Quant, Segment,
    TrainParam,
};
use weft_rl::{plan, DType, Plan, PlanConfig, RlError};

use crate::buffer_ffi::BufferGuard;
use crate::engine::PyTransferEngine;
use crate::errors;
use crate::types::PyMrDesc;

/// `weft.RlError` with a `kind` naming the variant.
fn rl_err(py: Python<'_>, e: &RlError) -> PyErr {
    let kind = match e {
        RlError::Layout(_) => "layout",
        RlError::Plan(_) => "plan",
        RlError::Engine { .. } => "engine",
        RlError::Timeout { .. } => "timeout",
        RlError::Buffer(_) => "buffer",
        RlError::Config { .. } => "config",
        RlError::UnknownRank { .. } => "unknown_rank",
        _ => "rl",
    };
    errors::new_err(py, "RlError", kind, e.to_string())
}

/// A target segment from Python: `(param, row_start, row_end, col_start, col_end)`.
type SegmentArg = (String, u64, u64, u64, u64);

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F8E4M3 => "fp8",
        _ => "bf16",
    }
}

fn layout_err(py: Python<'_>, m: impl Into<String>) -> PyErr {
    rl_err(py, &RlError::Layout(m.into()))
}

/// A layout tuple: `("replicate", ranks)`, `("shard", dim, ranks, sizes)`
/// or `("mesh", shape, ranks, placements)` with one placement per mesh
/// dimension, `None` for Replicate or the tensor dimension it shards.
fn parse_layout(py: Python<'_>, name: &str, l: &Bound<'_, PyAny>) -> PyResult<Layout> {
    let t = l
        .cast::<PyTuple>()
        .map_err(|_| layout_err(py, format!("{name}: a layout is a tuple")))?;
    let kind: String = t.get_item(0)?.extract()?;
    let bad = |m: &str| layout_err(py, format!("{name}: {m}"));
    match (kind.as_str(), t.len()) {
        ("replicate", 2) => Ok(Layout::Replicate {
            ranks: t.get_item(1)?.extract()?,
        }),
        ("shard", 4) => Ok(Layout::Shard {
            dim: t.get_item(1)?.extract()?,
            ranks: t.get_item(2)?.extract()?,
            sizes: t.get_item(3)?.extract()?,
        }),
        ("mesh", 4) => {
            let placements: Vec<Option<u8>> = t.get_item(3)?.extract()?;
            Ok(Layout::Mesh {
                shape: t.get_item(1)?.extract()?,
                ranks: t.get_item(2)?.extract()?,
                placements: placements
                    .into_iter()
                    .map(|p| p.map_or(Placement::Replicate, Placement::Shard))
                    .collect(),
            })
        }
        _ => Err(bad(
            "layout must be ('replicate', ranks), ('shard', dim, ranks, sizes) or ('mesh', shape, ranks, placements)",
        )),
    }
}

/// The routing table of one weight update, identical on every rank built
/// from the same arguments.
///
/// `params`: `(name, rows, cols, layout[, mesh_group[, dtype]])` per
/// training parameter, seen as 2-D, `dtype` `"bf16"` (default) or `"f32"`;
/// `inference`:
/// per inference rank its tensors `(name, segments, quant[, concat])` with
/// segments `(param_name, row_start, row_end, col_start, col_end)` stacked
/// along rows (`concat` `"rows"`, the default) or side by side (`"cols"`),
/// and `quant` `"none"` or `"fp8"` (e4m3 with one f32 scale per
/// `block × block` tile, from bf16 only). `fp8_fallback=True` keeps fp8
/// targets that cannot be quantised as given (a fused segment that is not
/// whole tiles, an f32 source) in the trainers' dtype, listed by
/// `fallbacks()`; without it they are refused. `ramp`: how many of each
/// mesh group's first waves are cut smaller (a quarter, a half, … of
/// `watermark`), so the first writes start sooner.
#[pyclass(name = "RlPlan", module = "weft._weft", frozen)]
pub struct PyRlPlan {
    plan: Arc<Plan>,
    model: Arc<ModelLayout>,
    fallbacks: Vec<Fp8Fallback>,
}

#[pymethods]
impl PyRlPlan {
    #[new]
    #[pyo3(signature = (trainers, params, inference, block = 128, unit_bytes = 2 << 20, align = 256, watermark = 512 << 20, min_direct_bytes = 256 << 10, fp8_fallback = false, ramp = 2))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        trainers: u32,
        params: &Bound<'_, PyList>,
        inference: &Bound<'_, PyList>,
        block: u64,
        unit_bytes: u64,
        align: u64,
        watermark: u64,
        min_direct_bytes: u64,
        fp8_fallback: bool,
        ramp: u32,
    ) -> PyResult<Self> {
        let mut ps = Vec::with_capacity(params.len());
        let mut index = BTreeMap::new();
        for p in params.iter() {
            let t = p.cast::<PyTuple>()?;
            if !(4..=6).contains(&t.len()) {
                return Err(layout_err(
                    py,
                    "a parameter is (name, rows, cols, layout[, mesh_group[, dtype]])",
                ));
            }
            let name: String = t.get_item(0)?.extract()?;
            let layout = parse_layout(py, &name, &t.get_item(3)?)?;
            let mesh_group = if t.len() >= 5 {
                t.get_item(4)?.extract()?
            } else {
                0
            };
            let dtype = if t.len() == 6 {
                let d: String = t.get_item(5)?.extract()?;
                match d.as_str() {
                    "bf16" => DType::Bf16,
                    "f32" => DType::F32,
                    d => {
                        return Err(layout_err(
                            py,
                            format!("{name}: dtype {d:?} (\"bf16\" or \"f32\")"),
                        ))
                    }
                }
            } else {
                DType::Bf16
            };
            if index.insert(name.clone(), ps.len()).is_some() {
                return Err(layout_err(py, format!("parameter {name} twice")));
            }
            ps.push(TrainParam {
                name,
                rows: t.get_item(1)?.extract()?,
                cols: t.get_item(2)?.extract()?,
                dtype,
                mesh_group,
                layout,
            });
        }
        let mut inf = Vec::with_capacity(inference.len());
        for (i, rank) in inference.iter().enumerate() {
            let mut ts = Vec::new();
            for t in rank.cast::<PyList>()?.iter() {
                let t = t.cast::<PyTuple>()?;
                if !(3..=4).contains(&t.len()) {
                    return Err(layout_err(
                        py,
                        format!("inference {i}: a tensor is (name, segments, quant[, concat])"),
                    ));
                }
                let name: String = t.get_item(0)?.extract()?;
                let segs: Vec<SegmentArg> = t.get_item(1)?.extract()?;
                let quant: String = t.get_item(2)?.extract()?;
                let concat = match t.get_item(3).ok().map(|c| c.extract::<String>()) {
                    None => Concat::Rows,
                    Some(Ok(c)) if c == "rows" => Concat::Rows,
                    Some(Ok(c)) if c == "cols" => Concat::Cols,
                    Some(_) => {
                        let shown = t
                            .get_item(3)
                            .and_then(|c| c.repr())
                            .map_or_else(|_| "?".to_string(), |r| r.to_string());
                        return Err(layout_err(
                            py,
                            format!("inference {i} {name}: concat {shown} (\"rows\" or \"cols\")"),
                        ));
                    }
                };
                // "fp8:<block>": this tensor's own tile edge.
                let (quant, own_block) = match quant.split_once(':') {
                    None if quant == "none" => (Quant::None, None),
                    None if quant == "fp8" => (Quant::Fp8Block, None),
                    Some(("fp8", b)) if b.parse::<u64>().is_ok() => {
                        (Quant::Fp8Block, b.parse::<u64>().ok())
                    }
                    _ => {
                        return Err(layout_err(
                            py,
                            format!(
                                "inference {i} {name}: quant {quant:?} (\"none\", \"fp8\" or \"fp8:<block>\")"
                            ),
                        ))
                    }
                };
                let mut segments = Vec::with_capacity(segs.len());
                for (p, r0, r1, c0, c1) in segs {
                    let Some(&param) = index.get(&p) else {
                        return Err(layout_err(
                            py,
                            format!("inference {i} {name}: no parameter {p}"),
                        ));
                    };
                    if r0 > r1 || c0 > c1 {
                        return Err(layout_err(
                            py,
                            format!("inference {i} {name}: reversed range of {p}"),
                        ));
                    }
                    segments.push(Segment {
                        param,
                        src: Box2 {
                            rows: r0..r1,
                            cols: c0..c1,
                        },
                    });
                }
                ts.push(InferTensor {
                    name,
                    segments,
                    concat,
                    quant,
                    block: own_block,
                });
            }
            inf.push(ts);
        }
        let mut model = ModelLayout {
            trainers,
            params: ps,
            inference: inf,
        };
        let fallbacks = if fp8_fallback {
            model.fp8_fallback(block)
        } else {
            Vec::new()
        };
        let cfg = PlanConfig {
            block,
            unit_bytes,
            align,
            watermark,
            ramp,
            min_direct_bytes,
        };
        let p = py
            .detach(|| plan(&model, &cfg))
            .map_err(|e| rl_err(py, &e))?;
        Ok(Self {
            plan: Arc::new(p),
            model: Arc::new(model),
            fallbacks,
        })
    }

    /// Training ranks.
    #[getter]
    fn trainers(&self) -> u32 {
        self.model.trainers
    }

    /// Inference ranks.
    #[getter]
    fn inference_ranks(&self) -> usize {
        self.model.inference.len()
    }

    /// The fp8 targets kept in the trainers' dtype (`fp8_fallback=True`):
    /// `(inference_rank, tensor, reason)` each.
    fn fallbacks(&self) -> Vec<(u32, String, String)> {
        self.fallbacks
            .iter()
            .map(|f| (f.inference, f.tensor.clone(), f.reason.clone()))
            .collect()
    }

    /// The parameters: `(name, rows, cols, dtype)` each, in the order
    /// given.
    fn params(&self) -> Vec<(String, u64, u64, &'static str)> {
        self.model
            .params
            .iter()
            .map(|p| (p.name.clone(), p.rows, p.cols, dtype_name(p.dtype)))
            .collect()
    }

    /// What trainer `rank` holds: `(param, (row_start, row_end), (col_start,
    /// col_end))` per piece, in the order `RlTrainer.load_piece` takes.
    fn pieces<'py>(&self, py: Python<'py>, rank: u32) -> PyResult<Bound<'py, PyList>> {
        let t = self.plan.trainers.get(rank as usize).ok_or_else(|| {
            rl_err(
                py,
                &RlError::UnknownRank {
                    role: "trainer",
                    rank,
                },
            )
        })?;
        let items = t.pieces.iter().map(|(p, b, _)| {
            (
                self.model.params[*p].name.clone(),
                (b.rows.start, b.rows.end),
                (b.cols.start, b.cols.end),
            )
        });
        PyList::new(py, items)
    }

    /// The tensors inference rank `rank` receives: `(name, rows, cols,
    /// quant, dtype)` in the order `RlInference.read` takes; `dtype` is
    /// how it is stored (`"bf16"`, `"f32"` or `"fp8"`).
    fn tensors<'py>(&self, py: Python<'py>, rank: u32) -> PyResult<Bound<'py, PyList>> {
        let r = self.plan.inference.get(rank as usize).ok_or_else(|| {
            rl_err(
                py,
                &RlError::UnknownRank {
                    role: "inference",
                    rank,
                },
            )
        })?;
        let tensors = self.model.inference.get(rank as usize);
        let items = r.tensors.iter().enumerate().map(|(i, t)| {
            let src = tensors
                .and_then(|ts| ts.get(i))
                .and_then(|x| x.segments.first())
                .and_then(|sg| self.model.params.get(sg.param))
                .map_or("bf16", |p| dtype_name(p.dtype));
            let (q, d) = if t.quant == Quant::Fp8Block {
                ("fp8", "fp8")
            } else {
                ("none", src)
            };
            (t.name.clone(), t.rows, t.cols, q, d)
        });
        PyList::new(py, items)
    }

    /// Counts of the plan: `units`, `waves`, `mesh_groups`, `bytes` (into
    /// inference memory, all ranks), `arena_bytes` (per trainer),
    /// `trainer_bytes` (what each trainer writes).
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let p = &self.plan;
        d.set_item("units", p.units.len())?;
        d.set_item(
            "waves",
            p.groups.iter().map(|g| g.waves.len()).sum::<usize>(),
        )?;
        d.set_item("mesh_groups", p.groups.len())?;
        d.set_item("bytes", p.units.iter().map(|u| u.dest_bytes()).sum::<u64>())?;
        d.set_item("arena_bytes", p.arena_len)?;
        d.set_item("trainer_bytes", p.trainer_load())?;
        Ok(d)
    }
}

/// Every rank's endpoint (`RlTrainer.endpoint()` / `RlInference.endpoint()`,
/// pairs of `MrDesc`), one per trainer and one per inference rank of the
/// plan. Descriptors from other processes travel as `MrDesc.to_bytes()`.
#[pyclass(name = "RlDirectory", module = "weft._weft", frozen)]
pub struct PyRlDirectory {
    dir: Arc<Directory>,
}

#[pymethods]
impl PyRlDirectory {
    #[new]
    fn new(
        py: Python<'_>,
        plan: &PyRlPlan,
        trainers: Vec<(PyMrDesc, PyMrDesc)>,
        inference: Vec<(PyMrDesc, PyMrDesc)>,
    ) -> PyResult<Self> {
        if trainers.len() != plan.model.trainers as usize
            || inference.len() != plan.model.inference.len()
        {
            return Err(errors::invalid(
                py,
                format!(
                    "the plan has {} trainers and {} inference ranks, the directory {} and {}",
                    plan.model.trainers,
                    plan.model.inference.len(),
                    trainers.len(),
                    inference.len()
                ),
            ));
        }
        let trainers = trainers
            .into_iter()
            .map(|(s, a)| TrainerEndpoint {
                shards: s.inner,
                arena: a.inner,
            })
            .collect();
        let inference = inference
            .into_iter()
            .map(|(a, b)| InferEndpoint {
                weights: [a.inner, b.inner],
            })
            .collect();
        Ok(Self {
            dir: Arc::new(Directory {
                trainers,
                inference,
            }),
        })
    }

    /// Trainers listed.
    #[getter]
    fn trainers(&self) -> usize {
        self.dir.trainers.len()
    }

    /// Inference ranks listed.
    #[getter]
    fn inference_ranks(&self) -> usize {
        self.dir.inference.len()
    }
}

/// What a rank's constructor needs: its step settings, the engine and the
/// plan.
fn rank_setup(
    py: Python<'_>,
    engine: &Py<PyTransferEngine>,
    plan: &Py<PyRlPlan>,
    timeout: f64,
) -> PyResult<(StepConfig, Arc<weft::TransferEngine>, Arc<Plan>)> {
    Ok((
        step_config(py, timeout)?,
        Arc::new(engine.get().engine.clone()),
        plan.get().plan.clone(),
    ))
}

fn step_config(py: Python<'_>, timeout: f64) -> PyResult<StepConfig> {
    if timeout.is_finite() && timeout > 0.0 && timeout <= 1e6 {
        Ok(StepConfig {
            timeout: Duration::from_secs_f64(timeout),
        })
    } else {
        Err(errors::invalid(
            py,
            format!("timeout must be in (0, 1e6] seconds, not {timeout}"),
        ))
    }
}

/// One training rank of the update: registers its shard memory and arena
/// (sizes from the plan) on `engine`. Load every piece (`load`), then
/// `step(version, directory)` on every trainer at once. Thread-safe; `step`
/// releases the GIL.
#[pyclass(name = "RlTrainer", module = "weft._weft", frozen)]
pub struct PyRlTrainer {
    t: Trainer,
    plan: Arc<Plan>,
    model: Arc<ModelLayout>,
    plan_obj: Py<PyRlPlan>,
    _engine: Py<PyTransferEngine>,
}

#[pymethods]
impl PyRlTrainer {
    #[new]
    #[pyo3(signature = (engine, plan, rank, timeout = 10.0))]
    fn new(
        py: Python<'_>,
        engine: Py<PyTransferEngine>,
        plan: Py<PyRlPlan>,
        rank: u32,
        timeout: f64,
    ) -> PyResult<Self> {
        let (cfg, eng, p) = rank_setup(py, &engine, &plan, timeout)?;
        let t = py
            .detach(|| Trainer::new(eng, rank, p.clone(), cfg))
            .map_err(|e| rl_err(py, &e))?;
        Ok(Self {
            t,
            plan: p,
            model: plan.get().model.clone(),
            plan_obj: plan,
            _engine: engine,
        })
    }

    /// What the other ranks need of this one, for `RlDirectory`: the
    /// descriptors of its shard memory and of its arena.
    fn endpoint(&self) -> (PyMrDesc, PyMrDesc) {
        let e = self.t.endpoint();
        (PyMrDesc { inner: e.shards }, PyMrDesc { inner: e.arena })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.t.rank()
    }

    /// The plan.
    #[getter]
    fn plan(&self, py: Python<'_>) -> Py<PyRlPlan> {
        self.plan_obj.clone_ref(py)
    }

    /// Copies piece `index` (of `RlPlan.pieces(rank)`) in: `data` is its
    /// bf16 elements, row-major, as any C-contiguous buffer of exactly its
    /// size.
    fn load_piece(&self, py: Python<'_>, index: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let pieces = self.t.pieces();
        let (p, b, off) = pieces.get(index).ok_or_else(|| {
            errors::invalid(
                py,
                format!("piece {index}: this rank holds {}", pieces.len()),
            )
        })?;
        let want = b.elems() * self.model.params[*p].dtype.size();
        let mut g = BufferGuard::acquire(data)?;
        let ok = g.len() as u64 == want && self.t.shards().write(*off as usize, g.as_slice());
        g.release(py);
        if ok {
            Ok(())
        } else {
            Err(errors::invalid(
                py,
                format!(
                    "piece {index} of {}: {want} bytes expected",
                    self.model.params[*p].name
                ),
            ))
        }
    }

    /// Copies this rank's piece of parameter `name` in (see `load_piece`);
    /// an error if the rank holds no piece or several of it.
    fn load(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut found = self
            .t
            .pieces()
            .iter()
            .enumerate()
            .filter(|(_, (p, _, _))| self.model.params[*p].name == name)
            .map(|(i, _)| i);
        match (found.next(), found.next()) {
            (Some(i), None) => self.load_piece(py, i, data),
            (None, _) => Err(errors::invalid(
                py,
                format!("trainer {} holds no piece of {name}", self.t.rank()),
            )),
            (Some(_), Some(_)) => Err(errors::invalid(
                py,
                format!(
                    "trainer {} holds several pieces of {name}: use load_piece",
                    self.t.rank()
                ),
            )),
        }
    }

    /// Pushes version `version` into buffer `version % 2` of every inference
    /// rank; returns when every inference rank acknowledged, with the
    /// step's counts (`writes`, `bytes`, `gathers`, `gather_bytes`,
    /// `quantised`, `waves`). A failure (a peer dead or stalled past the
    /// timeout) raises `RlError`; call `recover()` on every rank before
    /// retrying.
    fn step<'py>(
        &self,
        py: Python<'py>,
        version: u64,
        directory: &PyRlDirectory,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dir = directory.dir.clone();
        let s = py
            .detach(|| self.t.step(version, &dir))
            .map_err(|e| rl_err(py, &e))?;
        let d = PyDict::new(py);
        d.set_item("writes", s.writes)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("gathers", s.gathers)?;
        d.set_item("gather_bytes", s.gather_bytes)?;
        d.set_item("quantised", s.quantised)?;
        d.set_item("waves", s.waves)?;
        Ok(d)
    }

    /// Clears partial immediate counts after a failed step.
    fn recover(&self, py: Python<'_>) -> PyResult<()> {
        self.t.recover().map_err(|e| rl_err(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "RlTrainer(rank={}, pieces={}, units={})",
            self.t.rank(),
            self.t.pieces().len(),
            self.plan.units.len()
        )
    }
}

/// One inference rank: two registered weight buffers; version `v` lands in
/// buffer `v % 2` and becomes live when every byte of it landed (the live
/// buffer is never written). `step(version, directory)` waits for the
/// version; `read(i)` copies tensor `i` of the live version out.
#[pyclass(name = "RlInference", module = "weft._weft", frozen)]
pub struct PyRlInference {
    inf: Inference,
    rank: u32,
    plan: Arc<Plan>,
    armed: Mutex<BTreeMap<u64, Arc<weft::DoneFlag>>>,
    plan_obj: Py<PyRlPlan>,
    _engine: Py<PyTransferEngine>,
}

#[pymethods]
impl PyRlInference {
    #[new]
    #[pyo3(signature = (engine, plan, rank, timeout = 10.0))]
    fn new(
        py: Python<'_>,
        engine: Py<PyTransferEngine>,
        plan: Py<PyRlPlan>,
        rank: u32,
        timeout: f64,
    ) -> PyResult<Self> {
        let (cfg, eng, p) = rank_setup(py, &engine, &plan, timeout)?;
        let inf = py
            .detach(|| Inference::new(eng, rank, p.clone(), cfg))
            .map_err(|e| rl_err(py, &e))?;
        Ok(Self {
            inf,
            rank,
            plan: p,
            armed: Mutex::new(BTreeMap::new()),
            plan_obj: plan,
            _engine: engine,
        })
    }

    /// What trainers need of this rank, for `RlDirectory`: the
    /// descriptors of its two weight buffers.
    fn endpoint(&self) -> (PyMrDesc, PyMrDesc) {
        let [a, b] = self.inf.endpoint().weights;
        (PyMrDesc { inner: a }, PyMrDesc { inner: b })
    }

    /// Arms the count of version `version` (optional: `step` arms it if
    /// this was not called; writes that arrive first count either way).
    fn begin(&self, py: Python<'_>, version: u64) -> PyResult<()> {
        let mut armed = self.armed.lock();
        if armed.contains_key(&version) {
            return Ok(());
        }
        let f = self.inf.begin(version).map_err(|e| rl_err(py, &e))?;
        armed.insert(version, f);
        Ok(())
    }

    /// Waits until every byte of version `version` landed, makes it live and
    /// acknowledges it to every trainer. On failure (`RlError`, kind
    /// `timeout` or `engine`) the live version stays as it was; call
    /// `recover()` before retrying.
    fn step(&self, py: Python<'_>, version: u64, directory: &PyRlDirectory) -> PyResult<()> {
        self.begin(py, version)?;
        let flag = self.armed.lock().remove(&version);
        let Some(flag) = flag else {
            return Err(errors::invalid(py, format!("version {version} not armed")));
        };
        let dir = directory.dir.clone();
        py.detach(|| self.inf.finish(&flag, version, &dir))
            .map_err(|e| rl_err(py, &e))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// The plan.
    #[getter]
    fn plan(&self, py: Python<'_>) -> Py<PyRlPlan> {
        self.plan_obj.clone_ref(py)
    }

    /// The live version, or `None` before the first step.
    #[getter]
    fn live(&self) -> Option<u64> {
        self.inf.live()
    }

    /// The bytes of tensor `index` (of `RlPlan.tensors(rank)`) in the live
    /// version: bf16 (or e4m3 for fp8 tensors) row-major.
    fn read<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        self.read_part(py, index, false)
    }

    /// The f32 tile scales of fp8 tensor `index` in the live version,
    /// row-major `[ceil(rows/block), ceil(cols/block)]` (the tensor's block).
    fn read_scales<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        self.read_part(py, index, true)
    }

    /// Clears partial counts after a failed step.
    fn recover(&self, py: Python<'_>) -> PyResult<()> {
        self.armed.lock().clear();
        self.inf.recover().map_err(|e| rl_err(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "RlInference(rank={}, tensors={}, live={:?})",
            self.rank,
            self.plan.inference[self.rank as usize].tensors.len(),
            self.inf.live()
        )
    }
}

impl PyRlInference {
    fn read_part<'py>(
        &self,
        py: Python<'py>,
        index: usize,
        scales: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let Some((_, buf)) = self.inf.weights() else {
            return Err(errors::invalid(py, "no version is live yet"));
        };
        let t = self.inf.tensors().get(index).ok_or_else(|| {
            errors::invalid(
                py,
                format!("tensor {index}: this rank has {}", self.inf.tensors().len()),
            )
        })?;
        let (off, len) = if scales {
            t.scales
                .ok_or_else(|| errors::invalid(py, format!("{} has no scales", t.name)))?
        } else {
            t.data
        };
        let bytes = buf
            .read(off as usize, len as usize)
            .ok_or_else(|| errors::invalid(py, format!("{}: outside the buffer", t.name)))?;
        Ok(PyBytes::new(py, &bytes))
    }
}
