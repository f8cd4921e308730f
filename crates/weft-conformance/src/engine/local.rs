//! Engines in the test process: [`LocalPeer`] (one peer engine with its
//! buffer, also what a child process of the cross-process harness runs) and
//! [`InProcessEngines`], a ready-made [`EngineHarness`] over an
//! [`EngineBackend`].

use super::{check_regions, EngineHarness, EnginePeer, Kind, Region, PEER_IMMS};
use crate::HarnessError;
use crate::TestMemory;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use weft_engine::{GroupAddress, Imm, MrDesc, RecvQueue, TransferEngine};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type Rounds = Arc<Mutex<Vec<(u64, Result<(), String>)>>>;
type Received = Arc<Mutex<Vec<Result<Vec<u8>, String>>>>;
type RoundHook = Arc<dyn Fn(u64, &Result<(), String>) + Send + Sync>;

/// A peer engine in this process with one registered buffer. Dropping it
/// shuts the engine down (before the buffer goes).
pub struct LocalPeer {
    engine: TransferEngine,
    buf: Arc<dyn TestMemory>,
    desc: MrDesc,
    imms: Vec<Imm>,
    rounds: Rounds,
    received: Received,
    /// The polled receive pool, when one was posted.
    queue: Option<RecvQueue>,
    /// Called with `(tag, result)` as each round fires (after recording).
    on_round: Option<RoundHook>,
}

impl LocalPeer {
    /// Registers a zeroed buffer of `buf_len` bytes with `engine` and
    /// allocates [`PEER_IMMS`] immediate values.
    pub fn new(engine: TransferEngine, buf_len: usize) -> Result<Self, String> {
        Self::with_memory(engine, crate::memory::host_memory(buf_len)?)
    }

    /// [`LocalPeer::new`] over `buf` (zeroed; host or device memory).
    pub fn with_memory(engine: TransferEngine, buf: Box<dyn TestMemory>) -> Result<Self, String> {
        let buf: Arc<dyn TestMemory> = Arc::from(buf);
        let region = buf.sub_region(0..buf.len()).ok_or("an empty peer buffer")?;
        let (_mr, desc) = engine.reg_mr(region).map_err(|e| format!("reg_mr: {e}"))?;
        let imms = (0..PEER_IMMS)
            .map(|_| engine.alloc_imm())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("alloc_imm: {e}"))?;
        Ok(Self {
            engine,
            buf,
            desc,
            imms,
            rounds: Arc::default(),
            received: Arc::default(),
            queue: None,
            on_round: None,
        })
    }

    /// Also calls `f(tag, result)` when a round fires (the cross-process
    /// child reports rounds to its parent this way).
    pub fn with_round_hook(
        mut self,
        f: impl Fn(u64, &Result<(), String>) + Send + Sync + 'static,
    ) -> Self {
        self.on_round = Some(Arc::new(f));
        self
    }

    /// The peer's engine.
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }
}

impl Drop for LocalPeer {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

impl EnginePeer for LocalPeer {
    fn address(&self) -> GroupAddress {
        self.engine.main_address()
    }

    fn desc(&self) -> MrDesc {
        self.desc.clone()
    }

    fn imms(&self) -> Vec<Imm> {
        self.imms.clone()
    }

    fn expect(
        &mut self,
        tag: u64,
        imm: Imm,
        kinds: Vec<Kind>,
        regions: Vec<Region>,
    ) -> Result<u64, HarnessError> {
        let counts = self
            .engine
            .imm_counts(0)
            .map_err(|e| HarnessError::Failed(format!("imm_counts: {e}")))?;
        let count: u64 = kinds.iter().map(|k| k.count(&counts)).sum();
        let (buf, rounds, hook) = (
            Arc::clone(&self.buf),
            Arc::clone(&self.rounds),
            self.on_round.clone(),
        );
        self.engine
            .expect_imm_count(imm, count, move |r| {
                let result = match r {
                    Err(e) => Err(format!("imm round failed: {e}")),
                    Ok(()) => check_regions(&*buf, &regions),
                };
                if let Some(h) = &hook {
                    h(tag, &result);
                }
                lock(&rounds).push((tag, result));
            })
            .map_err(|e| HarnessError::Failed(format!("expect_imm_count: {e}")))?;
        Ok(count)
    }

    fn take_rounds(&mut self) -> Vec<(u64, Result<(), String>)> {
        std::mem::take(&mut *lock(&self.rounds))
    }

    fn post_recvs(&mut self, len: u64, count: u32, polled: bool) -> Result<(), HarnessError> {
        if polled {
            let q = self
                .engine
                .recv_queue(len, count)
                .map_err(|e| HarnessError::Failed(format!("recv_queue: {e}")))?;
            self.queue = Some(q);
            return Ok(());
        }
        let got = Arc::clone(&self.received);
        self.engine
            .submit_recvs(len, count, move |r| {
                lock(&got).push(r.map(<[u8]>::to_vec).map_err(|e| e.to_string()))
            })
            .map_err(|e| HarnessError::Failed(format!("submit_recvs: {e}")))
    }

    fn take_received(&mut self) -> Vec<Result<Vec<u8>, String>> {
        let mut got = std::mem::take(&mut *lock(&self.received));
        if let Some(q) = &self.queue {
            while let Some(r) = q.try_recv() {
                got.push(r.map(|m| m.to_vec()).map_err(|e| e.to_string()));
            }
        }
        got
    }

    fn shutdown(&mut self) -> Result<(), HarnessError> {
        self.engine.shutdown();
        Ok(())
    }
}

/// The backend half of [`InProcessEngines`]: builds engines whose hosts all
/// live in this process.
pub trait EngineBackend {
    /// See [`EngineHarness::name`].
    fn name(&self) -> String;
    /// See [`EngineHarness::seed`].
    fn seed(&self) -> u64;
    /// Builds the engine of a new host `host` (hosts are numbered 0, 1, ...
    /// in creation order; the initiator is created first, so it is host 0).
    fn engine(&mut self, host: usize) -> Result<TransferEngine, HarnessError>;
    /// See [`EngineHarness::progress`]; `engines` are all engines built so
    /// far, in host order (manual-mode engines are progressed here). The
    /// default sleeps 200 µs (threaded engines progress by themselves).
    fn progress(&mut self, engines: &[TransferEngine]) {
        let _ = engines;
        std::thread::sleep(Duration::from_micros(200));
    }
    /// See [`EngineHarness::wait_budget`]. The default (300 000 rounds of
    /// the default `progress`) is about a minute.
    fn wait_budget(&self) -> u64 {
        300_000
    }
    /// Fault hook: host `host` (whose engine is `engine`) dies now. The
    /// default returns [`HarnessError::Unsupported`].
    fn kill_host(&mut self, host: usize, engine: &TransferEngine) -> Result<(), HarnessError> {
        let _ = engine;
        Err(HarnessError::Unsupported(format!(
            "no fault hook to kill host {host}"
        )))
    }
    /// Whether [`revive_host`](EngineBackend::revive_host) is supported.
    /// Default: false.
    fn revives_hosts(&self) -> bool {
        false
    }
    /// Fault hook: killed host `host` comes back at the same NIC addresses
    /// with a fresh engine, returned (`old`, its previous engine, is shut
    /// down already, so its domains are closed). The default returns
    /// [`HarnessError::Unsupported`].
    fn revive_host(
        &mut self,
        host: usize,
        old: &TransferEngine,
    ) -> Result<TransferEngine, HarnessError> {
        let _ = old;
        Err(HarnessError::Unsupported(format!(
            "no fault hook to revive host {host}"
        )))
    }
}

/// An [`EngineHarness`] whose engines all live in this process.
pub struct InProcessEngines<B: EngineBackend> {
    // Drop order: peers (each shuts its engine down before its buffer
    // goes), then the initiator is shut down in `Drop`.
    peers: Vec<LocalPeer>,
    /// Host index of each peer.
    peer_hosts: Vec<usize>,
    initiator: Option<TransferEngine>,
    /// Every engine, in host order.
    engines: Vec<TransferEngine>,
    backend: B,
}

impl<B: EngineBackend> InProcessEngines<B> {
    /// Wraps a backend.
    pub fn new(backend: B) -> Self {
        Self {
            peers: Vec::new(),
            peer_hosts: Vec::new(),
            initiator: None,
            engines: Vec::new(),
            backend,
        }
    }

    /// The wrapped backend.
    pub fn backend(&mut self) -> &mut B {
        &mut self.backend
    }

    fn new_engine(&mut self) -> Result<(usize, TransferEngine), HarnessError> {
        let host = self.engines.len();
        let e = self.backend.engine(host)?;
        self.engines.push(e.clone());
        Ok((host, e))
    }
}

impl<B: EngineBackend> Drop for InProcessEngines<B> {
    fn drop(&mut self) {
        if let Some(e) = &self.initiator {
            e.shutdown();
        }
        self.peers.clear();
    }
}

impl<B: EngineBackend> EngineHarness for InProcessEngines<B> {
    fn name(&self) -> String {
        self.backend.name()
    }

    fn seed(&self) -> u64 {
        self.backend.seed()
    }

    fn initiator(&mut self) -> Result<TransferEngine, HarnessError> {
        if let Some(e) = &self.initiator {
            return Ok(e.clone());
        }
        let (_, e) = self.new_engine()?;
        self.initiator = Some(e.clone());
        Ok(e)
    }

    fn add_peer(&mut self, buf_len: usize) -> Result<usize, HarnessError> {
        let (host, e) = self.new_engine()?;
        let p = LocalPeer::new(e, buf_len).map_err(HarnessError::Failed)?;
        self.peers.push(p);
        self.peer_hosts.push(host);
        Ok(self.peers.len() - 1)
    }

    fn peer(&mut self, ix: usize) -> &mut dyn EnginePeer {
        match self.peers.get_mut(ix) {
            Some(p) => p,
            None => panic!("engine suite bug: no peer {ix}"),
        }
    }

    fn progress(&mut self) {
        self.backend.progress(&self.engines);
    }

    fn wait_budget(&self) -> u64 {
        self.backend.wait_budget()
    }

    fn kill_peer(&mut self, ix: usize) -> Result<(), HarnessError> {
        let (Some(&host), Some(p)) = (self.peer_hosts.get(ix), self.peers.get(ix)) else {
            return Err(HarnessError::Failed(format!("no peer {ix}")));
        };
        self.backend.kill_host(host, p.engine())
    }

    fn restarts_in_place(&self) -> bool {
        self.backend.revives_hosts()
    }

    fn restart_peer_in_place(&mut self, ix: usize, buf_len: usize) -> Result<usize, HarnessError> {
        let (Some(&host), Some(p)) = (self.peer_hosts.get(ix), self.peers.get_mut(ix)) else {
            return Err(HarnessError::Failed(format!("no peer {ix}")));
        };
        p.shutdown()?;
        let old = p.engine().clone();
        let e = self.backend.revive_host(host, &old)?;
        self.engines.push(e.clone());
        let p = LocalPeer::new(e, buf_len).map_err(HarnessError::Failed)?;
        self.peers.push(p);
        self.peer_hosts.push(host);
        Ok(self.peers.len() - 1)
    }
}
