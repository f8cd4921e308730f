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
            Layout::Replicate { ranks } | Layout::Shard { ranks, .. } => ranks,
        }
    }
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
/// below the previous segments (inference tensors concatenate their
/// segments along rows: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`,
/// experts into a stacked `w13`).
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

/// A tensor an inference rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InferTensor {
    /// Name on the inference side.
    pub name: String,
    /// Its parts, top to bottom; all of one width.
    pub segments: Vec<Segment>,
    /// Storage.
    pub quant: Quant,
}

impl InferTensor {
    /// Rows (sum of the segments').
    pub fn rows(&self) -> u64 {
        self.segments.iter().map(|s| s.src.height()).sum()
    }
    /// Columns.
    pub fn cols(&self) -> u64 {
        self.segments.first().map_or(0, |s| s.src.width())
    }
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
            if p.dtype != DType::Bf16 {
                return bad(format!("{}: trainers hold bf16 only", p.name));
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
            if let Layout::Shard { dim, ranks, sizes } = &p.layout {
                let ext = if *dim == 0 { p.rows } else { p.cols };
                if *dim > 1 || sizes.len() != ranks.len() || sizes.iter().sum::<u64>() != ext {
                    return bad(format!("{}: shard sizes do not tile dim {dim}", p.name));
                }
            }
        }
        for (i, ts) in self.inference.iter().enumerate() {
            for t in ts {
                let w = t.cols();
                let nseg = t.segments.len();
                if nseg == 0 || w == 0 {
                    return bad(format!("inference {i} {}: empty", t.name));
                }
                for (k, s) in t.segments.iter().enumerate() {
                    let Some(p) = self.params.get(s.param) else {
                        return bad(format!("inference {i} {}: no param {}", t.name, s.param));
                    };
                    if s.src.rows.end > p.rows
                        || s.src.cols.end > p.cols
                        || s.src.height() == 0
                        || s.src.width() != w
                    {
                        return bad(format!(
                            "inference {i} {}: segment {k} outside {} or of another width",
                            t.name, p.name
                        ));
                    }
                    if t.quant == Quant::Fp8Block && k + 1 < nseg && s.src.height() % block != 0 {
                        return bad(format!(
                            "inference {i} {}: fp8 segment {k} has {} rows, not a multiple of the {block}-row block",
                            t.name,
                            s.src.height()
                        ));
                    }
                }
            }
        }
        Ok(())
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
