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
    /// Allocates an immediate value (dense, from `0..imm_capacity`).
    pub fn alloc_imm(&self) -> Result<Imm, EngineError> {
        let mut a = self.inner.imm_free.lock();
        if let Some(v) = a.free.pop() {
            if let Some(u) = a.in_use.get_mut(v as usize) {
                *u = true;
            }
            return Ok(v);
        }
        if a.next < self.inner.imms.capacity() {
            let v = a.next;
            a.next += 1;
            a.in_use.push(true);
            return Ok(v);
        }
        Err(EngineError::ImmExhausted {
            capacity: self.inner.imms.capacity(),
        })
    }

    /// Returns an immediate value to the allocator. Arrivals of it that no
    /// round consumed are reported as excess (to the excess handler, and in
    /// [`EngineStats::imm_excess`](crate::EngineStats::imm_excess)); an armed,
    /// unfired round fails with [`EngineError::InvalidArgument`].
    pub fn free_imm(&self, imm: Imm) {
        let (n, unfired) = self.inner.imms.reset(imm);
        self.report_excess(imm, n);
        for d in unfired {
            self.finish_imm(
                d,
                Err(EngineError::InvalidArgument {
                    what: format!("immediate {imm} freed while armed"),
                }),
            );
        }
        let mut a = self.inner.imm_free.lock();
        // Only values handed out and not yet freed return to the pool, so a
        // double free cannot make `alloc_imm` hand a value out twice.
        if let Some(u) = a.in_use.get_mut(imm as usize) {
            if *u {
                *u = false;
                a.free.push(imm);
            }
        }
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
        if let Some((cb, r)) = d.resolve(r) {
            self.dispatch(Event::Done(cb, r));
        }
    }

    pub(super) fn dispatch(&self, e: Event) {
        let _ = self.inner.cb_tx.send(CbMsg::Event(e));
    }

    /// Calls `cb` (on the callback thread) once `count` immediates `imm`
    /// have arrived, counting arrivals that came before this call. Fires
    /// exactly once, never early; `count == 0` fires at once. Re-arm after
    /// it fired for the next round. Fails if a round is already armed.
    /// At shutdown an unfired round gets `Err(ShutDown)`. While a round
    /// waits, idle workers poll without sleeping (see
    /// [`EngineConfig::idle_sleep`](crate::EngineConfig::idle_sleep)).
    pub fn expect_imm_count(
        &self,
        imm: Imm,
        count: u32,
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
        count: u32,
        on_done: OnDone,
    ) -> Result<(), EngineError> {
        // Held until the round is in the table (or resolved): `shutdown`
        // waits for it before failing the armed rounds.
        let Some(_entered) = self.inner.arm_gate.enter() else {
            return Err(EngineError::ShutDown);
        };
        if count == 0 {
            if let Some((cb, r)) = on_done.resolve_inline(Ok(())) {
                self.dispatch(Event::Done(cb, r));
            }
            return Ok(());
        }
        let d = ImmDone::new(on_done, &self.inner.imm_waits);
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
