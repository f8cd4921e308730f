//! The sending half of the two-host example (see docs/backends.md).
//!
//! ```text
//! cargo run -p weft --example writer -- [--provider tcp|shm|efa|SPEC] [--domain eth0] <hex after WEFT_PEER= from the reader>
//! ```
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
    let blob = args
        .iter()
        .skip(1)
        .rev()
        .find(|a| {
            !a.starts_with("--")
                && arg(&args, "--provider").as_deref() != Some(a.as_str())
                && arg(&args, "--domain").as_deref() != Some(a.as_str())
        })
        .ok_or("usage: writer [--provider tcp|shm|efa|SPEC] [--domain IF] <WEFT_PEER hex>")?;
    let blob = blob.trim_start_matches("WEFT_PEER=");
    let desc: MrDesc = decode(&blob.parse::<NetAddr>()?.0)?;
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
