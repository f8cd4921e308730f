//! The cases. Each is `fn(&mut dyn Harness) -> Result<(), CaseFailure>`.

macro_rules! bail {
    ($($f:tt)+) => {
        return Err($crate::CaseFailure::Failed(format!($($f)+)))
    };
}

macro_rules! ensure {
    ($c:expr, $($f:tt)+) => {
        if !$c {
            bail!($($f)+);
        }
    };
}

mod basic;
mod errors;
mod lifecycle;
mod writes;

pub(crate) use basic::{
    capabilities_sane, message_too_long, receiver_not_ready, recv_buffer_pool, send_recv_sizes,
};
pub(crate) use errors::{
    deregistered_memory, local_access_errors, peer_death, remote_access_violations, unknown_peer,
    usable_after_remote_error,
};
pub(crate) use lifecycle::peer_removal;
pub(crate) use writes::{
    batch_writes_queue_full, concurrent_writes, imm_exactly_once, imm_only_writes, multi_nic,
    payload_visible_at_imm, write_large, write_sizes,
};

use crate::ctx::{local, remote, Buf, Ctx, Landed, Nic};
use crate::CaseFailure;
use std::rc::Rc;
use weft_transport::{Access, Imm, LocalMr, TransportError, WrId, WriteWr};

/// Patterned source memory, registered local-only on one NIC.
pub(crate) struct Source {
    pub mr: LocalMr,
    pub bytes: Rc<Vec<u8>>,
}

pub(crate) fn source(ctx: &mut Ctx<'_>, nic: Nic, len: usize) -> Result<Source, CaseFailure> {
    let (buf, bytes) = ctx.patterned(nic.host, len)?;
    let mr = ctx.reg(nic, &buf, 0..len, Access::LocalOnly)?;
    Ok(Source {
        mr,
        bytes: Rc::new(bytes),
    })
}

/// Target memory: a buffer filled with a canary pattern, of which
/// `[guard, guard+len)` is registered; `image` is what the whole buffer
/// must contain once every planned write has landed.
pub(crate) struct Target {
    pub buf: Buf,
    pub mr: LocalMr,
    pub guard: usize,
    pub image: Vec<u8>,
    pub nic: Nic,
}

pub(crate) fn target(
    ctx: &mut Ctx<'_>,
    nic: Nic,
    len: usize,
    guard: usize,
    access: Access,
) -> Result<Target, CaseFailure> {
    let (buf, image) = ctx.patterned(nic.host, len + 2 * guard)?;
    let mr = ctx.reg(nic, &buf, guard..guard + len, access)?;
    Ok(Target {
        buf,
        mr,
        guard,
        image,
        nic,
    })
}

impl Target {
    /// Checks the whole buffer (registration and guards) against `image`.
    pub fn verify(&self, ctx: &mut Ctx<'_>, what: &str) -> Result<(), CaseFailure> {
        let got = ctx.read(&self.buf, 0, self.buf.len)?;
        crate::pattern::check_bytes(
            &format!(
                "{what}: contents of the {} B target buffer on {} (registration at [{}, +{}))",
                self.buf.len, self.nic, self.guard, self.mr.len
            ),
            &got,
            &self.image,
        )
    }
}

/// Plans a verified WRITE of `len` bytes from `src[src_off..]` to
/// `dst_off` inside `tgt`'s registration, split into pieces of at most
/// `max_write_len`. Piece `k` carries immediate `imm + k` (if `imm` is set),
/// which is expected exactly once at the target, and whose payload is checked
/// when it is polled; every piece's payload is also checked when its write
/// completion is polled. Updates `tgt.image`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_write(
    ctx: &mut Ctx<'_>,
    from: Nic,
    src: &Source,
    src_off: usize,
    tgt: &mut Target,
    dst_off: usize,
    len: usize,
    imm: Option<Imm>,
) -> Result<Vec<WriteWr>, CaseFailure> {
    let max = usize::try_from(ctx.caps(from).max_write_len)
        .unwrap_or(usize::MAX)
        .max(1);
    let mut wrs = Vec::new();
    let mut done = 0usize;
    let mut k: u32 = 0;
    loop {
        let piece = (len - done).min(max);
        let s = src_off + done;
        let d = dst_off + done;
        let pimm = imm.map(|i| i.wrapping_add(k));
        let wr = ctx.write_wr(
            from,
            tgt.nic,
            local(&src.mr, s as u64, piece as u64)?,
            remote(&tgt.mr, d as u64),
            pimm,
        )?;
        let landed = Landed {
            buf: tgt.buf,
            offset: tgt.guard + d,
            data: src.bytes.clone(),
            start: s,
            len: piece,
        };
        if let Some(i) = pimm {
            ctx.expect_imm(tgt.nic, i, 1);
            ctx.check_at_imm(tgt.nic, i, landed.clone());
        }
        ctx.check_at_write_done(from, wr.wr, landed);
        tgt.image[tgt.guard + d..tgt.guard + d + piece].copy_from_slice(&src.bytes[s..s + piece]);
        wrs.push(wr);
        done += piece;
        k += 1;
        if done >= len {
            break;
        }
    }
    Ok(wrs)
}

/// Submits `wrs` on `from`, waits for all completions, requires success.
pub(crate) fn run_writes(
    ctx: &mut Ctx<'_>,
    from: Nic,
    wrs: &[WriteWr],
    what: &str,
) -> Result<(), CaseFailure> {
    ctx.submit_writes(from, wrs)?;
    let keys: Vec<(Nic, WrId)> = wrs.iter().map(|w| (from, w.wr)).collect();
    ctx.wait_wrs(what, &keys)?;
    for w in wrs {
        ctx.expect_ok(
            from,
            w.wr,
            &format!("{what}: WRITE of {} B (imm {:?})", w.src.len, w.imm),
        )?;
    }
    Ok(())
}

pub(crate) fn is_remote_access(e: &TransportError) -> bool {
    matches!(e, TransportError::RemoteAccess { .. })
}

pub(crate) fn is_local_access(e: &TransportError) -> bool {
    matches!(e, TransportError::LocalAccess { .. })
}

pub(crate) fn is_unreachable(e: &TransportError) -> bool {
    matches!(e, TransportError::PeerUnreachable { .. })
}

pub(crate) fn any_error(_: &TransportError) -> bool {
    true
}

/// An operation that must fail: `None` if it was rejected at post time with
/// an acceptable error, else its WR id, to be checked with [`check_failed`]
/// once it completed.
pub(crate) fn post_failing_write(
    ctx: &mut Ctx<'_>,
    from: Nic,
    wr: &WriteWr,
    ok: fn(&TransportError) -> bool,
    what: &str,
) -> Result<Option<WrId>, CaseFailure> {
    match ctx.post_write(from, wr)? {
        Ok(()) => Ok(Some(wr.wr)),
        Err(e) if ok(&e) && !e.is_retryable() => Ok(None),
        Err(e) => bail!("{what}: rejected at post with the wrong error: {e}"),
    }
}

/// Requires the finished SEND/WRITE `wr` to have failed with an acceptable
/// error.
pub(crate) fn check_failed(
    ctx: &Ctx<'_>,
    nic: Nic,
    wr: WrId,
    ok: fn(&TransportError) -> bool,
    want: &str,
    what: &str,
) -> Result<(), CaseFailure> {
    match ctx.op_result(nic, wr)? {
        Ok(()) => bail!("{what}: completed successfully, expected an error ({want})"),
        Err(e) if ok(&e) => Ok(()),
        Err(e) => bail!("{what}: failed with the wrong error, expected {want}: {e}"),
    }
}
