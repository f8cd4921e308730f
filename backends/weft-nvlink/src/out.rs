//! The initiator's side of one connection: operations waiting for ring
//! space (`backlog`), operations waiting for the target's answer
//! (`awaiting`) and one-sided copies into the target's mapped memory
//! (`copies`). No socket calls: the domain does the hand-shake and the
//! liveness checks and hands this type the rings.

use crate::keys::RemoteKeys;
use crate::proto::{self, Status};
use crate::ring::{Ring, RingError};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use weft_transport::{Completion, CopyTicket, Device, PeerMemory, TransportError, WrId};

/// Largest payload of one frame.
pub(crate) const CHUNK: usize = 256 << 10;

/// Where an operation's bytes come from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Src {
    pub(crate) addr: u64,
    pub(crate) dev: Device,
    pub(crate) len: u64,
}

#[derive(Debug)]
enum Kind {
    Write {
        rkey: u64,
        addr: u64,
        imm: Option<u32>,
    },
    Send,
    Landed {
        imm: u32,
    },
}

#[derive(Debug)]
struct Op {
    op: u64,
    wr: WrId,
    src: Src,
    kind: Kind,
    /// Bytes already in the ring.
    at: u64,
}

/// What a WRITE post decided.
pub(crate) enum Posted {
    /// Queued (staged through the ring or copied one-sidedly).
    Queued,
    /// Refused by the target's published table; complete it with this.
    Refused(Status),
}

/// One outbound connection's protocol state (see the module docs).
pub(crate) struct Outbound {
    pub(crate) tx: Ring,
    pub(crate) rx: Ring,
    /// The target's published table, once its answer arrived.
    pub(crate) keys: Option<RemoteKeys>,
    /// The target's pid, once known (the same pid: no import needed).
    pub(crate) target_pid: Option<u32>,
    backlog: VecDeque<Op>,
    awaiting: BTreeMap<u64, (WrId, bool)>,
    copies: VecDeque<(CopyTicket, WrId, Option<u32>)>,
    next_op: u64,
    scratch: Vec<u8>,
    /// One-sided writes that fell back to the ring (an import failed).
    pub(crate) staged_fallbacks: u64,
}

impl Outbound {
    pub(crate) fn new(tx: Ring, rx: Ring) -> Outbound {
        Outbound {
            tx,
            rx,
            keys: None,
            target_pid: None,
            backlog: VecDeque::new(),
            awaiting: BTreeMap::new(),
            copies: VecDeque::new(),
            next_op: 1,
            scratch: Vec::new(),
            staged_fallbacks: 0,
        }
    }

    fn queue(&mut self, wr: WrId, src: Src, kind: Kind) {
        let op = self.next_op;
        self.next_op += 1;
        self.backlog.push_back(Op {
            op,
            wr,
            src,
            kind,
            at: 0,
        });
    }

    /// Queues a SEND.
    pub(crate) fn send(&mut self, wr: WrId, src: Src) {
        self.queue(wr, src, Kind::Send);
    }

    /// Queues a WRITE: one-sided when the target published the region and
    /// `pm` can reach it, else staged through the ring (the target checks
    /// and copies).
    pub(crate) fn write(
        &mut self,
        wr: WrId,
        src: Src,
        rkey: u64,
        addr: u64,
        imm: Option<u32>,
        pm: Option<&Arc<dyn PeerMemory>>,
    ) -> Result<Posted, TransportError> {
        let entry = match (&self.keys, pm) {
            (Some(k), Some(_)) if src.len > 0 => k.lookup(rkey),
            _ => None,
        };
        let (Some(e), Some(pm), Some(token)) = (entry, pm, self.token()) else {
            self.queue(wr, src, Kind::Write { rkey, addr, imm });
            return Ok(Posted::Queued);
        };
        if !e.writable {
            return Ok(Posted::Refused(Status::RemoteAccess(
                weft_transport::RemoteAccessReason::NotWritable,
            )));
        }
        let inside = addr >= e.base
            && addr
                .checked_add(src.len)
                .is_some_and(|end| end <= e.base.saturating_add(e.len));
        if !inside {
            return Ok(Posted::Refused(Status::RemoteAccess(
                weft_transport::RemoteAccessReason::OutOfBounds,
            )));
        }
        let mapped = if self.target_pid == Some(std::process::id()) {
            Ok(e.base)
        } else {
            pm.import(token, &e.desc)
        };
        match mapped {
            Ok(base) => {
                let t = pm.start_copy(token, base + (addr - e.base), src.addr, src.dev, src.len)?;
                self.copies.push_back((t, wr, imm));
            }
            Err(err) => {
                if self.staged_fallbacks == 0 {
                    tracing::warn!(%err, "nvlink: cannot map the peer's memory; writes to it go through the ring");
                }
                self.staged_fallbacks += 1;
                self.queue(wr, src, Kind::Write { rkey, addr, imm });
            }
        }
        Ok(Posted::Queued)
    }

    /// The token the target's imports are cached under (its pid), once
    /// it answered.
    ///
    /// Imports and copy lanes are per target process: every lane of this
    /// process to it shares one mapping per allocation (a legacy IPC handle
    /// opens once per process) and one stream. So do targets in this
    /// process: a stream per connection would multiply the streams a
    /// process holds past the GPU's hardware queues, and a copy queued
    /// behind a kernel that spins on a flag (MoE's receive kernels) in the
    /// same hardware queue never runs.
    pub(crate) fn token(&self) -> Option<u64> {
        self.target_pid.map(u64::from)
    }

    /// Whether bytes still wait for ring space or a copy: only polling
    /// moves them (answers, by contrast, ring the doorbell).
    pub(crate) fn moving(&self) -> bool {
        !self.backlog.is_empty() || !self.copies.is_empty()
    }

    /// Finished one-sided copies (and their immediates queued), target
    /// answers read, ring filled from the backlog. `Ok(true)` when the
    /// target should be woken. Answers become completions through
    /// `status`, which names the peer.
    pub(crate) fn progress(
        &mut self,
        pm: Option<&Arc<dyn PeerMemory>>,
        out: &mut Vec<Completion>,
        status: &dyn Fn(Status) -> Result<(), TransportError>,
    ) -> Result<bool, RingError> {
        if let Some(pm) = pm {
            while let Some(&(t, wr, imm)) = self.copies.front() {
                match pm.copy_done(t) {
                    Ok(false) => break,
                    Ok(true) => {
                        if let Some(imm) = imm {
                            let src = Src {
                                addr: 0,
                                dev: Device::Host,
                                len: 0,
                            };
                            self.queue(WrId(0), src, Kind::Landed { imm });
                        }
                        out.push(Completion::Write { wr, result: Ok(()) });
                    }
                    Err(e) => out.push(Completion::Write { wr, result: Err(e) }),
                }
                self.copies.pop_front();
            }
        }
        while let Some(f) = self.rx.peek()? {
            if f.kind != proto::ACK || proto::need(&f, 3).is_none() {
                return Err(RingError(format!(
                    "frame kind {} on the answer ring",
                    f.kind
                )));
            }
            let (op, word, extra) = (f.u64_at(0), f.u64_at(1), f.u64_at(2));
            self.rx.consume(&f);
            let st = Status::decode(word, extra)
                .ok_or_else(|| RingError(format!("status word {word:#x}")))?;
            match self.awaiting.remove(&op) {
                Some((wr, true)) => out.push(Completion::Send {
                    wr,
                    result: status(st),
                }),
                Some((wr, false)) => out.push(Completion::Write {
                    wr,
                    result: status(st),
                }),
                None => {
                    tracing::warn!(op, "nvlink: answer for an operation not in flight; ignored")
                }
            }
        }
        self.pump(pm)
    }

    /// Moves backlog into the ring; `Ok(true)` when frames were added and
    /// the target asked for a doorbell.
    fn pump(&mut self, pm: Option<&Arc<dyn PeerMemory>>) -> Result<bool, RingError> {
        let mut pushed = false;
        while let Some(op) = self.backlog.front_mut() {
            let hdr;
            let kind;
            let n;
            match op.kind {
                Kind::Landed { imm } => {
                    kind = proto::LANDED;
                    hdr = proto::words([op.op, imm as u64]);
                    n = 0;
                }
                Kind::Write { rkey, addr, imm } => {
                    kind = proto::WRITE;
                    n = (op.src.len - op.at).min(CHUNK as u64) as usize;
                    let last = op.at + n as u64 == op.src.len;
                    let flags = imm.map_or(0, |_| proto::F_IMM)
                        | if last { proto::F_LAST } else { 0 }
                        | (imm.unwrap_or(0) as u64) << 32;
                    hdr = proto::words([op.op, rkey, addr, op.src.len, op.at, flags]);
                }
                Kind::Send => {
                    kind = proto::SEND;
                    n = (op.src.len - op.at).min(CHUNK as u64) as usize;
                    let last = op.at + n as u64 == op.src.len;
                    let at = op.at | if last { proto::LAST_BIT } else { 0 };
                    hdr = proto::words([op.op, op.src.len, at]);
                }
            }
            let from = op.src.addr + op.at;
            let staged = op.src.dev != Device::Host && n > 0;
            if staged {
                let pm = pm.ok_or_else(|| RingError("device memory without a copier".into()))?;
                self.scratch.resize(n, 0);
                pm.copy(
                    self.scratch.as_mut_ptr() as u64,
                    Device::Host,
                    from,
                    op.src.dev,
                    n as u64,
                )
                .map_err(|e| RingError(format!("staging device bytes: {e}")))?;
            }
            let scratch = self.scratch.as_ptr();
            let ok = self.tx.push(kind, &hdr, n, |p| {
                let s = if staged { scratch } else { from as *const u8 };
                // SAFETY: `s` is `n` readable bytes (registered local memory,
                // checked at post, or the scratch copy) and `p` is the
                // frame's `n` payload bytes.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(s, p, n)
                };
            });
            if !ok {
                break;
            }
            pushed = true;
            op.at += n as u64;
            if op.at == op.src.len {
                let op = self.backlog.pop_front().expect("front exists");
                match op.kind {
                    Kind::Write { .. } => {
                        self.awaiting.insert(op.op, (op.wr, false));
                    }
                    Kind::Send => {
                        self.awaiting.insert(op.op, (op.wr, true));
                    }
                    Kind::Landed { .. } => {}
                }
            }
        }
        Ok(pushed && self.tx.wants_bell())
    }

    /// Everything not yet answered fails with `err`; one-sided copies are
    /// waited for first (their bytes may be landing) and complete as they
    /// finished.
    pub(crate) fn fail_all(
        &mut self,
        pm: Option<&Arc<dyn PeerMemory>>,
        err: &TransportError,
        out: &mut Vec<Completion>,
    ) {
        if let Some(pm) = pm {
            for (t, wr, _) in self.copies.drain(..) {
                let result = loop {
                    match pm.copy_done(t) {
                        Ok(true) => break Ok(()),
                        Ok(false) => std::thread::yield_now(),
                        Err(e) => break Err(e),
                    }
                };
                out.push(Completion::Write { wr, result });
            }
        }
        for op in self.backlog.drain(..) {
            match op.kind {
                Kind::Write { .. } => out.push(Completion::Write {
                    wr: op.wr,
                    result: Err(err.clone()),
                }),
                Kind::Send => out.push(Completion::Send {
                    wr: op.wr,
                    result: Err(err.clone()),
                }),
                Kind::Landed { .. } => {}
            }
        }
        for (_, (wr, send)) in std::mem::take(&mut self.awaiting) {
            out.push(if send {
                Completion::Send {
                    wr,
                    result: Err(err.clone()),
                }
            } else {
                Completion::Write {
                    wr,
                    result: Err(err.clone()),
                }
            });
        }
    }
}
