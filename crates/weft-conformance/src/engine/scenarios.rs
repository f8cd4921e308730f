//! The engine scenarios. Each is `fn(&mut dyn EngineHarness) -> Result<(),
//! CaseFailure>`; the initiator's source buffer is filled with the pattern
//! of a seed derived from the harness seed, and every peer checks its bytes
//! against that pattern when a round fires.

use super::run::{bail, engine_err, ensure, harness, is_unreachable, Run};
use super::{EngineHarness, Kind, Region};
use crate::pattern::Rng;
use crate::{CaseFailure, HarnessError};
use std::sync::Arc;
use weft_engine::{DoneCounter, EngineError, Imm, MrDesc, OnDone, Pages, ScatterDst, ScatterMode};
use weft_testkit::pattern;

pub(crate) use super::lifecycle::{peer_restart, peer_restart_in_place};

const SIZES: [u64; 9] = [
    1,
    7,
    4095,
    4097,
    65_535,
    65_539,
    200_001,
    (1 << 20) + 13,
    3 * 1024 * 1024 + 777,
];

/// Sharded single writes to 2 peers: each size its own round, then every
/// size in one round per peer.
pub(crate) fn single_writes(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, 4 << 20)?;
    let peers = r.add_peers(2, 8 << 20)?;
    let imms = r.imms();
    for (k, &len) in SIZES.iter().enumerate() {
        let tag = k as u64;
        let mut flags = Vec::new();
        for &j in &peers {
            let so = (3 + 5 * k + 11 * j) as u64;
            let d_o = 11 * k as u64;
            let reg = r.region(so, d_o, len);
            let n = r.expect(j, tag, imms[0], vec![Kind::Single { len }], vec![reg])?;
            let nics = r.h.peer(j).address().nics.len();
            ensure!(
                len < 65_536 || nics < 2 || n >= 2,
                "len {len}: expected sharding over {nics} NICs, {n} pieces"
            );
            let dst = r.desc(j);
            flags.push(r.single(len, Some(imms[0]), so, &dst, d_o)?);
        }
        r.wait_ok(&format!("single writes of {len} B"), &flags)?;
        r.wait_rounds(&peers, tag)?;
    }
    // Every size at once, one round per peer.
    let tag = 100;
    let mut flags = Vec::new();
    for &j in &peers {
        let (mut kinds, mut regions, mut wrs) = (Vec::new(), Vec::new(), Vec::new());
        let mut dst_off = 0u64;
        for (k, &len) in SIZES.iter().enumerate() {
            let so = (3 + 5 * k + 11 * j) as u64;
            kinds.push(Kind::Single { len });
            regions.push(r.region(so, dst_off, len));
            wrs.push((len, so, dst_off));
            dst_off += len + 4096 + 7;
        }
        r.expect(j, tag, imms[1], kinds, regions)?;
        let dst = r.desc(j);
        for (len, so, d_o) in wrs {
            flags.push(r.single(len, Some(imms[1]), so, &dst, d_o)?);
        }
    }
    r.wait_ok("single writes of every size at once", &flags)?;
    r.wait_rounds(&peers, tag)?;
    r.finish(&[])
}

/// Paged writes: odd page lengths, scattered pages, a permutation per peer.
pub(crate) fn paged_writes(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, 1 << 20)?;
    let peers = r.add_peers(2, 4 << 20)?;
    let imms = r.imms();
    // (page length, source pages, destination pages) per peer.
    let layouts = |j: usize| -> Vec<(u64, Pages, Pages)> {
        let mut di: Vec<u32> = vec![3, 6, 0, 7, 1, 5, 2, 4];
        di.rotate_left(j);
        vec![
            (
                5000,
                Pages {
                    indices: vec![5, 0, 9, 2, 7, 3, 11, 1],
                    stride: 8192,
                    offset: 17 + j as u64,
                },
                Pages {
                    indices: di,
                    stride: 6000,
                    offset: 2 << 20,
                },
            ),
            (
                20_000,
                Pages {
                    indices: (0..12).rev().collect(),
                    stride: 20_000,
                    offset: 100_000,
                },
                Pages {
                    indices: (0..12).map(|i| (i * 5 + j as u32) % 13).collect(),
                    stride: 20_064,
                    offset: 32,
                },
            ),
        ]
    };
    for (round, &imm) in imms.iter().take(2).enumerate() {
        let tag = round as u64;
        let mut flags = Vec::new();
        for &j in &peers {
            let (page, sp, dp) = layouts(j).swap_remove(round);
            let mut regions = Vec::new();
            for i in 0..sp.indices.len() {
                let (Some(s), Some(d)) = (sp.page_offset(i), dp.page_offset(i)) else {
                    bail!("page {i} has no offset");
                };
                regions.push(r.region(s, d, page));
            }
            let kinds = vec![Kind::Paged {
                page_len: page,
                pages: sp.indices.len() as u64,
            }];
            r.expect(j, tag, imm, kinds, regions)?;
            let dst = r.desc(j);
            let (od, flag) = OnDone::flag();
            r.init
                .submit_paged_writes(page, Some(imm), (&r.smr, &sp), (&dst, &dp), od)
                .map_err(|e| engine_err("submit paged writes", e))?;
            flags.push(flag);
        }
        r.wait_ok(&format!("paged writes, round {round}"), &flags)?;
        r.wait_rounds(&peers, tag)?;
    }
    r.finish(&[])
}

/// A scatter (one `mode`) to `members` with immediate `imm` as round
/// `tag`, then a barrier with `bimm` as round `tag + 1000`.
fn scatter_round(
    r: &mut Run<'_>,
    members: &[usize],
    mode: ScatterMode,
    tag: u64,
    imm: Imm,
    bimm: Imm,
) -> Result<(), CaseFailure> {
    let addrs: Vec<_> = members.iter().map(|&j| r.h.peer(j).address()).collect();
    let group = r
        .init
        .add_peer_group(&addrs)
        .map_err(|e| engine_err("add peer group", e))?;
    let by_bytes = mode == ScatterMode::ByBytes;
    let mut dsts = Vec::new();
    for (k, &j) in members.iter().enumerate() {
        let len = [70_001u64, 3, 1_200_000 + 4096 * (tag % 4), 65_536][(j + tag as usize) % 4];
        let d = ScatterDst {
            len,
            src_offset: (k as u64) * 1_300_000 + tag % 64,
            dst: r.desc(j),
            dst_offset: 17 * j as u64 + 4096 * (tag % 64),
        };
        let reg = r.region(d.src_offset, d.dst_offset, len);
        r.expect(
            j,
            tag,
            imm,
            vec![Kind::Scatter { len, by_bytes }],
            vec![reg],
        )?;
        dsts.push(d);
    }
    let (od, flag) = OnDone::flag();
    r.init
        .submit_scatter_mode(&group, od, Some(imm), &r.smr, &dsts, mode)
        .map_err(|e| engine_err("submit scatter", e))?;
    r.wait_ok(&format!("scatter {mode:?} round {tag}"), &[flag])?;
    r.wait_rounds(members, tag)?;
    let btag = tag + 1000;
    for &j in members {
        r.expect(j, btag, bimm, vec![Kind::Barrier], vec![])?;
    }
    let descs: Vec<MrDesc> = members.iter().map(|&j| r.desc(j)).collect();
    let (od, flag) = OnDone::flag();
    r.init
        .submit_barrier(&group, od, bimm, &descs)
        .map_err(|e| engine_err("submit barrier", e))?;
    r.wait_ok(&format!("barrier after round {tag}"), &[flag])?;
    r.wait_rounds(members, btag)
}

const SCATTER_SRC: usize = 3 * 1_300_000 + (2 << 20);

/// Scatter to 3 peers in both modes, each followed by a barrier.
pub(crate) fn scatter_and_barrier(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, SCATTER_SRC)?;
    let peers = r.add_peers(3, 2 << 20)?;
    let imms = r.imms();
    scatter_round(&mut r, &peers, ScatterMode::ByPeer, 1, imms[2], imms[3])?;
    scatter_round(&mut r, &peers, ScatterMode::ByBytes, 2, imms[2], imms[3])?;
    // A subset of the peers (a fresh group), roles of the sizes rotated.
    scatter_round(
        &mut r,
        &peers[1..],
        ScatterMode::ByBytes,
        3,
        imms[2],
        imms[3],
    )?;
    r.finish(&[])
}

/// A pool of 4 receive buffers, re-posted while 12 messages arrive.
pub(crate) fn send_recv_pools(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    send_recv(h, false)
}

/// [`send_recv_pools`] with a polled pool.
pub(crate) fn send_recv_polled(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    send_recv(h, true)
}

fn send_recv(h: &mut dyn EngineHarness, polled: bool) -> Result<(), CaseFailure> {
    const POOL: u32 = 4;
    let mut r = Run::new(h, 4096)?;
    let peers = r.add_peers(1, 4096)?;
    let p = peers[0];
    r.h.peer(p)
        .post_recvs(8192, POOL, polled)
        .map_err(harness)?;
    let addr = r.h.peer(p).address();
    let sizes = [1usize, 100, 4096, 8000, 33, 8192, 0, 10, 5000, 4097, 7, 2];
    let seed = r.seed;
    let mut msgs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &l)| pattern(seed ^ (100 + k as u64), l))
        .collect();
    // In waves of the pool size, so no SEND can find the pool empty.
    let mut got: Vec<Vec<u8>> = Vec::new();
    for wave in msgs.chunks(POOL as usize) {
        let mut flags = Vec::new();
        for m in wave {
            let (od, flag) = OnDone::flag();
            r.init
                .submit_send(&addr, m, od)
                .map_err(|e| engine_err(&format!("submit send of {} B", m.len()), e))?;
            flags.push(flag);
        }
        r.wait_ok("sends", &flags)?;
        let want = got.len() + wave.len();
        let mut err = None;
        r.wait("every message of the wave received", |r| {
            for m in r.h.peer(p).take_received() {
                match m {
                    Ok(m) => got.push(m),
                    Err(e) => err = Some(e),
                }
            }
            err.is_some() || got.len() >= want
        })?;
        if let Some(e) = err {
            bail!("receive failed: {e}");
        }
    }
    for _ in 0..64 {
        r.h.progress();
    }
    got.extend(
        r.h.peer(p)
            .take_received()
            .into_iter()
            .filter_map(Result::ok),
    );
    got.sort();
    msgs.sort();
    ensure!(
        got == msgs,
        "received messages differ from the sent ones: got {} messages of sizes {:?}, sent sizes {:?}",
        got.len(),
        got.iter().map(Vec::len).collect::<Vec<_>>(),
        msgs.iter().map(Vec::len).collect::<Vec<_>>()
    );
    r.finish(&[])
}

/// Rounds of one immediate value whose arrivals (all, some, or none) come
/// before `expect_imm_count` is armed.
pub(crate) fn imm_early_arrival(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    const SRC: u64 = 1 << 20;
    let mut r = Run::new(h, SRC as usize)?;
    let peers = r.add_peers(1, 2 << 20)?;
    let p = peers[0];
    let imm = r.imms()[0];
    let dst = r.desc(p);
    let mut rng = Rng::new(r.seed);
    for round in 0..8u64 {
        let writes = 1 + rng.below(3);
        // Round 0: all early; round 1: none early; then seeded.
        let early = match round {
            0 => writes,
            1 => 0,
            _ => rng.below(writes + 1),
        };
        let plan: Vec<(u64, u64, u64)> = (0..writes)
            .map(|w| {
                let len = 1 + rng.below(300_000);
                (len, rng.below(SRC - len), w * 300_000 + rng.below(4096))
            })
            .collect();
        let kinds = plan
            .iter()
            .map(|&(len, _, _)| Kind::Single { len })
            .collect();
        let regions: Vec<Region> = plan.iter().map(|&(l, s, d)| r.region(s, d, l)).collect();
        let mut flags = Vec::new();
        for &(len, so, d_o) in &plan[..early as usize] {
            flags.push(r.single(len, Some(imm), so, &dst, d_o)?);
        }
        // Delivery-complete: once the writes completed at the initiator,
        // their immediates are at the peer, which has not armed yet.
        r.wait_ok(&format!("round {round}: early writes"), &flags)?;
        for _ in 0..32 {
            r.h.progress();
        }
        r.expect(p, round, imm, kinds, regions)?;
        for &(len, so, d_o) in &plan[early as usize..] {
            flags.push(r.single(len, Some(imm), so, &dst, d_o)?);
        }
        r.wait_ok(&format!("round {round}: writes"), &flags)?;
        r.wait_rounds(&[p], round)?;
    }
    r.finish(&[])
}

/// Writes pending to a peer whose host dies; the survivor is unaffected.
pub(crate) fn peer_death(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    const WRITES: u64 = 8;
    const WLEN: u64 = 1 << 20;
    const LEN: usize = (WRITES * WLEN) as usize + (1 << 20);
    let mut r = Run::new(h, SCATTER_SRC.max((WRITES * 4096 + 2 * WLEN) as usize))?;
    let peers = r.add_peers(2, LEN)?;
    let (survivor, victim) = (peers[0], peers[1]);
    let imms = r.imms();
    // Warm up: connections on every NIC to both peers.
    scatter_round(&mut r, &peers, ScatterMode::ByBytes, 1, imms[2], imms[3])?;

    // A stopped victim cannot complete anything: its writes are certainly
    // pending when it dies. Without that hook, it dies after a seeded
    // number of progress rounds.
    let stopped = match r.h.stop_peer(victim) {
        Ok(()) => true,
        Err(HarnessError::Unsupported(_)) => false,
        Err(e) => return Err(harness(e)),
    };
    let src_off = |k: u64, j: usize| k * 4096 + j as u64;
    let kinds = (0..WRITES).map(|_| Kind::Single { len: WLEN }).collect();
    let regions = (0..WRITES)
        .map(|k| r.region(src_off(k, survivor), k * WLEN, WLEN))
        .collect();
    r.expect(survivor, 10, imms[0], kinds, regions)?;
    let (sdst, vdst) = (r.desc(survivor), r.desc(victim));
    let (mut to_s, mut to_v) = (Vec::new(), Vec::new());
    for k in 0..WRITES {
        to_s.push(r.single(WLEN, Some(imms[0]), src_off(k, survivor), &sdst, k * WLEN)?);
        to_v.push(r.single(WLEN, Some(imms[0]), src_off(k, victim), &vdst, k * WLEN)?);
    }
    if stopped {
        r.wait_ok("writes to the survivor while the victim is stopped", &to_s)?;
        r.wait_rounds(&[survivor], 10)?;
    } else {
        // Seeded: at once (seed % 3 == 0: nothing can have completed), or
        // after a few progress rounds, stopping once one write completed.
        for _ in 0..r.h.seed() % 3 * 8 {
            if to_v.iter().any(|f| f.is_done()) {
                break;
            }
            r.h.progress();
        }
    }
    let pending = to_v.iter().filter(|f| !f.is_done()).count();
    ensure!(
        !stopped || pending > 0,
        "every write to the stopped victim completed: the death would not be mid-transfer"
    );
    r.h.kill_peer(victim).map_err(harness)?;
    if pending == 0 {
        // A fabric fast enough to finish everything in one progress round:
        // this seed checks death after the transfers only.
        crate::note(&format!(
            "note: peer_death seed {}: every write to the victim completed before it died",
            r.h.seed()
        ));
    }

    // Every write to the victim resolves: success (acknowledged before the
    // death) or PeerUnreachable; a stopped victim acknowledged nothing.
    let results = r.wait_flags("every write to the dead peer resolved", &to_v)?;
    let mut failed = 0;
    for (k, res) in results.iter().enumerate() {
        match res {
            Ok(()) if stopped => bail!("write {k} to a stopped-then-killed peer succeeded"),
            Ok(()) => {}
            Err(e) if is_unreachable(e) => failed += 1,
            Err(e) => {
                bail!("write {k} to the dead peer: expected Transport/PeerUnreachable, got {e}")
            }
        }
    }
    // Writes acknowledged just before the death may still succeed, but
    // when none had completed (a stopped victim, or one killed before any
    // progress), some must fail.
    ensure!(
        failed > 0 || (pending < to_v.len() && !stopped),
        "{pending} of {} writes were pending at the death, none failed",
        to_v.len()
    );
    // New work to the dead peer fails too (no hang).
    let f = r.single(WLEN, Some(imms[0]), 0, &vdst, 0)?;
    match r
        .wait_flags("write to the dead peer after its death", &[f])?
        .remove(0)
    {
        Ok(()) => bail!("write to a dead peer succeeded"),
        Err(e) => ensure!(
            is_unreachable(&e),
            "write to the dead peer after its death: {e}"
        ),
    }

    // The survivor is unaffected: its writes complete byte-exact, and a
    // fresh round and a scatter + barrier work afterwards.
    r.wait_ok("writes to the survivor", &to_s)?;
    r.wait_rounds(&[survivor], 10)?;
    let regions = (0..2u64)
        .map(|k| r.region(k * 8192 + 5, (k + 1) * WLEN, WLEN))
        .collect();
    let kinds = vec![Kind::Single { len: WLEN }; 2];
    r.expect(survivor, 30, imms[1], kinds, regions)?;
    let mut flags = Vec::new();
    for k in 0..2u64 {
        flags.push(r.single(WLEN, Some(imms[1]), k * 8192 + 5, &sdst, (k + 1) * WLEN)?);
    }
    r.wait_ok("writes to the survivor after the death", &flags)?;
    r.wait_rounds(&[survivor], 30)?;
    scatter_round(
        &mut r,
        &[survivor],
        ScatterMode::ByPeer,
        40,
        imms[2],
        imms[3],
    )?;
    scatter_round(
        &mut r,
        &[survivor],
        ScatterMode::ByBytes,
        41,
        imms[2],
        imms[3],
    )?;
    r.peers.retain(|&p| p != victim);
    r.finish(&[victim])
}

/// The initiator is shut down with work in flight; then a peer with an
/// armed round.
pub(crate) fn shutdown_in_flight(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, 1 << 20)?;
    let peers = r.add_peers(2, 2 << 20)?;
    let imms = r.imms();
    // A round that can never complete (nothing carries imms[3]).
    let never = Kind::Single { len: 1 };
    r.expect(peers[1], 90, imms[3], vec![never; 3], vec![])?;
    let done = Arc::new(DoneCounter::new());
    let mut accepted = 0u64;
    let descs: Vec<MrDesc> = peers.iter().map(|&p| r.desc(p)).collect();
    let mut rng = Rng::new(r.seed);
    for i in 0..200u64 {
        let len = 1 + rng.below(200_000);
        let so = rng.below((1 << 20) - len);
        let d_o = rng.below((2 << 20) - len);
        let dst = &descs[(i % 2) as usize];
        let res = if i % 10 == 9 {
            let pages = Pages {
                indices: vec![3, 1, 2, 0],
                stride: 5000,
                offset: 0,
            };
            r.init.submit_paged_writes(
                4000,
                Some(imms[0]),
                (&r.smr, &pages),
                (dst, &pages),
                OnDone::counter(&done),
            )
        } else {
            r.init.submit_single_write(
                len,
                Some(imms[0]),
                (&r.smr, so),
                (dst, d_o),
                OnDone::counter(&done),
            )
        };
        match res {
            Ok(_) => accepted += 1,
            Err(EngineError::QueueFull { .. }) => {}
            Err(e) => bail!("submit {i}: {e}"),
        }
    }
    ensure!(accepted > 0, "no submit was accepted");
    r.init.shutdown();
    // Every accepted transfer resolved (successfully or not).
    r.wait("every accepted transfer resolved", |_| {
        done.total() >= accepted
    })?;
    ensure!(
        done.total() == accepted,
        "{} resolutions for {accepted} accepted transfers",
        done.total()
    );
    let (od, _flag) = OnDone::flag();
    match r
        .init
        .submit_single_write(1, None, (&r.smr, 0), (&descs[0], 0), od)
    {
        Err(EngineError::ShutDown) => {}
        other => bail!("submit after shutdown: expected ShutDown, got {other:?}"),
    }
    // The peer with an armed round shuts down: the round resolves, failed.
    r.h.peer(peers[1]).shutdown().map_err(harness)?;
    r.wait_rounds(&[peers[1]], 90).err();
    match r.rounds.get(&(peers[1], 90)).map(Vec::as_slice) {
        Some([Err(_)]) => {}
        Some(v) => bail!("round armed at shutdown resolved as {v:?}, expected one error"),
        None => bail!("round armed at shutdown never resolved"),
    }
    r.armed.retain(|a| *a != (peers[1], 90));
    r.rounds.remove(&(peers[1], 90));
    r.peers.retain(|&p| p != peers[1]);
    r.finish(&[])
}
