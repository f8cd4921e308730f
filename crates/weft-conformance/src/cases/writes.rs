//! One-sided WRITEs: sizes, immediates, batches, concurrency, multiple NICs.

use super::{plan_write, run_writes, source, target};
use crate::ctx::{local, remote, Ctx, Nic};
use crate::pattern::check_bytes;
use crate::{CaseFailure, Harness};
use weft_transport::{Access, Completion, Imm, WrId, WriteWr};

const GUARD: usize = 64;

/// Writes `sizes` from `an` to `bn` all at once: odd source and target
/// offsets, two of every three with an immediate; checks payload at each
/// immediate and at each completion, exact immediates, and the whole target
/// buffer (guards and gaps untouched) at the end.
fn sized_writes(
    ctx: &mut Ctx<'_>,
    an: Nic,
    bn: Nic,
    sizes: &[usize],
    imm_base: Imm,
) -> Result<(), CaseFailure> {
    let total: usize = sizes.iter().map(|s| s + 5).sum();
    let src = source(ctx, an, total)?;
    let mut tgt = target(ctx, bn, total, GUARD, Access::RemoteWrite)?;
    let mut wrs = Vec::new();
    let (mut so, mut d) = (0usize, 0usize);
    for (i, &s) in sizes.iter().enumerate() {
        let imm = (i % 3 != 2).then(|| imm_base.wrapping_add((i as u32) << 8));
        let src_off = so + (i % 3);
        let dst_off = d + 1 + (i % 2);
        wrs.extend(plan_write(
            ctx, an, &src, src_off, &mut tgt, dst_off, s, imm,
        )?);
        so += s + 5;
        d += s + 5;
    }
    ctx.rng.shuffle(&mut wrs);
    run_writes(ctx, an, &wrs, &format!("writes of sizes {sizes:?}"))?;
    ctx.wait_imms("the immediates of every write")?;
    ctx.quiesce()?;
    tgt.verify(ctx, &format!("after writes of {sizes:?}"))
}

/// WRITEs of 0 B .. 1 MiB + 17 (odd sizes and offsets, around chunk and
/// page boundaries), with and without immediates.
pub(crate) fn write_sizes(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "write_sizes");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let sizes = [
        0,
        1,
        2,
        3,
        7,
        8,
        9,
        255,
        1000,
        1023,
        1024,
        1025,
        4095,
        4096,
        4097,
        16383,
        16384,
        16385,
        65539,
        262_147,
        (1 << 20) + 17,
    ];
    sized_writes(&mut ctx, an, bn, &sizes, 0x5100_0000)
}

/// 16 MiB + 5 and 64 MiB WRITEs, each verified byte for byte (sharded if the
/// backend's `max_write_len` is smaller, one immediate per piece).
pub(crate) fn write_large(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "write_large");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    sized_writes(&mut ctx, an, bn, &[(16 << 20) + 5], 0x5200_0000)?;
    sized_writes(&mut ctx, an, bn, &[64 << 20], 0x5300_0000)
}

/// Zero-length WRITEs: with an immediate (delivered exactly once, including
/// at the very end of the region), without one (just a completion); target
/// memory untouched.
pub(crate) fn imm_only_writes(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "imm_only_writes");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let src = source(&mut ctx, an, 16)?;
    let tgt = target(&mut ctx, bn, 64, GUARD, Access::RemoteWrite)?;
    let mut wrs = Vec::new();
    let values: [Imm; 6] = [0, 1, 7, 0x8000_0000, u32::MAX, 0x1234_5678];
    for i in 0..120usize {
        let imm = if i % 10 == 9 {
            None
        } else {
            let v = values[i % values.len()];
            ctx.expect_imm(bn, v, 1);
            Some(v)
        };
        let dst_off = [0u64, 31, 64][i % 3];
        wrs.push(ctx.write_wr(
            an,
            bn,
            local(&src.mr, (i % 17) as u64 % 16, 0)?,
            remote(&tgt.mr, dst_off),
            imm,
        )?);
    }
    run_writes(&mut ctx, an, &wrs, "zero-length writes")?;
    ctx.wait_imms("immediates of zero-length writes")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "after zero-length writes (nothing may change)")
}

/// Batches through `post_writes`: a flood without polling stops at a short
/// count or `QueueFull` no later than `max_inflight`, never accepts more than
/// `max_batch` per call; retrying after polls posts everything; nothing lost
/// or duplicated.
pub(crate) fn batch_writes_queue_full(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "batch_writes_queue_full");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let caps = ctx.caps(an);
    let n = (caps.max_inflight + caps.max_inflight / 2 + 3).clamp(16, 3000);
    const W: usize = 32;
    let src = source(&mut ctx, an, n * W)?;
    let mut tgt = target(&mut ctx, bn, n * W, GUARD, Access::RemoteWrite)?;
    let mut wrs: Vec<WriteWr> = Vec::new();
    for i in 0..n {
        wrs.extend(plan_write(
            &mut ctx,
            an,
            &src,
            i * W,
            &mut tgt,
            i * W,
            W,
            Some(0x4000_0000 + i as u32),
        )?);
    }
    // Flood: no poll, no progress. Offer twice max_batch per call.
    let mut pos = 0usize;
    let mut full = false;
    while pos < wrs.len() {
        let offer = (2 * caps.max_batch).min(wrs.len() - pos);
        let accepted = match ctx.post_writes(an, &wrs[pos..pos + offer])? {
            Ok(k) => k,
            Err(e) if e.error.is_retryable() => e.posted,
            Err(e) => bail!(
                "post_writes rejected WR {} of the flood with {} (expected QueueFull or a short count)",
                pos + e.posted,
                e.error
            ),
        };
        ensure!(
            accepted <= caps.max_batch,
            "post_writes accepted {accepted} WRs in one call, max_batch is {}",
            caps.max_batch
        );
        pos += accepted;
        if accepted < offer.min(caps.max_batch) {
            full = true;
            break;
        }
    }
    ensure!(
        pos <= caps.max_inflight,
        "{pos} WRITEs accepted without any poll, max_inflight is {}",
        caps.max_inflight
    );
    ensure!(
        pos >= 1,
        "the first post_writes on an idle domain accepted nothing"
    );
    if n > caps.max_inflight {
        ensure!(
            full,
            "flood of {n} WRITEs (max_inflight {}) never hit a full queue",
            caps.max_inflight
        );
    }
    if full {
        // A single post on a full queue: QueueFull or (if room freed) Ok.
        match ctx.post_write(an, &wrs[pos])? {
            Ok(()) => pos += 1,
            Err(e) if e.is_retryable() => {}
            Err(e) => bail!("post_write on a full queue failed with {e}, expected QueueFull"),
        }
    }
    ctx.submit_writes(an, &wrs[pos..])?;
    let keys: Vec<(Nic, WrId)> = wrs.iter().map(|w| (an, w.wr)).collect();
    ctx.wait_wrs("every batched WRITE", &keys)?;
    for w in &wrs {
        ctx.expect_ok(an, w.wr, "batched WRITE")?;
    }
    ctx.wait_imms("every batched WRITE's immediate")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "after the batched writes")
}

/// Two senders WRITE (0..2 KiB, some empty) with immediates drawn from a
/// small set with many repeats; each value's count is exact at quiescence
/// and never exceeded on the way.
pub(crate) fn imm_exactly_once(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "imm_exactly_once");
    let senders = [Ctx::nic(ctx.host(1)?, 0), Ctx::nic(ctx.host(1)?, 0)];
    let bn = Ctx::nic(ctx.host(1)?, 0);
    const PER: usize = 150;
    const AREA: usize = 2048;
    let values: [Imm; 7] = [0, 1, 2, 42, 0x8000_0000, u32::MAX, 0xdead_beef];
    let mut tgt = target(&mut ctx, bn, 2 * PER * AREA, GUARD, Access::RemoteWrite)?;
    let mut plans = Vec::new();
    for (s, &nic) in senders.iter().enumerate() {
        let src = source(&mut ctx, nic, PER * AREA)?;
        let mut wrs = Vec::new();
        for i in 0..PER {
            let v = values[ctx.rng.below(values.len() as u64) as usize];
            let len = if ctx.rng.below(4) == 0 {
                0
            } else {
                ctx.rng.range(1, AREA as u64)
            };
            let dst = (s * PER + i) * AREA;
            let wr = ctx.write_wr(
                nic,
                bn,
                local(&src.mr, (i * AREA) as u64, len)?,
                remote(&tgt.mr, dst as u64),
                Some(v),
            )?;
            ctx.expect_imm(bn, v, 1);
            let l = len as usize;
            tgt.image[GUARD + dst..GUARD + dst + l]
                .copy_from_slice(&src.bytes[i * AREA..i * AREA + l]);
            wrs.push(wr);
        }
        plans.push((nic, wrs));
    }
    for (nic, wrs) in &plans {
        ctx.submit_writes(*nic, wrs)?;
    }
    for (nic, wrs) in &plans {
        let keys: Vec<(Nic, WrId)> = wrs.iter().map(|w| (*nic, w.wr)).collect();
        ctx.wait_wrs("writes with repeated immediates", &keys)?;
        for w in wrs {
            ctx.expect_ok(*nic, w.wr, "write with a repeated immediate")?;
        }
    }
    ctx.wait_imms("every immediate")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "after writes with repeated immediates")
}

/// THE unordered-contract test: many multi-chunk WRITEs from two senders
/// into disjoint areas, each with its own immediate; at the moment an
/// immediate is polled, all bytes of its write are already in place (and at
/// the moment a write completion is polled, too).
pub(crate) fn payload_visible_at_imm(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "payload_visible_at_imm");
    let senders = [Ctx::nic(ctx.host(1)?, 0), Ctx::nic(ctx.host(1)?, 0)];
    let bn = Ctx::nic(ctx.host(1)?, 0);
    const PER: usize = 40;
    let mut sizes = Vec::new();
    for _ in 0..PER * senders.len() {
        // Log-uniform 1 B .. 256 KiB.
        let bits = ctx.rng.range(0, 18);
        sizes.push(ctx.rng.range(1u64 << bits, (2u64 << bits).min(256 << 10)) as usize);
    }
    let total: usize = sizes.iter().map(|s| s + 1).sum();
    let mut tgt = target(&mut ctx, bn, total, GUARD, Access::RemoteWrite)?;
    let mut plans = Vec::new();
    let mut d = 0usize;
    for (s, &nic) in senders.iter().enumerate() {
        let mine = &sizes[s * PER..(s + 1) * PER];
        let src = source(&mut ctx, nic, mine.iter().sum::<usize>())?;
        let mut so = 0;
        let mut wrs = Vec::new();
        for (i, &len) in mine.iter().enumerate() {
            let imm = (i % 8 != 7).then_some(0x7000_0000 + ((s * PER + i) as u32) * 0x100);
            wrs.extend(plan_write(&mut ctx, nic, &src, so, &mut tgt, d, len, imm)?);
            so += len;
            d += len + 1;
        }
        plans.push((nic, wrs));
    }
    for (nic, wrs) in &plans {
        ctx.submit_writes(*nic, wrs)?;
    }
    for (nic, wrs) in &plans {
        let keys: Vec<(Nic, WrId)> = wrs.iter().map(|w| (*nic, w.wr)).collect();
        ctx.wait_wrs("multi-chunk writes", &keys)?;
        for w in wrs {
            ctx.expect_ok(*nic, w.wr, "multi-chunk write")?;
        }
    }
    ctx.wait_imms("every immediate")?;
    ctx.quiesce()?;
    tgt.verify(&mut ctx, "after the multi-chunk writes")
}

/// Three senders, concurrent WRITEs: private areas (checked exactly) and a
/// shared area hit by many overlapping writes: every shared byte ends up
/// equal to the byte of some write that covered it (no foreign or torn
/// garbage), untouched bytes keep the canary.
pub(crate) fn concurrent_writes(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "concurrent_writes");
    let senders = [
        Ctx::nic(ctx.host(1)?, 0),
        Ctx::nic(ctx.host(1)?, 0),
        Ctx::nic(ctx.host(1)?, 0),
    ];
    let bn = Ctx::nic(ctx.host(1)?, 0);
    const SHARED: usize = 16 << 10;
    const PRIV: usize = 8 << 10;
    const PER: usize = 30;
    let total = SHARED + senders.len() * PER * PRIV;
    let mut tgt = target(&mut ctx, bn, total, GUARD, Access::RemoteWrite)?;
    let canary = tgt.image.clone();
    // (offset in shared area, sender, src offset, len)
    let mut shared_writes = Vec::new();
    let mut plans = Vec::new();
    for (s, &nic) in senders.iter().enumerate() {
        let src = source(&mut ctx, nic, PER * PRIV + PER * SHARED)?;
        let mut wrs = Vec::new();
        for i in 0..PER {
            // Private write i of sender s.
            let len = ctx.rng.range(1, PRIV as u64) as usize;
            let dst = SHARED + (s * PER + i) * PRIV;
            wrs.extend(plan_write(
                &mut ctx,
                nic,
                &src,
                i * PRIV,
                &mut tgt,
                dst,
                len,
                Some(0x6000_0000 + ((s * PER + i) as u32) * 0x10),
            )?);
            // Shared (overlapping) write.
            let off = ctx.rng.below(SHARED as u64 - 1) as usize;
            let len = ctx.rng.range(1, (SHARED - off) as u64) as usize;
            let so = PER * PRIV + i * SHARED;
            let imm = 0x6800_0000 + ((s * PER + i) as u32);
            ctx.expect_imm(bn, imm, 1);
            wrs.push(ctx.write_wr(
                nic,
                bn,
                local(&src.mr, so as u64, len as u64)?,
                remote(&tgt.mr, off as u64),
                Some(imm),
            )?);
            shared_writes.push((off, s, so, len));
        }
        ctx.rng.shuffle(&mut wrs);
        plans.push((nic, wrs, src));
    }
    for (nic, wrs, _) in &plans {
        ctx.submit_writes(*nic, wrs)?;
    }
    for (nic, wrs, _) in &plans {
        let keys: Vec<(Nic, WrId)> = wrs.iter().map(|w| (*nic, w.wr)).collect();
        ctx.wait_wrs("concurrent writes", &keys)?;
        for w in wrs {
            ctx.expect_ok(*nic, w.wr, "concurrent write")?;
        }
    }
    ctx.wait_imms("every immediate")?;
    ctx.quiesce()?;
    // Private areas and guards: exact. Shared area: checked byte-wise below.
    let got = ctx.read(&tgt.buf, 0, tgt.buf.len)?;
    let sh = GUARD..GUARD + SHARED;
    check_bytes(
        "concurrent writes: bytes before the shared area",
        &got[..sh.start],
        &tgt.image[..sh.start],
    )?;
    check_bytes(
        "concurrent writes: private areas and trailing guard",
        &got[sh.end..],
        &tgt.image[sh.end..],
    )?;
    for p in 0..SHARED {
        let g = got[GUARD + p];
        let mut covered = false;
        let mut ok = false;
        for &(off, s, so, len) in &shared_writes {
            if p >= off && p < off + len {
                covered = true;
                if plans[s].2.bytes[so + p - off] == g {
                    ok = true;
                    break;
                }
            }
        }
        if !covered {
            ok = g == canary[GUARD + p];
        }
        ensure!(
            ok,
            "shared area byte {p} is {g:#04x}: {}",
            if covered {
                "not the byte of any write that covered it"
            } else {
                "no write covered it but it changed"
            }
        );
    }
    Ok(())
}

/// Two NICs per host: NIC i WRITEs to the peer's NIC i with that NIC's
/// rkey of one buffer registered on both; the immediate is reported by the
/// target NIC that received the write (and no other); SEND/RECV on NIC 1.
pub(crate) fn multi_nic(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "multi_nic");
    let a = ctx.host(2)?;
    let b = ctx.host(2)?;
    const HALF: usize = 96 << 10;
    let (buf, canary) = ctx.patterned(b, 2 * HALF)?;
    let mut image = canary;
    let mut plans = Vec::new();
    for i in 0..2 {
        let (an, bn) = (Ctx::nic(a, i), Ctx::nic(b, i));
        let mr = ctx.reg(bn, &buf, 0..2 * HALF, Access::RemoteWrite)?;
        let src = source(&mut ctx, an, HALF)?;
        let mut tgt = super::Target {
            buf,
            mr,
            guard: 0,
            image: image.clone(),
            nic: bn,
        };
        let mut wrs = Vec::new();
        for k in 0..8usize {
            let len = HALF / 8;
            wrs.extend(plan_write(
                &mut ctx,
                an,
                &src,
                k * len,
                &mut tgt,
                i * HALF + k * len,
                len,
                Some(0x3000_0000 + ((i as u32) << 16) + ((k as u32) << 8)),
            )?);
        }
        image[i * HALF..(i + 1) * HALF].copy_from_slice(&tgt.image[i * HALF..(i + 1) * HALF]);
        plans.push((an, wrs));
    }
    for (an, wrs) in &plans {
        run_writes(&mut ctx, *an, wrs, "writes on each NIC")?;
    }
    ctx.wait_imms("immediates on the NIC that received each write")?;
    let got = ctx.read(&buf, 0, 2 * HALF)?;
    check_bytes("buffer written through two NICs", &got, &image)?;
    // SEND/RECV over NIC 1.
    let (a1, b1) = (Ctx::nic(a, 1), Ctx::nic(b, 1));
    let src = source(&mut ctx, a1, 100)?;
    let rb = ctx.alloc(b, 100)?;
    let rmr = ctx.reg(b1, &rb, 0..100, Access::LocalOnly)?;
    let r = ctx.recv(b1, local(&rmr, 0, 100)?)?;
    let w = ctx.send(a1, b1, local(&src.mr, 0, 100)?)?;
    ctx.wait_wrs("a SEND over NIC 1", &[(a1, w), (b1, r)])?;
    ctx.expect_ok(a1, w, "SEND over NIC 1")?;
    match ctx.completion(b1, r) {
        Some(Completion::Recv {
            result: Ok(100), ..
        }) => {}
        other => bail!("RECV over NIC 1 completed with {other:?}"),
    }
    let got = ctx.read(&rb, 0, 100)?;
    check_bytes("message over NIC 1", &got, &src.bytes)?;
    ctx.quiesce()
}
