//! The order of a plan's units: canonical (by parameter name, so the plan
//! does not depend on the order a model lists its parameters or tensors),
//! by mesh group for cutting waves, and interleaved by writer within each
//! group.

use super::{Dest, Unit};
use crate::meta::{ModelLayout, Quant, Rank};
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
