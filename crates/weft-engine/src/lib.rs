//! # weft-engine: the TransferEngine
//!
//! The paper's TransferEngine over any [`weft_transport::Provider`]: one
//! DomainGroup (one worker thread, 1..=8 NICs) per GPU, an ImmCounter that
//! turns "N immediates arrived" into an ordering-free completion signal,
//! sharding of large writes across a group's NICs, peer groups for
//! scatter/barrier, a shared callback thread and a UVM watcher thread.
//!
//! See `docs/engine.md` for the threading model, the backpressure scheme and
//! the immediate-count contract; [`shard`] has the counting functions.
//!
//! ```no_run
//! # use weft_engine::*;
//! # fn demo(provider: std::sync::Arc<dyn weft_transport::Provider>, peer: GroupAddress,
//! #         src: MrHandle, dst: weft_transport::MrDesc) -> Result<(), EngineError> {
//! let engine = TransferEngine::builder()
//!     .group(DomainGroupSpec::new(provider, vec![0, 1]))
//!     .build()?;
//! let (on_done, flag) = OnDone::flag();
//! engine.submit_single_write(1 << 20, Some(7), (&src, 0), (&dst, 0), on_done)?;
//! flag.wait()?;
//! engine.shutdown();
//! # Ok(()) }
//! ```

#![deny(unsafe_code)]

// Unsafe code is allowed only where the engine touches raw memory or the
// OS: CPU pinning (`affinity`), engine-owned registered buffers (`mem`), the
// watched words of the UVM watcher (`watcher`); single functions elsewhere
// carry their own narrow `allow`.
mod addrbook;
#[allow(unsafe_code)]
mod affinity;
mod builder;
mod config;
mod core;
mod driver;
mod engine;
mod error;
mod frame;
mod gate;
mod imm;
mod incarnation;
#[allow(unsafe_code)]
mod mem;
pub mod metrics;
mod ondone;
pub mod probe;
mod recvq;
mod request;
pub mod shard;
mod stats;
mod sync;
#[allow(unsafe_code)]
mod watcher;
mod wrid;

pub use affinity::{parse_cpulist, CpuListError};
pub use builder::EngineBuilder;
pub use config::{DomainGroupSpec, EngineConfig, ExcessHandler, PollPolicy, QueueFullPolicy};
pub use engine::{
    DataPathReport, ImmCounts, ImmLease, NicReport, PeerGroupHandle, Reach, Registration,
    Resources, ScatterSlice, ScatterTargets, TransferEngine,
};
pub use error::{EngineError, TransferId};
pub use mem::{MrHandle, RecvCallback, RecvFromCallback};
pub use ondone::{DoneCallback, DoneCounter, DoneFlag, DoneFuture, DoneResult, OnDone};
pub use recvq::{MessageSender, RecvMsg, RecvQueue};
pub use request::GroupAddress;
pub use shard::{Piece, ScatterMode, ShardConfig};
pub use stats::{EngineStats, GroupStats, NicStats, PeerStats};
pub use watcher::{UvmWatcher, WatchCallback};
pub use weft_transport::{
    DataPath, DeviceMemoryPath, DirectKind, Imm, Incarnation, MrDesc, Pages, ProgressMode,
    ScatterDst,
};

/// Most NICs in one group.
pub const MAX_NICS: usize = 8;
