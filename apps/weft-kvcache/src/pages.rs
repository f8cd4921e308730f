//! Page allocation: the decoder's free pages and tail slots, and the leases
//! that hold them. A lease's pages return to the pool only when no request
//! that may still write them is in flight.
//!
//! A lease is bound to the pool that handed it out: every pool of the
//! process has an id of its own and each lease carries it, so a lease of
//! another decoder (whose ids count from 1 as well) is refused
//! ([`KvError::UnknownLease`], [`ForeignLease`]) instead of being taken
//! for this pool's lease of the same id. A request's pages are the pool's
//! record of the lease, never the caller's copy.

use crate::KvError;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

/// Ids of the pools of this process (a lease names its pool).
static NEXT_POOL: AtomicU64 = AtomicU64::new(1);

/// A lease handed to a pool (or decoder) that did not hand it out; the
/// lease comes back unchanged, for its own decoder.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("page lease {} belongs to another decoder", .0.id)]
pub struct ForeignLease(pub PageLease);

/// Pages (and one tail slot) taken from a decoder's cache for one prompt.
/// Owned by the application between [`Decoder::alloc`](crate::Decoder::alloc)
/// and [`Decoder::free`](crate::Decoder::free). A copy is as good as the
/// original and no better: the pool's record decides what a lease holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageLease {
    /// The pool that handed it out.
    pool: u64,
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

#[derive(Debug, Clone)]
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
#[derive(Debug, Clone)]
pub struct PagePool {
    /// This pool's id (process-unique).
    id: u64,
    free_pages: BTreeSet<u32>,
    free_tails: BTreeSet<u32>,
    /// Tail slots of the cache; 0: the cache has no tail, and leases take
    /// none (their slot reads 0).
    tail_slots: u32,
    held: BTreeMap<u64, Held>,
    next: u64,
}

impl PagePool {
    /// A pool of `pages` pages and `tail_slots` tail slots, all free (no
    /// tail slots: leases take none).
    pub fn new(pages: u32, tail_slots: u32) -> Self {
        Self {
            id: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            free_pages: (0..pages).collect(),
            free_tails: (0..tail_slots).collect(),
            tail_slots,
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
        let tail_slot = self.take_tail()?;
        let pages: Vec<u32> = (0..n).filter_map(|_| self.free_pages.pop_first()).collect();
        Ok(self.hold(pages, tail_slot))
    }

    /// Takes exactly `pages` (in this order: a serving stack's own block
    /// ids) and a tail slot. Each page must be in range, free and named
    /// once; otherwise nothing is taken ([`KvError::PageTaken`]).
    pub fn alloc_pages(&mut self, pages: &[u32]) -> Result<PageLease, KvError> {
        if pages.is_empty() {
            return Err(KvError::NoPages {
                need: 0,
                free: self.free_pages(),
            });
        }
        let mut seen = BTreeSet::new();
        for &p in pages {
            if !seen.insert(p) {
                return Err(KvError::PageTaken {
                    page: p,
                    why: "named twice".into(),
                });
            }
            if !self.free_pages.contains(&p) {
                let why = match self.holder(p) {
                    Some(l) => format!("held by lease {l}"),
                    None => "out of range".into(),
                };
                return Err(KvError::PageTaken { page: p, why });
            }
        }
        let tail_slot = self.take_tail()?;
        for p in pages {
            self.free_pages.remove(p);
        }
        Ok(self.hold(pages.to_vec(), tail_slot))
    }

    fn take_tail(&mut self) -> Result<u32, KvError> {
        if self.tail_slots == 0 {
            return Ok(0);
        }
        self.free_tails.pop_first().ok_or(KvError::NoTailSlot {
            slots: self.tail_slots,
        })
    }

    fn hold(&mut self, pages: Vec<u32>, tail_slot: u32) -> PageLease {
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
        PageLease {
            pool: self.id,
            id,
            pages,
            tail_slot,
        }
    }

    /// Whether `lease` was handed out by this pool.
    pub fn owns(&self, lease: &PageLease) -> bool {
        lease.pool == self.id
    }

    /// The pool that holds page `p` for a lease: that lease's id.
    pub fn holder(&self, p: u32) -> Option<u64> {
        self.held
            .iter()
            .find(|(_, h)| h.pages.contains(&p))
            .map(|(&id, _)| id)
    }

    /// Marks `lease` busy with `request`; returns the lease's pages and
    /// tail slot as this pool holds them. A lease of another pool, or one
    /// already freed, is [`KvError::UnknownLease`].
    pub fn start(&mut self, lease: &PageLease, request: u64) -> Result<(&[u32], u32), KvError> {
        let id = lease.id;
        let h = self
            .held
            .get_mut(&id)
            .filter(|h| !h.freed && lease.pool == self.id)
            .ok_or(KvError::UnknownLease { lease: id })?;
        if let Some(r) = h.active {
            return Err(KvError::LeaseBusy {
                lease: id,
                request: r,
            });
        }
        h.active = Some(request);
        Ok((&h.pages, h.tail_slot))
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
    /// request in flight ends. Returns the request still in flight; a lease
    /// of another pool comes back as [`ForeignLease`], this pool untouched.
    pub fn free(&mut self, lease: PageLease) -> Result<Option<u64>, ForeignLease> {
        if lease.pool != self.id {
            return Err(ForeignLease(lease));
        }
        let active = match self.held.get_mut(&lease.id) {
            Some(h) => {
                h.freed = true;
                h.active
            }
            None => return Ok(None),
        };
        if active.is_none() {
            self.give_back(lease.id);
        }
        Ok(active)
    }

    fn give_back(&mut self, lease: u64) {
        if let Some(h) = self.held.remove(&lease) {
            self.free_pages.extend(h.pages);
            if self.tail_slots > 0 {
                self.free_tails.insert(h.tail_slot);
            }
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
        assert_eq!(p.start(&a, 10).unwrap(), (&[0, 1, 2][..], 0));
        assert!(matches!(
            p.start(&a, 11),
            Err(KvError::LeaseBusy { request: 10, .. })
        ));
        let aid = a.id();
        let again = PageLease {
            pool: a.pool,
            id: aid,
            pages: Vec::new(),
            tail_slot: 0,
        };
        assert_eq!(p.free(a), Ok(Some(10)));
        assert_eq!(p.free_pages(), 0, "still in flight");
        p.end(aid);
        assert_eq!(p.free_pages(), 3);
        assert!(matches!(
            p.start(&again, 12),
            Err(KvError::UnknownLease { .. })
        ));
        assert_eq!(p.free(b), Ok(None));
        assert_eq!(p.free_pages(), 8);
        let c = p.alloc(1).unwrap();
        let _d = p.alloc(1).unwrap();
        assert!(matches!(p.alloc(1), Err(KvError::NoTailSlot { slots: 2 })));
        p.free(c).unwrap();
        assert!(p.alloc(1).is_ok());
    }

    #[test]
    fn pages_by_index_are_taken_only_when_all_are_free() {
        let mut p = PagePool::new(8, 0);
        let a = p.alloc_pages(&[5, 2, 7]).unwrap();
        assert_eq!(a.pages(), &[5, 2, 7], "in the caller's order");
        for bad in [&[1, 1][..], &[1, 2], &[8], &[]] {
            assert!(p.alloc_pages(bad).is_err(), "{bad:?}");
        }
        assert_eq!(p.free_pages(), 5, "a refusal takes nothing");
        // no tail slots: any number of leases at once
        let b = p.alloc_pages(&[0]).unwrap();
        let c = p.alloc(2).unwrap();
        assert_eq!(c.pages(), &[1, 3]);
        assert_eq!(p.start(&b, 1).unwrap(), (&[0][..], 0));
        p.free(a).unwrap();
        assert!(p.alloc_pages(&[2, 5, 7]).is_ok());
        assert!(matches!(
            p.alloc_pages(&[0]),
            Err(KvError::PageTaken { page: 0, .. })
        ));
    }

    #[test]
    fn a_lease_of_another_pool_is_refused() {
        let mut a = PagePool::new(4, 1);
        let mut b = PagePool::new(4, 1);
        let mine = b.alloc(1).unwrap();
        let theirs = a.alloc(3).unwrap();
        assert_eq!(mine.id(), theirs.id());
        assert!(!b.owns(&theirs) && b.owns(&mine));
        assert!(matches!(
            b.start(&theirs, 1),
            Err(KvError::UnknownLease { .. })
        ));
        let back = b.free(theirs).unwrap_err().0;
        assert_eq!(b.free_pages(), 3, "b's own lease 1 is still held");
        assert_eq!(a.free(back), Ok(None));
        assert_eq!(a.free_pages(), 4);
    }
}
