//! TransferEngine end to end over nvlink across real processes: the
//! engine scenario suite with the initiator engine in the test process and
//! every peer engine in its own child process, each peer checking every
//! byte when its immediates fire.

weft_conformance::engine_scenarios!(
    |seed| crate::common::XprocEngines::new("nvlink", seed),
    seeds = [1u64]
);
