//! The shared fabric: hosts, NICs, the event queue and all delivery logic.
//!
//! Everything here is driven by simulated time (`u64` nanoseconds). The wall
//! clock appears only in [`Fabric::lock`], the thin realtime driver.
//!
//! One module per piece of state:
//!
//! - `handle`: the public [`Fabric`] handle and its drive modes.
//! - `state`: `State`, the shared simulated fabric: hosts, NICs,
//!   registrations (keys), posted receives, completion queues, NIC faults.
//! - `events`: the event queue in (time, sequence) order, stepping simulated
//!   time, event dispatch and the initiator's completions.
//! - `op`: one posted operation (`Op`) and posting: post-time checks,
//!   rules, chunking, the null-mode fast path.
//! - `delivery`: link timing, loss and retransmission, chunks landing (the
//!   immediate after the last one), SEND/RECV matching.

mod delivery;
mod events;
mod handle;
mod op;
mod state;

pub use handle::Fabric;

use crate::HostId;
use std::time::Duration;
use weft_transport::TransportError;

/// (host, NIC) of a simulated NIC.
pub(crate) type Loc = (u32, u32);

fn dur_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(crate) fn nic_name(loc: Loc) -> String {
    format!("lo/host{}/nic{}", loc.0, loc.1)
}

/// An address-free (hence replayable) description of an error for the trace.
fn trace_error(e: &TransportError) -> String {
    match e {
        TransportError::RemoteAccess { reason, .. } => format!("RemoteAccess: {reason}"),
        TransportError::PeerUnreachable { reason, .. } => format!("PeerUnreachable: {reason}"),
        TransportError::Failed { what, .. } => format!("Failed: {what}"),
        other => {
            let dbg = format!("{other:?}");
            dbg.split([' ', '{', '('])
                .next()
                .unwrap_or_default()
                .to_owned()
        }
    }
}

fn unknown_nic(host: HostId, nic: usize) -> TransportError {
    TransportError::InvalidArgument {
        nic: format!("lo/host{}/nic{nic}", host.0),
        what: "no such loopback host/NIC".into(),
    }
}
