//! GPU-to-GPU WRITE bandwidth across processes through the engine over a
//! CUDA-enabled libfabric's `shm` (FI_HMEM; the provider moves the bytes
//! with CUDA IPC), against `cuMemcpyDtoDAsync` inside one process, in the
//! same run.
//!
//! The example re-executes itself as the target: it registers a device
//! buffer with its engine and prints the descriptor. libfabric's shm
//! completes a CUDA WRITE when the target has *issued* its `cudaMemcpy`
//! (device-to-device copies return before they finish), so the writer's
//! completion alone says nothing about the bytes: per sample this process
//! submits one engine WRITE, waits for its completion, then asks the target
//! over a pipe to synchronise its GPU context and waits for the answer.
//! A sample is 8 such WRITEs (all completed) then one synchronisation; the
//! baseline sample is 8 copies of that size between two buffers of this
//! process, then the same pipe round trip; alternating. Then 4–64 KiB pages
//! of a KV-cache shape: 256 paged WRITEs in a shuffled order, one request,
//! then the synchronisation (and the same for the in-process copies).
//!
//! Usage: `WEFT_LIBFABRIC_PATH=/path/to/cuda/libfabric.so.1 shm_hmem_bandwidth
//! [--ipc] [--reps N]` (default 7 repetitions per size; `--ipc`: CUDA IPC
//! instead of staging through host memory, `LibfabricConfig::hmem_ipc`).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod shared;
#[path = "common/table.rs"]
mod table;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;
use weft::{decode, encode, MrDesc, TransferEngine};
use weft_cuda::Gpu;

const MAX: usize = 256 << 20;
/// WRITEs (and baseline copies) per sample, before one synchronisation.
const BATCH: usize = 8;

fn engine(ipc: bool) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    // The facade's libfabric backend, one host (this process), GPU memory
    // registered with the provider.
    shared::gpu_engine(&shared::cuda_shm(ipc)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let ipc = args.iter().any(|a| a == "--ipc");
    if args.iter().any(|a| a == "--target") {
        return target(ipc);
    }
    let reps = table::reps(&args);
    let gpu = Gpu::open(0)?;
    let src = gpu.alloc(MAX)?;
    let scratch = gpu.alloc(MAX)?;
    let e = engine(ipc)?;
    // SAFETY: `src` outlives the engine (dropped after it, below).
    let (h, _) = e.reg_mr(unsafe { src.region() })?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--target")
        .args(ipc.then_some("--ipc"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().ok_or("target stdout")?);
    let bytes = table::read_hex(&mut out)?;
    let desc: MrDesc = decode(&bytes)?;
    let mut stdin = child.stdin.take().ok_or("target stdin")?;
    let copy = gpu.copy_engine()?;
    println!(
        "engine WRITE over libfabric shm (FI_HMEM{}) to another process vs cuMemcpyDtoD in one \
         process, {}, {reps} reps per size",
        if ipc {
            ", CUDA IPC"
        } else {
            ", staged through host memory"
        },
        gpu.name()
    );
    table::header("engine", "in-process");
    let mut size = 4096;
    while size <= MAX {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..reps + 1 {
            let t = Instant::now();
            shared::write_batch(&e, &h, &desc, size, BATCH)?;
            sync(&mut stdin, &mut out)?;
            times[0].push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            shared::copy_batch(&copy, scratch.device_ptr(), src.device_ptr(), size, BATCH)?;
            sync(&mut stdin, &mut out)?;
            times[1].push(t.elapsed().as_secs_f64());
        }
        table::row(size, BATCH * size, &mut times);
        size *= 4;
    }
    shared::paged_rows(
        &e,
        &h,
        &desc,
        &copy,
        src.device_ptr(),
        scratch.device_ptr(),
        reps,
        || sync(&mut stdin, &mut out),
    )?;
    writeln!(stdin, "done")?;
    child.wait()?;
    drop(e);
    Ok(())
}

/// Asks the target to synchronise its GPU context; returns once it did.
fn sync(
    stdin: &mut std::process::ChildStdin,
    out: &mut std::io::BufReader<std::process::ChildStdout>,
) -> Result<(), Box<dyn std::error::Error>> {
    writeln!(stdin, "sync")?;
    stdin.flush()?;
    let mut line = String::new();
    out.read_line(&mut line)?;
    if line.trim() != "ok" {
        return Err(format!("target answered {line:?}").into());
    }
    Ok(())
}

/// The target: registers a device buffer, prints its descriptor, waits.
fn target(ipc: bool) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    let dst = gpu.alloc(MAX)?;
    let e = engine(ipc)?;
    // SAFETY: `dst` outlives the engine (dropped after it, below).
    let (_h, desc) = e.reg_mr(unsafe { dst.region() })?;
    let hex: String = encode(&desc)?.iter().map(|b| format!("{b:02x}")).collect();
    println!("{hex}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line)? > 0 && line.trim() == "sync" {
        gpu.synchronize()?;
        println!("ok");
        std::io::stdout().flush()?;
        line.clear();
    }
    drop(e);
    Ok(())
}
