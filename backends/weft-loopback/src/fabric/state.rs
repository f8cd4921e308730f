//! The shared simulated fabric: hosts, NICs, registered memory (keys),
//! posted receive buffers, completion queues, and NIC faults. [`State`] is
//! the one struct behind the fabric's mutex; its event handling, posting and
//! delivery live in the sibling modules.

use super::events::EventQueue;
use super::op::{Op, Phase};
use super::{nic_name, unknown_nic, Loc};
use crate::config::{FabricConfig, NicModel};
use crate::rules::Rule;
use crate::trace::{FabricStats, TraceEvent, TraceKind};
use crate::{addr, HostId, SimTime};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use weft_transport::{
    Access, Completion, Device, DeviceCopy, LocalMr, LocalSlice, MemRegion, MrKey,
    RemoteAccessReason, Rkey, TransportError, WrId,
};

/// Rkeys are the local key XOR this salt, so an lkey passed as an rkey (or
/// the reverse) is rejected.
const RKEY_SALT: u64 = 0x1f00_d5ee_d000_0000;

/// Where virtual registrations start (never dereferenced).
const VIRTUAL_BASE: u64 = 1 << 52;
/// Alignment of virtual registrations.
const VIRTUAL_ALIGN: u64 = 4096;

fn span_within(base: u64, base_len: u64, a: u64, len: u64) -> bool {
    match (a.checked_add(len), base.checked_add(base_len)) {
        (Some(end), Some(base_end)) => a >= base && end <= base_end,
        _ => false,
    }
}

pub(super) struct RuleState {
    pub(super) rule: Rule,
    pub(super) hits: u64,
}

pub(super) struct HostState {
    pub(super) nics: Vec<NicState>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Reg {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) device: Device,
    pub(super) access: Access,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct PostedRecv {
    pub(super) wr: WrId,
    pub(super) key: u64,
    pub(super) addr: u64,
    pub(super) len: u64,
}

pub(crate) struct NicState {
    pub(super) alive: bool,
    pub(super) open: bool,
    pub(super) model: NicModel,
    pub(super) regs: BTreeMap<u64, Reg>,
    pub(super) recvs: Vec<PostedRecv>,
    pub(super) rnr_wait: VecDeque<u64>,
    pub(super) cq: Vec<Completion>,
    pub(super) inflight: usize,
    pub(super) tx_free: u64,
    pub(super) rx_free: u64,
    /// In [`State::ready`] since the last [`crate::Fabric::take_ready`].
    pub(super) notified: bool,
}

impl NicState {
    pub(super) fn new(model: NicModel) -> Self {
        Self {
            alive: true,
            open: false,
            model,
            regs: BTreeMap::new(),
            recvs: Vec::new(),
            rnr_wait: VecDeque::new(),
            cq: Vec::new(),
            inflight: 0,
            tx_free: 0,
            rx_free: 0,
            notified: false,
        }
    }
}

pub(crate) struct State {
    pub(super) cfg: FabricConfig,
    pub(super) now: u64,
    pub(super) next_op: u64,
    pub(super) next_key: u64,
    pub(super) rng: ChaCha8Rng,
    pub(super) events: EventQueue,
    pub(super) hosts: Vec<HostState>,
    pub(super) ops: BTreeMap<u64, Op>,
    pub(super) rules: Vec<RuleState>,
    pub(super) trace: Vec<TraceEvent>,
    pub(super) stats: FabricStats,
    pub(super) last_landed: BTreeMap<(Loc, Loc), u64>,
    pub(super) device_copy: Option<Arc<dyn DeviceCopy>>,
    pub(super) shuffle_buf: Vec<u32>,
    /// NICs whose completion queue received something since the last
    /// [`crate::Fabric::take_ready`] (each at most once).
    pub(super) ready: Vec<Loc>,
    /// Next address handed out by [`State::register_virtual`].
    pub(super) next_virtual: u64,
}

impl State {
    pub(super) fn new(cfg: FabricConfig) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            device_copy: cfg.device_copy.clone(),
            cfg,
            now: 0,
            next_op: 0,
            next_key: 1,
            events: EventQueue::default(),
            hosts: Vec::new(),
            ops: BTreeMap::new(),
            rules: Vec::new(),
            trace: Vec::new(),
            stats: FabricStats::default(),
            last_landed: BTreeMap::new(),
            shuffle_buf: Vec::new(),
            ready: Vec::new(),
            next_virtual: VIRTUAL_BASE,
        }
    }

    /// Notes that `loc`'s completion queue has something to poll.
    pub(super) fn mark_ready(&mut self, loc: Loc) {
        if let Some(n) = self.nic_mut(loc) {
            if !n.notified {
                n.notified = true;
                self.ready.push(loc);
            }
        }
    }

    /// Hands out the NICs noted by [`State::mark_ready`], in the order they
    /// were noted, and clears the notes.
    pub(crate) fn take_ready(&mut self, out: &mut Vec<Loc>) {
        let ready = std::mem::take(&mut self.ready);
        for &loc in &ready {
            if let Some(n) = self.nic_mut(loc) {
                n.notified = false;
            }
        }
        out.extend(ready);
    }

    /// Whether payload bytes are copied (not in null or timing-only mode).
    pub(super) fn copies(&self) -> bool {
        !self.cfg.null && !self.cfg.timing_only
    }

    // --- lookup helpers ---------------------------------------------------

    pub(super) fn loc(&self, host: HostId, nic: usize) -> Result<Loc, TransportError> {
        let h = self
            .hosts
            .get(host.0 as usize)
            .ok_or_else(|| unknown_nic(host, nic))?;
        if nic >= h.nics.len() {
            return Err(unknown_nic(host, nic));
        }
        let n = u32::try_from(nic).map_err(|_| unknown_nic(host, nic))?;
        Ok((host.0, n))
    }

    pub(crate) fn nic_mut(&mut self, loc: Loc) -> Option<&mut NicState> {
        self.hosts
            .get_mut(loc.0 as usize)?
            .nics
            .get_mut(loc.1 as usize)
    }

    pub(super) fn nic(&self, loc: Loc) -> Option<&NicState> {
        self.hosts.get(loc.0 as usize)?.nics.get(loc.1 as usize)
    }

    pub(super) fn model(&self, loc: Loc) -> NicModel {
        self.nic(loc).map_or(self.cfg.nic, |n| n.model)
    }

    /// Whether operations can land on `loc` now.
    pub(super) fn reachable(&self, loc: Loc) -> bool {
        self.nic(loc).is_some_and(|n| n.alive && n.open)
    }

    pub(crate) fn capabilities(&self, device_memory: bool) -> weft_transport::Capabilities {
        weft_transport::Capabilities {
            // Every call into the fabric, from any host, moves it forward.
            software_progress: false,
            max_write_len: self.cfg.max_write_len,
            max_send_len: self.cfg.max_send_len,
            max_inflight: self.cfg.max_inflight,
            max_recvs: self.cfg.max_recvs,
            max_batch: self.cfg.max_batch.max(1),
            ordered: false,
            device_memory,
        }
    }

    pub(super) fn record(&mut self, what: TraceKind) {
        if self.cfg.trace {
            self.trace.push(TraceEvent {
                at: SimTime(self.now),
                what,
            });
        }
    }

    // --- memory -----------------------------------------------------------

    pub(crate) fn register(
        &mut self,
        loc: Loc,
        region: &MemRegion,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        let cuda = region.device() != Device::Host;
        let has_dc = self.device_copy.is_some();
        let key = self.next_key;
        let Some(n) = self.nic_mut(loc).filter(|n| n.alive) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if cuda && !has_dc {
            return Err(TransportError::Unsupported {
                nic: nic_name(loc),
                what: format!(
                    "registering {} memory needs a DeviceCopy (FabricConfig::device_copy or Fabric::set_device_copy)",
                    region.device()
                ),
            });
        }
        let reg = Reg {
            addr: region.addr(),
            len: region.len() as u64,
            device: region.device(),
            access,
        };
        if reg.addr.checked_add(reg.len).is_none() {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(loc),
                what: "region wraps the address space".into(),
            });
        }
        n.regs.insert(key, reg);
        self.next_key += 1;
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(key ^ RKEY_SALT),
            addr: reg.addr,
            len: reg.len,
            device: reg.device,
        })
    }

    /// A registration of `len` bytes with no memory behind it, at an
    /// address the fabric makes up. Only in timing-only mode, where the
    /// fabric never touches registered memory.
    pub(crate) fn register_virtual(
        &mut self,
        loc: Loc,
        len: u64,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        if !self.cfg.timing_only {
            return Err(TransportError::Unsupported {
                nic: nic_name(loc),
                what: "virtual registrations need a timing-only fabric (FabricConfig::timing_only)"
                    .into(),
            });
        }
        let key = self.next_key;
        let addr = self.next_virtual;
        let end = len
            .checked_add(VIRTUAL_ALIGN - 1)
            .map(|l| l - l % VIRTUAL_ALIGN)
            .and_then(|l| addr.checked_add(l.max(VIRTUAL_ALIGN)))
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: nic_name(loc),
                what: format!("virtual registration of {len} bytes exhausts the address space"),
            })?;
        let Some(n) = self.nic_mut(loc).filter(|n| n.alive) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        n.regs.insert(
            key,
            Reg {
                addr,
                len,
                device: Device::Host,
                access,
            },
        );
        self.next_key += 1;
        self.next_virtual = end;
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(key ^ RKEY_SALT),
            addr,
            len,
            device: Device::Host,
        })
    }

    pub(crate) fn deregister(&mut self, loc: Loc, key: MrKey) -> Result<(), TransportError> {
        let Some(n) = self.nic_mut(loc) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if n.regs.remove(&key.0).is_none() {
            return Err(TransportError::LocalAccess {
                nic: nic_name(loc),
                what: format!("deregister of unknown key {}", key.0),
            });
        }
        // Posted receive buffers in this registration are flushed.
        let alive = n.alive;
        let mut flushed = false;
        let mut i = 0;
        while i < n.recvs.len() {
            if n.recvs[i].key == key.0 {
                let r = n.recvs.remove(i);
                if alive {
                    flushed = true;
                    n.cq.push(Completion::Recv {
                        wr: r.wr,
                        result: Err(TransportError::LocalAccess {
                            nic: nic_name(loc),
                            what: format!("receive buffer's key {} deregistered", key.0),
                        }),
                        from: None,
                    });
                }
            } else {
                i += 1;
            }
        }
        if flushed {
            self.mark_ready(loc);
        }
        Ok(())
    }

    pub(super) fn check_local(
        &self,
        loc: Loc,
        key: u64,
        a: u64,
        len: u64,
    ) -> Result<Device, TransportError> {
        let err = |what: String| TransportError::LocalAccess {
            nic: nic_name(loc),
            what,
        };
        let reg = self
            .nic(loc)
            .and_then(|n| n.regs.get(&key))
            .ok_or_else(|| err(format!("unknown or deregistered key {key}")))?;
        if !span_within(reg.addr, reg.len, a, len) {
            return Err(err(format!(
                "slice [{a:#x}, +{len}) outside registration {key} [{:#x}, +{})",
                reg.addr, reg.len
            )));
        }
        Ok(reg.device)
    }

    pub(super) fn check_remote(
        &self,
        dst: Loc,
        rkey: u64,
        a: Option<u64>,
        len: u64,
    ) -> Result<Device, RemoteAccessReason> {
        let reg = self
            .nic(dst)
            .and_then(|n| n.regs.get(&(rkey ^ RKEY_SALT)))
            .ok_or(RemoteAccessReason::UnknownKey)?;
        if reg.access != Access::RemoteWrite {
            return Err(RemoteAccessReason::NotWritable);
        }
        match a {
            Some(a) if span_within(reg.addr, reg.len, a, len) => Ok(reg.device),
            _ => Err(RemoteAccessReason::OutOfBounds),
        }
    }

    // --- posting ----------------------------------------------------------

    pub(crate) fn check_alive(&self, loc: Loc) -> Result<(), TransportError> {
        if self.nic(loc).is_some_and(|n| n.alive) {
            Ok(())
        } else {
            Err(TransportError::NicDown { nic: nic_name(loc) })
        }
    }

    pub(crate) fn has_room(&self, loc: Loc) -> bool {
        self.nic(loc)
            .is_some_and(|n| n.inflight < self.cfg.max_inflight)
    }

    pub(crate) fn post_recv(
        &mut self,
        loc: Loc,
        wr: WrId,
        buf: LocalSlice,
    ) -> Result<(), TransportError> {
        self.check_local(loc, buf.mr.0, buf.addr, buf.len)?;
        let max = self.cfg.max_recvs;
        let Some(n) = self.nic_mut(loc) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if n.recvs.len() >= max {
            return Err(TransportError::QueueFull { nic: nic_name(loc) });
        }
        n.recvs.push(PostedRecv {
            wr,
            key: buf.mr.0,
            addr: buf.addr,
            len: buf.len,
        });
        self.stats.recvs_posted += 1;
        self.match_waiting(loc);
        Ok(())
    }

    pub(crate) fn drain_cq(
        &mut self,
        loc: Loc,
        out: &mut Vec<Completion>,
    ) -> Result<usize, TransportError> {
        match self.nic_mut(loc) {
            Some(n) if n.alive => {
                let k = n.cq.len();
                // A send-queue slot frees when its completion is polled.
                let sq =
                    n.cq.iter()
                        .filter(|c| matches!(c, Completion::Send { .. } | Completion::Write { .. }))
                        .count();
                n.inflight = n.inflight.saturating_sub(sq);
                out.append(&mut n.cq);
                Ok(k)
            }
            _ => Err(TransportError::NicDown { nic: nic_name(loc) }),
        }
    }

    pub(super) fn unreachable(&self, src: Loc, dst: Loc, why: &str) -> TransportError {
        TransportError::PeerUnreachable {
            nic: nic_name(src),
            peer: addr::encode(dst.0, dst.1),
            reason: why.to_owned(),
        }
    }

    pub(super) fn dst_state(&self, dst: Loc) -> &'static str {
        match self.nic(dst) {
            None => "no such loopback NIC",
            Some(n) if !n.alive => "peer NIC is dead",
            Some(_) => "peer domain is closed",
        }
    }

    // --- faults -----------------------------------------------------------

    pub(crate) fn kill_host(&mut self, host: u32) {
        let n = self.hosts.get(host as usize).map_or(0, |h| h.nics.len());
        for nic in 0..n {
            if let Ok(nic) = u32::try_from(nic) {
                self.nic_down((host, nic), true);
            }
        }
    }

    /// See [`Fabric::revive_host`](crate::Fabric::revive_host).
    pub(crate) fn revive_host(&mut self, host: HostId) -> Result<(), TransportError> {
        let h = self
            .hosts
            .get_mut(host.0 as usize)
            .ok_or_else(|| unknown_nic(host, 0))?;
        if let Some((i, _)) = h.nics.iter().enumerate().find(|(_, n)| n.alive || n.open) {
            return Err(TransportError::InvalidArgument {
                nic: format!("lo/host{}/nic{i}", host.0),
                what: "only a killed host whose domains are all closed can be revived".into(),
            });
        }
        for n in &mut h.nics {
            *n = NicState::new(n.model);
        }
        // In-order delivery state of the old incarnation's pairs.
        self.last_landed
            .retain(|(src, dst), _| src.0 != host.0 && dst.0 != host.0);
        Ok(())
    }

    /// A NIC dies (`killed`) or its domain closes.
    pub(crate) fn nic_down(&mut self, loc: Loc, killed: bool) {
        let Some(n) = self.nic_mut(loc) else { return };
        if killed && !n.alive {
            return;
        }
        if killed {
            n.alive = false;
        } else {
            n.open = false;
            n.regs.clear();
        }
        n.recvs.clear();
        n.rnr_wait.clear();
        n.cq.clear();
        n.inflight = 0;
        self.record(TraceKind::NicDown {
            host: loc.0,
            nic: loc.1,
            killed,
        });
        let affected: Vec<(u64, bool)> = self
            .ops
            .iter()
            .filter(|(_, o)| o.src == loc || (o.dst == loc && matches!(o.phase, Phase::InFlight)))
            .map(|(&id, o)| (id, o.src == loc))
            .collect();
        let why = if killed {
            "peer NIC died"
        } else {
            "peer domain closed"
        };
        for (id, own) in affected {
            if own {
                // The initiator is gone: its work vanishes with it.
                self.ops.remove(&id);
                self.record(TraceKind::Completed {
                    op: id,
                    error: Some("canceled: initiator NIC down".into()),
                });
            } else if let Some(src) = self.ops.get(&id).map(|o| o.src) {
                let e = self.unreachable(src, loc, why);
                self.complete(id, Err(e));
            }
        }
    }
}
