//! The engine scenario suite (`weft_conformance::engine`) over libfabric
//! `tcp` (`tcp;ofi_rxm` on `lo`), every engine in this process with one group of 2 NICs
//! (two endpoints of `lo`; each engine checks it got 2). Scenarios are skipped
//! (printed) when libfabric is unavailable. A dying host is an engine shut down (its endpoints close).

mod common;

use weft_conformance::engine::InProcessEngines;

weft_conformance::engine_scenarios!(|seed| InProcessEngines::new(common::engines::LfEngines {
    name: "tcp".into(),
    seed,
}));
