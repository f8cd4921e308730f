//! What a prefiller remembers of each decoder: its liveness, its grant,
//! and the window of request ids it used (see the core's module docs).

use crate::liveness::PeerClock;
use std::collections::BTreeMap;

/// Request ids remembered per decoder above its floor (ids taken out of
/// order, and cancels that came before their request).
pub const ID_WINDOW: usize = 1024;

/// What a decoder's id was used for (above its window's floor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    /// A request of this id was taken (served, refused or cancelled).
    Taken,
    /// Cancelled before its request came: the request is never served.
    Cancelled,
}

/// The ids a decoder used: all at or below `floor`, and `seen` above it.
#[derive(Debug, Clone, Default)]
pub(super) struct Ids {
    floor: u64,
    seen: BTreeMap<u64, Seen>,
}

/// Where an id stands in a decoder's window.
pub(super) enum IdState {
    /// At or below the floor.
    Old(u64),
    Seen(Seen),
    New,
}

impl Ids {
    pub(super) fn state(&self, id: u64) -> IdState {
        if id <= self.floor {
            return IdState::Old(self.floor);
        }
        match self.seen.get(&id) {
            Some(s) => IdState::Seen(*s),
            None => IdState::New,
        }
    }

    /// Records `id` as `s`: past [`ID_WINDOW`] ids the lowest go and the
    /// floor rises over them; contiguous taken ids fold into the floor.
    pub(super) fn mark(&mut self, id: u64, s: Seen) {
        if id <= self.floor {
            return;
        }
        self.seen.insert(id, s);
        while self.seen.len() > ID_WINDOW {
            if let Some((k, _)) = self.seen.pop_first() {
                self.floor = self.floor.max(k);
            }
        }
        while let Some(e) = self.seen.first_entry() {
            if Some(*e.key()) == self.floor.checked_add(1) && *e.get() == Seen::Taken {
                e.remove();
                self.floor += 1;
            } else {
                break;
            }
        }
    }
}

/// A decoder known to the prefiller.
#[derive(Debug, Clone)]
pub(super) struct Dec {
    pub(super) clock: PeerClock,
    /// The decoder's grant to this prefiller (0: unknown; only for an
    /// entry made by [`PrefillerCore::decoder_gone`], which sends nothing).
    pub(super) theirs: u64,
    pub(super) ids: Ids,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_folds_contiguous_ids_and_stays_bounded() {
        let mut ids = Ids::default();
        ids.mark(2, Seen::Taken);
        ids.mark(3, Seen::Cancelled);
        assert!(matches!(ids.state(1), IdState::New));
        ids.mark(1, Seen::Taken);
        // 1 and 2 fold into the floor; 3, a cancel, stays
        assert!(matches!(ids.state(2), IdState::Old(2)));
        assert!(matches!(ids.state(3), IdState::Seen(Seen::Cancelled)));
        ids.mark(3, Seen::Taken);
        assert!(matches!(ids.state(3), IdState::Old(3)));
        for id in 10..10 + ID_WINDOW as u64 + 5 {
            ids.mark(id, Seen::Cancelled);
        }
        assert_eq!(ids.seen.len(), ID_WINDOW);
        assert!(matches!(ids.state(14), IdState::Old(14)));
        assert!(matches!(ids.state(15), IdState::Seen(Seen::Cancelled)));
    }
}
