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
use weft::{
    Backend, DomainGroupSpec, EngineConfig, LibfabricOptions, LoopbackOptions, LoopbackProfile,
    ProviderConfig, ProviderSpec, TransferEngine,
};

mod kvcache;
mod sim;

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
    let (_, _, secs) = kvcache::run(|| engine(&backend), seed)?;
    if !sim::print_fabric(&backend, "kvcache", secs) {
        println!("  [kvcache] {secs:.3} s");
    }
    Ok(())
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
