//! The checks a request passes before a prefiller takes it.

use crate::wire::KvRequest;
use crate::{KvLayout, Refusal};
use weft::Incarnation;

/// Why a prefiller of cache `me` refuses `req` from the (authenticated)
/// decoder of incarnation `from`, if it does: regions of another engine,
/// layouts that do not fit, heads or pages out of range or without a page
/// index, a decoder head written twice.
pub(super) fn refusal(me: &KvLayout, req: &KvRequest, from: Incarnation) -> Option<Refusal> {
    // The regions written must be the decoder's own: a decoder handing
    // over another engine's descriptor would make this prefiller write a
    // prompt into a third party's memory.
    if let Some(d) = req
        .kv
        .iter()
        .chain(&req.tail)
        .find(|d| d.incarnation != from)
    {
        return Some(Refusal::BadPages {
            what: format!(
                "a region of incarnation {:?}, not the decoder's ({from:?})",
                d.incarnation
            ),
        });
    }
    let d = &req.layout;
    if d.layers != me.layers || d.page_len != me.page_len {
        return Some(Refusal::LayoutMismatch {
            what: format!(
                "decoder {} layers of {} B pages, prefiller {} of {} B",
                d.layers, d.page_len, me.layers, me.page_len
            ),
        });
    }
    if req.kv.len() != 1 && req.kv.len() as u64 != u64::from(d.layers) {
        return Some(Refusal::LayoutMismatch {
            what: format!(
                "{} decoder KV regions for {} layers",
                req.kv.len(),
                d.layers
            ),
        });
    }
    if req.tail_slot.is_some() && req.tail.is_none() {
        return Some(Refusal::BadPages {
            what: "a tail slot without a tail region".into(),
        });
    }
    if req.tail_slot.is_some() && d.tail_len != me.tail_len {
        return Some(Refusal::LayoutMismatch {
            what: format!("tail {} B vs {} B", d.tail_len, me.tail_len),
        });
    }
    for hm in &req.heads {
        if hm.src >= me.kv_heads {
            return Some(Refusal::HeadOutOfRange {
                head: hm.src,
                heads: me.kv_heads,
                side: "prefill".into(),
            });
        }
        if hm.dst >= d.kv_heads {
            return Some(Refusal::HeadOutOfRange {
                head: hm.dst,
                heads: d.kv_heads,
                side: "decode".into(),
            });
        }
    }
    // Each decoder head at most once (the decoder checks its own routes
    // the same way). Without this, a short request repeating one head
    // map thousands of times would make the per-layer index lists
    // (heads x pages) as long as a whole cache.
    let mut dsts: Vec<u32> = req.heads.iter().map(|hm| hm.dst).collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Some(Refusal::DuplicateHead { head: w[0] });
    }
    if req.pages.is_empty() || req.heads.is_empty() {
        return Some(Refusal::BadPages {
            what: "no pages or no heads".into(),
        });
    }
    if let Some(p) = req.pages.iter().find(|&&p| p >= d.num_pages) {
        return Some(Refusal::BadPages {
            what: format!("page {p} of {}", d.num_pages),
        });
    }
    if req.tail_slot.is_some_and(|s| s >= d.tail_slots) {
        return Some(Refusal::BadPages {
            what: "tail slot out of range".into(),
        });
    }
    // Every page must map, on both sides, before anything is taken:
    // a request that fails at its first layer would be accepted and
    // then never answered. The decoder's layout is its claim: checked
    // like ours (sizes fit), then each (head, page) index.
    if let Err(e) = d.validate() {
        return Some(Refusal::LayoutMismatch {
            what: format!("decoder layout: {e}"),
        });
    }
    let last_page = me.num_pages - 1;
    for hm in &req.heads {
        if me.page_index(hm.src, last_page).is_none() {
            return Some(Refusal::BadPages {
                what: format!("prefill head {} has no page index", hm.src),
            });
        }
        if let Some(p) = req
            .pages
            .iter()
            .find(|&&p| d.page_index(hm.dst, p).is_none())
        {
            return Some(Refusal::BadPages {
                what: format!("decoder head {} page {p} has no page index", hm.dst),
            });
        }
    }
    None
}
