//! Engine settings: [`EngineConfig`] (with [`QueueFullPolicy`] and the idle
//! policy of the engine's threads) and [`DomainGroupSpec`], one per domain
//! group.

use crate::shard::{ScatterMode, ShardConfig};
use std::sync::Arc;
use std::time::Duration;
use weft_transport::{Device, Imm, Provider};

/// What a submit does when its group's request queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueFullPolicy {
    /// Wait (spin, then yield) until the worker frees room. Cannot deadlock:
    /// workers never wait for submitters or for the callback thread, so the
    /// queue always drains; a callback that re-submits just waits a little.
    #[default]
    Block,
    /// Return [`EngineError::QueueFull`](crate::EngineError::QueueFull) at once
    /// (the submit's `on_done` is not called).
    Fail,
}

/// Engine-wide settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Capacity of each group's lock-free request queue. Requests sit in
    /// it by value (about 200 bytes each, allocated once with the queue),
    /// so a submit allocates nothing for the hand-off itself.
    pub queue_capacity: usize,
    /// Behaviour on a full request queue.
    pub queue_full: QueueFullPolicy,
    /// A worker stops taking new requests while this many planned WRs wait
    /// for send-queue room (bounds its memory; the request queue then fills
    /// and applies `queue_full`).
    pub max_pending_wrs: usize,
    /// Immediate values handed out by `alloc_imm` (`0..imm_capacity`).
    pub imm_capacity: u32,
    /// Sharding plan (part of the immediate-count contract).
    pub shard: ShardConfig,
    /// Default spreading of `submit_scatter`.
    pub scatter_mode: ScatterMode,
    /// Send slots per group (each `send_slot_len` bytes, on NIC 0).
    pub send_slots: u32,
    /// Bytes per send slot; larger messages are registered one by one.
    pub send_slot_len: u64,
    /// Idle loop iterations spent spinning before yielding. A group whose
    /// NICs need software progress ([`Capabilities::software_progress`]:
    /// libfabric tcp, shm, EFA's emulated protocols) skips this phase and
    /// yields after every empty poll instead: each poll already is a round of
    /// provider progress (system calls), and a worker that keeps the core
    /// through a run of them starves the threads it is waiting on, such as a
    /// peer's worker or the submitter on the same core. A yield with nothing
    /// else runnable returns at once, so a dedicated core loses nothing.
    ///
    /// [`Capabilities::software_progress`]: weft_transport::Capabilities::software_progress
    pub idle_spins: u32,
    /// Idle loop iterations (after spinning) spent yielding before sleeping.
    pub idle_yields: u32,
    /// Sleep of an idle worker/watcher; `None` = never sleep (lowest latency,
    /// burns a core). A worker with WRs in flight, or while an
    /// [`TransferEngine::expect_imm_count`](crate::TransferEngine::expect_imm_count)
    /// round of its engine waits, does not sleep (it yields between polls, so
    /// completions and the awaited immediates are not delayed) until
    /// `inflight_spin` passes without any progress or new arm.
    pub idle_sleep: Option<Duration>,
    /// How long a worker with WRs in flight (or an armed immediate round)
    /// keeps polling without sleeping while nothing completes, gets posted
    /// or is armed. Past it (a WR that never
    /// completes, e.g. to a peer that hangs) the worker falls back to
    /// `idle_sleep` between polls instead of burning a core indefinitely.
    pub inflight_spin: Duration,
    /// How long `shutdown` waits for in-flight WRs before failing them.
    pub drain_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            queue_full: QueueFullPolicy::Block,
            max_pending_wrs: 1 << 16,
            imm_capacity: 1 << 16,
            shard: ShardConfig::default(),
            scatter_mode: ScatterMode::ByPeer,
            send_slots: 64,
            send_slot_len: 16 * 1024,
            idle_spins: 64,
            idle_yields: 256,
            idle_sleep: Some(Duration::from_micros(200)),
            inflight_spin: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// One DomainGroup (one GPU): a provider, the NICs to open, where to run.
#[derive(Clone)]
pub struct DomainGroupSpec {
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) nics: Vec<usize>,
    pub(crate) device: Device,
    pub(crate) cpu: Option<usize>,
    pub(crate) numa: Option<u32>,
}

impl std::fmt::Debug for DomainGroupSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainGroupSpec")
            .field("provider", &self.provider.name())
            .field("nics", &self.nics)
            .field("device", &self.device)
            .field("cpu", &self.cpu)
            .field("numa", &self.numa)
            .finish()
    }
}

impl DomainGroupSpec {
    /// A group of `nics` (indices into `provider.nics()`, 1..=8 of them).
    pub fn new(provider: Arc<dyn Provider>, nics: impl Into<Vec<usize>>) -> Self {
        Self {
            provider,
            nics: nics.into(),
            device: Device::Host,
            cpu: None,
            numa: None,
        }
    }

    /// The device (GPU) this group serves; `reg_mr` of that device's memory
    /// goes to this group. Default [`Device::Host`].
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Pin the worker to this CPU.
    pub fn cpu(mut self, cpu: usize) -> Self {
        self.cpu = Some(cpu);
        self
    }

    /// Pin the worker to a CPU of this NUMA node (when sysfs knows it).
    pub fn numa_node(mut self, node: u32) -> Self {
        self.numa = Some(node);
        self
    }
}

/// Called with `(imm, count)` for immediates that arrived but were never
/// consumed by a round (see the ImmCounter contract).
pub type ExcessHandler = Arc<dyn Fn(Imm, u64) + Send + Sync + 'static>;

/// The idle policy of a worker or watcher thread: spin, then yield, then
/// sleep (see [`EngineConfig::idle_spins`]).
#[derive(Clone, Copy)]
pub(crate) struct Idle {
    pub(crate) spins: u32,
    pub(crate) yields: u32,
    pub(crate) sleep: Option<Duration>,
}

impl From<&EngineConfig> for Idle {
    fn from(c: &EngineConfig) -> Self {
        Self {
            spins: c.idle_spins,
            yields: c.idle_yields,
            sleep: c.idle_sleep,
        }
    }
}

impl Idle {
    /// Returns true when the caller should park for `sleep`.
    pub(crate) fn step(&self, idle: &mut u32) -> Option<Duration> {
        *idle = idle.saturating_add(1);
        if *idle <= self.spins {
            std::hint::spin_loop();
            None
        } else if *idle <= self.spins + self.yields || self.sleep.is_none() {
            std::thread::yield_now();
            None
        } else {
            self.sleep
        }
    }
}
