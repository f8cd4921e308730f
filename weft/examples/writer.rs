//! The sending half of the two-host example (see docs/backends.md).
//!
//! ```text
//! cargo run -p weft --example writer -- [--provider tcp|shm|efa|SPEC] [--domain eth0] <hex after WEFT_PEER= from the reader>
//! cargo run -p weft --example writer -- [--provider ...] --rendezvous dir:/path|etcd:http://host:2379
//! ```
//!
//! With `--rendezvous` (and no hex), the writer waits for the reader's
//! region `buf` in the store instead.
//!
//! WRITEs a pattern into the reader's buffer in 1 MiB chunks, each with an
//! immediate, and exits when every WRITE has completed (delivery-complete).

use std::time::{Duration, Instant};

use weft::{decode, Access, Completion, HostBuffer, MrDesc, NetAddr, WrId, WriteWr};

mod common;
use common::arg;

const CHUNK: usize = 1 << 20;
const IMM: u32 = 0x5745_4654;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let blob = args.iter().skip(1).rev().find(|a| {
        !a.starts_with("--")
            && ["--provider", "--domain", "--rendezvous"]
                .iter()
                .all(|o| arg(&args, o).as_deref() != Some(a.as_str()))
    });
    let desc: MrDesc = match (blob, common::rendezvous(&args)?) {
        (Some(blob), _) => decode(&blob.trim_start_matches("WEFT_PEER=").parse::<NetAddr>()?.0)?,
        (None, Some(ns)) => {
            eprintln!("writer: waiting for the reader in {}", ns.store().endpoint());
            ns.wait_mr("reader", "buf", Duration::from_secs(300))?.desc
        }
        (None, None) => {
            return Err("usage: writer [--provider tcp|shm|efa|SPEC] [--domain IF] (<WEFT_PEER hex> | --rendezvous dir:/path|etcd:URL)".into())
        }
    };
    let (peer_addr, _) = desc.rkeys.first().ok_or("descriptor without NIC")?.clone();
    let len = usize::try_from(desc.len)?;
    let chunks = len / CHUNK;
    // `src` outlives the domain (declared earlier, dropped later).
    let src = HostBuffer::new(len)?;
    src.write(0, &(0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let mut dom = common::open_domain(&args)?;
    let mr = dom.register(&src.region(), Access::LocalOnly)?;
    let peer = dom.add_peer(&peer_addr)?;
    let wrs: Vec<WriteWr> = (0..chunks)
        .map(|i| {
            let off = (i * CHUNK) as u64;
            Ok(WriteWr {
                wr: WrId(i as u64),
                peer,
                src: mr.slice(off, CHUNK as u64).ok_or("source slice")?,
                dst: desc
                    .slice(0, off, CHUNK as u64)
                    .ok_or("destination slice")?,
                imm: Some(IMM),
            })
        })
        .collect::<Result<_, &str>>()?;
    let start = Instant::now();
    let (mut posted, mut done) = (0usize, 0usize);
    let mut out = Vec::new();
    while done < chunks {
        if posted < chunks {
            posted += dom.post_writes(&wrs[posted..]).map_err(|e| e.error)?;
        }
        out.clear();
        dom.poll(&mut out)?;
        for c in &out {
            if let Completion::Write { wr, result } = c {
                result.clone().map_err(|e| format!("write {wr:?}: {e}"))?;
                done += 1;
            }
        }
        if start.elapsed() > Duration::from_secs(300) {
            return Err(format!("gave up after 300 s: {done} of {chunks} done").into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "ok: wrote {chunks} MiB to {peer_addr} in {secs:.3} s ({:.2} GB/s)",
        len as f64 / secs / 1e9
    );
    Ok(())
}
