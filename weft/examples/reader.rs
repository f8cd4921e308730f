//! The receiving half of the two-host example (see docs/backends.md).
//!
//! ```text
//! cargo run -p weft --example reader -- [--provider tcp|shm|efa|SPEC] [--domain eth0] [--mib 64] [--rendezvous dir:/path|etcd:http://host:2379]
//! ```
//!
//! `--provider` takes a libfabric provider name or any weft provider spec.
//!
//! Registers a buffer, prints one `WEFT_PEER=<hex>` line (its address and
//! memory descriptor) to paste into the writer (with `--rendezvous`, it also
//! publishes the descriptor as region `buf` of peer `reader` in namespace
//! `weft-examples`, where the writer finds it), then waits until the writer's
//! immediates report that every chunk has landed, checks the bytes and exits.

use std::time::{Duration, Instant};

use weft::{encode, Access, Completion, HostBuffer, MrDesc, NetAddr};

mod common;
use common::arg;

/// Size of each WRITE the writer posts (must match writer.rs).
const CHUNK: usize = 1 << 20;
/// The immediate every chunk carries.
const IMM: u32 = 0x5745_4654;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = arg(&args, "--mib")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(64);
    let mut dom = common::open_domain(&args)?;
    let len = mib * CHUNK;
    // `buf` lives until the end of main, after the domain is dropped
    // explicitly, and is only read after all writes have been reported by
    // their immediates.
    let buf = HostBuffer::new(len)?;
    let mr = dom.register(&buf.region(), Access::RemoteWrite)?;
    let desc = MrDesc {
        addr: mr.addr,
        len: mr.len,
        rkeys: vec![(dom.local_addr().clone(), mr.rkey)],
        // A bare domain, no engine: the oldest incarnation.
        incarnation: Default::default(),
    };
    let blob = NetAddr(encode(&desc)?);
    println!("WEFT_PEER={blob}");
    // Kept until the end of main: the records live while the session does.
    let _published = match common::rendezvous(&args)? {
        Some(ns) => {
            let session = common::session(&ns)?;
            ns.publish_peer(&session, "reader", 1, &[vec![dom.local_addr().clone()]])?;
            ns.publish_mr(&session, "reader", "buf", 1, &desc)?;
            eprintln!("reader: published in {}", ns.store().endpoint());
            Some(session)
        }
        None => None,
    };
    eprintln!(
        "reader on {} ({}): waiting for {mib} x 1 MiB",
        dom.info().name,
        dom.local_addr()
    );
    let mut out = Vec::new();
    let mut got = 0usize;
    let mut last_progress = Instant::now();
    while got < mib {
        out.clear();
        dom.poll(&mut out)?;
        for c in &out {
            match c {
                Completion::Imm { imm } if *imm == IMM => {
                    got += 1;
                    last_progress = Instant::now();
                }
                other => eprintln!("unexpected completion {other:?}"),
            }
        }
        if got > 0 && last_progress.elapsed() > Duration::from_secs(60) {
            return Err(format!("writer stalled after {got} of {mib} chunks").into());
        }
    }
    // Keep progressing briefly so the writer's delivery acknowledgements go out.
    let linger = Instant::now();
    while linger.elapsed() < Duration::from_millis(500) {
        dom.poll(&mut out)?;
    }
    drop(dom);
    let got = buf.read(0, len).ok_or("read back")?;
    let bad = got
        .iter()
        .enumerate()
        .find(|(i, b)| **b != (*i % 251) as u8);
    match bad {
        None => {
            println!("ok: {mib} MiB received and verified");
            Ok(())
        }
        Some((i, b)) => Err(format!("byte {i} is {b}, expected {}", i % 251).into()),
    }
}
