//! Latency probe (cargo feature `latency-probe`): per-request timestamps
//! for the benchmark harness.
//!
//! The engine's hot path names three types only, [`Stamps`] (taken on the
//! submitting thread), [`TransferProbe`] (one per transfer slot) and
//! [`Probes`] (the engine's sink): with the feature they record, without it
//! they are zero-sized and every method is an empty inline function, so
//! the engine has no `cfg` of its own for the probe and nothing is left of
//! it in the build.
//!
//! For every transfer the engine records, with [`std::time::Instant`]:
//! `submit` (entry of the `submit_*` call), `enqueued` (request pushed on
//! the group's queue), `pickup` (worker popped it), `first_wr` (first work
//! request accepted by the backend) and `all_posted` (last one accepted).
//! Records are pushed to a bounded lock-free sink when the last WR is
//! posted; [`crate::TransferEngine::take_probe_records`] drains it. When the
//! sink is full, records are dropped and counted in
//! [`ProbeSink::dropped`].

#[cfg(feature = "latency-probe")]
pub use on::{ProbeSink, Record};
#[cfg(feature = "latency-probe")]
pub(crate) use on::{Probes, Stamps, TransferProbe};

#[cfg(not(feature = "latency-probe"))]
pub(crate) use off::{Probes, Stamps, TransferProbe};

/// The probe compiled out: zero-sized types, empty methods.
#[cfg(not(feature = "latency-probe"))]
mod off {
    use crate::error::TransferId;

    /// Stamps taken on the submitting thread (none).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Stamps;

    impl Stamps {
        #[inline(always)]
        pub(crate) fn now() -> Self {
            Stamps
        }
        #[inline(always)]
        pub(crate) fn enqueued(&mut self) {}
    }

    /// One transfer's record (none).
    #[derive(Debug, Clone, Copy, Default)]
    pub(crate) struct TransferProbe;

    impl TransferProbe {
        #[inline(always)]
        pub(crate) fn new() -> Self {
            TransferProbe
        }
        #[inline(always)]
        pub(crate) fn start(_: TransferId, _: Stamps) -> Self {
            TransferProbe
        }
        #[inline(always)]
        pub(crate) fn posted(&mut self, _nic: usize, _k: u32, _last: bool, _to: &Probes) {}
        #[inline(always)]
        pub(crate) fn all_posted_at_release(&mut self, _to: &Probes) {}
    }

    /// The engine's sink (none).
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Probes;

    impl Probes {
        pub(crate) fn new() -> Self {
            Probes
        }
    }
}

#[cfg(feature = "latency-probe")]
mod on {
    use crate::error::TransferId;
    use crossbeam_queue::ArrayQueue;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    /// Stamps taken on the submitting thread.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Stamps {
        submit: Instant,
        enqueued: Instant,
    }

    impl Stamps {
        /// At the entry of a `submit_*` call.
        pub(crate) fn now() -> Self {
            let now = Instant::now();
            Stamps {
                submit: now,
                enqueued: now,
            }
        }

        /// Pushed onto the request queue (now).
        pub(crate) fn enqueued(&mut self) {
            self.enqueued = Instant::now();
        }
    }

    /// One transfer's record, kept in its slot while it is posted.
    #[derive(Debug, Clone, Copy, Default)]
    pub(crate) struct TransferProbe(Record);

    impl TransferProbe {
        /// A slot's record before its transfer starts.
        pub(crate) fn new() -> Self {
            Self::default()
        }

        /// The worker picked the transfer up (now).
        pub(crate) fn start(transfer: TransferId, s: Stamps) -> Self {
            TransferProbe(Record::start(transfer, s))
        }

        /// `k` WRs accepted by NIC `nic`; `last`: nothing of the transfer is
        /// left to post, and the record goes to `to`.
        pub(crate) fn posted(&mut self, nic: usize, k: u32, last: bool, to: &Probes) {
            if let Some(n) = self.0.wrs_per_nic.get_mut(nic) {
                *n = n.saturating_add(k);
            }
            self.0.posted(last);
            if last {
                to.0.push(self.0);
            }
        }

        /// The last planning hold went after every piece was posted: "all
        /// posted" is now. A transfer that posted nothing is not recorded.
        pub(crate) fn all_posted_at_release(&mut self, to: &Probes) {
            if self.0.first_wr.is_some() {
                self.0.posted(true);
                to.0.push(self.0);
            }
        }
    }

    /// The engine's sink of finished records, shared by its workers.
    #[derive(Debug, Clone)]
    pub(crate) struct Probes(Arc<ProbeSink>);

    impl Default for Probes {
        fn default() -> Self {
            Probes(Arc::new(ProbeSink::new(1 << 20)))
        }
    }

    impl Probes {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        pub(crate) fn drain(&self) -> Vec<Record> {
            self.0.drain()
        }
    }

    /// The timestamps of one transfer.
    #[derive(Debug, Clone, Copy)]
    pub struct Record {
        /// The transfer.
        pub transfer: TransferId,
        /// `submit_*` entered.
        pub submit: Instant,
        /// Pushed onto the request queue.
        pub enqueued: Instant,
        /// Popped by the worker.
        pub pickup: Instant,
        /// First WR accepted by the backend.
        pub first_wr: Option<Instant>,
        /// Last WR accepted by the backend.
        pub all_posted: Option<Instant>,
        /// WRs of this transfer each NIC of the group accepted, by NIC index:
        /// how a sharded write or a scatter was spread.
        pub wrs_per_nic: [u32; crate::MAX_NICS],
    }

    impl Default for Record {
        fn default() -> Self {
            let now = Instant::now();
            Self {
                transfer: TransferId(0),
                submit: now,
                enqueued: now,
                pickup: now,
                first_wr: None,
                all_posted: None,
                wrs_per_nic: [0; crate::MAX_NICS],
            }
        }
    }

    impl Record {
        pub(crate) fn start(transfer: TransferId, s: Stamps) -> Self {
            Self {
                transfer,
                submit: s.submit,
                enqueued: s.enqueued,
                pickup: Instant::now(),
                first_wr: None,
                all_posted: None,
                wrs_per_nic: [0; crate::MAX_NICS],
            }
        }

        /// One more WR accepted; `last`: it was the transfer's last. The clock
        /// is read only for the first and the last WR: a paged transfer posts
        /// thousands, and a clock read each was a fifth of the worker's time.
        pub(crate) fn posted(&mut self, last: bool) {
            if self.first_wr.is_some() && !last {
                return;
            }
            let now = Instant::now();
            if self.first_wr.is_none() {
                self.first_wr = Some(now);
            }
            if last {
                self.all_posted = Some(now);
            }
        }
    }

    /// Where finished records go.
    #[derive(Debug)]
    pub struct ProbeSink {
        q: ArrayQueue<Record>,
        dropped: AtomicU64,
    }

    impl ProbeSink {
        pub(crate) fn new(cap: usize) -> Self {
            Self {
                q: ArrayQueue::new(cap.max(1)),
                dropped: AtomicU64::new(0),
            }
        }

        pub(crate) fn push(&self, r: Record) {
            if self.q.push(r).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }

        pub(crate) fn drain(&self) -> Vec<Record> {
            let mut v = Vec::with_capacity(self.q.len());
            while let Some(r) = self.q.pop() {
                v.push(r);
            }
            v
        }

        /// Records dropped because the sink was full.
        pub fn dropped(&self) -> u64 {
            self.dropped.load(Ordering::Relaxed)
        }
    }
}
