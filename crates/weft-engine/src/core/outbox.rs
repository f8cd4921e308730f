//! What the core hands out: events for the driver, and the successful
//! finishes of counted transfers, bumped in runs.

use super::Event;
use crate::ondone::{runs, DoneCounter};
use std::sync::Arc;

/// Events produced since the driver last took them, and counter bumps held
/// back until then.
#[derive(Default)]
pub(super) struct Outbox {
    events: Vec<Event>,
    /// Counters of transfers that finished successfully since the last
    /// [`Outbox::flush_counts`], one entry per transfer, in finishing order.
    counts: Vec<Arc<DoneCounter>>,
}

impl Outbox {
    /// Queues an event for the driver.
    pub(super) fn push(&mut self, e: Event) {
        self.events.push(e);
    }

    /// Records a successful finish of a transfer counted by `c` (bumped by
    /// the next [`Outbox::flush_counts`]).
    pub(super) fn count_ok(&mut self, c: Arc<DoneCounter>) {
        self.counts.push(c);
    }

    /// Bumps the counters of the transfers that finished successfully
    /// since the last call: one add per run of the same counter, then the
    /// transfers' references to it dropped together. The counter's cache
    /// line then crosses to this thread once per run rather than once per
    /// transfer (its submitter takes it back for every `OnDone::counter`
    /// clone and every read of the count). The core calls it after each
    /// NIC's completions and with every hand-over of events (at the end of
    /// every worker lap, before the lap's events go to the callback
    /// thread), so a bump waits at most for the rest of that lap.
    #[inline]
    pub(super) fn flush_counts(&mut self) {
        if !self.counts.is_empty() {
            self.bump_counts();
        }
    }

    #[inline(never)]
    fn bump_counts(&mut self) {
        // Taken out first: were an add to panic, the runs after it would be
        // dropped uncounted, never counted twice by the failure path's
        // flush.
        let mut counts = std::mem::take(&mut self.counts);
        for (c, n) in runs(&counts) {
            c.add_ok(n as u64);
        }
        counts.clear();
        self.counts = counts;
    }

    /// Every counter bump held back, then the events (appended to `out`,
    /// oldest first).
    pub(super) fn take(&mut self, out: &mut Vec<Event>) {
        self.flush_counts();
        out.append(&mut self.events);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn counts_wait_for_a_flush_and_runs_are_bumped_once_each() {
        let (a, b) = (Arc::new(DoneCounter::new()), Arc::new(DoneCounter::new()));
        let mut o = Outbox::default();
        for c in [&a, &a, &b, &a] {
            o.count_ok(Arc::clone(c));
        }
        assert_eq!((a.ok(), b.ok()), (0, 0), "held back until a flush");
        o.flush_counts();
        assert_eq!((a.ok(), b.ok()), (3, 1));
        // The references went with the flush.
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1));
        o.flush_counts();
        assert_eq!((a.ok(), b.ok()), (3, 1), "nothing counted twice");
    }

    #[test]
    fn take_flushes_the_counts_and_hands_over_events_in_order() {
        let c = Arc::new(DoneCounter::new());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut o = Outbox::default();
        for i in 0..3 {
            let s = Arc::clone(&seen);
            o.push(Event::Done(
                Box::new(move |_| s.lock().unwrap().push(i)),
                Ok(()),
            ));
            o.count_ok(Arc::clone(&c));
        }
        let mut out = Vec::new();
        o.take(&mut out);
        assert_eq!(c.ok(), 3, "bumped before the events are handed over");
        assert_eq!(out.len(), 3);
        for e in out {
            let Event::Done(cb, r) = e else {
                panic!("a Done event")
            };
            cb(r);
        }
        assert_eq!(*seen.lock().unwrap(), [0, 1, 2]);
        let mut again = Vec::new();
        o.take(&mut again);
        assert!(again.is_empty(), "handed over once");
    }
}
