//! Shared helpers of the GPU tests: open the GPU or skip with a message.

#![allow(dead_code)]

use weft_cuda::{Gpu, Kernels};

/// Whether a missing GPU must fail the test instead of skipping it (the
/// device-machine script sets `WEFT_CUDA_REQUIRE_GPU=1`, so a broken CUDA
/// environment there cannot pass silently).
fn required() -> bool {
    std::env::var_os("WEFT_CUDA_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// Opens GPU 0, or prints why the test is skipped and returns `None`.
pub fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) if !required() => {
            eprintln!("SKIP {test}: no usable CUDA GPU: {e}");
            None
        }
        Err(e) => panic!("{test}: WEFT_CUDA_REQUIRE_GPU=1 but no usable GPU: {e}"),
    }
}

/// Opens GPU 0 and compiles the kernels, or skips.
pub fn gpu_kernels(test: &str) -> Option<(Gpu, Kernels)> {
    let g = gpu(test)?;
    match g.kernels() {
        Ok(k) => Some((g, k)),
        Err(e) if !required() => {
            eprintln!("SKIP {test}: GPU present but kernels unavailable: {e}");
            None
        }
        Err(e) => panic!("{test}: kernels unavailable: {e}"),
    }
}

/// Lowercase hex of `b` (descriptions passed to child processes by line).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of [`hex`]'s output.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}
