//! Owned engine resources: a [`Registration`] deregisters its memory and an
//! [`ImmLease`] returns its immediate value when dropped, so no early return
//! or panic in an application leaks NIC-registered memory or an immediate.
//!
//! Both hold the engine weakly: a guard never keeps an engine alive, and a
//! guard dropped after its engine shut down (or was dropped) has nothing left
//! to release. Drop cannot report errors, so each guard also has an explicit
//! `release` that does.

use super::{Inner, TransferEngine};
use crate::error::EngineError;
use crate::mem::MrHandle;
use std::sync::{Arc, Weak};
use weft_transport::{Imm, MemRegion, MrDesc};

/// Memory registered with a [`TransferEngine`]: the local handle submits take
/// as their source, and the descriptor peers need to write into it.
/// Deregistered when dropped (or by [`Registration::release`], which reports
/// errors).
///
/// Made by [`TransferEngine::register`] and [`TransferEngine::register_on`].
#[derive(Debug)]
#[must_use = "dropping a Registration deregisters its memory at once"]
pub struct Registration {
    engine: Weak<Inner>,
    handle: MrHandle,
    desc: MrDesc,
    live: bool,
}

impl Registration {
    /// The local handle: pass it to submits as the source (or local target).
    pub fn handle(&self) -> MrHandle {
        self.handle
    }

    /// The descriptor peers need to write into this memory (serializable).
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }

    /// Deregisters the memory now, reporting what went wrong. An engine
    /// that has shut down (or no longer exists) has released every
    /// registration already: that is `Ok`.
    pub fn release(mut self) -> Result<(), EngineError> {
        self.live = false;
        match self.engine.upgrade() {
            Some(inner) => match (TransferEngine { inner }).unreg_mr(self.handle) {
                Err(EngineError::ShutDown) => Ok(()),
                r => r,
            },
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        if let Some(inner) = self.engine.upgrade() {
            match (TransferEngine { inner }).unreg_mr(self.handle) {
                Ok(()) | Err(EngineError::ShutDown) => {}
                Err(e) => tracing::warn!(
                    addr = self.handle.addr(),
                    len = self.handle.len(),
                    group = self.handle.group(),
                    error = %e,
                    "dropped registration failed to deregister"
                ),
            }
        }
    }
}

/// An immediate value taken from a [`TransferEngine`]'s allocator (by
/// [`TransferEngine::lease_imm`] or [`TransferEngine::lease_imm_value`]),
/// returned to it when dropped or by [`ImmLease::release`].
///
/// Returning a value reports its unconsumed arrivals as excess and fails a
/// round still armed on it, exactly like [`TransferEngine::free_imm`]: keep
/// the lease for as long as rounds on the value are armed.
#[derive(Debug)]
#[must_use = "dropping an ImmLease returns its value at once"]
pub struct ImmLease {
    engine: Weak<Inner>,
    imm: Imm,
    live: bool,
}

impl ImmLease {
    /// The immediate value.
    pub fn value(&self) -> Imm {
        self.imm
    }

    /// Returns the value now. Fails with [`EngineError::InvalidArgument`]
    /// when rounds were still armed on it (they fail, as with
    /// [`TransferEngine::free_imm`]); the value is returned either way. An
    /// engine that no longer exists has nothing to return: `Ok`.
    pub fn release(mut self) -> Result<(), EngineError> {
        self.live = false;
        let Some(inner) = self.engine.upgrade() else {
            return Ok(());
        };
        match (TransferEngine { inner }).free_imm_counted(self.imm) {
            0 => Ok(()),
            n => Err(EngineError::InvalidArgument {
                what: format!(
                    "immediate {} released while {n} round(s) were armed on it",
                    self.imm
                ),
            }),
        }
    }
}

impl ImmLease {
    /// Starts the value afresh, keeping it: arrivals no round consumed are
    /// dropped (reported as excess) and rounds armed on it fail. For
    /// clearing partial counts after a failed step. Returns how many armed
    /// rounds it failed.
    pub fn reset(&self) -> usize {
        match self.engine.upgrade() {
            Some(inner) => (TransferEngine { inner }).reset_imm(self.imm, "reset"),
            None => 0,
        }
    }
}

impl Drop for ImmLease {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        if let Some(inner) = self.engine.upgrade() {
            (TransferEngine { inner }).free_imm(self.imm);
        }
    }
}

impl TransferEngine {
    fn weak(&self) -> Weak<Inner> {
        Arc::downgrade(&self.inner)
    }

    /// [`TransferEngine::reg_mr`] as an owned [`Registration`]: the memory
    /// is deregistered when the registration is dropped.
    pub fn register(&self, region: MemRegion) -> Result<Registration, EngineError> {
        let g = self.group_for(region.device())?;
        self.register_on(g, region)
    }

    /// [`TransferEngine::reg_mr_on`] as an owned [`Registration`].
    pub fn register_on(&self, g: usize, region: MemRegion) -> Result<Registration, EngineError> {
        let (handle, desc) = self.reg_mr_on(g, region)?;
        Ok(self.own_registration(handle, desc))
    }

    /// [`TransferEngine::reg_mr_direct`] as an owned [`Registration`]: fails
    /// instead of registering memory that would be staged.
    pub fn register_direct(&self, region: MemRegion) -> Result<Registration, EngineError> {
        let (handle, desc) = self.reg_mr_direct(region)?;
        Ok(self.own_registration(handle, desc))
    }

    fn own_registration(&self, handle: MrHandle, desc: MrDesc) -> Registration {
        Registration {
            engine: self.weak(),
            handle,
            desc,
            live: true,
        }
    }

    /// [`TransferEngine::alloc_imm`] as an owned [`ImmLease`]: the value
    /// returns to the allocator when the lease is dropped. Fails as
    /// `alloc_imm` does ([`EngineError::ShutDown`] after shutdown).
    pub fn lease_imm(&self) -> Result<ImmLease, EngineError> {
        let imm = self.alloc_imm()?;
        Ok(self.own_imm(imm))
    }

    /// [`TransferEngine::reserve_imm`] as an owned [`ImmLease`]: takes the
    /// specific value `imm` (a group-wide value, see `reserve_imm`). Fails
    /// as `reserve_imm` does.
    pub fn lease_imm_value(&self, imm: Imm) -> Result<ImmLease, EngineError> {
        self.reserve_imm(imm)?;
        Ok(self.own_imm(imm))
    }

    fn own_imm(&self, imm: Imm) -> ImmLease {
        ImmLease {
            engine: self.weak(),
            imm,
            live: true,
        }
    }
}

/// Registrations and immediate leases owned together and released
/// together: what a component sets up on an engine (its buffers'
/// registrations, its reserved immediates), so that one early return in
/// its set-up, or dropping it, releases all of it.
///
/// Dropping it returns the immediates, then deregisters the memory (in
/// the order they were taken); [`Resources::release`] does the same and
/// reports the first error. Keep the memory itself alive for at least as
/// long as this set: declare it after the `Resources` in a struct (fields
/// drop in declaration order).
#[derive(Debug, Default)]
pub struct Resources {
    // Dropped first: rounds on these values fail before their targets go.
    imms: Vec<ImmLease>,
    regs: Vec<Registration>,
}

impl Resources {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `region` with `engine` ([`TransferEngine::register`]) and
    /// keeps the registration; returns its handle and descriptor.
    pub fn register(
        &mut self,
        engine: &TransferEngine,
        region: MemRegion,
    ) -> Result<(MrHandle, MrDesc), EngineError> {
        let r = engine.register(region)?;
        let out = (r.handle(), r.desc().clone());
        self.regs.push(r);
        Ok(out)
    }

    /// Keeps a registration made elsewhere.
    pub fn keep_registration(&mut self, r: Registration) {
        self.regs.push(r);
    }

    /// Allocates an immediate value ([`TransferEngine::lease_imm`]) and
    /// keeps its lease.
    pub fn lease_imm(&mut self, engine: &TransferEngine) -> Result<Imm, EngineError> {
        let l = engine.lease_imm()?;
        let v = l.value();
        self.imms.push(l);
        Ok(v)
    }

    /// Reserves the value `imm` ([`TransferEngine::lease_imm_value`]) and
    /// keeps its lease.
    pub fn lease_imm_value(
        &mut self,
        engine: &TransferEngine,
        imm: Imm,
    ) -> Result<(), EngineError> {
        self.imms.push(engine.lease_imm_value(imm)?);
        Ok(())
    }

    /// Keeps an immediate lease taken elsewhere.
    pub fn keep_imm(&mut self, l: ImmLease) {
        self.imms.push(l);
    }

    /// [`ImmLease::reset`] of every immediate held: partial counts of a
    /// failed step are dropped, the values kept.
    pub fn reset_imms(&self) {
        for l in &self.imms {
            l.reset();
        }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.imms.is_empty() && self.regs.is_empty()
    }

    /// Returns every immediate, then deregisters every region; every
    /// release is attempted and the first error is returned. The set is
    /// empty afterwards.
    pub fn release(&mut self) -> Result<(), EngineError> {
        let mut first = Ok(());
        for l in self.imms.drain(..) {
            if let (Err(e), true) = (l.release(), first.is_ok()) {
                first = Err(e);
            }
        }
        for r in self.regs.drain(..) {
            if let (Err(e), true) = (r.release(), first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }
}
