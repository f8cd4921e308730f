//! The bookkeeping every case runs on: posts go through [`Ctx`], which
//! tracks outstanding work requests, checks every completion against them,
//! counts immediates against expectations and verifies payloads at the exact
//! moment an immediate or a write completion is polled.

use crate::harness::{BufId, Harness, HarnessError, HostId};
use crate::pattern::{check_bytes, Rng};
use crate::CaseFailure;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::rc::Rc;
use weft_transport::{
    Access, Capabilities, Completion, Imm, LocalMr, LocalSlice, NetAddr, PeerId, PostError,
    RemoteSlice, TransportError, WrId, WriteWr,
};

/// One NIC of one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Nic {
    pub host: HostId,
    pub index: usize,
}

impl fmt::Display for Nic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/nic{}", self.host, self.index)
    }
}

/// A buffer on a host.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buf {
    pub host: HostId,
    pub id: BufId,
    pub len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Send,
    Recv,
    Write,
}

/// A completion as polled, with the NIC that reported it.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub nic: Nic,
    pub completion: Completion,
}

/// Bytes `data[start..start+len]` that must be in `buf` at `offset` at a
/// given moment.
#[derive(Clone)]
pub(crate) struct Landed {
    pub buf: Buf,
    pub offset: usize,
    pub data: Rc<Vec<u8>>,
    pub start: usize,
    pub len: usize,
}

impl Landed {
    fn want(&self) -> &[u8] {
        self.data
            .get(self.start..self.start + self.len)
            .unwrap_or(&[])
    }
}

pub(crate) struct Ctx<'h> {
    pub h: &'h mut dyn Harness,
    pub rng: Rng,
    live: Vec<Nic>,
    dead: BTreeSet<HostId>,
    caps: BTreeMap<Nic, Capabilities>,
    addrs: BTreeMap<Nic, NetAddr>,
    peers: BTreeMap<(Nic, NetAddr), PeerId>,
    pending: BTreeMap<(Nic, WrId), Kind>,
    done: BTreeMap<(Nic, WrId), Completion>,
    imm_expected: BTreeMap<(Nic, Imm), u64>,
    imm_seen: BTreeMap<(Nic, Imm), u64>,
    at_imm: BTreeMap<(Nic, Imm), Landed>,
    at_write: BTreeMap<(Nic, WrId), Landed>,
    next_wr: u64,
    next_tag: u64,
}

impl<'h> Ctx<'h> {
    pub fn new(h: &'h mut dyn Harness, case: &str) -> Self {
        let mut salt = 0xcbf2_9ce4_8422_2325u64;
        for b in case.bytes() {
            salt = (salt ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        let seed = h.seed();
        Self {
            h,
            rng: Rng::new(seed ^ salt),
            live: Vec::new(),
            dead: BTreeSet::new(),
            caps: BTreeMap::new(),
            addrs: BTreeMap::new(),
            peers: BTreeMap::new(),
            pending: BTreeMap::new(),
            done: BTreeMap::new(),
            imm_expected: BTreeMap::new(),
            imm_seen: BTreeMap::new(),
            at_imm: BTreeMap::new(),
            at_write: BTreeMap::new(),
            next_wr: 1,
            next_tag: (seed ^ salt).rotate_left(17),
        }
    }

    // ---- hosts, memory, registration ----

    /// A new host with `nics` NICs; skips the case if unsupported.
    pub fn host(&mut self, nics: usize) -> Result<HostId, CaseFailure> {
        let id = self.h.add_host(nics).map_err(|e| match e {
            HarnessError::Unsupported(m) => {
                CaseFailure::Skipped(format!("needs a host with {nics} NICs: {m}"))
            }
            other => CaseFailure::Failed(format!("add_host({nics}): {other}")),
        })?;
        for index in 0..nics {
            self.live.push(Nic { host: id, index });
        }
        Ok(id)
    }

    pub fn nic(host: HostId, index: usize) -> Nic {
        Nic { host, index }
    }

    pub fn alloc(&mut self, host: HostId, len: usize) -> Result<Buf, CaseFailure> {
        let id = self
            .h
            .alloc(host, len)
            .map_err(|e| harness_err(format!("alloc({host}, {len})"), e))?;
        Ok(Buf { host, id, len })
    }

    pub fn fill(&mut self, buf: &Buf, offset: usize, data: &[u8]) -> Result<(), CaseFailure> {
        self.h
            .write_mem(buf.host, buf.id, offset, data)
            .map_err(|e| harness_err(format!("write_mem({}, {offset})", buf.host), e))
    }

    pub fn read(&mut self, buf: &Buf, offset: usize, len: usize) -> Result<Vec<u8>, CaseFailure> {
        self.h
            .read_mem(buf.host, buf.id, offset, len)
            .map_err(|e| harness_err(format!("read_mem({}, {offset}, {len})", buf.host), e))
    }

    /// A buffer filled with a fresh pattern; returns it and the pattern.
    pub fn patterned(&mut self, host: HostId, len: usize) -> Result<(Buf, Vec<u8>), CaseFailure> {
        let buf = self.alloc(host, len)?;
        let bytes = self.pattern(len);
        self.fill(&buf, 0, &bytes)?;
        Ok((buf, bytes))
    }

    pub fn register(
        &mut self,
        nic: Nic,
        buf: &Buf,
        range: Range<usize>,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        self.h.register(nic.host, nic.index, buf.id, range, access)
    }

    /// Registers and fails the case on error.
    pub fn reg(
        &mut self,
        nic: Nic,
        buf: &Buf,
        range: Range<usize>,
        access: Access,
    ) -> Result<LocalMr, CaseFailure> {
        let r = range.clone();
        let mr = self
            .register(nic, buf, range, access)
            .map_err(|e| fail_msg(format!("register {r:?} on {nic} ({access:?}) failed: {e}")))?;
        if mr.len != (r.end - r.start) as u64 {
            return Err(fail_msg(format!(
                "register {r:?} on {nic}: LocalMr.len is {}, expected {}",
                mr.len,
                r.end - r.start
            )));
        }
        Ok(mr)
    }

    pub fn deregister(&mut self, nic: Nic, mr: &LocalMr) -> Result<(), CaseFailure> {
        self.h
            .domain(nic.host, nic.index)
            .deregister(mr.key)
            .map_err(|e| fail_msg(format!("deregister {:?} on {nic} failed: {e}", mr.key)))
    }

    // ---- NIC facts ----

    pub fn caps(&mut self, nic: Nic) -> Capabilities {
        if let Some(c) = self.caps.get(&nic) {
            return c.clone();
        }
        let c = self.h.domain(nic.host, nic.index).capabilities().clone();
        self.caps.insert(nic, c.clone());
        c
    }

    pub fn addr(&mut self, nic: Nic) -> NetAddr {
        if let Some(a) = self.addrs.get(&nic) {
            return a.clone();
        }
        let a = self.h.domain(nic.host, nic.index).local_addr().clone();
        self.addrs.insert(nic, a.clone());
        a
    }

    /// The peer handle for `to` on `from` (cached: `add_peer` is idempotent).
    pub fn peer(&mut self, from: Nic, to: Nic) -> Result<PeerId, CaseFailure> {
        let addr = self.addr(to);
        self.peer_addr(from, &addr)
            .map_err(|e| fail_msg(format!("add_peer({to} = {addr}) on {from} failed: {e}")))
    }

    pub fn peer_addr(&mut self, from: Nic, addr: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(p) = self.peers.get(&(from, addr.clone())) {
            return Ok(*p);
        }
        let p = self.h.domain(from.host, from.index).add_peer(addr)?;
        self.peers.insert((from, addr.clone()), p);
        Ok(p)
    }

    /// `remove_peer` of `to`'s handle on `from`; the cached handle is
    /// dropped (the next [`Ctx::peer`] adds the address again). Returns the
    /// removed handle and the domain's answer.
    pub fn remove_peer(
        &mut self,
        from: Nic,
        to: Nic,
    ) -> Result<(PeerId, Result<(), TransportError>), CaseFailure> {
        let p = self.peer(from, to)?;
        let addr = self.addr(to);
        let r = self.h.domain(from.host, from.index).remove_peer(p);
        if r.is_ok() {
            self.peers.remove(&(from, addr));
        }
        Ok((p, r))
    }

    // ---- ids and data ----

    pub fn wr(&mut self) -> WrId {
        let w = WrId(self.next_wr);
        self.next_wr += 1;
        w
    }

    /// A fresh pseudo-random byte pattern (different for every call and seed).
    pub fn pattern(&mut self, len: usize) -> Vec<u8> {
        self.next_tag = self.next_tag.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::pattern::pattern(self.next_tag, len)
    }

    // ---- posting ----

    fn track(&mut self, nic: Nic, wr: WrId, kind: Kind) -> Result<(), CaseFailure> {
        if self.pending.insert((nic, wr), kind).is_some() {
            return Err(fail_msg(format!(
                "conformance suite bug: {wr:?} posted twice on {nic}"
            )));
        }
        self.done.remove(&(nic, wr));
        Ok(())
    }

    pub fn write_wr(
        &mut self,
        from: Nic,
        to: Nic,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<Imm>,
    ) -> Result<WriteWr, CaseFailure> {
        Ok(WriteWr {
            wr: self.wr(),
            peer: self.peer(from, to)?,
            src,
            dst,
            imm,
        })
    }

    pub fn post_write(
        &mut self,
        nic: Nic,
        wr: &WriteWr,
    ) -> Result<Result<(), TransportError>, CaseFailure> {
        let r = self.h.domain(nic.host, nic.index).post_write(wr);
        if r.is_ok() {
            self.track(nic, wr.wr, Kind::Write)?;
        }
        Ok(r)
    }

    /// `post_writes`, tracking the accepted prefix and checking the count.
    pub fn post_writes(
        &mut self,
        nic: Nic,
        wrs: &[WriteWr],
    ) -> Result<Result<usize, PostError>, CaseFailure> {
        let r = self.h.domain(nic.host, nic.index).post_writes(wrs);
        let accepted = match &r {
            Ok(n) => *n,
            Err(e) => e.posted,
        };
        if accepted > wrs.len() {
            return Err(fail_msg(format!(
                "post_writes on {nic} of {} WRs reported {accepted} accepted",
                wrs.len()
            )));
        }
        for w in &wrs[..accepted] {
            self.track(nic, w.wr, Kind::Write)?;
        }
        Ok(r)
    }

    /// Posts all `wrs` in order, in batches, retrying after polling whenever
    /// the queue is full. Any other post error fails the case.
    pub fn submit_writes(&mut self, nic: Nic, wrs: &[WriteWr]) -> Result<(), CaseFailure> {
        let max_batch = self.caps(nic).max_batch.max(1);
        let budget = self.h.wait_budget();
        let mut next = 0;
        let mut stalls = 0u64;
        while next < wrs.len() {
            let end = (next + max_batch).min(wrs.len());
            let n = match self.post_writes(nic, &wrs[next..end])? {
                Ok(n) => n,
                Err(e) if e.error.is_retryable() => e.posted,
                Err(e) => {
                    return Err(fail_msg(format!(
                        "post_writes on {nic}: WR {:?} rejected: {}",
                        wrs[next + e.posted].wr,
                        e.error
                    )))
                }
            };
            next += n;
            if n == 0 {
                stalls += 1;
                if stalls > budget {
                    return Err(fail_msg(format!(
                        "post_writes on {nic} stayed full for {budget} progress rounds ({} WRs pending)",
                        self.pending.len()
                    )));
                }
                self.poll_all()?;
                self.h.progress();
            } else {
                stalls = 0;
            }
        }
        Ok(())
    }

    pub fn post_send(
        &mut self,
        nic: Nic,
        peer: PeerId,
        src: LocalSlice,
    ) -> Result<Result<WrId, TransportError>, CaseFailure> {
        let wr = self.wr();
        let r = self.h.domain(nic.host, nic.index).post_send(wr, peer, src);
        Ok(match r {
            Ok(()) => {
                self.track(nic, wr, Kind::Send)?;
                Ok(wr)
            }
            Err(e) => Err(e),
        })
    }

    /// Posts a SEND and fails the case if the post is rejected.
    pub fn send(&mut self, from: Nic, to: Nic, src: LocalSlice) -> Result<WrId, CaseFailure> {
        let peer = self.peer(from, to)?;
        self.post_send(from, peer, src)?.map_err(|e| {
            fail_msg(format!(
                "post_send {from} -> {to} ({} B) rejected: {e}",
                src.len
            ))
        })
    }

    pub fn post_recv(
        &mut self,
        nic: Nic,
        buf: LocalSlice,
    ) -> Result<Result<WrId, TransportError>, CaseFailure> {
        let wr = self.wr();
        let r = self.h.domain(nic.host, nic.index).post_recv(wr, buf);
        Ok(match r {
            Ok(()) => {
                self.track(nic, wr, Kind::Recv)?;
                Ok(wr)
            }
            Err(e) => Err(e),
        })
    }

    /// Posts a receive buffer and fails the case if the post is rejected.
    pub fn recv(&mut self, nic: Nic, buf: LocalSlice) -> Result<WrId, CaseFailure> {
        self.post_recv(nic, buf)?
            .map_err(|e| fail_msg(format!("post_recv on {nic} ({} B) rejected: {e}", buf.len)))
    }

    // ---- expectations ----

    /// `count` more immediates `imm` are expected at `nic`. Receiving more
    /// than expected (or any value not expected) fails the case at once.
    pub fn expect_imm(&mut self, nic: Nic, imm: Imm, count: u64) {
        *self.imm_expected.entry((nic, imm)).or_insert(0) += count;
    }

    /// When `imm` is polled at `nic`, `landed` must already be in memory.
    pub fn check_at_imm(&mut self, nic: Nic, imm: Imm, landed: Landed) {
        self.at_imm.insert((nic, imm), landed);
    }

    /// When the write `wr` posted on `nic` completes successfully, `landed`
    /// must already be in target memory (delivery-complete).
    pub fn check_at_write_done(&mut self, nic: Nic, wr: WrId, landed: Landed) {
        self.at_write.insert((nic, wr), landed);
    }

    pub fn imms_complete(&self) -> bool {
        self.imm_expected
            .iter()
            .all(|(k, n)| self.imm_seen.get(k).copied().unwrap_or(0) >= *n)
    }

    // ---- polling and waiting ----

    fn verify_landed(&mut self, when: String, l: &Landed) -> Result<(), CaseFailure> {
        let got = self.read(&l.buf, l.offset, l.len)?;
        check_bytes(&when, &got, l.want())
    }

    /// Polls every live domain once, checking each completion.
    pub fn poll_all(&mut self) -> Result<Vec<Event>, CaseFailure> {
        let mut events = Vec::new();
        let nics = self.live.clone();
        for nic in nics {
            let mut out = Vec::new();
            let n = self
                .h
                .domain(nic.host, nic.index)
                .poll(&mut out)
                .map_err(|e| fail_msg(format!("poll on {nic} failed (domain unusable): {e}")))?;
            if n != out.len() {
                return Err(fail_msg(format!(
                    "poll on {nic} returned {n} but appended {} completions",
                    out.len()
                )));
            }
            for c in out {
                self.account(nic, &c)?;
                events.push(Event { nic, completion: c });
            }
        }
        Ok(events)
    }

    fn account(&mut self, nic: Nic, c: &Completion) -> Result<(), CaseFailure> {
        let (wr, kind) = match c {
            Completion::Imm { imm } => {
                let seen = self.imm_seen.entry((nic, *imm)).or_insert(0);
                *seen += 1;
                let seen = *seen;
                let expected = self.imm_expected.get(&(nic, *imm)).copied().unwrap_or(0);
                if seen > expected {
                    return Err(fail_msg(format!(
                        "immediate {imm:#x} reported {seen} times at {nic}, expected {expected} \
                         (duplicate, or an immediate of a failed/unknown write)"
                    )));
                }
                if let Some(l) = self.at_imm.remove(&(nic, *imm)) {
                    self.verify_landed(
                        format!(
                            "payload of the write with immediate {imm:#x} when that immediate was polled at {nic} \
                             ({} B at offset {})",
                            l.len,
                            l.offset
                        ),
                        &l,
                    )?;
                }
                return Ok(());
            }
            Completion::Send { wr, .. } => (*wr, Kind::Send),
            Completion::Recv { wr, .. } => (*wr, Kind::Recv),
            Completion::Write { wr, .. } => (*wr, Kind::Write),
        };
        match self.pending.remove(&(nic, wr)) {
            None => {
                let again = self.done.contains_key(&(nic, wr));
                return Err(fail_msg(format!(
                    "{nic} reported {c:?} for {}",
                    if again {
                        "a WR that already completed (duplicate completion)"
                    } else {
                        "a WR that was never posted there"
                    }
                )));
            }
            Some(k) if k != kind => {
                return Err(fail_msg(format!(
                    "{nic} reported {c:?} for {wr:?}, which was posted as {k:?}"
                )));
            }
            Some(_) => {}
        }
        if let Completion::Write { result: Ok(()), .. } = c {
            if let Some(l) = self.at_write.remove(&(nic, wr)) {
                self.verify_landed(
                    format!(
                        "payload of write {wr:?} when its successful completion was polled at {nic} \
                         (delivery-complete; {} B at offset {})",
                        l.len,
                        l.offset
                    ),
                    &l,
                )?;
            }
        }
        self.done.insert((nic, wr), c.clone());
        Ok(())
    }

    /// Polls and progresses until `cond` holds, at most `wait_budget` rounds.
    /// `cond` sees the events of each poll before any further progress.
    pub fn wait_until(
        &mut self,
        what: &str,
        mut cond: impl FnMut(&mut Self, &[Event]) -> Result<bool, CaseFailure>,
    ) -> Result<(), CaseFailure> {
        if cond(self, &[])? {
            return Ok(());
        }
        let budget = self.h.wait_budget();
        for _ in 0..budget {
            let ev = self.poll_all()?;
            if cond(self, &ev)? {
                return Ok(());
            }
            self.h.progress();
        }
        Err(fail_msg(format!(
            "gave up waiting for {what} after {budget} poll+progress rounds (hang?); {}",
            self.pending_summary()
        )))
    }

    /// Waits until every listed WR has completed.
    pub fn wait_wrs(&mut self, what: &str, wrs: &[(Nic, WrId)]) -> Result<(), CaseFailure> {
        self.wait_until(what, |c, _| Ok(wrs.iter().all(|k| c.done.contains_key(k))))
    }

    /// Waits until every expected immediate has been seen.
    pub fn wait_imms(&mut self, what: &str) -> Result<(), CaseFailure> {
        self.wait_until(what, |c, _| Ok(c.imms_complete()))
    }

    /// The completion of a finished WR.
    pub fn completion(&self, nic: Nic, wr: WrId) -> Option<&Completion> {
        self.done.get(&(nic, wr))
    }

    /// Result of a finished SEND or WRITE.
    pub fn op_result(&self, nic: Nic, wr: WrId) -> Result<Result<(), TransportError>, CaseFailure> {
        match self.done.get(&(nic, wr)) {
            Some(Completion::Write { result, .. }) | Some(Completion::Send { result, .. }) => {
                Ok(result.clone())
            }
            Some(other) => Err(fail_msg(format!("{wr:?} on {nic} completed as {other:?}"))),
            None => Err(fail_msg(format!("{wr:?} on {nic} has not completed"))),
        }
    }

    /// Fails unless the finished SEND/WRITE succeeded.
    pub fn expect_ok(&self, nic: Nic, wr: WrId, what: &str) -> Result<(), CaseFailure> {
        self.op_result(nic, wr)?
            .map_err(|e| fail_msg(format!("{what} ({wr:?} on {nic}) failed: {e}")))
    }

    /// Result of a finished RECV.
    pub fn recv_result(&self, nic: Nic, wr: WrId) -> Option<Result<u64, TransportError>> {
        match self.done.get(&(nic, wr)) {
            Some(Completion::Recv { result, .. }) => Some(result.clone()),
            _ => None,
        }
    }

    pub fn kill(&mut self, host: HostId) -> Result<(), CaseFailure> {
        self.h.kill_host(host).map_err(|e| match e {
            HarnessError::Unsupported(m) => CaseFailure::Skipped(format!("needs kill_host: {m}")),
            other => CaseFailure::Failed(format!("kill_host({host}): {other}")),
        })?;
        self.dead.insert(host);
        self.live.retain(|n| n.host != host);
        Ok(())
    }

    /// Lets everything settle, then polls: any completion of an operation
    /// still tracked is returned (the caller decides), but every WRITE/SEND
    /// must have completed before and every expected immediate must have been
    /// seen exactly; nothing else may show up.
    pub fn quiesce(&mut self) -> Result<(), CaseFailure> {
        self.h.settle();
        for _ in 0..3 {
            let ev = self.poll_all()?;
            if let Some(e) = ev.first() {
                return Err(fail_msg(format!(
                    "after quiescence {} reported an unexpected {:?}",
                    e.nic, e.completion
                )));
            }
            self.h.progress();
        }
        let stuck: Vec<_> = self
            .pending
            .iter()
            .filter(|(_, k)| **k != Kind::Recv)
            .map(|((n, w), k)| format!("{k:?} {w:?} on {n}"))
            .take(8)
            .collect();
        if !stuck.is_empty() {
            return Err(fail_msg(format!(
                "after quiescence these operations never completed: {}",
                stuck.join(", ")
            )));
        }
        for ((nic, imm), want) in &self.imm_expected {
            let got = self.imm_seen.get(&(*nic, *imm)).copied().unwrap_or(0);
            if got != *want {
                return Err(fail_msg(format!(
                    "immediate {imm:#x} at {nic}: seen {got} times, expected exactly {want}"
                )));
            }
        }
        Ok(())
    }

    pub fn pending_summary(&self) -> String {
        let missing: Vec<String> = self
            .imm_expected
            .iter()
            .filter_map(|(k, n)| {
                let s = self.imm_seen.get(k).copied().unwrap_or(0);
                (s < *n).then(|| format!("imm {:#x}@{} {s}/{n}", k.1, k.0))
            })
            .take(6)
            .collect();
        let wrs: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, k)| **k != Kind::Recv)
            .take(6)
            .map(|((n, w), k)| format!("{k:?} {w:?}@{n}"))
            .collect();
        format!(
            "{} WRs outstanding (first non-recv: [{}]); missing immediates: [{}]",
            self.pending.len(),
            wrs.join(", "),
            missing.join(", ")
        )
    }
}

/// A remote slice of a registration at `offset`.
pub(crate) fn remote(mr: &LocalMr, offset: u64) -> RemoteSlice {
    RemoteSlice {
        base: mr.addr,
        offset,
        rkey: mr.rkey,
    }
}

/// A local slice, failing the case if it does not fit.
pub(crate) fn local(mr: &LocalMr, offset: u64, len: u64) -> Result<LocalSlice, CaseFailure> {
    mr.slice(offset, len).ok_or_else(|| {
        fail_msg(format!(
            "conformance suite bug: slice [{offset}, +{len}) outside registration of {} B",
            mr.len
        ))
    })
}

pub(crate) fn fail_msg(m: String) -> CaseFailure {
    CaseFailure::Failed(m)
}

fn harness_err(what: String, e: HarnessError) -> CaseFailure {
    match e {
        HarnessError::Unsupported(m) => CaseFailure::Skipped(format!("{what}: {m}")),
        other => CaseFailure::Failed(format!("{what}: {other}")),
    }
}
