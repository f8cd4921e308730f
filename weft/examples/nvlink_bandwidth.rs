//! GPU-to-GPU WRITE bandwidth across processes through the engine over the
//! same-host backend (`nvlink`: the initiator maps the target's memory
//! with CUDA IPC and copies into it on a stream of its own), against
//! `cuMemcpyDtoDAsync` inside one process, in the same run.
//!
//! The example re-executes itself as the target: it registers a device
//! buffer with its engine and prints the descriptor. A WRITE over nvlink
//! completes once its copy finished (delivery complete), so a sample is 8
//! engine WRITEs of one size, all completed; the baseline sample is 8
//! synchronous copies of that size between two buffers of this process;
//! alternating. Then 64 KiB pages of a KV-cache shape: 256 paged WRITEs in
//! a shuffled order, one request.
//!
//! Usage: `nvlink_bandwidth [--reps N]` (default 7 repetitions per size).

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

const MAX: usize = 1 << 30;
/// WRITEs (and baseline copies) per sample.
const BATCH: usize = 8;

fn engine(gpu: &Gpu) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    shared::gpu_engine(&shared::nvlink(gpu)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--target") {
        return target();
    }
    let reps = table::reps(&args);
    let gpu = Gpu::open(0)?;
    let src = gpu.alloc(MAX)?;
    let scratch = gpu.alloc(MAX)?;
    let e = engine(&gpu)?;
    // SAFETY: `src` outlives the engine (dropped after it, below).
    let (h, _) = e.reg_mr(unsafe { src.region() })?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().ok_or("target stdout")?);
    let desc: MrDesc = decode(&table::read_hex(&mut out)?)?;
    let mut stdin = child.stdin.take().ok_or("target stdin")?;
    let copy = gpu.copy_engine()?;
    println!(
        "engine WRITE over nvlink (CUDA IPC, copy engine) to another process vs cuMemcpyDtoD in \
         one process, {}, {reps} reps per size",
        gpu.name()
    );
    table::header("engine", "in-process");
    let mut size = 4096;
    while size <= MAX {
        let batch = if size >= 256 << 20 { 2 } else { BATCH };
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..reps + 1 {
            let t = Instant::now();
            shared::write_batch(&e, &h, &desc, size, batch)?;
            times[0].push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            shared::copy_batch(&copy, scratch.device_ptr(), src.device_ptr(), size, batch)?;
            times[1].push(t.elapsed().as_secs_f64());
        }
        table::row(size, batch * size, &mut times);
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
        || Ok(()),
    )?;
    writeln!(stdin, "done")?;
    child.wait()?;
    drop(e);
    Ok(())
}

/// The target: registers a device buffer, prints its descriptor, waits
/// for the end (the bytes arrive without it doing anything but polling).
fn target() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    let dst = gpu.alloc(MAX)?;
    let e = engine(&gpu)?;
    // SAFETY: `dst` outlives the engine (dropped after it, below).
    let (_h, desc) = e.reg_mr(unsafe { dst.region() })?;
    let hex: String = encode(&desc)?.iter().map(|b| format!("{b:02x}")).collect();
    println!("{hex}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line)?;
    drop(e);
    Ok(())
}
