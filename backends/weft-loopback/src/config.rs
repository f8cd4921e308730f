//! Fabric configuration: delivery profile, NIC model and queue limits.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use weft_transport::DeviceCopy;

/// Latency and bandwidth of one simulated NIC.
///
/// A transfer of `n` bytes from NIC `a` to NIC `b` occupies `a`'s transmit
/// link for `n * 8 / a.link_gbps` ns, travels for
/// `(a.latency + b.latency) / 2`, then occupies `b`'s receive link for
/// `n * 8 / b.link_gbps` ns (so incast serializes at the receiver), plus
/// the configured jitter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NicModel {
    /// One-way base latency contributed by this NIC.
    pub latency: Duration,
    /// Link bandwidth in Gbit/s. Zero, negative or non-finite means infinite.
    pub link_gbps: f64,
}

impl Default for NicModel {
    /// A 400 Gbit/s NIC with ~2 µs one-way latency.
    fn default() -> Self {
        Self {
            latency: Duration::from_micros(2),
            link_gbps: 400.0,
        }
    }
}

/// Configuration of a [`crate::Fabric`]. Start from one of the profiles
/// ([`FabricConfig::adversarial`], [`FabricConfig::ideal`],
/// [`FabricConfig::null`]) and adjust the public fields.
#[derive(Clone)]
pub struct FabricConfig {
    /// Seed of the fabric's ChaCha RNG: same seed + same calls = same trace.
    pub seed: u64,
    /// Null mode: see [`FabricConfig::null`].
    pub null: bool,
    /// Timing-only mode: see [`FabricConfig::timing`].
    pub timing_only: bool,
    /// Default NIC model for every NIC (override per NIC with
    /// [`crate::Fabric::set_nic_model`]).
    pub nic: NicModel,
    /// Extra delay added to every chunk/message, uniform in `[0, jitter]`.
    pub jitter: Duration,
    /// Smallest payload chunk a WRITE is split into (bytes, at least 1).
    pub chunk_min: u64,
    /// Largest payload chunk (bytes). Each WRITE picks one chunk size in
    /// `[chunk_min, chunk_max]`.
    pub chunk_max: u64,
    /// Upper bound on the chunks of one WRITE; longer writes use larger
    /// chunks (keeps a 64 MiB write from becoming thousands of events).
    pub max_chunks: u32,
    /// Whether the chunks of a WRITE leave the NIC in random order.
    pub shuffle_chunks: bool,
    /// Whether an incoming SEND picks a random posted receive buffer (true)
    /// or the oldest one (false).
    pub random_recv_match: bool,
    /// Probability that one transmission of a chunk or message is lost and
    /// retransmitted. Random losses are never fatal: after
    /// [`FabricConfig::retry_limit`] losses the next transmission succeeds.
    pub drop_prob: f64,
    /// Delay between a loss and its retransmission.
    pub retransmit_delay: Duration,
    /// Retransmissions before an operation whose every transmission is lost
    /// ([`crate::Action::DropAll`]) fails with `PeerUnreachable`.
    pub retry_limit: u32,
    /// How long a SEND waits for a posted receive buffer before failing with
    /// `ReceiverNotReady`.
    pub rnr_timeout: Duration,
    /// Outstanding SEND + WRITE work requests per domain (posted, and
    /// completion not yet returned by `poll`).
    pub max_inflight: usize,
    /// Outstanding receive buffers per domain.
    pub max_recvs: usize,
    /// Most WRs accepted by one `post_writes` call.
    pub max_batch: usize,
    /// Largest WRITE accepted in one WR (bytes).
    pub max_write_len: u64,
    /// Largest SEND (bytes).
    pub max_send_len: u64,
    /// Record a [`crate::TraceEvent`] log (see [`crate::Fabric::trace`]).
    pub trace: bool,
    /// Copier for regions on [`weft_transport::Device::Cuda`]; without one,
    /// registering CUDA memory fails with `Unsupported`.
    pub device_copy: Option<Arc<dyn DeviceCopy>>,
}

impl fmt::Debug for FabricConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricConfig")
            .field("seed", &self.seed)
            .field("null", &self.null)
            .field("timing_only", &self.timing_only)
            .field("nic", &self.nic)
            .field("jitter", &self.jitter)
            .field("chunk_min", &self.chunk_min)
            .field("chunk_max", &self.chunk_max)
            .field("max_chunks", &self.max_chunks)
            .field("shuffle_chunks", &self.shuffle_chunks)
            .field("random_recv_match", &self.random_recv_match)
            .field("drop_prob", &self.drop_prob)
            .field("retransmit_delay", &self.retransmit_delay)
            .field("retry_limit", &self.retry_limit)
            .field("rnr_timeout", &self.rnr_timeout)
            .field("max_inflight", &self.max_inflight)
            .field("max_recvs", &self.max_recvs)
            .field("max_batch", &self.max_batch)
            .field("max_write_len", &self.max_write_len)
            .field("max_send_len", &self.max_send_len)
            .field("trace", &self.trace)
            .field(
                "device_copy",
                &self.device_copy.as_ref().map(|_| "<installed>"),
            )
            .finish()
    }
}

impl Default for FabricConfig {
    /// [`FabricConfig::adversarial`] with seed 0.
    fn default() -> Self {
        Self::adversarial(0)
    }
}

impl FabricConfig {
    /// The default profile, the worst NIC we know: WRITEs are split into
    /// 1–16 KiB chunks that leave in random order, every chunk gets up to
    /// 20 µs of jitter (ten times the base latency, so writes overtake each
    /// other), 2% of transmissions are lost and retransmitted after 10 µs,
    /// SENDs take a random posted buffer. No error is injected unless a
    /// [`crate::Rule`] says so.
    pub fn adversarial(seed: u64) -> Self {
        Self {
            seed,
            null: false,
            timing_only: false,
            nic: NicModel::default(),
            jitter: Duration::from_micros(20),
            chunk_min: 1024,
            chunk_max: 16 * 1024,
            max_chunks: 64,
            shuffle_chunks: true,
            random_recv_match: true,
            drop_prob: 0.02,
            retransmit_delay: Duration::from_micros(10),
            retry_limit: 7,
            rnr_timeout: Duration::from_millis(10),
            max_inflight: 1024,
            max_recvs: 4096,
            max_batch: 64,
            max_write_len: 1 << 40,
            max_send_len: 1 << 20,
            trace: false,
            device_copy: None,
        }
    }

    /// A well-behaved fabric: no jitter, no loss, each WRITE travels as one
    /// chunk, receive buffers are taken oldest first. Still models latency
    /// and bandwidth, so it is in order only by accident of the model.
    pub fn ideal(seed: u64) -> Self {
        Self {
            jitter: Duration::ZERO,
            max_chunks: 1,
            shuffle_chunks: false,
            random_recv_match: false,
            drop_prob: 0.0,
            ..Self::adversarial(seed)
        }
    }

    /// Timing-only mode, for simulations at scales whose payload would not
    /// fit in memory: the [`FabricConfig::ideal`] profile (latency and
    /// bandwidth model, step-mode delivery, every check at post and at
    /// arrival, immediates and completions at their simulated times), but
    /// **no payload byte is copied**, so registrations need no memory
    /// behind them: [`crate::LoopbackDomain::register_virtual`] registers a
    /// length at an address the fabric makes up (ordinary registrations
    /// work too; their memory is never read or written). Queue limits are
    /// raised (`max_inflight` 2^20, `max_batch` 1024) so that a driver
    /// posting a whole schedule is not throttled by them.
    pub fn timing(seed: u64) -> Self {
        Self {
            timing_only: true,
            max_inflight: 1 << 20,
            max_batch: 1024,
            ..Self::ideal(seed)
        }
    }

    /// Null mode, for benchmarks that want to measure the engine alone.
    ///
    /// WRs are validated exactly as in the other modes (local keys and
    /// bounds at post, rkey/bounds/writability at the target, queue limits,
    /// rules) and complete at the next `poll` of any domain (no simulated
    /// time passes). Skipped: **no payload byte is copied** (target memory is
    /// never touched, neither for WRITEs nor for SENDs), no chunking, no
    /// latency/bandwidth model, no jitter, no random loss, no reordering.
    /// Still delivered: immediates ([`weft_transport::Completion::Imm`]),
    /// receive completions with the SEND's length, send/write completions.
    /// RNR still waits (for `rnr_timeout` of simulated time).
    pub fn null() -> Self {
        Self {
            null: true,
            nic: NicModel {
                latency: Duration::ZERO,
                link_gbps: 0.0,
            },
            max_inflight: 1 << 16,
            max_batch: 1024,
            ..Self::ideal(0)
        }
    }

    /// Builder-style: enables or disables the trace.
    pub fn with_trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }
}
