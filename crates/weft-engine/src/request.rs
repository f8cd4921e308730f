//! Submitted requests as they travel through a group's request queue: the
//! request body and its destinations as plain values (no descriptor is
//! cloned per submit; the NIC addresses of single and paged write
//! destinations are interned in the engine-wide [`AddrBook`]).

pub(crate) use crate::addrbook::AddrBook;
use crate::error::{EngineError, TransferId};
use crate::mem::SendPayload;
use crate::ondone::OnDone;
use crate::shard::ScatterMode;
use crate::MAX_NICS;
use weft_transport::{Imm, Incarnation, MrDesc, NetAddr, Pages, Rkey, ScatterDst};

/// The remote addresses of one peer group member: one per NIC, in NIC
/// order, and the incarnation of the engine that answers there.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct GroupAddress {
    /// Address of NIC `i` of the peer's group.
    pub nics: Vec<NetAddr>,
    /// The peer engine's incarnation
    /// ([`TransferEngine::incarnation`](crate::TransferEngine::incarnation)):
    /// a removed or replaced incarnation is refused even when a restarted
    /// process answers at the same addresses. (`serde(default)` lets
    /// self-describing formats read addresses written before the field
    /// existed; postcard, the wire format, has no field names: there the
    /// field changed the encoding.)
    #[serde(default)]
    pub incarnation: Incarnation,
}

/// A request as the group's queue carries it. Every byte crosses from the
/// submitting core to the worker's (the worker's `pop` reads the whole
/// slot), so the large paged body is boxed: 192 bytes rather than 256.
#[derive(Debug)]
pub(crate) struct Submitted {
    pub(crate) id: TransferId,
    pub(crate) on_done: OnDone,
    pub(crate) body: Body,
    pub(crate) stamps: crate::probe::Stamps,
}

// See `Submitted` (the latency probe's stamps add to it).
#[cfg(all(target_pointer_width = "64", not(feature = "latency-probe")))]
const _: () = assert!(std::mem::size_of::<Submitted>() <= 192);

/// A paged write's body: page `i` of `src_pages` (in registration `src`)
/// to page `i` of `dst_pages` (in `dst`), `page_len` bytes each. Planned a
/// window of pages at a time (`core::paged`).
#[derive(Debug)]
pub(crate) struct PagedBody {
    pub(crate) page_len: u64,
    pub(crate) imm: Option<Imm>,
    pub(crate) src: u64,
    pub(crate) src_pages: Pages,
    pub(crate) dst: PlainDst,
    pub(crate) dst_pages: Pages,
}

/// The body of one submitted request.
#[derive(Debug)]
pub(crate) enum Body {
    Single {
        len: u64,
        imm: Option<Imm>,
        src: u64,
        src_off: u64,
        dst: PlainDst,
        dst_off: u64,
    },
    /// Boxed: the largest body by far (224 bytes), it would set the size
    /// of every request the queue carries from the submitting core to the
    /// worker's (see [`Submitted`]).
    Paged(Box<PagedBody>),
    Scatter {
        imm: Option<Imm>,
        src: u64,
        peers: u32,
        dsts: Dsts,
        mode: ScatterMode,
    },
    Barrier {
        imm: Imm,
        peers: u32,
        dsts: Dsts,
    },
    Send {
        peer: NetAddr,
        incarnation: Incarnation,
        payload: SendPayload,
    },
}

/// A descriptor's region and per-NIC rkeys as plain values, the part of
/// a [`PlainDst`] that travels instead of a cloned `MrDesc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DstKeys {
    /// The destination region's base address and length.
    pub(crate) base: u64,
    pub(crate) region_len: u64,
    /// How many of `rkeys` are valid (the descriptor's rkey count).
    pub(crate) nics: usize,
    pub(crate) rkeys: [Rkey; MAX_NICS],
}

impl DstKeys {
    /// `dst`'s region and rkeys; `None` when it has more rkeys than a
    /// group can have NICs.
    pub(crate) fn of(dst: &MrDesc) -> Option<Self> {
        if dst.rkeys.len() > MAX_NICS {
            return None;
        }
        let mut rkeys = [Rkey(0); MAX_NICS];
        for (nic, (_, rkey)) in dst.rkeys.iter().enumerate() {
            rkeys[nic] = *rkey;
        }
        Some(Self {
            base: dst.addr,
            region_len: dst.len,
            nics: dst.rkeys.len(),
            rkeys,
        })
    }

    /// The rkey of `nic`, if the descriptor has one.
    pub(crate) fn rkey(&self, nic: usize) -> Result<Rkey, EngineError> {
        self.rkeys
            .get(nic)
            .copied()
            .filter(|_| nic < self.nics)
            .ok_or_else(|| no_rkey(nic))
    }
}

/// The error of a destination without an rkey for `nic` (every kind of
/// destination: plain, routed, or resolved from its descriptor).
pub(crate) fn no_rkey(nic: usize) -> EngineError {
    EngineError::InvalidArgument {
        what: format!("destination has no rkey for NIC {nic}"),
    }
}

/// A scatter or barrier destination whose per-NIC NIC addresses were
/// matched, at submit, to the peer group member it goes to: plain values
/// only (no descriptor is cloned into the request queue), its NIC 0 rkey
/// inline and the others in the [`Routed::rkeys`] of its request. 56 bytes,
/// so a 64-peer scatter hands the worker 3.5 KiB of destinations rather
/// than the 7 KiB it took with a fixed `MAX_NICS` rkey array per
/// destination: those bytes cross from the submitting core to the worker's,
/// and each one costs. NIC 0's rkey inline keeps a one-NIC group's first
/// WRITE from waiting on a second line from the other core.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoutedDst {
    pub(crate) len: u64,
    pub(crate) src_offset: u64,
    pub(crate) dst_offset: u64,
    /// The destination region's base address and length.
    pub(crate) base: u64,
    pub(crate) region_len: u64,
    /// The rkey of NIC 0.
    rkey0: Rkey,
    /// Where its rkeys of NIC 1 and on start in [`Routed::rkeys`].
    rkey_at: u32,
    /// How many rkeys it has (the descriptor's count, at most `MAX_NICS`).
    pub(crate) nics: u32,
}

// What a 64-peer scatter hands the worker depends on it (see above).
const _: () = assert!(std::mem::size_of::<RoutedDst>() == 56);

/// The destinations of a scatter or barrier, each matched to its peer
/// group member ([`Routed::matched`]).
#[derive(Debug, Default, Clone)]
pub(crate) struct Routed {
    pub(crate) dsts: Vec<RoutedDst>,
    /// Every destination's rkeys of NIC 1 and on, by NIC, one destination
    /// after another.
    rkeys: Vec<Rkey>,
}

impl Routed {
    /// Room for `n` destinations of up to `nics` rkeys each.
    fn with_capacity(n: usize, nics: usize) -> Self {
        Routed {
            dsts: Vec::with_capacity(n),
            rkeys: Vec::with_capacity(n * nics.saturating_sub(1)),
        }
    }

    /// Appends `dst` as seen through `member`: `Some` when each of its
    /// rkeys' NIC addresses is `member`'s address of the same NIC, both
    /// name the same incarnation and it has at most `MAX_NICS` rkeys.
    pub(crate) fn matched(
        &mut self,
        member: &GroupAddress,
        dst: &MrDesc,
        len: u64,
        src_offset: u64,
        dst_offset: u64,
    ) -> Option<()> {
        if dst.rkeys.len() > MAX_NICS || dst.incarnation != member.incarnation {
            return None;
        }
        for (nic, (addr, _)) in dst.rkeys.iter().enumerate() {
            if member.nics.get(nic) != Some(addr) {
                return None;
            }
        }
        let rkey_at = u32::try_from(self.rkeys.len()).ok()?;
        let rkey0 = dst.rkeys.first().map_or(Rkey(0), |(_, k)| *k);
        self.rkeys.extend(dst.rkeys.iter().skip(1).map(|(_, k)| *k));
        self.dsts.push(RoutedDst {
            len,
            src_offset,
            dst_offset,
            base: dst.addr,
            region_len: dst.len,
            rkey0,
            rkey_at,
            nics: dst.rkeys.len() as u32,
        });
        Some(())
    }

    /// The rkey of destination `d` on `nic`, if its descriptor has one.
    pub(crate) fn rkey(&self, d: &RoutedDst, nic: usize) -> Result<Rkey, EngineError> {
        (nic < d.nics as usize)
            .then(|| match nic {
                0 => Some(d.rkey0),
                _ => self.rkeys.get(d.rkey_at as usize + nic - 1).copied(),
            })
            .flatten()
            .ok_or_else(|| no_rkey(nic))
    }
}

/// A single or paged write's destination with its NIC addresses interned
/// in the [`AddrBook`]: plain values only, nothing allocated per submit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlainDst {
    pub(crate) keys: DstKeys,
    /// The [`AddrBook`] id of each NIC's address (`keys.nics` valid).
    pub(crate) addrs: [u32; MAX_NICS],
}

impl PlainDst {
    /// `dst` with its addresses entered in `book`; `None` when it has more
    /// rkeys than a group can have NICs.
    pub(crate) fn new(dst: &MrDesc, book: &AddrBook) -> Option<Self> {
        let keys = DstKeys::of(dst)?;
        let addrs = book.ids(dst);
        Some(Self { keys, addrs })
    }
}

/// The destinations of a scatter or barrier.
#[derive(Debug)]
pub(crate) enum Dsts {
    /// Every descriptor matched its peer group member (the common case):
    /// the member's pre-resolved peers are used, nothing is looked up.
    Routed(Routed),
    /// Some descriptor names NIC addresses other than its member's: each
    /// destination is resolved by its descriptor's addresses.
    Described(Vec<ScatterDst>),
}

impl Dsts {
    pub(crate) fn len(&self) -> usize {
        match self {
            Dsts::Routed(r) => r.dsts.len(),
            Dsts::Described(v) => v.len(),
        }
    }
}

/// Matches every destination `(descriptor, len, src_offset, dst_offset)`
/// to its peer group member ([`Routed::matched`]); `None` if any does
/// not match (then the worker resolves descriptors by address). `nics`:
/// the rkeys per destination to make room for (the group's NIC count).
pub(crate) fn routed_dsts<'a>(
    members: &[GroupAddress],
    nics: usize,
    dsts: impl ExactSizeIterator<Item = (&'a MrDesc, u64, u64, u64)>,
) -> Option<Dsts> {
    // Sized up front: collecting into `Option<Vec<_>>` knows no length and
    // grew the vector four times for 64 destinations.
    let mut r = Routed::with_capacity(dsts.len().min(members.len()), nics);
    for ((d, len, so, doff), m) in dsts.zip(members) {
        r.matched(m, d, len, so, doff)?;
    }
    Some(Dsts::Routed(r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addrbook::tests::{addr, desc, INC};

    #[test]
    fn routed_dst_only_when_every_nic_matches() {
        let member = GroupAddress {
            nics: vec![addr(1), addr(2)],
            incarnation: INC,
        };
        let mut routed = Routed::default();
        routed
            .matched(&member, &desc(&[1, 2]), 8, 1, 2)
            .expect("matches");
        routed
            .matched(&member, &desc(&[1, 2]), 4, 0, 0)
            .expect("matches");
        let r = routed.dsts[0];
        assert_eq!((r.len, r.src_offset, r.dst_offset), (8, 1, 2));
        assert_eq!((r.base, r.region_len, r.nics), (0x1000, 64, 2));
        for d in &routed.dsts {
            assert_eq!(routed.rkey(d, 0).ok(), Some(Rkey(101)));
            assert_eq!(routed.rkey(d, 1).ok(), Some(Rkey(102)));
            assert!(routed.rkey(d, 2).is_err());
        }
        // Another member's NICs, NICs swapped, one NIC different, more
        // rkeys than the member has NICs: resolved by address instead.
        for d in [&[3, 4][..], &[2, 1], &[1, 3], &[1, 2, 3]] {
            assert!(
                Routed::default()
                    .matched(&member, &desc(d), 8, 0, 0)
                    .is_none(),
                "{d:?}"
            );
        }
        // The same addresses of another incarnation (a restart).
        let mut other = desc(&[1, 2]);
        other.incarnation = Incarnation(INC.0 + 1);
        assert!(Routed::default()
            .matched(&member, &other, 8, 0, 0)
            .is_none());
        let many = GroupAddress {
            nics: (0..=MAX_NICS as u8).map(addr).collect(),
            incarnation: INC,
        };
        let all: Vec<u8> = (0..=MAX_NICS as u8).collect();
        assert!(Routed::default()
            .matched(&many, &desc(&all), 8, 0, 0)
            .is_none());
    }
}
