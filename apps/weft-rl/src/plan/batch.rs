//! A wave's gathers as few submits as the engine allows.
//!
//! The unshard of a finely sharded parameter is many small pieces: with
//! FSDP 16 over rows, each 2 MiB band of 128-row fp8 tiles has a piece on
//! every holder (2 KiB to 768 KiB in Qwen3-235B), so a trainer sources
//! thousands of gathers per update (Qwen3-235B as one instance with PP 2:
//! about 2 100 per trainer; batched, about 160). Each would be
//! its own submit, and the host cost of submits, not the bytes, would
//! set the unshard's pace. So a source's pieces of up to
//! [`BATCH_PAGE_MAX`] bytes into one writer in one wave go out as one
//! paged submit per page length ([`GatherPost::Batch`]); larger transfers
//! stay one submit each ([`GatherPost::One`]: a contiguous range is
//! sharded over the NICs by the engine).

use std::collections::BTreeMap;

use super::{Unit, Xfer};
use crate::meta::Rank;

/// Largest page a batch carries; longer pages and ranges are posted on
/// their own.
pub const BATCH_PAGE_MAX: u64 = 1 << 20;

/// How one or more gathers of a wave go out.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GatherPost {
    /// One planned transfer, one submit.
    One {
        /// The rank that holds the bytes.
        from: Rank,
        /// The writer whose arena receives them.
        writer: Rank,
        /// Shards → arena (arena offsets relative to the wave's half).
        xfer: Xfer,
    },
    /// Pages of one length from one source into one writer's arena, one
    /// paged submit: page `i` goes from `src[i]` to `dst[i]`.
    Batch {
        /// The rank that holds the bytes.
        from: Rank,
        /// The writer whose arena receives them.
        writer: Rank,
        /// Bytes per page.
        page_len: u64,
        /// Page offsets in the source's shard memory.
        src: Vec<u64>,
        /// Page offsets in the writer's arena (relative to the half).
        dst: Vec<u64>,
    },
}

impl GatherPost {
    /// The source rank.
    pub fn from(&self) -> Rank {
        match self {
            GatherPost::One { from, .. } | GatherPost::Batch { from, .. } => *from,
        }
    }

    /// The writer.
    pub fn writer(&self) -> Rank {
        match self {
            GatherPost::One { writer, .. } | GatherPost::Batch { writer, .. } => *writer,
        }
    }

    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        match self {
            GatherPost::One { xfer, .. } => xfer.src.bytes(),
            GatherPost::Batch { page_len, src, .. } => page_len * src.len() as u64,
        }
    }
}

/// The gathers of `units` (one wave) as posts: small pages batched per
/// (source, writer, page length), in plan order within a batch; the rest
/// one post per transfer. Deterministic: ordered by source, writer, then
/// page length (batches) or plan order (single posts).
pub fn gather_posts(units: &[Unit]) -> Vec<GatherPost> {
    /// One (source, writer) pair's pages by length, and its long transfers.
    type Pair = (BTreeMap<u64, (Vec<u64>, Vec<u64>)>, Vec<Xfer>);
    let mut pairs: BTreeMap<(Rank, Rank), Pair> = BTreeMap::new();
    for u in units {
        for g in &u.gathers {
            let x = &g.xfer;
            let (batches, ones) = pairs.entry((g.from, u.writer)).or_default();
            let page = if x.is_single() {
                x.src.bytes()
            } else {
                x.dst.page_len
            };
            if page > BATCH_PAGE_MAX || page == 0 {
                ones.push(*x);
                continue;
            }
            let (s, d) = batches.entry(page).or_default();
            if x.is_single() {
                s.push(x.src.offset);
                d.push(x.dst.offset);
            } else {
                for i in 0..x.dst.count {
                    s.push(x.src.offset + i * x.src.stride);
                    d.push(x.dst.offset + i * x.dst.stride);
                }
            }
        }
    }
    let mut out = Vec::new();
    for ((from, writer), (batches, ones)) in pairs {
        out.extend(
            batches
                .into_iter()
                .map(|(page_len, (src, dst))| GatherPost::Batch {
                    from,
                    writer,
                    page_len,
                    src,
                    dst,
                }),
        );
        out.extend(
            ones.into_iter()
                .map(|xfer| GatherPost::One { from, writer, xfer }),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Gather, Run};
    use proptest::prelude::*;

    fn unit(writer: Rank, gathers: Vec<(Rank, Xfer)>) -> Unit {
        Unit {
            mesh_group: 0,
            wave: 0,
            param: 0,
            src: crate::meta::Box2 {
                rows: 0..1,
                cols: 0..1,
            },
            quant: crate::meta::Quant::Fp8Block,
            dests: Vec::new(),
            writer,
            eligible: vec![writer],
            assign_seq: 0,
            arena: Some((0, 0)),
            local: Vec::new(),
            gathers: gathers
                .into_iter()
                .map(|(from, xfer)| Gather { from, xfer })
                .collect(),
        }
    }

    fn single(src: u64, dst: u64, len: u64) -> Xfer {
        Xfer {
            src: Run::contiguous(src, len),
            dst: Run::contiguous(dst, len),
        }
    }

    fn strided(src: u64, dst: u64, page: u64, stride: u64, count: u64) -> Xfer {
        Xfer {
            src: Run {
                offset: src,
                page_len: page,
                stride,
                count,
            },
            dst: Run {
                offset: dst,
                page_len: page,
                stride: page,
                count,
            },
        }
    }

    /// Every page of every gather, as (from, writer, src, dst, length): a
    /// contiguous transfer is one page (batching never cuts a page).
    type Page = (Rank, Rank, u64, u64, u64);

    fn pages_of(from: Rank, writer: Rank, x: &Xfer, v: &mut Vec<Page>) {
        if x.is_single() {
            v.push((from, writer, x.src.offset, x.dst.offset, x.src.bytes()));
        } else {
            for i in 0..x.dst.count {
                v.push((
                    from,
                    writer,
                    x.src.offset + i * x.src.stride,
                    x.dst.offset + i * x.dst.stride,
                    x.dst.page_len,
                ));
            }
        }
    }

    fn pages_of_units(units: &[Unit]) -> Vec<Page> {
        let mut v = Vec::new();
        for u in units {
            for g in &u.gathers {
                pages_of(g.from, u.writer, &g.xfer, &mut v);
            }
        }
        v.sort_unstable();
        v
    }

    fn pages_of_posts(posts: &[GatherPost]) -> Vec<Page> {
        let mut v = Vec::new();
        for p in posts {
            match p {
                GatherPost::One { from, writer, xfer } => pages_of(*from, *writer, xfer, &mut v),
                GatherPost::Batch {
                    from,
                    writer,
                    page_len,
                    src,
                    dst,
                } => {
                    assert_eq!(src.len(), dst.len());
                    v.extend(
                        src.iter()
                            .zip(dst)
                            .map(|(s, d)| (*from, *writer, *s, *d, *page_len)),
                    );
                }
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn small_pieces_batch_per_source_writer_and_page_length() {
        let units = vec![
            unit(
                0,
                vec![
                    (1, single(0, 8192, 8192)),
                    (2, single(0, 16384, 8192)),
                    (1, strided(100_000, 0, 2048, 16384, 4)),
                ],
            ),
            unit(
                0,
                vec![
                    (1, single(8192, 24576, 8192)),
                    // Too long to batch: its own post.
                    (2, single(1 << 22, 1 << 23, BATCH_PAGE_MAX + 1)),
                ],
            ),
            unit(3, vec![(1, single(16384, 0, 8192))]),
        ];
        let posts = gather_posts(&units);
        assert_eq!(pages_of_posts(&posts), pages_of_units(&units));
        // (1→0, 2048), (1→0, 8192), (1→3, 8192), (2→0, 8192), (2→0, one).
        assert_eq!(posts.len(), 5, "{posts:#?}");
        assert!(matches!(
            &posts[1],
            GatherPost::Batch { from: 1, writer: 0, page_len: 8192, src, .. } if src == &[0, 8192]
        ));
        assert!(matches!(
            &posts[4],
            GatherPost::One {
                from: 2,
                writer: 0,
                ..
            }
        ));
        // Ordered by source, then writer.
        let keys: Vec<_> = posts.iter().map(|p| (p.from(), p.writer())).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }

    fn any_xfer() -> impl Strategy<Value = Xfer> {
        let page = prop::sample::select(vec![1u64, 7, 64, BATCH_PAGE_MAX, BATCH_PAGE_MAX + 1]);
        (page, 0u64..1000, 0u64..1000, prop::option::of(2u64..4)).prop_map(|(p, s, d, n)| match n {
            None => single(s, d, p),
            Some(n) => strided(s, d, p, p * 3, n),
        })
    }

    fn any_units() -> impl Strategy<Value = Vec<Unit>> {
        let unit_s = (0u32..3, prop::collection::vec((0u32..3, any_xfer()), 0..5))
            .prop_map(|(w, g)| unit(w, g));
        prop::collection::vec(unit_s, 1..6)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The posts carry every planned page exactly once, from the same
        /// source to the same writer, and no batch holds a long page.
        #[test]
        fn posts_cover_the_gathers_exactly(units in any_units()) {
            let posts = gather_posts(&units);
            prop_assert_eq!(pages_of_posts(&posts), pages_of_units(&units));
            for p in &posts {
                if let GatherPost::Batch { page_len, .. } = p {
                    prop_assert!(*page_len <= BATCH_PAGE_MAX);
                }
            }
            let total: u64 = posts.iter().map(GatherPost::bytes).sum();
            let want: u64 = pages_of_units(&units).iter().map(|p| p.4).sum();
            prop_assert_eq!(total, want);
        }
    }
}
