//! Registrations: the domain's own ([`Keys`], keyed by a key that is both
//! its lkey and rkey) and the table it publishes to peers for memory they
//! may map and write one-sidedly ([`Published`], read by peers through
//! [`RemoteKeys`]). A key names its table slot in its low bits, so a peer
//! finds an entry without searching; keys start at a random point per
//! domain, so another domain's or process's key is unknown here.

#![allow(unsafe_code)]

use crate::sys::Mapping;
use std::collections::BTreeMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use weft_transport::{Access, Device, Exported};

/// Slots of the published table.
pub(crate) const SLOTS: usize = 1024;
const SLOT_BYTES: usize = 256;
const DESC_AT: usize = 48;
/// Longest export description a slot holds.
pub(crate) const MAX_DESC: usize = SLOT_BYTES - DESC_AT;
/// Bytes of the published table.
pub(crate) const TABLE_BYTES: usize = SLOTS * SLOT_BYTES;
const SLOT_BITS: u32 = 12;
const NO_SLOT: u64 = (1 << SLOT_BITS) - 1;

/// One registration of this domain.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) device: Device,
    /// Held while peers may map the region.
    _export: Option<Exported>,
}

impl Region {
    /// Whether `[addr, addr+len)` lies inside the region.
    pub(crate) fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}

/// The domain's registrations and its published table.
pub(crate) struct Keys {
    regions: BTreeMap<u64, Region>,
    next: u64,
    table: Mapping,
    free: Vec<usize>,
}

impl Keys {
    pub(crate) fn new(table: Mapping, seed: u64) -> Keys {
        Keys {
            regions: BTreeMap::new(),
            next: (seed & ((1 << 40) - 1)) | 1,
            table,
            free: (0..SLOTS).rev().collect(),
        }
    }

    /// The published table's descriptor (sent to peers).
    pub(crate) fn table_fd(&self) -> std::os::fd::RawFd {
        self.table.fd()
    }

    /// Adds a registration; `export` (when given and a slot is free) is
    /// published for peers to map. Returns its key.
    pub(crate) fn insert(
        &mut self,
        base: u64,
        len: u64,
        access: Access,
        device: Device,
        export: Option<Exported>,
    ) -> u64 {
        let n = self.next;
        self.next += 1;
        let slot = match &export {
            Some(e) if e.desc.len() <= MAX_DESC => self.free.pop(),
            _ => None,
        };
        let key = n << SLOT_BITS | slot.map_or(NO_SLOT, |s| s as u64);
        if let (Some(s), Some(e)) = (slot, &export) {
            let writable = matches!(access, Access::RemoteWrite);
            self.slot(s).publish(key, base, len, writable, &e.desc);
        }
        let export = slot.and(export);
        self.regions.insert(
            key,
            Region {
                base,
                len,
                access,
                device,
                _export: export,
            },
        );
        key
    }

    /// Removes a registration (withdrawn from the table first).
    pub(crate) fn remove(&mut self, key: u64) -> Option<Region> {
        let r = self.regions.remove(&key)?;
        let s = (key & NO_SLOT) as usize;
        if s < SLOTS {
            self.slot(s).revoke();
            self.free.push(s);
        }
        Some(r)
    }

    pub(crate) fn get(&self, key: u64) -> Option<&Region> {
        self.regions.get(&key)
    }

    fn slot(&self, s: usize) -> Slot<'_> {
        Slot {
            // SAFETY: `s < SLOTS`, inside the table mapping.
            base: unsafe { self.table.base().add(s * SLOT_BYTES) },
            _m: std::marker::PhantomData,
        }
    }
}

/// One slot of a published table (either side's view).
struct Slot<'a> {
    base: *mut u8,
    _m: std::marker::PhantomData<&'a Mapping>,
}

impl Slot<'_> {
    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: `i < 6`, 8-aligned words inside the 256-byte slot.
        unsafe { &*(self.base.add(i * 8) as *const AtomicU64) }
    }

    /// Writes an entry (seqlock: odd while changing).
    fn publish(&self, key: u64, base: u64, len: u64, writable: bool, desc: &[u8]) {
        let seq = self.word(0);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.word(1).store(key, Ordering::Relaxed);
        self.word(2).store(base, Ordering::Relaxed);
        self.word(3).store(len, Ordering::Relaxed);
        self.word(4).store(
            writable as u64 | (desc.len() as u64) << 32,
            Ordering::Relaxed,
        );
        // SAFETY: `desc` fits the slot (checked by the caller); peers only
        // read these bytes and discard them unless the sequence held.
        unsafe { std::ptr::copy_nonoverlapping(desc.as_ptr(), self.base.add(DESC_AT), desc.len()) };
        seq.store((s | 1) + 1, Ordering::Release);
    }

    fn revoke(&self) {
        let seq = self.word(0);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.word(1).store(0, Ordering::Relaxed);
        seq.store((s | 1) + 1, Ordering::SeqCst);
    }
}

/// A peer's entry for one key, as read from its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) writable: bool,
    pub(crate) desc: Vec<u8>,
}

/// A peer's published table, mapped read-mostly.
pub(crate) struct RemoteKeys {
    map: Mapping,
}

impl RemoteKeys {
    pub(crate) fn new(map: Mapping) -> RemoteKeys {
        RemoteKeys { map }
    }

    /// The peer's entry for `key`, `None` when it publishes none (memory
    /// it does not let peers map, or an unknown key: the peer then checks
    /// the write itself).
    pub(crate) fn lookup(&self, key: u64) -> Option<Entry> {
        let s = (key & NO_SLOT) as usize;
        if s >= SLOTS {
            return None;
        }
        let slot = Slot {
            // SAFETY: `s < SLOTS`, inside the mapping.
            base: unsafe { self.map.base().add(s * SLOT_BYTES) },
            _m: std::marker::PhantomData,
        };
        for _ in 0..64 {
            let s0 = slot.word(0).load(Ordering::Acquire);
            if s0 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let k = slot.word(1).load(Ordering::Relaxed);
            let base = slot.word(2).load(Ordering::Relaxed);
            let len = slot.word(3).load(Ordering::Relaxed);
            let w = slot.word(4).load(Ordering::Relaxed);
            let dlen = ((w >> 32) as usize).min(MAX_DESC);
            let mut desc = vec![0u8; dlen];
            // SAFETY: `dlen ≤ MAX_DESC`, inside the slot; a torn read is
            // discarded by the sequence check below.
            unsafe {
                std::ptr::copy_nonoverlapping(slot.base.add(DESC_AT), desc.as_mut_ptr(), dlen)
            };
            fence(Ordering::Acquire);
            if slot.word(0).load(Ordering::Relaxed) != s0 {
                continue;
            }
            return (k == key).then_some(Entry {
                base,
                len,
                writable: w & 1 == 1,
                desc,
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> (Keys, RemoteKeys) {
        let m = Mapping::create("t", TABLE_BYTES).unwrap();
        // SAFETY: the mapping's descriptor is open for the whole test.
        #[allow(unsafe_code)]
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(m.fd()) }
            .try_clone_to_owned()
            .unwrap();
        let r = RemoteKeys::new(Mapping::open(fd, TABLE_BYTES).unwrap());
        (Keys::new(m, 0x1234_5678_9abc), r)
    }

    fn exp(d: &[u8]) -> Option<Exported> {
        Some(Exported {
            desc: d.to_vec(),
            keep: Box::new(()),
        })
    }

    #[test]
    fn published_entries_are_seen_and_withdrawn() {
        let (mut k, r) = keys();
        let a = k.insert(4096, 100, Access::RemoteWrite, Device::Host, exp(b"abc"));
        let b = k.insert(8192, 10, Access::LocalOnly, Device::Host, exp(b"xyz"));
        let c = k.insert(9000, 10, Access::RemoteWrite, Device::Host, None);
        let e = r.lookup(a).unwrap();
        assert_eq!(
            (e.base, e.len, e.writable, &e.desc[..]),
            (4096, 100, true, &b"abc"[..])
        );
        assert!(!r.lookup(b).unwrap().writable);
        assert_eq!(r.lookup(c), None, "unexported memory is not published");
        assert_eq!(
            r.lookup(a ^ (1 << 20)),
            None,
            "a forged key naming a used slot"
        );
        k.remove(a).unwrap();
        assert_eq!(r.lookup(a), None);
        assert!(k.get(a).is_none() && k.get(b).is_some());
        let d = k.insert(1, 1, Access::RemoteWrite, Device::Host, exp(b"d"));
        assert_ne!(d, a, "keys are never reused");
        assert_eq!(r.lookup(a), None);
    }

    #[test]
    fn region_bounds() {
        let (mut k, _) = keys();
        let a = k.insert(100, 10, Access::RemoteWrite, Device::Host, None);
        let r = k.get(a).unwrap();
        assert!(r.holds(100, 10) && r.holds(110, 0) && !r.holds(99, 1) && !r.holds(105, 6));
        assert!(!r.holds(u64::MAX, 2));
    }
}
