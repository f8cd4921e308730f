//! KvCache shape and the content a prompt's bytes must have.

use crate::buf::pattern;
use serde::{Deserialize, Serialize};
use weft_engine::Pages;

/// Shape of the KvCache (identical on both sides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers (one paged-write submit each).
    pub layers: u32,
    /// KV heads per layer on this rank.
    pub heads: u32,
    /// Bytes of one page of one head (e.g. 32 KiB in the paper).
    pub page_len: u64,
    /// Bytes of the tail (logits / hidden state), written last.
    pub tail_len: u64,
}

impl KvLayout {
    /// Bytes of one layer-head-page cube with `pages` pages, checked.
    pub fn kv_bytes(&self, pages: u32) -> Option<u64> {
        u64::from(self.layers)
            .checked_mul(u64::from(self.heads))?
            .checked_mul(u64::from(pages))?
            .checked_mul(self.page_len)
    }

    /// Offset of (layer, head, page) in a buffer of `num_pages` pages.
    pub fn offset(&self, num_pages: u32, layer: u32, head: u32, page: u32) -> Option<u64> {
        u64::from(layer)
            .checked_mul(u64::from(self.heads))?
            .checked_add(u64::from(head))?
            .checked_mul(u64::from(num_pages))?
            .checked_add(u64::from(page))?
            .checked_mul(self.page_len)
    }

    /// The paged-write page sets of `layer` for a request: prefiller source
    /// (a dense `[head][j]` cube of `pages.len()` pages) and decoder
    /// destination (`num_pages` pages per head).
    pub fn layer_pages(&self, layer: u32, pages: &[u32], num_pages: u32) -> Option<(Pages, Pages)> {
        let n = u32::try_from(pages.len()).ok()?;
        let mut si = Vec::with_capacity(pages.len() * self.heads as usize);
        let mut di = Vec::with_capacity(si.capacity());
        for h in 0..self.heads {
            for (j, &p) in pages.iter().enumerate() {
                if p >= num_pages {
                    return None;
                }
                si.push(h.checked_mul(n)?.checked_add(u32::try_from(j).ok()?)?);
                di.push(h.checked_mul(num_pages)?.checked_add(p)?);
            }
        }
        let src = Pages {
            indices: si,
            stride: self.page_len,
            offset: self.offset(n, layer, 0, 0)?,
        };
        let dst = Pages {
            indices: di,
            stride: self.page_len,
            offset: self.offset(num_pages, layer, 0, 0)?,
        };
        Some((src, dst))
    }
}

/// Expected content of KV byte `i` of page-slot `j` (the request's `j`-th
/// page), head `h`, layer `l` of a prompt with `seed`.
pub fn expected_kv_byte(seed: u64, l: u32, h: u32, j: u32, i: u64) -> u8 {
    let tag = seed ^ (u64::from(l) << 40) ^ (u64::from(h) << 20) ^ u64::from(j);
    pattern(tag, i)
}

/// Expected content of tail byte `i` of a prompt with `seed`.
pub fn expected_tail_byte(seed: u64, i: u64) -> u8 {
    pattern(seed ^ 0x7a11_0000_0000_0000, i)
}
