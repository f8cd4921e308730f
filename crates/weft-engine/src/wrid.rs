//! Packing of the 64-bit ids the engine hands to backends and to users:
//! work-request ids (a transfer's slab slot and generation, or a receive
//! buffer's pool and index) and registration keys (a registration slot and
//! its generation). Pure bit arithmetic, no state.

use weft_transport::WrId;

/// Packs a registration slot id and its generation into one key.
#[inline]
pub(crate) fn mr_key(id: u32, gen: u32) -> u64 {
    (u64::from(gen) << 32) | u64::from(id)
}

/// Splits [`mr_key`]'s key into (slot id, generation).
#[inline]
pub(crate) fn split_mr_key(key: u64) -> (u32, u32) {
    ((key & 0xffff_ffff) as u32, (key >> 32) as u32)
}

/// A [`WrId`]'s kind sits in its top two bits.
const KIND_SHIFT: u32 = 62;
/// Kind of a transfer's WRITE WRs.
pub(crate) const KIND_WRITE: u64 = 0;
/// Kind of a transfer's SEND WR.
pub(crate) const KIND_SEND: u64 = 1;
/// Kind of a receive buffer's WR.
const KIND_RECV: u64 = 2;
/// The transfer generation bits a [`WrId`] carries.
pub(crate) const GEN_MASK: u64 = (1 << 30) - 1;

/// The id of a WR of transfer `slot` (generation `gen`).
#[inline]
pub(crate) fn wr_transfer(kind: u64, slot: u32, gen: u32) -> WrId {
    WrId((kind << KIND_SHIFT) | ((u64::from(gen) & GEN_MASK) << 32) | u64::from(slot))
}

/// The id of the receive WR of buffer `idx` of pool `pool`.
#[inline]
pub(crate) fn wr_recv(pool: u16, idx: u32) -> WrId {
    WrId((KIND_RECV << KIND_SHIFT) | (u64::from(pool) << 32) | u64::from(idx))
}

/// Whether `wr` is a transfer's SEND (made by [`wr_transfer`] with
/// [`KIND_SEND`]).
#[inline]
pub(crate) fn is_send(wr: WrId) -> bool {
    wr.0 >> KIND_SHIFT == KIND_SEND
}

/// What a [`WrId`] names.
pub(crate) enum Decoded {
    Transfer { slot: u32, gen: u32 },
    Recv { pool: u16, idx: u32 },
    Unknown,
}

/// Unpacks a [`WrId`] made by [`wr_transfer`] or [`wr_recv`].
#[inline]
pub(crate) fn decode(wr: WrId) -> Decoded {
    let kind = wr.0 >> KIND_SHIFT;
    let low = (wr.0 & 0xffff_ffff) as u32;
    match kind {
        KIND_WRITE | KIND_SEND => Decoded::Transfer {
            slot: low,
            gen: ((wr.0 >> 32) & GEN_MASK) as u32,
        },
        KIND_RECV => Decoded::Recv {
            pool: ((wr.0 >> 32) & 0xffff) as u16,
            idx: low,
        },
        _ => Decoded::Unknown,
    }
}
