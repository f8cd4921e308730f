//! What the simulated fabric did, when the demo ran on it (its counters of
//! drops, retransmits and reorderings are the point of the adversarial
//! profile).

use weft::Backend;

/// Prints the simulated fabric's counters for the run `name` (`secs`
/// long); `false` when `backend` is not the simulated fabric.
pub(crate) fn print_fabric(backend: &Backend, name: &str, secs: f64) -> bool {
    let Some(fabric) = backend.loopback_fabric() else {
        return false;
    };
    let s = fabric.stats();
    println!(
        "  [{name}] fabric: {} WRITEs, {} SENDs, {} payload bytes in {} chunks, {} immediates, \
         {} drops/{} retransmits, {} reorderings across / {} within writes; {:.3} s",
        s.writes_posted,
        s.sends_posted,
        s.bytes_delivered,
        s.chunks_delivered,
        s.imms_delivered,
        s.drops,
        s.retransmits,
        s.inversions_across,
        s.inversions_within,
        secs
    );
    true
}
