//! Parameter metadata: what trainers hold (name, global shape, dtype, how
//! each rank holds it) and what inference ranks want (tensors assembled from
//! boxes of training parameters, possibly fused and fp8-quantised).
//!
//! Every tensor is seen as 2-D `[rows, cols]`: a weight `[out, in]` as is, a
//! 1-D vector `[n]` as `[n, 1]`, a stack of experts as one parameter per
//! expert. A torch `Shard(0)` is a row split, `Shard(1)` a column split
//! (TP column-parallel weights are `Shard(0)` of `[out, in]`, row-parallel
//! ones `Shard(1)`).

use std::ops::Range;

use crate::RlError;

/// A training rank (index into the trainers).
pub type Rank = u32;

/// Element types on either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// bfloat16, 2 bytes.
    Bf16,
    /// float8 e4m3 (fn variant: no infinities, max 448), 1 byte.
    F8E4M3,
    /// float32, 4 bytes (block scales).
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::Bf16 => 2,
            DType::F8E4M3 => 1,
            DType::F32 => 4,
        }
    }
}

/// How the ranks of a parameter's mesh hold it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Layout {
    /// Every listed rank holds the whole tensor.
    Replicate {
        /// The holders.
        ranks: Vec<Rank>,
    },
    /// Rank `ranks[i]` holds `sizes[i]` consecutive rows (`dim == 0`) or
    /// columns (`dim == 1`), in order; sizes may be uneven or zero and sum
    /// to the extent (FSDP `Shard(dim)`, TP column/row splits).
    Shard {
        /// 0: rows, 1: columns.
        dim: u8,
        /// The holders, in split order.
        ranks: Vec<Rank>,
        /// Extent each holder has along `dim`.
        sizes: Vec<u64>,
    },
    /// A torch DTensor's layout: the ranks form an N-D mesh of `shape`
    /// (row-major: `ranks[i]` sits at the coordinates of index `i`), with
    /// one placement per mesh dimension. `Shard(d)` splits tensor dimension
    /// `d` (0: rows, 1: columns) the way `torch.chunk` does; when several
    /// mesh dimensions shard one tensor dimension the outer one splits
    /// first and the inner ones split its chunks. FSDP × TP (a 2-D grid of
    /// boxes), HSDP (shards replicated over an outer mesh dimension) and
    /// TP with replicated norms are all meshes. Ranks holding the same box
    /// are replicas: the planner may pick any of them to write it.
    Mesh {
        /// Extent of each mesh dimension (product = `ranks.len()`).
        shape: Vec<u32>,
        /// The ranks, row-major over `shape`.
        ranks: Vec<Rank>,
        /// One per mesh dimension.
        placements: Vec<Placement>,
    },
}

/// How one mesh dimension places a tensor (torch DTensor placements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Placement {
    /// Every coordinate along this mesh dimension holds the same part.
    Replicate,
    /// This mesh dimension splits tensor dimension `0` (rows) or `1`
    /// (columns) as `torch.chunk`.
    Shard(u8),
}

impl Layout {
    /// torch `chunk` semantics (FSDP2 `Shard(dim)`): `ceil(extent/n)` per
    /// rank, the last ones shorter or empty.
    pub fn fsdp(dim: u8, ranks: Vec<Rank>, extent: u64) -> Layout {
        let n = ranks.len().max(1) as u64;
        let chunk = extent.div_ceil(n);
        let sizes = (0..n)
            .map(|i| extent.saturating_sub(i * chunk).min(chunk))
            .collect();
        Layout::Shard { dim, ranks, sizes }
    }

    /// Even split with the remainder spread over the first ranks (TP).
    pub fn even(dim: u8, ranks: Vec<Rank>, extent: u64) -> Layout {
        let n = ranks.len().max(1) as u64;
        let sizes = (0..n)
            .map(|i| extent / n + u64::from(i < extent % n))
            .collect();
        Layout::Shard { dim, ranks, sizes }
    }

    /// Every rank that holds some of the tensor.
    pub fn ranks(&self) -> &[Rank] {
        match self {
            Layout::Replicate { ranks }
            | Layout::Shard { ranks, .. }
            | Layout::Mesh { ranks, .. } => ranks,
        }
    }

    /// Checks a mesh's shape, ranks and placements (other layouts: `Ok`).
    fn check_mesh(&self) -> Result<(), String> {
        let Layout::Mesh {
            shape,
            ranks,
            placements,
        } = self
        else {
            return Ok(());
        };
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(u64::from(d)));
        if shape.is_empty() || shape.contains(&0) || n != Some(ranks.len() as u64) {
            return Err(format!(
                "mesh shape {shape:?} does not cover its {} ranks",
                ranks.len()
            ));
        }
        if placements.len() != shape.len() {
            return Err(format!(
                "{} placements for a {}-D mesh",
                placements.len(),
                shape.len()
            ));
        }
        if let Some(Placement::Shard(d)) = placements
            .iter()
            .find(|p| matches!(p, Placement::Shard(d) if *d > 1))
        {
            return Err(format!("Shard({d}) of a 2-D tensor"));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(r) = ranks.iter().find(|&&r| !seen.insert(r)) {
            return Err(format!("rank {r} twice in the mesh"));
        }
        Ok(())
    }
}

/// `torch.chunk` of `range` into `n` parts: part `i` (empty past the end).
fn chunk(range: &Range<u64>, n: u64, i: u64) -> Range<u64> {
    let len = range.end - range.start;
    let size = len.div_ceil(n.max(1));
    let start = (range.start + i * size).min(range.end);
    start..(start + size).min(range.end)
}

/// The box the rank at row-major mesh index `index` holds.
fn mesh_box(shape: &[u32], placements: &[Placement], index: usize, whole: &Box2) -> Box2 {
    // Coordinates, outermost first.
    let mut coords = vec![0u64; shape.len()];
    let mut rest = index as u64;
    for (k, &d) in shape.iter().enumerate().rev() {
        coords[k] = rest % u64::from(d);
        rest /= u64::from(d);
    }
    let mut b = whole.clone();
    for ((&d, p), &c) in shape.iter().zip(placements).zip(&coords) {
        match p {
            Placement::Shard(0) => b.rows = chunk(&b.rows, u64::from(d), c),
            Placement::Shard(_) => b.cols = chunk(&b.cols, u64::from(d), c),
            Placement::Replicate => {}
        }
    }
    b
}

/// A training-side parameter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TrainParam {
    /// Fully qualified name.
    pub name: String,
    /// Global rows.
    pub rows: u64,
    /// Global columns.
    pub cols: u64,
    /// Element type on the trainers (bf16 in every shipped model).
    pub dtype: DType,
    /// The MeshGroup it belongs to (groups run one after another).
    pub mesh_group: u32,
    /// How the ranks hold it.
    pub layout: Layout,
}

/// A rectangle of a parameter (global coordinates).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Box2 {
    /// Row range.
    pub rows: Range<u64>,
    /// Column range.
    pub cols: Range<u64>,
}

impl Box2 {
    /// Elements.
    pub fn elems(&self) -> u64 {
        (self.rows.end - self.rows.start) * (self.cols.end - self.cols.start)
    }
    /// Width in columns.
    pub fn width(&self) -> u64 {
        self.cols.end - self.cols.start
    }
    /// Height in rows.
    pub fn height(&self) -> u64 {
        self.rows.end - self.rows.start
    }
    /// Intersection, if not empty.
    pub fn intersect(&self, o: &Box2) -> Option<Box2> {
        let r = self.rows.start.max(o.rows.start)..self.rows.end.min(o.rows.end);
        let c = self.cols.start.max(o.cols.start)..self.cols.end.min(o.cols.end);
        (r.start < r.end && c.start < c.end).then_some(Box2 { rows: r, cols: c })
    }
}

/// One part of an inference tensor: a box of a training parameter, placed
/// below the previous segments ([`Concat::Rows`]: q/k/v into `qkv_proj`,
/// gate/up into `gate_up_proj`, experts into a stacked `w13`) or to their
/// right ([`Concat::Cols`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index into the model's parameters.
    pub param: usize,
    /// The part of that parameter.
    pub src: Box2,
}

/// Whether an inference tensor is stored as the trainers' bf16 or
/// quantised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Quant {
    /// Same dtype as on the trainers.
    None,
    /// fp8 e4m3 with one f32 scale per `block × block` tile (the plan's
    /// `block`, 128 for DeepSeek-V3/Kimi-K2 checkpoints); the scales are a
    /// second tensor `[ceil(rows/block), ceil(cols/block)]` right after it.
    Fp8Block,
}

/// Along which dimension an inference tensor joins its segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Concat {
    /// Stacked top to bottom (torch `cat(dim=0)`); all segments of one
    /// width. Fused projections and stacked experts.
    #[default]
    Rows,
    /// Side by side, left to right (torch `cat(dim=1)`); all segments of
    /// one height. An fp8 target needs every segment but the last to be
    /// whole tiles wide.
    Cols,
}

impl Concat {
    /// How messages name it: the unit along it (plural, singular), and the
    /// extent all segments share.
    fn words(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Concat::Rows => ("rows", "row", "width"),
            Concat::Cols => ("columns", "column", "height"),
        }
    }
}

/// A tensor an inference rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InferTensor {
    /// Name on the inference side.
    pub name: String,
    /// Its parts, in order along `concat`.
    pub segments: Vec<Segment>,
    /// How the segments are joined.
    pub concat: Concat,
    /// Storage.
    pub quant: Quant,
    /// fp8: the tile edge of this tensor's scales (`None`: the plan's
    /// `block`); 1..=4096.
    pub block: Option<u64>,
}

impl InferTensor {
    /// The fp8 tile edge in effect: `block`, else the plan's.
    pub fn tile(&self, plan_block: u64) -> u64 {
        self.block.unwrap_or(plan_block)
    }
    /// Rows (stacked: the sum of the segments').
    pub fn rows(&self) -> u64 {
        match self.concat {
            Concat::Rows => self.segments.iter().map(|s| s.src.height()).sum(),
            Concat::Cols => self.segments.first().map_or(0, |s| s.src.height()),
        }
    }
    /// Columns (side by side: the sum of the segments').
    pub fn cols(&self) -> u64 {
        match self.concat {
            Concat::Rows => self.segments.first().map_or(0, |s| s.src.width()),
            Concat::Cols => self.segments.iter().map(|s| s.src.width()).sum(),
        }
    }
    /// Where each segment's top-left corner sits in the tensor:
    /// `(row, col)`, one per segment.
    pub fn offsets(&self) -> Vec<(u64, u64)> {
        let mut at = 0;
        self.segments
            .iter()
            .map(|s| {
                let o = match self.concat {
                    Concat::Rows => (at, 0),
                    Concat::Cols => (0, at),
                };
                at += self.extents(s).0;
                o
            })
            .collect()
    }
    /// A segment's extent along `concat` (what must be whole fp8 tiles
    /// for every segment but the last) and across it (what all segments
    /// share).
    fn extents(&self, s: &Segment) -> (u64, u64) {
        match self.concat {
            Concat::Rows => (s.src.height(), s.src.width()),
            Concat::Cols => (s.src.width(), s.src.height()),
        }
    }
}

/// An fp8 target [`ModelLayout::fp8_fallback`] kept unquantised.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fp8Fallback {
    /// The inference rank.
    pub inference: u32,
    /// The tensor's name.
    pub tensor: String,
    /// Why it could not be quantised.
    pub reason: String,
}

/// The whole description a controller gathers once.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelLayout {
    /// Training ranks.
    pub trainers: u32,
    /// The training parameters.
    pub params: Vec<TrainParam>,
    /// Per inference rank, its tensors in memory order.
    pub inference: Vec<Vec<InferTensor>>,
}

impl ModelLayout {
    /// Checks shapes, shard tilings and segment bounds.
    pub fn validate(&self, block: u64) -> Result<(), RlError> {
        let bad = |m: String| Err(RlError::Layout(m));
        for p in &self.params {
            if !matches!(p.dtype, DType::Bf16 | DType::F32) {
                return bad(format!("{}: trainers hold bf16 or f32", p.name));
            }
            let ranks = p.layout.ranks();
            if ranks.is_empty() {
                return bad(format!("{}: no holder", p.name));
            }
            if let Some(r) = ranks.iter().find(|&&r| r >= self.trainers) {
                return bad(format!(
                    "{}: rank {r} >= {} trainers",
                    p.name, self.trainers
                ));
            }
            if let Err(m) = p.layout.check_mesh() {
                return bad(format!("{}: {m}", p.name));
            }
            if let Layout::Shard { dim, ranks, sizes } = &p.layout {
                let ext = if *dim == 0 { p.rows } else { p.cols };
                if *dim > 1 || sizes.len() != ranks.len() || sizes.iter().sum::<u64>() != ext {
                    return bad(format!("{}: shard sizes do not tile dim {dim}", p.name));
                }
            }
        }
        for (i, ts) in self.inference.iter().enumerate() {
            for t in ts {
                let nseg = t.segments.len();
                let across = t.segments.first().map_or(0, |s| t.extents(s).1);
                if nseg == 0 || across == 0 {
                    return bad(format!("inference {i} {}: empty", t.name));
                }
                let block = t.tile(block);
                if !(1..=4096).contains(&block) {
                    return bad(format!(
                        "inference {i} {}: fp8 block {block}, expected 1..=4096",
                        t.name
                    ));
                }
                let dtype = self.params.get(t.segments[0].param).map(|p| p.dtype);
                for (k, s) in t.segments.iter().enumerate() {
                    let Some(p) = self.params.get(s.param) else {
                        return bad(format!("inference {i} {}: no param {}", t.name, s.param));
                    };
                    if Some(p.dtype) != dtype {
                        return bad(format!(
                            "inference {i} {}: segment {k} ({}) is {:?}, segment 0 {dtype:?}: one tensor, one dtype",
                            t.name, p.name, p.dtype
                        ));
                    }
                    if t.quant == Quant::Fp8Block && p.dtype != DType::Bf16 {
                        return bad(format!(
                            "inference {i} {}: fp8 from {} ({:?}): fp8 targets quantise bf16",
                            t.name, p.name, p.dtype
                        ));
                    }
                    let (along, across_k) = t.extents(s);
                    if s.src.rows.end > p.rows
                        || s.src.cols.end > p.cols
                        || along == 0
                        || across_k != across
                    {
                        return bad(format!(
                            "inference {i} {}: segment {k} outside {} or of another {}",
                            t.name,
                            p.name,
                            t.concat.words().2
                        ));
                    }
                    if t.quant == Quant::Fp8Block && k + 1 < nseg && along % block != 0 {
                        let (many, one, _) = t.concat.words();
                        return bad(format!(
                            "inference {i} {}: fp8 segment {k} has {along} {many}, not a multiple of the {block}-{one} block",
                            t.name,
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The explicit fp8 fallback: every fp8 target that cannot be
    /// quantised as given — a segment other than the last that is not whole
    /// tiles along `concat` (the tensor's block, else `block`) (e.g. Qwen3's
    /// q/k/v at TP 3), or a source that is
    /// not bf16 — is kept in the trainers' dtype instead (`Quant::None`).
    /// Returns what it changed, for the plan summary; apply it before
    /// [`crate::plan()`], and read each tensor's storage from the plan's
    /// `TensorSlot::quant`.
    pub fn fp8_fallback(&mut self, block: u64) -> Vec<Fp8Fallback> {
        let mut out = Vec::new();
        for (i, ts) in self.inference.iter_mut().enumerate() {
            for t in ts.iter_mut().filter(|t| t.quant == Quant::Fp8Block) {
                let n = t.segments.len();
                let block = t.tile(block);
                let reason = t.segments.iter().enumerate().find_map(|(k, s)| {
                    let p = self.params.get(s.param)?;
                    let along = t.extents(s).0;
                    let (many, one, _) = t.concat.words();
                    if p.dtype != DType::Bf16 {
                        Some(format!("{} is {:?}", p.name, p.dtype))
                    } else if k + 1 < n && block > 0 && along % block != 0 {
                        Some(format!(
                            "segment {k} ({}) has {along} {many}, not whole {block}-{one} tiles",
                            p.name
                        ))
                    } else {
                        None
                    }
                });
                if let Some(reason) = reason {
                    t.quant = Quant::None;
                    out.push(Fp8Fallback {
                        inference: i as u32,
                        tensor: t.name.clone(),
                        reason,
                    });
                }
            }
        }
        out
    }

    /// The pieces of parameter `p`: `(holders, box)`.
    pub fn pieces(&self, p: usize) -> Vec<(Vec<Rank>, Box2)> {
        let q = &self.params[p];
        match &q.layout {
            Layout::Replicate { ranks } => vec![(
                ranks.clone(),
                Box2 {
                    rows: 0..q.rows,
                    cols: 0..q.cols,
                },
            )],
            Layout::Shard { dim, ranks, sizes } => {
                let mut at = 0;
                let mut out = Vec::new();
                for (r, s) in ranks.iter().zip(sizes) {
                    let range = at..at + s;
                    at += s;
                    if *s == 0 {
                        continue;
                    }
                    let b = if *dim == 0 {
                        Box2 {
                            rows: range,
                            cols: 0..q.cols,
                        }
                    } else {
                        Box2 {
                            rows: 0..q.rows,
                            cols: range,
                        }
                    };
                    out.push((vec![*r], b));
                }
                out
            }
            Layout::Mesh {
                shape,
                ranks,
                placements,
            } => {
                let whole = Box2 {
                    rows: 0..q.rows,
                    cols: 0..q.cols,
                };
                // Replicas grouped by box, boxes in the order of their
                // first holder.
                let mut out: Vec<(Vec<Rank>, Box2)> = Vec::new();
                let mut at: std::collections::BTreeMap<_, usize> = Default::default();
                for (i, &r) in ranks.iter().enumerate() {
                    let b = mesh_box(shape, placements, i, &whole);
                    if b.elems() == 0 {
                        continue;
                    }
                    let key = (b.rows.start, b.rows.end, b.cols.start, b.cols.end);
                    match at.get(&key) {
                        Some(&k) => out[k].0.push(r),
                        None => {
                            at.insert(key, out.len());
                            out.push((vec![r], b));
                        }
                    }
                }
                out
            }
        }
    }

    /// Mesh groups in execution order with their ranks (sorted).
    pub fn mesh_groups(&self) -> Vec<(u32, Vec<Rank>)> {
        let mut g: std::collections::BTreeMap<u32, std::collections::BTreeSet<Rank>> =
            Default::default();
        for p in &self.params {
            g.entry(p.mesh_group)
                .or_default()
                .extend(p.layout.ranks().iter().copied());
        }
        g.into_iter()
            .map(|(k, v)| (k, v.into_iter().collect()))
            .collect()
    }
}
