//! Rejected accesses, deregistered memory, unknown and dead peers.

use super::{
    any_error, check_failed, is_local_access, is_remote_access, is_unreachable, plan_write,
    post_failing_write, run_writes, source, target,
};
use crate::ctx::{local, remote, Ctx, Nic};
use crate::{CaseFailure, Harness};
use weft_transport::{Access, LocalSlice, MrKey, NetAddr, RemoteSlice, Rkey, TransportError, WrId};

const GUARD: usize = 64;
const LEN: usize = 4096;

/// Out-of-bounds (by one byte, past the end, overflowing `base + offset`),
/// a foreign rkey (another NIC of the same host), a local-only region and a
/// deregistered region: each WRITE completes with a `RemoteAccess` error
/// (the overflowing one may instead be rejected at post), nothing is
/// written anywhere, no immediate is reported.
pub(crate) fn remote_access_violations(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "remote_access_violations");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let b = ctx.host(2)?;
    let (b0, b1) = (Ctx::nic(b, 0), Ctx::nic(b, 1));
    let src = source(&mut ctx, an, LEN + 1)?;
    let x = target(&mut ctx, b0, LEN, GUARD, Access::RemoteWrite)?;
    let y = target(&mut ctx, b1, LEN, GUARD, Access::RemoteWrite)?;
    let z = target(&mut ctx, b0, LEN, GUARD, Access::LocalOnly)?;
    let d = target(&mut ctx, b0, LEN, GUARD, Access::RemoteWrite)?;
    ctx.deregister(b0, &d.mr)?;
    let l = LEN as u64;
    type Pred = fn(&TransportError) -> bool;
    let ra: (Pred, &str) = (is_remote_access, "RemoteAccess");
    let cases: Vec<(&str, RemoteSlice, u64, (Pred, &str))> = vec![
        ("one byte past the end", remote(&x.mr, l - 3), 4, ra),
        ("starting at the end", remote(&x.mr, l), 1, ra),
        ("longer than the region", remote(&x.mr, 0), l + 1, ra),
        (
            "base + offset overflowing u64",
            remote(&x.mr, u64::MAX - 2),
            8,
            (any_error, "any error"),
        ),
        (
            "foreign rkey (region registered only on the other NIC of the target host)",
            remote(&y.mr, 0),
            16,
            ra,
        ),
        ("local-only region", remote(&z.mr, 0), 16, ra),
        ("deregistered region", remote(&d.mr, 0), 16, ra),
    ];
    let mut posted = Vec::new();
    for (i, (what, dst, len, (ok, want))) in cases.iter().enumerate() {
        let wr = ctx.write_wr(
            an,
            b0,
            local(&src.mr, 0, *len)?,
            *dst,
            Some(0x0bad_0000 + i as u32),
        )?;
        if let Some(w) = post_failing_write(&mut ctx, an, &wr, *ok, what)? {
            posted.push((w, *what, *ok, *want));
        }
    }
    let keys: Vec<(Nic, WrId)> = posted.iter().map(|p| (an, p.0)).collect();
    ctx.wait_wrs("rejected remote writes", &keys)?;
    for (w, what, ok, want) in &posted {
        check_failed(&ctx, an, *w, *ok, want, &format!("WRITE to {what}"))?;
    }
    // No immediate may show up (none is expected: any arrival fails).
    ctx.quiesce()?;
    for (t, what) in [
        (&x, "X"),
        (&y, "Y (other NIC)"),
        (&z, "Z (local-only)"),
        (&d, "D (deregistered)"),
    ] {
        t.verify(
            &mut ctx,
            &format!("region {what} after rejected writes (nothing may be written)"),
        )?;
    }
    Ok(())
}

/// After a rejected remote access the same domain and peer keep working:
/// a valid WRITE with immediate and a SEND succeed.
pub(crate) fn usable_after_remote_error(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "usable_after_remote_error");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let src = source(&mut ctx, an, LEN)?;
    let mut tgt = target(&mut ctx, bn, LEN, GUARD, Access::RemoteWrite)?;
    let bad = ctx.write_wr(
        an,
        bn,
        local(&src.mr, 0, 64)?,
        remote(&tgt.mr, LEN as u64 - 1),
        Some(0x0bad_0001),
    )?;
    if let Some(w) =
        post_failing_write(&mut ctx, an, &bad, is_remote_access, "out-of-bounds write")?
    {
        ctx.wait_wrs("an out-of-bounds write", &[(an, w)])?;
        check_failed(
            &ctx,
            an,
            w,
            is_remote_access,
            "RemoteAccess",
            "out-of-bounds write",
        )?;
    }
    let wrs = plan_write(&mut ctx, an, &src, 0, &mut tgt, 0, LEN, Some(0x600d_0000))?;
    run_writes(&mut ctx, an, &wrs, "a valid write after a rejected one")?;
    ctx.wait_imms("the valid write's immediate")?;
    let rb = ctx.alloc(bn.host, 64)?;
    let rmr = ctx.reg(bn, &rb, 0..64, Access::LocalOnly)?;
    let r = ctx.recv(bn, local(&rmr, 0, 64)?)?;
    let s = ctx.send(an, bn, local(&src.mr, 0, 64)?)?;
    ctx.wait_wrs("a SEND after a rejected write", &[(an, s), (bn, r)])?;
    ctx.expect_ok(an, s, "SEND after a rejected remote write")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "after a rejected and a valid write")
}

/// Invalid local slices (past the end, before the start, a key never
/// issued, the key of another NIC of the same host) are rejected for WRITE,
/// SEND and RECV with `LocalAccess` (at post or as an error completion);
/// nothing is read from or written to memory outside registrations.
pub(crate) fn local_access_errors(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "local_access_errors");
    let a = ctx.host(2)?;
    let (a0, a1) = (Ctx::nic(a, 0), Ctx::nic(a, 1));
    let bn = Ctx::nic(ctx.host(1)?, 0);
    // S: [64, 192) of a 256 B buffer registered local-only on a0.
    let (s_buf, s_bytes) = ctx.patterned(a, 256)?;
    let ms = ctx.reg(a0, &s_buf, 64..192, Access::LocalOnly)?;
    let (f_buf, f_bytes) = ctx.patterned(a, 64)?;
    let mf = ctx.reg(a1, &f_buf, 0..64, Access::LocalOnly)?;
    let tgt = target(&mut ctx, bn, 256, GUARD, Access::RemoteWrite)?;
    // Valid receive buffers at b, so a bad SEND has somewhere to land.
    let rbuf = ctx.alloc(bn.host, 4 * 256)?;
    let rmr = ctx.reg(bn, &rbuf, 0..rbuf.len, Access::LocalOnly)?;
    let mut b_recvs = Vec::new();
    for k in 0..4u64 {
        b_recvs.push(ctx.recv(bn, local(&rmr, k * 256, 256)?)?);
    }
    let bad: Vec<(&str, LocalSlice)> = vec![
        (
            "past the end of the registration",
            LocalSlice {
                mr: ms.key,
                addr: ms.addr + 120,
                len: 16,
            },
        ),
        (
            "before the start of the registration",
            LocalSlice {
                mr: ms.key,
                addr: ms.addr - 8,
                len: 16,
            },
        ),
        (
            "a key never issued",
            LocalSlice {
                mr: MrKey(0x7bad_c0de_0000_0001),
                addr: ms.addr,
                len: 16,
            },
        ),
        (
            "the key of another NIC of this host",
            LocalSlice {
                mr: mf.key,
                addr: mf.addr,
                len: 16,
            },
        ),
    ];
    let peer = ctx.peer(a0, bn)?;
    let mut waits = Vec::new();
    for (i, (what, sl)) in bad.iter().enumerate() {
        let wr = ctx.write_wr(
            a0,
            bn,
            *sl,
            remote(&tgt.mr, 0),
            Some(0x10ca_0000 + i as u32),
        )?;
        if let Some(w) = post_failing_write(
            &mut ctx,
            a0,
            &wr,
            is_local_access,
            &format!("WRITE from {what}"),
        )? {
            waits.push((w, format!("WRITE from {what}")));
        }
        match ctx.post_send(a0, peer, *sl)? {
            Ok(w) => waits.push((w, format!("SEND from {what}"))),
            Err(e) if is_local_access(&e) => {}
            Err(e) => bail!("SEND from {what}: rejected at post with the wrong error: {e}"),
        }
    }
    let keys: Vec<(Nic, WrId)> = waits.iter().map(|w| (a0, w.0)).collect();
    ctx.wait_wrs("operations with invalid local slices", &keys)?;
    for (w, what) in &waits {
        check_failed(&ctx, a0, *w, is_local_access, "LocalAccess", what)?;
    }
    // Bad receive buffers on a0; then b sends one message to a0, which also
    // has one valid buffer posted.
    let mut a_bad_recvs = Vec::new();
    for (what, sl) in &bad {
        match ctx.post_recv(a0, *sl)? {
            Ok(r) => a_bad_recvs.push((r, *what)),
            Err(e) if is_local_access(&e) => {}
            Err(e) => bail!("RECV into {what}: rejected at post with the wrong error: {e}"),
        }
    }
    let good = ctx.alloc(a, 64)?;
    let gmr = ctx.reg(a0, &good, 0..64, Access::LocalOnly)?;
    ctx.recv(a0, local(&gmr, 0, 64)?)?;
    let bsrc = source(&mut ctx, bn, 32)?;
    let bs = ctx.send(bn, a0, local(&bsrc.mr, 0, 32)?)?;
    ctx.wait_wrs(
        "a SEND to a host with invalid receive buffers posted",
        &[(bn, bs)],
    )?;
    ctx.h.settle();
    ctx.poll_all()?;
    for (r, what) in &a_bad_recvs {
        if let Some(Ok(n)) = ctx.recv_result(a0, *r) {
            bail!("RECV into {what} reported success ({n} B)");
        }
    }
    for r in &b_recvs {
        if let Some(res) = ctx.recv_result(bn, *r) {
            bail!("a SEND from an invalid local slice reached the peer's receive buffer: {res:?}");
        }
    }
    let got = ctx.read(&s_buf, 0, 256)?;
    crate::pattern::check_bytes(
        "buffer S (around the local-only registration)",
        &got,
        &s_bytes,
    )?;
    let got = ctx.read(&f_buf, 0, 64)?;
    crate::pattern::check_bytes("buffer F (registered on the other NIC)", &got, &f_bytes)?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "target after writes from invalid local slices")
}

/// Deregistration: a local key after deregister is rejected (`LocalAccess`)
/// for WRITE and SEND; deregistering twice or an unknown key is an error;
/// a remote WRITE into a region deregistered after a successful write fails
/// with `RemoteAccess` and changes nothing; registering again works.
pub(crate) fn deregistered_memory(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "deregistered_memory");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    // Local side.
    let src = source(&mut ctx, an, LEN)?;
    let (old_buf, _) = ctx.patterned(an.host, 256)?;
    let old = ctx.reg(an, &old_buf, 0..256, Access::LocalOnly)?;
    ctx.deregister(an, &old)?;
    match ctx.h.domain(an.host, an.index).deregister(old.key) {
        Err(_) => {}
        Ok(()) => bail!("deregistering {:?} twice succeeded", old.key),
    }
    match ctx
        .h
        .domain(an.host, an.index)
        .deregister(MrKey(0x7bad_c0de_0000_0002))
    {
        Err(_) => {}
        Ok(()) => bail!("deregistering a key never issued succeeded"),
    }
    let mut tgt = target(&mut ctx, bn, LEN, GUARD, Access::RemoteWrite)?;
    let wr = ctx.write_wr(
        an,
        bn,
        local(&old, 0, 64)?,
        remote(&tgt.mr, 0),
        Some(0xde00_0001),
    )?;
    let mut waits = Vec::new();
    if let Some(w) = post_failing_write(
        &mut ctx,
        an,
        &wr,
        is_local_access,
        "WRITE from deregistered memory",
    )? {
        waits.push((w, "WRITE from deregistered memory"));
    }
    let peer = ctx.peer(an, bn)?;
    match ctx.post_send(an, peer, local(&old, 0, 64)?)? {
        Ok(w) => waits.push((w, "SEND from deregistered memory")),
        Err(e) if is_local_access(&e) => {}
        Err(e) => bail!("SEND from deregistered memory: wrong error at post: {e}"),
    }
    let keys: Vec<(Nic, WrId)> = waits.iter().map(|w| (an, w.0)).collect();
    ctx.wait_wrs("operations on deregistered local memory", &keys)?;
    for (w, what) in &waits {
        check_failed(&ctx, an, *w, is_local_access, "LocalAccess", what)?;
    }
    // Remote side: first a good write, then deregister, then a stale write.
    let wrs = plan_write(&mut ctx, an, &src, 0, &mut tgt, 0, 128, Some(0xde00_0002))?;
    run_writes(&mut ctx, an, &wrs, "a write before deregistration")?;
    ctx.wait_imms("the first write's immediate")?;
    ctx.deregister(bn, &tgt.mr)?;
    let stale = ctx.write_wr(
        an,
        bn,
        local(&src.mr, 128, 128)?,
        remote(&tgt.mr, 128),
        Some(0xde00_0003),
    )?;
    if let Some(w) = post_failing_write(
        &mut ctx,
        an,
        &stale,
        is_remote_access,
        "WRITE into a deregistered region",
    )? {
        ctx.wait_wrs("a WRITE into a deregistered region", &[(an, w)])?;
        check_failed(
            &ctx,
            an,
            w,
            is_remote_access,
            "RemoteAccess",
            "WRITE into a deregistered region",
        )?;
    }
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "region after a write into it post-deregistration")?;
    // Register again: both directions work.
    let again = ctx.reg(bn, &tgt.buf, GUARD..GUARD + LEN, Access::RemoteWrite)?;
    tgt.mr = again;
    let src2 = source(&mut ctx, an, 256)?;
    let wrs = plan_write(
        &mut ctx,
        an,
        &src2,
        0,
        &mut tgt,
        256,
        256,
        Some(0xde00_0004),
    )?;
    run_writes(&mut ctx, an, &wrs, "a write after re-registration")?;
    ctx.wait_imms("the re-registered write's immediate")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "region after re-registration")
}

/// Operations to an address nobody listens on fail with `PeerUnreachable`
/// (a malformed address with any error) — at `add_peer`, at post or as an
/// error completion, within the wait budget; other traffic is unaffected.
pub(crate) fn unknown_peer(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "unknown_peer");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    // (address, must fail with PeerUnreachable, description)
    let mut addrs: Vec<(NetAddr, bool, String)> = Vec::new();
    match ctx.h.unreachable_addr() {
        Ok(a) => addrs.push((a.clone(), true, format!("unreachable address {a}"))),
        Err(e) => {
            crate::note(&format!(
                "weft-conformance [{}] case unknown_peer seed {}: only malformed addresses tried ({e})",
                ctx.h.name(),
                ctx.h.seed()
            ));
        }
    }
    for a in [
        NetAddr(vec![]),
        NetAddr(vec![0xff; 3]),
        NetAddr(vec![0xa5; 64]),
    ] {
        let d = format!("malformed address {a:?}");
        addrs.push((a, false, d));
    }
    let src = source(&mut ctx, an, 64)?;
    let mut waits = Vec::new();
    for (i, (addr, strict, what)) in addrs.iter().enumerate() {
        let (ok, want): (fn(&TransportError) -> bool, &str) = if *strict {
            (is_unreachable, "PeerUnreachable")
        } else {
            (any_error, "any error")
        };
        let peer = match ctx.peer_addr(an, addr) {
            Ok(p) => p,
            Err(_) => continue,
        };
        let wr = weft_transport::WriteWr {
            wr: ctx.wr(),
            peer,
            src: local(&src.mr, 0, 16)?,
            dst: RemoteSlice {
                base: 0x10_0000,
                offset: 0,
                rkey: Rkey(1),
            },
            imm: Some(0x0dd0_0000 + i as u32),
        };
        if let Some(w) = post_failing_write(&mut ctx, an, &wr, ok, &format!("WRITE to {what}"))? {
            waits.push((w, format!("WRITE to {what}"), ok, want));
        }
        match ctx.post_send(an, peer, local(&src.mr, 16, 16)?)? {
            Ok(w) => waits.push((w, format!("SEND to {what}"), ok, want)),
            Err(e) if ok(&e) && !e.is_retryable() => {}
            Err(e) => bail!("SEND to {what}: wrong error at post: {e}"),
        }
    }
    let keys: Vec<(Nic, WrId)> = waits.iter().map(|w| (an, w.0)).collect();
    ctx.wait_wrs("operations to unknown peers to fail", &keys)?;
    for (w, what, ok, want) in &waits {
        check_failed(&ctx, an, *w, *ok, want, what)?;
    }
    let mut tgt = target(&mut ctx, bn, 64, GUARD, Access::RemoteWrite)?;
    let wrs = plan_write(&mut ctx, an, &src, 0, &mut tgt, 0, 64, Some(0x0dd0_1000))?;
    run_writes(
        &mut ctx,
        an,
        &wrs,
        "a write to a live peer after unknown peers",
    )?;
    ctx.wait_imms("the live peer's immediate")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "live peer's region")
}

/// Peer death: large WRITEs and a SEND in flight to host B when B dies
/// complete exactly once, successfully or with `PeerUnreachable`; every
/// operation posted to B afterwards fails with `PeerUnreachable`; traffic
/// between the survivors A and C (both directions, WRITE and SEND) works.
pub(crate) fn peer_death(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "peer_death");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let cn = Ctx::nic(ctx.host(1)?, 0);
    const BIG: usize = 1 << 20;
    let src = source(&mut ctx, an, 4 * BIG)?;
    // B's memory is never checked (B dies): plain zeroed memory.
    let tb_buf = ctx.alloc(bn.host, 4 * BIG)?;
    let tb_mr = ctx.reg(bn, &tb_buf, 0..4 * BIG, Access::RemoteWrite)?;
    let mut tc = target(&mut ctx, cn, 64 << 10, GUARD, Access::RemoteWrite)?;
    let mut before = Vec::new();
    for k in 0..4usize {
        let wr = ctx.write_wr(
            an,
            bn,
            local(&src.mr, (k * BIG) as u64, BIG as u64)?,
            remote(&tb_mr, (k * BIG) as u64),
            Some(0xdead_0000 + k as u32),
        )?;
        ctx.post_write(an, &wr)?.map_err(|e| {
            CaseFailure::Failed(format!("WRITE to B before its death rejected: {e}"))
        })?;
        before.push((wr.wr, "WRITE in flight when B died"));
    }
    let s = ctx.send(an, bn, local(&src.mr, 0, 64)?)?;
    before.push((s, "SEND in flight when B died"));
    let c_wrs = plan_write(
        &mut ctx,
        an,
        &src,
        0,
        &mut tc,
        0,
        32 << 10,
        Some(0xc000_0000),
    )?;
    ctx.submit_writes(an, &c_wrs)?;
    ctx.kill(bn.host)?;
    // Posted after the death.
    let mut after = Vec::new();
    let wr = ctx.write_wr(
        an,
        bn,
        local(&src.mr, 0, 64)?,
        remote(&tb_mr, 0),
        Some(0xdead_1000),
    )?;
    if let Some(w) = post_failing_write(
        &mut ctx,
        an,
        &wr,
        is_unreachable,
        "WRITE to B after its death",
    )? {
        after.push((w, "WRITE to B after its death"));
    }
    let peer_b = ctx.peer(an, bn)?;
    match ctx.post_send(an, peer_b, local(&src.mr, 0, 64)?)? {
        Ok(w) => after.push((w, "SEND to B after its death")),
        Err(e) if is_unreachable(&e) => {}
        Err(e) => bail!("SEND to B after its death: wrong error at post: {e}"),
    }
    let mut keys: Vec<(Nic, WrId)> = before.iter().chain(&after).map(|w| (an, w.0)).collect();
    keys.extend(c_wrs.iter().map(|w| (an, w.wr)));
    ctx.wait_wrs("operations to a dead peer to complete", &keys)?;
    for (w, what) in &before {
        match ctx.op_result(an, *w)? {
            Ok(()) => {}
            Err(e) if is_unreachable(&e) => {}
            Err(e) => bail!("{what}: failed with {e}, expected success or PeerUnreachable"),
        }
    }
    for (w, what) in &after {
        check_failed(&ctx, an, *w, is_unreachable, "PeerUnreachable", what)?;
    }
    for w in &c_wrs {
        ctx.expect_ok(an, w.wr, "WRITE to C while B died")?;
    }
    ctx.wait_imms("C's immediates")?;
    // Survivors keep talking, both ways.
    let src_c = source(&mut ctx, cn, 4096)?;
    let mut ta = target(&mut ctx, an, 4096, GUARD, Access::RemoteWrite)?;
    let wrs = plan_write(&mut ctx, cn, &src_c, 0, &mut ta, 0, 4096, Some(0xc000_1000))?;
    run_writes(&mut ctx, cn, &wrs, "C -> A after B died")?;
    let wrs = plan_write(
        &mut ctx,
        an,
        &src,
        100,
        &mut tc,
        40 << 10,
        4096,
        Some(0xc000_2000),
    )?;
    run_writes(&mut ctx, an, &wrs, "A -> C after B died")?;
    let rb = ctx.alloc(cn.host, 64)?;
    let rmr = ctx.reg(cn, &rb, 0..64, Access::LocalOnly)?;
    let r = ctx.recv(cn, local(&rmr, 0, 64)?)?;
    let s = ctx.send(an, cn, local(&src.mr, 0, 64)?)?;
    ctx.wait_wrs("SEND A -> C after B died", &[(an, s), (cn, r)])?;
    ctx.expect_ok(an, s, "SEND A -> C after B died")?;
    ctx.wait_imms("survivors' immediates")?;
    ctx.quiesce()?;
    tc.verify(&mut ctx, "C's region")?;
    ta.verify(&mut ctx, "A's region")
}
