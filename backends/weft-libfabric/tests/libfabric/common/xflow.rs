//! Waiting for and submitting writes in the cross-process engine tests
//! (`engine_xproc`, `shm_restart_xproc`): done flags, rounds verified by
//! the peer processes, batches of patterned single writes.

use super::XprocEngines;
use std::sync::Arc;
use std::time::Duration;
use weft_conformance::engine::{EngineHarness, Kind, Region};
use weft_conformance::HarnessError;
use weft_engine::{DoneFlag, EngineError, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_transport::TransportError;

/// Generous bound on every wait (it only catches hangs).
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The harness's initiator engine, or `None` with a printed SKIP line when
/// libfabric is unavailable here; any other harness error panics.
pub fn initiator_or_skip(h: &mut XprocEngines) -> Option<TransferEngine> {
    match h.initiator() {
        Ok(e) => Some(e),
        Err(HarnessError::Unsupported(m)) => {
            eprintln!("SKIP: {m}");
            None
        }
        Err(e) => panic!("initiator: {e}"),
    }
}

/// Whether `e` is a transport `PeerUnreachable`.
pub fn is_unreachable(e: &EngineError) -> bool {
    matches!(e, EngineError::Transport { .. })
        && matches!(e.transport(), Some(TransportError::PeerUnreachable { .. }))
}

/// Waits for `f` to be resolved and returns its result.
pub fn wait_flag(what: &str, f: &Arc<DoneFlag>) -> Result<(), EngineError> {
    weft_testkit::wait_until(what, DEADLINE, || f.is_done());
    f.result()
        .unwrap_or_else(|| panic!("{what}: done flag without a result"))
}

pub fn wait_ok(what: &str, f: &Arc<DoneFlag>) {
    wait_flag(what, f).unwrap_or_else(|e| panic!("{what} failed: {e}"));
}

/// Waits until round `tag` fired at peer `p` with every byte in place.
pub fn wait_round(h: &mut XprocEngines, p: usize, tag: u64) {
    let mut got = None;
    weft_testkit::wait_until(&format!("round {tag} at peer {p}"), DEADLINE, || {
        got = h.peer(p).take_rounds().into_iter().find(|(t, _)| *t == tag);
        got.is_some()
    });
    if let Some((_, Err(e))) = got {
        panic!("peer {p}: round {tag}: {e}");
    }
}

/// Arms round `tag` at `p` for `writes` single writes of `wlen` bytes,
/// write `k` from source offset `src_off(k)` to `k * wlen`, and submits
/// them; returns the flags.
#[allow(clippy::too_many_arguments)]
pub fn singles(
    h: &mut XprocEngines,
    init: &TransferEngine,
    smr: &MrHandle,
    seed: u64,
    p: usize,
    tag: u64,
    arm: bool,
    writes: u64,
    wlen: u64,
    src_off: impl Fn(u64) -> u64,
) -> Vec<Arc<DoneFlag>> {
    let imm = h.peer(p).imms()[0];
    let desc: MrDesc = h.peer(p).desc();
    if arm {
        let kinds = (0..writes).map(|_| Kind::Single { len: wlen }).collect();
        let regions = (0..writes)
            .map(|k| Region {
                src_off: src_off(k),
                dst_off: k * wlen,
                len: wlen,
                seed,
            })
            .collect();
        h.peer(p)
            .expect(tag, imm, kinds, regions)
            .expect("arm round");
    }
    (0..writes)
        .map(|k| {
            let (od, flag) = OnDone::flag();
            init.submit_single_write(wlen, Some(imm), (smr, src_off(k)), (&desc, k * wlen), od)
                .expect("submit single write");
            flag
        })
        .collect()
}
