//! The setup of one row group: the raw baseline, the buffers, and the
//! thread placement; engine pairs are built per round, so no engine thread
//! exists (idle workers poll the fabric every 20 µs) while the baseline
//! runs.

use crate::backend::Testbed;
use crate::engines::{EnginePair, PairBuffers};
use crate::pin::{self, PinGuard, Placement};
use crate::raw::RawPair;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A raw pair, buffers for engine pairs, and where every thread runs.
pub struct Rig<'a> {
    tb: &'a Testbed,
    bufs: Arc<PairBuffers>,
    place: Option<Placement>,
    live: Arc<AtomicUsize>,
    raw: RawPair,
    // Last: the bench thread leaves the submitter CPU after everything else
    // is gone.
    _submitter: PinGuard,
}

impl<'a> Rig<'a> {
    /// Pins the calling (bench) thread to the submitter CPU, opens the raw
    /// pair and builds (then drops) one engine pair, so setup errors show
    /// up here.
    pub fn new(
        tb: &'a Testbed,
        src_len: usize,
        dst_len: usize,
        place: Option<Placement>,
    ) -> Result<Self, String> {
        let submitter = PinGuard::new(place.map(|p| p.submitter));
        let bufs = Arc::new(PairBuffers::new(src_len, dst_len)?);
        let mut raw = RawPair::new(tb, src_len, dst_len)?;
        raw.set_target_cpu(place.map(|p| p.target));
        raw.set_worker_cpu(place.map(|p| p.initiator));
        drop(EnginePair::on(tb, &bufs, place.as_ref())?);
        Ok(Rig {
            tb,
            bufs,
            place,
            live: Arc::new(AtomicUsize::new(0)),
            raw,
            _submitter: submitter,
        })
    }

    /// A fresh engine pair for one round of weft (drop it before the
    /// baseline's round: [`Rig::raw`] refuses to run while one lives).
    pub fn engines(&self) -> Result<EnginePair, String> {
        EnginePair::on(self.tb, &self.bufs, self.place.as_ref()).map(|e| e.counted(&self.live))
    }

    /// Runs a round of the raw baseline on the initiator CPU, with no
    /// engine pair of this rig alive.
    pub fn raw<R>(
        &mut self,
        f: impl FnOnce(&mut RawPair) -> Result<R, String>,
    ) -> Result<R, String> {
        self.no_engines()?;
        let _pin = PinGuard::new(self.place.map(|p| p.initiator));
        f(&mut self.raw)
    }

    /// Runs a round of the raw baseline from the submitter CPU, where the
    /// bench thread stays (for [`RawPair::drive_handoff`], whose worker
    /// takes the initiator CPU), with no engine pair of this rig alive.
    pub fn raw_handoff<R>(
        &mut self,
        f: impl FnOnce(&mut RawPair) -> Result<R, String>,
    ) -> Result<R, String> {
        self.no_engines()?;
        f(&mut self.raw)
    }

    fn no_engines(&self) -> Result<(), String> {
        match self.live.load(Ordering::SeqCst) {
            0 => Ok(()),
            live => Err(format!(
                "bench bug: raw round started with {live} engine pair(s) alive"
            )),
        }
    }

    /// The raw pair, for its shape (lanes, largest write).
    pub fn raw_pair(&self) -> &RawPair {
        &self.raw
    }

    /// The placement, if pinned.
    pub fn placement(&self) -> Option<&Placement> {
        self.place.as_ref()
    }

    /// What rows record: the placement or `unpinned`.
    pub fn label(&self) -> String {
        pin::label(self.place.as_ref())
    }
}
