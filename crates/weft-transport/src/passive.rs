//! [`PassivePeers`]: for backends, the peers a remote made them create.

use crate::PeerId;
use std::collections::VecDeque;

/// The peers a backend created because a remote named an address the
/// backend was not asked to reach (a connection handshake, a message that
/// needs an answer), oldest first. Anyone who can reach a NIC can name any
/// address, so a backend bounds how many such peers it keeps and, at the
/// bound, evicts the oldest one it may (verbs: a half-open connection
/// whose handshakes ran out; libfabric: a peer with nothing in flight) or
/// refuses the newcomer. A peer leaves the list when it becomes a normal
/// one: the user adds its address, or (verbs) it connects.
///
/// The bound is the backend's (its config); this type only keeps the
/// order. Every operation is linear in the length, which the bound keeps
/// small.
#[derive(Debug, Default, Clone)]
pub struct PassivePeers {
    order: VecDeque<PeerId>,
}

impl PassivePeers {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Passive peers now.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether `peer` is passive.
    pub fn contains(&self, peer: PeerId) -> bool {
        self.order.contains(&peer)
    }

    /// Records `peer`, just created, as the newest passive peer (nothing if
    /// it is listed already).
    pub fn push(&mut self, peer: PeerId) {
        if !self.contains(peer) {
            self.order.push_back(peer);
        }
    }

    /// `peer` is no longer passive; whether it was.
    pub fn remove(&mut self, peer: PeerId) -> bool {
        match self.order.iter().position(|p| *p == peer) {
            Some(i) => {
                self.order.remove(i);
                true
            }
            None => false,
        }
    }

    /// The oldest passive peer for which `evictable` holds.
    pub fn oldest_where(&self, mut evictable: impl FnMut(PeerId) -> bool) -> Option<PeerId> {
        self.order.iter().copied().find(|p| evictable(*p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_membership_and_removal() {
        let mut l = PassivePeers::new();
        assert!(l.is_empty());
        for p in [3, 1, 2] {
            l.push(PeerId(p));
        }
        l.push(PeerId(1));
        assert_eq!(l.len(), 3, "a peer is listed once");
        assert!(l.contains(PeerId(2)));
        assert_eq!(l.oldest_where(|_| true), Some(PeerId(3)));
        assert_eq!(l.oldest_where(|p| p.0 != 3), Some(PeerId(1)));
        assert!(l.remove(PeerId(1)));
        assert!(!l.remove(PeerId(1)));
        assert!(!l.contains(PeerId(1)));
        assert_eq!(l.oldest_where(|p| p.0 != 3), Some(PeerId(2)));
        assert_eq!(l.oldest_where(|_| false), None);
    }
}
