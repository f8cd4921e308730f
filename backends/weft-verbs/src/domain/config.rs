//! Tunables of a verbs domain ([`VerbsConfig`]) and the constants peers
//! agree on.

use weft_transport::{Device, TransportError};

/// Q_Key of every weft UD (handshake) QP.
pub const WEFT_QKEY: u32 = 0x7765_6674;

/// Largest length one verbs WR can carry (`uint32_t length`, and the RC
/// message limit): 2^31 - 1.
pub const MAX_VERBS_WR_LEN: u64 = (1 << 31) - 1;

/// How GPU memory is turned into a dma-buf for `ibv_reg_dmabuf_mr`.
pub trait DmaBufExporter: Send + Sync {
    /// Returns `(fd, offset)` of a dma-buf covering `[addr, addr+len)` on
    /// `device` (for CUDA: `cuMemGetHandleForAddressRange`). The backend
    /// does not close the fd.
    fn export(&self, addr: u64, len: u64, device: Device) -> Result<(i32, u64), TransportError>;
}

/// Tunables of a verbs domain. `Default` is right for ConnectX.
#[derive(Clone)]
pub struct VerbsConfig {
    /// Port number (1-based).
    pub port: u8,
    /// GID index; `None` = pick automatically (RoCE v2 IPv4-mapped first,
    /// then any RoCE v2, then the IB GID). The provider reads
    /// `WEFT_VERBS_GID_INDEX` into this.
    pub gid_index: Option<u32>,
    /// User SEND + WRITE operations accepted but not completed.
    pub max_inflight: usize,
    /// Send queue depth of each RC QP.
    pub sq_depth: u32,
    /// Hardware send WRs outstanding across all QPs of the domain (sizes the
    /// send CQ).
    pub hw_send_budget: u32,
    /// Receive buffers the user may post (SEND/RECV SRQ depth).
    pub recv_pool: u32,
    /// Zero-byte receives kept posted for WRITE_WITH_IMM (imm SRQ depth).
    pub imm_pool: u32,
    /// WRs linked per `ibv_post_send` (doorbell).
    pub chain_len: usize,
    /// Most WRs accepted by one `post_writes` call.
    pub max_batch: usize,
    /// Override of the largest bytes per WR (default: the port's
    /// `max_msg_sz`, at most 2^31-1). Longer WRITEs are split.
    pub max_wr_len: Option<u64>,
    /// Time before a handshake is retransmitted.
    pub handshake_timeout_ns: u64,
    /// Handshake transmissions before the peer is declared unreachable.
    pub handshake_tries: u32,
    /// Most *half-open passive* peers: peers created by a handshake from
    /// an address this domain was not asked to reach, before they connect.
    /// Each holds two RC QPs. At the bound, a handshake from a new address
    /// evicts the oldest one whose retransmissions have run out, or is
    /// refused (the module docs of `weft_verbs` say more). At least 1.
    pub max_half_open: usize,
    /// RC local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// RC transport retries.
    pub retry_cnt: u8,
    /// RC RNR retries (7 would be infinite; the contract wants a bound).
    pub rnr_retry: u8,
    /// RNR NAK timer code advertised by our responders.
    pub min_rnr_timer: u8,
    /// Service level.
    pub sl: u8,
    /// GRH traffic class (RoCE DSCP << 2).
    pub traffic_class: u8,
    /// Turns GPU pointers into dma-bufs; without it GPU memory needs a
    /// peer-memory client (`nvidia_peermem`).
    pub dmabuf: Option<std::sync::Arc<dyn DmaBufExporter>>,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: None,
            max_inflight: 1024,
            sq_depth: 256,
            hw_send_budget: 2048,
            recv_pool: 1024,
            imm_pool: 1024,
            chain_len: 4,
            max_batch: 256,
            max_wr_len: None,
            handshake_timeout_ns: 50_000_000,
            handshake_tries: 40,
            max_half_open: 256,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            sl: 0,
            traffic_class: 0,
            dmabuf: None,
        }
    }
}

impl std::fmt::Debug for VerbsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConfig")
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("max_inflight", &self.max_inflight)
            .field("chain_len", &self.chain_len)
            .field("max_wr_len", &self.max_wr_len)
            .finish_non_exhaustive()
    }
}
