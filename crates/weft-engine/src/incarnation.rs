//! Incarnations: which engine instance answers at a remote NIC address.
//!
//! Every engine draws its own [`Incarnation`] at build time
//! ([`fresh`]; [`EngineBuilder::incarnation`](crate::EngineBuilder::incarnation)
//! overrides it) and puts it into what peers hold: its
//! [`GroupAddress`](crate::GroupAddress)es and [`MrDesc`](crate::MrDesc)s.
//!
//! On the receiving side, [`Incarnations`] (one per engine, shared by its
//! workers) binds each remote NIC address to at most one live incarnation
//! and remembers the `(address, incarnation)` pairs removed with
//! `TransferEngine::remove_peer`. A worker asks it ([`Incarnations::admit`])
//! only when it resolves a destination to a domain peer (once per address,
//! incarnation and NIC, then cached), never per WR.
//!
//! **Who may say a peer restarted.** An incarnation number in a
//! descriptor or group address is a claim made by bytes that came from a
//! file, a store or a socket, not by the peer: it can be stale, damaged or
//! forged. So a claim never ends the incarnation bound to an address. A
//! *newer* incarnation named at a bound address is only adopted once the
//! bound one is known to have ended:
//! * it was removed (`TransferEngine::remove_peer`), or
//! * the transport reported it unreachable: a WR to it failed with
//!   `TransportError::PeerUnreachable` ([`Incarnations::unreachable`]).
//!
//! Until then the newer one is refused ([`Refused::Unproven`], the
//! engine's `EngineError::IncarnationUnproven`) for the transfer or peer
//! group that named it, and the bound one keeps working. Once adopted, the
//! newer one replaces the bound one and bumps [`Incarnations::epoch`]; each
//! worker compares the epoch (one atomic load) before it takes a request or
//! a control message and, when it moved, drops its peers that are no longer
//! live (see `core::lifecycle`). An older incarnation than the bound one is
//! refused ([`Refused::Replaced`]); a removed one for good
//! ([`Refused::Removed`]). The first incarnation named at an address never
//! seen before binds it: there is nothing to compare it with.

use crossbeam_utils::CachePadded;
use parking_lot::RwLock;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use weft_transport::{Incarnation, NetAddr};

/// Low bits of a fresh incarnation that are not wall-clock time.
const MIX_BITS: u32 = 16;

/// The largest incarnation [`fresh`] handed out in this process.
static LAST: AtomicU64 = AtomicU64::new(0);

/// A new incarnation for an engine built now: the wall clock in
/// nanoseconds since the Unix epoch with its low 16 bits replaced by a mix
/// of the process id (so two processes built in the same 65 µs window
/// differ), and strictly larger than every incarnation this process drew
/// before. So a process restarted on the same host orders after its
/// predecessor as long as the host clock does not step back by more than
/// the time between the two builds; tests that need fixed values set them
/// with [`EngineBuilder::incarnation`](crate::EngineBuilder::incarnation).
pub(crate) fn fresh() -> Incarnation {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    let pid = u64::from(std::process::id());
    let mix = pid.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - MIX_BITS);
    let candidate = (now & !((1 << MIX_BITS) - 1)) | mix;
    let prev = LAST
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(candidate.max(last.saturating_add(1)))
        })
        .unwrap_or(0);
    Incarnation(candidate.max(prev.saturating_add(1)))
}

/// Why [`Incarnations::admit`] refused an incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Removed with `TransferEngine::remove_peer`.
    Removed,
    /// Older than the incarnation bound to the address (`.0`).
    Replaced(Incarnation),
    /// Newer than the incarnation bound to the address (`.0`), which is
    /// not known to have ended: a claim nothing has confirmed.
    Unproven(Incarnation),
}

#[derive(Debug, Default)]
struct Table {
    /// The live (or last removed) incarnation at each remote NIC address.
    bound: BTreeMap<NetAddr, Incarnation>,
    /// `(address, incarnation)` pairs removed with `remove_peer`.
    removed: BTreeSet<(NetAddr, Incarnation)>,
    /// Bound `(address, incarnation)` pairs the transport reported
    /// unreachable: a newer incarnation named there may replace them.
    unreachable: BTreeSet<(NetAddr, Incarnation)>,
}

impl Table {
    /// Whether the incarnation bound at `addr`, `b`, is known to have
    /// ended (removed, or reported unreachable by the transport).
    fn ended(&self, addr: &NetAddr, b: Incarnation) -> bool {
        let k = (addr.clone(), b);
        self.removed.contains(&k) || self.unreachable.contains(&k)
    }
}

/// The engine-wide table of remote incarnations (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Incarnations {
    table: RwLock<Table>,
    /// Bumped whenever a bound incarnation stops being live (replaced by a
    /// newer one or removed). Every worker reads it on every lap, so it
    /// sits on a cache line of its own: it was 8 bytes from the lock of
    /// the `AddrBook`'s index (the field after this one in the book),
    /// which every submit takes, so for most allocation offsets a submit
    /// could cost the worker a miss on its next lap and the submitter one
    /// on its next submit (the cost is not measured separately).
    epoch: CachePadded<AtomicU64>,
}

impl Incarnations {
    /// Whether `inc` may be used at `addr`: `Ok` when it is (now) the live
    /// incarnation there. An address not seen before is bound to `inc`; a
    /// newer incarnation replaces the bound one (bumping the epoch) only
    /// if the bound one is known to have ended, and is refused as
    /// [`Refused::Unproven`] otherwise. A removed or older one is refused.
    pub(crate) fn admit(&self, addr: &NetAddr, inc: Incarnation) -> Result<(), Refused> {
        {
            let t = self.table.read();
            if t.removed.contains(&(addr.clone(), inc)) {
                return Err(Refused::Removed);
            }
            match t.bound.get(addr) {
                Some(&b) if b == inc => return Ok(()),
                Some(&b) if b > inc => return Err(Refused::Replaced(b)),
                Some(&b) if !t.ended(addr, b) => return Err(Refused::Unproven(b)),
                _ => {}
            }
        }
        let mut t = self.table.write();
        if t.removed.contains(&(addr.clone(), inc)) {
            return Err(Refused::Removed);
        }
        match t.bound.get(addr).copied() {
            Some(b) if b == inc => Ok(()),
            Some(b) if b > inc => Err(Refused::Replaced(b)),
            Some(b) if !t.ended(addr, b) => Err(Refused::Unproven(b)),
            old => {
                t.bound.insert(addr.clone(), inc);
                if let Some(old) = old {
                    let key = (addr.clone(), old);
                    let was_live = !t.removed.contains(&key);
                    t.unreachable.remove(&key);
                    tracing::info!(
                        peer = %addr, old = %old, new = %inc,
                        "a newer incarnation replaces one that ended at this address"
                    );
                    if was_live {
                        self.epoch.fetch_add(1, Ordering::Release);
                    }
                }
                Ok(())
            }
        }
    }

    /// The transport reported `inc` at `addr` unreachable (a WR to it
    /// failed with `PeerUnreachable`): if it is the bound incarnation, a
    /// newer one named there from now on replaces it. Nothing else
    /// changes: the bound one stays live until then.
    pub(crate) fn unreachable(&self, addr: &NetAddr, inc: Incarnation) {
        let key = (addr.clone(), inc);
        {
            let t = self.table.read();
            if t.bound.get(addr) != Some(&inc) || t.ended(addr, inc) {
                return;
            }
        }
        let mut t = self.table.write();
        if t.bound.get(addr) == Some(&inc) && !t.removed.contains(&key) && t.unreachable.insert(key)
        {
            tracing::debug!(peer = %addr, incarnation = %inc,
                "the transport reported this incarnation unreachable: a newer one may replace it");
        }
    }

    /// Records that `inc` at `addr` was removed: refused from now on. An
    /// incarnation older than `inc` bound there stops being live as well
    /// (the application says a newer one existed).
    pub(crate) fn remove(&self, addr: &NetAddr, inc: Incarnation) {
        let mut t = self.table.write();
        let fresh = t.removed.insert((addr.clone(), inc));
        let bound = t.bound.get(addr).copied();
        if bound.is_none_or(|b| b < inc) {
            t.bound.insert(addr.clone(), inc);
            if let Some(b) = bound {
                t.unreachable.remove(&(addr.clone(), b));
            }
        }
        t.unreachable.remove(&(addr.clone(), inc));
        if fresh && bound.is_some_and(|b| b <= inc) {
            self.epoch.fetch_add(1, Ordering::Release);
        }
    }

    /// Whether `inc` is the live incarnation at `addr` (bound and not
    /// removed).
    pub(crate) fn is_live(&self, addr: &NetAddr, inc: Incarnation) -> bool {
        let t = self.table.read();
        t.bound.get(addr) == Some(&inc) && !t.removed.contains(&(addr.clone(), inc))
    }

    /// Whether `inc` at `addr` was removed.
    pub(crate) fn is_removed(&self, addr: &NetAddr, inc: Incarnation) -> bool {
        self.table.read().removed.contains(&(addr.clone(), inc))
    }

    /// Changes whenever a bound incarnation stops being live.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(b: u8) -> NetAddr {
        NetAddr(vec![b; 4])
    }

    /// The rules: first sight binds; the same incarnation is admitted; an
    /// older one is refused; a newer one is unproven (refused, nothing
    /// changes) while the bound one has not ended, and replaces it (epoch
    /// moves, the old is no longer live) once the transport reported it
    /// unreachable or it was removed; a removed one is refused for good
    /// while a later one at the same address is admitted; other addresses
    /// are unaffected.
    #[test]
    fn newer_replaces_only_an_ended_incarnation() {
        let t = Incarnations::default();
        let e0 = t.epoch();
        assert_eq!(t.admit(&a(1), Incarnation(5)), Ok(()));
        assert_eq!(t.admit(&a(1), Incarnation(5)), Ok(()));
        assert_eq!(t.epoch(), e0, "binding a fresh address replaces nothing");
        assert!(t.is_live(&a(1), Incarnation(5)));
        assert_eq!(
            t.admit(&a(1), Incarnation(4)),
            Err(Refused::Replaced(Incarnation(5)))
        );
        // A claim of a newer incarnation changes nothing.
        for claim in [6, 7, u64::MAX] {
            assert_eq!(
                t.admit(&a(1), Incarnation(claim)),
                Err(Refused::Unproven(Incarnation(5)))
            );
        }
        assert_eq!(t.epoch(), e0);
        assert!(t.is_live(&a(1), Incarnation(5)));
        // The transport's word about another incarnation changes nothing.
        t.unreachable(&a(1), Incarnation(6));
        assert_eq!(
            t.admit(&a(1), Incarnation(7)),
            Err(Refused::Unproven(Incarnation(5)))
        );
        // About the bound one: a newer one may now replace it.
        t.unreachable(&a(1), Incarnation(5));
        assert!(
            t.is_live(&a(1), Incarnation(5)),
            "still live until replaced"
        );
        assert_eq!(t.admit(&a(1), Incarnation(5)), Ok(()));
        assert_eq!(t.admit(&a(1), Incarnation(7)), Ok(()));
        let e1 = t.epoch();
        assert_ne!(e1, e0, "a replacement moves the epoch");
        assert!(!t.is_live(&a(1), Incarnation(5)));
        assert!(t.is_live(&a(1), Incarnation(7)));
        assert_eq!(
            t.admit(&a(1), Incarnation(5)),
            Err(Refused::Replaced(Incarnation(7)))
        );
        // The new one starts with a clean record.
        assert_eq!(
            t.admit(&a(1), Incarnation(9)),
            Err(Refused::Unproven(Incarnation(7)))
        );
        t.remove(&a(1), Incarnation(7));
        let e2 = t.epoch();
        assert_ne!(e2, e1, "removing the live incarnation moves the epoch");
        assert!(!t.is_live(&a(1), Incarnation(7)));
        assert_eq!(t.admit(&a(1), Incarnation(7)), Err(Refused::Removed));
        t.remove(&a(1), Incarnation(7));
        assert_eq!(t.epoch(), e2, "removing twice is a no-op");
        assert_eq!(t.admit(&a(1), Incarnation(8)), Ok(()));
        assert_eq!(t.epoch(), e2, "replacing a removed one ends nothing live");
        assert!(t.is_live(&a(1), Incarnation(8)));
        assert_eq!(t.admit(&a(1), Incarnation(7)), Err(Refused::Removed));
        assert_eq!(t.admit(&a(2), Incarnation(1)), Ok(()), "other address");
        // Removing an incarnation newer than the bound one ends the bound
        // one too (the application says so); removing an older one leaves
        // the bound one live.
        t.remove(&a(2), Incarnation(3));
        assert!(!t.is_live(&a(2), Incarnation(1)));
        assert_eq!(
            t.admit(&a(2), Incarnation(1)),
            Err(Refused::Replaced(Incarnation(3)))
        );
        assert_eq!(t.admit(&a(2), Incarnation(4)), Ok(()));
        t.remove(&a(2), Incarnation(2));
        assert!(t.is_live(&a(2), Incarnation(4)));
    }

    /// Fresh incarnations strictly increase within a process and carry the
    /// wall clock in their high bits.
    #[test]
    fn fresh_incarnations_increase() {
        let mut last = fresh();
        for _ in 0..1000 {
            let next = fresh();
            assert!(next > last, "{next} after {last}");
            last = next;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        assert!(
            last.0 >> 32 <= now >> 32,
            "{last} is not from the wall clock"
        );
        assert!(last.0 > (1 << 60), "{last} is not from the wall clock");
    }
}
