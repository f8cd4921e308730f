//! The host executor: runs [`RankCore`] actions on a [`TransferEngine`]
//! with host buffers. Shared by the blocking driver ([`crate::MoeRank`])
//! and the step-mode simulation ([`crate::sim`]); a driver decides only how
//! to wait ([`HostExec::block`] or [`HostExec::poll`]).

use crate::config::{Dims, MoeConfig};
use crate::core::{Action, Entry, Event, RankCore, Wait};
use crate::error::{MoeError, Phase};
use crate::expert::{ExpertTokens, RankInput};
use crate::imm::{ImmValues, COMBINE_MODE, DISPATCH_MODE};
use crate::pack;
use crate::plan::{member_rank, CombineSlot};
use crate::routes::{row_to_le_bytes, CountedPairs, RouteMatrix};
use std::sync::Arc;
use std::time::Duration;
use weft::{
    DoneCounter, DoneFlag, GroupAddress, HostBuffer, Imm, ImmCounts, MrDesc, MrHandle, OnDone,
    PeerGroupHandle, Resources, ScatterMode, ScatterSlice, ScatterTargets, TransferEngine,
};

/// What a rank tells its peers (exchanged out of band before `connect`;
/// [`RankInfo::to_bytes`] / [`RankInfo::from_bytes`] give its wire form).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankInfo {
    /// The rank: its index among the active ranks when some are masked
    /// (`MoeConfig::masked`), its rank in the group otherwise.
    pub rank: u32,
    /// Its engine's group-0 address.
    pub addr: GroupAddress,
    /// Its route buffer.
    pub route: MrDesc,
    /// Its receive buffer.
    pub recv: MrDesc,
    /// Hash of the shape and immediate values; must match on every rank.
    pub config_hash: u64,
}

impl RankInfo {
    /// The wire form (postcard).
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serialising plain integers, byte vectors and strings into a
        // growable vector cannot fail.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// Parses the wire form; a malformed message (one that does not
    /// decode, or with bytes left after it) is [`MoeError::PeerInfo`] (the
    /// rank is unknown: `u32::MAX`). Never panics; allocates no more than
    /// the bytes can hold (a length prefix larger than what is left is
    /// refused before anything is allocated for it).
    pub fn from_bytes(bytes: &[u8]) -> Result<RankInfo, MoeError> {
        weft::decode(bytes).map_err(|e| MoeError::PeerInfo {
            rank: u32::MAX,
            what: format!("undecodable rank info ({} bytes): {e}", bytes.len()),
        })
    }
}

pub(crate) struct Peers {
    pub group: PeerGroupHandle,
    /// Per member j: the receive descriptor (overflow writes, barriers).
    pub recv: Vec<MrDesc>,
    /// The members' route and receive buffers as scatter targets, checked
    /// once at `connect` (every step's scatters write into them).
    pub route_targets: ScatterTargets,
    pub recv_targets: ScatterTargets,
}

impl Peers {
    /// Adds `members` (checked infos, rotated order) as a peer group and
    /// checks their route and receive buffers as scatter targets.
    pub(crate) fn connect(
        engine: &TransferEngine,
        members: &[&RankInfo],
    ) -> Result<Peers, MoeError> {
        let addrs: Vec<GroupAddress> = members.iter().map(|i| i.addr.clone()).collect();
        let group = engine.add_peer_group(&addrs).map_err(eng(Phase::Setup))?;
        let route: Vec<MrDesc> = members.iter().map(|i| i.route.clone()).collect();
        let recv: Vec<MrDesc> = members.iter().map(|i| i.recv.clone()).collect();
        let route_targets = engine
            .scatter_targets(&group, &route)
            .map_err(eng(Phase::Setup))?;
        let recv_targets = engine
            .scatter_targets(&group, &recv)
            .map_err(eng(Phase::Setup))?;
        Ok(Peers {
            group,
            recv,
            route_targets,
            recv_targets,
        })
    }
}

pub(crate) struct Bufs {
    pub route: HostBuffer,
    pub send: HostBuffer,
    pub recv: HostBuffer,
    pub route_h: MrHandle,
    pub send_h: MrHandle,
}

pub(crate) fn eng(phase: Phase) -> impl Fn(weft::EngineError) -> MoeError {
    move |source| MoeError::Engine { phase, source }
}

fn phase_index(p: Phase) -> usize {
    match p {
        Phase::Setup => 0,
        Phase::Route => 1,
        Phase::Dispatch => 2,
        Phase::BarrierD => 3,
        Phase::Combine => 4,
        Phase::BarrierC => 5,
    }
}

/// The data of one dispatch on the host: the rows land in `tokens`
/// (refilled in place), `unpacked` says they did.
pub(crate) struct DispatchIo<'a> {
    pub input: RankInput<'a>,
    pub pairs: &'a CountedPairs,
    pub tokens: &'a mut ExpertTokens,
    pub unpacked: bool,
}

/// The data of one combine on the host: the combined tokens land in `out`
/// (exactly their size for the weighted sum), `summed` says they did.
pub(crate) struct CombineIo<'a> {
    pub outputs: &'a [u8],
    pub slots: &'a [u32],
    pub weights: &'a [f32],
    pub out: &'a mut [u8],
    pub summed: bool,
}

/// Engine, buffers and peers of one rank, and the flags of its armed
/// rounds.
pub(crate) struct HostExec {
    pub engine: Arc<TransferEngine>,
    pub dims: Dims,
    pub rank: u32,
    pub imms: ImmValues,
    /// The buffers' registrations and the reserved immediates; declared
    /// before `bufs`, so it is released before the memory goes.
    held: Resources,
    pub bufs: Bufs,
    pub peers: Option<Peers>,
    done: Arc<DoneCounter>,
    submitted: u64,
    flags: [Option<Arc<DoneFlag>>; 6],
    pub timeout: Duration,
    /// Own combine rows between pack and copy (reused every step).
    scratch: Vec<u8>,
}

fn fnv(h: u64, v: u64) -> u64 {
    v.to_le_bytes()
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Hash of the shape and the immediate values: equal on every rank of a
/// group, whatever its data path (host or GPU buffers have one layout).
/// The layout of what ranks write into each other's buffers, in every
/// rank's config hash: ranks of different layouts refuse each other's
/// infos instead of misreading each other's bytes. 2: dispatch slots carry
/// the row's origin after the token.
const WIRE_VERSION: u64 = 2;

pub(crate) fn config_hash(dims: &Dims, imms: &ImmValues) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in [
        u64::from(dims.ranks),
        u64::from(dims.experts),
        u64::from(dims.topk),
        u64::from(dims.max_tokens),
        u64::from(dims.token_bytes),
        u64::from(dims.hidden),
        u64::from(dims.out_dtype.size()),
        u64::from(dims.private),
        u64::from(imms.route),
        dims.dispatch.code(),
        u64::from(dims.mask.global_ranks()),
        WIRE_VERSION,
    ] {
        h = fnv(h, v);
    }
    for &m in dims.mask.masked() {
        h = fnv(h, u64::from(m));
    }
    h
}

/// Checks every rank's info (from a peer or a store: untrusted) against
/// this rank's shape and `hash`; returns rank `rank`'s members in rotated
/// order (member j is rank `member_rank(N, rank, j)`).
pub(crate) fn check_infos<'a>(
    dims: &Dims,
    rank: u32,
    hash: u64,
    all: &'a [RankInfo],
) -> Result<Vec<&'a RankInfo>, MoeError> {
    let n = dims.ranks;
    if all.len() != n as usize {
        return Err(MoeError::Shape {
            what: "rank infos",
            got: all.len() as u64,
            want: u64::from(n),
        });
    }
    for (s, i) in all.iter().enumerate() {
        let bad = |what: String| MoeError::PeerInfo {
            rank: s as u32,
            what,
        };
        if i.rank != s as u32 {
            return Err(bad(format!("info at index {s} names rank {}", i.rank)));
        }
        if i.config_hash != hash {
            return Err(bad("config hash differs (shape, P or immediates)".into()));
        }
        if i.recv.len < dims.recv_buf_len || i.route.len < dims.route_buf_len() {
            return Err(bad("buffers shorter than the shape needs".into()));
        }
    }
    Ok((0..n.saturating_sub(1) as usize)
        .map(|j| &all[member_rank(n, rank, j) as usize])
        .collect())
}

impl HostExec {
    /// Validates `cfg`, allocates and registers the buffers and reserves
    /// the five immediates.
    pub fn prepare(
        engine: Arc<TransferEngine>,
        cfg: &MoeConfig,
        rank: u32,
    ) -> Result<(HostExec, RankInfo, ImmCounts), MoeError> {
        let dims = cfg.validate()?;
        if rank >= dims.mask.global_ranks() {
            return Err(MoeError::NoSuchRank {
                rank,
                ranks: dims.mask.global_ranks(),
            });
        }
        // The protocol numbers the active ranks only.
        let rank = dims
            .mask
            .active_index(rank)
            .ok_or(MoeError::Masked { rank })?;
        let imms = ImmValues::for_instance(dims.instance, engine.imm_capacity())?;
        let ic = engine.imm_counts(0).map_err(eng(Phase::Setup))?;
        let alloc = |len: u64| {
            HostBuffer::new(len as usize).map_err(|e| MoeError::Alloc {
                bytes: len,
                reason: e.to_string(),
            })
        };
        let (route, send, recv) = (
            alloc(dims.route_buf_len())?,
            alloc(dims.send_buf_len)?,
            alloc(dims.recv_buf_len)?,
        );
        // Dropped on any early return: what was taken is released.
        let mut held = Resources::new();
        let mut reg = |b: &HostBuffer| {
            held.register(&engine, b.region())
                .map_err(eng(Phase::Setup))
        };
        let (route_h, route_d) = reg(&route)?;
        let (send_h, _) = reg(&send)?;
        let (_, recv_d) = reg(&recv)?;
        for v in imms.all() {
            held.lease_imm_value(&engine, v)
                .map_err(eng(Phase::Setup))?;
        }
        let info = RankInfo {
            rank,
            addr: engine.main_address(),
            route: route_d,
            recv: recv_d,
            config_hash: config_hash(&dims, &imms),
        };
        let exec = HostExec {
            engine,
            dims,
            rank,
            imms,
            held,
            bufs: Bufs {
                route,
                send,
                recv,
                route_h,
                send_h,
            },
            peers: None,
            done: Arc::new(DoneCounter::new()),
            submitted: 0,
            flags: Default::default(),
            timeout: cfg.step_timeout,
            scratch: Vec::new(),
        };
        Ok((exec, info, ic))
    }

    /// Checks every rank's info against `own` and adds the peer group in
    /// rotated order.
    pub fn connect(&mut self, own: &RankInfo, all: &[RankInfo]) -> Result<(), MoeError> {
        let own = own.config_hash;
        let members = check_infos(&self.dims, self.rank, own, all)?;
        self.peers = Some(Peers::connect(&self.engine, &members)?);
        Ok(())
    }

    fn on_done(&mut self) -> OnDone {
        self.submitted += 1;
        OnDone::counter(&self.done)
    }

    fn peers(&self) -> Result<&Peers, MoeError> {
        self.peers.as_ref().ok_or(MoeError::NotConnected)
    }

    fn scatter(
        &mut self,
        phase: Phase,
        imm: Imm,
        entries: &[Entry],
        route: bool,
        mode: ScatterMode,
    ) -> Result<(), MoeError> {
        let slices = scatter_slices(entries)?;
        self.peers()?;
        let od = self.on_done();
        let p = self.peers.as_ref().ok_or(MoeError::NotConnected)?;
        let (targets, src) = if route {
            (&p.route_targets, &self.bufs.route_h)
        } else {
            (&p.recv_targets, &self.bufs.send_h)
        };
        self.engine
            .submit_scatter_to_mode(targets, od, Some(imm), src, &slices, mode)
            .map_err(eng(phase))?;
        Ok(())
    }

    /// Runs a network action (anything but the data operations, the waits
    /// and `Finished`); returns the event it produces (the routes).
    pub fn net(&mut self, a: &Action, core: &RankCore) -> Result<Option<Event>, MoeError> {
        let d = &self.dims;
        match a {
            Action::Arm { phase, imm, count } => {
                let (od, flag) = OnDone::flag();
                self.engine
                    .expect_imm_count_with(*imm, *count, od)
                    .map_err(eng(*phase))?;
                self.flags[phase_index(*phase)] = Some(flag);
            }
            Action::WriteRouteRow { offset } => {
                let mut row = vec![0u8; d.route_row_len() as usize];
                row_to_le_bytes(core.row(), &mut row);
                self.bufs.route.write(*offset as usize, &row);
            }
            Action::RouteScatter { imm, entries } => {
                self.scatter(Phase::Route, *imm, entries, true, DISPATCH_MODE)?
            }
            Action::PrivateScatter { imm, entries } => {
                self.scatter(Phase::Dispatch, *imm, entries, false, DISPATCH_MODE)?
            }
            Action::CombineScatter { imm, entries } => {
                self.scatter(Phase::Combine, *imm, entries, false, COMBINE_MODE)?
            }
            Action::ReadRoutes => {
                let all = self
                    .bufs
                    .route
                    .read(0, d.route_buf_len() as usize)
                    .unwrap_or_default();
                let row_len = d.route_row_len() as usize;
                let mut m = RouteMatrix::new(d);
                for s in 0..d.ranks {
                    if s == self.rank {
                        continue;
                    }
                    let off = s as usize * row_len;
                    let bytes = all.get(off..off + row_len).unwrap_or(&[]);
                    m.set_row_le_bytes(d, s, bytes)?;
                }
                return Ok(Some(Event::Routes(m)));
            }
            Action::OverflowWrite { imm, entry } => {
                let p = self.peers()?;
                let dst = p
                    .recv
                    .get(entry.member)
                    .ok_or(MoeError::Shape {
                        what: "overflow member",
                        got: entry.member as u64,
                        want: p.recv.len() as u64,
                    })?
                    .clone();
                let od = self.on_done();
                self.engine
                    .submit_single_write(
                        entry.len,
                        Some(*imm),
                        (&self.bufs.send_h, entry.src_offset),
                        (&dst, entry.dst_offset),
                        od,
                    )
                    .map_err(eng(Phase::Dispatch))?;
            }
            Action::Barrier { phase, imm } => {
                self.peers()?;
                let od = self.on_done();
                let p = self.peers.as_ref().ok_or(MoeError::NotConnected)?;
                self.engine
                    .submit_barrier(&p.group, od, *imm, &p.recv)
                    .map_err(eng(*phase))?;
            }
            Action::PackDispatch
            | Action::Unpack
            | Action::PackCombine
            | Action::WeightedSum
            | Action::Wait(_)
            | Action::Finished(_) => {}
        }
        Ok(None)
    }

    /// Runs a dispatch data operation (pack or unpack).
    ///
    /// `send_buf` is only ever a source (peers get no descriptor of it), and
    /// the core runs the pack only after every own submit that read it
    /// resolved, so it is used as a plain slice. `recv_buf` is read in place
    /// too: unpack runs after the DISPATCH round fired and before this rank's
    /// BAR_D, so no peer can write bytes into it meanwhile (combine data needs
    /// this rank's BAR_D, the next step's private and overflow rows need its
    /// BAR_C; barriers themselves carry no bytes).
    pub fn data_dispatch(
        &mut self,
        a: &Action,
        core: &RankCore,
        io: &mut DispatchIo<'_>,
    ) -> Result<(), MoeError> {
        let d = &self.dims;
        let Bufs { send, recv, .. } = &mut self.bufs;
        match a {
            Action::PackDispatch => {
                pack::pack_dispatch(d, &io.input, io.pairs, send.as_mut_slice())?;
            }
            Action::Unpack => {
                let plan = core.plan().ok_or(MoeError::OutOfOrder {
                    expected: "routes before unpack",
                })?;
                pack::unpack_into(d, plan, send.as_slice(), recv.as_slice(), io.tokens)?;
                io.unpacked = true;
            }
            _ => {}
        }
        Ok(())
    }

    /// Runs a combine data operation (pack or weighted sum).
    ///
    /// The pack writes `send_buf` in place (after the own dispatch submits
    /// resolved) and copies this rank's own rows into its `recv_buf`
    /// combine slots with [`HostBuffer::write`] (peers' combine rows may be
    /// landing in other slots meanwhile). The weighted sum reads `recv_buf`
    /// in place: the COMBINE round fired, and nothing else can land before
    /// this rank's BAR_C.
    pub fn data_combine(
        &mut self,
        a: &Action,
        core: &RankCore,
        io: &mut CombineIo<'_>,
    ) -> Result<(), MoeError> {
        let d = &self.dims;
        let plan = core.plan().ok_or(MoeError::OutOfOrder {
            expected: "dispatch before combine",
        })?;
        let own_rows = io.slots.len() as u64;
        let Bufs { send, recv, .. } = &mut self.bufs;
        match a {
            Action::PackCombine => {
                let ob = d.out_row_bytes() as usize;
                let own = &mut self.scratch;
                own.clear();
                own.resize((own_rows * d.b_out) as usize, 0);
                pack::pack_combine(d, plan, io.outputs, send.as_mut_slice(), own)?;
                for c in plan.combine() {
                    if let CombineSlot::Recv(x) = *c {
                        let off = (u64::from(x) * d.b_out) as usize;
                        let row = own.get(off..off + ob).ok_or(MoeError::Shape {
                            what: "own combine rows",
                            got: own.len() as u64,
                            want: (off + ob) as u64,
                        })?;
                        recv.write(off, row);
                    }
                }
            }
            Action::WeightedSum => {
                pack::weighted_sum_into(d, io.slots, io.weights, recv.as_slice(), io.out)?;
                io.summed = true;
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether `w` holds now: `None` if not yet, else the event to feed (or
    /// the engine's error).
    pub fn poll(&self, w: &Wait) -> Option<Result<Event, MoeError>> {
        match *w {
            Wait::Submits(phase) => {
                if self.done.total() < self.submitted {
                    return None;
                }
                Some(match self.done.first_error() {
                    Some(source) => Err(MoeError::Engine { phase, source }),
                    None => Ok(Event::SubmitsDone),
                })
            }
            Wait::Round { phase, .. } => {
                let r = self.flags[phase_index(phase)].as_ref()?.result()?;
                Some(match r {
                    Ok(()) => Ok(Event::RoundFired(phase)),
                    Err(source) => Err(MoeError::Engine { phase, source }),
                })
            }
        }
    }

    /// Blocks until `w` holds (at most the step timeout).
    pub fn block(&self, w: &Wait) -> Result<Event, MoeError> {
        match *w {
            Wait::Submits(phase) => {
                if !self.done.wait_for_timeout(self.submitted, self.timeout) {
                    return Err(MoeError::SubmitTimeout {
                        phase,
                        submitted: self.submitted,
                        done: self.done.total(),
                    });
                }
                match self.done.first_error() {
                    Some(source) => Err(MoeError::Engine { phase, source }),
                    None => Ok(Event::SubmitsDone),
                }
            }
            Wait::Round { phase, imm, count } => {
                let flag = self.flags[phase_index(phase)]
                    .as_ref()
                    .ok_or(MoeError::OutOfOrder {
                        expected: "a round armed before its wait",
                    })?;
                match flag.wait_timeout(self.timeout) {
                    Some(Ok(())) => Ok(Event::RoundFired(phase)),
                    Some(Err(source)) => Err(MoeError::Engine { phase, source }),
                    None => Err(MoeError::Timeout {
                        phase,
                        imm,
                        expected: count,
                        pending: self.engine.imm_pending(imm),
                    }),
                }
            }
        }
    }

    /// Frees the immediates and unregisters the buffers.
    pub fn release(&mut self) -> Result<(), MoeError> {
        self.held.release().map_err(eng(Phase::Setup))
    }
}

/// The engine's scatter slices for `entries` (slice `j` to peer-group
/// member `j`): the core lists every member once, in member order; any
/// other list is [`MoeError::Shape`]. Shared by the host executor and the
/// GPU proxy.
pub(crate) fn scatter_slices(entries: &[Entry]) -> Result<Vec<ScatterSlice>, MoeError> {
    entries
        .iter()
        .enumerate()
        .map(|(j, e)| {
            if e.member != j {
                return Err(MoeError::Shape {
                    what: "scatter entry's member (entries list members in order)",
                    got: e.member as u64,
                    want: j as u64,
                });
            }
            Ok(ScatterSlice {
                src_offset: e.src_offset,
                dst_offset: e.dst_offset,
                len: e.len,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(member: usize, k: u64) -> Entry {
        Entry {
            member,
            len: k,
            src_offset: 10 * k,
            dst_offset: 100 * k,
        }
    }

    /// Slice `j` carries entry `j`'s bytes; an entry out of member order is
    /// a shape error naming the member it found and the one it wanted.
    #[test]
    fn scatter_slices_follow_member_order() {
        let ok = scatter_slices(&[entry(0, 1), entry(1, 0), entry(2, 7)]).unwrap();
        assert_eq!(
            ok,
            vec![
                ScatterSlice {
                    src_offset: 10,
                    dst_offset: 100,
                    len: 1
                },
                ScatterSlice {
                    src_offset: 0,
                    dst_offset: 0,
                    len: 0
                },
                ScatterSlice {
                    src_offset: 70,
                    dst_offset: 700,
                    len: 7
                },
            ]
        );
        match scatter_slices(&[entry(0, 1), entry(2, 1), entry(1, 1)]) {
            Err(MoeError::Shape {
                got: 2, want: 1, ..
            }) => {}
            r => panic!("out of order: {r:?}"),
        }
        assert!(scatter_slices(&[]).unwrap().is_empty());
    }
}
