//! Layout maths: where page `p` of head `h` in layer `l` lives in a paged
//! KvCache, the page sets of one layer's paged write, and the number of
//! immediates a request produces.

use crate::KvError;
use serde::{Deserialize, Serialize};
use weft::{ImmCounts, Pages};

/// Order of heads and pages within one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum HeadOrder {
    /// `[layer][head][page]`: consecutive pages of one head are contiguous
    /// (the paper's layout).
    #[default]
    HeadsBeforePages,
    /// `[layer][page][head]`: the heads of one page are contiguous.
    PagesBeforeHeads,
}

/// Shape of one rank's paged KvCache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers (one paged-write submit each).
    pub layers: u32,
    /// KV heads per layer on this rank (1 for MLA's latent).
    pub kv_heads: u32,
    /// Bytes of one page of one head (e.g. 32 KiB: 128 tokens).
    pub page_len: u64,
    /// Bytes of a request's tail (logits / hidden state), written last; 0
    /// for none.
    pub tail_len: u64,
    /// Pages per head (the cache's capacity in pages).
    pub num_pages: u32,
    /// Tail slots (requests in flight at once, at most).
    pub tail_slots: u32,
    /// Order of heads and pages.
    pub order: HeadOrder,
}

fn overflow(what: &str) -> KvError {
    KvError::Layout {
        what: format!("{what} overflows"),
    }
}

impl KvLayout {
    /// Checks that the layout is usable: at least one layer, head and page,
    /// a non-zero page size and sizes that fit in `u64` and `usize`.
    pub fn validate(&self) -> Result<(), KvError> {
        if self.layers == 0 || self.kv_heads == 0 || self.num_pages == 0 || self.page_len == 0 {
            return Err(KvError::Layout {
                what: format!("layers, kv_heads, num_pages and page_len must be > 0: {self:?}"),
            });
        }
        if self.tail_len > 0 && self.tail_slots == 0 {
            return Err(KvError::Layout {
                what: "a tail needs tail slots".into(),
            });
        }
        let kv = self.kv_bytes()?;
        let tail = self.tail_bytes()?;
        usize::try_from(kv.max(tail)).map_err(|_| overflow("cache size"))?;
        Ok(())
    }

    /// Bytes of one layer.
    pub fn layer_bytes(&self) -> Result<u64, KvError> {
        u64::from(self.kv_heads)
            .checked_mul(u64::from(self.num_pages))
            .and_then(|x| x.checked_mul(self.page_len))
            .ok_or_else(|| overflow("layer size"))
    }

    /// Bytes of the whole KV region (all layers).
    pub fn kv_bytes(&self) -> Result<u64, KvError> {
        self.layer_bytes()?
            .checked_mul(u64::from(self.layers))
            .ok_or_else(|| overflow("kv size"))
    }

    /// Bytes of the tail region (all slots).
    pub fn tail_bytes(&self) -> Result<u64, KvError> {
        self.tail_len
            .checked_mul(u64::from(self.tail_slots))
            .ok_or_else(|| overflow("tail size"))
    }

    /// Index of (head, page) within a layer, in units of `page_len`.
    pub fn page_index(&self, head: u32, page: u32) -> Option<u32> {
        if head >= self.kv_heads || page >= self.num_pages {
            return None;
        }
        match self.order {
            HeadOrder::HeadsBeforePages => head.checked_mul(self.num_pages)?.checked_add(page),
            HeadOrder::PagesBeforeHeads => page.checked_mul(self.kv_heads)?.checked_add(head),
        }
    }

    /// Byte offset of (layer, head, page) in the KV region.
    pub fn offset(&self, layer: u32, head: u32, page: u32) -> Option<u64> {
        if layer >= self.layers {
            return None;
        }
        let idx = u64::from(self.page_index(head, page)?);
        u64::from(layer)
            .checked_mul(self.layer_bytes().ok()?)?
            .checked_add(idx.checked_mul(self.page_len)?)
    }

    /// Byte offset of tail slot `slot` in the tail region.
    pub fn tail_offset(&self, slot: u32) -> Option<u64> {
        (slot < self.tail_slots).then(|| u64::from(slot) * self.tail_len)
    }
}

/// One head of a transfer: head `src` of the prefill rank's cache goes to
/// head `dst` of the decode rank's cache (local indices on each rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeadMap {
    /// Head index on the prefill rank.
    pub src: u32,
    /// Head index on the decode rank.
    pub dst: u32,
}

/// The source and destination page sets of `layer` for a transfer of
/// `heads` with prompt pages `src_pages` (prefiller) → `dst_pages`
/// (decoder): one paged write of `heads.len() * pages` pages.
pub fn layer_pages(
    src: &KvLayout,
    dst: &KvLayout,
    layer: u32,
    heads: &[HeadMap],
    src_pages: &[u32],
    dst_pages: &[u32],
) -> Option<(Pages, Pages)> {
    if src_pages.len() != dst_pages.len() || layer >= src.layers || layer >= dst.layers {
        return None;
    }
    let n = heads.len().checked_mul(src_pages.len())?;
    let mut si = Vec::with_capacity(n);
    let mut di = Vec::with_capacity(n);
    for hm in heads {
        for (&sp, &dp) in src_pages.iter().zip(dst_pages) {
            si.push(src.page_index(hm.src, sp)?);
            di.push(dst.page_index(hm.dst, dp)?);
        }
    }
    let s = Pages {
        indices: si,
        stride: src.page_len,
        offset: u64::from(layer).checked_mul(src.layer_bytes().ok()?)?,
    };
    let d = Pages {
        indices: di,
        stride: dst.page_len,
        offset: u64::from(layer).checked_mul(dst.layer_bytes().ok()?)?,
    };
    Some((s, d))
}

/// Immediates one source's part of a request produces at the decoder: one
/// paged write per layer of `heads * pages` pages, plus the tail's single
/// write when `tail` (and the layout has one).
pub fn source_imm_count(
    counts: &ImmCounts,
    layout: &KvLayout,
    heads: u32,
    pages: u32,
    tail: bool,
) -> Result<u64, KvError> {
    let per_layer = counts.paged_writes(layout.page_len, u64::from(heads) * u64::from(pages));
    let mut total = per_layer
        .checked_mul(u64::from(layout.layers))
        .ok_or_else(|| overflow("immediate count"))?;
    if tail && layout.tail_len > 0 {
        total = total
            .checked_add(counts.single_write(layout.tail_len))
            .ok_or_else(|| overflow("immediate count"))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lay(order: HeadOrder) -> KvLayout {
        KvLayout {
            layers: 3,
            kv_heads: 2,
            page_len: 16,
            tail_len: 8,
            num_pages: 5,
            tail_slots: 2,
            order,
        }
    }

    #[test]
    fn offsets_cover_the_region_once() {
        for order in [HeadOrder::HeadsBeforePages, HeadOrder::PagesBeforeHeads] {
            let l = lay(order);
            let mut seen = std::collections::BTreeSet::new();
            for layer in 0..3 {
                for h in 0..2 {
                    for p in 0..5 {
                        let o = l.offset(layer, h, p).unwrap();
                        assert_eq!(o % 16, 0);
                        assert!(o + 16 <= l.kv_bytes().unwrap());
                        assert!(seen.insert(o), "{order:?} {layer} {h} {p}");
                    }
                }
            }
            assert_eq!(seen.len(), 30);
            assert_eq!(l.offset(3, 0, 0), None);
            assert_eq!(l.offset(0, 2, 0), None);
            assert_eq!(l.offset(0, 0, 5), None);
        }
        let hp = lay(HeadOrder::HeadsBeforePages);
        // consecutive pages of one head are contiguous
        assert_eq!(
            hp.offset(1, 1, 3).unwrap() + 16,
            hp.offset(1, 1, 4).unwrap()
        );
        let ph = lay(HeadOrder::PagesBeforeHeads);
        assert_eq!(
            ph.offset(1, 0, 3).unwrap() + 16,
            ph.offset(1, 1, 3).unwrap()
        );
    }

    #[test]
    fn layer_pages_pair_heads_and_pages() {
        let s = lay(HeadOrder::HeadsBeforePages);
        let d = KvLayout {
            kv_heads: 1,
            num_pages: 9,
            order: HeadOrder::PagesBeforeHeads,
            ..s
        };
        let heads = [HeadMap { src: 1, dst: 0 }];
        let (sp, dp) = layer_pages(&s, &d, 2, &heads, &[0, 4], &[8, 2]).unwrap();
        assert_eq!(sp.indices, vec![5, 9]);
        assert_eq!(dp.indices, vec![8, 2]);
        assert_eq!(sp.offset, 2 * 2 * 5 * 16);
        assert_eq!(dp.offset, 2 * 9 * 16);
        assert!(layer_pages(&s, &d, 2, &heads, &[0], &[9]).is_none());
        assert!(layer_pages(&s, &d, 3, &heads, &[0], &[1]).is_none());
        assert!(layer_pages(&s, &d, 0, &[HeadMap { src: 0, dst: 1 }], &[0], &[1]).is_none());
    }

    #[test]
    fn validate_refuses_empty_and_overflowing() {
        let l = lay(HeadOrder::HeadsBeforePages);
        assert!(l.validate().is_ok());
        assert!(KvLayout { layers: 0, ..l }.validate().is_err());
        assert!(KvLayout { tail_slots: 0, ..l }.validate().is_err());
        assert!(KvLayout {
            page_len: u64::MAX / 2,
            ..l
        }
        .validate()
        .is_err());
    }
}
