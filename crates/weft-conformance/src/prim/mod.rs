//! Generic test primitives the engine suite and the cross-process harness
//! are built on: host buffers, byte patterns, bounded waits, re-executing the
//! test binary as a child process, and message framing.
//!
//! Nothing here knows about a backend or a case. The module is kept apart on
//! purpose so it can be swapped for the workspace's `weft-testkit` crate
//! once that exists (the names and signatures are meant to map 1:1).

mod child;
mod frame;
mod host_buf;
mod wait;

pub use child::{signal, spawn_self, SpawnSpec};
pub use frame::{from_line, recv_frame, send_frame, to_line};
pub use host_buf::HostBuf;
pub use wait::{wait_flag, wait_until, DEADLINE};

/// Byte `i` of the payload pattern `seed`: sources are filled with it and
/// receivers check their destination against it, so a receiver in another
/// process needs only `(seed, source offset)` to verify bytes.
pub fn pat(seed: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (x >> 29) as u8
}
