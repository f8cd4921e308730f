//! The order of a plan's units: canonical (by parameter name, so the plan
//! does not depend on the order a model lists its parameters or tensors),
//! by mesh group for cutting waves, and interleaved by writer within each
//! group.

use super::{relocate, Dest, GroupPlan, PlanConfig, Unit};
use crate::meta::{ModelLayout, Quant, Rank};
use crate::RlError;
use std::collections::BTreeMap;

/// Sorts `units` by parameter name and box, and each unit's destinations
/// by rank, tensor name and row: nothing then depends on where the model
/// lists its parameters or an inference rank its tensors.
pub(super) fn canonical(m: &ModelLayout, plan_block: u64, units: &mut [Unit]) {
    let name = |u: &Unit| m.params[u.param].name.as_str();
    // A unit's fp8 block in effect (units of one box and storage differ
    // by it; all of a unit's destinations share it).
    let block = |u: &Unit| {
        u.dests
            .first()
            .filter(|_| u.quant == Quant::Fp8Block)
            .map(|d| m.inference[d.inf as usize][d.tensor].tile(plan_block))
    };
    units.sort_by(|a, b| {
        let key = |u: &Unit| {
            (
                u.src.rows.start,
                u.src.rows.end,
                u.src.cols.start,
                u.src.cols.end,
                u.quant == Quant::Fp8Block,
                u.arena.is_some(),
                block(u),
            )
        };
        name(a).cmp(name(b)).then_with(|| key(a).cmp(&key(b)))
    });
    for u in units.iter_mut() {
        u.dests.sort_by(|a, b| {
            let t = |d: &Dest| m.inference[d.inf as usize][d.tensor].name.as_str();
            (a.inf, t(a), a.dest_row, a.dest_col).cmp(&(b.inf, t(b), b.dest_row, b.dest_col))
        });
    }
}

/// Sorts `units` by mesh group (in `gpos` order), then parameter name and
/// box: the order waves are cut in.
pub(super) fn by_group(m: &ModelLayout, gpos: &BTreeMap<u32, usize>, units: &mut [Unit]) {
    let name = |u: &Unit| m.params[u.param].name.as_str();
    units.sort_by(|a, b| {
        let key = |u: &Unit| {
            (
                gpos[&u.mesh_group],
                name(u),
                u.src.rows.start,
                u.src.cols.start,
                u.quant == Quant::Fp8Block,
            )
        };
        key(a).cmp(&key(b))
    });
}

/// Within each mesh group (units sorted by group, then parameter name),
/// interleaves the writers' units so that every prefix of the group holds
/// about the same bytes per writer: the next unit is the next one (in
/// that order) of the writer with the fewest bytes emitted so far
/// (ties: the lowest rank). Waves are cut from prefixes, so each wave then
/// gives every writer a similar share and no writer waits at the next
/// barrier for another's backlog.
pub(super) fn interleave_writers(units: &mut Vec<Unit>) {
    let mut out = Vec::with_capacity(units.len());
    let mut rest = std::mem::take(units).into_iter().peekable();
    while let Some(first) = rest.next() {
        let g = first.mesh_group;
        let mut by_writer: BTreeMap<Rank, std::collections::VecDeque<Unit>> = BTreeMap::new();
        by_writer.entry(first.writer).or_default().push_back(first);
        while let Some(u) = rest.next_if(|u| u.mesh_group == g) {
            by_writer.entry(u.writer).or_default().push_back(u);
        }
        let mut sent: BTreeMap<Rank, u64> = by_writer.keys().map(|&w| (w, 0)).collect();
        while let Some((&w, _)) = sent
            .iter()
            .filter(|(w, _)| by_writer.get(w).is_some_and(|q| !q.is_empty()))
            .min_by_key(|(w, b)| (**b, **w))
        {
            let Some(u) = by_writer.get_mut(&w).and_then(|q| q.pop_front()) else {
                break;
            };
            *sent.entry(w).or_default() += u.dest_bytes();
            out.push(u);
        }
    }
    *units = out;
}

/// Cuts each mesh group's units (already grouped and interleaved) into
/// waves: a writer's arena use within a wave stays under
/// [`PlanConfig::wave_budget`]; each unit's arena slot is placed at its
/// writer's offset in the wave. Returns the groups and the arena length
/// (the largest wave use).
pub(super) fn cut_waves(
    m: &ModelLayout,
    cfg: &PlanConfig,
    groups_meta: Vec<(u32, Vec<Rank>)>,
    units: &mut [Unit],
) -> Result<(Vec<GroupPlan>, u64), RlError> {
    let mut groups = Vec::new();
    let mut arena_len = 0;
    let mut k = 0;
    for (gid, ranks) in groups_meta {
        let start = k;
        while k < units.len() && units[k].mesh_group == gid {
            k += 1;
        }
        let mut waves = Vec::new();
        let mut used: BTreeMap<Rank, u64> = BTreeMap::new();
        let mut wstart = start;
        #[allow(clippy::needless_range_loop)] // `j` also cuts the wave ranges
        for j in start..k {
            let need = units[j].arena.map_or(0, |a| a.1);
            if need > cfg.watermark {
                return Err(RlError::Plan(format!(
                    "a unit of {} needs {need} B of staging, over the {} B watermark",
                    m.params[units[j].param].name, cfg.watermark
                )));
            }
            let wr = units[j].writer;
            let cur = used.get(&wr).copied().unwrap_or(0);
            if need > 0 && cur + need > cfg.wave_budget(waves.len()).max(need) {
                waves.push(wstart..j);
                wstart = j;
                used.clear();
            }
            let off = used.get(&wr).copied().unwrap_or(0);
            if need > 0 {
                let u = &mut units[j];
                relocate(u, off);
                let e = off + need;
                arena_len = arena_len.max(e);
                used.insert(wr, e);
            }
            units[j].wave = waves.len() as u32;
        }
        if wstart < k || waves.is_empty() {
            waves.push(wstart..k);
        }
        groups.push(GroupPlan {
            id: gid,
            ranks,
            waves,
        });
    }
    Ok((groups, arena_len))
}
