//! Capabilities and two-sided SEND/RECV.

use super::source;
use crate::ctx::{local, Ctx};
use crate::pattern::check_bytes;
use crate::{CaseFailure, Harness};
use std::collections::{BTreeMap, BTreeSet};
use weft_transport::{Access, Completion, TransportError, WrId};

/// Capabilities and NIC facts are sane; `add_peer` is idempotent; `poll`
/// appends; an empty batch posts nothing.
pub(crate) fn capabilities_sane(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "capabilities_sane");
    let a = ctx.host(2)?;
    let b = ctx.host(1)?;
    let nics = [Ctx::nic(a, 0), Ctx::nic(a, 1), Ctx::nic(b, 0)];
    let mut addrs = Vec::new();
    for nic in nics {
        let caps = ctx.caps(nic);
        ensure!(caps.max_batch >= 1, "{nic}: max_batch is 0 ({caps:?})");
        ensure!(
            caps.max_inflight >= 1,
            "{nic}: max_inflight is 0 ({caps:?})"
        );
        ensure!(caps.max_recvs >= 1, "{nic}: max_recvs is 0 ({caps:?})");
        ensure!(
            caps.max_write_len >= 1,
            "{nic}: max_write_len is 0 ({caps:?})"
        );
        ensure!(
            caps.max_send_len >= 1,
            "{nic}: max_send_len is 0 ({caps:?})"
        );
        let d = ctx.h.domain(nic.host, nic.index);
        let info = d.info().clone();
        let local_addr = d.local_addr().clone();
        let again = d.capabilities().clone();
        ensure!(again == caps, "{nic}: capabilities changed between calls");
        ensure!(!info.name.is_empty(), "{nic}: empty NIC name");
        ensure!(!info.addr.0.is_empty(), "{nic}: empty NIC address");
        ensure!(
            local_addr == info.addr,
            "{nic}: local_addr() {local_addr} differs from info().addr {}",
            info.addr
        );
        if let Some(g) = info.link_gbps {
            ensure!(g.is_finite() && g > 0.0, "{nic}: link_gbps is {g}");
        }
        addrs.push(info.addr);
    }
    for i in 0..addrs.len() {
        for j in i + 1..addrs.len() {
            ensure!(
                addrs[i] != addrs[j],
                "{} and {} report the same address {}",
                nics[i],
                nics[j],
                addrs[i]
            );
        }
    }
    let d = ctx.h.domain(a, 0);
    let p1 = d
        .add_peer(&addrs[2])
        .map_err(|e| CaseFailure::Failed(format!("add_peer({}) failed: {e}", addrs[2])))?;
    let p2 = d
        .add_peer(&addrs[2])
        .map_err(|e| CaseFailure::Failed(format!("second add_peer({}) failed: {e}", addrs[2])))?;
    ensure!(
        p1 == p2,
        "add_peer is not idempotent: {p1:?} then {p2:?} for {}",
        addrs[2]
    );
    let p3 = d
        .add_peer(&addrs[1])
        .map_err(|e| CaseFailure::Failed(format!("add_peer({}) failed: {e}", addrs[1])))?;
    ensure!(
        p3 != p1,
        "add_peer gave the same {p1:?} for two different addresses"
    );
    let sentinel = Completion::Imm { imm: 0x5e17_0001 };
    let mut out = vec![sentinel.clone()];
    let n = d
        .poll(&mut out)
        .map_err(|e| CaseFailure::Failed(format!("poll on an idle domain failed: {e}")))?;
    ensure!(
        out.first() == Some(&sentinel),
        "poll did not append: it replaced what was in the output vector"
    );
    ensure!(
        n == 0 && out.len() == 1,
        "poll on an idle domain reported {n} completions: {out:?}"
    );
    match d.post_writes(&[]) {
        Ok(0) => {}
        other => bail!("post_writes(&[]) returned {other:?}, expected Ok(0)"),
    }
    ctx.quiesce()
}

fn send_sizes(max: u64) -> Vec<u64> {
    const CAP: u64 = 8 << 20;
    let mut sizes: Vec<u64> = [
        0,
        1,
        2,
        3,
        7,
        8,
        63,
        64,
        65,
        255,
        1000,
        1023,
        1024,
        1025,
        4095,
        4096,
        4097,
        9000,
        65535,
        65537,
        (1 << 20) - 1,
        1 << 20,
    ]
    .into_iter()
    .filter(|s| *s <= max)
    .collect();
    if max <= CAP {
        sizes.push(max);
    }
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// SENDs of 0 B, 1 B, odd sizes up to `max_send_len` (capped at 8 MiB):
/// first one at a time into a buffer of exactly the message size (bytes
/// past it untouched), then all at once into equal buffers, any order.
pub(crate) fn send_recv_sizes(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "send_recv_sizes");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let max = ctx.caps(an).max_send_len.min(ctx.caps(bn).max_send_len);
    let sizes = send_sizes(max);
    let mut offsets = Vec::new();
    let mut total = 0usize;
    for &s in &sizes {
        offsets.push(total);
        total += s as usize + 1;
    }
    let src = source(&mut ctx, an, total)?;
    const GUARD: usize = 16;

    for (i, &s) in sizes.iter().enumerate() {
        let su = s as usize;
        let (rb, canary) = ctx.patterned(bn.host, su + GUARD)?;
        let rmr = ctx.reg(bn, &rb, 0..rb.len, Access::LocalOnly)?;
        let r = ctx.recv(bn, local(&rmr, 0, s)?)?;
        let w = ctx.send(an, bn, local(&src.mr, offsets[i] as u64, s)?)?;
        let what = format!("SEND of {s} B into a receive buffer of exactly {s} B");
        ctx.wait_wrs(&what, &[(an, w), (bn, r)])?;
        ctx.expect_ok(an, w, &what)?;
        match ctx.recv_result(bn, r) {
            Some(Ok(len)) if len == s => {}
            other => bail!("{what}: RECV completed with {other:?}, expected Ok({s})"),
        }
        let got = ctx.read(&rb, 0, rb.len)?;
        let mut want = src.bytes[offsets[i]..offsets[i] + su].to_vec();
        want.extend_from_slice(&canary[su..]);
        check_bytes(
            &format!("{what}: receive buffer (message + {GUARD} B after it)"),
            &got,
            &want,
        )?;
    }

    // All at once: every buffer can hold the largest message, so whichever
    // buffer a SEND lands in is fine.
    let n_max = ctx.caps(bn).max_recvs.min(ctx.caps(an).max_inflight);
    let batch: Vec<usize> = (0..sizes.len()).rev().take(n_max).collect();
    let slot = *sizes.last().unwrap_or(&0) as usize;
    let pool = ctx.alloc(bn.host, (slot.max(1)) * batch.len())?;
    let pmr = ctx.reg(bn, &pool, 0..pool.len, Access::LocalOnly)?;
    let mut recvs = BTreeMap::new();
    for k in 0..batch.len() {
        let r = ctx.recv(bn, local(&pmr, (k * slot.max(1)) as u64, slot as u64)?)?;
        recvs.insert(r, k);
    }
    let mut order = batch.clone();
    ctx.rng.shuffle(&mut order);
    let mut keys = Vec::new();
    let mut sends = Vec::new();
    for &i in &order {
        let w = ctx.send(an, bn, local(&src.mr, offsets[i] as u64, sizes[i])?)?;
        sends.push((w, sizes[i]));
        keys.push((an, w));
    }
    keys.extend(recvs.keys().map(|r| (bn, *r)));
    ctx.wait_wrs("all SENDs in flight at once", &keys)?;
    for (w, s) in &sends {
        ctx.expect_ok(an, *w, &format!("concurrent SEND of {s} B"))?;
    }
    let mut seen = BTreeSet::new();
    for (r, k) in &recvs {
        let len = match ctx.recv_result(bn, *r) {
            Some(Ok(len)) => len,
            other => bail!("concurrent phase: RECV {r:?} completed with {other:?}"),
        };
        let Some(i) = batch.iter().copied().find(|&i| sizes[i] == len) else {
            bail!("concurrent phase: RECV {r:?} reports {len} B, no SEND had that length")
        };
        ensure!(
            seen.insert(i),
            "concurrent phase: two receive buffers got a {len} B message (only one was sent)"
        );
        let got = ctx.read(&pool, k * slot.max(1), len as usize)?;
        check_bytes(
            &format!("concurrent phase: {len} B message in receive buffer {k}"),
            &got,
            &src.bytes[offsets[i]..offsets[i] + len as usize],
        )?;
    }
    ctx.quiesce()
}

/// A small pool of receive buffers serves many more SENDs from two
/// senders: each completed buffer is checked (its WR id says which buffer)
/// and reposted; every message arrives exactly once, intact, in any order.
pub(crate) fn recv_buffer_pool(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "recv_buffer_pool");
    let senders = [Ctx::nic(ctx.host(1)?, 0), Ctx::nic(ctx.host(1)?, 0)];
    let bn = Ctx::nic(ctx.host(1)?, 0);
    const SLOT: usize = 256;
    const PER_SENDER: usize = 120;
    let k = 8usize.min(ctx.caps(bn).max_recvs);
    let window = (2 * k).min(ctx.caps(senders[0]).max_inflight);
    let total = PER_SENDER * senders.len();

    // Message i: sender i % 2, 8..=SLOT bytes, starts with i (LE u64).
    let mut msgs = Vec::new();
    for i in 0..total {
        let len = ctx.rng.range(8, SLOT as u64) as usize;
        let mut m = (i as u64).to_le_bytes().to_vec();
        m.extend(ctx.pattern(len - 8));
        msgs.push(m);
    }
    let mut srcs = Vec::new();
    for (s, &nic) in senders.iter().enumerate() {
        let buf = ctx.alloc(nic.host, PER_SENDER * SLOT)?;
        for j in 0..PER_SENDER {
            let i = j * senders.len() + s;
            ctx.fill(&buf, j * SLOT, &msgs[i])?;
        }
        let mr = ctx.reg(nic, &buf, 0..buf.len, Access::LocalOnly)?;
        srcs.push(mr);
    }
    let pool = ctx.alloc(bn.host, k * SLOT)?;
    let pmr = ctx.reg(bn, &pool, 0..pool.len, Access::LocalOnly)?;
    let mut slot_of: BTreeMap<WrId, usize> = BTreeMap::new();
    for slot in 0..k {
        let r = ctx.recv(bn, local(&pmr, (slot * SLOT) as u64, SLOT as u64)?)?;
        slot_of.insert(r, slot);
    }
    let sender_addrs = [ctx.addr(senders[0]), ctx.addr(senders[1])];
    let mut next = [0usize; 2];
    let mut in_flight = [0usize; 2];
    let mut sends_ok = 0usize;
    let mut received = vec![false; total];
    let mut n_received = 0usize;
    let mut uses = vec![0u64; k];

    ctx.wait_until("every message through the receive pool", |c, events| {
        for ev in events {
            match &ev.completion {
                Completion::Recv { wr, result, from } if ev.nic == bn => {
                    let Some(slot) = slot_of.remove(wr) else {
                        bail!("RECV completion for {wr:?}, which is not a posted pool buffer")
                    };
                    let len = match result {
                        Ok(len) => *len as usize,
                        Err(e) => bail!("pool buffer {slot} completed with an error: {e}"),
                    };
                    ensure!(
                        (8..=SLOT).contains(&len),
                        "pool buffer {slot}: received length {len} is no message's length"
                    );
                    let got = c.read(&pool, slot * SLOT, len)?;
                    let mut idx = [0u8; 8];
                    idx.copy_from_slice(&got[..8]);
                    let i = u64::from_le_bytes(idx) as usize;
                    ensure!(
                        i < total,
                        "pool buffer {slot} holds garbage (message index {i})"
                    );
                    ensure!(
                        !received[i],
                        "message {i} received twice (second time in buffer {slot})"
                    );
                    check_bytes(
                        &format!("message {i} in pool buffer {slot}"),
                        &got,
                        &msgs[i],
                    )?;
                    // Message i came from sender i % 2: the completion
                    // names that NIC.
                    let want = &sender_addrs[i % senders.len()];
                    ensure!(
                        from.as_ref() == Some(want),
                        "message {i} says it came from {from:?}, it came from {want:?}"
                    );
                    received[i] = true;
                    n_received += 1;
                    uses[slot] += 1;
                    let r = c.recv(bn, local(&pmr, (slot * SLOT) as u64, SLOT as u64)?)?;
                    slot_of.insert(r, slot);
                }
                Completion::Send { wr, result } => {
                    let s = senders.iter().position(|n| *n == ev.nic).unwrap_or(0);
                    if let Err(e) = result {
                        bail!("SEND {wr:?} from {} failed: {e}", ev.nic);
                    }
                    in_flight[s] -= 1;
                    sends_ok += 1;
                }
                other => bail!("unexpected completion at {}: {other:?}", ev.nic),
            }
        }
        for (s, &nic) in senders.iter().enumerate() {
            while in_flight[s] < window && next[s] < PER_SENDER {
                let j = next[s];
                let i = j * senders.len() + s;
                let sl = local(&srcs[s], (j * SLOT) as u64, msgs[i].len() as u64)?;
                c.send(nic, bn, sl)?;
                next[s] += 1;
                in_flight[s] += 1;
            }
        }
        Ok(n_received == total && sends_ok == total)
    })?;
    ensure!(
        uses.iter().sum::<u64>() == total as u64,
        "pool accounting: {uses:?}"
    );
    ctx.quiesce()
}

/// A SEND larger than the receive buffer fails with `MessageTooLong` and
/// writes nothing past the buffer; a SEND larger than `max_send_len` is
/// rejected (at post or as an error completion).
pub(crate) fn message_too_long(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "message_too_long");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let src = source(&mut ctx, an, 64)?;
    let mut bufs = Vec::new();
    for _ in 0..2 {
        let (rb, canary) = ctx.patterned(bn.host, 64)?;
        let mr = ctx.reg(bn, &rb, 0..64, Access::LocalOnly)?;
        bufs.push((rb, canary, mr));
    }
    let r1 = ctx.recv(bn, local(&bufs[0].2, 0, 16)?)?;
    let w1 = ctx.send(an, bn, local(&src.mr, 0, 17)?)?;
    ctx.wait_wrs("a 17 B SEND into a 16 B buffer", &[(an, w1)])?;
    match ctx.op_result(an, w1)? {
        Err(TransportError::MessageTooLong { .. }) => {}
        Ok(()) => bail!("a 17 B SEND into the only posted buffer (16 B) succeeded"),
        Err(e) => bail!("a 17 B SEND into a 16 B buffer failed with {e}, expected MessageTooLong"),
    }
    // A fitting SEND still works (into whichever buffer is posted).
    let r2 = ctx.recv(bn, local(&bufs[1].2, 0, 16)?)?;
    let w2 = ctx.send(an, bn, local(&src.mr, 20, 16)?)?;
    ctx.wait_wrs("a 16 B SEND after the failed one", &[(an, w2)])?;
    ctx.expect_ok(an, w2, "a 16 B SEND after a MessageTooLong")?;
    ctx.wait_until("the 16 B message to be received", |c, _| {
        Ok([r1, r2]
            .iter()
            .any(|r| matches!(c.recv_result(bn, *r), Some(Ok(_)))))
    })?;
    ctx.h.settle();
    ctx.poll_all()?;
    let mut oks = 0;
    for (k, r) in [r1, r2].into_iter().enumerate() {
        let (rb, canary, _) = &bufs[k];
        let got = ctx.read(rb, 0, 64)?;
        match ctx.recv_result(bn, r) {
            Some(Ok(16)) => {
                oks += 1;
                let mut want = src.bytes[20..36].to_vec();
                want.extend_from_slice(&canary[16..]);
                check_bytes(
                    &format!("receive buffer {k} that took the 16 B message"),
                    &got,
                    &want,
                )?;
            }
            Some(Ok(n)) => bail!("receive buffer {k} (16 B) reported {n} B received"),
            Some(Err(_)) | None => {
                check_bytes(
                    &format!("receive buffer {k} (16 B, not reported filled): bytes 16..64"),
                    &got[16..],
                    &canary[16..],
                )?;
            }
        }
    }
    ensure!(
        oks == 1,
        "{oks} receive buffers report the single 16 B message"
    );

    let max = ctx.caps(an).max_send_len;
    if max < (64 << 20) {
        let over = max as usize + 1;
        let big = ctx.alloc(an.host, over)?;
        let bmr = ctx.reg(an, &big, 0..over, Access::LocalOnly)?;
        let rbig = ctx.alloc(bn.host, over)?;
        let rmr = ctx.reg(bn, &rbig, 0..over, Access::LocalOnly)?;
        let r = ctx.recv(bn, local(&rmr, 0, over as u64)?)?;
        let peer = ctx.peer(an, bn)?;
        match ctx.post_send(an, peer, local(&bmr, 0, over as u64)?)? {
            Err(e) if !e.is_retryable() => {}
            Err(e) => bail!("SEND of max_send_len + 1 = {over} B: {e}"),
            Ok(w) => {
                ctx.wait_wrs("a SEND of max_send_len + 1 bytes", &[(an, w)])?;
                if ctx.op_result(an, w)?.is_ok() {
                    bail!("a SEND of max_send_len + 1 = {over} B succeeded");
                }
            }
        }
        ctx.h.settle();
        ctx.poll_all()?;
        if let Some(Ok(n)) = ctx.recv_result(bn, r) {
            bail!("a SEND over max_send_len was received ({n} B)");
        }
    }
    ctx.quiesce()
}

/// A SEND to a peer without posted receive buffers fails with
/// `ReceiverNotReady` (bounded, never hangs); afterwards SENDs work and the
/// failed message is never delivered.
pub(crate) fn receiver_not_ready(h: &mut dyn Harness) -> Result<(), CaseFailure> {
    let mut ctx = Ctx::new(h, "receiver_not_ready");
    let an = Ctx::nic(ctx.host(1)?, 0);
    let bn = Ctx::nic(ctx.host(1)?, 0);
    let src = source(&mut ctx, an, 64)?;
    let w1 = ctx.send(an, bn, local(&src.mr, 0, 32)?)?;
    ctx.wait_wrs(
        "a SEND to a peer with no receive buffer posted",
        &[(an, w1)],
    )?;
    match ctx.op_result(an, w1)? {
        Err(TransportError::ReceiverNotReady { .. }) => {}
        Ok(()) => bail!("a SEND to a peer with no receive buffer posted succeeded"),
        Err(e) => bail!("a SEND with no receive buffer failed with {e}, expected ReceiverNotReady"),
    }
    let rb = ctx.alloc(bn.host, 64)?;
    let rmr = ctx.reg(bn, &rb, 0..64, Access::LocalOnly)?;
    let r = ctx.recv(bn, local(&rmr, 0, 64)?)?;
    let w2 = ctx.send(an, bn, local(&src.mr, 32, 32)?)?;
    ctx.wait_wrs("a SEND after receiver-not-ready", &[(an, w2), (bn, r)])?;
    ctx.expect_ok(an, w2, "a SEND after a ReceiverNotReady")?;
    match ctx.recv_result(bn, r) {
        Some(Ok(32)) => {}
        other => bail!("RECV after receiver-not-ready completed with {other:?}, expected Ok(32)"),
    }
    let got = ctx.read(&rb, 0, 32)?;
    check_bytes(
        "the message received after receiver-not-ready (must be the second SEND, not the failed one)",
        &got,
        &src.bytes[32..64],
    )?;
    ctx.quiesce()
}
