//! Shared helpers for the loopback tests.
#![allow(dead_code)]

use std::ptr::NonNull;
use weft_loopback::{Fabric, LoopbackDomain};
use weft_transport::{Completion, Device, Domain, LocalMr, MemRegion, RemoteSlice};

/// Runs `body` for each seed, printing the seed if it panics.
pub fn for_seeds(seeds: impl IntoIterator<Item = u64>, body: impl Fn(u64)) {
    for seed in seeds {
        with_seed(seed, || body(seed));
    }
}

/// Runs `body`, printing `seed` if it panics.
pub fn with_seed<R>(seed: u64, body: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("test failed with fabric seed {seed}");
            std::panic::resume_unwind(e)
        }
    }
}

/// Heap memory handed to the fabric by raw pointer. Read it only when the
/// fabric is not running (step mode between calls).
pub struct Buf {
    ptr: NonNull<u8>,
    len: usize,
    _mem: Vec<u8>,
}

// SAFETY: the buffer is plain heap memory owned by `_mem`; access goes
// through the raw pointer only, and tests synchronize through the fabric lock.
unsafe impl Send for Buf {}
// SAFETY: see `Send`.
unsafe impl Sync for Buf {}

impl Buf {
    pub fn new(len: usize, fill: u8) -> Self {
        let mut mem = vec![fill; len.max(1)];
        let ptr = NonNull::new(mem.as_mut_ptr()).expect("vec pointer is non-null");
        Self {
            ptr,
            len,
            _mem: mem,
        }
    }

    /// A pattern buffer: byte i = (i * 31 + salt) mod 251.
    pub fn pattern(len: usize, salt: u8) -> Self {
        let b = Self::new(len, 0);
        let data: Vec<u8> = (0..len).map(|i| pattern_byte(i, salt)).collect();
        b.write(0, &data);
        b
    }

    pub fn region(&self) -> MemRegion {
        // SAFETY: `ptr..ptr+len` is owned by `_mem`, which lives as long as
        // `self`; tests keep every `Buf` alive until after the domains that
        // registered it are dropped, and touch it only via raw copies.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }

    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `ptr..ptr+len` is valid (owned by `_mem`); no fabric call
        // runs concurrently in the tests that use `read` in step mode, and
        // in realtime tests the fabric only writes under its lock, while the
        // reads happen after all completions were observed.
        unsafe { std::ptr::copy(self.ptr.as_ptr(), out.as_mut_ptr(), self.len) };
        out
    }

    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: bounds asserted above; memory owned by `_mem`.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(off), data.len()) };
    }
}

pub fn pattern_byte(i: usize, salt: u8) -> u8 {
    ((i * 31 + usize::from(salt)) % 251) as u8
}

pub fn remote(mr: &LocalMr, offset: u64) -> RemoteSlice {
    RemoteSlice {
        base: mr.addr,
        offset,
        rkey: mr.rkey,
    }
}

pub fn poll_all(d: &mut LoopbackDomain) -> Vec<Completion> {
    let mut v = Vec::new();
    d.poll(&mut v).expect("poll");
    v
}

/// Two hosts with `nics` NICs each, domains opened on NIC 0 of each.
pub fn pair(fabric: &Fabric) -> (LoopbackDomain, LoopbackDomain) {
    let a = fabric.add_host(2);
    let b = fabric.add_host(2);
    (fabric.open(a, 0).unwrap(), fabric.open(b, 0).unwrap())
}

pub fn imms(c: &[Completion]) -> Vec<u32> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Imm { imm } => Some(*imm),
            _ => None,
        })
        .collect()
}

pub fn write_results(c: &[Completion]) -> Vec<(u64, Result<(), weft_transport::TransportError>)> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Write { wr, result } => Some((wr.0, result.clone())),
            _ => None,
        })
        .collect()
}
