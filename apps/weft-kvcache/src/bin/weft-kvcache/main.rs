//! `weft-kvcache`: a prefiller or a decoder as its own process, over any
//! weft provider spec (`libfabric:tcp`, `libfabric:shm`, `libfabric:efa`,
//! `verbs`, ...). Addresses are exchanged through a file or a pipe: the
//! prefiller writes its address (`--addr-out FILE`, `-` for stdout only);
//! the decoder reads it (`--peer FILE`, `-` for a line on stdin). Or both
//! find each other through a rendezvous store (`--rendezvous dir:/path` or
//! `etcd:http://host:2379`, namespace `--namespace`): the prefiller
//! announces itself and follows the decoders (dropping the work of one that
//! leaves), the decoder announces itself and routes to the first prefiller
//! the store lists; a killed process's record leaves when its lease runs
//! out.
//!
//! Demo mode: the prefiller "computes" each layer by writing a pattern
//! (optionally taking `--layer-us` per layer) and the decoder checks every
//! byte it received. Lines on stdout: `ready ADDR`, `accepted id=N`,
//! `served id=N`, `serve-error id=N kind=KIND msg=...` (prefill);
//! `done id=N bytes=B`, `error id=N kind=KIND msg=...`, `summary ...`
//! (decode). Exit codes: 0 all went well, 2 usage/setup error, 3 a request
//! failed (the line says which typed error).

#![deny(unsafe_code)]

mod demo;

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use weft::rendezvous::{self, RendezvousSpec, Session};
use weft::{
    DomainGroupSpec, EngineConfig, GroupAddress, LibfabricOptions, NetAddr, ProviderConfig,
    ProviderSpec, TransferEngine,
};
use weft_kvcache::{HeadOrder, Heartbeat, KvConfig, KvLayout, KvRendezvous};

#[derive(Parser, Debug)]
#[command(
    name = "weft-kvcache",
    about = "KvCache transfer: a prefiller or a decoder process"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve decoders' requests from this process's KV cache.
    Prefill(PrefillArgs),
    /// Request prompts' KV from a prefiller and check every byte.
    Decode(DecodeArgs),
}

/// Settings both roles share.
#[derive(Args, Debug, Clone)]
struct Common {
    /// weft provider spec.
    #[arg(long, default_value = "libfabric:tcp")]
    provider: String,
    /// NICs per process.
    #[arg(long, default_value_t = 1)]
    nics: usize,
    /// Layers.
    #[arg(long, default_value_t = 8)]
    layers: u32,
    /// KV heads on this rank.
    #[arg(long, default_value_t = 2)]
    kv_heads: u32,
    /// Bytes per page (per head).
    #[arg(long, default_value_t = 32 * 1024)]
    page_len: u64,
    /// Tail bytes.
    #[arg(long, default_value_t = 4096)]
    tail_len: u64,
    /// Pages in the cache.
    #[arg(long, default_value_t = 256)]
    pages: u32,
    /// Heartbeat interval (ms).
    #[arg(long, default_value_t = 20)]
    hb_ms: u64,
    /// Heartbeat timeout (ms).
    #[arg(long, default_value_t = 1000)]
    hb_timeout_ms: u64,
    /// Find the other role through this rendezvous store (`dir:/path`,
    /// `etcd:http://host:2379`) instead of pasting addresses.
    #[arg(long)]
    rendezvous: Option<String>,
    /// The rendezvous namespace.
    #[arg(long, default_value = "kvcache")]
    namespace: String,
    /// This process's name in the namespace (default: ROLE-PID).
    #[arg(long)]
    name: Option<String>,
    /// Rendezvous lease TTL (ms): a killed process's record leaves this
    /// long after its last keep-alive.
    #[arg(long, default_value_t = 5000)]
    ttl_ms: u64,
}

#[derive(Args, Debug)]
struct PrefillArgs {
    #[command(flatten)]
    common: Common,
    /// Where to write this prefiller's address (`-`: stdout only).
    #[arg(long, default_value = "-")]
    addr_out: String,
    /// Simulated compute per layer (µs).
    #[arg(long, default_value_t = 0)]
    layer_us: u64,
    /// Report layers through the UVM watcher word instead of calls.
    #[arg(long)]
    watcher: bool,
    /// Exit after this many requests ended (0: serve until killed).
    #[arg(long, default_value_t = 0)]
    max_requests: u64,
}

#[derive(Args, Debug)]
struct DecodeArgs {
    #[command(flatten)]
    common: Common,
    /// The prefiller's address: a file, or `-` for a line on stdin (not
    /// with `--rendezvous`).
    #[arg(long, required_unless_present = "rendezvous")]
    peer: Option<String>,
    /// With `--rendezvous`: how long to wait for a prefiller (ms).
    #[arg(long, default_value_t = 60_000)]
    wait_ms: u64,
    /// Requests.
    #[arg(long, default_value_t = 8)]
    requests: u64,
    /// Pages per prompt.
    #[arg(long, default_value_t = 16)]
    prompt_pages: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Seed of the prompts' content.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl Common {
    fn layout(&self) -> KvLayout {
        KvLayout {
            layers: self.layers,
            kv_heads: self.kv_heads,
            page_len: self.page_len,
            tail_len: self.tail_len,
            num_pages: self.pages,
            tail_slots: self.pages,
            order: HeadOrder::HeadsBeforePages,
        }
    }

    fn config(&self) -> KvConfig {
        KvConfig {
            heartbeat: Heartbeat {
                interval: Duration::from_millis(self.hb_ms),
                timeout: Duration::from_millis(self.hb_timeout_ms),
            },
            ..KvConfig::default()
        }
    }

    /// The store `--rendezvous` names, a session in it and this process's
    /// name; `None` without `--rendezvous`.
    fn rendezvous(&self, role: &str) -> Result<Option<(KvRendezvous, Session, String)>, String> {
        let Some(spec) = &self.rendezvous else {
            return Ok(None);
        };
        let spec: RendezvousSpec = spec.parse().map_err(|e| format!("{e}"))?;
        if spec == RendezvousSpec::Mem {
            return Err(
                "--rendezvous mem only works inside one process; use dir:/path or etcd:URL".into(),
            );
        }
        let store = rendezvous::open(&spec).map_err(|e| e.to_string())?;
        let session = Session::new(store.clone(), Duration::from_millis(self.ttl_ms))
            .map_err(|e| e.to_string())?;
        let name = self
            .name
            .clone()
            .unwrap_or_else(|| format!("{role}-{}", std::process::id()));
        Ok(Some((
            KvRendezvous::new(store, &self.namespace),
            session,
            name,
        )))
    }

    fn engine(&self) -> Result<Arc<TransferEngine>, String> {
        let spec: ProviderSpec = self.provider.parse().map_err(|e| format!("{e}"))?;
        let mut cfg = ProviderConfig::default().with_nics(self.nics);
        if let ProviderSpec::Libfabric(p) = &spec {
            cfg = cfg.with_libfabric(LibfabricOptions::same_machine(p));
        }
        let backend = weft::provider_with(&spec, &cfg).map_err(|e| e.to_string())?;
        let host = backend.host().map_err(|e| e.to_string())?;
        TransferEngine::builder()
            .group(DomainGroupSpec::new(
                host,
                (0..backend.nics()).collect::<Vec<_>>(),
            ))
            .config(EngineConfig::default())
            .build()
            .map(Arc::new)
            .map_err(|e| format!("engine on {spec}: {e}"))
    }
}

/// A group address as text: its NICs' addresses, comma-separated, then
/// `@` and the engine's incarnation (decimal).
fn addr_to_string(a: &GroupAddress) -> String {
    let nics = a
        .nics
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    format!("{nics}@{}", a.incarnation.0)
}

/// Parses [`addr_to_string`]'s text (without `@`, the incarnation is 0, the
/// oldest: an engine that saw a newer one at these addresses refuses it).
fn addr_from_str(s: &str) -> Result<GroupAddress, String> {
    let (nics, inc) = match s.trim().split_once('@') {
        Some((n, i)) => (
            n,
            i.parse::<u64>()
                .map_err(|e| format!("incarnation {i:?}: {e}"))?,
        ),
        None => (s.trim(), 0),
    };
    let nics = nics
        .split(',')
        .map(|x| {
            x.parse::<NetAddr>()
                .map_err(|e| format!("address {x:?}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(GroupAddress {
        nics,
        incarnation: weft::Incarnation(inc),
    })
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Prefill(a) => demo::prefill(a),
        Cmd::Decode(a) => demo::decode(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("weft-kvcache: {e}");
            ExitCode::from(2)
        }
    }
}
