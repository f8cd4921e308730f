//! Settings shared by the decoder and the prefiller.

use std::time::Duration;

/// Settings shared by both sides.
#[derive(Debug, Clone)]
pub struct KvConfig {
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Silence after which the peer is declared dead.
    pub heartbeat_timeout: Duration,
    /// Receive buffer size (bytes) and count.
    pub recv_len: u64,
    /// Receive buffers.
    pub recv_count: u32,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_millis(20),
            heartbeat_timeout: Duration::from_millis(1000),
            recv_len: 16 * 1024,
            recv_count: 32,
        }
    }
}
