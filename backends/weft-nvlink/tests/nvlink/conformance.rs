//! The conformance suite, unchanged, over nvlink: every host in this
//! process (`in_process::*`), the same with every remotely writable
//! registration exported to a host-memory `PeerMemory`, so peers copy into
//! it one-sidedly (`in_process_one_sided::*`), and every host in its own
//! child process (`cross_process::*`, domains are proxies; `..._fallback`
//! with that `PeerMemory`, whose exports other processes cannot map: every
//! WRITE falls back to the rings).

mod in_process {
    weft_conformance::conformance_tests!(
        |seed| crate::common::NvInProcess::harness(seed, false),
        seeds = 0..3u64,
        heavy_seeds = 0..1u64
    );
}

mod in_process_one_sided {
    weft_conformance::conformance_tests!(
        |seed| crate::common::NvInProcess::harness(seed, true),
        seeds = 0..3u64,
        heavy_seeds = 0..1u64
    );
}

mod cross_process {
    weft_conformance::conformance_tests!(
        |seed| crate::common::CrossProcess::new("nvlink", seed),
        seeds = 0..1u64,
        heavy_seeds = 0..1u64
    );
}

mod cross_process_fallback {
    weft_conformance::conformance_tests!(
        |seed| crate::common::CrossProcess::new("nvlink;one-sided", seed),
        seeds = 0..1u64,
        heavy_seeds = 0..1u64
    );
}
