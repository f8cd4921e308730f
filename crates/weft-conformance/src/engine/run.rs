//! One scenario run ([`Run`]): the initiator with its patterned source, the
//! peers, the round results seen so far, and the bounded waits.

use super::{EngineHarness, Kind, Region};
use crate::{CaseFailure, HarnessError};
use std::collections::BTreeMap;
use std::sync::Arc;
use weft_engine::{DoneFlag, EngineError, Imm, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_testkit::mem::patterned;
use weft_transport::{HostBuffer, TransportError};

macro_rules! bail {
    ($($f:tt)+) => {
        return Err(CaseFailure::Failed(format!($($f)+)))
    };
}

macro_rules! ensure {
    ($c:expr, $($f:tt)+) => {
        if !$c {
            bail!($($f)+);
        }
    };
}

pub(super) fn harness(e: HarnessError) -> CaseFailure {
    match e {
        HarnessError::Unsupported(m) => CaseFailure::Skipped(m),
        HarnessError::Failed(m) => CaseFailure::Failed(format!("harness: {m}")),
    }
}

pub(super) fn engine_err(what: &str, e: EngineError) -> CaseFailure {
    CaseFailure::Failed(format!("{what}: {e}"))
}

pub(super) fn is_unreachable(e: &EngineError) -> bool {
    matches!(e, EngineError::Transport { .. })
        && matches!(e.transport(), Some(TransportError::PeerUnreachable { .. }))
}

pub(super) use {bail, ensure};

/// One scenario run: the initiator with its patterned source, the peers,
/// and the round results seen so far.
pub(super) struct Run<'a> {
    pub(super) h: &'a mut dyn EngineHarness,
    pub(super) init: TransferEngine,
    pub(super) smr: MrHandle,
    pub(super) seed: u64,
    pub(super) peers: Vec<usize>,
    pub(super) rounds: BTreeMap<(usize, u64), Vec<Result<(), String>>>,
    pub(super) armed: Vec<(usize, u64)>,
    // Last: outlives the initiator's registration (shut down in `Drop`).
    pub(super) _src: Arc<HostBuffer>,
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        self.init.shutdown();
    }
}

impl<'a> Run<'a> {
    pub(super) fn new(h: &'a mut dyn EngineHarness, src_len: usize) -> Result<Self, CaseFailure> {
        let seed = h.seed().wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed;
        let init = h.initiator().map_err(harness)?;
        let src = Arc::new(patterned(seed, src_len));
        let (smr, _) = init
            .reg_mr(src.region())
            .map_err(|e| engine_err("register the initiator's source", e))?;
        Ok(Self {
            h,
            init,
            smr,
            seed,
            peers: Vec::new(),
            rounds: BTreeMap::new(),
            armed: Vec::new(),
            _src: src,
        })
    }

    /// Adds `n` peers with `buf_len`-byte buffers; checks that their
    /// descriptors carry one rkey per NIC and that fresh engines agree on
    /// their immediate values.
    pub(super) fn add_peers(
        &mut self,
        n: usize,
        buf_len: usize,
    ) -> Result<Vec<usize>, CaseFailure> {
        let mut out = Vec::new();
        for _ in 0..n {
            let p = self.h.add_peer(buf_len).map_err(harness)?;
            let (addr, desc) = (self.h.peer(p).address(), self.h.peer(p).desc());
            ensure!(!addr.nics.is_empty(), "peer {p}: address without NICs");
            ensure!(
                desc.rkeys.len() == addr.nics.len(),
                "peer {p}: descriptor has {} rkeys for {} NICs",
                desc.rkeys.len(),
                addr.nics.len()
            );
            ensure!(
                desc.len as usize == buf_len,
                "peer {p}: descriptor of {} bytes",
                desc.len
            );
            self.peers.push(p);
            out.push(p);
        }
        if let Some(&first) = self.peers.first() {
            let imms = self.h.peer(first).imms();
            for &p in &self.peers {
                let other = self.h.peer(p).imms();
                ensure!(
                    other == imms,
                    "fresh engines should hand out the same imm values: {imms:?} vs {other:?}"
                );
            }
        }
        Ok(out)
    }

    /// Restarts killed peer `old` at its NIC addresses
    /// ([`EngineHarness::restart_peer_in_place`]); the new peer joins the
    /// run like one from [`Run::add_peers`].
    pub(super) fn restart_in_place(
        &mut self,
        old: usize,
        buf_len: usize,
    ) -> Result<usize, CaseFailure> {
        let p = self
            .h
            .restart_peer_in_place(old, buf_len)
            .map_err(harness)?;
        let (addr, desc) = (self.h.peer(p).address(), self.h.peer(p).desc());
        ensure!(
            desc.rkeys.len() == addr.nics.len() && desc.len as usize == buf_len,
            "restarted peer {p}: descriptor {desc:?} for address {addr:?}"
        );
        let imms = self.imms();
        ensure!(
            self.h.peer(p).imms() == imms,
            "a restarted engine should hand out the same imm values as fresh ones"
        );
        self.peers.push(p);
        Ok(p)
    }

    pub(super) fn imms(&mut self) -> Vec<Imm> {
        match self.peers.first() {
            Some(&p) => self.h.peer(p).imms(),
            None => Vec::new(),
        }
    }

    pub(super) fn desc(&mut self, p: usize) -> MrDesc {
        self.h.peer(p).desc()
    }

    pub(super) fn region(&self, src_off: u64, dst_off: u64, len: u64) -> Region {
        Region {
            src_off,
            dst_off,
            len,
            seed: self.seed,
        }
    }

    /// Arms round `tag` at peer `p`; returns the armed immediate count.
    pub(super) fn expect(
        &mut self,
        p: usize,
        tag: u64,
        imm: Imm,
        kinds: Vec<Kind>,
        regions: Vec<Region>,
    ) -> Result<u64, CaseFailure> {
        let n = self
            .h
            .peer(p)
            .expect(tag, imm, kinds, regions)
            .map_err(harness)?;
        ensure!(n > 0, "peer {p}: round {tag} expects no immediate");
        self.armed.push((p, tag));
        Ok(n)
    }

    pub(super) fn collect(&mut self) {
        for &p in &self.peers {
            for (tag, r) in self.h.peer(p).take_rounds() {
                self.rounds.entry((p, tag)).or_default().push(r);
            }
        }
    }

    /// Waits (bounded) until `cond` holds, checking it before each
    /// progress call.
    pub(super) fn wait(
        &mut self,
        what: &str,
        mut cond: impl FnMut(&mut Self) -> bool,
    ) -> Result<(), CaseFailure> {
        let budget = self.h.wait_budget();
        for _ in 0..budget {
            if cond(self) {
                return Ok(());
            }
            self.h.progress();
        }
        bail!("hung: {what} (after {budget} progress rounds)")
    }

    /// Waits for every flag; returns their results in order.
    pub(super) fn wait_flags(
        &mut self,
        what: &str,
        flags: &[Arc<DoneFlag>],
    ) -> Result<Vec<Result<(), EngineError>>, CaseFailure> {
        self.wait(what, |_| flags.iter().all(|f| f.is_done()))?;
        Ok(flags
            .iter()
            .map(|f| f.result().unwrap_or(Err(EngineError::ShutDown)))
            .collect())
    }

    pub(super) fn wait_ok(
        &mut self,
        what: &str,
        flags: &[Arc<DoneFlag>],
    ) -> Result<(), CaseFailure> {
        for (k, r) in self.wait_flags(what, flags)?.into_iter().enumerate() {
            if let Err(e) = r {
                bail!("{what}: transfer {k} failed: {e}");
            }
        }
        Ok(())
    }

    /// Waits until round `tag` fired at each of `peers`, with every byte in
    /// place.
    pub(super) fn wait_rounds(&mut self, peers: &[usize], tag: u64) -> Result<(), CaseFailure> {
        self.wait(&format!("round {tag} at peers {peers:?}"), |r| {
            r.collect();
            peers.iter().all(|&p| r.rounds.contains_key(&(p, tag)))
        })?;
        for &p in peers {
            if let Some(Err(e)) = self.rounds.get(&(p, tag)).and_then(|v| v.first()) {
                bail!("peer {p}: round {tag}: {e}");
            }
        }
        Ok(())
    }

    /// Lets late events arrive, then requires every armed round to have
    /// fired exactly once (those at `except` peers: at most once) and
    /// nothing else.
    pub(super) fn finish(&mut self, except: &[usize]) -> Result<(), CaseFailure> {
        for _ in 0..64 {
            self.h.progress();
        }
        self.collect();
        for (&(p, tag), v) in &self.rounds {
            ensure!(
                self.armed.contains(&(p, tag)),
                "peer {p}: round {tag} fired but was never armed"
            );
            ensure!(
                v.len() == 1,
                "peer {p}: round {tag} fired {} times",
                v.len()
            );
        }
        for &(p, tag) in &self.armed {
            ensure!(
                except.contains(&p) || self.rounds.contains_key(&(p, tag)),
                "peer {p}: round {tag} never fired"
            );
        }
        Ok(())
    }

    pub(super) fn single(
        &self,
        len: u64,
        imm: Option<Imm>,
        src_off: u64,
        dst: &MrDesc,
        dst_off: u64,
    ) -> Result<Arc<DoneFlag>, CaseFailure> {
        let (od, flag) = OnDone::flag();
        self.init
            .submit_single_write(len, imm, (&self.smr, src_off), (dst, dst_off), od)
            .map_err(|e| engine_err(&format!("submit single write of {len} B"), e))?;
        Ok(flag)
    }
}
