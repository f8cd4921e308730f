//! Engine settings: [`EngineConfig`] (with [`QueueFullPolicy`] and the idle
//! policy of the engine's threads) and [`DomainGroupSpec`], one per domain
//! group.

use crate::shard::{ScatterMode, ShardConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};
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

/// How an idle worker (and the UVM watcher) waits for work. Whatever the
/// policy, a worker with WRs in flight or an armed immediate round keeps
/// polling (see [`EngineConfig::inflight_spin`]), and a submit or an arm
/// wakes a parked worker at once; the policy decides what an idle worker
/// costs (CPU) against how fast it notices what nobody wakes it for
/// (received messages, immediates of no armed round) and how long a wake
/// takes. `weft-bench poll` measures each (submit → completion p50/p99
/// after an idle gap, and idle CPU per group): see docs/benchmarks.md,
/// "Polling policy and idle CPU".
///
/// Groups whose NICs need software progress (libfabric tcp, shm) and
/// offer a wait fd ([`weft_transport::Domain::wait_fd`]) sleep in those
/// fds when idle, under `Adaptive` after
/// [`EngineConfig::idle_block_after`] and under `SpinThenPark` after its
/// spin: the fd wakes them when a peer sends something only a poll would
/// move (a WRITE into this host, a message), and submits, arms and
/// control requests wake them through an eventfd. Without wait fds such a
/// group never parks under `Adaptive` (a thread asleep without them would
/// stall what peers write into this host) and parks for `idle_sleep` at a
/// time under `SpinThenPark`. Hardware-progress groups park as before:
/// their NICs move data without polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PollPolicy {
    /// Spin [`EngineConfig::idle_spins`] polls, yield
    /// [`EngineConfig::idle_yields`] polls, then park for
    /// [`EngineConfig::idle_sleep`] at a time (or keep yielding when that is
    /// `None`). The callback thread polls its queue (yielding) for 50 µs
    /// after each message, then blocks on it. The default.
    #[default]
    Adaptive,
    /// Poll without ever yielding or parking: the lowest latency, one full
    /// core per group while idle. On groups whose NICs need software
    /// progress each poll is a round of system calls, as in `fi_pingpong`.
    /// The callback thread likewise polls its queue instead of blocking, so
    /// a callback after idleness pays no thread wake-up (a second core).
    Busy,
    /// Poll (spinning; yielding on software-progress NICs) for `spin` after
    /// the last work, then park for [`EngineConfig::idle_sleep`] at a time
    /// (1 ms when that is `None`); the callback thread polls its queue for
    /// `spin` after its last message, then blocks on it.
    SpinThenPark {
        /// How long an idle worker keeps polling before it parks.
        spin: Duration,
    },
}

/// Engine-wide settings.
///
/// Non-exhaustive, so that a new setting is not a breaking change: start
/// from [`EngineConfig::default`] and set the fields you need.
///
/// ```
/// use std::time::Duration;
/// let mut cfg = weft_engine::EngineConfig::default();
/// cfg.idle_sleep = None; // workers never sleep: lowest latency, a core each
/// cfg.drain_timeout = Duration::from_secs(1);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Capacity of each group's lock-free request queue. Requests sit in
    /// it by value (192 bytes each, allocated once with the queue),
    /// so a submit allocates nothing for the hand-off itself.
    pub queue_capacity: usize,
    /// Behaviour on a full request queue.
    pub queue_full: QueueFullPolicy,
    /// A worker stops taking new requests while this many planned WRs wait
    /// for send-queue room (bounds its memory; the request queue then fills
    /// and applies `queue_full`). A paged write is planned half this many
    /// pages at a time, each next window once fewer than this many wait,
    /// so one huge paged write neither exceeds the bound by its size nor
    /// holds back the requests behind it until all its pages are planned.
    /// Default 2048: planned WRs are written once and read back when
    /// posted, so planning far ahead of the NICs only moves them out of the
    /// core's caches in between (10 000-page paged writes on one NIC ran at
    /// ~0.8 of the raw loop with 65 536, ~0.95 with 2048, on the 16-core
    /// H200 host; at 8 NICs, 0.99 of it planned in windows against 0.89
    /// planned all at once).
    pub max_pending_wrs: usize,
    /// Most WRs a worker keeps posted and not yet completed per NIC (the
    /// lower of this and the NIC's own `Capabilities::max_inflight`),
    /// bounding the worker's in-flight bookkeeping where a backend allows
    /// far more (the null fabric allows 65,536). 4096 WRITEs of 64 B keep
    /// a 400 Gbit/s NIC busy across a 5 µs round trip. On the 16-core H200
    /// host the ImmCounter row did not move between 1,024, 4,096 and
    /// 65,536 (0.65–0.71 of the raw loop). Default 4096.
    pub max_inflight_per_nic: usize,
    /// Immediate values handed out by `alloc_imm` (`0..imm_capacity`).
    pub imm_capacity: u32,
    /// Sharding plan (part of the immediate-count contract).
    pub shard: ShardConfig,
    /// Default spreading of `submit_scatter`.
    pub scatter_mode: ScatterMode,
    /// Bytes of received messages per receive pool that may wait for (or
    /// be in) their callback. The worker copies each message out of its
    /// receive buffer and re-posts the buffer at once; once a pool's
    /// copied-out messages reach this many bytes (at least one message),
    /// it holds finished buffers back until callbacks return messages, so
    /// a slow callback makes peers' SENDs wait for a buffer (receiver not
    /// ready) instead of growing this process's memory without bound. Peers
    /// whose SENDs wait longer than their fabric's RNR timeout see them
    /// fail. Default 64 MiB.
    pub recv_backlog_bytes: u64,
    /// Send slots per group (each `send_slot_len` bytes, on NIC 0).
    pub send_slots: u32,
    /// The largest message a send slot holds (each slot also holds the
    /// 20-byte SEND frame header); larger messages are registered one by
    /// one.
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
    /// Under [`PollPolicy::Adaptive`], the empty polls a software-progress
    /// group spins through before it starts yielding (see
    /// [`EngineConfig::idle_spins`], which such groups skip). 0, the
    /// default, yields after every empty poll; a worker with a core of its
    /// own may see completions sooner with a few spins, at the cost of
    /// holding the core from threads it shares one with.
    pub progress_spins: u32,
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
    /// How idle workers and the watcher wait; see [`PollPolicy`].
    pub poll: PollPolicy,
    /// Under [`PollPolicy::Adaptive`]: how long a software-progress group
    /// with nothing in flight and no armed round keeps polling before its
    /// worker sleeps in its NICs' wait fds (where every NIC has one; see
    /// [`PollPolicy`]). It then costs no CPU while idle; the first message
    /// after the sleep pays the wake-ups of the sleeping threads on both
    /// sides (+65 µs on libfabric tcp on the 16-core H200 host, against
    /// one core per idle group while polling). `None`: never sleep in fds
    /// (the group polls, one core, while idle). Also off when `idle_sleep`
    /// is `None`. Default 10 ms: the wake-up then costs under 1 % of the
    /// idle time before it, and an idle group burns at most 10 ms of CPU
    /// per idle period (docs/benchmarks.md, "Polling policy and idle
    /// CPU").
    pub idle_block_after: Option<Duration>,
    /// Whether a submitting thread plans and posts its request itself when
    /// the group's worker is not using the group's state at that moment
    /// (it takes the worker's lock without waiting, and only when nothing
    /// is queued before it); otherwise, and always in manual mode, the
    /// request goes through the group's queue to the worker. The worker
    /// keeps completions, the backlog and progress either way. Meant to
    /// save the hand-off to the worker thread on lightly loaded groups; off
    /// by default until a benchmark shows the gain (docs/benchmarks.md,
    /// "Ping-pong"), and best left off where submitting threads share
    /// contended cores (one descheduled while it holds the lock holds the
    /// worker back).
    pub caller_posts: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            queue_full: QueueFullPolicy::Block,
            max_pending_wrs: 2048,
            max_inflight_per_nic: 4096,
            imm_capacity: 1 << 16,
            shard: ShardConfig::default(),
            scatter_mode: ScatterMode::ByPeer,
            recv_backlog_bytes: 64 << 20,
            send_slots: 64,
            send_slot_len: 16 * 1024,
            idle_spins: 64,
            progress_spins: 0,
            idle_yields: 256,
            idle_sleep: Some(Duration::from_micros(200)),
            inflight_spin: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(5),
            poll: PollPolicy::Adaptive,
            idle_block_after: Some(Duration::from_millis(10)),
            caller_posts: false,
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
    /// A same-host domain after the NICs (see [`DomainGroupSpec::same_host`]).
    pub(crate) local: Option<(Arc<dyn Provider>, usize)>,
}

impl std::fmt::Debug for DomainGroupSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainGroupSpec")
            .field("provider", &self.provider.name())
            .field("nics", &self.nics)
            .field("device", &self.device)
            .field("cpu", &self.cpu)
            .field("numa", &self.numa)
            .field(
                "same_host",
                &self.local.as_ref().map(|(p, n)| (p.name().to_string(), *n)),
            )
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
            local: None,
        }
    }

    /// Adds NIC `nic` of a same-host `provider` (`nvlink`) after the
    /// group's NICs: destinations on this host go through it, every other
    /// through the NICs (`Domain::same_host`, `Domain::prefers`). Peers
    /// must build their groups alike (the same NICs, the same-host NIC at
    /// the same place), since each NIC writes to the peer's NIC of the same
    /// index.
    pub fn same_host(mut self, provider: Arc<dyn Provider>, nic: usize) -> Self {
        self.local = Some((provider, nic));
        self
    }

    /// NICs the group opens (the same-host one included).
    pub(crate) fn nic_count(&self) -> usize {
        self.nics.len() + usize::from(self.local.is_some())
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
/// sleep (see [`EngineConfig::idle_spins`] and [`PollPolicy`]).
#[derive(Clone, Copy)]
pub(crate) struct Idle {
    pub(crate) spins: u32,
    /// Software progress: `SpinThenPark` yields instead of spinning.
    pub(crate) yield_in_spin: bool,
    pub(crate) yields: u32,
    pub(crate) sleep: Option<Duration>,
    pub(crate) poll: PollPolicy,
    pub(crate) block_after: Option<Duration>,
}

impl From<&EngineConfig> for Idle {
    fn from(c: &EngineConfig) -> Self {
        Self {
            spins: c.idle_spins,
            yield_in_spin: false,
            yields: c.idle_yields,
            sleep: c.idle_sleep,
            poll: c.poll,
            block_after: c.idle_block_after,
        }
    }
}

/// Where an idle thread is in its idle policy; `reset` after any work.
#[derive(Debug, Default)]
pub(crate) struct IdleState {
    n: u32,
    since: Option<Instant>,
}

impl IdleState {
    /// Work was done: start over.
    pub(crate) fn reset(&mut self) {
        self.n = 0;
        self.since = None;
    }
}

impl Idle {
    /// One idle poll. Returns `Some(d)` when the caller should park for
    /// (at most) `d`; otherwise it spun or yielded already.
    pub(crate) fn step(&self, st: &mut IdleState) -> Option<Duration> {
        st.n = st.n.saturating_add(1);
        match self.poll {
            PollPolicy::Busy => {
                std::hint::spin_loop();
                None
            }
            PollPolicy::SpinThenPark { spin } => {
                let since = *st.since.get_or_insert_with(Instant::now);
                if since.elapsed() < spin {
                    if self.yield_in_spin {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    None
                } else {
                    Some(self.sleep.unwrap_or(Duration::from_millis(1)))
                }
            }
            PollPolicy::Adaptive => {
                if st.n <= self.spins {
                    std::hint::spin_loop();
                    None
                } else if st.n <= self.spins + self.yields || self.sleep.is_none() {
                    std::thread::yield_now();
                    None
                } else {
                    self.sleep
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(poll: PollPolicy) -> Idle {
        Idle {
            spins: 2,
            yield_in_spin: false,
            yields: 2,
            sleep: Some(Duration::from_micros(50)),
            poll,
            block_after: None,
        }
    }

    #[test]
    fn adaptive_spins_yields_then_parks() {
        let i = idle(PollPolicy::Adaptive);
        let mut st = IdleState::default();
        let steps: Vec<_> = (0..6).map(|_| i.step(&mut st)).collect();
        assert_eq!(&steps[..4], &[None, None, None, None]);
        assert_eq!(steps[4], Some(Duration::from_micros(50)));
        st.reset();
        assert_eq!(i.step(&mut st), None);
    }

    #[test]
    fn busy_never_parks() {
        let i = idle(PollPolicy::Busy);
        let mut st = IdleState::default();
        assert!((0..10_000).all(|_| i.step(&mut st).is_none()));
    }

    #[test]
    fn spin_then_park_parks_after_its_bound() {
        let i = idle(PollPolicy::SpinThenPark {
            spin: Duration::from_millis(2),
        });
        let mut st = IdleState::default();
        assert_eq!(i.step(&mut st), None);
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(i.step(&mut st), Some(Duration::from_micros(50)));
        st.reset();
        assert_eq!(i.step(&mut st), None, "work restarts the spin phase");
    }
}
