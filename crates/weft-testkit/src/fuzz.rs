//! Fuzzing wire decoders with proptest: the case count every fuzz property
//! runs ([`config`], `WEFT_FUZZ_CASES=N` to override it), mutations of
//! valid encodings ([`mutated`]), and an allocator that measures what a
//! decode allocated ([`TrackingAlloc`], [`peak_during`]).
//!
//! A decoder of bytes a peer, a store or a file hands over must not panic,
//! must not allocate more than its input can justify (a length prefix
//! claiming 2^60 elements is refused before anything that size is
//! allocated), and must not accept a forgery where a rule exists. The
//! fuzz properties of each crate check these with arbitrary bytes and with
//! valid encodings mutated: bytes flipped or set, cut short, spliced,
//! extended, and length prefixes inflated to huge varints.

use proptest::prelude::*;
use proptest::test_runner::Config;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The environment variable that overrides every fuzz property's case
/// count (e.g. `WEFT_FUZZ_CASES=10000000` for a long run on a fast
/// machine, `100` for a quick one).
pub const CASES_ENV: &str = "WEFT_FUZZ_CASES";

/// The proptest configuration of a fuzz property: `cases` cases (or
/// [`CASES_ENV`]), no regression files written into the source tree
/// (proptest prints the minimal failing input), shrinking bounded.
pub fn config(cases: u32) -> Config {
    let cases = std::env::var(CASES_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    }
}

/// One change to a byte string.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// XOR the byte at the index (modulo the length, as for every index
    /// here) with a non-zero mask.
    Flip(usize, u8),
    /// Set the byte at the index.
    Set(usize, u8),
    /// Cut the string at the index.
    Truncate(usize),
    /// Insert bytes at the index.
    Insert(usize, Vec<u8>),
    /// Remove up to `n` bytes from the index.
    Remove(usize, usize),
    /// Insert a varint of `value` at the index: with postcard, a length
    /// prefix (or an integer) where there was none, up to 2^64 - 1.
    Varint(usize, u64),
    /// Replace the byte at the index with a varint of `value` (a length
    /// prefix inflated in place).
    Inflate(usize, u64),
}

/// The LEB128 varint of `v` (postcard's integer and length encoding).
pub fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(10);
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

/// Large values a length prefix may claim, and a few small ones.
fn claim() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(1u64 << 60),
        Just(u64::MAX),
        Just(u64::from(u32::MAX)),
        Just(1u64 << 31),
        0u64..64,
        any::<u64>(),
    ]
}

/// A random [`Mutation`].
pub fn mutation() -> impl Strategy<Value = Mutation> {
    let ix = any::<usize>;
    prop_oneof![
        (ix(), 1u8..).prop_map(|(i, m)| Mutation::Flip(i, m)),
        (ix(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        ix().prop_map(Mutation::Truncate),
        (ix(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (ix(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (ix(), claim()).prop_map(|(i, v)| Mutation::Varint(i, v)),
        (ix(), claim()).prop_map(|(i, v)| Mutation::Inflate(i, v)),
    ]
}

/// Applies `m` to `bytes`.
pub fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let at = |i: &usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::Flip(i, x) if !bytes.is_empty() => {
            let k = at(i, bytes.len());
            bytes[k] ^= x;
        }
        Mutation::Set(i, b) if !bytes.is_empty() => {
            let k = at(i, bytes.len());
            bytes[k] = *b;
        }
        Mutation::Truncate(i) => bytes.truncate(at(i, bytes.len() + 1)),
        Mutation::Insert(i, b) => {
            let k = at(i, bytes.len() + 1);
            bytes.splice(k..k, b.iter().copied());
        }
        Mutation::Remove(i, n) if !bytes.is_empty() => {
            let k = at(i, bytes.len());
            let end = (k + n).min(bytes.len());
            bytes.drain(k..end);
        }
        Mutation::Varint(i, v) => {
            let k = at(i, bytes.len() + 1);
            bytes.splice(k..k, varint(*v));
        }
        Mutation::Inflate(i, v) if !bytes.is_empty() => {
            let k = at(i, bytes.len());
            bytes.splice(k..=k, varint(*v));
        }
        _ => {}
    }
}

/// `valid` with one to four [`Mutation`]s applied.
pub fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(mutation(), 1..5).prop_map(move |ms| {
        let mut b = valid.clone();
        for m in &ms {
            apply(&mut b, m);
        }
        b
    })
}

thread_local! {
    /// Bytes this thread has allocated and not freed (frees of memory
    /// allocated elsewhere count too: only differences are meaningful).
    static LIVE: Cell<isize> = const { Cell::new(0) };
    /// The most `LIVE` reached since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|l| {
        let now = l.get().saturating_add(delta);
        l.set(now);
        let _ = PEAK.try_with(|p| {
            if now > p.get() {
                p.set(now);
            }
        });
    });
}

/// A global allocator that forwards to the system allocator and counts,
/// per thread, the bytes allocated and not yet freed, so that
/// [`peak_during`] can tell how much a decode allocated. Install it in a
/// test binary:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: weft_testkit::fuzz::TrackingAlloc = weft_testkit::fuzz::TrackingAlloc;
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct TrackingAlloc;

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged (so `System`'s guarantees hold) and only updates thread-local
// counters, which neither allocate nor unwind.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        // SAFETY: forwarded unchanged (see the impl's comment).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(-(layout.size() as isize));
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size as isize - layout.size() as isize);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `f` and returns its result with the most bytes it had allocated
/// (and not freed) at any one time on this thread. Meaningful only in a
/// binary whose global allocator is [`TrackingAlloc`] (0 otherwise).
pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, usize::try_from(peak - base).unwrap_or(0))
}

/// Whether this binary's global allocator is [`TrackingAlloc`] (an
/// allocation shows up in [`peak_during`]).
pub fn tracking() -> bool {
    let (_, peak) = peak_during(|| std::hint::black_box(vec![0u8; 64]));
    peak >= 64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_match_postcard() {
        for v in [0u64, 1, 127, 128, 300, 1 << 60, u64::MAX] {
            let mut want = postcard_varint(v);
            assert_eq!(varint(v), want);
            want.clear();
        }
    }

    /// LEB128 as postcard writes it (7 bits per byte, low first).
    fn postcard_varint(v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut v = v;
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
        out
    }

    #[test]
    fn mutations_stay_in_bounds() {
        let mut b = Vec::new();
        let i = 7usize;
        for m in [
            Mutation::Flip(i, 1),
            Mutation::Set(i, 1),
            Mutation::Remove(i, 3),
            Mutation::Inflate(i, 5),
            Mutation::Truncate(i),
            Mutation::Varint(i, 1 << 60),
            Mutation::Insert(i, vec![1, 2]),
            Mutation::Flip(i, 1),
            Mutation::Remove(i, 30),
        ] {
            apply(&mut b, &m);
        }
    }
}
