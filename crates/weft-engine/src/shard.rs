//! Pure sharding plans and the immediate-count functions receivers use.
//!
//! Every plan is a list of [`Piece`]s. A piece names the *NIC index* that
//! carries it; NIC index `i` is NIC `i` of the sending group **and** entry
//! `i` of the destination [`MrDesc::rkeys`](weft_transport::MrDesc). The engine turns a
//! piece into a work request in exactly one place, taking the domain, the
//! local key, the remote NIC address and the rkey all from that one NIC
//! index, so a key of one NIC can never be posted on another.
//!
//! Every piece of a transfer that carries an immediate carries it, so the
//! number of immediates a submit produces at the receiver equals its number
//! of pieces. The `imm_count_*` functions compute it from what the receiver
//! knows (lengths, page counts, the group's NIC count and `max_write_len`,
//! and the [`ShardConfig`], which all peers of a deployment share).

/// Knobs of the sharding plan. All peers of a deployment must use the same
/// values (they are part of the immediate-count contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardConfig {
    /// Single writes (and by-bytes scatter destinations) shorter than this go
    /// on one NIC; longer ones are split across all NICs.
    pub min_shard_len: u64,
    /// Boundaries between the NICs' chunks are multiples of this (and so
    /// are piece boundaries inside a chunk, when `max_write_len >= align`).
    /// Must be > 0.
    pub align: u64,
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            min_shard_len: 64 * 1024,
            align: 4096,
        }
    }
}

/// One contiguous piece of a transfer, carried by one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// NIC index: the piece goes out on local NIC `nic` with the
    /// destination's rkey entry `nic`.
    pub nic: usize,
    /// Byte offset of the piece inside the transfer.
    pub offset: u64,
    /// Length in bytes (0 only for a zero-length transfer).
    pub len: u64,
}

/// The largest piece length used for a given `max_write_len`: rounded down to
/// `align` when that keeps it positive.
pub(crate) fn piece_cap(max_write_len: u64, align: u64) -> u64 {
    let m = max_write_len.max(1);
    if align > 0 && m >= align {
        m - m % align
    } else {
        m
    }
}

/// Number of pieces `[0, len)` is cut into with pieces of at most `cap`.
fn pieces_of(len: u64, cap: u64) -> u64 {
    if len == 0 {
        1
    } else {
        len.div_ceil(cap.max(1))
    }
}

/// Per-NIC chunk length of a sharded write, and the number of NICs used.
fn nic_layout(len: u64, nics: usize, cfg: &ShardConfig) -> (u64, u64) {
    let nics = nics.max(1) as u64;
    if nics == 1 || len < cfg.min_shard_len || len == 0 {
        return (len, 1);
    }
    let align = cfg.align.max(1);
    let per = len.div_ceil(nics);
    // Round up to the alignment; saturate (a chunk >= len just means one NIC).
    let chunk = per
        .checked_add(align - 1)
        .map_or(len, |v| v - v % align)
        .max(1);
    let used = len.div_ceil(chunk);
    (chunk, used)
}

/// Plans a single write of `len` bytes over `nics` NICs.
///
/// Writes shorter than `cfg.min_shard_len` (or with one NIC) go whole on
/// NIC `first_nic % nics`; longer ones are cut into `nics` contiguous,
/// `align`-aligned chunks (the last one shorter), chunk `k` on NIC `k`.
/// Every chunk is further cut into pieces of at most `max_write_len`. The
/// pieces cover `[0, len)` exactly once, in order.
pub fn plan_single_write(
    len: u64,
    nics: usize,
    max_write_len: u64,
    first_nic: usize,
    cfg: &ShardConfig,
) -> Vec<Piece> {
    let mut out = Vec::new();
    plan_single_write_into(&mut out, len, nics, max_write_len, first_nic, cfg);
    out
}

/// [`plan_single_write`], appending to `out` (no allocation once `out` has
/// room: the engine reuses one buffer).
pub fn plan_single_write_into(
    out: &mut Vec<Piece>,
    len: u64,
    nics: usize,
    max_write_len: u64,
    first_nic: usize,
    cfg: &ShardConfig,
) {
    let nics = nics.max(1);
    let cap = piece_cap(max_write_len, cfg.align);
    let (chunk, used) = nic_layout(len, nics, cfg);
    if used == 1 {
        let nic = first_nic % nics;
        push_pieces(out, nic, 0, len, cap);
        return;
    }
    let mut start = 0u64;
    let mut nic = 0usize;
    while start < len {
        let end = start.saturating_add(chunk).min(len);
        push_pieces(out, nic, start, end - start, cap);
        start = end;
        nic += 1;
    }
}

fn push_pieces(out: &mut Vec<Piece>, nic: usize, start: u64, len: u64, cap: u64) {
    if len == 0 {
        out.push(Piece {
            nic,
            offset: start,
            len: 0,
        });
        return;
    }
    let mut off = 0u64;
    while off < len {
        let l = cap.min(len - off);
        out.push(Piece {
            nic,
            offset: start + off,
            len: l,
        });
        off += l;
    }
}

/// Immediates at the receiver for one `submit_single_write` of `len` bytes
/// with an immediate, sent by a group of `nics` NICs (the minimum of the
/// sender's NIC count and the destination descriptor's rkey count) whose
/// smallest `max_write_len` is `max_write_len`.
pub fn imm_count_single_write(len: u64, nics: usize, max_write_len: u64, cfg: &ShardConfig) -> u64 {
    let cap = piece_cap(max_write_len, cfg.align);
    let (chunk, used) = nic_layout(len, nics, cfg);
    if used == 1 {
        return pieces_of(len, cap);
    }
    // All chunks but the last are `chunk` long.
    let last = len - chunk * (used - 1);
    (used - 1) * pieces_of(chunk, cap) + pieces_of(last, cap)
}

/// Plans one page of a paged write: page `i` of the list goes on NIC
/// `i % nics`, cut into pieces of at most `max_write_len`.
pub fn plan_page(
    page: usize,
    page_len: u64,
    nics: usize,
    max_write_len: u64,
    align: u64,
) -> Vec<Piece> {
    let mut out = Vec::new();
    plan_page_into(&mut out, page, page_len, nics, max_write_len, align);
    out
}

/// [`plan_page`], appending to `out`.
pub fn plan_page_into(
    out: &mut Vec<Piece>,
    page: usize,
    page_len: u64,
    nics: usize,
    max_write_len: u64,
    align: u64,
) {
    push_pieces(
        out,
        page % nics.max(1),
        0,
        page_len,
        piece_cap(max_write_len, align),
    );
}

/// Immediates at the receiver for one `submit_paged_writes` of `pages`
/// pages of `page_len` bytes with an immediate: every page produces
/// `ceil(page_len / max_write_len)` (at least one).
pub fn imm_count_paged_writes(
    page_len: u64,
    pages: u64,
    max_write_len: u64,
    cfg: &ShardConfig,
) -> u64 {
    pages.saturating_mul(pieces_of(page_len, piece_cap(max_write_len, cfg.align)))
}

/// How a scatter spreads its destinations over the group's NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScatterMode {
    /// Destination `j` goes whole on NIC `j % nics` (cut only by
    /// `max_write_len`). Best for many small destinations.
    #[default]
    ByPeer,
    /// Every destination is sharded across all NICs like a single write.
    /// Best for few large destinations.
    ByBytes,
}

/// Plans destination `j` (of `len` bytes) of a scatter.
pub fn plan_scatter_dst(
    j: usize,
    len: u64,
    nics: usize,
    max_write_len: u64,
    mode: ScatterMode,
    cfg: &ShardConfig,
) -> Vec<Piece> {
    let mut out = Vec::new();
    plan_scatter_dst_into(&mut out, j, len, nics, max_write_len, mode, cfg);
    out
}

/// [`plan_scatter_dst`], appending to `out`.
pub fn plan_scatter_dst_into(
    out: &mut Vec<Piece>,
    j: usize,
    len: u64,
    nics: usize,
    max_write_len: u64,
    mode: ScatterMode,
    cfg: &ShardConfig,
) {
    match mode {
        ScatterMode::ByPeer => push_pieces(
            out,
            j % nics.max(1),
            0,
            len,
            piece_cap(max_write_len, cfg.align),
        ),
        ScatterMode::ByBytes => plan_single_write_into(out, len, nics, max_write_len, j, cfg),
    }
}

/// Immediates one scatter destination of `len` bytes receives (with an
/// immediate). A barrier produces exactly 1 per destination.
pub fn imm_count_scatter_dst(
    len: u64,
    nics: usize,
    max_write_len: u64,
    mode: ScatterMode,
    cfg: &ShardConfig,
) -> u64 {
    match mode {
        ScatterMode::ByPeer => pieces_of(len, piece_cap(max_write_len, cfg.align)),
        ScatterMode::ByBytes => imm_count_single_write(len, nics, max_write_len, cfg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_cover(pieces: &[Piece], len: u64, nics: usize, cap: u64) {
        let mut next = 0u64;
        for p in pieces {
            assert_eq!(p.offset, next, "gap or overlap in {pieces:?}");
            assert!(p.nic < nics);
            assert!(p.len <= cap.max(1) || (len == 0 && p.len == 0));
            next = p.offset + p.len;
        }
        assert_eq!(next, len, "plan does not end at len");
        if len > 0 {
            assert!(pieces.iter().all(|p| p.len > 0));
        }
    }

    #[test]
    fn zero_length_is_one_piece() {
        let cfg = ShardConfig::default();
        assert_eq!(
            plan_single_write(0, 4, 1 << 30, 2, &cfg),
            vec![Piece {
                nic: 2,
                offset: 0,
                len: 0
            }]
        );
        assert_eq!(imm_count_single_write(0, 4, 1 << 30, &cfg), 1);
    }

    #[test]
    fn five_gib_over_three_nics_no_truncation() {
        let cfg = ShardConfig::default();
        let len = 5u64 << 30;
        let max = 1u64 << 30;
        let p = plan_single_write(len, 3, max, 0, &cfg);
        check_cover(&p, len, 3, max);
        assert_eq!(p.len() as u64, imm_count_single_write(len, 3, max, &cfg));
        assert!(p.iter().any(|x| x.offset > u64::from(u32::MAX)));
        for nic in 0..3 {
            assert!(p.iter().any(|x| x.nic == nic));
        }
    }

    #[test]
    fn nic_chunks_aligned() {
        let cfg = ShardConfig::default();
        let p = plan_single_write(1_000_000, 3, u64::MAX, 0, &cfg);
        assert_eq!(p.len(), 3);
        assert_eq!(p[1].offset % 4096, 0);
        assert_eq!(p[2].offset % 4096, 0);
        check_cover(&p, 1_000_000, 3, u64::MAX);
    }

    proptest! {
        #[test]
        fn single_write_covers_exactly(len in 0u64..(1u64 << 36), nics in 1usize..=8,
                                       max in 1u64..(1u64 << 34), first in 0usize..8,
                                       min_shard in 0u64..(1 << 20), align_pow in 0u32..16) {
            let cfg = ShardConfig { min_shard_len: min_shard, align: 1 << align_pow };
            // keep the piece count bounded for the test
            prop_assume!(len / max.max(1) < 100_000);
            let p = plan_single_write(len, nics, max, first, &cfg);
            check_cover(&p, len, nics, max);
            prop_assert_eq!(p.len() as u64, imm_count_single_write(len, nics, max, &cfg));
            // NIC chunks are aligned
            for w in p.windows(2) {
                if w[0].nic != w[1].nic {
                    prop_assert_eq!(w[1].offset % cfg.align, 0);
                }
            }
        }

        #[test]
        fn pages_and_scatter_counts_match_plans(page_len in 0u64..(1u64 << 33), pages in 0u64..64,
                                                nics in 1usize..=8, max in 1u64..(1u64 << 32),
                                                by_bytes: bool) {
            prop_assume!(page_len / max.max(1) < 10_000);
            let cfg = ShardConfig::default();
            let mut n = 0u64;
            for i in 0..pages as usize {
                let p = plan_page(i, page_len, nics, max, cfg.align);
                check_cover(&p, page_len, nics, max);
                prop_assert!(p.iter().all(|x| x.nic == i % nics));
                // The engine's one-piece fast path relies on this.
                if page_len > 0 && page_len <= piece_cap(max, cfg.align) {
                    prop_assert_eq!(&p, &vec![Piece { nic: i % nics, offset: 0, len: page_len }]);
                }
                n += p.len() as u64;
            }
            prop_assert_eq!(n, imm_count_paged_writes(page_len, pages, max, &cfg));
            let mode = if by_bytes { ScatterMode::ByBytes } else { ScatterMode::ByPeer };
            let p = plan_scatter_dst(3, page_len, nics, max, mode, &cfg);
            check_cover(&p, page_len, nics, max);
            prop_assert_eq!(p.len() as u64, imm_count_scatter_dst(page_len, nics, max, mode, &cfg));
        }
    }
}
