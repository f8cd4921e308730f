//! The engine scenario suite (`weft_conformance::engine`) over libfabric
//! `shm`, every engine in this process with one group of 2 NICs
//! (two shm endpoints; each engine checks it got 2). Scenarios are skipped
//! (printed) when libfabric is unavailable. Peer death is skipped here (see `LfEngines::kill_host`); `engine_xproc.rs` covers it.

use weft_conformance::engine::InProcessEngines;

weft_conformance::engine_scenarios!(|seed| InProcessEngines::new(
    crate::common::engines::LfEngines {
        name: "shm".into(),
        seed,
    }
));
