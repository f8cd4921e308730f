//! `weft-demo`: runs weft's application systems over the loopback fabric in
//! realtime adversarial mode (fixed seed, small sizes) and prints what moved.
//!
//! Environment: `WEFT_SEED` overrides the seed; `RUST_LOG` enables tracing.

#![deny(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_kvcache::{Decoder, KvConfig, KvLayout, Prefiller};
use weft_loopback::{Fabric, FabricConfig, FabricStats};

const NICS: usize = 2;

fn engine(fabric: &Fabric, nics: usize) -> Result<Arc<TransferEngine>, String> {
    let host = fabric.add_host(nics);
    let p = Arc::new(fabric.provider(host));
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..nics).collect::<Vec<_>>()))
        .config(EngineConfig::default())
        .build()
        .map(Arc::new)
        .map_err(|e| format!("engine on host {host:?}: {e}"))
}

fn print_fabric(name: &str, s: &FabricStats, secs: f64) {
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
}

/// Disaggregated prefill/decode: one prefiller, two decoders.
fn kvcache(seed: u64) -> Result<(), String> {
    println!("== KvCache transfer (prefill -> decode), seed {seed}");
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 16 * 1024,
        ..FabricConfig::adversarial(seed)
    });
    let layout = KvLayout {
        layers: 16,
        heads: 4,
        page_len: 8 * 1024,
        tail_len: 32 * 1024,
    };
    let pages = 128;
    let pe = engine(&fabric, NICS)?;
    let des = [engine(&fabric, NICS)?, engine(&fabric, NICS)?];
    let t0 = Instant::now();
    let pre = Prefiller::new(pe.clone(), layout, KvConfig::default(), None)
        .map_err(|e| format!("prefiller: {e}"))?;
    let decs = des
        .iter()
        .map(|d| {
            Decoder::new(
                d.clone(),
                layout,
                pages,
                pe.main_address(),
                KvConfig::default(),
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("decoder: {e}"))?;
    let mut total_bytes = 0u64;
    let mut total_imms = 0u64;
    let mut requests = 0u64;
    let mut err = None;
    for round in 0..4u64 {
        let mut hs = Vec::new();
        for (d, dec) in decs.iter().enumerate() {
            for k in 0..3u64 {
                let n = 4 + ((seed + round * 7 + k * 3 + d as u64) % 13) as u32;
                let ps = seed ^ (round << 16) ^ (k << 8) ^ d as u64;
                hs.push(dec.submit(n, ps).map_err(|e| format!("submit: {e}"))?);
            }
        }
        for h in hs {
            match h.wait() {
                Ok(c) => {
                    total_bytes += c.bytes;
                    total_imms += u64::from(c.imms);
                    requests += 1;
                }
                Err(e) => err = Some(format!("request {}: {e}", h.id)),
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = pre.stats();
    println!(
        "  {requests} requests ({} layers x {} heads x {} B pages + {} B tail) verified byte-exact: \
         {total_bytes} bytes, {} write submits, {total_imms} immediates counted",
        layout.layers,
        layout.heads,
        layout.page_len,
        layout.tail_len,
        st.submits.load(std::sync::atomic::Ordering::Relaxed),
    );
    for d in &decs {
        d.shutdown();
    }
    pre.shutdown();
    for d in &des {
        d.shutdown();
    }
    pe.shutdown();
    print_fabric("kvcache", &fabric.stats(), secs);
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let seed = std::env::var("WEFT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2026);
    let t0 = Instant::now();
    let mut ok = true;
    if let Err(e) = kvcache(seed) {
        eprintln!("kvcache demo FAILED (seed {seed}): {e}");
        ok = false;
    }
    println!("weft-demo finished in {:.3} s", t0.elapsed().as_secs_f64());
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
