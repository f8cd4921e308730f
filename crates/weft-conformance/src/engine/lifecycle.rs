//! The peer lifecycle scenario: a peer killed mid-transfer, removed with
//! `TransferEngine::remove_peer` and restarted (a new host / process at a
//! new address), [`RESTARTS`] times.

use super::run::{bail, engine_err, ensure, harness, is_unreachable, Run};
use super::{EngineHarness, Kind};
use crate::CaseFailure;
use weft_engine::{GroupAddress, OnDone, TransferEngine};

/// Restarts of the peer per run.
pub const RESTARTS: u64 = 20;

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

/// A peer is killed with writes to it in flight, removed, and restarted at
/// a new address, [`RESTARTS`] times; a second peer survives throughout.
/// Each incarnation first gets a full round (every write acknowledged, the
/// round fires once with every byte in place — rounds of a fresh engine use
/// the same immediate value as the writes aimed at its predecessor, so a
/// stray immediate of the old incarnation would fire it early or twice);
/// writes pending at the kill each resolve once (success, `PeerUnreachable`
/// or `PeerRemoved`); a write to the old incarnation's descriptor after the
/// removal fails with `PeerRemoved`; the initiator's resolved peer count is
/// back to its baseline after each removal; no address comes back.
pub(crate) fn peer_restart(h: &mut dyn EngineHarness) -> Result<(), CaseFailure> {
    let mut r = Run::new(h, BUF + 4096)?;
    let survivor = r.add_peers(1, BUF)?[0];
    full_round(&mut r, survivor, 1, 0)?;
    let baseline = peers_resolved(&r.init);
    let mut gone: Vec<GroupAddress> = Vec::new();
    let mut dead = Vec::new();
    let mut cur = r.add_peers(1, BUF)?[0];
    for k in 0..RESTARTS {
        let addr = r.h.peer(cur).address();
        if let Some(old) = gone
            .iter()
            .find(|g| g.nics.iter().any(|a| addr.nics.contains(a)))
        {
            bail!("incarnation {k} reuses an address of an earlier one: {old:?}");
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
        let results = r.wait_flags(
            &format!("writes pending at the kill of incarnation {k}"),
            &pending,
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
        // The old incarnation's descriptor is refused from now on.
        let f = r.single(WLEN, Some(imm), 0, &desc, 0)?;
        match r.wait_flags("write to a removed peer", &[f])?.remove(0) {
            Ok(()) => bail!("incarnation {k}: a write to the removed peer succeeded"),
            Err(e) => ensure!(
                e.is_peer_removed(),
                "incarnation {k}: write to the removed peer: expected PeerRemoved, got {e}"
            ),
        }
        // So is every peer group it was a member of.
        let (od, flag) = OnDone::flag();
        let dsts = [r.desc(survivor), desc.clone()];
        let refused = match r.init.submit_barrier(&group, od, imm, &dsts) {
            Err(e) => Some(e),
            Ok(_) => r
                .wait_flags("barrier to a group with a removed member", &[flag])?
                .remove(0)
                .err(),
        };
        match refused {
            Some(e) => ensure!(
                e.is_peer_removed(),
                "incarnation {k}: barrier to a group with a removed member: expected \
                 PeerRemoved, got {e}"
            ),
            None => bail!("incarnation {k}: barrier to a group with a removed member succeeded"),
        }
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
    r.finish(&dead)
}
