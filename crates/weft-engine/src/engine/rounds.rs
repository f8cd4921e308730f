//! The immediate half of the [`TransferEngine`] API: immediate values
//! (`alloc_imm`/`free_imm`) and `expect_imm_count` rounds over the engine's
//! [`ImmTable`](crate::imm::ImmTable).

use super::TransferEngine;
use crate::core::Event;
use crate::driver::CbMsg;
use crate::error::EngineError;
use crate::imm::{ArmError, ImmDone};
use crate::ondone::{DoneResult, OnDone};
use std::sync::atomic::Ordering;
use weft_transport::Imm;

impl TransferEngine {
    /// Allocates an immediate value of `0..imm_capacity`: the most recently
    /// freed one if any, else the lowest value never handed out. Values
    /// taken with [`reserve_imm`](Self::reserve_imm) are skipped. Fails
    /// with [`EngineError::ShutDown`] once the engine is shut down.
    pub fn alloc_imm(&self) -> Result<Imm, EngineError> {
        self.check_live()?;
        let capacity = self.inner.imms.capacity();
        let mut a = self.inner.imm_free.lock();
        if let Some(v) = a.free.pop() {
            a.mark(v);
            return Ok(v);
        }
        while a.next < capacity {
            let v = a.next;
            a.next += 1;
            if !a.is_used(v) {
                a.mark(v);
                return Ok(v);
            }
        }
        Err(EngineError::ImmExhausted { capacity })
    }

    /// Takes the specific value `imm` (of `0..imm_capacity`) for this
    /// caller, as [`alloc_imm`](Self::alloc_imm) would have handed it out;
    /// [`free_imm`](Self::free_imm) returns it. Fails with
    /// [`EngineError::ImmInUse`] if it is taken (allocated or reserved and
    /// not freed), with [`EngineError::ShutDown`] once the engine is shut
    /// down.
    ///
    /// This is how a value free on *every member of a peer group* is had:
    /// scatter and barrier send one immediate value to every member, and
    /// each member counts it in its own engine, so the value must be free
    /// on all of them. `alloc_imm` hands out values from the bottom of the
    /// range; the convention is that applications take group-wide values
    /// from the top down, by a rule every member computes the same way
    /// (e.g. `imm_capacity - 1 - k` for the `k`-th group-wide value of a
    /// deployment whose engines share one `imm_capacity`), and that every
    /// member reserves them. A clash with a value some member already uses
    /// is then a typed error on that member, never a silent miscount.
    pub fn reserve_imm(&self, imm: Imm) -> Result<(), EngineError> {
        self.check_live()?;
        let capacity = self.inner.imms.capacity();
        if imm >= capacity {
            return Err(EngineError::InvalidArgument {
                what: format!("immediate {imm} is outside 0..{capacity} (imm_capacity)"),
            });
        }
        let mut a = self.inner.imm_free.lock();
        if a.is_used(imm) {
            return Err(EngineError::ImmInUse { imm });
        }
        // A value handed out (or reserved) before and freed since waits in
        // the free list, wherever it lies in the range: take it out, or
        // `alloc_imm` would hand it out while reserved.
        if let Some(pos) = a.free.iter().position(|&v| v == imm) {
            a.free.swap_remove(pos);
        }
        a.mark(imm);
        Ok(())
    }

    /// `Err(ShutDown)` once [`shutdown`](Self::shutdown) has begun: a value
    /// handed out then could never be counted.
    fn check_live(&self) -> Result<(), EngineError> {
        if self.is_shut_down() {
            Err(EngineError::ShutDown)
        } else {
            Ok(())
        }
    }

    /// Size of the immediate value space (`0..imm_capacity`), from
    /// [`EngineConfig::imm_capacity`](crate::EngineConfig::imm_capacity).
    pub fn imm_capacity(&self) -> u32 {
        self.inner.imms.capacity()
    }

    /// Returns an immediate value to the allocator. Arrivals of it that no
    /// round consumed are reported as excess (to the excess handler, and in
    /// [`EngineStats::imm_excess`](crate::EngineStats::imm_excess)); an armed,
    /// unfired round fails with [`EngineError::InvalidArgument`].
    pub fn free_imm(&self, imm: Imm) {
        self.free_imm_counted(imm);
    }

    /// [`free_imm`](Self::free_imm), returning how many armed rounds it
    /// failed.
    pub(super) fn free_imm_counted(&self, imm: Imm) -> usize {
        let failed = self.reset_imm(imm, "freed");
        let mut a = self.inner.imm_free.lock();
        // Only values handed out and not yet freed return to the pool, so a
        // double free cannot make `alloc_imm` hand a value out twice.
        if a.is_used(imm) {
            a.unmark(imm);
            a.free.push(imm);
        }
        failed
    }

    /// Drops the unconsumed arrivals of `imm` (reported as excess) and
    /// fails the rounds armed on it (`what`: why, for the error); returns
    /// how many rounds it failed.
    pub(super) fn reset_imm(&self, imm: Imm, what: &str) -> usize {
        let (n, unfired) = self.inner.imms.reset(imm);
        let failed = unfired.len();
        self.report_excess(imm, n);
        for d in unfired {
            self.finish_imm(
                d,
                Err(EngineError::InvalidArgument {
                    what: format!("immediate {imm} {what} while armed"),
                }),
            );
        }
        failed
    }

    pub(super) fn report_excess(&self, imm: Imm, n: u64) {
        if n > 0 {
            self.inner.excess_total.fetch_add(n, Ordering::Relaxed);
            let _ = self.inner.cb_tx.send(CbMsg::Excess(imm, n));
        }
    }

    /// Reports a round: flags and counters here, callbacks on the callback
    /// thread.
    pub(super) fn finish_imm(&self, d: ImmDone, r: DoneResult) {
        if let Some(c) = d.resolve(r) {
            self.dispatch(c.into());
        }
    }

    pub(super) fn dispatch(&self, e: Event) {
        let _ = self.inner.cb_tx.send(CbMsg::Event(e));
    }

    /// Calls `cb` (on the callback thread) once `count` immediates `imm`
    /// have arrived, counting arrivals that came before this call. Fires
    /// exactly once, never early; `count == 0` fires at once. Re-arm after
    /// it fired for the next round. Fails if a round is already armed, and
    /// with [`EngineError::ImmCountTooLarge`] for a count over `u32::MAX`
    /// (the sum of [`ImmCounts`](crate::ImmCounts) results is a `u64`).
    /// At shutdown an unfired round gets `Err(ShutDown)`. While a round
    /// waits, idle workers poll without sleeping (see
    /// [`EngineConfig::idle_sleep`](crate::EngineConfig::idle_sleep)).
    pub fn expect_imm_count(
        &self,
        imm: Imm,
        count: u64,
        cb: impl FnOnce(DoneResult) + Send + 'static,
    ) -> Result<(), EngineError> {
        self.expect_imm_count_with(imm, count, OnDone::callback(cb))
    }

    /// [`expect_imm_count`](Self::expect_imm_count) reporting to any
    /// [`OnDone`]: a flag or a counter is set by the worker that counted the
    /// last immediate (or by this call, when early arrivals already reach
    /// `count`), with no hop through the callback thread. A refused arm
    /// drops `on_done` unresolved.
    pub fn expect_imm_count_with(
        &self,
        imm: Imm,
        count: u64,
        on_done: OnDone,
    ) -> Result<(), EngineError> {
        // Counts are `u64` like the `ImmCounts` that compute them; a round
        // holds at most `u32::MAX` arrivals (checked in `arm_round`).
        self.arm_round(imm, count, ImmDone::new(on_done, &self.inner.imm_waits))
    }

    /// Arms the round `d` (a `u64` count checked here); shared by the
    /// `expect_imm_count` calls.
    pub(super) fn arm_round(&self, imm: Imm, count: u64, d: ImmDone) -> Result<(), EngineError> {
        let count = u32::try_from(count).map_err(|_| EngineError::ImmCountTooLarge {
            imm,
            count,
            max: u32::MAX,
        })?;
        // Held until the round is in the table (or resolved): `shutdown`
        // waits for it before failing the armed rounds.
        let Some(_entered) = self.inner.arm_gate.enter() else {
            return Err(EngineError::ShutDown);
        };
        if count == 0 {
            if let Some(c) = d.resolve_unarmed(Ok(())) {
                self.dispatch(c.into());
            }
            return Ok(());
        }
        match self.inner.imms.arm(imm, count, d) {
            Ok(Some(d)) => {
                self.finish_imm(d, Ok(()));
                Ok(())
            }
            Ok(None) => {
                // The round waits: sleeping workers poll again now (see
                // `ImmWaits`).
                self.inner.imm_waits.arms.fetch_add(1, Ordering::SeqCst);
                for g in &self.inner.groups {
                    g.wake();
                }
                Ok(())
            }
            Err((ArmError::AlreadyArmed, _)) => Err(EngineError::ImmAlreadyArmed { imm }),
        }
    }

    /// Whether `imm` has an armed round that has not fired.
    pub fn imm_armed(&self, imm: Imm) -> bool {
        self.inner.imms.is_armed(imm)
    }

    /// [`expect_imm_count`](Self::expect_imm_count) rounds (of every value)
    /// armed whose callbacks have not run yet: a round counts from its arm
    /// until its callback returned, or was dropped unrun (a refused arm).
    /// While it is non-zero, idle workers poll without sleeping (see
    /// [`EngineConfig::idle_sleep`](crate::EngineConfig::idle_sleep)).
    pub fn armed_imm_rounds(&self) -> u64 {
        self.inner.imm_waits.armed.load(Ordering::SeqCst)
    }

    /// Arrivals of `imm` not yet consumed by a round.
    pub fn imm_pending(&self, imm: Imm) -> u64 {
        self.inner.imms.pending(imm)
    }
}
