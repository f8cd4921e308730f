//! `weft-demo`: runs weft's application systems over the loopback fabric in
//! realtime adversarial mode (fixed seed, small sizes) and prints what moved.
//!
//! Environment: `WEFT_SEED` overrides the seed; `WEFT_PROVIDER` selects
//! another backend by its weft provider spec (e.g. `libfabric:shm`; every
//! "host" is then an endpoint in this process); `RUST_LOG` enables tracing.

#![deny(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use weft::loopback::FabricStats;
use weft::{
    Backend, DomainGroupSpec, EngineConfig, LibfabricOptions, LoopbackOptions, LoopbackProfile,
    ProviderConfig, ProviderSpec, TransferEngine,
};
use weft_kvcache::{Decoder, KvConfig, KvLayout, Prefiller};

const NICS: usize = 2;

/// An engine on a fresh host of `backend` with all its NICs.
fn engine(backend: &Backend) -> Result<Arc<TransferEngine>, String> {
    let p = backend.host().map_err(|e| e.to_string())?;
    TransferEngine::builder()
        .group(DomainGroupSpec::new(
            p,
            (0..backend.nics()).collect::<Vec<_>>(),
        ))
        .config(EngineConfig::default())
        .build()
        .map(Arc::new)
        .map_err(|e| format!("engine on a {} host: {e}", backend.spec()))
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
fn kvcache(spec: &ProviderSpec, seed: u64) -> Result<(), String> {
    match spec {
        ProviderSpec::Loopback => println!("== KvCache transfer (prefill -> decode), seed {seed}"),
        other => println!("== KvCache transfer (prefill -> decode) on {other}"),
    }
    // On loopback: the adversarial profile with WRITEs of at most 16 KiB per
    // WR, so every transfer is split, chunked and reordered.
    let mut config = ProviderConfig::default().with_nics(NICS).with_loopback(
        LoopbackOptions::new(LoopbackProfile::Adversarial, seed).with_max_write_len(16 * 1024),
    );
    if let ProviderSpec::Libfabric(prov) = spec {
        config = config.with_libfabric(LibfabricOptions::same_machine(prov));
    }
    let backend = weft::provider_with(spec, &config).map_err(|e| e.to_string())?;
    let layout = KvLayout {
        layers: 16,
        heads: 4,
        page_len: 8 * 1024,
        tail_len: 32 * 1024,
    };
    let pages = 128;
    let pe = engine(&backend)?;
    let des = [engine(&backend)?, engine(&backend)?];
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
    match backend.loopback_fabric() {
        Some(fabric) => print_fabric("kvcache", &fabric.stats(), secs),
        None => println!("  [kvcache] {secs:.3} s"),
    }
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
    let spec = match std::env::var("WEFT_PROVIDER") {
        Ok(s) => match s.parse::<ProviderSpec>() {
            Ok(spec) => spec,
            Err(e) => {
                eprintln!("WEFT_PROVIDER: {e}");
                return ExitCode::FAILURE;
            }
        },
        Err(_) => ProviderSpec::Loopback,
    };
    let t0 = Instant::now();
    let mut ok = true;
    if let Err(e) = kvcache(&spec, seed) {
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
