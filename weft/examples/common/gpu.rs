//! What the GPU examples share: an engine with one group on cuda:0 over a
//! backend, the nvlink backend with a GPU's peer memory, waiting for a
//! batch of WRITEs, and the paged-WRITE rows of KV-cache shapes.

use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{
    Backend, Device, DomainGroupSpec, DoneFlag, EngineConfig, NvlinkOptions, ProviderConfig,
    TransferEngine,
};
use weft_cuda::Gpu;

/// An engine with one group on cuda:0 over `backend`, polling without
/// sleeping (latency and bandwidth runs).
pub fn gpu_engine(backend: &Backend) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    let mut cfg = EngineConfig::default();
    cfg.idle_sleep = None;
    Ok(TransferEngine::builder()
        .group(DomainGroupSpec::new(backend.host()?, vec![0]).device(Device::Cuda(0)))
        .config(cfg)
        .build()?)
}

/// The `nvlink` backend with `gpu`'s peer memory (CUDA IPC).
pub fn nvlink(gpu: &Gpu) -> Result<Backend, Box<dyn std::error::Error>> {
    let pm = Arc::new(gpu.peer_memory()?);
    Ok(weft::provider_with(
        &"nvlink".parse()?,
        &ProviderConfig::default().with_nvlink(NvlinkOptions::default().with_peer_memory(pm)),
    )?)
}

/// libfabric `shm` on this machine with GPU memory registered (FI_HMEM;
/// a libfabric built with CUDA), moved with CUDA IPC when `ipc`.
pub fn cuda_shm(ipc: bool) -> Result<Backend, Box<dyn std::error::Error>> {
    Ok(weft::provider_with(
        &"libfabric:shm".parse()?,
        &ProviderConfig::default().with_libfabric(
            weft::LibfabricOptions::same_machine("shm")
                .with_hmem(true)
                .with_hmem_ipc(ipc),
        ),
    )?)
}

/// Submits `batch` WRITEs of `size` bytes from offset 0 of `h` to offset
/// 0 of `desc` and waits until all completed.
pub fn write_batch(
    e: &TransferEngine,
    h: &weft::MrHandle,
    desc: &weft::MrDesc,
    size: usize,
    batch: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut flags = Vec::with_capacity(batch);
    for _ in 0..batch {
        let (od, f) = weft::OnDone::flag();
        e.submit_single_write(size as u64, None, (h, 0), (desc, 0), od)?;
        flags.push(f);
    }
    wait_all(&flags, &format!("WRITE of {size} B"))
}

/// The baseline of a batch: `batch` synchronous device-to-device copies of
/// `size` bytes from `src` to `dst`, both on cuda:0 of this process.
pub fn copy_batch(
    copy: &weft_cuda::CudaCopy,
    dst: u64,
    src: u64,
    size: usize,
    batch: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use weft::DeviceCopy;
    let dev = Device::Cuda(0);
    for _ in 0..batch {
        copy.copy(dst, dev, src, dev, size as u64)?;
    }
    Ok(())
}

/// Spins until every flag is done (60 s bound); the first failure is an
/// error naming `what`.
pub fn wait_all(flags: &[Arc<DoneFlag>], what: &str) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for f in flags {
        while !f.is_done() {
            if Instant::now() > deadline {
                return Err(format!("{what}: not complete within 60 s").into());
            }
            std::hint::spin_loop();
        }
        if let Some(Err(err)) = f.result() {
            return Err(format!("{what}: {err}").into());
        }
    }
    Ok(())
}

/// The paged rows of a KV-cache shape: per page size (4, 16, 64 KiB), one
/// request of 256 pages in a shuffled order from `h` into `desc`, against
/// the same 256 copies between two buffers of this process (`src` →
/// `scratch`), alternating, `reps` + 1 samples each (the first dropped by
/// the table). `settle` runs after each request and each baseline (the
/// shm example synchronises the target's copies there).
#[allow(clippy::too_many_arguments)]
pub fn paged_rows(
    e: &TransferEngine,
    h: &weft::MrHandle,
    desc: &weft::MrDesc,
    copy: &weft_cuda::CudaCopy,
    src: u64,
    scratch: u64,
    reps: usize,
    mut settle: impl FnMut() -> Result<(), Box<dyn std::error::Error>>,
) -> Result<(), Box<dyn std::error::Error>> {
    use weft::{DeviceCopy, OnDone, Pages};
    let dev = Device::Cuda(0);
    println!(
        "paged WRITEs (256 shuffled pages per request) vs in-process copies of the same pages"
    );
    super::table::header("engine", "in-process");
    for page in [4usize << 10, 16 << 10, 64 << 10] {
        let n = 256u32;
        let order: Vec<u32> = (0..n).map(|j| (j * 97 + 31) % n).collect();
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..reps + 1 {
            let sp = Pages {
                indices: order.clone(),
                stride: page as u64,
                offset: 0,
            };
            let dp = Pages {
                indices: (0..n).collect(),
                stride: page as u64,
                offset: 0,
            };
            let t = Instant::now();
            let (od, f) = OnDone::flag();
            e.submit_paged_writes(page as u64, None, (h, &sp), (desc, &dp), od)?;
            wait_all(&[f], "paged WRITEs")?;
            settle()?;
            times[0].push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            for (j, &s) in order.iter().enumerate() {
                copy.copy(
                    scratch + (j * page) as u64,
                    dev,
                    src + s as u64 * page as u64,
                    dev,
                    page as u64,
                )?;
            }
            settle()?;
            times[1].push(t.elapsed().as_secs_f64());
        }
        super::table::row(page, n as usize * page, &mut times);
    }
    Ok(())
}
