//! Lanes: which NIC carries each piece of a destination in a group that
//! mixes a same-host domain (`nvlink`) with NIC domains.
//!
//! A plan spreads a destination over `n` lanes (`n` = local NICs that have
//! a key at the destination, as before): piece `p` goes on lane `p % n`.
//! In a group without a same-host domain lane `i` is NIC `i`. In a group
//! with one (at NIC `L`), a destination the same-host domain prefers (its
//! key at `L` names a peer on this host) has every lane on NIC `L`; any
//! other destination has its lanes on the other NICs, cycled. The number
//! of pieces, and so the immediates the target counts, never depends on
//! the choice: both ends count with `n`.

use super::route::Target;
use super::WorkerCore;
use crate::error::EngineError;
use crate::MAX_NICS;
use weft_transport::{Domain, NetAddr};

/// The same-host NIC of a group and the others (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct LaneTable {
    /// The same-host NIC, when the group also has other NICs.
    local: Option<usize>,
    /// The NICs that are not same-host, ascending.
    remote: Vec<usize>,
}

impl LaneTable {
    pub(super) fn new(domains: &[&dyn Domain]) -> LaneTable {
        let local = domains.iter().position(|d| d.same_host());
        let remote: Vec<usize> = (0..domains.len())
            .filter(|&i| !domains[i].same_host())
            .collect();
        match local {
            Some(l) if !remote.is_empty() => LaneTable {
                local: Some(l),
                remote,
            },
            // Only same-host NICs, or none: every lane is its NIC.
            _ => LaneTable::default(),
        }
    }

    /// The NIC the destination prefers is asked about, if any.
    pub(super) fn local(&self) -> Option<usize> {
        self.local
    }

    /// The lanes of a destination with `n` lanes, local or not.
    pub(super) fn lanes(&self, n: usize, local: bool) -> Lanes {
        let mut map = [0u8; MAX_NICS];
        for (p, m) in map.iter_mut().enumerate().take(n) {
            *m = p as u8;
        }
        if let Some(l) = self.local.filter(|&l| l < n) {
            if local {
                map[..n].fill(l as u8);
            } else {
                let others: Vec<usize> = self.remote.iter().copied().filter(|&r| r < n).collect();
                for (p, m) in map.iter_mut().enumerate().take(n) {
                    *m = others[p % others.len()] as u8;
                }
            }
        }
        Lanes { n, map }
    }
}

/// The NICs of one destination's lanes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lanes {
    /// Lanes (pieces are spread over `0..n`).
    pub(super) n: usize,
    map: [u8; MAX_NICS],
}

impl Lanes {
    /// The NIC of lane `p % n`.
    #[inline]
    pub(super) fn nic(&self, p: usize) -> usize {
        self.map[p % self.n] as usize
    }
}

impl WorkerCore {
    /// The lanes of `target` (see the module docs).
    pub(super) fn lanes(&self, target: Target<'_>) -> Result<Lanes, EngineError> {
        let n = self.nics_for(target)?;
        let local = match self.lanes.local() {
            Some(l) if l < n => self
                .target_addr(target, l)
                .is_some_and(|a| self.nics[l].domain.prefers(&a)),
            _ => false,
        };
        Ok(self.lanes.lanes(n, local))
    }

    /// The NICs WRITEs to `dst` use, ascending.
    pub(super) fn nics_to(&self, dst: &weft_transport::MrDesc) -> Result<Vec<usize>, EngineError> {
        let l = self.lanes(Target::Desc(dst, None))?;
        let mut v: Vec<usize> = (0..l.n).map(|p| l.nic(p)).collect();
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }

    /// The destination's address on NIC `nic`, if it has one.
    fn target_addr(&self, target: Target<'_>, nic: usize) -> Option<NetAddr> {
        match target {
            Target::Desc(d, _) => d.rkeys.get(nic).map(|(a, _)| a.clone()),
            Target::Member(_, g, j) => self
                .reg
                .peer_groups
                .get(g as usize)?
                .members
                .get(j)?
                .nics
                .get(nic)
                .map(|(a, _)| a.clone()),
            Target::Plain(p) => self.addrs.addr(*p.addrs.get(nic)?).map(|(a, _)| a),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_of_a_mixed_group() {
        // NICs 0, 1: NIC domains; NIC 2: same-host.
        let t = LaneTable {
            local: Some(2),
            remote: vec![0, 1],
        };
        let l = t.lanes(3, true);
        assert_eq!((0..6).map(|p| l.nic(p)).collect::<Vec<_>>(), [2; 6]);
        let r = t.lanes(3, false);
        assert_eq!(
            (0..6).map(|p| r.nic(p)).collect::<Vec<_>>(),
            [0, 1, 0, 0, 1, 0]
        );
        // A destination without a key at NIC 2 (two lanes): as before.
        let two = t.lanes(2, true);
        assert_eq!((0..4).map(|p| two.nic(p)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        // Groups without a same-host NIC: identity.
        let plain = LaneTable::default().lanes(3, true);
        assert_eq!((0..3).map(|p| plain.nic(p)).collect::<Vec<_>>(), [0, 1, 2]);
    }
}
