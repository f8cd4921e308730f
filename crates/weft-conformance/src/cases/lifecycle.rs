//! Peer removal ([`weft_transport::Domain::remove_peer`], contract rule 10).

use super::{check_failed, plan_write, post_failing_write, run_writes, source, target};
use crate::ctx::{local, remote, Ctx, Nic};
use crate::{CaseFailure, Harness};
use weft_transport::{Access, TransportError, WrId, WriteWr};

const GUARD: usize = 64;
const LEN: usize = 4096;

fn is_removed(e: &TransportError) -> bool {
    matches!(e, TransportError::PeerRemoved { .. })
}

/// A peer handle used for a verified write is removed: a WRITE and a SEND
/// naming it fail with `PeerRemoved` (at post or as an error completion) and
/// write nothing; removing it again is a no-op; adding the address again
/// gives a new handle, over which a verified write (bytes, one immediate)
/// works. Skipped where the domain answers `Unsupported`.
pub(crate) fn peer_removal(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "peer_removal");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let src = source(&mut ctx, an, LEN)?;
    let mut tgt = target(&mut ctx, bn, LEN, GUARD, Access::RemoteWrite)?;
    let wrs = plan_write(&mut ctx, an, &src, 0, &mut tgt, 0, 1024, Some(0x7e40_0000))?;
    run_writes(&mut ctx, an, &wrs, "a write before the removal")?;
    ctx.wait_imms("the immediate before the removal")?;

    let (old, r) = ctx.remove_peer(an, bn)?;
    match r {
        Ok(()) => {}
        Err(TransportError::Unsupported { what, .. }) => {
            return Err(CaseFailure::Skipped(format!(
                "remove_peer unsupported: {what}"
            )))
        }
        Err(e) => bail!("remove_peer failed: {e}"),
    }
    // The removed handle: nothing is written, no immediate (the suite fails
    // on an unexpected one; `verify` below on stray bytes).
    let wr = WriteWr {
        wr: ctx.wr(),
        peer: old,
        src: local(&src.mr, 0, 64)?,
        dst: remote(&tgt.mr, 2048),
        imm: Some(0x7e40_1000),
    };
    let mut waits: Vec<WrId> = Vec::new();
    let what = "WRITE with a removed peer handle";
    if let Some(w) = post_failing_write(&mut ctx, an, &wr, is_removed, what)? {
        waits.push(w);
    }
    match ctx.post_send(an, old, local(&src.mr, 64, 64)?)? {
        Ok(w) => waits.push(w),
        Err(e) if is_removed(&e) => {}
        Err(e) => bail!("SEND with a removed peer handle: wrong error at post: {e}"),
    }
    let keys: Vec<(Nic, WrId)> = waits.iter().map(|w| (an, *w)).collect();
    ctx.wait_wrs("operations naming a removed peer to fail", &keys)?;
    for w in &waits {
        check_failed(
            &ctx,
            an,
            *w,
            is_removed,
            "PeerRemoved",
            "operation naming a removed peer",
        )?;
    }
    if let Err(e) = ctx.h.domain(an.host, an.index).remove_peer(old) {
        bail!("removing a removed peer again: {e}");
    }

    // Added again: a new handle with working state.
    let new = ctx.peer(an, bn)?;
    ensure!(
        new != old,
        "add_peer after remove_peer returned the removed handle {old:?}"
    );
    let wrs = plan_write(
        &mut ctx,
        an,
        &src,
        1024,
        &mut tgt,
        1024,
        1024,
        Some(0x7e40_2000),
    )?;
    run_writes(&mut ctx, an, &wrs, "a write after adding the peer again")?;
    ctx.wait_imms("the immediate after adding the peer again")?;
    tgt.verify(&mut ctx, "after remove and re-add")?;
    ctx.quiesce()
}
