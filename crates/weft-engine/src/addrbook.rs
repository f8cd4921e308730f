//! The engine-wide [`AddrBook`]: the NIC addresses (with their
//! incarnation) of single and paged write destinations, interned into
//! small ids at submit, and the engine's [`Incarnations`] table.

use crate::incarnation::Incarnations;
use crate::MAX_NICS;
use weft_transport::{Incarnation, MrDesc, NetAddr};

/// A remote NIC address and the incarnation that answers there.
pub(crate) type Remote = (NetAddr, Incarnation);

/// The NIC addresses single and paged writes target, interned engine-wide
/// with their incarnation: a submit turns a descriptor's addresses into
/// small ids here ([`AddrBook::ids`]: one read lock and one look-up of the
/// descriptor's whole address list), so no descriptor is cloned into the
/// request queue; workers map ids to their peers and fetch the address
/// itself only the first time they meet an id (that is when its
/// incarnation is checked). Entries are never removed (one per distinct
/// remote NIC address and incarnation ever written to, one per distinct
/// address list, which holds only its addresses' ids).
#[derive(Debug, Default)]
pub(crate) struct AddrBook {
    index: parking_lot::RwLock<AddrIndex>,
    /// The live incarnation of each remote address and the removed ones.
    pub(crate) incs: Incarnations,
}

#[derive(Debug, Default)]
struct AddrIndex {
    /// Per address, the id of each incarnation seen there (a handful:
    /// one per restart), so a look-up allocates nothing.
    ids: std::collections::HashMap<NetAddr, Vec<(Incarnation, u32)>, AddrHash>,
    addrs: Vec<Remote>,
    /// Per hash of a descriptor's address list (every NIC's address in
    /// order, and the incarnation: [`AddrIndex::list_hash`]), the lists
    /// seen with that hash and their addresses' ids. A submit to an 8-NIC
    /// descriptor makes one look-up here instead of eight in `ids`.
    lists: std::collections::HashMap<u64, Vec<AddrList>, PreHashed>,
}

/// One distinct address list of [`AddrIndex::lists`]: the ids of its
/// addresses (each id names its address and incarnation in
/// [`AddrIndex::addrs`], which is how a hit is compared).
#[derive(Debug)]
struct AddrList {
    /// How many of `ids` are the list's.
    len: u8,
    /// The descriptor's incarnation (also that of each id's address; kept
    /// here so that an empty list too is one per incarnation).
    incarnation: Incarnation,
    ids: [u32; MAX_NICS],
}

/// The hasher of [`AddrIndex::lists`], whose keys are already hashes
/// (seeded [`AddrHasher`] output): passed through.
#[derive(Debug, Clone, Copy, Default)]
struct PreHashed;

impl std::hash::BuildHasher for PreHashed {
    type Hasher = PassThrough;
    fn build_hasher(&self) -> PassThrough {
        PassThrough(0)
    }
}

/// See [`PreHashed`].
#[derive(Debug, Clone, Copy)]
struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed with it; fold anything else in.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The hash of the [`AddrBook`]'s index: word at a time, each word
/// folded into the state by a 64×64→128-bit multiply with a per-book
/// random key, the two halves of the product XORed (the folded multiply
/// of foldhash and aHash's fallback), from a per-book random start.
/// SipHash was half the cost of interning a destination (210 of 396
/// instructions per single WRITE's submit, callgrind); addresses are a
/// few words long. The keys come from the process's `RandomState`, so
/// bucket placement is not known outside; the hash is not cryptographic,
/// and colliding addresses cost time only (every hit is compared in
/// full), never a wrong id. (The FxHash-style multiply-rotate used before
/// had collisions that held for every seed: flipping bit 63 of one word
/// and bit 25 of the next.)
#[derive(Debug, Clone, Copy)]
struct AddrHash {
    start: u64,
    key: u64,
}

impl Default for AddrHash {
    fn default() -> Self {
        use std::hash::BuildHasher;
        let r = std::collections::hash_map::RandomState::new();
        Self {
            start: r.hash_one(0x7765_6674_u64),
            // Odd: a multiply by it loses no bit of the other factor.
            key: r.hash_one(0x006b_6579_u64) | 1,
        }
    }
}

impl std::hash::BuildHasher for AddrHash {
    type Hasher = AddrHasher;
    fn build_hasher(&self) -> AddrHasher {
        AddrHasher {
            state: self.start,
            key: self.key,
        }
    }
}

/// See [`AddrHash`].
#[derive(Debug, Clone, Copy)]
struct AddrHasher {
    state: u64,
    key: u64,
}

impl AddrHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        let p = u128::from(self.state ^ w) * u128::from(self.key);
        self.state = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl std::hash::Hasher for AddrHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length in the top byte: "ab" and "ab\0" differ.
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}

impl AddrIndex {
    fn get(&self, addr: &NetAddr, inc: Incarnation) -> Option<u32> {
        self.ids
            .get(addr)?
            .iter()
            .find(|(i, _)| *i == inc)
            .map(|(_, id)| *id)
    }

    /// The hash of `dst`'s address list: its NIC count, each address with
    /// its length first (so that no two lists of other splits of the same
    /// bytes hash alike) and its incarnation, with the book's keys.
    fn list_hash(&self, dst: &MrDesc) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = self.ids.hasher().build_hasher();
        h.write_usize(dst.rkeys.len());
        for (addr, _) in &dst.rkeys {
            h.write_usize(addr.0.len());
            h.write(&addr.0);
        }
        h.write_u64(dst.incarnation.0);
        h.finish()
    }

    /// The ids of `dst`'s address list if seen before (`hash`: its
    /// [`AddrIndex::list_hash`]): a list of as many ids whose addresses are
    /// `dst`'s, in order, at `dst`'s incarnation.
    fn list(&self, hash: u64, dst: &MrDesc) -> Option<[u32; MAX_NICS]> {
        self.lists
            .get(&hash)?
            .iter()
            .find(|l| {
                usize::from(l.len) == dst.rkeys.len()
                    && l.incarnation == dst.incarnation
                    && l.ids.iter().zip(&dst.rkeys).all(|(&id, (a, _))| {
                        self.addrs
                            .get(id as usize)
                            .is_some_and(|(b, inc)| *inc == dst.incarnation && b == a)
                    })
            })
            .map(|l| l.ids)
    }

    /// Enters `dst`'s address list (at most [`MAX_NICS`] rkeys) under
    /// `hash`, interning its addresses; returns their ids.
    fn insert_list(&mut self, hash: u64, dst: &MrDesc) -> [u32; MAX_NICS] {
        let ids = self.intern_all(dst);
        let len = dst.rkeys.len().min(MAX_NICS) as u8;
        self.lists.entry(hash).or_default().push(AddrList {
            len,
            incarnation: dst.incarnation,
            ids,
        });
        ids
    }

    /// The ids of `dst`'s first [`MAX_NICS`] addresses (at its
    /// incarnation), by NIC, each entered on first sight; the rest 0.
    fn intern_all(&mut self, dst: &MrDesc) -> [u32; MAX_NICS] {
        let mut ids = [0u32; MAX_NICS];
        for (slot, (addr, _)) in ids.iter_mut().zip(&dst.rkeys) {
            *slot = self.intern(addr, dst.incarnation);
        }
        ids
    }

    /// The id of `addr` at incarnation `inc`, entered on first sight.
    fn intern(&mut self, addr: &NetAddr, inc: Incarnation) -> u32 {
        if let Some(id) = self.get(addr, inc) {
            return id;
        }
        let id = self.addrs.len() as u32;
        self.addrs.push((addr.clone(), inc));
        self.ids.entry(addr.clone()).or_default().push((inc, id));
        id
    }
}

impl AddrBook {
    /// The id of `addr` at incarnation `inc`, entered on first sight.
    #[cfg(test)]
    fn id(&self, addr: &NetAddr, inc: Incarnation) -> u32 {
        if let Some(id) = self.index.read().get(addr, inc) {
            return id;
        }
        self.index.write().intern(addr, inc)
    }

    /// The ids of `dst`'s NIC addresses (at its incarnation), by NIC; those
    /// past its rkey count are 0. Entered on first sight, address by
    /// address and as a list. Only the first [`MAX_NICS`] addresses are
    /// read (callers refuse wider descriptors first, `DstKeys::of`); a
    /// wider descriptor's list is not kept.
    pub(crate) fn ids(&self, dst: &MrDesc) -> [u32; MAX_NICS] {
        if dst.rkeys.len() > MAX_NICS {
            return self.index.write().intern_all(dst);
        }
        let hash = {
            let ix = self.index.read();
            let hash = ix.list_hash(dst);
            if let Some(ids) = ix.list(hash, dst) {
                return ids;
            }
            hash
        };
        let mut ix = self.index.write();
        match ix.list(hash, dst) {
            Some(ids) => ids,
            None => ix.insert_list(hash, dst),
        }
    }

    /// The address and incarnation of `id`.
    pub(crate) fn addr(&self, id: u32) -> Option<Remote> {
        self.index.read().addrs.get(id as usize).cloned()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::request::PlainDst;
    use weft_transport::Rkey;

    /// A 2-byte NIC address made of `b` (shared with `request`'s tests).
    pub(crate) fn addr(b: u8) -> NetAddr {
        NetAddr(vec![b, b])
    }

    /// The incarnation of [`desc`]'s descriptors.
    pub(crate) const INC: Incarnation = Incarnation(9);

    /// A descriptor with one rkey per address of `addrs` ([`addr`]), rkey
    /// `100 + b`, at incarnation [`INC`].
    pub(crate) fn desc(addrs: &[u8]) -> MrDesc {
        MrDesc {
            addr: 0x1000,
            len: 64,
            rkeys: addrs
                .iter()
                .map(|&b| (addr(b), Rkey(u64::from(b) + 100)))
                .collect(),
            incarnation: INC,
        }
    }

    /// One id per distinct address and incarnation, stable, and back to
    /// both; a plain destination keeps every NIC's rkey and address in
    /// order.
    #[test]
    fn addr_book_interns_descriptor_addresses() {
        let book = AddrBook::default();
        let (a, b) = (book.id(&addr(1), INC), book.id(&addr(2), INC));
        assert_ne!(a, b);
        assert_eq!(book.id(&addr(1), INC), a);
        let restarted = book.id(&addr(1), Incarnation(10));
        assert!(
            restarted != a && restarted != b,
            "same address, new incarnation"
        );
        assert_eq!(book.id(&addr(1), Incarnation(10)), restarted);
        assert_eq!(book.addr(a), Some((addr(1), INC)));
        assert_eq!(book.addr(b), Some((addr(2), INC)));
        assert_eq!(book.addr(restarted), Some((addr(1), Incarnation(10))));
        assert_eq!(book.addr(99), None);
        let d = desc(&[2, 3, 1]);
        let p = PlainDst::new(&d, &book).expect("3 nics fit");
        assert_eq!(
            (p.keys.base, p.keys.region_len, p.keys.nics),
            (d.addr, d.len, 3)
        );
        for (nic, (na, rk)) in d.rkeys.iter().enumerate() {
            assert_eq!(p.keys.rkeys[nic], *rk);
            assert_eq!(book.addr(p.addrs[nic]), Some((na.clone(), INC)));
        }
        assert_eq!(p.addrs[2], a, "a known address keeps its id");
        let wide: Vec<u8> = (0..=MAX_NICS as u8).collect();
        assert!(PlainDst::new(&desc(&wide), &book).is_none());
    }

    /// Thousands of addresses of every length from 0 to 40 bytes, many
    /// differing only in trailing zeros or one byte: each gets its own
    /// id, kept on a second look-up, and maps back to itself.
    #[test]
    fn addr_book_keeps_addresses_apart() {
        let book = AddrBook::default();
        let addrs: Vec<NetAddr> = (0..41usize)
            .flat_map(|len| {
                (0..64u8).map(move |b| {
                    let mut v = vec![0u8; len];
                    if let Some(x) = v.get_mut(len / 2) {
                        *x = b;
                    }
                    NetAddr(v)
                })
            })
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let ids: Vec<u32> = addrs.iter().map(|a| book.id(a, INC)).collect();
        let distinct: std::collections::BTreeSet<u32> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), addrs.len());
        for (a, id) in addrs.iter().zip(&ids) {
            assert_eq!(book.id(a, INC), *id);
            assert_eq!(book.addr(*id), Some((a.clone(), INC)));
        }
    }

    /// A descriptor's address list gets the ids its addresses get one by
    /// one, the same ids on every later look-up, whatever its region or
    /// rkeys; lists that differ in one address, in order, in length or in
    /// incarnation get their own ids, also when they collide in the list
    /// map's hash (all lists forced into one bucket).
    #[test]
    fn address_lists_map_to_their_addresses_ids() {
        let book = AddrBook::default();
        let lists: Vec<Vec<u8>> = vec![
            vec![1],
            vec![1, 2],
            vec![2, 1],
            vec![1, 2, 3],
            vec![1, 2, 4],
            (0..MAX_NICS as u8).collect(),
            vec![],
        ];
        let check = |book: &AddrBook| {
            for l in &lists {
                for inc in [INC, Incarnation(INC.0 + 1)] {
                    let mut d = desc(l);
                    d.incarnation = inc;
                    let ids = book.ids(&d);
                    for (nic, (a, _)) in d.rkeys.iter().enumerate() {
                        assert_eq!(ids[nic], book.id(a, inc), "{l:?} {inc:?} NIC {nic}");
                    }
                    assert!(ids[l.len()..].iter().all(|&x| x == 0), "{l:?}");
                    // Another region and other rkeys, same addresses.
                    d.addr += 4096;
                    for (_, k) in d.rkeys.iter_mut() {
                        k.0 += 1;
                    }
                    assert_eq!(book.ids(&d), ids, "{l:?} {inc:?}");
                }
            }
        };
        check(&book);
        check(&book);
        // Every list in one bucket (entered as `ids` enters a list): the
        // contents alone tell them apart.
        let one = AddrBook::default();
        {
            let mut ix = one.index.write();
            for l in &lists {
                for inc in [INC, Incarnation(INC.0 + 1)] {
                    let mut d = desc(l);
                    d.incarnation = inc;
                    assert_eq!(ix.list(7, &d), None, "{l:?} {inc:?} before");
                    ix.insert_list(7, &d);
                }
            }
            assert_eq!(ix.lists.len(), 1);
            for l in &lists {
                for inc in [INC, Incarnation(INC.0 + 1)] {
                    let mut d = desc(l);
                    d.incarnation = inc;
                    let want: Vec<u32> = d
                        .rkeys
                        .iter()
                        .map(|(a, _)| ix.get(a, inc).unwrap())
                        .collect();
                    let got = ix.list(7, &d).expect("in the bucket");
                    assert_eq!(&got[..l.len()], &want[..], "{l:?} {inc:?}");
                }
            }
            let mut other = desc(&[1, 2]);
            other.incarnation = Incarnation(INC.0 + 5);
            assert_eq!(ix.list(7, &other), None);
            assert_eq!(ix.list(7, &desc(&[3, 2])), None);
        }
    }

    /// Lists that split the same bytes into other addresses (an 8-byte
    /// address next to an empty one, either way round) hash apart.
    #[test]
    fn list_hash_tells_address_boundaries_apart() {
        let book = AddrBook::default();
        let ix = book.index.read();
        let list = |parts: &[&[u8]]| MrDesc {
            addr: 0,
            len: 0,
            rkeys: parts
                .iter()
                .map(|p| (NetAddr(p.to_vec()), Rkey(1)))
                .collect(),
            incarnation: INC,
        };
        let a8: &[u8] = b"abcdefgh";
        let splits = [
            list(&[a8, b""]),
            list(&[b"", a8]),
            list(&[b"abcd", b"efgh"]),
            list(&[b"abcdefgh\0", b""]),
            list(&[a8, b"", b""]),
        ];
        let hashes: std::collections::BTreeSet<u64> =
            splits.iter().map(|d| ix.list_hash(d)).collect();
        assert_eq!(hashes.len(), splits.len());
    }

    /// A descriptor wider than `MAX_NICS` gets its first addresses' ids and
    /// leaves no list behind.
    #[test]
    fn wide_descriptor_ids_without_a_list() {
        let book = AddrBook::default();
        let wide: Vec<u8> = (0..=MAX_NICS as u8).collect();
        let d = desc(&wide);
        let ids = book.ids(&d);
        for (nic, (a, _)) in d.rkeys.iter().take(MAX_NICS).enumerate() {
            assert_eq!(ids[nic], book.id(a, INC));
        }
        assert!(book.index.read().lists.is_empty());
    }

    /// Threads entering overlapping lists in different orders end up with
    /// the ids the addresses have one by one, every list once.
    #[test]
    fn concurrent_lists_agree() {
        let book = std::sync::Arc::new(AddrBook::default());
        let lists: Vec<Vec<u8>> = (0..24u8).map(|i| vec![i % 7, i % 5, i]).collect();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (book, lists) = (book.clone(), lists.clone());
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    for k in 0..lists.len() {
                        let l = &lists[(k * (t + 1) + t) % lists.len()];
                        seen.push((l.clone(), book.ids(&desc(l))));
                    }
                    seen
                })
            })
            .collect();
        for t in threads {
            for (l, ids) in t.join().expect("thread") {
                let want: Vec<u32> = l.iter().map(|&b| book.id(&addr(b), INC)).collect();
                assert_eq!(&ids[..3], &want[..], "{l:?}");
            }
        }
        let ix = book.index.read();
        let kept: usize = ix.lists.values().map(Vec::len).sum();
        assert_eq!(kept, lists.len(), "every list kept, once");
    }
}
