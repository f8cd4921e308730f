//! Probe real RDMA hardware: list devices, open each port-1 domain, connect
//! it to itself over its UD handshake QP and do a WRITE_WITH_IMM and a
//! SEND/RECV loop through the NIC.
//!
//! `cargo run -p weft-verbs --example verbs_probe` (needs rdma-core and a
//! device; prints a clean error otherwise).

use std::time::{Duration, Instant};
use weft_transport::{
    Access, Completion, Domain, HostBuffer, Provider, RemoteSlice, WrId, WriteWr,
};
use weft_verbs::{VerbsConfig, VerbsProvider};

fn main() {
    let p = VerbsProvider::new(VerbsConfig::default());
    let nics = match p.nics() {
        Ok(n) => n,
        Err(e) => {
            println!("verbs: {e}");
            return;
        }
    };
    println!(
        "verbs: {} device(s): {:?}",
        nics.len(),
        nics.iter().map(|n| &n.name).collect::<Vec<_>>()
    );
    let want: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX);
    for (i, nic) in nics.iter().enumerate() {
        if want != usize::MAX && i != want {
            continue;
        }
        match probe(&p, i) {
            Ok(()) => println!("  [{i}] {}: OK", nic.name),
            Err(e) => println!("  [{i}] {}: {e}", nic.name),
        }
    }
}

fn probe(p: &VerbsProvider, i: usize) -> Result<(), String> {
    let mut d = p.open_domain(i).map_err(|e| e.to_string())?;
    println!(
        "  [{i}] open: addr {} gid_index {} mtu {} max_wr_len {} link {:?} Gb/s",
        d.local_addr(),
        d.gid_index(),
        d.mtu(),
        d.max_wr_len(),
        d.info().link_gbps
    );
    let len = 1 << 20;
    let src_bytes: Vec<u8> = (0..len).map(|k| (k % 251) as u8).collect();
    // Both buffers outlive the domain's use of them (dropped after `d`), and
    // are only read after completions.
    let src = HostBuffer::new(len).map_err(|e| e.to_string())?;
    src.write(0, &src_bytes);
    let dst = HostBuffer::new(len).map_err(|e| e.to_string())?;
    let (sr, dr) = (src.region(), dst.region());
    let smr = d
        .register(&sr, Access::LocalOnly)
        .map_err(|e| e.to_string())?;
    let dmr = d
        .register(&dr, Access::RemoteWrite)
        .map_err(|e| e.to_string())?;
    let me = d.local_addr().clone();
    let peer = d.add_peer(&me).map_err(|e| e.to_string())?;
    let wr = WriteWr {
        wr: WrId(1),
        peer,
        src: smr.slice(4096, len as u64 - 4096).unwrap(),
        dst: RemoteSlice {
            base: dmr.addr,
            offset: 4096,
            rkey: dmr.rkey,
        },
        imm: Some(0xabc),
    };
    d.post_write(&wr).map_err(|e| e.to_string())?;
    d.post_recv(WrId(3), dmr.slice(0, 64).unwrap())
        .map_err(|e| e.to_string())?;
    d.post_send(WrId(2), peer, smr.slice(100, 32).unwrap())
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut out = Vec::new();
    let (mut w, mut imm, mut s, mut r) = (false, false, false, false);
    while !(w && imm && s && r) {
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "timeout; completions so far: {out:?}; stats {:?}",
                d.stats()
            ));
        }
        let n = out.len();
        d.poll(&mut out).map_err(|e| e.to_string())?;
        for c in &out[n..] {
            match c {
                Completion::Write { result, .. } => {
                    result.clone().map_err(|e| e.to_string())?;
                    w = true
                }
                Completion::Imm { imm: v } => {
                    if *v != 0xabc {
                        return Err(format!("imm {v:#x}"));
                    }
                    imm = true
                }
                Completion::Send { result, .. } => {
                    result.clone().map_err(|e| e.to_string())?;
                    s = true
                }
                Completion::Recv { result, .. } => {
                    if result.clone().map_err(|e| e.to_string())? != 32 {
                        return Err("recv len".into());
                    }
                    r = true
                }
            }
        }
    }
    // The WRITE filled dst[4096..], the SEND dst[0..32] (different QPs: no
    // order between them, so they do not overlap).
    let got = dst.read(0, len).ok_or("read back")?;
    if got[4096..] != src_bytes[4096..] || got[..32] != src_bytes[100..132] {
        return Err("data mismatch".into());
    }
    println!(
        "  [{i}] loopback write 1 MiB + imm + send/recv in {:?}; stats {:?}",
        start.elapsed(),
        d.stats()
    );
    drop(d);
    drop(dst);
    Ok(())
}
