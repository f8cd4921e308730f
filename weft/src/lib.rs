//! # weft: portable RDMA point-to-point for LLM systems
//!
//! The one crate an application depends on. It re-exports
//!
//! - the engine ([`TransferEngine`], [`EngineBuilder`], [`DomainGroupSpec`],
//!   [`OnDone`], [`MrHandle`], peer groups, the ImmCounter, [`shard`], the
//!   [`UvmWatcher`], ...: everything `weft-engine` exports),
//! - the transport types an application touches ([`MemRegion`], [`Device`],
//!   [`MrDesc`], [`Pages`], [`NetAddr`], [`ScatterDst`], [`TransportError`])
//!   and, for backend authors and raw baselines, the backend traits
//!   [`Provider`] and [`Domain`] with their work-request types,
//! - and the **provider registry**: [`provider`] turns a spec string
//!   (`loopback`, `loopback-null`, `libfabric:tcp`, `libfabric:shm`,
//!   `libfabric:efa`, `verbs`, `verbs:mlx5_0`) into a [`Backend`] that hands
//!   out one [`Provider`] per host; [`providers`] lists every known backend
//!   with whether it works on this host; [`register`] / [`Registry::register`]
//!   add a backend that lives outside this workspace,
//! - [`rendezvous`]: how processes find each other (an in-process,
//!   directory or etcd store; engine addresses and memory descriptors
//!   published under a namespace).
//!
//! The backends are cargo features (`loopback`, `libfabric`, `verbs`, all on
//! by default); a backend compiled out is still listed and reports
//! [`ProviderError::FeatureDisabled`]. The native libraries are loaded at run
//! time, so every feature builds anywhere.
//!
//! ```
//! use weft::{DomainGroupSpec, ProviderConfig, TransferEngine};
//!
//! let backend = weft::provider_with(&"loopback".parse()?, &ProviderConfig::default().with_nics(2))?;
//! let engine = TransferEngine::builder()
//!     .group(DomainGroupSpec::new(backend.host()?, vec![0, 1]))
//!     .build()?;
//! engine.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! See `docs/architecture.md` for where the facade sits.

#![deny(unsafe_code)]

mod backend;
mod builtin;
mod config;
pub mod dtype;
mod error;
mod registry;
pub mod rendezvous;
mod serve;
mod spec;
pub mod topology;

pub use backend::{Backend, HostSource};
pub use config::{
    LibfabricOptions, LoopbackOptions, LoopbackProfile, NvlinkOptions, ProviderConfig,
};
pub use error::ProviderError;
pub use registry::{
    provider, provider_with, providers, register, Availability, Factory, ProviderStatus, Registry,
};
pub use serve::MetricsServer;
pub use spec::ProviderSpec;
pub use topology::Topology;

pub use weft_engine::*;
pub use weft_transport::{
    decode, encode, Access, Capabilities, Completion, Device, DeviceCopy, Domain, HostBuffer,
    HostBufferBuilder, HostBufferError, LocalMr, LocalSlice, MemRegion, MrKey, NetAddr,
    NetAddrParseError, NicInfo, PeerId, PeerMemory, PostError, Provider, RemoteAccessReason,
    RemoteSlice, Rkey, TransportError, WireError, WrId, WriteWr,
};

/// The simulated fabric's own types (fault rules, NIC models, statistics),
/// for tests and demos that drive it beyond the [`LoopbackOptions`]: get the
/// fabric of a loopback backend with [`Backend::loopback_fabric`].
#[cfg(feature = "loopback")]
pub mod loopback {
    pub use weft_loopback::{
        Action, Fabric, FabricConfig, FabricStats, HostId, LoopbackDomain, Matcher, NicModel,
        OpKind, Rule, SimTime, TraceEvent, TraceKind,
    };
}
