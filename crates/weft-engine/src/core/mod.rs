//! The worker core: the sans-IO state machine of one domain group.
//!
//! [`WorkerCore`] is thread- and clock-free: it owns the domains of one
//! group and is driven from outside (by `driver::worker` on the group's
//! worker thread, or by `TransferEngine::progress` in manual mode). It
//! never blocks, never sleeps, never reads a clock and never runs user
//! callbacks.
//!
//! Inputs:
//! * requests ([`Submitted`], from the group's request queue):
//!   [`WorkerCore::take_request`] (priority 1: a new request and its
//!   first WRs);
//! * control messages ([`Control`]: registrations, peer groups, receive
//!   pools): [`WorkerCore::handle_control`];
//! * room under the planning bound: [`WorkerCore::continue_paged`] (the
//!   next window of a paged write planned in windows, taking turns with
//!   new requests);
//! * send-queue room: [`WorkerCore::post_backlog`] (priority 2: more WRs
//!   of pending requests as room frees);
//! * completions: [`WorkerCore::poll`] (priority 3: the domains'
//!   completion queues).
//!
//! Outputs:
//! * posts: WRITEs, SENDs and receives handed to the domains;
//! * events ([`Event`]: finished transfers' callbacks, received buffers),
//!   collected by [`WorkerCore::take_events`] for the driver to hand to the
//!   callback thread (flags and counters are set inline, not as events).
//!
//! One module per piece of state: `nic` (per-NIC rings, posting and
//! completion queues), `slab` (transfers in flight), `outbox` (events and
//! held-back counter bumps), `registry`
//! (registrations, peer groups, receive pools), `lifecycle` (removed and replaced peer
//! incarnations), `route` (per-NIC routes of
//! a destination), `plan` (turning a request body into WRs) and `paged`
//! (paged writes planned a window at a time).

mod lanes;
mod lifecycle;
mod nic;
mod outbox;
mod paged;
mod plan;
mod registry;
mod route;
mod slab;

use crate::error::{EngineError, TransferId};
use crate::imm::{ImmDone, ImmTable};
use crate::mem::{RecvPool, SendPool};
use crate::ondone::{DoneCallback, DoneResult};
use crate::request::{AddrBook, Body, GroupAddress, Submitted};
use crate::shard::{Piece, ShardConfig};
use crate::stats::GroupCounters;
use crate::wrid::{wr_transfer, KIND_SEND, KIND_WRITE};
use crate::MAX_NICS;
use nic::Nic;
use outbox::Outbox;
use registry::Registry;
use slab::Slab;
use std::collections::VecDeque;
use std::sync::Arc;
use weft_transport::{Access, Completion, Domain, LocalMr, MemRegion, NetAddr, TransportError};

/// What the core hands to the driver.
pub(crate) enum Event {
    /// A transfer finished; run its callback.
    Done(DoneCallback, DoneResult),
    /// An immediate round fired; run its callback, then drop the round's
    /// [`ArmedRound`](crate::imm::ArmedRound) count.
    RoundDone(DoneCallback, DoneResult, crate::imm::ArmedRound),
    /// A receive completed: the message, copied out of its buffer (which
    /// is already re-posted), or why the receive failed.
    Recv {
        pool: Arc<RecvPool>,
        result: Result<Vec<u8>, EngineError>,
        /// Who sent it, when the NIC says (see [`crate::MessageSender`]).
        from: Option<crate::MessageSender>,
    },
}

impl From<crate::imm::RoundCallback> for Event {
    fn from(c: crate::imm::RoundCallback) -> Event {
        match c.round {
            Some(round) => Event::RoundDone(c.cb, c.result, round),
            None => Event::Done(c.cb, c.result),
        }
    }
}

/// Control-plane operations (registration, peers, pools): the core's
/// input besides requests and completions.
pub(crate) enum Control {
    RegMr {
        region: MemRegion,
        reply: crossbeam_channel::Sender<Result<(u64, Vec<LocalMr>), EngineError>>,
    },
    UnregMr {
        id: u64,
        reply: crossbeam_channel::Sender<Result<(), EngineError>>,
    },
    AddPeerGroup {
        peers: Vec<GroupAddress>,
        reply: crossbeam_channel::Sender<Result<u32, EngineError>>,
    },
    RecvPool {
        pool: Arc<RecvPool>,
        reply: crossbeam_channel::Sender<Result<(), EngineError>>,
    },
    RemovePeer {
        addrs: Vec<NetAddr>,
        incarnation: weft_transport::Incarnation,
        reply: crossbeam_channel::Sender<Result<(), EngineError>>,
    },
    /// The NICs WRITEs to a descriptor take (see `lanes`).
    Lanes {
        dst: weft_transport::MrDesc,
        reply: crossbeam_channel::Sender<Result<Vec<usize>, EngineError>>,
    },
}

/// Static facts about a group once its domains are open.
#[derive(Debug, Clone)]
pub(crate) struct GroupInfo {
    pub(crate) addrs: Vec<NetAddr>,
    pub(crate) names: Vec<String>,
    /// Each NIC's data path, in NIC order.
    pub(crate) paths: Vec<weft_transport::DataPath>,
    pub(crate) max_write_len: u64,
    pub(crate) max_send_len: u64,
}

impl GroupInfo {
    /// The start-up log line of every NIC of group `g`.
    pub(crate) fn log_data_paths(&self, g: usize) {
        for (i, (name, p)) in self.names.iter().zip(&self.paths).enumerate() {
            tracing::info!(
                group = g,
                nic = i,
                name = %name,
                provider = %p.provider,
                fabric = %p.fabric,
                gpu_memory = %p.device_memory,
                max_write_len = p.max_write_len,
                max_send_len = p.max_send_len,
                progress = %p.progress,
                "weft data path"
            );
        }
    }
}

/// The per-group worker state machine: thread- and clock-free, driven from
/// outside. See the module docs.
pub(crate) struct WorkerCore {
    group: usize,
    nics: Vec<Nic>,
    /// Transfers in flight.
    slab: Slab,
    /// Registrations, peer groups and receive pools.
    reg: Registry,
    send_pool: Arc<SendPool>,
    send_mr: LocalMr,
    /// The send pool buffer registered on every NIC: the source of
    /// zero-length (immediate-only) writes on that NIC.
    zero_mrs: Vec<LocalMr>,
    imms: Arc<ImmTable<ImmDone>>,
    addrs: Arc<AddrBook>,
    shard: ShardConfig,
    max_write_len: u64,
    rr: usize,
    /// Events for the driver and held-back counter bumps.
    out: Outbox,
    /// Reused buffer of planned pieces.
    pieces: Vec<Piece>,
    comps: Vec<Completion>,
    pending_pieces: usize,
    /// Paged writes with pages left to plan, oldest first (`paged`).
    partial: VecDeque<paged::Partial>,
    /// Pages of a paged write planned at a time (`paged`).
    plan_window: usize,
    /// Per-NIC posting counters for `TransferEngine::stats`.
    counters: Arc<GroupCounters>,
    /// The epoch of the engine's incarnation table this group last synced
    /// its peers with (see `lifecycle`).
    inc_epoch: u64,
    probes: crate::probe::Probes,
    /// The engine's own incarnation: received frames meant for another
    /// one are dropped (see [`crate::frame`]).
    incarnation: weft_transport::Incarnation,
    /// The same-host NIC and the others (see `lanes`).
    lanes: lanes::LaneTable,
}

/// A backend error on NIC `nic` of `group` while moving `transfer`.
fn transport(
    group: usize,
    nic: usize,
    transfer: TransferId,
    peer: Option<NetAddr>,
    source: TransportError,
) -> EngineError {
    EngineError::Transport {
        transfer,
        group,
        nic,
        peer,
        source: Box::new(source),
    }
}

impl WorkerCore {
    /// Builds the core from freshly opened domains (call on the worker
    /// thread, after pinning).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        group: usize,
        domains: Vec<Box<dyn Domain>>,
        imms: Arc<ImmTable<ImmDone>>,
        addrs: Arc<AddrBook>,
        shard: ShardConfig,
        send_slots: u32,
        send_slot_len: u64,
        max_inflight_per_nic: usize,
        plan_window: usize,
        counters: Arc<GroupCounters>,
        probes: crate::probe::Probes,
        incarnation: weft_transport::Incarnation,
    ) -> Result<Self, EngineError> {
        if domains.is_empty() || domains.len() > MAX_NICS {
            return Err(EngineError::Setup {
                group,
                what: format!("a group needs 1..={MAX_NICS} NICs, got {}", domains.len()),
                source: None,
            });
        }
        let mut nics: Vec<Nic> = domains.into_iter().map(Nic::new).collect();
        let max_write_len = nics
            .iter()
            .map(|n| n.caps.max_write_len)
            .min()
            .unwrap_or(1)
            .max(1);
        // Each slot holds a frame: the header and a message of up to
        // `send_slot_len` bytes.
        let slot_len = send_slot_len.saturating_add(crate::frame::HEADER_LEN as u64);
        let send_pool = Arc::new(SendPool::new(send_slots, slot_len)?);
        let send_mr = nics[0]
            .domain
            .register(&send_pool.buf.region(), Access::LocalOnly)
            .map_err(|e| EngineError::Setup {
                group,
                what: "registering the send pool".into(),
                source: Some(Box::new(e)),
            })?;
        let mut zero_mrs = vec![send_mr];
        for (i, n) in nics.iter_mut().enumerate().skip(1) {
            let mr = n
                .domain
                .register(&send_pool.buf.region(), Access::LocalOnly)
                .map_err(|e| EngineError::Setup {
                    group,
                    what: format!("registering the zero-length source on NIC {i}"),
                    source: Some(Box::new(e)),
                })?;
            zero_mrs.push(mr);
        }
        for n in &mut nics {
            n.caps.max_inflight = n.caps.max_inflight.min(max_inflight_per_nic).max(1);
            n.caps.max_batch = n.caps.max_batch.max(1);
        }
        let lanes = lanes::LaneTable::new(&nics.iter().map(|n| &*n.domain).collect::<Vec<_>>());
        Ok(Self {
            lanes,
            group,
            nics,
            slab: Slab::default(),
            reg: Registry::default(),
            send_pool,
            send_mr,
            zero_mrs,
            imms,
            addrs,
            shard,
            max_write_len,
            rr: 0,
            out: Outbox::default(),
            pieces: Vec::new(),
            comps: Vec::new(),
            pending_pieces: 0,
            partial: VecDeque::new(),
            plan_window: plan_window.max(1),
            counters,
            inc_epoch: 0,
            probes,
            incarnation,
        })
    }

    pub(crate) fn info(&self) -> GroupInfo {
        GroupInfo {
            addrs: self
                .nics
                .iter()
                .map(|n| n.domain.local_addr().clone())
                .collect(),
            names: self.nics.iter().map(|n| n.name.clone()).collect(),
            paths: self.nics.iter().map(|n| n.domain.data_path()).collect(),
            max_write_len: self.max_write_len,
            // What a message may hold: the transport's largest SEND less
            // the frame header.
            max_send_len: self.nics[0]
                .caps
                .max_send_len
                .saturating_sub(crate::frame::HEADER_LEN as u64),
        }
    }

    pub(crate) fn send_pool(&self) -> Arc<SendPool> {
        Arc::clone(&self.send_pool)
    }

    /// Events produced since the last call (and every counter bump held
    /// back until now, see [`WorkerCore::flush_counts`]).
    pub(crate) fn take_events(&mut self, out: &mut Vec<Event>) {
        self.out.take(out);
    }

    /// Bumps the counters of the transfers that finished successfully
    /// since the last call, one add per run of the same counter
    /// ([`Outbox::flush_counts`]).
    #[inline]
    pub(crate) fn flush_counts(&mut self) {
        self.out.flush_counts();
    }

    /// WRs planned but not yet handed to the backend (backpressure signal).
    pub(crate) fn pending_pieces(&self) -> usize {
        self.pending_pieces
    }

    /// Whether a NIC of the group moves data only while polled
    /// ([`Capabilities::software_progress`]).
    ///
    /// [`Capabilities::software_progress`]: weft_transport::Capabilities::software_progress
    pub(crate) fn software_progress(&self) -> bool {
        self.nics.iter().any(|n| n.caps.software_progress)
    }

    /// Every live NIC's wait fd ([`weft_transport::Domain::wait_fd`]), or
    /// `None` if one of them has none. Dead NICs are left out: nothing
    /// polls them any more, so their fds and pending work must not keep
    /// the worker awake.
    pub(crate) fn wait_fds(&self) -> Option<Vec<std::os::fd::RawFd>> {
        self.nics
            .iter()
            .filter(|n| n.dead.is_none())
            .map(|n| n.domain.wait_fd())
            .collect()
    }

    /// Whether every live NIC lets the worker sleep on its wait fd now
    /// ([`weft_transport::Domain::try_wait`]).
    pub(crate) fn try_wait(&mut self) -> bool {
        self.nics
            .iter_mut()
            .filter(|n| n.dead.is_none())
            .all(|n| n.domain.try_wait())
    }

    /// How many of the group's NICs died (the worker rebuilds its wait-fd
    /// set when this changes).
    pub(crate) fn dead_nics(&self) -> usize {
        self.nics.iter().filter(|n| n.dead.is_some()).count()
    }

    /// Whether WRs are posted and not yet completed, waiting for room, or
    /// still to be planned.
    pub(crate) fn in_flight(&self) -> bool {
        self.pending_pieces > 0 || self.has_partial() || self.nics.iter().any(|n| n.inflight > 0)
    }

    /// Transfers taken and not yet resolved.
    pub(crate) fn live_transfers(&self) -> usize {
        self.slab.live_count()
    }

    /// Whether any transfer is still unfinished.
    pub(crate) fn busy(&self) -> bool {
        self.slab.any_live()
    }

    /// Takes one new request and posts its first WRs (priority 1).
    pub(crate) fn take_request(&mut self, req: Submitted) {
        self.sync_incarnations();
        let Submitted {
            id,
            on_done,
            body,
            stamps,
        } = req;
        let (slot, gen) = self.slab.alloc(id, on_done);
        self.slab[slot as usize].probe = crate::probe::TransferProbe::start(id, stamps);
        let kind = if matches!(body, Body::Send { .. }) {
            KIND_SEND
        } else {
            KIND_WRITE
        };
        let wr = wr_transfer(kind, slot, gen);
        // Planning holds one count of `remaining` and of `unposted`, so
        // pieces posted early (see the scatter plan) can neither finish the
        // transfer nor count as "all posted" before every piece is planned.
        self.slab.hold(slot);
        if let Err(e) = self.plan(slot, wr, body) {
            self.fail_transfer(slot, e);
        }
        self.release_plan(slot);
        // Post the fresh WRs now; what does not fit joins the backlog.
        self.post_fresh();
        self.stage_fresh();
    }

    /// Drops a planning hold of transfer `slot`, and resolves the transfer
    /// if nothing else holds it.
    fn release_plan(&mut self, slot: u32) {
        // Every piece was posted before the last hold went: the probe's
        // "all posted" is now (`posted` saw the hold and did not record
        // it). A failed transfer's unposted pieces were dropped, not
        // posted: it is not recorded, as elsewhere.
        if self.slab.release(slot) {
            self.slab[slot as usize]
                .probe
                .all_posted_at_release(&self.probes);
        }
        self.maybe_finish(slot);
    }

    /// Moves the WRs left in the fresh rings to the end of their backlogs.
    fn stage_fresh(&mut self) {
        for n in &mut self.nics {
            n.stage_fresh();
        }
    }

    /// Fails everything not yet handed to the backend (shutdown).
    pub(crate) fn fail_unposted(&mut self, e: &EngineError) {
        for slot in 0..self.slab.len() {
            let t = &mut self.slab[slot];
            if t.live && t.unposted > 0 && t.error.is_none() {
                t.error = Some(e.clone());
            }
        }
        for nic in 0..self.nics.len() {
            while let Some(op) = self.nics[nic].backlog.pop_front() {
                self.skip_piece(op.wr);
            }
        }
        self.fail_partial(e);
    }

    /// Fails everything still in flight (shutdown after the drain timeout).
    /// The backend may still complete those WRs later; they are ignored.
    pub(crate) fn abandon_inflight(&mut self, e: &EngineError) {
        self.fail_unposted(e);
        for slot in 0..self.slab.len() {
            let t = &mut self.slab[slot];
            if !t.live {
                continue;
            }
            if t.error.is_none() {
                t.error = Some(e.clone());
            }
            t.remaining = 0;
            self.maybe_finish(slot as u32);
        }
    }

    /// Fails a request that never reached planning (shutdown).
    pub(crate) fn reject(&mut self, req: Submitted, e: EngineError) {
        self.counters.transfer_failed(e.kind());
        if let Some((cb, r)) = req.on_done.resolve_inline(Err(e)) {
            self.out.push(Event::Done(cb, r));
        }
    }

    /// Deregisters everything and closes the domains.
    pub(crate) fn close(mut self) {
        for (_, ps) in std::mem::take(&mut self.reg.pools) {
            let _ = self.nics[0].domain.deregister(ps.mr.key);
        }
        for id in 0..self.reg.mrs.len() {
            if let Some(e) = self.reg.mrs[id].take() {
                for (i, mr) in e.nics.iter().enumerate() {
                    let _ = self.nics_dereg(i, mr.key);
                }
            }
        }
        for (i, mr) in std::mem::take(&mut self.zero_mrs).iter().enumerate() {
            let _ = self.nics_dereg(i, mr.key);
        }
        self.nics.clear();
    }
}
