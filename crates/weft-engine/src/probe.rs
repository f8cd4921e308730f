//! Latency probe (cargo feature `latency-probe`): per-request timestamps
//! for the benchmark harness. Compiled out entirely when the feature is off.
//!
//! For every transfer the engine records, with [`std::time::Instant`]:
//! `submit` (entry of the `submit_*` call), `enqueued` (request pushed on
//! the group's queue), `pickup` (worker popped it), `first_wr` (first work
//! request accepted by the backend) and `all_posted` (last one accepted).
//! Records are pushed to a bounded lock-free sink when the last WR is
//! posted; [`crate::TransferEngine::take_probe_records`] drains it. When the
//! sink is full, records are dropped and counted in
//! [`ProbeSink::dropped`].

use crate::error::TransferId;
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Stamps taken on the submitting thread.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stamps {
    pub(crate) submit: Instant,
    pub(crate) enqueued: Instant,
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
