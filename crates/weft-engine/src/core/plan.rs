//! Planning: a request body becomes pieces (see [`crate::shard`]) and each
//! piece a WR on the fresh ring of its NIC.

use super::nic::send_op;
use super::registry::Member;
use super::route::{build_write_checked, Routes, Target};
use super::slab::SendRes;
use super::WorkerCore;
use crate::error::EngineError;
use crate::mem::SendPayload;
use crate::request::{Body, Dsts, Routed};
use crate::shard::{self, ScatterMode};
use crate::MAX_NICS;
use weft_transport::{
    Access, Imm, Incarnation, LocalMr, MemRegion, NetAddr, RemoteSlice, WrId, WriteWr,
};

impl WorkerCore {
    pub(super) fn plan(&mut self, slot: u32, wr: WrId, body: Body) -> Result<(), EngineError> {
        match body {
            Body::Single {
                len,
                imm,
                src,
                src_off,
                dst,
                dst_off,
            } => {
                let lanes = self.lanes(Target::Plain(&dst))?;
                self.rr = self.rr.wrapping_add(1);
                shard::plan_single_write_into(
                    &mut self.pieces,
                    len,
                    lanes.n,
                    self.max_write_len,
                    self.rr,
                    &self.shard,
                );
                let mut routes = Routes::default();
                self.push_pieces(
                    slot,
                    wr,
                    &mut routes,
                    lanes,
                    Target::Plain(&dst),
                    src,
                    src_off,
                    dst_off,
                    imm,
                )
            }
            Body::Paged(p) => self.plan_paged(slot, wr, p),
            Body::Scatter {
                imm,
                src,
                peers,
                dsts,
                mode,
            } => {
                self.reg.check_peer_group(self.group, peers, dsts.len())?;
                // Fast path: a destination matched to its member whose
                // ByPeer plan is one piece (NIC `j % nics`, the whole
                // length: what `plan_scatter_dst` says) is pushed directly
                // with the source registration looked up once per request.
                let cap = shard::piece_cap(self.max_write_len, self.shard.align);
                let mut src_mrs = [None; MAX_NICS];
                if matches!(dsts, Dsts::Routed(_)) && dsts.len() > 0 {
                    let nics = &self.reg.mr_entry(src)?.nics;
                    for (l, mr) in nics.iter().take(MAX_NICS).enumerate() {
                        src_mrs[l] = Some(*mr);
                    }
                }
                let mut j = 0;
                while j < dsts.len() {
                    if j > 0 && matches!(mode, ScatterMode::ByPeer) {
                        if let Dsts::Routed(v) = &dsts {
                            // After the first WRITE: runs of one-piece
                            // destinations are pushed in one go.
                            let next =
                                self.push_routed_run(slot, wr, v, j, peers, cap, &src_mrs, imm)?;
                            if next > j {
                                j = next;
                                continue;
                            }
                        }
                    }
                    let one_piece = match (&dsts, mode) {
                        (Dsts::Routed(r), ScatterMode::ByPeer) if r.dsts[j].len <= cap => Some(r),
                        _ => None,
                    };
                    if let Some(r) = one_piece {
                        let d = r.dsts[j];
                        let target = Target::Member(r, peers, j);
                        let nic = self.lanes(target)?.nic(j);
                        let mr = src_mrs.get(nic).copied().flatten();
                        let route = self.member_route(r, peers, j, nic, mr)?;
                        self.push_write(
                            slot,
                            wr,
                            route,
                            nic,
                            d.src_offset,
                            target,
                            d.dst_offset,
                            d.len,
                            imm,
                        )?;
                    } else {
                        self.push_scatter_dst(slot, wr, src, &dsts, peers, j, mode, imm)?;
                    }
                    if j == 0 && matches!(dsts, Dsts::Routed(_)) {
                        // The first WRITE goes out before the other
                        // destinations are planned (scatter latency). Only
                        // for routed destinations: their planning cannot
                        // fail later (peers resolved, bounds checked at
                        // submit), so no destination is written for a
                        // scatter that then fails in planning.
                        self.post_fresh();
                    }
                    if self.slab[slot as usize].error.is_some() {
                        // Failed (an early post was rejected): plan no more.
                        break;
                    }
                    j += 1;
                }
                Ok(())
            }
            Body::Barrier { imm, peers, dsts } => {
                self.reg.check_peer_group(self.group, peers, dsts.len())?;
                for j in 0..dsts.len() {
                    let target = match &dsts {
                        Dsts::Routed(r) => Target::Member(r, peers, j),
                        Dsts::Described(v) => Target::Desc(&v[j].dst, Some((peers, j))),
                    };
                    // Zero-length, immediate-only: source is the send pool
                    // (any valid local key of that NIC works for 0 bytes).
                    let nic = self.lanes(target)?.nic(j);
                    self.push_zero_write(slot, wr, nic, target, imm)?;
                }
                Ok(())
            }
            Body::Send {
                peer,
                incarnation,
                payload,
            } => self.plan_send(slot, wr, peer, incarnation, payload),
        }
    }

    /// Pushes destinations `j..` of a routed `ByPeer` scatter for as long
    /// as each is one piece (length within `cap`: NIC `j % nics`, the whole
    /// length, what `plan_scatter_dst` says), making the same WRs as the
    /// per-destination path (`member_route` + `push_write`) with the peer
    /// group's member table and the transfer's counts looked up once per
    /// run instead of once per WR. Returns the first destination not
    /// pushed. Pushing changes no transfer's failure state, so the caller's
    /// per-destination failure check is not needed inside a run.
    #[allow(clippy::too_many_arguments)]
    fn push_routed_run(
        &mut self,
        slot: u32,
        wr: WrId,
        r: &Routed,
        start: usize,
        peers: u32,
        cap: u64,
        src_mrs: &[Option<LocalMr>; MAX_NICS],
        imm: Option<Imm>,
    ) -> Result<usize, EngineError> {
        let local_nics = self.nics.len();
        let members: &[Member] = self
            .reg
            .peer_groups
            .get(peers as usize)
            .map_or(&[], |g| &g.members[..]);
        let mut err = None;
        let mut j = start;
        while let Some(d) = r.dsts.get(j) {
            if d.len > cap {
                break;
            }
            // `nics_for(Target::Member)`.
            let nics = local_nics.min(d.nics as usize);
            if nics == 0 {
                err = Some(EngineError::InvalidArgument {
                    what: "destination descriptor has no rkeys".into(),
                });
                break;
            }
            let nic = if self.lanes.local().is_some() {
                match self.lanes(Target::Member(r, peers, j)) {
                    Ok(l) => l.nic(j),
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            } else {
                j % nics
            };
            // `member_route`.
            let rkey = match r.rkey(d, nic) {
                Ok(r) => r,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            };
            let Some(peer) = members
                .get(j)
                .and_then(|m| m.nics.get(nic))
                .map(|(_, id)| *id)
            else {
                err = Some(EngineError::InvalidArgument {
                    what: format!("peer group {peers} member {j} has no NIC {nic}"),
                });
                break;
            };
            let Some(mr) = src_mrs.get(nic).copied().flatten() else {
                // `build_write` without a source registration on `nic`.
                err = Some(EngineError::OutOfBounds {
                    what: format!("source on NIC {nic}"),
                    offset: d.src_offset,
                    len: d.len,
                    region_len: 0,
                });
                break;
            };
            // Submit checked the source span against this registration
            // and the destination span against the descriptor `d` was
            // made from.
            self.nics[nic].fresh.push_back(build_write_checked(
                wr,
                peer,
                mr,
                d.src_offset,
                d.base,
                d.region_len,
                d.dst_offset,
                rkey,
                d.len,
                imm,
            ));
            j += 1;
        }
        // `push_op`'s counts, once for the run.
        self.count_pushed(slot, j - start);
        match err {
            Some(e) => Err(e),
            None => Ok(j),
        }
    }

    /// Plans and pushes destination `j` of a scatter by the general path
    /// (any mode, any number of pieces, routed or resolved by address).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_scatter_dst(
        &mut self,
        slot: u32,
        wr: WrId,
        src: u64,
        dsts: &Dsts,
        peers: u32,
        j: usize,
        mode: ScatterMode,
        imm: Option<Imm>,
    ) -> Result<(), EngineError> {
        let (target, len, src_off, dst_off) = match dsts {
            Dsts::Routed(r) => {
                let d = &r.dsts[j];
                (
                    Target::Member(r, peers, j),
                    d.len,
                    d.src_offset,
                    d.dst_offset,
                )
            }
            Dsts::Described(v) => {
                let d = &v[j];
                let t = Target::Desc(&d.dst, Some((peers, j)));
                (t, d.len, d.src_offset, d.dst_offset)
            }
        };
        let lanes = self.lanes(target)?;
        shard::plan_scatter_dst_into(
            &mut self.pieces,
            j,
            len,
            lanes.n,
            self.max_write_len,
            mode,
            &self.shard,
        );
        let mut routes = Routes::default();
        self.push_pieces(
            slot,
            wr,
            &mut routes,
            lanes,
            target,
            src,
            src_off,
            dst_off,
            imm,
        )
    }

    pub(super) fn push_zero_write(
        &mut self,
        slot: u32,
        wr: WrId,
        nic: usize,
        target: Target<'_>,
        imm: Imm,
    ) -> Result<(), EngineError> {
        let tid = self.slab[slot as usize].id;
        // A zero-length local slice of a registration made on *this* NIC.
        let local = self.zero_slice(nic)?;
        let route = self.route(&mut Routes::default(), tid, nic, None, target)?;
        let w = WriteWr {
            wr,
            peer: route.peer,
            src: local,
            dst: RemoteSlice {
                base: target.base(),
                offset: 0,
                rkey: route.rkey,
            },
            imm: Some(imm),
        };
        self.push_op(slot, nic, w);
        Ok(())
    }

    // Registers an oversize SEND buffer in place (`MemRegion::new`).
    #[allow(unsafe_code)]
    pub(super) fn plan_send(
        &mut self,
        slot: u32,
        wr: WrId,
        peer: NetAddr,
        inc: Incarnation,
        payload: SendPayload,
    ) -> Result<(), EngineError> {
        let tid = self.slab[slot as usize].id;
        let group = self.group;
        let pid = self
            .resolve(0, &peer, inc)
            .map_err(|e| e.into_error(group, 0, Some(tid), &peer, "resolve"));
        let (src, res) = match payload {
            SendPayload::Slot { slot: s, len } => {
                let res = SendRes {
                    slot: Some(s),
                    owned: None,
                };
                let src = self.send_mr.slice(self.send_pool.slot_offset(s), len);
                (src, res)
            }
            SendPayload::Owned(v) => {
                if let Some(s) = self.send_pool.try_fill(&v) {
                    let src = self
                        .send_mr
                        .slice(self.send_pool.slot_offset(s), v.len() as u64);
                    (
                        src,
                        SendRes {
                            slot: Some(s),
                            owned: None,
                        },
                    )
                } else if v.is_empty() {
                    // Nothing to register: use the zero-length slice of the
                    // engine's own registered buffer.
                    (
                        self.zero_slice(0).ok(),
                        SendRes {
                            slot: None,
                            owned: None,
                        },
                    )
                } else {
                    // Oversize (or pool empty): register the message itself.
                    // SAFETY: the Vec's heap buffer stays allocated and
                    // untouched (it is moved into the transfer state, which
                    // never reallocates it) until the SEND completes and
                    // the registration is removed.
                    let region = unsafe {
                        MemRegion::new(
                            std::ptr::NonNull::new(v.as_ptr().cast_mut())
                                .unwrap_or(std::ptr::NonNull::dangling()),
                            v.len(),
                            weft_transport::Device::Host,
                        )
                    };
                    let mr = self.nics[0]
                        .domain
                        .register(&region, Access::LocalOnly)
                        .map_err(|e| EngineError::Control {
                            group,
                            nic: 0,
                            op: "register send buffer",
                            source: Box::new(e),
                        });
                    match mr {
                        Ok(mr) => {
                            let src = mr.slice(0, v.len() as u64);
                            (
                                src,
                                SendRes {
                                    slot: None,
                                    owned: Some((v, mr.key)),
                                },
                            )
                        }
                        Err(e) => {
                            return Err(e);
                        }
                    }
                }
            }
        };
        self.slab[slot as usize].send = Some(res);
        let pid = pid?;
        let src = src.ok_or_else(|| EngineError::InvalidArgument {
            what: "send buffer slice".into(),
        })?;
        self.push_op(slot, 0, send_op(wr, pid, src));
        Ok(())
    }
}
