//! Who sent a frame, as far as the app can tell.
//!
//! The engine's receive callback hands over the bytes of a message, not the
//! transport's sender: the `from` of a frame is a claim anyone who can send
//! to this engine can make. What the transport does guarantee is the other
//! direction: a SEND to an address reaches only the engine that holds it
//! (the engine binds every NIC address to one live incarnation, and the
//! backends check that a connection comes from the address it claims). So
//! identity is bound by return routability, as a TCP handshake does it:
//!
//! - each side derives, for every peer address, a *grant*: a keyed hash
//!   (SipHash-2-4 under a random key of this core) of the address. It sends
//!   the grant only to that address, in every frame
//!   ([`Auth::grant`](crate::wire::Auth)).
//! - a frame is *authentic* when its [`Auth::proof`](crate::wire::Auth) is
//!   the grant the receiver derives for the frame's `from`: only a process
//!   that received frames sent to that address knows it.
//! - an unauthentic `Hello` is answered (by the prefiller at a bounded
//!   rate; by the decoder only for the prefillers it added) with a `Hello`
//!   that echoes the claimed grant as its proof; the real peer finds its
//!   own grant there, and from then on both sides' frames are authentic.
//!   Every other unauthentic frame is dropped.
//!
//! Grants are stateless (a hash, not a table), so a stranger's claims cost
//! no memory, and a peer forgotten and met again keeps its grant. Replays
//! of a peer's own frames are authentic: the request-id windows of the
//! prefiller ([`crate::PrefillerCore`]) and the decoder's own checks make
//! them harmless. What this cannot stop: a process on the path that reads
//! other processes' SENDs, which RDMA fabrics do not offer an unprivileged
//! peer.

use rand::{RngCore, SeedableRng};
use weft::GroupAddress;

/// Whether the `n`th dropped frame is logged at warn (1st, 2nd, 4th, ...):
/// a flood of strangers' frames cannot flood the log.
pub(crate) fn loud(n: u64) -> bool {
    n.is_power_of_two()
}

/// The secret key of a core's grants.
#[derive(Clone)]
pub(crate) struct Keys {
    k0: u64,
    k1: u64,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the key itself stays out of logs
        f.write_str("Keys(..)")
    }
}

impl Keys {
    /// A key from the OS's randomness.
    pub(crate) fn random() -> Self {
        Self::from_rng(&mut rand::rngs::OsRng)
    }

    /// A key from `seed` (tests and models: reproducible runs).
    pub(crate) fn seeded(seed: u64) -> Self {
        Self::from_rng(&mut rand_chacha::ChaCha20Rng::seed_from_u64(seed))
    }

    fn from_rng(rng: &mut impl RngCore) -> Self {
        Self {
            k0: rng.next_u64(),
            k1: rng.next_u64(),
        }
    }

    /// The grant for `peer`: never 0 (0 is "no proof").
    pub(crate) fn grant(&self, peer: &GroupAddress) -> u64 {
        let mut bytes = Vec::with_capacity(16 * peer.nics.len() + 16);
        for nic in &peer.nics {
            bytes.extend_from_slice(&(nic.0.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&nic.0);
        }
        bytes.extend_from_slice(&peer.incarnation.0.to_le_bytes());
        siphash24(self.k0, self.k1, &bytes).max(1)
    }
}

/// SipHash-2-4 of `data` under key `(k0, k1)` (Aumasson and Bernstein).
fn siphash24(k0: u64, k1: u64, data: &[u8]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
    let compress = |m: u64, v: &mut [u64; 4]| {
        v[3] ^= m;
        round(v);
        round(v);
        v[0] ^= m;
    };
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        compress(u64::from_le_bytes(w), &mut v);
    }
    let mut last = [0u8; 8];
    let rest = chunks.remainder();
    last[..rest.len()].copy_from_slice(rest);
    last[7] = data.len() as u8;
    compress(u64::from_le_bytes(last), &mut v);
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_matches_the_reference_vectors() {
        // The paper's key 00..0f; messages 00, 00 01, ..., of length 0, 1,
        // 8 and 15 (vectors.h of the reference implementation).
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let msg: Vec<u8> = (0..15).collect();
        assert_eq!(siphash24(k0, k1, &msg[..0]), 0x726f_db47_dd0e_0e31);
        assert_eq!(siphash24(k0, k1, &msg[..1]), 0x74f8_39c5_93dc_67fd);
        assert_eq!(siphash24(k0, k1, &msg[..8]), 0x93f5_f579_9a93_2462);
        assert_eq!(siphash24(k0, k1, &msg[..15]), 0xa129_ca61_49be_45e5);
    }

    #[test]
    fn grants_differ_per_address_and_key() {
        let a = GroupAddress {
            nics: vec![weft::NetAddr(vec![1])],
            incarnation: weft::Incarnation(1),
        };
        let mut b = a.clone();
        b.incarnation = weft::Incarnation(2);
        let k = Keys::seeded(1);
        assert_ne!(k.grant(&a), k.grant(&b));
        assert_ne!(k.grant(&a), Keys::seeded(2).grant(&a));
        assert_eq!(k.grant(&a), Keys::seeded(1).grant(&a));
    }
}
