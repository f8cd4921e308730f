//! Shared helpers for the loopback tests.
#![allow(dead_code, unused_imports)]

use weft_loopback::{Fabric, LoopbackDomain};
use weft_transport::{Completion, Domain, LocalMr, RemoteSlice};

pub use weft_testkit::mem::{self, HostBufferExt};
pub use weft_testkit::{for_seeds, with_seed};
pub use weft_transport::HostBuffer;

pub fn remote(mr: &LocalMr, offset: u64) -> RemoteSlice {
    RemoteSlice {
        base: mr.addr,
        offset,
        rkey: mr.rkey,
    }
}

pub fn poll_all(d: &mut LoopbackDomain) -> Vec<Completion> {
    let mut v = Vec::new();
    d.poll(&mut v).expect("poll");
    v
}

/// Two hosts with `nics` NICs each, domains opened on NIC 0 of each.
pub fn pair(fabric: &Fabric) -> (LoopbackDomain, LoopbackDomain) {
    let a = fabric.add_host(2);
    let b = fabric.add_host(2);
    (fabric.open(a, 0).unwrap(), fabric.open(b, 0).unwrap())
}

pub fn imms(c: &[Completion]) -> Vec<u32> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Imm { imm } => Some(*imm),
            _ => None,
        })
        .collect()
}

pub fn write_results(c: &[Completion]) -> Vec<(u64, Result<(), weft_transport::TransportError>)> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Write { wr, result } => Some((wr.0, result.clone())),
            _ => None,
        })
        .collect()
}
