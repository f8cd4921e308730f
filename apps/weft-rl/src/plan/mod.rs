//! The static routing planner (pure, clock-free, deterministic).
//!
//! Input: a [`ModelLayout`]. Output: a [`Plan`] that says, for every byte of
//! every inference-side tensor (and its fp8 scales), which training rank
//! writes it and from where, as [`Run`]s — contiguous (one
//! `submit_single_write`) or regular strided pages (one
//! `submit_paged_writes`).
//!
//! Work is cut into [`Unit`]s: a box of one parameter that lands in one
//! inference tensor.
//! - **bf16 targets**: a unit never crosses a training shard, so its writer
//!   is the shard's holder and it is written straight out of the trainer's
//!   shard memory (no staging, no gather). Replicated parameters may be
//!   written by any holder: the planner chooses.
//! - **fp8 targets**: a unit is a band of whole `block`-row tiles across
//!   the full segment width (a scale needs the whole tile), so it may span
//!   several shards. Its writer is chosen among the holders of those
//!   shards; the others write their parts into the writer's *arena*
//!   (unshard, the `full_tensor` step), the writer quantises into the arena
//!   and writes fp8 bytes and f32 scales out.
//!
//! **Balance**: within each mesh group, units with one possible writer are
//! assigned first, then the others by decreasing size, each to the
//! least-loaded possible writer (load = bytes written to inference; ties to
//! the lowest rank). Bound (checked by the property test): for every rank,
//! its group load minus the size of the last flexible unit it received is
//! at most the load of every other rank that could have taken that unit;
//! so when all units of a group share one holder set, `max - min ≤` the
//! largest unit (`unit_bytes` or one shard band).
//!
//! **Waves** (the watermark): the units of a mesh group are cut into waves
//! so that no trainer's arena holds more than `watermark` bytes at a time;
//! a wave starts with a barrier among the group's ranks (every arena of the
//! group is free again). Before the cut, the group's units are interleaved
//! writer by writer, the writer with the fewest bytes so far first, so each
//! wave gives every writer about the same share (a writer that got a whole
//! wave's worth alone would hold the others at the next barrier). A
//! group's first waves are smaller (`ramp`: a quarter, then a half of the
//! watermark) so its first WRITEs wait for a short unshard only.

use std::collections::BTreeMap;

mod batch;
mod order;
mod runs;

pub use batch::{gather_posts, GatherPost, BATCH_PAGE_MAX};

pub(crate) use runs::box_run;
use runs::pair;
pub use runs::{Run, Xfer};

use crate::meta::{Box2, DType, ModelLayout, Quant, Rank};
use crate::RlError;

/// Planner knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanConfig {
    /// fp8 tile edge (128 for DeepSeek-V3 / Kimi-K2 checkpoints).
    pub block: u64,
    /// Target size of one unit (bytes on the trainer, bf16); 2 MiB by
    /// default (smaller units spread a wave more evenly over the writers
    /// and fill the pipeline sooner, for a few more WRs).
    pub unit_bytes: u64,
    /// Alignment of tensors in inference regions and of arena slots.
    pub align: u64,
    /// Bytes of staging (arena) one trainer may hold at a time.
    pub watermark: u64,
    /// Ramp-up: the first `ramp` waves of each mesh group hold a
    /// quarter, a half, … of the watermark (wave `i < ramp` gets
    /// `watermark >> (ramp - i)`), so a group's first WRITEs start after a
    /// small unshard instead of a whole watermark's worth (the pipeline
    /// fills sooner). 0 cuts every wave at the watermark.
    pub ramp: u32,
    /// A bf16 target is written straight from the trainers' shards only
    /// when every shard's part of it is at least this long (or one shard
    /// holds all of it); otherwise it is unsharded into one writer's arena
    /// first (no flood of tiny writes for norms and small vectors).
    pub min_direct_bytes: u64,
}

impl PlanConfig {
    /// Every knob in its range: a tile edge of 1 to 4096, a unit size and
    /// watermark above 0, an alignment that is a power of two. [`plan`]
    /// checks it first.
    pub fn validate(&self) -> Result<(), RlError> {
        RlError::check(
            (1..=4096).contains(&self.block),
            "block",
            self.block,
            "a tile edge of 1 to 4096",
        )?;
        RlError::check(
            self.unit_bytes > 0,
            "unit_bytes",
            self.unit_bytes,
            "above 0",
        )?;
        RlError::check(
            self.align.is_power_of_two(),
            "align",
            self.align,
            "a power of two",
        )?;
        RlError::check(self.watermark > 0, "watermark", self.watermark, "above 0")?;
        RlError::check(self.ramp <= 16, "ramp", self.ramp, "0 to 16 waves")?;
        Ok(())
    }

    /// Bytes wave `wave` of a mesh group may stage per writer: the
    /// watermark, halved per ramp-up wave still ahead (see
    /// [`PlanConfig::ramp`]). A unit larger than that still gets a wave of
    /// its own.
    pub fn wave_budget(&self, wave: usize) -> u64 {
        let ahead = (self.ramp as usize).saturating_sub(wave);
        (self.watermark >> ahead.min(63)).max(1)
    }
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            block: 128,
            unit_bytes: 2 << 20,
            align: 256,
            watermark: 512 << 20,
            ramp: 2,
            min_direct_bytes: 256 << 10,
        }
    }
}

/// A part of a unit that another rank writes into the writer's arena.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gather {
    /// The rank that holds it.
    pub from: Rank,
    /// From its shard memory (trainer region) to the writer's arena.
    pub xfer: Xfer,
}

/// One piece of work.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Unit {
    /// Mesh group.
    pub mesh_group: u32,
    /// Wave within the group.
    pub wave: u32,
    /// Parameter index.
    pub param: usize,
    /// Box of the parameter.
    pub src: Box2,
    /// Storage of the target.
    pub quant: Quant,
    /// Where it lands: one entry per inference tensor holding this box
    /// (replicas across TP groups and instances are written from one
    /// staging copy: unshard and quantise once, write many times).
    pub dests: Vec<Dest>,
    /// The rank that writes it to inference.
    pub writer: Rank,
    /// Ranks that could have.
    pub eligible: Vec<Rank>,
    /// Order in which the balancer assigned it (within its group).
    pub assign_seq: u32,
    /// Staged (fp8): arena range `[arena_off, arena_off + arena_len)`; the
    /// bf16 box sits at `arena_off`, row-major with `src.width()` columns.
    pub arena: Option<(u64, u64)>,
    /// Staged: the writer's own parts (trainer region → arena).
    pub local: Vec<Xfer>,
    /// Staged: parts others write into the arena.
    pub gathers: Vec<Gather>,
}

/// One destination of a unit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Dest {
    /// Inference rank.
    pub inf: u32,
    /// Tensor index on that rank.
    pub tensor: usize,
    /// First row of the unit in the inference tensor.
    pub dest_row: u64,
    /// First column of the unit in the inference tensor.
    pub dest_col: u64,
    /// Unstaged: `src` in the writer's trainer region. Staged: `src` in the
    /// arena (the quantised bytes).
    pub data: Xfer,
    /// fp8 scales (contiguous, from the arena).
    pub scales: Option<Xfer>,
}

impl Dest {
    /// Bytes it puts into inference memory.
    pub fn bytes(&self) -> u64 {
        self.data.dst.bytes() + self.scales.map_or(0, |s| s.dst.bytes())
    }
    /// Its transfers (data, then scales).
    pub fn xfers(&self) -> impl Iterator<Item = &Xfer> + '_ {
        std::iter::once(&self.data).chain(self.scales.as_ref())
    }
}

impl Unit {
    /// Bytes it puts into inference memory (all destinations).
    pub fn dest_bytes(&self) -> u64 {
        self.dests.iter().map(Dest::bytes).sum()
    }
}

/// Where a tensor sits in an inference rank's region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSlot {
    /// Name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// Storage.
    pub quant: Quant,
    /// Data bytes.
    pub data: (u64, u64),
    /// Scale bytes (fp8): `[ceil(rows/block), ceil(cols/block)]` f32.
    pub scales: Option<(u64, u64)>,
    /// fp8 tile edge (the tensor's block, else the plan's).
    pub block: u64,
}

/// An inference rank's weight region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InferRegion {
    /// Tensors in memory order.
    pub tensors: Vec<TensorSlot>,
    /// Region length.
    pub len: u64,
}

/// Where a trainer keeps the pieces it holds (one registered region).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TrainerRegion {
    /// `(param, box, offset)`: the box row-major (bf16) at `offset`.
    pub pieces: Vec<(usize, Box2, u64)>,
    /// Region length.
    pub len: u64,
}

impl TrainerRegion {
    /// The held piece of `param` containing `b`.
    pub fn piece(&self, param: usize, b: &Box2) -> Option<&(usize, Box2, u64)> {
        // Pieces are stored in parameter order.
        let lo = self.pieces.partition_point(|(p, _, _)| *p < param);
        self.pieces[lo..]
            .iter()
            .take_while(|(p, _, _)| *p == param)
            .find(|(_, pb, _)| {
                pb.rows.start <= b.rows.start
                    && b.rows.end <= pb.rows.end
                    && pb.cols.start <= b.cols.start
                    && b.cols.end <= pb.cols.end
            })
    }
}

/// One mesh group's schedule.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupPlan {
    /// Group id.
    pub id: u32,
    /// Its ranks, sorted.
    pub ranks: Vec<Rank>,
    /// Unit index ranges, one per wave.
    pub waves: Vec<std::ops::Range<usize>>,
}

/// The routing table.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan {
    /// Knobs it was made with.
    pub config: PlanConfig,
    /// Per trainer.
    pub trainers: Vec<TrainerRegion>,
    /// Per inference rank.
    pub inference: Vec<InferRegion>,
    /// Units, grouped by mesh group then wave.
    pub units: Vec<Unit>,
    /// Mesh groups in execution order.
    pub groups: Vec<GroupPlan>,
    /// Arena bytes of one wave (largest wave use, ≤ watermark); trainers
    /// register two halves of it (consecutive waves overlap).
    pub arena_len: u64,
}

/// Identity of a unit across replicas: parameter, box, fp8, staged.
/// (param, box, fp8, staged, fp8 block): what makes units one.
type UnitKey = (usize, u64, u64, u64, u64, bool, bool, u64);

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a.max(1)) * a.max(1)
}

/// Lays out one inference rank's tensors.
fn infer_region(m: &ModelLayout, ts: &[crate::meta::InferTensor], cfg: &PlanConfig) -> InferRegion {
    let mut at = 0;
    let mut tensors = Vec::with_capacity(ts.len());
    for t in ts {
        let (rows, cols) = (t.rows(), t.cols());
        let elem = match t.quant {
            Quant::None => m.params[t.segments[0].param].dtype.size(),
            Quant::Fp8Block => DType::F8E4M3.size(),
        };
        let data = (at, rows * cols * elem);
        at = align_up(at + data.1, cfg.align);
        let block = t.tile(cfg.block);
        let scales = (t.quant == Quant::Fp8Block).then(|| {
            let s = (at, rows.div_ceil(block) * cols.div_ceil(block) * 4);
            at = align_up(at + s.1, cfg.align);
            s
        });
        tensors.push(TensorSlot {
            name: t.name.clone(),
            rows,
            cols,
            quant: t.quant,
            data,
            scales,
            block,
        });
    }
    InferRegion {
        tensors,
        len: at.max(1),
    }
}

/// Computes the routing table.
pub fn plan(m: &ModelLayout, cfg: &PlanConfig) -> Result<Plan, RlError> {
    cfg.validate()?;
    if cfg.block == 0 || cfg.unit_bytes == 0 || cfg.align == 0 {
        return Err(RlError::Plan(
            "block, unit_bytes and align must be > 0".into(),
        ));
    }
    m.validate(cfg.block)?;
    // Trainer regions.
    let mut trainers: Vec<TrainerRegion> = (0..m.trainers)
        .map(|_| TrainerRegion {
            pieces: Vec::new(),
            len: 0,
        })
        .collect();
    let pieces: Vec<Vec<(Vec<Rank>, Box2)>> = (0..m.params.len()).map(|p| m.pieces(p)).collect();
    for (p, ps) in pieces.iter().enumerate() {
        let elem = m.params[p].dtype.size();
        for (holders, b) in ps {
            for &r in holders {
                let t = &mut trainers[r as usize];
                t.pieces.push((p, b.clone(), t.len));
                t.len = align_up(t.len + b.elems() * elem, cfg.align);
            }
        }
    }
    for t in &mut trainers {
        t.len = t.len.max(1);
    }
    let inference: Vec<InferRegion> = m
        .inference
        .iter()
        .map(|ts| infer_region(m, ts, cfg))
        .collect();

    // Cut units.
    let mut units = Vec::new();
    for (i, ts) in m.inference.iter().enumerate() {
        for (ti, t) in ts.iter().enumerate() {
            let slot = &inference[i].tensors[ti];
            for (seg, &at) in t.segments.iter().zip(&t.offsets()) {
                let p = &m.params[seg.param];
                let elem = p.dtype.size();
                let w = seg.src.width();
                let mut push = |b: Box2, eligible: Vec<Rank>, staged: bool| {
                    let mut u = new_unit(
                        seg.param,
                        b,
                        (i as u32, ti),
                        at,
                        t.quant,
                        eligible,
                        slot,
                        seg,
                        p.mesh_group,
                        elem,
                    );
                    if staged {
                        u.arena = Some((0, 0));
                    }
                    units.push(u);
                };
                let inters: Vec<u64> = pieces[seg.param]
                    .iter()
                    .filter_map(|(_, pb)| seg.src.intersect(pb).map(|b| b.elems() * elem))
                    .collect();
                let direct = inters.len() == 1 || inters.iter().all(|&x| x >= cfg.min_direct_bytes);
                match t.quant {
                    Quant::None if direct => {
                        for (holders, pb) in &pieces[seg.param] {
                            let Some(inter) = seg.src.intersect(pb) else {
                                continue;
                            };
                            let band = (cfg.unit_bytes / (inter.width() * elem)).max(1);
                            let mut r = inter.rows.start;
                            while r < inter.rows.end {
                                let e = (r + band).min(inter.rows.end);
                                push(
                                    Box2 {
                                        rows: r..e,
                                        cols: inter.cols.clone(),
                                    },
                                    holders.clone(),
                                    false,
                                );
                                r = e;
                            }
                        }
                    }
                    _ => {
                        let fp8 = t.quant == Quant::Fp8Block;
                        let tile = if fp8 { t.tile(cfg.block) } else { 1 };
                        let tiles = (cfg.unit_bytes / (w * elem * tile)).max(1);
                        let band = tiles * tile;
                        let mut r = seg.src.rows.start;
                        while r < seg.src.rows.end {
                            let e = (r + band).min(seg.src.rows.end);
                            let b = Box2 {
                                rows: r..e,
                                cols: seg.src.cols.clone(),
                            };
                            let mut el: Vec<Rank> = pieces[seg.param]
                                .iter()
                                .filter(|(_, pb)| pb.intersect(&b).is_some())
                                .flat_map(|(h, _)| h.iter().copied())
                                .collect();
                            el.sort_unstable();
                            el.dedup();
                            push(b, el, true);
                            r = e;
                        }
                    }
                }
            }
        }
    }

    // One unit per (parameter box, storage, fp8 block): replicas become
    // destinations.
    let mut merged: Vec<Unit> = Vec::with_capacity(units.len());
    let mut seen: BTreeMap<UnitKey, usize> = BTreeMap::new();
    for u in units {
        let fp8 = u.quant == Quant::Fp8Block;
        let block = u
            .dests
            .first()
            .filter(|_| fp8)
            .map_or(0, |d| inference[d.inf as usize].tensors[d.tensor].block);
        let key = (
            u.param,
            u.src.rows.start,
            u.src.rows.end,
            u.src.cols.start,
            u.src.cols.end,
            fp8,
            u.arena.is_some(),
            block,
        );
        match seen.get(&key) {
            Some(&k) => merged[k].dests.extend(u.dests),
            None => {
                seen.insert(key, merged.len());
                merged.push(u);
            }
        }
    }
    let mut units = merged;
    order::canonical(m, cfg.block, &mut units);

    // Balance within each mesh group.
    let groups_meta = m.mesh_groups();
    let mut by_group: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (k, u) in units.iter().enumerate() {
        by_group.entry(u.mesh_group).or_default().push(k);
    }
    for idx in by_group.values() {
        let mut load: BTreeMap<Rank, u64> = BTreeMap::new();
        let mut order: Vec<usize> = idx.clone();
        // Forced first (in plan order), then flexible by size desc.
        order.sort_by(|&a, &b| {
            let (ua, ub) = (&units[a], &units[b]);
            let fa = ua.eligible.len() > 1;
            let fb = ub.eligible.len() > 1;
            fa.cmp(&fb)
                .then_with(|| {
                    if fa {
                        ub.dest_bytes().cmp(&ua.dest_bytes())
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
                .then(a.cmp(&b))
        });
        for (seq, &k) in order.iter().enumerate() {
            let u = &units[k];
            let w = *u
                .eligible
                .iter()
                .min_by_key(|&&r| (load.get(&r).copied().unwrap_or(0), r))
                .ok_or_else(|| RlError::Plan("unit without a holder".into()))?;
            *load.entry(w).or_default() += u.dest_bytes();
            units[k].writer = w;
            units[k].assign_seq = seq as u32;
        }
    }

    // Sources, gathers and arena sizes now that writers are known.
    for u in &mut units {
        fill_sources(
            u,
            &pieces[u.param],
            &trainers,
            m.params[u.param].dtype.size(),
            cfg,
        )?;
    }

    // Order by group, cut waves.
    let gpos: BTreeMap<u32, usize> = groups_meta
        .iter()
        .enumerate()
        .map(|(i, (g, _))| (*g, i))
        .collect();
    order::by_group(m, &gpos, &mut units);
    order::interleave_writers(&mut units);
    let (groups, arena_len) = order::cut_waves(m, cfg, groups_meta, &mut units)?;
    Ok(Plan {
        config: *cfg,
        trainers,
        inference,
        units,
        groups,
        arena_len: arena_len.max(1),
    })
}

/// A unit for box `b` of segment `seg`, whose top-left corner sits at
/// `at` (row, column) in tensor `tensor` of inference rank `inf`.
#[allow(clippy::too_many_arguments)]
fn new_unit(
    param: usize,
    b: Box2,
    (inf, tensor): (u32, usize),
    at: (u64, u64),
    quant: Quant,
    eligible: Vec<Rank>,
    slot: &TensorSlot,
    seg: &crate::meta::Segment,
    mesh_group: u32,
    elem: u64,
) -> Unit {
    let w = slot.cols;
    let dst_elem = if quant == Quant::Fp8Block { 1 } else { elem };
    // Unit box in dest coordinates: the segment's corner plus the box's
    // place in the segment.
    let dest_row = at.0 + (b.rows.start - seg.src.rows.start);
    let dest_col = at.1 + (b.cols.start - seg.src.cols.start);
    let dbox = Box2 {
        rows: dest_row..dest_row + b.height(),
        cols: dest_col..dest_col + b.width(),
    };
    let dst = box_run(slot.data.0, w, dst_elem, 0, 0, &dbox);
    let scales = slot.scales.map(|(off, _)| {
        // The box's tiles: rows and columns of the scale matrix (a staged
        // box starts on a tile corner; validation sees to it).
        let tiles = Box2 {
            rows: dest_row / slot.block..(dest_row + b.height()).div_ceil(slot.block),
            cols: dest_col / slot.block..(dest_col + b.width()).div_ceil(slot.block),
        };
        let d = box_run(off, w.div_ceil(slot.block), 4, 0, 0, &tiles);
        Xfer { src: d, dst: d }
    });
    Unit {
        mesh_group,
        wave: 0,
        param,
        src: b,
        quant,
        dests: vec![Dest {
            inf,
            tensor,
            dest_row,
            dest_col,
            data: Xfer { src: dst, dst },
            scales,
        }],
        writer: 0,
        eligible,
        assign_seq: 0,
        arena: None,
        local: Vec::new(),
        gathers: Vec::new(),
    }
}

/// Fills the source side (trainer region or arena at offset 0; moved by
/// [`relocate`] once the wave is known).
fn fill_sources(
    u: &mut Unit,
    pieces: &[(Vec<Rank>, Box2)],
    trainers: &[TrainerRegion],
    elem: u64,
    cfg: &PlanConfig,
) -> Result<(), RlError> {
    let missing = |r: Rank| RlError::Plan(format!("rank {r} lacks a piece of param {}", u.param));
    match u.arena {
        None => {
            let (_, pb, off) = trainers[u.writer as usize]
                .piece(u.param, &u.src)
                .ok_or_else(|| missing(u.writer))?;
            let src = box_run(*off, pb.width(), elem, pb.rows.start, pb.cols.start, &u.src);
            for d in &mut u.dests {
                d.data = pair(src, d.data.dst);
            }
        }
        Some(_) => {
            let bw = u.src.width();
            let box_bytes = align_up(u.src.elems() * elem, cfg.align);
            let fp8 = u.quant == Quant::Fp8Block;
            let q_bytes = if fp8 {
                align_up(u.src.elems(), cfg.align)
            } else {
                0
            };
            let s_bytes = u.dests[0].scales.map_or(0, |s| s.dst.bytes());
            u.arena = Some((0, box_bytes + q_bytes + align_up(s_bytes, cfg.align)));
            // fp8: the quantised bytes after the box; bf16: the box itself.
            let out = if fp8 {
                Run::contiguous(box_bytes, u.src.elems())
            } else {
                Run::contiguous(0, u.src.elems() * elem)
            };
            for d in &mut u.dests {
                d.data = pair(out, d.data.dst);
                if let Some(s) = &mut d.scales {
                    // The quantiser writes the box's scales row-major,
                    // contiguous; the target's may be strided (a segment
                    // beside others).
                    *s = pair(Run::contiguous(box_bytes + q_bytes, s_bytes), s.dst);
                }
            }
            for (holders, pb) in pieces {
                let Some(inter) = pb.intersect(&u.src) else {
                    continue;
                };
                let dst = box_run(0, bw, elem, u.src.rows.start, u.src.cols.start, &inter);
                if holders.contains(&u.writer) {
                    let (_, pb2, off) = trainers[u.writer as usize]
                        .piece(u.param, &inter)
                        .ok_or_else(|| missing(u.writer))?;
                    let src = box_run(
                        *off,
                        pb2.width(),
                        elem,
                        pb2.rows.start,
                        pb2.cols.start,
                        &inter,
                    );
                    u.local.push(pair(src, dst));
                } else {
                    let from = holders[0];
                    let (_, pb2, off) = trainers[from as usize]
                        .piece(u.param, &inter)
                        .ok_or_else(|| missing(from))?;
                    let src = box_run(
                        *off,
                        pb2.width(),
                        elem,
                        pb2.rows.start,
                        pb2.cols.start,
                        &inter,
                    );
                    u.gathers.push(Gather {
                        from,
                        xfer: pair(src, dst),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Moves a staged unit's arena use to `off`.
pub(super) fn relocate(u: &mut Unit, off: u64) {
    if let Some(a) = &mut u.arena {
        a.0 = off;
    }
    for d in &mut u.dests {
        d.data.src.offset += off;
        if let Some(s) = &mut d.scales {
            s.src.offset += off;
        }
    }
    for x in &mut u.local {
        x.dst.offset += off;
    }
    for g in &mut u.gathers {
        g.xfer.dst.offset += off;
    }
}

impl Plan {
    /// The fp8 tile edge of unit `u`'s target (every destination of a
    /// unit is one tensor's box, replicated: same block).
    pub fn unit_block(&self, u: &Unit) -> u64 {
        u.dests
            .first()
            .and_then(|d| self.inference.get(d.inf as usize)?.tensors.get(d.tensor))
            .map_or(self.config.block, |t| t.block)
    }

    /// The arena half wave `wave` of group `group` stages in: waves are
    /// numbered across groups in plan order and alternate halves, so a
    /// group's first wave does not share a half with the previous group's
    /// last.
    pub fn arena_half(&self, group: usize, wave: usize) -> usize {
        let before: usize = self.groups.iter().take(group).map(|g| g.waves.len()).sum();
        (before + wave) % 2
    }

    /// The gathers of wave `wave` of group `group` as submits
    /// ([`gather_posts`]); empty for a wave that does not exist.
    pub fn gather_posts(&self, group: usize, wave: usize) -> Vec<GatherPost> {
        self.groups
            .get(group)
            .and_then(|g| g.waves.get(wave))
            .and_then(|w| self.units.get(w.clone()))
            .map_or_else(Vec::new, gather_posts)
    }

    /// Bytes each trainer writes into inference memory.
    pub fn trainer_load(&self) -> Vec<u64> {
        let mut l = vec![0; self.trainers.len()];
        for u in &self.units {
            l[u.writer as usize] += u.dest_bytes();
        }
        l
    }

    /// Bytes each trainer sends to other trainers (unshard traffic).
    pub fn gather_load(&self) -> Vec<u64> {
        let mut l = vec![0; self.trainers.len()];
        for u in &self.units {
            for g in &u.gathers {
                l[g.from as usize] += g.xfer.src.bytes();
            }
        }
        l
    }

    /// Total bytes of the inference regions' tensors.
    pub fn inference_bytes(&self) -> u64 {
        self.inference
            .iter()
            .flat_map(|r| &r.tensors)
            .map(|t| t.data.1 + t.scales.map_or(0, |s| s.1))
            .sum()
    }

    /// Every transfer into inference rank `inf`: `(writer, xfer)`.
    pub fn writes_to(&self, inf: u32) -> impl Iterator<Item = (Rank, &Xfer)> + '_ {
        self.units.iter().flat_map(move |u| {
            u.dests
                .iter()
                .filter(move |d| d.inf == inf)
                .flat_map(move |d| d.xfers().map(move |x| (u.writer, x)))
        })
    }
}
