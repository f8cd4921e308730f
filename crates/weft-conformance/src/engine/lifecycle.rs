//! The peer lifecycle scenarios: a peer killed mid-transfer, removed with
//! `TransferEngine::remove_peer` and restarted (a new host / process, at a
//! new address or a reused one), [`RESTARTS`] times; and a peer killed and
//! restarted at the same NIC addresses ([`IN_PLACE_RESTARTS`] times),
//! which the new incarnation replaces once the old one is known to have
//! ended: reported unreachable by the transport, or removed by the
//! application after the engine refused the new descriptor as unproven.

use super::run::{bail, engine_err, ensure, harness, is_unreachable, Run};
use super::{EngineHarness, Kind};
use crate::CaseFailure;
use std::sync::Arc;
use weft_engine::{DoneFlag, GroupAddress, Imm, MrDesc, OnDone, PeerGroupHandle, TransferEngine};

/// Restarts of the peer per run.
pub const RESTARTS: u64 = 20;

/// Restarts at the same NIC addresses per run of `peer_restart_in_place`.
pub const IN_PLACE_RESTARTS: u64 = 6;

/// Bytes per write.
const WLEN: u64 = 64 << 10;
/// Writes per transfer batch.
const WRITES: u64 = 4;
/// Peer buffer size.
const BUF: usize = (WRITES * WLEN) as usize;

/// Peers the initiator's NICs have resolved (all groups).
fn peers_resolved(e: &TransferEngine) -> u64 {
    e.stats()
        .groups
        .iter()
        .flat_map(|g| g.nics.iter())
        .map(|n| n.peers)
        .sum()
}

/// Arms round `tag` at `p` and writes [`WRITES`] patterned writes to it;
/// waits until every one succeeded and the round fired with every byte in
/// place (nothing lost).
fn full_round(r: &mut Run<'_>, p: usize, tag: u64, salt: u64) -> Result<(), CaseFailure> {
    let imm = r.imms()[0];
    let desc = r.desc(p);
    let src = |k: u64| k * WLEN + (17 * salt) % 4096;
    let kinds = (0..WRITES).map(|_| Kind::Single { len: WLEN }).collect();
    let regions = (0..WRITES)
        .map(|k| r.region(src(k), k * WLEN, WLEN))
        .collect();
    r.expect(p, tag, imm, kinds, regions)?;
    let mut flags = Vec::new();
    for k in 0..WRITES {
        flags.push(r.single(WLEN, Some(imm), src(k), &desc, k * WLEN)?);
    }
    r.wait_ok(&format!("round {tag} to peer {p}"), &flags)?;
    r.wait_rounds(&[p], tag)
}

/// Waits for the writes pending at the kill of incarnation `k`: each
/// resolves once, with success, `PeerUnreachable` or `PeerRemoved`.
fn pending_resolved_once(
    r: &mut Run<'_>,
    k: u64,
    pending: &[Arc<DoneFlag>],
) -> Result<(), CaseFailure> {
    let results = r.wait_flags(
        &format!("writes pending at the kill of incarnation {k}"),
        pending,
    )?;
    for (w, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            ensure!(
                is_unreachable(&e) || e.is_peer_removed(),
                "incarnation {k}, write {w} pending at the kill: expected \
                 PeerUnreachable or PeerRemoved, got {e}"
            );
        }
    }
    Ok(())
}

/// A write with `imm` to `desc` (a descriptor of `whom`, an incarnation
/// gone at step `k`) fails with `PeerRemoved`.
fn write_refused(
    r: &mut Run<'_>,
    k: u64,
    whom: &str,
    imm: Imm,
    desc: &MrDesc,
) -> Result<(), CaseFailure> {
    let f = r.single(WLEN, Some(imm), 0, desc, 0)?;
    match r.wait_flags(&format!("write to {whom}"), &[f])?.remove(0) {
        Ok(()) => bail!("incarnation {k}: a write to {whom} succeeded"),
        Err(e) => ensure!(
            e.is_peer_removed(),
            "incarnation {k}: write to {whom}: expected PeerRemoved, got {e}"
        ),
    }
    Ok(())
}

/// A barrier to peer `group`, which has a `how` (removed or replaced)
/// member, is refused or fails with `PeerRemoved`.
fn barrier_refused(
    r: &mut Run<'_>,
    k: u64,
    how: &str,
    group: &PeerGroupHandle,
    imm: Imm,
    dsts: &[MrDesc],
) -> Result<(), CaseFailure> {
    let what = format!("barrier to a group with a {how} member");
    let (od, flag) = OnDone::flag();
    let refused = match r.init.submit_barrier(group, od, imm, dsts) {
        Err(e) => Some(e),
        Ok(_) => r.wait_flags(&what, &[flag])?.remove(0).err(),
    };
    match refused {
        Some(e) => ensure!(
            e.is_peer_removed(),
            "incarnation {k}: {what}: expected PeerRemoved, got {e}"
        ),
        None => bail!("incarnation {k}: {what} succeeded"),
    }
    Ok(())
}

/// A peer is killed with writes to it in flight, removed, and restarted at
/// a new address, [`RESTARTS`] times; a second peer survives throughout.
/// Each incarnation first gets a full round (every write acknowledged, the
/// round fires once with every byte in place — rounds of a fresh engine use
/// the same immediate value as the writes aimed at its predecessor, so a
/// stray immediate of the old incarnation would fire it early or twice);
/// writes pending at the kill each resolve once (success, `PeerUnreachable`
/// or `PeerRemoved`); a write to the old incarnation's descriptor after the
/// removal fails with `PeerRemoved`; the initiator's resolved peer count is
/// back to its baseline after each removal; every incarnation differs from
/// the earlier ones (its NIC addresses may be reused: the engine tells
/// incarnations apart, not addresses).
pub(crate) fn peer_restart(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, BUF + 4096)?;
    let survivor = r.add_peers(1, BUF)?[0];
    full_round(&mut r, survivor, 1, 0)?;
    let baseline = peers_resolved(&r.init);
    let mut gone: Vec<GroupAddress> = Vec::new();
    let mut dead = Vec::new();
    let mut cur = r.add_peers(1, BUF)?[0];
    let mut reused = 0;
    for k in 0..RESTARTS {
        let addr = r.h.peer(cur).address();
        ensure!(
            r.h.peer(cur).desc().incarnation == addr.incarnation,
            "incarnation {k}: descriptor and address name different incarnations"
        );
        if let Some(old) = gone.iter().find(|g| g.incarnation == addr.incarnation) {
            bail!("incarnation {k} repeats an earlier one: {old:?}");
        }
        if gone
            .iter()
            .any(|g| g.nics.iter().any(|a| addr.nics.contains(a)))
        {
            reused += 1;
        }
        full_round(&mut r, cur, 100 + k, k)?;
        if k % 5 == 4 {
            full_round(&mut r, survivor, 1000 + k, k)?;
        }
        // A peer group with this incarnation as a member (resolved now).
        let group = r
            .init
            .add_peer_group(&[r.h.peer(survivor).address(), addr.clone()])
            .map_err(|e| engine_err("add_peer_group", e))?;
        // Mid-transfer: writes submitted, none waited for, then the kill.
        let desc = r.desc(cur);
        let imm = r.imms()[0];
        let mut pending = Vec::new();
        for w in 0..WRITES {
            pending.push(r.single(WLEN, Some(imm), w * WLEN, &desc, w * WLEN)?);
        }
        r.h.kill_peer(cur).map_err(harness)?;
        r.init
            .remove_peer(&addr)
            .map_err(|e| engine_err("remove_peer", e))?;
        pending_resolved_once(&mut r, k, &pending)?;
        // The old incarnation's descriptor is refused from now on.
        write_refused(&mut r, k, "the removed peer", imm, &desc)?;
        // So is every peer group it was a member of.
        let dsts = [r.desc(survivor), desc.clone()];
        barrier_refused(&mut r, k, "removed", &group, imm, &dsts)?;
        let now = peers_resolved(&r.init);
        ensure!(
            now == baseline,
            "incarnation {k}: {now} peers resolved after the removal, {baseline} before it"
        );
        gone.push(addr);
        dead.push(cur);
        cur = r.add_peers(1, BUF)?[0];
    }
    full_round(&mut r, cur, 100 + RESTARTS, RESTARTS)?;
    full_round(&mut r, survivor, 2, 1)?;
    if reused > 0 {
        crate::note(&format!(
            "peer_restart on {}: {reused} of {RESTARTS} incarnations reused an earlier address",
            r.h.name()
        ));
    }
    r.finish(&dead)
}

/// Whether `e` refuses a newer incarnation as unproven.
fn is_unproven(e: &weft_engine::EngineError) -> bool {
    e.is_unproven_incarnation()
}

/// A peer is killed with writes to it in flight and restarted at the same
/// NIC addresses ([`EngineHarness::restart_peer_in_place`]),
/// [`IN_PLACE_RESTARTS`] times; a second peer survives throughout. The new
/// incarnation is newer than the old. A descriptor is no proof that the
/// old one ended, so the new one replaces it only once that is known: on
/// even restarts the initiator's write to the dead peer before the restart
/// fails with `PeerUnreachable` (a heartbeat: the transport's word) and the
/// first write to the new incarnation replaces the old one; on odd ones the
/// initiator may have seen nothing — then the first write to the new
/// incarnation fails with `IncarnationUnproven` (nothing sent) and the
/// application removes the old incarnation (`remove_peer`), as it would on
/// its own evidence (its rendezvous store, a heartbeat). Each incarnation's rounds fire
/// once with every byte in place (rounds reuse the old incarnation's
/// immediate value, so a stray immediate would fire one early or twice);
/// writes pending at the kill resolve once (success, `PeerUnreachable` or
/// `PeerRemoved`); a write with an immediate to the old incarnation's
/// descriptor after the replacement fails with `PeerRemoved` (never
/// posted: the next round still fires exactly once); a peer group with the
/// old incarnation fails with `PeerRemoved`, one with the new works; the
/// initiator's resolved peer count is unchanged (the old peer was freed).
pub(crate) fn peer_restart_in_place(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    if !h.restarts_in_place() {
        return Err(CaseFailure::Skipped(format!(
            "{} cannot restart a peer at its NIC addresses",
            h.name()
        )));
    }
    let mut r = Run::new(h, BUF + 4096)?;
    let survivor = r.add_peers(1, BUF)?[0];
    full_round(&mut r, survivor, 1, 0)?;
    let mut dead = Vec::new();
    let mut cur = r.add_peers(1, BUF)?[0];
    full_round(&mut r, cur, 100, 0)?;
    let baseline = peers_resolved(&r.init);
    for k in 0..IN_PLACE_RESTARTS {
        let addr = r.h.peer(cur).address();
        let sur = r.h.peer(survivor).address();
        let group = r
            .init
            .add_peer_group(&[sur.clone(), addr.clone()])
            .map_err(|e| engine_err("add_peer_group", e))?;
        let desc = r.desc(cur);
        let imm = r.imms()[0];
        let mut pending = Vec::new();
        for w in 0..WRITES {
            pending.push(r.single(WLEN, Some(imm), w * WLEN, &desc, w * WLEN)?);
        }
        r.h.kill_peer(cur).map_err(harness)?;
        pending_resolved_once(&mut r, k, &pending)?;
        if k % 2 == 0 {
            // A heartbeat: the transport says the peer is gone.
            let f = r.single(64, None, 0, &desc, 0)?;
            match r.wait_flags("a write to the dead peer", &[f])?.remove(0) {
                Err(e) if is_unreachable(&e) => {}
                res => bail!("incarnation {k}: a write to the dead peer: expected PeerUnreachable, got {res:?}"),
            }
        }
        dead.push(cur);
        let next = r.restart_in_place(cur, BUF)?;
        let naddr = r.h.peer(next).address();
        ensure!(
            naddr.nics == addr.nics,
            "incarnation {k}: restarted in place at {naddr:?}, was {addr:?}"
        );
        ensure!(
            naddr.incarnation > addr.incarnation,
            "incarnation {k}: the restart's incarnation {} is not newer than {}",
            naddr.incarnation,
            addr.incarnation
        );
        if k % 2 == 1 {
            // Nothing may have told the initiator that the old incarnation
            // ended: the new descriptor is then refused, nothing is sent,
            // until the application removes the old one.
            let ndesc = r.desc(next);
            let f = r.single(64, None, 0, &ndesc, 0)?;
            match r
                .wait_flags("a first write to the restarted peer", &[f])?
                .remove(0)
            {
                Ok(()) => {}
                Err(e) if is_unproven(&e) => r
                    .init
                    .remove_peer(&addr)
                    .map_err(|e| engine_err("remove_peer", e))?,
                Err(e) => bail!("incarnation {k}: a first write to the restarted peer: {e}"),
            }
        }
        // The first round to the new incarnation replaces the old one.
        full_round(&mut r, next, 200 + k, k)?;
        // The old incarnation's descriptor is refused, never posted.
        write_refused(&mut r, k, "the replaced incarnation", imm, &desc)?;
        // A stray immediate from that write would fire this round early
        // or twice (`finish` checks once).
        full_round(&mut r, next, 300 + k, k + 1)?;
        let dsts = [r.desc(survivor), desc.clone()];
        barrier_refused(&mut r, k, "replaced", &group, imm, &dsts)?;
        let fresh = r
            .init
            .add_peer_group(&[sur, naddr])
            .map_err(|e| engine_err("add_peer_group with the new incarnation", e))?;
        let bimm = r.imms()[1];
        let btag = 400 + k;
        for p in [survivor, next] {
            r.expect(p, btag, bimm, vec![Kind::Barrier], vec![])?;
        }
        let (od, flag) = OnDone::flag();
        let dsts = [r.desc(survivor), r.desc(next)];
        r.init
            .submit_barrier(&fresh, od, bimm, &dsts)
            .map_err(|e| engine_err("barrier with the new incarnation", e))?;
        r.wait_ok("barrier with the new incarnation", &[flag])?;
        r.wait_rounds(&[survivor, next], btag)?;
        let now = peers_resolved(&r.init);
        ensure!(
            now == baseline,
            "incarnation {k}: {now} peers resolved after the replacement, {baseline} before"
        );
        cur = next;
    }
    full_round(&mut r, survivor, 2, 1)?;
    r.finish(&dead)
}
