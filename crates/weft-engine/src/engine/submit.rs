//! The submit half of the [`TransferEngine`] API: checks at submit, the
//! request built as plain values, and the hand-off to the group's request
//! queue (with the queue-full policy).

use super::{no_group, PeerGroupHandle, TransferEngine};
use crate::config::QueueFullPolicy;
use crate::driver::GroupShared;
use crate::error::{EngineError, TransferId};
use crate::frame::{self, HEADER_LEN};
use crate::mem::{MrHandle, SendPayload};
use crate::ondone::OnDone;
use crate::request::{routed_dsts, Body, Dsts, GroupAddress, PagedBody, PlainDst, Submitted};
use crate::shard::ScatterMode;
use crate::MAX_NICS;
use crossbeam_utils::Backoff;
use std::sync::atomic::Ordering;
use weft_transport::{Imm, MrDesc, Pages, ScatterDst};

impl TransferEngine {
    pub(super) fn enqueue(
        &self,
        gs: &GroupShared,
        req: Submitted,
    ) -> Result<TransferId, EngineError> {
        let id = req.id;
        gs.submitting.fetch_add(1, Ordering::SeqCst);
        let r = self.enqueue_inner(gs, req);
        gs.submitting.fetch_sub(1, Ordering::SeqCst);
        match r {
            Ok(()) => Ok(id),
            Err((e, req)) => {
                // Give back a send slot the rejected request held.
                if let Body::Send {
                    payload: SendPayload::Slot { slot, .. },
                    ..
                } = req.body
                {
                    if let Some(p) = gs.send_pool.get() {
                        let _ = p.free.push(slot);
                    }
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::result_large_err)]
    fn enqueue_inner(
        &self,
        gs: &GroupShared,
        mut req: Submitted,
    ) -> Result<(), (EngineError, Submitted)> {
        if self.inner.config.caller_posts && self.inner.manual.is_none() {
            req = match self.post_here(gs, req) {
                Ok(()) => return Ok(()),
                Err(r) => r,
            };
        }
        let backoff = Backoff::new();
        loop {
            if self.inner.shut.load(Ordering::SeqCst) {
                return Err((EngineError::ShutDown, req));
            }
            if let Some(e) = gs.failed.get() {
                return Err((e.clone(), req));
            }
            req.stamps.enqueued();
            match gs.queue.push(req) {
                Ok(()) => {
                    gs.wake();
                    return Ok(());
                }
                Err(r) => {
                    req = r;
                    if self.inner.config.queue_full == QueueFullPolicy::Fail
                        || self.inner.manual.is_some()
                    {
                        return Err((EngineError::QueueFull { group: gs.index }, req));
                    }
                    gs.kick();
                    if backoff.is_completed() {
                        std::thread::yield_now();
                    } else {
                        backoff.snooze();
                    }
                }
            }
        }
    }

    /// The caller-posts path (`EngineConfig::caller_posts`): when nothing
    /// is queued before it and the worker's lock is free right now, the
    /// request is planned and posted on this thread; otherwise it is given
    /// back for the queue. Never waits: `try_lock` only, so it cannot
    /// deadlock with the worker or with itself (a submit from code the
    /// engine runs while this thread holds the lock finds it taken and
    /// queues).
    #[allow(clippy::result_large_err)]
    fn post_here(&self, gs: &GroupShared, mut req: Submitted) -> Result<(), Submitted> {
        if !gs.queue.is_empty() {
            return Err(req);
        }
        let Some(mut slot) = gs.slot.try_lock() else {
            return Err(req);
        };
        let Some(w) = slot.as_mut() else {
            return Err(req);
        };
        // Checked with the lock held: a shutdown or failure that began
        // before is seen here (the queue path then refuses the request).
        if self.inner.shut.load(Ordering::SeqCst) || gs.failed.get().is_some() {
            return Err(req);
        }
        req.stamps.enqueued();
        w.try_take(req)?;
        drop(slot);
        // The worker polls the completions: wake it if it sleeps.
        gs.wake();
        Ok(())
    }

    pub(super) fn new_req(&self, on_done: OnDone, body: Body) -> Submitted {
        Submitted {
            id: TransferId(self.inner.next_id.fetch_add(1, Ordering::Relaxed)),
            on_done,
            body,
            stamps: crate::probe::Stamps::now(),
        }
    }

    /// The receiver's [`ImmCounts`](crate::ImmCounts) assume the sender spreads over as many
    /// NICs as the receiver has: refuse a destination with another count.
    /// The handle was made by this engine and has `n` members.
    pub(super) fn check_peer_group(
        &self,
        peers: &PeerGroupHandle,
        n: usize,
    ) -> Result<(), EngineError> {
        if peers.engine != self.inner.id {
            return Err(EngineError::InvalidArgument {
                what: "peer group handle of another engine".into(),
            });
        }
        if n != peers.len() {
            return Err(EngineError::InvalidArgument {
                what: format!("{n} destinations for a peer group of {}", peers.len()),
            });
        }
        Ok(())
    }

    /// `dst` with its NIC addresses interned (see `AddrBook`).
    fn plain(&self, dst: &MrDesc) -> Result<PlainDst, EngineError> {
        PlainDst::new(dst, &self.inner.addrs).ok_or_else(|| EngineError::InvalidArgument {
            what: format!(
                "destination has {} rkeys, more than {MAX_NICS} NICs",
                dst.rkeys.len()
            ),
        })
    }

    fn check_nic_count(&self, g: usize, dst: &MrDesc) -> Result<(), EngineError> {
        let local = self.nic_count(g)?;
        if dst.rkeys.len() != local {
            return Err(EngineError::NicCountMismatch {
                group: g,
                local,
                remote: dst.rkeys.len(),
            });
        }
        Ok(())
    }

    pub(super) fn check_dst(
        dst: &MrDesc,
        what: impl std::fmt::Display,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        if dst.rkeys.is_empty() {
            return Err(EngineError::InvalidArgument {
                what: format!("{what}: descriptor has no rkeys"),
            });
        }
        crate::error::check_range(what, offset, len, dst.len)
    }

    /// SENDs a copy of `msg` from NIC 0 of group 0 to NIC 0 of `peer`, in a
    /// frame naming `peer.incarnation` (see docs/engine.md, "SEND frames"):
    /// the receiver hands it to a receive callback only if that is its
    /// incarnation (or 0, an address built by hand), and drops it
    /// otherwise. A destination whose incarnation this engine knows was
    /// removed or replaced fails with `PeerRemoved`; one newer than the
    /// live incarnation at its address without proof, with
    /// [`EngineError::IncarnationUnproven`].
    pub fn submit_send(
        &self,
        peer: &GroupAddress,
        msg: &[u8],
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let addr = peer
            .nics
            .first()
            .ok_or_else(|| EngineError::InvalidArgument {
                what: "peer address has no NICs".into(),
            })?;
        let gs = self.group(0)?;
        let info = self.info(0)?;
        if msg.len() as u64 > info.max_send_len {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "message of {} bytes exceeds max_send_len {}",
                    msg.len(),
                    info.max_send_len
                ),
            });
        }
        // The frame: who it is meant for (the receiver drops it if that is
        // not its incarnation) and who sends it, then the message.
        let head = frame::header(peer.incarnation, self.inner.incarnation);
        let payload = match gs
            .send_pool
            .get()
            .and_then(|p| p.try_fill_parts(&head, msg))
        {
            Some(slot) => SendPayload::Slot {
                slot,
                len: (HEADER_LEN + msg.len()) as u64,
            },
            None => {
                let mut v = Vec::with_capacity(HEADER_LEN + msg.len());
                v.extend_from_slice(&head);
                v.extend_from_slice(msg);
                SendPayload::Owned(v)
            }
        };
        let req = self.new_req(
            on_done,
            Body::Send {
                peer: addr.clone(),
                incarnation: peer.incarnation,
                payload,
            },
        );
        self.enqueue(gs, req)
    }

    /// One WRITE of `len` bytes from `src.0` at offset `src.1` to `dst.0` at
    /// offset `dst.1`, sharded across the group's NICs (see
    /// [`crate::shard::plan_single_write`]); with `imm`, every piece carries it
    /// ([`ImmCounts::single_write`](crate::ImmCounts::single_write) immediates
    /// in total).
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<Imm>,
        src: (&MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let (h, src_off) = src;
        let (d, dst_off) = dst;
        let gs = self.own_group(h)?;
        h.check("source", src_off, len)?;
        Self::check_dst(d, "destination", dst_off, len)?;
        self.check_nic_count(h.group as usize, d)?;
        let req = self.new_req(
            on_done,
            Body::Single {
                len,
                imm,
                src: h.key(),
                src_off,
                dst: self.plain(d)?,
                dst_off,
            },
        );
        self.enqueue(gs, req)
    }

    /// Page `i` of `src` pages goes to page `i` of `dst` pages (`page_len`
    /// bytes each); pages are spread over the NICs (`i % nics`). With
    /// `imm`, [`ImmCounts::paged_writes`](crate::ImmCounts::paged_writes) immediates in total.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<Imm>,
        src: (&MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let (h, sp) = src;
        let (d, dp) = dst;
        let gs = self.own_group(h)?;
        if sp.len() != dp.len() {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "{} source pages but {} destination pages",
                    sp.len(),
                    dp.len()
                ),
            });
        }
        // Page offsets grow with the page index, so checking the page with
        // the largest index of each side checks them all (one vectorised
        // pass over the indices; its position is looked up only for an
        // error message).
        if let Some(m) = MaxPage::of(sp) {
            let so = m.offset().ok_or_else(|| EngineError::InvalidArgument {
                what: format!("source {m} offset overflows"),
            })?;
            h.check(format_args!("source {m}"), so, page_len)?;
        }
        if let Some(m) = MaxPage::of(dp) {
            let d_o = m.offset().ok_or_else(|| EngineError::InvalidArgument {
                what: format!("destination {m} offset overflows"),
            })?;
            Self::check_dst(d, format_args!("destination {m}"), d_o, page_len)?;
        }
        self.check_nic_count(h.group as usize, d)?;
        let req = self.new_req(
            on_done,
            Body::Paged(Box::new(PagedBody {
                page_len,
                imm,
                src: h.key(),
                src_pages: sp.clone(),
                dst: self.plain(d)?,
                dst_pages: dp.clone(),
            })),
        );
        self.enqueue(gs, req)
    }

    /// One WRITE per peer of the group (`dsts[j]` to member `j`), spread by
    /// the configured [`ScatterMode`].
    pub fn submit_scatter(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        dsts: &[ScatterDst],
    ) -> Result<TransferId, EngineError> {
        self.submit_scatter_mode(
            peers,
            on_done,
            imm,
            src,
            dsts,
            self.inner.config.scatter_mode,
        )
    }

    /// [`TransferEngine::submit_scatter`] with an explicit mode.
    pub fn submit_scatter_mode(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        dsts: &[ScatterDst],
        mode: ScatterMode,
    ) -> Result<TransferId, EngineError> {
        let gs = self.own_group(src)?;
        self.check_peer_group(peers, dsts.len())?;
        for (j, d) in dsts.iter().enumerate() {
            src.check(format_args!("scatter source {j}"), d.src_offset, d.len)?;
            Self::check_dst(
                &d.dst,
                format_args!("scatter destination {j}"),
                d.dst_offset,
                d.len,
            )?;
        }
        let g = src.group as usize;
        // `check_nic_count` per destination, with the group's NIC count
        // looked up once.
        let local = self.nic_count(g)?;
        if let Some(d) = dsts.iter().find(|d| d.dst.rkeys.len() != local) {
            return Err(EngineError::NicCountMismatch {
                group: g,
                local,
                remote: d.dst.rkeys.len(),
            });
        }
        let pg = *peers.ids.get(g).ok_or_else(|| no_group(g))?;
        let req = self.new_req(
            on_done,
            Body::Scatter {
                imm,
                src: src.key(),
                peers: pg,
                dsts: routed_dsts(
                    &peers.members,
                    local,
                    dsts.iter()
                        .map(|d| (&d.dst, d.len, d.src_offset, d.dst_offset)),
                )
                .unwrap_or_else(|| Dsts::Described(dsts.to_vec())),
                mode,
            },
        );
        self.enqueue(gs, req)
    }

    /// An immediate-only (zero-length) WRITE to every member of the peer
    /// group, from group 0: each destination receives exactly one `imm`.
    pub fn submit_barrier(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Imm,
        dsts: &[MrDesc],
    ) -> Result<TransferId, EngineError> {
        self.check_peer_group(peers, dsts.len())?;
        for (j, d) in dsts.iter().enumerate() {
            Self::check_dst(d, format_args!("barrier destination {j}"), 0, 0)?;
        }
        let gs = self.group(0)?;
        let nics = self.nic_count(0)?;
        let pg = *peers.ids.first().ok_or_else(|| no_group(0))?;
        let req = self.new_req(
            on_done,
            Body::Barrier {
                imm,
                peers: pg,
                dsts: routed_dsts(&peers.members, nics, dsts.iter().map(|d| (d, 0, 0, 0)))
                    .unwrap_or_else(|| {
                        Dsts::Described(
                            dsts.iter()
                                .map(|d| ScatterDst {
                                    len: 0,
                                    src_offset: 0,
                                    dst: d.clone(),
                                    dst_offset: 0,
                                })
                                .collect(),
                        )
                    }),
            },
        );
        self.enqueue(gs, req)
    }
}

/// The largest page index of a page list. Displayed as "page N", N the
/// position of its last occurrence (found only when displayed).
struct MaxPage<'a> {
    pages: &'a Pages,
    index: u32,
}

impl<'a> MaxPage<'a> {
    /// `None` when `pages` is empty.
    fn of(pages: &'a Pages) -> Option<Self> {
        let index = pages.indices.iter().copied().max()?;
        Some(Self { pages, index })
    }

    /// The page's byte offset (`None` on overflow).
    fn offset(&self) -> Option<u64> {
        self.pages.index_offset(self.index)
    }
}

impl std::fmt::Display for MaxPage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self
            .pages
            .indices
            .iter()
            .rposition(|&x| x == self.index)
            .unwrap_or(0);
        write!(f, "page {i}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(indices: &[u32], stride: u64, offset: u64) -> Pages {
        Pages {
            indices: indices.to_vec(),
            stride,
            offset,
        }
    }

    /// The largest index wins; its message names its last position; the
    /// offset is `offset + index * stride`, `None` on overflow.
    #[test]
    fn max_page_checks_the_largest_index() {
        assert!(MaxPage::of(&pages(&[], 8, 0)).is_none());
        let p = pages(&[3, 9, 1, 9, 2], 4096, 64);
        let m = MaxPage::of(&p).expect("not empty");
        assert_eq!(m.offset(), Some(64 + 9 * 4096));
        assert_eq!(m.to_string(), "page 3");
        let huge = pages(&[0, u32::MAX], u64::MAX / 2, 0);
        let m = MaxPage::of(&huge).expect("not empty");
        assert_eq!(m.offset(), None);
        assert_eq!(m.to_string(), "page 1");
    }
}
