//! The conformance suite, unchanged, over nvlink: every host in this
//! process (`in_process::*`) and every host in its own child process
//! (`cross_process::*`, domains are proxies).

mod in_process {
    weft_conformance::conformance_tests!(
        |seed| crate::common::NvInProcess::harness(seed),
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
