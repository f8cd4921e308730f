//! Paged writes, planned a window of pages at a time.
//!
//! A paged write is planned `plan_window` pages at a time (half of
//! `EngineConfig::max_pending_wrs`): the first window when the request is
//! taken, each next one once the group's planned WRs waiting for room have
//! fallen under `max_pending_wrs` again. Planning a 100 000-page write at
//! once would write 100 000 WRs that wait, and are read back, long after
//! they left the core's caches, and would make every request behind it
//! wait for all of them to be planned.
//!
//! A transfer with pages left to plan holds one count of `remaining` and
//! of `unposted` (as planning itself does, see `take_request`), so it can
//! neither finish nor count as all posted before its last window. This
//! module owns the list of such writes ([`Partial`]); the worker alternates
//! their windows with new requests lap by lap, so neither starves the
//! other.

use super::route::{build_write, build_write_checked, Routes, Target};
use super::WorkerCore;
use crate::error::EngineError;
use crate::request::PagedBody;
use crate::shard;
use weft_transport::WrId;

/// A paged write with pages left to plan.
pub(super) struct Partial {
    slot: u32,
    wr: WrId,
    body: Box<PagedBody>,
    /// The first page not planned yet.
    next: usize,
}

impl WorkerCore {
    /// Plans the first window of paged write `p` (transfer `slot`, WR id
    /// `wr`); if pages are left, keeps it (with a planning hold on its
    /// transfer) for [`WorkerCore::continue_paged`].
    pub(super) fn plan_paged(
        &mut self,
        slot: u32,
        wr: WrId,
        p: Box<PagedBody>,
    ) -> Result<(), EngineError> {
        let next = self.plan_pages(slot, wr, &p, 0)?;
        if next < p.src_pages.len() {
            self.slab.hold(slot);
            self.partial.push_back(Partial {
                slot,
                wr,
                body: p,
                next,
            });
        }
        Ok(())
    }

    /// Whether a paged write has pages left to plan.
    pub(crate) fn has_partial(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Plans the next window of the oldest paged write with pages left, if
    /// fewer than `max_pending` planned WRs wait for room. Its WRs join the
    /// backlog (posted by the next `post_backlog`). Returns whether it
    /// planned or resolved anything.
    pub(crate) fn continue_paged(&mut self, max_pending: usize) -> bool {
        if self.pending_pieces >= max_pending {
            return false;
        }
        let Some(mut p) = self.partial.pop_front() else {
            return false;
        };
        let slot = p.slot;
        let len = p.body.src_pages.len();
        // A transfer that failed (a WR rejected, its peer removed) plans no
        // more pages.
        let r = if self.slab[slot as usize].error.is_some() {
            Ok(len)
        } else {
            self.plan_pages(slot, p.wr, &p.body, p.next)
        };
        self.stage_fresh();
        match r {
            Ok(next) if next < len => {
                p.next = next;
                self.partial.push_back(p);
            }
            Ok(_) => self.release_plan(slot),
            Err(e) => {
                self.fail_transfer(slot, e);
                self.release_plan(slot);
            }
        }
        true
    }

    /// Fails every paged write with pages left to plan with `e` and drops
    /// its planning hold (shutdown, a failed worker).
    pub(super) fn fail_partial(&mut self, e: &EngineError) {
        while let Some(p) = self.partial.pop_front() {
            self.fail_transfer(p.slot, e.clone());
            self.release_plan(p.slot);
        }
    }

    /// Plans pages `start..` of `p`, at most `plan_window` of them, into
    /// the fresh rings. Returns the first page not planned.
    fn plan_pages(
        &mut self,
        slot: u32,
        wr: WrId,
        p: &PagedBody,
        start: usize,
    ) -> Result<usize, EngineError> {
        let target = Target::Plain(&p.dst);
        let lanes = self.lanes(target)?;
        let nics = lanes.n;
        let mut routes = Routes::default();
        let tid = self.slab[slot as usize].id;
        // `plan_window` is at least 1 (`WorkerCore::new`).
        let end = p
            .src_pages
            .len()
            .min(start.saturating_add(self.plan_window));
        // A page that fits one WR is one piece on NIC `i % nics` (what
        // `plan_page` says): pushed without the piece list.
        let one_piece =
            p.page_len > 0 && p.page_len <= shard::piece_cap(self.max_write_len, self.shard.align);
        let mut i = start;
        while i < end {
            if one_piece && i >= start + nics {
                // Pages start..start + nics looked up every NIC's route:
                // the rest are pushed in one run.
                let next = self.push_paged_run(slot, wr, &routes, lanes, i, end, p, target)?;
                if next > i {
                    i = next;
                    continue;
                }
            }
            let (Some(so), Some(d_o)) = (p.src_pages.page_offset(i), p.dst_pages.page_offset(i))
            else {
                return Err(EngineError::InvalidArgument {
                    what: format!("page {i} offset overflows"),
                });
            };
            if one_piece {
                let nic = lanes.nic(i);
                let route = self.route(&mut routes, tid, nic, Some(p.src), target)?;
                self.push_write(slot, wr, route, nic, so, target, d_o, p.page_len, p.imm)?;
                i += 1;
                continue;
            }
            shard::plan_page_into(
                &mut self.pieces,
                i,
                p.page_len,
                nics,
                self.max_write_len,
                self.shard.align,
            );
            self.push_pieces(slot, wr, &mut routes, lanes, target, p.src, so, d_o, p.imm)?;
            i += 1;
        }
        Ok(i)
    }

    /// Pushes pages `start..end` of a paged write whose pages are one piece
    /// each (page `i` on NIC `i % nics`, what `plan_page` says) while their
    /// NIC's route is cached in `routes`: the same WRs as `push_write`
    /// makes, with the transfer's counts updated once per run. Returns the
    /// first page not pushed.
    #[allow(clippy::too_many_arguments)]
    fn push_paged_run(
        &mut self,
        slot: u32,
        wr: WrId,
        routes: &Routes,
        lanes: super::lanes::Lanes,
        start: usize,
        end: usize,
        p: &PagedBody,
        target: Target<'_>,
    ) -> Result<usize, EngineError> {
        let (base, region_len) = (target.base(), target.region_len());
        let (page_len, imm) = (p.page_len, p.imm);
        let (sp, dp) = (&p.src_pages, &p.dst_pages);
        let (Some(si), Some(di)) = (sp.indices.get(start..end), dp.indices.get(start..end)) else {
            return Err(EngineError::InvalidArgument {
                what: format!("pages {start}..{end} of a paged write out of range"),
            });
        };
        let mut err = None;
        let mut i = start;
        let nics = lanes.n;
        let mut lane = start % nics.max(1);
        for (&s, &d) in si.iter().zip(di) {
            // Submit checked the largest page index of each side, and
            // offsets grow with the index: none of these overflows.
            let so = u64::from(s).wrapping_mul(sp.stride).wrapping_add(sp.offset);
            let d_o = u64::from(d).wrapping_mul(dp.stride).wrapping_add(dp.offset);
            debug_assert_eq!(Some(so), sp.index_offset(s));
            debug_assert_eq!(Some(d_o), dp.index_offset(d));
            let nic = lanes.nic(lane);
            let Some(route) = routes.cached(nic) else {
                break;
            };
            let Some(mr) = route.mr else {
                // `build_write` without a source registration on `nic`.
                err = build_write(wr, route, nic, so, base, region_len, d_o, page_len, imm).err();
                break;
            };
            // Submit checked every page of both sides (the largest page
            // index of each).
            self.nics[nic].fresh.push_back(build_write_checked(
                wr, route.peer, mr, so, base, region_len, d_o, route.rkey, page_len, imm,
            ));
            i += 1;
            lane += 1;
            if lane == nics {
                lane = 0;
            }
        }
        // `push_op`'s counts, once for the run.
        self.count_pushed(slot, i - start);
        match err {
            Some(e) => Err(e),
            None => Ok(i),
        }
    }
}
