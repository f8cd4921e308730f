//! Routes: what one NIC needs to turn a destination's pieces into WRs
//! (source registration, peer, rkey), looked up once per destination and
//! NIC, and the one place a piece becomes a WR (`push_write`).

use super::nic::Op;
use super::WorkerCore;
use crate::error::{EngineError, TransferId};
use crate::request::{no_rkey, PlainDst, Routed};
use crate::MAX_NICS;
use weft_transport::{Imm, LocalMr, LocalSlice, MrDesc, PeerId, RemoteSlice, Rkey, WrId, WriteWr};

/// Where the pieces of one destination go.
#[derive(Clone, Copy)]
pub(super) enum Target<'a> {
    /// A descriptor; with `(peer group, member)`, that member's
    /// pre-resolved peers are used where their address is the descriptor's.
    Desc(&'a MrDesc, Option<(u32, usize)>),
    /// Destination `.2` of a request's routed destinations, matched at
    /// submit to member `.2` of peer group `.1`.
    Member(&'a Routed, u32, usize),
    /// A single or paged write's destination (addresses interned).
    Plain(&'a PlainDst),
}

impl Target<'_> {
    pub(super) fn base(&self) -> u64 {
        match self {
            Target::Desc(d, _) => d.addr,
            Target::Member(r, _, j) => r.dsts[*j].base,
            Target::Plain(p) => p.keys.base,
        }
    }

    pub(super) fn region_len(&self) -> u64 {
        match self {
            Target::Desc(d, _) => d.len,
            Target::Member(r, _, j) => r.dsts[*j].region_len,
            Target::Plain(p) => p.keys.region_len,
        }
    }

    /// Number of remote NICs the destination has keys for.
    pub(super) fn rkey_count(&self) -> usize {
        match self {
            Target::Desc(d, _) => d.rkeys.len(),
            Target::Member(r, _, j) => r.dsts[*j].nics as usize,
            Target::Plain(p) => p.keys.nics,
        }
    }
}

/// What one NIC of one destination needs to turn pieces into WRs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Route {
    /// The source registration on this NIC (`None`: not registered
    /// there; pieces fail with `OutOfBounds`).
    pub(super) mr: Option<LocalMr>,
    pub(super) peer: PeerId,
    pub(super) rkey: Rkey,
}

/// Per-NIC routes of one destination, filled on first use.
#[derive(Default)]
pub(super) struct Routes([Option<Route>; MAX_NICS]);

impl Routes {
    /// The route of `nic`, if looked up already.
    #[inline]
    pub(super) fn cached(&self, nic: usize) -> Option<Route> {
        self.0.get(nic).copied().flatten()
    }
}

impl WorkerCore {
    pub(super) fn push_op(&mut self, slot: u32, nic: usize, op: Op) {
        self.count_pushed(slot, 1);
        self.nics[nic].fresh.push_back(op);
    }

    /// `k` more WRs of transfer `slot` were pushed to fresh rings.
    #[inline]
    pub(super) fn count_pushed(&mut self, slot: u32, k: usize) {
        let t = &mut self.slab[slot as usize];
        t.remaining += k as u64;
        t.unposted += k as u64;
        self.pending_pieces += k;
    }

    /// The route of `nic` toward `target` from source registration `src`
    /// (`None`: zero-length writes, whose source is the engine's own):
    /// looked up once per destination (cached in `routes`), not per piece.
    #[inline]
    pub(super) fn route(
        &mut self,
        routes: &mut Routes,
        tid: TransferId,
        nic: usize,
        src: Option<u64>,
        target: Target<'_>,
    ) -> Result<Route, EngineError> {
        // The per-piece fast path (a paged write calls this per page) stays
        // inlined at its callers; the look-up below runs once per NIC.
        if let Some(r) = routes.0.get(nic).copied().flatten() {
            return Ok(r);
        }
        self.route_uncached(routes, tid, nic, src, target)
    }

    #[inline(never)]
    pub(super) fn route_uncached(
        &mut self,
        routes: &mut Routes,
        tid: TransferId,
        nic: usize,
        src: Option<u64>,
        target: Target<'_>,
    ) -> Result<Route, EngineError> {
        let mr = match src {
            Some(key) => self.reg.mr_entry(key)?.nics.get(nic).copied(),
            None => None,
        };
        let (peer, rkey) = match target {
            Target::Member(r, g, j) => {
                let route = self.member_route(r, g, j, nic, mr)?;
                (route.peer, route.rkey)
            }
            Target::Plain(d) => {
                let rkey = d.keys.rkey(nic)?;
                (self.plain_peer(nic, d.addrs[nic], tid)?, rkey)
            }
            Target::Desc(dst, hint) => {
                let (addr, rkey) = dst.rkeys.get(nic).ok_or_else(|| no_rkey(nic))?;
                let hinted = hint
                    .and_then(|(g, j)| {
                        self.reg
                            .peer_groups
                            .get(g as usize)?
                            .members
                            .get(j)
                            .filter(|m| m.incarnation == dst.incarnation)?
                            .nics
                            .get(nic)
                    })
                    .and_then(|(a, id)| (a == addr).then_some(*id));
                let peer = match hinted {
                    Some(p) => p,
                    None => {
                        let group = self.group;
                        self.resolve(nic, addr, dst.incarnation)
                            .map_err(|e| e.into_error(group, nic, Some(tid), addr, "resolve"))?
                    }
                };
                (peer, *rkey)
            }
        };
        let r = Route { mr, peer, rkey };
        if let Some(slot) = routes.0.get_mut(nic) {
            *slot = Some(r);
        }
        Ok(r)
    }

    /// The peer on `nic` at interned address `id` (see [`AddrBook`](crate::request::AddrBook)):
    /// cached per NIC, resolved by address the first time.
    pub(super) fn plain_peer(
        &mut self,
        nic: usize,
        id: u32,
        tid: TransferId,
    ) -> Result<PeerId, EngineError> {
        if let Some(Some(p)) = self
            .nics
            .get(nic)
            .and_then(|n| n.by_addr_id.get(id as usize))
        {
            return Ok(*p);
        }
        let group = self.group;
        let (addr, inc) = self
            .addrs
            .addr(id)
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("unknown interned address {id}"),
            })?;
        let peer = self
            .resolve(nic, &addr, inc)
            .map_err(|e| e.into_error(group, nic, Some(tid), &addr, "resolve"))?;
        let cache = &mut self.nics[nic].by_addr_id;
        if cache.len() <= id as usize {
            cache.resize(id as usize + 1, None);
        }
        cache[id as usize] = Some(peer);
        Ok(peer)
    }

    /// The route of `nic` to member `j` of peer group `g` for a
    /// destination matched to it at submit.
    pub(super) fn member_route(
        &self,
        r: &Routed,
        g: u32,
        j: usize,
        nic: usize,
        mr: Option<LocalMr>,
    ) -> Result<Route, EngineError> {
        let rkey = r.rkey(&r.dsts[j], nic)?;
        let peer = self
            .reg
            .peer_groups
            .get(g as usize)
            .and_then(|pg| pg.members.get(j)?.nics.get(nic))
            .map(|(_, id)| *id)
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("peer group {g} member {j} has no NIC {nic}"),
            })?;
        Ok(Route { mr, peer, rkey })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_write(
        &mut self,
        slot: u32,
        wr: WrId,
        route: Route,
        nic: usize,
        src_off: u64,
        target: Target<'_>,
        dst_off: u64,
        len: u64,
        imm: Option<Imm>,
    ) -> Result<(), EngineError> {
        let w = build_write(
            wr,
            route,
            nic,
            src_off,
            target.base(),
            target.region_len(),
            dst_off,
            len,
            imm,
        )?;
        self.push_op(slot, nic, w);
        Ok(())
    }

    /// Routes and pushes every planned piece of `self.pieces` (offsets
    /// relative to `src_off` / `dst_off`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_pieces(
        &mut self,
        slot: u32,
        wr: WrId,
        routes: &mut Routes,
        lanes: super::lanes::Lanes,
        target: Target<'_>,
        src: u64,
        src_off: u64,
        dst_off: u64,
        imm: Option<Imm>,
    ) -> Result<(), EngineError> {
        let tid = self.slab[slot as usize].id;
        let pieces = std::mem::take(&mut self.pieces);
        let mut r = Ok(());
        for p in &pieces {
            let nic = lanes.nic(p.nic);
            r = self
                .route(routes, tid, nic, Some(src), target)
                .and_then(|route| {
                    self.push_write(
                        slot,
                        wr,
                        route,
                        nic,
                        src_off + p.offset,
                        target,
                        dst_off + p.offset,
                        p.len,
                        imm,
                    )
                });
            if r.is_err() {
                break;
            }
        }
        self.pieces = pieces;
        self.pieces.clear();
        r
    }

    pub(super) fn nics_for(&self, target: Target<'_>) -> Result<usize, EngineError> {
        let l = self.nics.len().min(target.rkey_count());
        if l == 0 {
            return Err(EngineError::InvalidArgument {
                what: "destination descriptor has no rkeys".into(),
            });
        }
        Ok(l)
    }

    pub(super) fn zero_slice(&mut self, nic: usize) -> Result<LocalSlice, EngineError> {
        self.zero_mrs
            .get(nic)
            .and_then(|mr| mr.slice(0, 0))
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("no NIC {nic}"),
            })
    }
}

/// The one place a piece becomes a WR: domain, lkey, remote NIC address and
/// rkey all come from `nic` (its `Route`); the source and destination
/// spans are checked against the registrations (`base`, `region_len`: the
/// destination's).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn build_write(
    wr: WrId,
    route: Route,
    nic: usize,
    src_off: u64,
    base: u64,
    region_len: u64,
    dst_off: u64,
    len: u64,
    imm: Option<Imm>,
) -> Result<WriteWr, EngineError> {
    let Some(local) = route.mr.and_then(|mr| mr.slice(src_off, len)) else {
        return Err(EngineError::OutOfBounds {
            what: format!("source on NIC {nic}"),
            offset: src_off,
            len,
            region_len: route.mr.map_or(0, |mr| mr.len),
        });
    };
    crate::error::check_range("destination", dst_off, len, region_len)?;
    Ok(WriteWr {
        wr,
        peer: route.peer,
        src: local,
        dst: RemoteSlice {
            base,
            offset: dst_off,
            rkey: route.rkey,
        },
        imm,
    })
}

/// [`build_write`] for spans that submit already checked (the runs of
/// `plan`): the checks are only debug-asserted here.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn build_write_checked(
    wr: WrId,
    peer: PeerId,
    mr: LocalMr,
    src_off: u64,
    base: u64,
    region_len: u64,
    dst_off: u64,
    rkey: Rkey,
    len: u64,
    imm: Option<Imm>,
) -> WriteWr {
    debug_assert!(mr.slice(src_off, len).is_some());
    debug_assert!(dst_off.checked_add(len).is_some_and(|e| e <= region_len));
    WriteWr {
        wr,
        peer,
        src: LocalSlice {
            mr: mr.key,
            addr: mr.addr.wrapping_add(src_off),
            len,
        },
        dst: RemoteSlice {
            base,
            offset: dst_off,
            rkey,
        },
        imm,
    }
}
