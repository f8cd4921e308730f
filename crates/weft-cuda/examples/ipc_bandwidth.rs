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

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;
use weft_cuda::{Gpu, SharedMemory};
use weft_transport::{Device, DeviceCopy};

const MAX: usize = 1 << 30;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let vmm = args.iter().any(|a| a == "--vmm");
    if args.iter().any(|a| a == "--peer") {
        return peer(vmm);
    }
    let reps: usize = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(7)
        .max(1);
    let gpu = Gpu::open(0)?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--peer")
        .args(vmm.then_some("--vmm"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().ok_or("peer stdout")?).read_line(&mut line)?;
    let bytes: Vec<u8> = (0..line.trim().len() / 2)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()?;
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
    println!(
        "{:>10} {:>26} {:>26} {:>7}",
        "size", "peer process GB/s min/med/max", "this process GB/s min/med/max", "ratio"
    );
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
        let stats = |v: &mut Vec<f64>| {
            v.remove(0); // warm-up
            let mut g: Vec<f64> = v.iter().map(|t| size as f64 / t / 1e9).collect();
            g.sort_by(|a, b| a.total_cmp(b));
            (g[0], g[g.len() / 2], g[g.len() - 1])
        };
        let (a, b) = (stats(&mut times[0]), stats(&mut times[1]));
        println!(
            "{:>10} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>7.2}",
            human(size),
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2,
            a.1 / b.1
        );
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

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n => format!("{} KiB", n >> 10),
    }
}
