//! Device-to-device copy bandwidth into another process's memory (mapped
//! with `Gpu::import`) against the same copy into this process's own
//! memory, in the same run: what the same-host GPU path can reach.
//!
//! The example re-executes itself as the peer: the peer allocates the
//! destination (`cuMemAlloc`, or `cuMemCreate` with `--vmm`), exports it and
//! waits; this process imports it and times `cuMemcpyDtoDAsync` + stream
//! synchronisation from its own buffer into it, then into a local buffer,
//! alternating, for each size.
//!
//! Usage: `ipc_bandwidth [--vmm] [--reps N]` (default 7 repetitions per size
//! and side; prints min/median/max GB/s and the ratio of medians).

#[path = "common/table.rs"]
mod table;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;
use weft::{Device, DeviceCopy};
use weft_cuda::{Gpu, SharedMemory};

const MAX: usize = 1 << 30;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let vmm = args.iter().any(|a| a == "--vmm");
    if args.iter().any(|a| a == "--peer") {
        return peer(vmm);
    }
    let reps = table::reps(&args);
    let gpu = Gpu::open(0)?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--peer")
        .args(vmm.then_some("--vmm"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let bytes = table::read_hex(&mut std::io::BufReader::new(
        child.stdout.take().ok_or("peer stdout")?,
    ))?;
    let remote = gpu.import(&SharedMemory::from_bytes(&bytes)?)?;
    let src = gpu.alloc(MAX)?;
    let local = gpu.alloc(MAX)?;
    let copy = gpu.copy_engine()?;
    let dev = Device::Cuda(0);
    println!(
        "{} on {} (same GPU, two processes), {reps} reps per size",
        if vmm {
            "cuMemCreate (POSIX fd)"
        } else {
            "cuMemAlloc (legacy IPC)"
        },
        gpu.name(),
    );
    table::header("peer process", "this process");
    let mut size = 4096;
    while size <= MAX {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..reps + 1 {
            for (side, dst) in [remote.device_ptr(), local.device_ptr()]
                .into_iter()
                .enumerate()
            {
                let t = Instant::now();
                copy.copy(dst, dev, src.device_ptr(), dev, size as u64)?;
                times[side].push(t.elapsed().as_secs_f64());
            }
        }
        table::row(size, size, &mut times);
        size *= 4;
    }
    drop(remote);
    if let Some(mut stdin) = child.stdin.take() {
        writeln!(stdin, "done")?;
    }
    child.wait()?;
    Ok(())
}

/// The peer: allocates and exports the destination, waits for "done".
fn peer(vmm: bool) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    let buf = if vmm {
        gpu.alloc_shareable(MAX)?
    } else {
        gpu.alloc(MAX)?
    };
    let e = gpu.export(buf.device_ptr(), MAX as u64)?;
    let hex: String = e
        .shared()
        .to_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("{hex}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(())
}
