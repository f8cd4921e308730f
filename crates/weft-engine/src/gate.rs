//! A gate that closes once: operations enter it and leave it; closing it
//! turns every later entry away and waits until the operations already
//! inside have left. `expect_imm_count` arms through one, so that an arm
//! racing `shutdown` is either refused or lands in the immediate table
//! before shutdown fails the table's rounds — never after, where nothing
//! would ever resolve it.
//!
//! The protocol is the classic store-then-load handshake with a `SeqCst`
//! fence between the two on each side: an entrant increments `inside`,
//! fences, then reads `closed`; the closer sets `closed`, fences, then reads
//! `inside`. The two fences are ordered in the single total order of
//! `SeqCst` operations, so at least one side sees the other's store: either
//! the entrant sees the gate closed (and backs out), or the closer sees it
//! inside (and waits for it). Fences rather than `SeqCst` accesses alone
//! because that is the form loom models exactly (it treats `SeqCst`
//! accesses as `AcqRel`). Model-checked with loom (`loom_model` below).

use crate::sync::{fence, spin, AtomicBool, AtomicUsize, Ordering};

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    closed: AtomicBool,
    inside: AtomicUsize,
}

/// Holds a place inside a [`Gate`] until dropped.
#[derive(Debug)]
pub(crate) struct Entered<'a>(&'a Gate);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    /// Enters, unless the gate is closed.
    pub(crate) fn enter(&self) -> Option<Entered<'_>> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        let entered = Entered(self);
        fence(Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        Some(entered)
    }

    /// Closes the gate (idempotent) and waits until every operation that
    /// entered before has left. Operations inside never block, so the wait
    /// is short; it must not be called from inside the gate.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        while self.inside.load(Ordering::SeqCst) != 0 {
            spin();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn entries_after_close_are_refused() {
        let g = Gate::default();
        let e = g.enter();
        assert!(e.is_some());
        drop(e);
        g.close();
        assert!(g.enter().is_none());
        assert_eq!(g.inside.load(Ordering::SeqCst), 0, "a refused entry leaves");
    }
}

/// `RUSTFLAGS="--cfg loom" cargo test -p weft-engine --lib --release gate::loom_model`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use crate::sync::Mutex;
    use ::loom::sync::Arc;
    use ::loom::thread;

    /// An entrant racing a closer that drains a table after closing: the
    /// entrant's item is either refused or in the table before the drain.
    #[test]
    fn nothing_lands_after_close() {
        ::loom::model(|| {
            let gate = Arc::new(Gate::default());
            let table = Arc::new(Mutex::new(Vec::new()));
            let (g2, t2) = (gate.clone(), table.clone());
            let entrant = thread::spawn(move || {
                if let Some(_in) = g2.enter() {
                    t2.lock().push(1u32);
                    true
                } else {
                    false
                }
            });
            gate.close();
            let drained = std::mem::take(&mut *table.lock());
            let accepted = entrant.join().unwrap();
            assert_eq!(drained.len(), usize::from(accepted));
            assert!(table.lock().is_empty(), "an item landed after the drain");
        });
    }
}
