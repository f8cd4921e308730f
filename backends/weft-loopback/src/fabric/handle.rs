//! The public [`Fabric`] handle: creation, the drive modes (step and
//! realtime), hosts and NICs, rules, device copier, trace and stats. Each
//! method locks the shared [`State`] and delegates to it.

use super::state::{HostState, NicState, RuleState, State};
use super::{dur_ns, nic_name, unknown_nic};
use crate::config::{FabricConfig, NicModel};
use crate::rules::Rule;
use crate::trace::{FabricStats, TraceEvent};
use crate::{addr, HostId, LoopbackDomain, LoopbackProvider, SimTime};
use parking_lot::{Mutex, MutexGuard};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_transport::{DeviceCopy, TransportError};

/// A handle to a simulated fabric. Cheap to clone (an `Arc` inside); all
/// clones, providers and domains share one state behind one mutex.
///
/// See the crate documentation for the drive modes and semantics.
#[derive(Clone)]
pub struct Fabric {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// `Some` in realtime mode: simulated time = wall time since this instant.
    start: Option<Instant>,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.inner.state.lock();
        f.debug_struct("Fabric")
            .field("realtime", &self.inner.start.is_some())
            .field("now", &SimTime(st.now))
            .field("hosts", &st.hosts.len())
            .field("pending_events", &st.events.len())
            .field("seed", &st.cfg.seed)
            .finish()
    }
}

impl Fabric {
    /// A fabric in **step mode**: simulated time advances only through
    /// [`Fabric::step`], [`Fabric::advance`] and [`Fabric::run_until_idle`].
    /// `poll` only reports what is due at the current simulated time.
    pub fn new(config: FabricConfig) -> Self {
        Self::build(config, None)
    }

    /// A fabric in **realtime mode**: every call into the fabric (any
    /// domain's `poll`/`post_*`, from any thread, and the `Fabric` methods)
    /// first advances simulated time to the wall time elapsed since creation
    /// and processes everything due. Not deterministic (the wall clock
    /// decides interleavings), but the delivery rules are the same.
    pub fn new_realtime(config: FabricConfig) -> Self {
        Self::build(config, Some(Instant::now()))
    }

    fn build(config: FabricConfig, start: Option<Instant>) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::new(config)),
                start,
            }),
        }
    }

    /// Locks the state and brings it up to date: in realtime mode advances
    /// to the wall clock; in both modes processes the events due now.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        let mut st = self.inner.state.lock();
        if let Some(start) = self.inner.start {
            let wall = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            st.advance_to(wall);
        } else {
            st.process_due();
        }
        st
    }

    /// Whether this fabric runs in realtime mode.
    pub fn is_realtime(&self) -> bool {
        self.inner.start.is_some()
    }

    /// The configuration the fabric was built with (the device copier may
    /// have been replaced since by [`Fabric::set_device_copy`]).
    pub fn config(&self) -> FabricConfig {
        self.inner.state.lock().cfg.clone()
    }

    /// Current simulated time.
    pub fn now(&self) -> SimTime {
        SimTime(self.lock().now)
    }

    /// Processes the next pending event, moving simulated time to it.
    /// Returns whether there was one. In realtime mode it only processes
    /// what is already due by the wall clock and returns whether anything was.
    pub fn step(&self) -> bool {
        if self.is_realtime() {
            let mut st = self.inner.state.lock();
            let before = st.stats.events;
            drop(st);
            st = self.lock();
            return st.stats.events != before;
        }
        // The raw lock: the next event in (time, seq) order is also the
        // first due one, so this processes exactly one event.
        self.inner.state.lock().step()
    }

    /// Advances simulated time by `d`, processing every event due on the way.
    /// In realtime mode simulated time follows the wall clock, so this only
    /// processes what is due.
    pub fn advance(&self, d: Duration) {
        let mut st = self.lock();
        if !self.is_realtime() {
            let target = st.now.saturating_add(dur_ns(d));
            st.advance_to(target);
        }
    }

    /// Processes events until none is pending; returns how many were
    /// processed. Terminates: retransmissions and RNR waits are bounded. In
    /// realtime mode it sleeps (in slices of at most 1 ms) until the wall
    /// clock has reached the last event.
    pub fn run_until_idle(&self) -> u64 {
        let mut n = 0;
        loop {
            let mut st = self.lock();
            if !self.is_realtime() {
                while st.step() {
                    n += 1;
                }
                return n;
            }
            let Some(next) = st.events.next_time() else {
                return n;
            };
            n += 1;
            let wait = next.saturating_sub(st.now).clamp(1_000, 1_000_000);
            drop(st);
            std::thread::sleep(Duration::from_nanos(wait));
        }
    }

    /// When the next pending event is due, if any (step mode: the time
    /// [`Fabric::step`] would move to). A driver that interleaves its own
    /// simulated work with the fabric's advances to whichever comes first.
    pub fn next_event_at(&self) -> Option<SimTime> {
        self.lock().events.next_time().map(SimTime)
    }

    /// Appends to `out` every `(host, NIC)` whose completion queue received
    /// something (a completion or an immediate) since the last call, each
    /// once, in the order they were first noted, and forgets them: a
    /// driver of many domains polls only those. A NIC may be listed with
    /// nothing left to poll (its domain polled it meanwhile, or it went
    /// down).
    pub fn take_ready(&self, out: &mut Vec<(HostId, usize)>) {
        let mut locs = Vec::new();
        self.lock().take_ready(&mut locs);
        out.extend(locs.into_iter().map(|(h, n)| (HostId(h), n as usize)));
    }

    /// Number of events still queued.
    pub fn pending_events(&self) -> usize {
        self.lock().events.len()
    }

    /// Adds a host with `nics` NICs (at most 65535; more are ignored) and
    /// returns its id. Hosts are numbered 0, 1, 2, ... in creation order.
    pub fn add_host(&self, nics: usize) -> HostId {
        let model = self.inner.state.lock().cfg.nic;
        self.add_host_with(nics, model)
    }

    /// Like [`Fabric::add_host`], with a NIC model other than the
    /// configuration's default for all of the host's NICs.
    pub fn add_host_with(&self, nics: usize, model: NicModel) -> HostId {
        let mut st = self.lock();
        let n = nics.min(usize::from(u16::MAX));
        let id = u32::try_from(st.hosts.len()).unwrap_or(u32::MAX);
        st.hosts.push(HostState {
            nics: (0..n).map(|_| NicState::new(model)).collect(),
        });
        HostId(id)
    }

    /// Number of hosts added so far.
    pub fn host_count(&self) -> usize {
        self.lock().hosts.len()
    }

    /// Number of NICs of `host` (0 for an unknown host).
    pub fn nic_count(&self, host: HostId) -> usize {
        let st = self.lock();
        st.hosts.get(host.0 as usize).map_or(0, |h| h.nics.len())
    }

    /// Overrides the latency/bandwidth model of one NIC.
    pub fn set_nic_model(
        &self,
        host: HostId,
        nic: usize,
        model: NicModel,
    ) -> Result<(), TransportError> {
        let mut st = self.lock();
        let loc = st.loc(host, nic)?;
        if let Some(n) = st.nic_mut(loc) {
            n.model = model;
        }
        Ok(())
    }

    /// A [`weft_transport::Provider`] for the NICs of `host`.
    pub fn provider(&self, host: HostId) -> LoopbackProvider {
        LoopbackProvider::new(self.clone(), host)
    }

    /// Opens the domain of NIC `nic` of `host`. One open domain per NIC:
    /// opening an open NIC fails with `InvalidArgument`; a killed NIC fails
    /// with `NicDown`. Dropping the domain closes the NIC (see the crate docs).
    pub fn open(&self, host: HostId, nic: usize) -> Result<LoopbackDomain, TransportError> {
        let mut st = self.lock();
        let loc = st.loc(host, nic)?;
        let (model, dc) = (st.model(loc), st.device_copy.is_some());
        let caps = st.capabilities(dc);
        let Some(n) = st.nic_mut(loc) else {
            return Err(unknown_nic(host, nic));
        };
        if !n.alive {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        }
        if n.open {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(loc),
                what: "NIC already has an open domain".into(),
            });
        }
        n.open = true;
        drop(st);
        Ok(LoopbackDomain::new(self.clone(), loc, model, caps))
    }

    /// The address of NIC `nic` of `host` (whether or not it exists).
    pub fn nic_addr(host: HostId, nic: usize) -> weft_transport::NetAddr {
        addr::encode(host.0, u32::try_from(nic).unwrap_or(u32::MAX))
    }

    /// Kills every NIC of `host` (see [`Fabric::kill_nic`]).
    pub fn kill_host(&self, host: HostId) {
        self.lock().kill_host(host.0);
    }

    /// Brings killed host `host` back at the same NIC addresses, as a
    /// process restarted there would be: every NIC alive again with fresh
    /// state (no registrations, no posted receives, nothing queued) and
    /// its model kept, ready for [`Fabric::open`]. Registration keys are
    /// never reused, so a key of the old incarnation matches nothing.
    ///
    /// Refused with `InvalidArgument` while any NIC of the host is alive or
    /// still has an open domain (drop the old incarnation's domains first:
    /// a stale domain must not come back to life).
    pub fn revive_host(&self, host: HostId) -> Result<(), TransportError> {
        self.lock().revive_host(host)
    }

    /// Kills one NIC: every pending operation to it fails at its initiator
    /// with `PeerUnreachable` (reported at the initiator's next poll), later
    /// ones fail the same way on arrival. The dead NIC's own domain returns
    /// `Err(NicDown)` from `poll`, `post_*` and `register`; its pending
    /// operations never complete (they are dropped, as its bytes would be).
    /// `deregister` still succeeds, so memory can be released. A killed NIC
    /// cannot be reopened, except after [`Fabric::revive_host`]. Unknown
    /// hosts/NICs are ignored.
    pub fn kill_nic(&self, host: HostId, nic: usize) {
        let mut st = self.lock();
        if let Ok(loc) = st.loc(host, nic) {
            st.nic_down(loc, true);
        }
    }

    /// Whether NIC `nic` of `host` exists and has not been killed.
    pub fn is_alive(&self, host: HostId, nic: usize) -> bool {
        let mut st = self.lock();
        st.loc(host, nic)
            .ok()
            .and_then(|l| st.nic_mut(l).map(|n| n.alive))
            .unwrap_or(false)
    }

    /// Appends a fault-injection rule; returns its index. Rules are checked
    /// in order when an operation is posted; the first match decides.
    pub fn add_rule(&self, rule: Rule) -> usize {
        let mut st = self.lock();
        st.rules.push(RuleState { rule, hits: 0 });
        st.rules.len() - 1
    }

    /// Removes all rules.
    pub fn clear_rules(&self) {
        self.lock().rules.clear();
    }

    /// How many operations rule `index` has matched (0 for no such rule).
    pub fn rule_hits(&self, index: usize) -> u64 {
        self.lock().rules.get(index).map_or(0, |r| r.hits)
    }

    /// Installs the copier used for CUDA regions. Domains opened afterwards
    /// report `device_memory: true`. The copier is called with the fabric
    /// locked, so it must not call back into the fabric.
    pub fn set_device_copy(&self, copier: Arc<dyn DeviceCopy>) {
        self.lock().device_copy = Some(copier);
    }

    /// The recorded trace (empty unless [`FabricConfig::trace`] is set).
    pub fn trace(&self) -> Vec<TraceEvent> {
        self.lock().trace.clone()
    }

    /// Takes the recorded trace, leaving it empty.
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        std::mem::take(&mut self.lock().trace)
    }

    /// Counters since creation.
    pub fn stats(&self) -> FabricStats {
        self.lock().stats.clone()
    }
}
