//! Small-WRITE latency between two processes on one GPU machine: an 8-byte
//! WRITE with immediate through the engine over `nvlink`, GPU memory to
//! GPU memory, against the raw path in the same run — a CUDA IPC copy of 8
//! bytes into the peer's mapped buffer (`cuMemcpyDtoDAsync` + stream
//! synchronisation) followed by a flag the peer spins on in shared host
//! memory.
//!
//! Both are ping-pongs (this process and a copy of itself re-executed as
//! the peer): half the round trip is the time from one side's submit to
//! the other side seeing the immediate (or the flag). Reported in µs as
//! min / median / max over `--reps` runs (default 5) of 2000 round trips
//! each (median of each run), after 200 warm-up round trips.
//!
//! `--shm` runs the engine side over a CUDA-enabled libfabric's shm
//! instead (FI_HMEM with CUDA IPC; load it with `WEFT_LIBFABRIC_PATH`),
//! against the same raw baseline.
//!
//! Usage: `nvlink_latency [--reps N] [--shm]`.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod shared;
// Only `reps` and `read_hex` of the shared table code are used here.
#[allow(dead_code)]
#[path = "common/table.rs"]
mod table;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use weft::{decode, encode, Device, DeviceCopy, MrDesc, OnDone, TransferEngine};
use weft_cuda::{Gpu, SharedMemory};

const ROUNDS: usize = 2000;
const WARM: usize = 200;

fn engine(gpu: &Gpu) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    let backend = if std::env::args().any(|a| a == "--shm") {
        shared::cuda_shm(true)?
    } else {
        shared::nvlink(gpu)?
    };
    shared::gpu_engine(&backend)
}

/// A page of host memory both processes map (a file under /dev/shm).
struct Flags {
    ptr: *mut AtomicU64,
}

impl Flags {
    fn map(path: &str, create: bool) -> Result<Flags, Box<dyn std::error::Error>> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(create)
            .open(path)?;
        f.set_len(4096)?;
        // SAFETY: a fresh shared mapping of a 4096-byte file; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(Flags { ptr: p.cast() })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: words 0 and 8 (a cache line apart) of the mapped page,
        // which lives as long as `self` (never unmapped: the process ends).
        unsafe { &*self.ptr.add(i * 8) }
    }
}

fn spin_until(w: &AtomicU64, v: u64) {
    while w.load(Ordering::Acquire) != v {
        std::hint::spin_loop();
    }
}

fn stats(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--peer") {
        return peer();
    }
    let reps = table::reps(&args).min(50);
    let gpu = Gpu::open(0)?;
    let buf = gpu.alloc(4096)?;
    let e = engine(&gpu)?;
    // SAFETY: `buf` outlives the engine (dropped after it).
    let (h, desc) = e.reg_mr(unsafe { buf.region() })?;
    let exported = gpu.export(buf.device_ptr(), 4096)?;
    let path = format!("/dev/shm/weft-nvlink-latency.{}", std::process::id());
    let flags = Flags::map(&path, true)?;
    let shm = args.iter().any(|a| a == "--shm");
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--peer"])
        .args(shm.then_some("--shm"))
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().ok_or("peer stdout")?);
    let mut stdin = child.stdin.take().ok_or("peer stdin")?;
    // Exchange: engine descriptors and immediates, raw IPC descriptions.
    let my_imm = e.alloc_imm()?;
    writeln!(stdin, "{}", hex(&encode(&desc)?))?;
    writeln!(stdin, "{my_imm}")?;
    writeln!(stdin, "{}", hex(&exported.shared().to_bytes()))?;
    stdin.flush()?;
    let peer_desc: MrDesc = decode(&table::read_hex(&mut out)?)?;
    let mut line = String::new();
    out.read_line(&mut line)?;
    let peer_imm: u32 = line.trim().parse()?;
    let peer_shared = SharedMemory::from_bytes(&table::read_hex(&mut out)?)?;
    let peer_buf = gpu.import(&peer_shared)?;
    let copy = gpu.copy_engine()?;
    let dev = Device::Cuda(0);
    println!(
        "8-byte WRITE+imm over {} (GPU to GPU, another process) vs a raw CUDA IPC copy + host flag, {}, \
         half round trip in µs, median of {ROUNDS} round trips per run, {reps} runs",
        if shm { "libfabric shm (FI_HMEM, CUDA IPC)" } else { "nvlink" },
        gpu.name()
    );
    let (mut eng, mut raw) = (Vec::new(), Vec::new());
    let mut seq = 0u64;
    for _ in 0..reps {
        // Engine ping-pong: arm our round, write, wait for the answer.
        let mut t = Vec::with_capacity(ROUNDS);
        for i in 0..WARM + ROUNDS {
            let (od, f) = OnDone::flag();
            e.expect_imm_count_with(my_imm, 1, od)?;
            let t0 = Instant::now();
            e.submit_single_write(8, Some(peer_imm), (&h, 0), (&peer_desc, 0), OnDone::Ignore)?;
            while !f.is_done() {
                std::hint::spin_loop();
            }
            if i >= WARM {
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        eng.push(stats(t));
        // Raw ping-pong: copy into the peer's buffer, raise its flag,
        // wait for ours.
        let mut t = Vec::with_capacity(ROUNDS);
        for i in 0..WARM + ROUNDS {
            seq += 1;
            let t0 = Instant::now();
            copy.copy(peer_buf.device_ptr(), dev, buf.device_ptr(), dev, 8)?;
            flags.word(1).store(seq, Ordering::Release);
            spin_until(flags.word(0), seq);
            if i >= WARM {
                t.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        raw.push(stats(t));
    }
    flags.word(1).store(u64::MAX, Ordering::Release);
    child.wait()?;
    let _ = std::fs::remove_file(&path);
    let mm = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        (v[0], v[v.len() / 2], v[v.len() - 1])
    };
    let (a, b) = (mm(&eng), mm(&raw));
    println!("{:>22} {:>8} {:>8} {:>8}", "", "min", "median", "max");
    println!(
        "{:>22} {:>8.2} {:>8.2} {:>8.2}",
        "engine WRITE+imm", a.0, a.1, a.2
    );
    println!(
        "{:>22} {:>8.2} {:>8.2} {:>8.2}",
        "raw IPC copy + flag", b.0, b.1, b.2
    );
    println!("ratio of medians (engine / raw): {:.2}", a.1 / b.1);
    drop(e);
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The peer: answers every engine WRITE with one back, then every raw
/// flag with a copy and a flag back, until told to stop.
fn peer() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.last().ok_or("flag path")?.clone();
    let gpu = Gpu::open(0)?;
    let buf = gpu.alloc(4096)?;
    let e = engine(&gpu)?;
    // SAFETY: `buf` outlives the engine (dropped after it).
    let (h, desc) = e.reg_mr(unsafe { buf.region() })?;
    let exported = gpu.export(buf.device_ptr(), 4096)?;
    let flags = Flags::map(&path, false)?;
    let mut inp = std::io::BufReader::new(std::io::stdin());
    let peer_desc: MrDesc = decode(&table::read_hex(&mut inp)?)?;
    let mut line = String::new();
    inp.read_line(&mut line)?;
    let peer_imm: u32 = line.trim().parse()?;
    let peer_shared = SharedMemory::from_bytes(&table::read_hex(&mut inp)?)?;
    let my_imm = e.alloc_imm()?;
    let mut out = std::io::stdout();
    writeln!(out, "{}", hex(&encode(&desc)?))?;
    writeln!(out, "{my_imm}")?;
    writeln!(out, "{}", hex(&exported.shared().to_bytes()))?;
    out.flush()?;
    let peer_buf = gpu.import(&peer_shared)?;
    let copy = gpu.copy_engine()?;
    let dev = Device::Cuda(0);
    // The parent runs WARM+ROUNDS engine round trips, then as many raw
    // ones, per run, and raises the stop flag at the end.
    let mut seq = 0u64;
    let (od, mut f) = OnDone::flag();
    e.expect_imm_count_with(my_imm, 1, od)?;
    loop {
        for _ in 0..WARM + ROUNDS {
            while !f.is_done() {
                if flags.word(1).load(Ordering::Acquire) == u64::MAX {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            let (od, next) = OnDone::flag();
            e.expect_imm_count_with(my_imm, 1, od)?;
            f = next;
            e.submit_single_write(8, Some(peer_imm), (&h, 0), (&peer_desc, 0), OnDone::Ignore)?;
        }
        for _ in 0..WARM + ROUNDS {
            seq += 1;
            loop {
                let v = flags.word(1).load(Ordering::Acquire);
                if v == u64::MAX {
                    return Ok(());
                }
                if v == seq {
                    break;
                }
                std::hint::spin_loop();
            }
            copy.copy(peer_buf.device_ptr(), dev, buf.device_ptr(), dev, 8)?;
            flags.word(0).store(seq, Ordering::Release);
        }
    }
}
