//! Device memory shared between processes: this process exports ranges of a
//! `cuMemAlloc` buffer (legacy IPC handle) and of a `cuMemCreate` buffer
//! (POSIX file descriptor); a child process (this binary re-executed)
//! imports them through an `ImportCache`, checks their bytes, writes new
//! ones, and refuses forged descriptions with typed errors. Skips without a
//! GPU.

#![cfg(feature = "cuda")]

use crate::common::{gpu, hex, unhex};
use std::time::{Duration, Instant};
use weft_cuda::{CudaError, Gpu, ImportCache, ShareKind, SharedMemory};
use weft_testkit::child::{self, spawn_role};
use weft_transport::{Device, DeviceCopy};

/// Byte `k` of the pattern `seed`.
fn pat(seed: u8, k: usize) -> u8 {
    (k as u8).wrapping_mul(7).wrapping_add(seed)
}

/// The child: imports each description it is sent (`<seed> <new seed>
/// <hex>`), checks the range holds pattern `seed`, writes pattern `new
/// seed`, then answers with the cache's state and the forged cases.
#[test]
fn ipc_entry() {
    let Some(_) = child::role() else { return };
    let g = Gpu::open(0).expect("child: open the GPU");
    let copy = g.copy_engine().unwrap();
    let cache = ImportCache::new(&g);
    let mut ranges = Vec::new();
    while let Some(line) = child::recv_line().unwrap() {
        if line == "end" {
            break;
        }
        let mut it = line.split(' ');
        let seed: u8 = it.next().unwrap().parse().unwrap();
        let new: u8 = it.next().unwrap().parse().unwrap();
        let shared = SharedMemory::from_bytes(&unhex(it.next().unwrap())).unwrap();
        let r = match cache.import(1, &shared) {
            Ok(r) => r,
            Err(e) => {
                child::send_line(&format!("import failed: {e}")).unwrap();
                return;
            }
        };
        // A second import of the same allocation reuses the mapping.
        let again = cache.import(1, &shared).unwrap();
        assert_eq!(again.device_ptr(), r.device_ptr());
        let len = r.len() as usize;
        let mut host = vec![0u8; len];
        copy.copy(
            host.as_mut_ptr() as u64,
            Device::Host,
            r.device_ptr(),
            Device::Cuda(0),
            len as u64,
        )
        .unwrap();
        let wrong = (0..len).filter(|&k| host[k] != pat(seed, k)).count();
        let fresh: Vec<u8> = (0..len).map(|k| pat(new, k)).collect();
        copy.copy(
            r.device_ptr(),
            Device::Cuda(0),
            fresh.as_ptr() as u64,
            Device::Host,
            len as u64,
        )
        .unwrap();
        child::send_line(&format!("checked {wrong} wrong")).unwrap();
        ranges.push(r);
    }
    child::send_line(&format!("mappings {}", cache.mappings())).unwrap();
    // Forged descriptions: typed errors, no crash.
    let forged = [
        SharedMemory {
            kind: ShareKind::Legacy { handle: [0x5a; 64] },
            offset: 0,
            len: 64,
            device_uuid: [0; 16],
        },
        SharedMemory {
            kind: ShareKind::PosixFd {
                pid: std::process::id() as i32,
                fd: 0,
                size: 1 << 21,
            },
            offset: 0,
            len: 64,
            device_uuid: [0; 16],
        },
        SharedMemory {
            kind: ShareKind::PosixFd {
                pid: i32::MAX,
                fd: 3,
                size: 1 << 21,
            },
            offset: 0,
            len: 64,
            device_uuid: [0; 16],
        },
    ];
    let typed = forged
        .iter()
        .filter(|f| matches!(cache.import(2, f), Err(CudaError::ImportFailed { .. })))
        .count();
    child::send_line(&format!("forged refused {typed}")).unwrap();
    drop(ranges);
    child::send_line(&format!("forgot {}", cache.forget_peer(1))).unwrap();
}

#[test]
fn device_memory_crosses_processes() {
    let Some(g) = gpu("device_memory_crosses_processes") else {
        return;
    };
    let legacy = g.alloc(1 << 20).unwrap();
    let vmm = g.alloc_shareable(3 << 20).unwrap();
    let fill = |b: &weft_cuda::DeviceBuffer, seed: u8| {
        let v: Vec<u8> = (0..b.len()).map(|k| pat(seed, k)).collect();
        b.write(0, &v).unwrap();
    };
    fill(&legacy, 1);
    fill(&vmm, 2);
    // Ranges inside each allocation (not at its start).
    let (lo, llen) = (4096usize, 64usize << 10);
    let (vo, vlen) = (8192usize, 1usize << 20);
    let el = g
        .export(legacy.device_ptr() + lo as u64, llen as u64)
        .unwrap();
    let ev = g.export(vmm.device_ptr() + vo as u64, vlen as u64).unwrap();
    assert!(matches!(el.shared().kind, ShareKind::Legacy { .. }));
    assert!(matches!(ev.shared().kind, ShareKind::PosixFd { .. }));
    assert_eq!(el.shared().offset, lo as u64);
    // Memory that cannot be shared.
    let host = vec![0u8; 4096];
    assert!(matches!(
        g.export(host.as_ptr() as u64, 4096),
        Err(CudaError::NotShareable { .. })
    ));
    assert!(matches!(
        g.export(legacy.device_ptr() + (1 << 20) - 8, 16),
        Err(CudaError::NotShareable { .. })
    ));

    let mut c = spawn_role("ipc_entry", "import", &[]).expect("spawn");
    let line = |c: &mut child::ChildProcess| {
        c.recv_line_timeout(Duration::from_secs(120))
            .expect("child line")
            .expect("child alive")
    };
    // The range seen from the child starts at `lo`/`vo`: its pattern is the
    // parent's shifted, so the child checks against a pattern of its own
    // start (seeds chosen so pat(seed', k) == pat(seed, k + off)).
    let shifted = |seed: u8, off: usize| seed.wrapping_add((off as u8).wrapping_mul(7));
    let started = Instant::now();
    for (e, seed, off) in [(&el, 1u8, lo), (&ev, 2u8, vo)] {
        c.send_line(&format!(
            "{} {} {}",
            shifted(seed, off),
            seed + 100,
            hex(&e.shared().to_bytes())
        ))
        .unwrap();
        assert_eq!(line(&mut c), "checked 0 wrong");
    }
    eprintln!(
        "two imports, checks and writes across processes: {:?}",
        started.elapsed()
    );
    c.send_line("end").unwrap();
    assert_eq!(line(&mut c), "mappings 2");
    assert_eq!(line(&mut c), "forged refused 3");
    assert_eq!(line(&mut c), "forgot 2");
    assert!(c.wait().unwrap().success());
    // The child's bytes landed in the ranges, and nothing outside them.
    for (b, seed, off, len) in [(&legacy, 1u8, lo, llen), (&vmm, 2u8, vo, vlen)] {
        let got = b.to_vec().unwrap();
        let mut wrong = 0;
        for (k, &x) in got.iter().enumerate() {
            let want = if (off..off + len).contains(&k) {
                pat(seed + 100, k - off)
            } else {
                pat(seed, k)
            };
            wrong += usize::from(x != want);
        }
        assert_eq!(wrong, 0, "bytes of the buffer with seed {seed}");
    }
}
