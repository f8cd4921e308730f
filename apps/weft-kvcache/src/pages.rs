//! Page allocation: the decoder's free pages and tail slots, and the leases
//! that hold them. A lease's pages return to the pool only when no request
//! that may still write them is in flight.

use crate::KvError;
use std::collections::{BTreeMap, BTreeSet};

/// Pages (and one tail slot) taken from a decoder's cache for one prompt.
/// Owned by the application between [`Decoder::alloc`](crate::Decoder::alloc)
/// and [`Decoder::free`](crate::Decoder::free).
#[derive(Debug, PartialEq, Eq)]
pub struct PageLease {
    pub(crate) id: u64,
    pages: Vec<u32>,
    tail_slot: u32,
}

impl PageLease {
    /// Lease id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Page indices (per head), in prompt order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// The tail slot.
    pub fn tail_slot(&self) -> u32 {
        self.tail_slot
    }
}

#[derive(Debug)]
struct Held {
    pages: Vec<u32>,
    tail_slot: u32,
    /// The request in flight on these pages.
    active: Option<u64>,
    /// Freed by the application while a request was in flight: return the
    /// pages once it ends.
    freed: bool,
}

/// Free pages and tail slots, and the leases holding the others.
#[derive(Debug)]
pub struct PagePool {
    free_pages: BTreeSet<u32>,
    free_tails: BTreeSet<u32>,
    tail_slots: u32,
    held: BTreeMap<u64, Held>,
    next: u64,
}

impl PagePool {
    /// A pool of `pages` pages and `tail_slots` tail slots, all free.
    pub fn new(pages: u32, tail_slots: u32) -> Self {
        Self {
            free_pages: (0..pages).collect(),
            free_tails: (0..tail_slots.max(1)).collect(),
            tail_slots: tail_slots.max(1),
            held: BTreeMap::new(),
            next: 1,
        }
    }

    /// Free pages now.
    pub fn free_pages(&self) -> u32 {
        u32::try_from(self.free_pages.len()).unwrap_or(u32::MAX)
    }

    /// Whether page `p` is free (not held by any lease).
    pub fn is_free(&self, p: u32) -> bool {
        self.free_pages.contains(&p)
    }

    /// Takes `n` pages (lowest first) and a tail slot.
    pub fn alloc(&mut self, n: u32) -> Result<PageLease, KvError> {
        let free = self.free_pages();
        if n == 0 || n > free {
            return Err(KvError::NoPages { need: n, free });
        }
        let tail_slot = self.free_tails.pop_first().ok_or(KvError::NoTailSlot {
            slots: self.tail_slots,
        })?;
        let pages: Vec<u32> = (0..n).filter_map(|_| self.free_pages.pop_first()).collect();
        let id = self.next;
        self.next += 1;
        self.held.insert(
            id,
            Held {
                pages: pages.clone(),
                tail_slot,
                active: None,
                freed: false,
            },
        );
        Ok(PageLease {
            id,
            pages,
            tail_slot,
        })
    }

    /// Marks `lease` busy with `request`.
    pub fn start(&mut self, lease: u64, request: u64) -> Result<(), KvError> {
        let h = self
            .held
            .get_mut(&lease)
            .filter(|h| !h.freed)
            .ok_or(KvError::UnknownLease { lease })?;
        if let Some(r) = h.active {
            return Err(KvError::LeaseBusy { lease, request: r });
        }
        h.active = Some(request);
        Ok(())
    }

    /// The request on `lease` ended (no write of it can land any more).
    pub fn end(&mut self, lease: u64) {
        let done = match self.held.get_mut(&lease) {
            Some(h) => {
                h.active = None;
                h.freed
            }
            None => false,
        };
        if done {
            self.give_back(lease);
        }
    }

    /// The application frees `lease`: its pages return now, or when its
    /// request in flight ends. Returns the request still in flight.
    pub fn free(&mut self, lease: PageLease) -> Option<u64> {
        let active = match self.held.get_mut(&lease.id) {
            Some(h) => {
                h.freed = true;
                h.active
            }
            None => return None,
        };
        if active.is_none() {
            self.give_back(lease.id);
        }
        active
    }

    fn give_back(&mut self, lease: u64) {
        if let Some(h) = self.held.remove(&lease) {
            self.free_pages.extend(h.pages);
            self.free_tails.insert(h.tail_slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_return_only_when_the_request_ended() {
        let mut p = PagePool::new(8, 2);
        let a = p.alloc(3).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        let b = p.alloc(5).unwrap();
        assert!(matches!(
            p.alloc(1),
            Err(KvError::NoPages { need: 1, free: 0 })
        ));
        p.start(a.id(), 10).unwrap();
        assert!(matches!(
            p.start(a.id(), 11),
            Err(KvError::LeaseBusy { request: 10, .. })
        ));
        let aid = a.id();
        assert_eq!(p.free(a), Some(10));
        assert_eq!(p.free_pages(), 0, "still in flight");
        p.end(aid);
        assert_eq!(p.free_pages(), 3);
        assert!(matches!(
            p.start(aid, 12),
            Err(KvError::UnknownLease { .. })
        ));
        assert_eq!(p.free(b), None);
        assert_eq!(p.free_pages(), 8);
        let c = p.alloc(1).unwrap();
        let _d = p.alloc(1).unwrap();
        assert!(matches!(p.alloc(1), Err(KvError::NoTailSlot { slots: 2 })));
        p.free(c);
        assert!(p.alloc(1).is_ok());
    }
}
