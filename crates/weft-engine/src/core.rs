//! The sans-IO per-group worker core.
//!
//! [`WorkerCore`] owns the domains of one group and is driven from outside:
//! `take_request` (priority 1: new requests and their first WRs),
//! `post_backlog` (priority 2: more WRs of pending requests as send-queue
//! room frees) and `poll` (priority 3: completion queues). It never blocks,
//! never sleeps and never runs user callbacks: those come out as
//! [`Event`]s for the driver to hand to the callback thread.

use crate::error::{EngineError, TransferId};
use crate::imm::ImmTable;
use crate::mem::{RawBuf, SendPayload, SendPool};
use crate::ondone::{DoneCallback, DoneResult, OnDone};
use crate::shard::{self, Piece, ScatterMode, ShardConfig};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weft_transport::{
    Access, Capabilities, Completion, Domain, Imm, LocalMr, LocalSlice, MemRegion, MrDesc, MrKey,
    NetAddr, Pages, PeerId, PostError, RemoteSlice, Rkey, ScatterDst, TransportError, WrId,
    WriteWr,
};

/// Most NICs in one group.
pub const MAX_NICS: usize = 8;

/// The armed `expect_imm_count` rounds, for the workers' idle loop: while a
/// round waits, a worker with nothing in flight keeps polling (yielding)
/// rather than sleeping `idle_sleep` between polls, so the immediates it
/// waits for are seen when they land, not after a sleep. As with WRs in
/// flight, this lasts `inflight_spin` past the last progress or arm.
#[derive(Debug, Default)]
pub(crate) struct ImmWaits {
    /// Rounds armed and not yet fired (or dropped).
    pub(crate) armed: AtomicU64,
    /// Bumped by every arm that leaves a round waiting: a worker that sees
    /// it change restarts its `inflight_spin` clock.
    pub(crate) arms: AtomicU64,
}

/// Holds one count of [`ImmWaits::armed`] for as long as it lives; it
/// travels with the round's `OnDone` (inside the callback, for a callback),
/// so the count drops once the round was reported, or dropped unreported.
pub(crate) struct ArmedRound(Arc<ImmWaits>);

impl ArmedRound {
    /// Counted before the round is armed, so the count never drops below
    /// zero when the round fires at once on another thread.
    pub(crate) fn new(w: &Arc<ImmWaits>) -> Self {
        w.armed.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(w))
    }
}

impl Drop for ArmedRound {
    fn drop(&mut self) {
        self.0.armed.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What an armed immediate round reports to, stored in the immediate
/// table: the caller's `OnDone` and the round's [`ArmedRound`] count.
pub(crate) struct ImmDone {
    on_done: OnDone,
    round: ArmedRound,
}

impl ImmDone {
    pub(crate) fn new(on_done: OnDone, waits: &Arc<ImmWaits>) -> Self {
        Self {
            on_done,
            round: ArmedRound::new(waits),
        }
    }

    /// Resolves a flag or counter at once; a callback comes back, with the
    /// round's count inside it, to be run on the callback thread.
    pub(crate) fn resolve(self, r: DoneResult) -> Option<(DoneCallback, DoneResult)> {
        let ImmDone { on_done, round } = self;
        let (cb, r) = on_done.resolve_inline(r)?;
        Some((
            Box::new(move |r| {
                let _round = round;
                cb(r)
            }),
            r,
        ))
    }
}

/// Receive callback: the filled bytes, or why the buffer came back empty.
pub type RecvCallback = Box<dyn FnMut(Result<&[u8], EngineError>) + Send + 'static>;

/// What the core hands to the driver.
pub(crate) enum Event {
    /// A transfer finished; run its callback.
    Done(DoneCallback, DoneResult),
    /// A receive buffer was filled (or failed).
    Recv {
        pool: Arc<RecvPool>,
        idx: u32,
        result: Result<u64, EngineError>,
    },
}

/// A rotating pool of receive buffers on NIC 0 of a group.
pub(crate) struct RecvPool {
    pub(crate) id: u16,
    pub(crate) group: usize,
    pub(crate) buf: RawBuf,
    pub(crate) len: u64,
    pub(crate) count: u32,
    pub(crate) cb: parking_lot::Mutex<RecvCallback>,
}

impl RecvPool {
    /// The bytes of buffer `idx` (first `n`).
    ///
    /// # Safety
    /// The buffer must not be posted (no NIC may write it) for the lifetime
    /// of the returned slice.
    pub(crate) unsafe fn bytes(&self, idx: u32, n: u64) -> Option<&[u8]> {
        if idx >= self.count || n > self.len {
            return None;
        }
        let off = usize::try_from(u64::from(idx) * self.len).ok()?;
        let n = usize::try_from(n).ok()?;
        // SAFETY: in bounds (idx < count, n <= len, buffer is count*len);
        // the caller guarantees no concurrent writer.
        Some(unsafe { std::slice::from_raw_parts(self.buf.ptr().add(off), n) })
    }
}

/// The remote addresses of one peer group member: one per NIC, in NIC order.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct GroupAddress {
    /// Address of NIC `i` of the peer's group.
    pub nics: Vec<NetAddr>,
}

/// Packs a registration slot id and its generation into one key.
pub(crate) fn mr_key(id: u32, gen: u32) -> u64 {
    (u64::from(gen) << 32) | u64::from(id)
}

/// Splits [`mr_key`]'s key into (slot id, generation).
pub(crate) fn split_mr_key(key: u64) -> (u32, u32) {
    ((key & 0xffff_ffff) as u32, (key >> 32) as u32)
}

/// The body of one submitted request.
#[derive(Debug)]
pub(crate) enum Body {
    Single {
        len: u64,
        imm: Option<Imm>,
        src: u64,
        src_off: u64,
        dst: PlainDst,
        dst_off: u64,
    },
    Paged {
        page_len: u64,
        imm: Option<Imm>,
        src: u64,
        src_pages: Pages,
        dst: PlainDst,
        dst_pages: Pages,
    },
    Scatter {
        imm: Option<Imm>,
        src: u64,
        peers: u32,
        dsts: Dsts,
        mode: ScatterMode,
    },
    Barrier {
        imm: Imm,
        peers: u32,
        dsts: Dsts,
    },
    Send {
        peer: NetAddr,
        payload: SendPayload,
    },
}

/// A descriptor's region and per-lane rkeys as plain values, the part of
/// [`RoutedDst`] and [`PlainDst`] that travels instead of a cloned
/// `MrDesc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DstKeys {
    /// The destination region's base address and length.
    pub(crate) base: u64,
    pub(crate) region_len: u64,
    /// How many of `rkeys` are valid (the descriptor's rkey count).
    pub(crate) lanes: usize,
    pub(crate) rkeys: [Rkey; MAX_NICS],
}

impl DstKeys {
    /// `dst`'s region and rkeys; `None` when it has more rkeys than a
    /// group can have NICs.
    fn of(dst: &MrDesc) -> Option<Self> {
        if dst.rkeys.len() > MAX_NICS {
            return None;
        }
        let mut rkeys = [Rkey(0); MAX_NICS];
        for (lane, (_, rkey)) in dst.rkeys.iter().enumerate() {
            rkeys[lane] = *rkey;
        }
        Some(Self {
            base: dst.addr,
            region_len: dst.len,
            lanes: dst.rkeys.len(),
            rkeys,
        })
    }

    /// The rkey of `lane`, if the descriptor has one.
    fn rkey(&self, lane: usize) -> Result<Rkey, EngineError> {
        self.rkeys
            .get(lane)
            .copied()
            .filter(|_| lane < self.lanes)
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("destination has no rkey for NIC {lane}"),
            })
    }
}

/// A scatter or barrier destination whose per-lane NIC addresses were
/// matched, at submit, to the peer group member it goes to. It holds plain
/// values only, so no descriptor is cloned into the request queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoutedDst {
    pub(crate) len: u64,
    pub(crate) src_offset: u64,
    pub(crate) dst_offset: u64,
    pub(crate) keys: DstKeys,
}

impl RoutedDst {
    /// `dst` as seen through `member`: `Some` when each of its rkeys' NIC
    /// addresses is `member`'s address of the same lane.
    pub(crate) fn matched(
        member: &GroupAddress,
        dst: &MrDesc,
        len: u64,
        src_offset: u64,
        dst_offset: u64,
    ) -> Option<Self> {
        let keys = DstKeys::of(dst)?;
        for (lane, (addr, _)) in dst.rkeys.iter().enumerate() {
            if member.nics.get(lane) != Some(addr) {
                return None;
            }
        }
        Some(Self {
            len,
            src_offset,
            dst_offset,
            keys,
        })
    }
}

/// The NIC addresses single and paged writes target, interned engine-wide:
/// a submit turns each descriptor's addresses into small ids here (one
/// read lock and hash look-up per address), so no descriptor is cloned
/// into the request queue; workers map ids to their peers and fetch the
/// address itself only the first time they meet an id. Addresses are never
/// removed (one entry per distinct remote NIC address ever written to).
#[derive(Debug, Default)]
pub(crate) struct AddrBook {
    index: parking_lot::RwLock<AddrIndex>,
}

#[derive(Debug, Default)]
struct AddrIndex {
    ids: std::collections::HashMap<NetAddr, u32>,
    addrs: Vec<NetAddr>,
}

impl AddrBook {
    /// The id of `addr`, entered on first sight.
    fn id(&self, addr: &NetAddr) -> u32 {
        if let Some(&id) = self.index.read().ids.get(addr) {
            return id;
        }
        let mut ix = self.index.write();
        if let Some(&id) = ix.ids.get(addr) {
            return id;
        }
        let id = ix.addrs.len() as u32;
        ix.addrs.push(addr.clone());
        ix.ids.insert(addr.clone(), id);
        id
    }

    /// The address of `id`.
    fn addr(&self, id: u32) -> Option<NetAddr> {
        self.index.read().addrs.get(id as usize).cloned()
    }
}

/// A single or paged write's destination with its NIC addresses interned
/// in the [`AddrBook`]: plain values only, nothing allocated per submit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlainDst {
    keys: DstKeys,
    /// The [`AddrBook`] id of each lane's NIC address (`keys.lanes` valid).
    addrs: [u32; MAX_NICS],
}

impl PlainDst {
    /// `dst` with its addresses entered in `book`; `None` when it has more
    /// rkeys than a group can have NICs.
    pub(crate) fn new(dst: &MrDesc, book: &AddrBook) -> Option<Self> {
        let keys = DstKeys::of(dst)?;
        let mut addrs = [0u32; MAX_NICS];
        for (lane, (addr, _)) in dst.rkeys.iter().enumerate() {
            addrs[lane] = book.id(addr);
        }
        Some(Self { keys, addrs })
    }
}

/// The destinations of a scatter or barrier.
#[derive(Debug)]
pub(crate) enum Dsts {
    /// Every descriptor matched its peer group member (the common case):
    /// the member's pre-resolved peers are used, nothing is looked up.
    Routed(Vec<RoutedDst>),
    /// Some descriptor names NIC addresses other than its member's: each
    /// destination is resolved by its descriptor's addresses.
    Described(Vec<ScatterDst>),
}

impl Dsts {
    fn len(&self) -> usize {
        match self {
            Dsts::Routed(v) => v.len(),
            Dsts::Described(v) => v.len(),
        }
    }
}

/// Where the pieces of one destination go.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// A descriptor; with `(peer group, member)`, that member's
    /// pre-resolved peers are used where their address is the descriptor's.
    Desc(&'a MrDesc, Option<(u32, usize)>),
    /// A destination matched at submit to member `.2` of peer group `.1`.
    Member(&'a RoutedDst, u32, usize),
    /// A single or paged write's destination (addresses interned).
    Plain(&'a PlainDst),
}

impl Target<'_> {
    fn base(&self) -> u64 {
        match self {
            Target::Desc(d, _) => d.addr,
            Target::Member(r, ..) => r.keys.base,
            Target::Plain(p) => p.keys.base,
        }
    }

    fn region_len(&self) -> u64 {
        match self {
            Target::Desc(d, _) => d.len,
            Target::Member(r, ..) => r.keys.region_len,
            Target::Plain(p) => p.keys.region_len,
        }
    }

    /// Number of remote NICs the destination has keys for.
    fn rkey_count(&self) -> usize {
        match self {
            Target::Desc(d, _) => d.rkeys.len(),
            Target::Member(r, ..) => r.keys.lanes,
            Target::Plain(p) => p.keys.lanes,
        }
    }
}

/// One request as it travels through the request queue.
#[derive(Debug)]
pub(crate) struct Submitted {
    pub(crate) id: TransferId,
    pub(crate) on_done: OnDone,
    pub(crate) body: Body,
    #[cfg(feature = "latency-probe")]
    pub(crate) stamps: crate::probe::Stamps,
}

/// Control-plane operations (registration, peers, pools).
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
    Repost {
        pool: u16,
        idx: u32,
    },
}

const KIND_SHIFT: u32 = 62;
const KIND_WRITE: u64 = 0;
const KIND_SEND: u64 = 1;
const KIND_RECV: u64 = 2;
const GEN_MASK: u64 = (1 << 30) - 1;

fn wr_transfer(kind: u64, slot: u32, gen: u32) -> WrId {
    WrId((kind << KIND_SHIFT) | ((u64::from(gen) & GEN_MASK) << 32) | u64::from(slot))
}

fn wr_recv(pool: u16, idx: u32) -> WrId {
    WrId((KIND_RECV << KIND_SHIFT) | (u64::from(pool) << 32) | u64::from(idx))
}

enum Decoded {
    Transfer { slot: u32, gen: u32 },
    Recv { pool: u16, idx: u32 },
    Unknown,
}

fn decode(wr: WrId) -> Decoded {
    let kind = wr.0 >> KIND_SHIFT;
    let low = (wr.0 & 0xffff_ffff) as u32;
    match kind {
        KIND_WRITE | KIND_SEND => Decoded::Transfer {
            slot: low,
            gen: ((wr.0 >> 32) & GEN_MASK) as u32,
        },
        KIND_RECV => Decoded::Recv {
            pool: ((wr.0 >> 32) & 0xffff) as u16,
            idx: low,
        },
        _ => Decoded::Unknown,
    }
}

/// A work request waiting for send-queue room.
#[derive(Debug, Clone, Copy)]
enum Op {
    Write(WriteWr),
    Send {
        wr: WrId,
        peer: PeerId,
        src: LocalSlice,
    },
}

impl Op {
    fn wr(&self) -> WrId {
        match self {
            Op::Write(w) => w.wr,
            Op::Send { wr, .. } => *wr,
        }
    }
}

struct Nic {
    domain: Box<dyn Domain>,
    caps: Capabilities,
    name: String,
    inflight: usize,
    /// WRs of the request being taken right now (priority 1).
    fresh: VecDeque<Op>,
    /// WRs of older requests waiting for room (priority 2).
    backlog: VecDeque<Op>,
    peers: BTreeMap<NetAddr, PeerId>,
    peer_addrs: BTreeMap<PeerId, NetAddr>,
    /// `peers` by [`AddrBook`] id (filled on first use).
    by_addr_id: Vec<Option<PeerId>>,
    dead: Option<TransportError>,
    recvs_posted: usize,
}

struct SendRes {
    slot: Option<u32>,
    owned: Option<(Vec<u8>, MrKey)>,
}

struct Transfer {
    gen: u32,
    live: bool,
    id: TransferId,
    on_done: Option<OnDone>,
    /// Pieces not yet completed (posted or not).
    remaining: u64,
    /// Pieces not yet handed to the backend.
    unposted: u64,
    /// Posted, not yet completed, per NIC.
    posted_on: [u32; MAX_NICS],
    error: Option<EngineError>,
    send: Option<SendRes>,
    #[cfg(feature = "latency-probe")]
    probe: crate::probe::Record,
}

/// What one lane of one destination needs to turn pieces into WRs.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// The source registration on this lane's NIC (`None`: not registered
    /// there; pieces fail with `OutOfBounds`).
    mr: Option<LocalMr>,
    peer: PeerId,
    rkey: Rkey,
}

/// Per-lane routes of one destination, filled on first use.
#[derive(Default)]
struct Routes([Option<Route>; MAX_NICS]);

struct MrEntry {
    lanes: Vec<LocalMr>,
}

struct PeerGroup {
    /// `[member][lane]` resolved peer and the address it was resolved from.
    members: Vec<Vec<(NetAddr, PeerId)>>,
}

struct PoolState {
    pool: Arc<RecvPool>,
    mr: LocalMr,
    waiting: VecDeque<u32>,
}

/// Static facts about a group once its domains are open.
#[derive(Debug, Clone)]
pub(crate) struct GroupInfo {
    pub(crate) addrs: Vec<NetAddr>,
    pub(crate) names: Vec<String>,
    pub(crate) max_write_len: u64,
    pub(crate) max_send_len: u64,
}

/// Per-group worker state machine. See the module docs.
pub(crate) struct WorkerCore {
    group: usize,
    nics: Vec<Nic>,
    slab: Vec<Transfer>,
    free: Vec<u32>,
    mrs: Vec<Option<MrEntry>>,
    /// Generation of each `mrs` slot, bumped on every deregistration.
    mr_gens: Vec<u32>,
    peer_groups: Vec<PeerGroup>,
    pools: BTreeMap<u16, PoolState>,
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
    events: Vec<Event>,
    scratch: Vec<WriteWr>,
    /// Reused buffer of planned pieces.
    pieces: Vec<Piece>,
    comps: Vec<Completion>,
    pending_pieces: usize,
    #[cfg(feature = "latency-probe")]
    probes: Arc<crate::probe::ProbeSink>,
}

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
        #[cfg(feature = "latency-probe")] probes: Arc<crate::probe::ProbeSink>,
    ) -> Result<Self, EngineError> {
        if domains.is_empty() || domains.len() > MAX_NICS {
            return Err(EngineError::Setup {
                group,
                what: format!("a group needs 1..={MAX_NICS} NICs, got {}", domains.len()),
                source: None,
            });
        }
        let mut nics: Vec<Nic> = domains
            .into_iter()
            .map(|d| {
                let caps = d.capabilities().clone();
                let name = d.info().name.clone();
                Nic {
                    domain: d,
                    caps,
                    name,
                    inflight: 0,
                    fresh: VecDeque::new(),
                    backlog: VecDeque::new(),
                    peers: BTreeMap::new(),
                    peer_addrs: BTreeMap::new(),
                    by_addr_id: Vec::new(),
                    dead: None,
                    recvs_posted: 0,
                }
            })
            .collect();
        let max_write_len = nics
            .iter()
            .map(|n| n.caps.max_write_len)
            .min()
            .unwrap_or(1)
            .max(1);
        let send_pool = Arc::new(SendPool::new(send_slots, send_slot_len)?);
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
            n.caps.max_inflight = n.caps.max_inflight.max(1);
            n.caps.max_batch = n.caps.max_batch.max(1);
        }
        Ok(Self {
            group,
            nics,
            slab: Vec::new(),
            free: Vec::new(),
            mrs: Vec::new(),
            mr_gens: Vec::new(),
            peer_groups: Vec::new(),
            pools: BTreeMap::new(),
            send_pool,
            send_mr,
            zero_mrs,
            imms,
            addrs,
            shard,
            max_write_len,
            rr: 0,
            events: Vec::new(),
            scratch: Vec::new(),
            pieces: Vec::new(),
            comps: Vec::new(),
            pending_pieces: 0,
            #[cfg(feature = "latency-probe")]
            probes,
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
            max_write_len: self.max_write_len,
            max_send_len: self.nics[0].caps.max_send_len,
        }
    }

    pub(crate) fn send_pool(&self) -> Arc<SendPool> {
        Arc::clone(&self.send_pool)
    }

    /// Events produced since the last call.
    pub(crate) fn take_events(&mut self, out: &mut Vec<Event>) {
        out.append(&mut self.events);
    }

    /// WRs planned but not yet handed to the backend (backpressure signal).
    pub(crate) fn pending_pieces(&self) -> usize {
        self.pending_pieces
    }

    /// Whether a NIC of the group moves data only while polled
    /// ([`Capabilities::software_progress`]).
    pub(crate) fn software_progress(&self) -> bool {
        self.nics.iter().any(|n| n.caps.software_progress)
    }

    /// Whether WRs are posted and not yet completed, or waiting for room.
    pub(crate) fn in_flight(&self) -> bool {
        self.pending_pieces > 0 || self.nics.iter().any(|n| n.inflight > 0)
    }

    /// Whether any transfer is still unfinished.
    pub(crate) fn busy(&self) -> bool {
        self.slab.iter().any(|t| t.live)
    }

    // ---------------------------------------------------------------- control

    pub(crate) fn handle_control(&mut self, c: Control) {
        match c {
            Control::RegMr { region, reply } => {
                let _ = reply.send(self.reg_mr(&region));
            }
            Control::UnregMr { id, reply } => {
                let _ = reply.send(self.unreg_mr(id));
            }
            Control::AddPeerGroup { peers, reply } => {
                let _ = reply.send(self.add_peer_group(peers));
            }
            Control::RecvPool { pool, reply } => {
                let _ = reply.send(self.add_recv_pool(pool));
            }
            Control::Repost { pool, idx } => self.repost(pool, idx),
        }
    }

    fn reg_mr(&mut self, region: &MemRegion) -> Result<(u64, Vec<LocalMr>), EngineError> {
        let mut lanes = Vec::with_capacity(self.nics.len());
        for (i, n) in self.nics.iter_mut().enumerate() {
            match n.domain.register(region, Access::RemoteWrite) {
                Ok(mr) => lanes.push(mr),
                Err(e) => {
                    for (j, mr) in lanes.iter().enumerate() {
                        let _ = self.nics_dereg(j, mr.key);
                    }
                    return Err(EngineError::Control {
                        group: self.group,
                        nic: i,
                        op: "register",
                        source: Box::new(e),
                    });
                }
            }
        }
        let id = match self.mrs.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.mrs.push(None);
                self.mr_gens.push(0);
                self.mrs.len() - 1
            }
        };
        let id32 = u32::try_from(id).map_err(|_| EngineError::InvalidArgument {
            what: "too many registrations".into(),
        })?;
        if let Some(slot) = self.mrs.get_mut(id) {
            *slot = Some(MrEntry {
                lanes: lanes.clone(),
            });
        }
        let gen = self.mr_gens.get(id).copied().unwrap_or(0);
        Ok((mr_key(id32, gen), lanes))
    }

    fn nics_dereg(&mut self, nic: usize, key: MrKey) -> Result<(), TransportError> {
        match self.nics.get_mut(nic) {
            Some(n) => n.domain.deregister(key),
            None => Ok(()),
        }
    }

    /// The live registration `key` names; a key whose generation is not
    /// the slot's current one is stale.
    fn mr_entry(&self, key: u64) -> Result<&MrEntry, EngineError> {
        let (id, gen) = split_mr_key(key);
        let current = self.mr_gens.get(id as usize).copied();
        match current {
            Some(c) if c != gen => Err(EngineError::StaleMr {
                id: u64::from(id),
                gen,
                current: c,
            }),
            _ => self
                .mrs
                .get(id as usize)
                .and_then(Option::as_ref)
                .ok_or(EngineError::UnknownMr(u64::from(id))),
        }
    }

    fn unreg_mr(&mut self, key: u64) -> Result<(), EngineError> {
        self.mr_entry(key)?;
        let id = split_mr_key(key).0 as usize;
        let entry = self
            .mrs
            .get_mut(id)
            .and_then(Option::take)
            .ok_or(EngineError::UnknownMr(id as u64))?;
        if let Some(g) = self.mr_gens.get_mut(id) {
            *g = g.wrapping_add(1);
        }
        let mut first = Ok(());
        for (i, mr) in entry.lanes.iter().enumerate() {
            if let Err(e) = self.nics_dereg(i, mr.key) {
                if first.is_ok() {
                    first = Err(EngineError::Control {
                        group: self.group,
                        nic: i,
                        op: "deregister",
                        source: Box::new(e),
                    });
                }
            }
        }
        first
    }

    fn resolve(&mut self, lane: usize, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let n = self
            .nics
            .get_mut(lane)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: String::new(),
                what: format!("no NIC {lane}"),
            })?;
        if let Some(p) = n.peers.get(addr) {
            return Ok(*p);
        }
        let p = n.domain.add_peer(addr)?;
        n.peers.insert(addr.clone(), p);
        n.peer_addrs.insert(p, addr.clone());
        Ok(p)
    }

    fn add_peer_group(&mut self, peers: Vec<GroupAddress>) -> Result<u32, EngineError> {
        let mut members = Vec::with_capacity(peers.len());
        for p in peers {
            let lanes = p.nics.len().min(self.nics.len());
            let mut m = Vec::with_capacity(lanes);
            for (lane, addr) in p.nics.into_iter().take(lanes).enumerate() {
                let id = self
                    .resolve(lane, &addr)
                    .map_err(|e| EngineError::Control {
                        group: self.group,
                        nic: lane,
                        op: "add_peer",
                        source: Box::new(e),
                    })?;
                m.push((addr, id));
            }
            members.push(m);
        }
        let id =
            u32::try_from(self.peer_groups.len()).map_err(|_| EngineError::InvalidArgument {
                what: "too many peer groups".into(),
            })?;
        self.peer_groups.push(PeerGroup { members });
        Ok(id)
    }

    fn add_recv_pool(&mut self, pool: Arc<RecvPool>) -> Result<(), EngineError> {
        let mr = self.nics[0]
            .domain
            .register(&pool.buf.region(), Access::LocalOnly)
            .map_err(|e| EngineError::Control {
                group: self.group,
                nic: 0,
                op: "register receive pool",
                source: Box::new(e),
            })?;
        let id = pool.id;
        let count = pool.count;
        self.pools.insert(
            id,
            PoolState {
                pool,
                mr,
                waiting: VecDeque::new(),
            },
        );
        for idx in 0..count {
            self.repost(id, idx);
        }
        Ok(())
    }

    fn repost(&mut self, pool: u16, idx: u32) {
        let Some(ps) = self.pools.get_mut(&pool) else {
            return;
        };
        let nic = &mut self.nics[0];
        if nic.dead.is_some() {
            return;
        }
        if nic.recvs_posted >= nic.caps.max_recvs.max(1) {
            ps.waiting.push_back(idx);
            return;
        }
        let Some(buf) = ps.mr.slice(u64::from(idx) * ps.pool.len, ps.pool.len) else {
            return;
        };
        match nic.domain.post_recv(wr_recv(pool, idx), buf) {
            Ok(()) => nic.recvs_posted += 1,
            Err(e) if e.is_retryable() => ps.waiting.push_back(idx),
            Err(e) => {
                let err = EngineError::Control {
                    group: self.group,
                    nic: 0,
                    op: "post_recv",
                    source: Box::new(e),
                };
                self.events.push(Event::Recv {
                    pool: Arc::clone(&ps.pool),
                    idx,
                    result: Err(err),
                });
            }
        }
    }

    // --------------------------------------------------------------- requests

    fn alloc_transfer(&mut self, id: TransferId, on_done: OnDone) -> (u32, u32) {
        if let Some(slot) = self.free.pop() {
            let t = &mut self.slab[slot as usize];
            t.gen = t.gen.wrapping_add(1) & GEN_MASK as u32;
            t.live = true;
            t.id = id;
            t.on_done = Some(on_done);
            t.remaining = 0;
            t.unposted = 0;
            t.posted_on = [0; MAX_NICS];
            t.error = None;
            t.send = None;
            return (slot, t.gen);
        }
        let slot = self.slab.len() as u32;
        self.slab.push(Transfer {
            gen: 0,
            live: true,
            id,
            on_done: Some(on_done),
            remaining: 0,
            unposted: 0,
            posted_on: [0; MAX_NICS],
            error: None,
            send: None,
            #[cfg(feature = "latency-probe")]
            probe: crate::probe::Record::default(),
        });
        (slot, 0)
    }

    /// Takes one new request and posts its first WRs (priority 1).
    pub(crate) fn take_request(&mut self, req: Submitted) {
        let Submitted {
            id,
            on_done,
            body,
            #[cfg(feature = "latency-probe")]
            stamps,
        } = req;
        let (slot, gen) = self.alloc_transfer(id, on_done);
        #[cfg(feature = "latency-probe")]
        {
            self.slab[slot as usize].probe = crate::probe::Record::start(id, stamps);
        }
        let kind = if matches!(body, Body::Send { .. }) {
            KIND_SEND
        } else {
            KIND_WRITE
        };
        let wr = wr_transfer(kind, slot, gen);
        // Planning holds one count of `remaining` and of `unposted`, so
        // pieces posted early (see the scatter plan) can neither finish the
        // transfer nor count as "all posted" before every piece is planned.
        {
            let t = &mut self.slab[slot as usize];
            t.remaining += 1;
            t.unposted += 1;
        }
        if let Err(e) = self.plan(slot, wr, body) {
            self.fail_transfer(slot, e);
        }
        {
            let t = &mut self.slab[slot as usize];
            t.remaining -= 1;
            t.unposted -= 1;
            // Every piece was posted during planning: the probe's "all
            // posted" is now (`posted` saw the hold and did not record it).
            #[cfg(feature = "latency-probe")]
            if t.unposted == 0 && t.probe.first_wr.is_some() {
                t.probe.posted(true);
                self.probes.push(t.probe);
            }
        }
        // Post the fresh WRs now; what does not fit joins the backlog.
        self.post_fresh();
        for i in 0..self.nics.len() {
            if !self.nics[i].fresh.is_empty() {
                let n = &mut self.nics[i];
                if n.backlog.is_empty() {
                    // Common case: no copy, the rings trade buffers.
                    std::mem::swap(&mut n.fresh, &mut n.backlog);
                } else {
                    n.backlog.append(&mut n.fresh);
                }
            }
        }
        self.maybe_finish(slot);
    }

    /// Posts what the fresh rings hold while there is room; the rest stays
    /// there, in order, ahead of pieces planned later.
    fn post_fresh(&mut self) {
        for i in 0..self.nics.len() {
            if !self.nics[i].fresh.is_empty() {
                self.post_ring(i, true);
            }
        }
    }

    fn push_op(&mut self, slot: u32, lane: usize, op: Op) {
        let t = &mut self.slab[slot as usize];
        t.remaining += 1;
        t.unposted += 1;
        self.pending_pieces += 1;
        self.nics[lane].fresh.push_back(op);
    }

    /// The route of `lane` toward `target` from source registration `src`
    /// (`None`: zero-length writes, whose source is the engine's own):
    /// looked up once per destination (cached in `routes`), not per piece.
    #[inline]
    fn route(
        &mut self,
        routes: &mut Routes,
        tid: TransferId,
        lane: usize,
        src: Option<u64>,
        target: Target<'_>,
    ) -> Result<Route, EngineError> {
        // The per-piece fast path (a paged write calls this per page) stays
        // inlined at its callers; the look-up below runs once per lane.
        if let Some(r) = routes.0.get(lane).copied().flatten() {
            return Ok(r);
        }
        self.route_uncached(routes, tid, lane, src, target)
    }

    #[inline(never)]
    fn route_uncached(
        &mut self,
        routes: &mut Routes,
        tid: TransferId,
        lane: usize,
        src: Option<u64>,
        target: Target<'_>,
    ) -> Result<Route, EngineError> {
        let mr = match src {
            Some(key) => self.mr_entry(key)?.lanes.get(lane).copied(),
            None => None,
        };
        let no_rkey = || EngineError::InvalidArgument {
            what: format!("destination has no rkey for NIC {lane}"),
        };
        let (peer, rkey) = match target {
            Target::Member(d, g, j) => {
                let r = self.member_route(d, g, j, lane, mr)?;
                (r.peer, r.rkey)
            }
            Target::Plain(d) => {
                let rkey = d.keys.rkey(lane)?;
                (self.plain_peer(lane, d.addrs[lane], tid)?, rkey)
            }
            Target::Desc(dst, hint) => {
                let (addr, rkey) = dst.rkeys.get(lane).ok_or_else(no_rkey)?;
                let hinted = hint
                    .and_then(|(g, j)| self.peer_groups.get(g as usize)?.members.get(j)?.get(lane))
                    .and_then(|(a, id)| (a == addr).then_some(*id));
                let peer = match hinted {
                    Some(p) => p,
                    None => {
                        let group = self.group;
                        self.resolve(lane, addr)
                            .map_err(|e| transport(group, lane, tid, Some(addr.clone()), e))?
                    }
                };
                (peer, *rkey)
            }
        };
        let r = Route { mr, peer, rkey };
        if let Some(slot) = routes.0.get_mut(lane) {
            *slot = Some(r);
        }
        Ok(r)
    }

    /// The peer on `lane` at interned address `id` (see [`AddrBook`]):
    /// cached per lane, resolved by address the first time.
    fn plain_peer(&mut self, lane: usize, id: u32, tid: TransferId) -> Result<PeerId, EngineError> {
        if let Some(Some(p)) = self
            .nics
            .get(lane)
            .and_then(|n| n.by_addr_id.get(id as usize))
        {
            return Ok(*p);
        }
        let group = self.group;
        let addr = self
            .addrs
            .addr(id)
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("unknown interned address {id}"),
            })?;
        let peer = self
            .resolve(lane, &addr)
            .map_err(|e| transport(group, lane, tid, Some(addr.clone()), e))?;
        let cache = &mut self.nics[lane].by_addr_id;
        if cache.len() <= id as usize {
            cache.resize(id as usize + 1, None);
        }
        cache[id as usize] = Some(peer);
        Ok(peer)
    }

    /// The route of `lane` to member `j` of peer group `g` for a
    /// destination matched to it at submit.
    fn member_route(
        &self,
        d: &RoutedDst,
        g: u32,
        j: usize,
        lane: usize,
        mr: Option<LocalMr>,
    ) -> Result<Route, EngineError> {
        let rkey = d.keys.rkey(lane)?;
        let peer = self
            .peer_groups
            .get(g as usize)
            .and_then(|pg| pg.members.get(j)?.get(lane))
            .map(|(_, id)| *id)
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("peer group {g} member {j} has no NIC {lane}"),
            })?;
        Ok(Route { mr, peer, rkey })
    }

    #[allow(clippy::too_many_arguments)]
    fn push_write(
        &mut self,
        slot: u32,
        wr: WrId,
        route: Route,
        lane: usize,
        src_off: u64,
        target: Target<'_>,
        dst_off: u64,
        len: u64,
        imm: Option<Imm>,
    ) -> Result<(), EngineError> {
        // The one place a piece becomes a WR: domain, lkey, remote NIC
        // address and rkey all come from `lane` (its `Route`).
        let local = route
            .mr
            .and_then(|mr| mr.slice(src_off, len))
            .ok_or_else(|| EngineError::OutOfBounds {
                what: format!("source on NIC {lane}"),
                offset: src_off,
                len,
                region_len: route.mr.map_or(0, |mr| mr.len),
            })?;
        if dst_off
            .checked_add(len)
            .is_none_or(|e| e > target.region_len())
        {
            return Err(EngineError::OutOfBounds {
                what: "destination".into(),
                offset: dst_off,
                len,
                region_len: target.region_len(),
            });
        }
        let w = WriteWr {
            wr,
            peer: route.peer,
            src: local,
            dst: RemoteSlice {
                base: target.base(),
                offset: dst_off,
                rkey: route.rkey,
            },
            imm,
        };
        self.push_op(slot, lane, Op::Write(w));
        Ok(())
    }

    /// Routes and pushes every planned piece of `self.pieces` (offsets
    /// relative to `src_off` / `dst_off`).
    #[allow(clippy::too_many_arguments)]
    fn push_pieces(
        &mut self,
        slot: u32,
        wr: WrId,
        routes: &mut Routes,
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
            r = self
                .route(routes, tid, p.lane, Some(src), target)
                .and_then(|route| {
                    self.push_write(
                        slot,
                        wr,
                        route,
                        p.lane,
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

    fn lanes_for(&self, target: Target<'_>) -> Result<usize, EngineError> {
        let l = self.nics.len().min(target.rkey_count());
        if l == 0 {
            return Err(EngineError::InvalidArgument {
                what: "destination descriptor has no rkeys".into(),
            });
        }
        Ok(l)
    }

    fn plan(&mut self, slot: u32, wr: WrId, body: Body) -> Result<(), EngineError> {
        match body {
            Body::Single {
                len,
                imm,
                src,
                src_off,
                dst,
                dst_off,
            } => {
                let lanes = self.lanes_for(Target::Plain(&dst))?;
                self.rr = self.rr.wrapping_add(1);
                shard::plan_single_write_into(
                    &mut self.pieces,
                    len,
                    lanes,
                    self.max_write_len,
                    self.rr,
                    &self.shard,
                );
                let mut routes = Routes::default();
                self.push_pieces(
                    slot,
                    wr,
                    &mut routes,
                    Target::Plain(&dst),
                    src,
                    src_off,
                    dst_off,
                    imm,
                )
            }
            Body::Paged {
                page_len,
                imm,
                src,
                src_pages,
                dst,
                dst_pages,
            } => {
                let lanes = self.lanes_for(Target::Plain(&dst))?;
                let mut routes = Routes::default();
                let target = Target::Plain(&dst);
                let tid = self.slab[slot as usize].id;
                // A page that fits one WR is one piece on lane `i % lanes`
                // (what `plan_page` says): pushed without the piece list.
                let one_piece = page_len > 0
                    && page_len <= shard::piece_cap(self.max_write_len, self.shard.align);
                for i in 0..src_pages.len() {
                    let (Some(so), Some(d_o)) =
                        (src_pages.page_offset(i), dst_pages.page_offset(i))
                    else {
                        return Err(EngineError::InvalidArgument {
                            what: format!("page {i} offset overflows"),
                        });
                    };
                    if one_piece {
                        let lane = i % lanes;
                        let route = self.route(&mut routes, tid, lane, Some(src), target)?;
                        self.push_write(slot, wr, route, lane, so, target, d_o, page_len, imm)?;
                        continue;
                    }
                    shard::plan_page_into(
                        &mut self.pieces,
                        i,
                        page_len,
                        lanes,
                        self.max_write_len,
                        self.shard.align,
                    );
                    self.push_pieces(slot, wr, &mut routes, target, src, so, d_o, imm)?;
                }
                Ok(())
            }
            Body::Scatter {
                imm,
                src,
                peers,
                dsts,
                mode,
            } => {
                self.check_peer_group(peers, dsts.len())?;
                // Fast path: a destination matched to its member whose
                // ByPeer plan is one piece (lane `j % lanes`, the whole
                // length: what `plan_scatter_dst` says) is pushed directly
                // with the source registration looked up once per request.
                let cap = shard::piece_cap(self.max_write_len, self.shard.align);
                let mut src_mrs = [None; MAX_NICS];
                if matches!(dsts, Dsts::Routed(_)) && dsts.len() > 0 {
                    let lanes = &self.mr_entry(src)?.lanes;
                    for (l, mr) in lanes.iter().take(MAX_NICS).enumerate() {
                        src_mrs[l] = Some(*mr);
                    }
                }
                for j in 0..dsts.len() {
                    let one_piece = match (&dsts, mode) {
                        (Dsts::Routed(v), ScatterMode::ByPeer) if v[j].len <= cap => Some(&v[j]),
                        _ => None,
                    };
                    if let Some(d) = one_piece {
                        let target = Target::Member(d, peers, j);
                        let lane = j % self.lanes_for(target)?;
                        let mr = src_mrs.get(lane).copied().flatten();
                        let route = self.member_route(d, peers, j, lane, mr)?;
                        self.push_write(
                            slot,
                            wr,
                            route,
                            lane,
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
                }
                Ok(())
            }
            Body::Barrier { imm, peers, dsts } => {
                self.check_peer_group(peers, dsts.len())?;
                for j in 0..dsts.len() {
                    let target = match &dsts {
                        Dsts::Routed(v) => Target::Member(&v[j], peers, j),
                        Dsts::Described(v) => Target::Desc(&v[j].dst, Some((peers, j))),
                    };
                    let lanes = self.lanes_for(target)?;
                    // Zero-length, immediate-only: source is the send pool
                    // (any valid local key of that NIC works for 0 bytes).
                    let lane = j % lanes;
                    self.push_zero_write(slot, wr, lane, target, imm)?;
                }
                Ok(())
            }
            Body::Send { peer, payload } => self.plan_send(slot, wr, peer, payload),
        }
    }

    /// Plans and pushes destination `j` of a scatter by the general path
    /// (any mode, any number of pieces, routed or resolved by address).
    #[allow(clippy::too_many_arguments)]
    fn push_scatter_dst(
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
            Dsts::Routed(v) => {
                let d = &v[j];
                (
                    Target::Member(d, peers, j),
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
        let lanes = self.lanes_for(target)?;
        shard::plan_scatter_dst_into(
            &mut self.pieces,
            j,
            len,
            lanes,
            self.max_write_len,
            mode,
            &self.shard,
        );
        let mut routes = Routes::default();
        self.push_pieces(slot, wr, &mut routes, target, src, src_off, dst_off, imm)
    }

    fn push_zero_write(
        &mut self,
        slot: u32,
        wr: WrId,
        lane: usize,
        target: Target<'_>,
        imm: Imm,
    ) -> Result<(), EngineError> {
        let tid = self.slab[slot as usize].id;
        // A zero-length local slice of a registration made on *this* lane.
        let local = self.zero_slice(lane)?;
        let route = self.route(&mut Routes::default(), tid, lane, None, target)?;
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
        self.push_op(slot, lane, Op::Write(w));
        Ok(())
    }

    fn zero_slice(&mut self, lane: usize) -> Result<LocalSlice, EngineError> {
        self.zero_mrs
            .get(lane)
            .and_then(|mr| mr.slice(0, 0))
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("no NIC {lane}"),
            })
    }

    fn check_peer_group(&self, peers: u32, n: usize) -> Result<(), EngineError> {
        let g =
            self.peer_groups
                .get(peers as usize)
                .ok_or_else(|| EngineError::InvalidArgument {
                    what: format!("unknown peer group {peers}"),
                })?;
        if g.members.len() != n {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "peer group {peers} has {} members, got {n} destinations",
                    g.members.len()
                ),
            });
        }
        Ok(())
    }

    fn plan_send(
        &mut self,
        slot: u32,
        wr: WrId,
        peer: NetAddr,
        payload: SendPayload,
    ) -> Result<(), EngineError> {
        let tid = self.slab[slot as usize].id;
        let group = self.group;
        let pid = self
            .resolve(0, &peer)
            .map_err(|e| transport(group, 0, tid, Some(peer.clone()), e));
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
        self.push_op(slot, 0, Op::Send { wr, peer: pid, src });
        Ok(())
    }

    // ---------------------------------------------------------------- posting

    /// Posts more WRs of pending requests as room frees (priority 2).
    pub(crate) fn post_backlog(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.nics.len() {
            if !self.nics[i].backlog.is_empty() {
                any |= self.post_ring(i, false);
            }
        }
        any
    }

    fn ring(&mut self, nic: usize, fresh: bool) -> &mut VecDeque<Op> {
        let n = &mut self.nics[nic];
        if fresh {
            &mut n.fresh
        } else {
            &mut n.backlog
        }
    }

    /// Posts from one ring of one NIC while there is room. Returns whether
    /// anything was posted or resolved.
    fn post_ring(&mut self, nic: usize, fresh: bool) -> bool {
        let mut progressed = false;
        loop {
            if let Some(e) = self.nics[nic].dead.clone() {
                // Everything queued on a dead NIC fails.
                while let Some(op) = self.ring(nic, fresh).pop_front() {
                    self.unposted_failed(nic, op, e.clone());
                }
                return true;
            }
            let n = &self.nics[nic];
            let room = n.caps.max_inflight.saturating_sub(n.inflight);
            if room == 0 {
                return progressed;
            }
            // Skip (and resolve) pieces of transfers that already failed.
            let Some(front) = self.ring(nic, fresh).front().copied() else {
                return progressed;
            };
            if self.transfer_failed(front.wr()) {
                self.ring(nic, fresh).pop_front();
                self.skip_piece(front.wr());
                progressed = true;
                continue;
            }
            match front {
                Op::Send { wr, peer, src } => {
                    self.ring(nic, fresh).pop_front();
                    match self.nics[nic].domain.post_send(wr, peer, src) {
                        Ok(()) => {
                            self.posted(nic, wr);
                            progressed = true;
                        }
                        Err(e) if e.is_retryable() => {
                            self.ring(nic, fresh).push_front(front);
                            return progressed;
                        }
                        Err(e) => {
                            self.post_failed(nic, wr, Some(peer), e);
                            progressed = true;
                        }
                    }
                }
                Op::Write(_) => {
                    let max = room.min(self.nics[nic].caps.max_batch);
                    self.scratch.clear();
                    while self.scratch.len() < max {
                        let Some(Op::Write(w)) = self.ring(nic, fresh).front().copied() else {
                            break;
                        };
                        if self.transfer_failed(w.wr) {
                            self.ring(nic, fresh).pop_front();
                            self.skip_piece(w.wr);
                            continue;
                        }
                        self.scratch.push(w);
                        self.ring(nic, fresh).pop_front();
                    }
                    if self.scratch.is_empty() {
                        continue;
                    }
                    let batch = std::mem::take(&mut self.scratch);
                    let (accepted, err) = match self.nics[nic].domain.post_writes(&batch) {
                        Ok(k) => (k.min(batch.len()), None),
                        Err(PostError { posted, error }) => (posted.min(batch.len()), Some(error)),
                    };
                    for w in &batch[..accepted] {
                        self.posted(nic, w.wr);
                    }
                    progressed |= accepted > 0;
                    let mut rest = accepted;
                    let mut stop = accepted < batch.len() && err.is_none();
                    let mut died = None;
                    if let Some(e) = err {
                        if e.is_retryable() {
                            stop = true;
                        } else if let Some(w) = batch.get(accepted) {
                            let fatal = matches!(e, TransportError::NicDown { .. });
                            self.post_failed(nic, w.wr, Some(w.peer), e.clone());
                            rest += 1;
                            progressed = true;
                            if fatal {
                                died = Some(e);
                            }
                        }
                    }
                    // Put back what was not taken, in order, at the front.
                    for w in batch[rest.min(batch.len())..].iter().rev() {
                        self.ring(nic, fresh).push_front(Op::Write(*w));
                    }
                    self.scratch = batch;
                    if let Some(e) = died {
                        // Resolve what is already posted on this NIC too:
                        // `poll` skips dead NICs, so nothing else would.
                        tracing::error!(group = self.group, nic, error = %e, "NIC down on post");
                        self.nic_died(nic, e);
                    }
                    if stop {
                        return progressed;
                    }
                }
            }
        }
    }

    fn transfer_failed(&self, wr: WrId) -> bool {
        match decode(wr) {
            Decoded::Transfer { slot, .. } => self
                .slab
                .get(slot as usize)
                .is_some_and(|t| t.error.is_some()),
            _ => false,
        }
    }

    fn lookup(&mut self, wr: WrId) -> Option<u32> {
        match decode(wr) {
            Decoded::Transfer { slot, gen } => {
                let t = self.slab.get(slot as usize)?;
                (t.live && t.gen == gen).then_some(slot)
            }
            _ => None,
        }
    }

    fn posted(&mut self, nic: usize, wr: WrId) {
        self.nics[nic].inflight += 1;
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        if let Some(slot) = self.lookup(wr) {
            let t = &mut self.slab[slot as usize];
            t.posted_on[nic] += 1;
            t.unposted = t.unposted.saturating_sub(1);
            #[cfg(feature = "latency-probe")]
            {
                t.probe.posted(t.unposted == 0);
                if t.unposted == 0 {
                    self.probes.push(t.probe);
                }
            }
        }
    }

    /// A piece never reached the backend (failed transfer): resolve it.
    fn skip_piece(&mut self, wr: WrId) {
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        if let Some(slot) = self.lookup(wr) {
            let t = &mut self.slab[slot as usize];
            t.unposted = t.unposted.saturating_sub(1);
            t.remaining = t.remaining.saturating_sub(1);
            self.maybe_finish(slot);
        }
    }

    fn unposted_failed(&mut self, nic: usize, op: Op, e: TransportError) {
        let peer = match op {
            Op::Write(w) => Some(w.peer),
            Op::Send { peer, .. } => Some(peer),
        };
        self.post_failed(nic, op.wr(), peer, e);
    }

    /// The backend rejected a WR at post time.
    fn post_failed(&mut self, nic: usize, wr: WrId, peer: Option<PeerId>, e: TransportError) {
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        let Some(slot) = self.lookup(wr) else { return };
        let addr = peer.and_then(|p| self.nics[nic].peer_addrs.get(&p).cloned());
        let t = &mut self.slab[slot as usize];
        t.unposted = t.unposted.saturating_sub(1);
        t.remaining = t.remaining.saturating_sub(1);
        if t.error.is_none() {
            t.error = Some(transport(self.group, nic, t.id, addr, e));
        }
        self.maybe_finish(slot);
    }

    fn fail_transfer(&mut self, slot: u32, e: EngineError) {
        if let Some(t) = self.slab.get_mut(slot as usize) {
            if t.error.is_none() {
                t.error = Some(e);
            }
        }
    }

    /// Resolves a transfer whose pieces have all completed.
    fn maybe_finish(&mut self, slot: u32) {
        let Some(t) = self.slab.get_mut(slot as usize) else {
            return;
        };
        if !t.live || t.remaining != 0 {
            return;
        }
        // Pieces never planned because planning failed part-way may still
        // sit in `fresh`/`backlog`; they are skipped when reached, and they
        // hold `remaining` up, so we only get here when all are accounted.
        t.live = false;
        let result = match t.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        let on_done = t.on_done.take();
        let send = t.send.take();
        self.free.push(slot);
        if let Some(res) = send {
            if let Some(s) = res.slot {
                let _ = self.send_pool.free.push(s);
            }
            if let Some((buf, key)) = res.owned {
                let _ = self.nics[0].domain.deregister(key);
                drop(buf);
            }
        }
        if let Some(od) = on_done {
            if let Some((cb, r)) = od.resolve_inline(result) {
                self.events.push(Event::Done(cb, r));
            }
        }
    }

    // ---------------------------------------------------------------- polling

    /// Polls every domain's completion queue (priority 3). Returns how many
    /// completions were handled.
    pub(crate) fn poll(&mut self) -> usize {
        let mut handled = 0;
        for nic in 0..self.nics.len() {
            if self.nics[nic].dead.is_some() {
                continue;
            }
            let mut comps = std::mem::take(&mut self.comps);
            comps.clear();
            let r = self.nics[nic].domain.poll(&mut comps);
            handled += comps.len();
            for c in comps.drain(..) {
                self.on_completion(nic, c);
            }
            self.comps = comps;
            if let Err(e) = r {
                tracing::error!(group = self.group, nic, error = %e, "domain failed");
                self.nic_died(nic, e);
                handled += 1;
            }
        }
        handled
    }

    fn on_completion(&mut self, nic: usize, c: Completion) {
        match c {
            Completion::Write { wr, result } | Completion::Send { wr, result } => {
                self.nics[nic].inflight = self.nics[nic].inflight.saturating_sub(1);
                let Some(slot) = self.lookup(wr) else {
                    tracing::warn!(group = self.group, nic, ?wr, "completion for unknown WR");
                    return;
                };
                let group = self.group;
                let t = &mut self.slab[slot as usize];
                t.posted_on[nic] = t.posted_on[nic].saturating_sub(1);
                t.remaining = t.remaining.saturating_sub(1);
                if let Err(e) = result {
                    if t.error.is_none() {
                        let peer = peer_of(&e);
                        t.error = Some(transport(group, nic, t.id, peer, e));
                    }
                }
                self.maybe_finish(slot);
            }
            Completion::Recv { wr, result } => {
                let Decoded::Recv { pool, idx } = decode(wr) else {
                    tracing::warn!(
                        group = self.group,
                        nic,
                        ?wr,
                        "receive completion for unknown WR"
                    );
                    return;
                };
                let n = &mut self.nics[nic];
                n.recvs_posted = n.recvs_posted.saturating_sub(1);
                // A freed receive slot: post a waiting buffer.
                if let Some(next) = self
                    .pools
                    .values_mut()
                    .find_map(|p| p.waiting.pop_front().map(|i| (p.pool.id, i)))
                {
                    self.repost(next.0, next.1);
                }
                let Some(ps) = self.pools.get(&pool) else {
                    return;
                };
                let group = self.group;
                let result = result.map_err(|e| EngineError::Control {
                    group,
                    nic,
                    op: "receive",
                    source: Box::new(e),
                });
                if matches!(
                    result.as_ref().err().and_then(EngineError::transport),
                    Some(TransportError::Canceled { .. })
                ) {
                    // Flushed at close: not an event.
                    return;
                }
                self.events.push(Event::Recv {
                    pool: Arc::clone(&ps.pool),
                    idx,
                    result,
                });
            }
            Completion::Imm { imm } => {
                if let Some((cb, r)) = self.imms.arrive(imm).and_then(|d| d.resolve(Ok(()))) {
                    self.events.push(Event::Done(cb, r));
                }
            }
        }
    }

    fn nic_died(&mut self, nic: usize, e: TransportError) {
        self.nics[nic].dead = Some(e.clone());
        self.nics[nic].inflight = 0;
        // Fail every posted piece on that NIC.
        for slot in 0..self.slab.len() {
            let t = &mut self.slab[slot];
            if !t.live || t.posted_on[nic] == 0 {
                continue;
            }
            let k = u64::from(t.posted_on[nic]);
            t.posted_on[nic] = 0;
            t.remaining = t.remaining.saturating_sub(k);
            if t.error.is_none() {
                t.error = Some(EngineError::NicDown {
                    group: self.group,
                    nic,
                    source: Box::new(e.clone()),
                });
            }
            self.maybe_finish(slot as u32);
        }
        // And everything still queued on it.
        self.post_ring(nic, false);
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
                self.skip_piece(op.wr());
            }
        }
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
        if let Some((cb, r)) = req.on_done.resolve_inline(Err(e)) {
            self.events.push(Event::Done(cb, r));
        }
    }

    /// Deregisters everything and closes the domains.
    pub(crate) fn close(mut self) {
        for (_, ps) in std::mem::take(&mut self.pools) {
            let _ = self.nics[0].domain.deregister(ps.mr.key);
        }
        for id in 0..self.mrs.len() {
            if let Some(e) = self.mrs[id].take() {
                for (i, mr) in e.lanes.iter().enumerate() {
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

fn peer_of(e: &TransportError) -> Option<NetAddr> {
    match e {
        TransportError::PeerUnreachable { peer, .. }
        | TransportError::RemoteAccess { peer, .. }
        | TransportError::ReceiverNotReady { peer, .. }
        | TransportError::MessageTooLong { peer, .. } => Some(peer.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(b: u8) -> NetAddr {
        NetAddr(vec![b, b])
    }

    /// One id per distinct address, stable, and back to the address; a
    /// plain destination keeps every lane's rkey and address in order.
    #[test]
    fn addr_book_interns_descriptor_addresses() {
        let book = AddrBook::default();
        let (a, b) = (book.id(&addr(1)), book.id(&addr(2)));
        assert_ne!(a, b);
        assert_eq!(book.id(&addr(1)), a);
        assert_eq!(book.addr(a), Some(addr(1)));
        assert_eq!(book.addr(b), Some(addr(2)));
        assert_eq!(book.addr(99), None);
        let d = desc(&[2, 3, 1]);
        let p = PlainDst::new(&d, &book).expect("3 lanes fit");
        assert_eq!(
            (p.keys.base, p.keys.region_len, p.keys.lanes),
            (d.addr, d.len, 3)
        );
        for (lane, (na, rk)) in d.rkeys.iter().enumerate() {
            assert_eq!(p.keys.rkeys[lane], *rk);
            assert_eq!(book.addr(p.addrs[lane]).as_ref(), Some(na));
        }
        assert_eq!(p.addrs[2], a, "a known address keeps its id");
        let wide: Vec<u8> = (0..=MAX_NICS as u8).collect();
        assert!(PlainDst::new(&desc(&wide), &book).is_none());
    }

    fn desc(addrs: &[u8]) -> MrDesc {
        MrDesc {
            addr: 0x1000,
            len: 64,
            rkeys: addrs
                .iter()
                .map(|&b| (addr(b), Rkey(u64::from(b) + 100)))
                .collect(),
        }
    }

    #[test]
    fn routed_dst_only_when_every_lane_matches() {
        let member = GroupAddress {
            nics: vec![addr(1), addr(2)],
        };
        let r = RoutedDst::matched(&member, &desc(&[1, 2]), 8, 1, 2).expect("matches");
        assert_eq!((r.len, r.src_offset, r.dst_offset), (8, 1, 2));
        assert_eq!(
            (r.keys.base, r.keys.region_len, r.keys.lanes),
            (0x1000, 64, 2)
        );
        assert_eq!(&r.keys.rkeys[..2], &[Rkey(101), Rkey(102)]);
        // Another member's NICs, lanes swapped, one lane different, more
        // rkeys than the member has NICs: resolved by address instead.
        for d in [&[3, 4][..], &[2, 1], &[1, 3], &[1, 2, 3]] {
            assert!(
                RoutedDst::matched(&member, &desc(d), 8, 0, 0).is_none(),
                "{d:?}"
            );
        }
        let many = GroupAddress {
            nics: (0..=MAX_NICS as u8).map(addr).collect(),
        };
        let all: Vec<u8> = (0..=MAX_NICS as u8).collect();
        assert!(RoutedDst::matched(&many, &desc(&all), 8, 0, 0).is_none());
    }
}
