//! The [`StepPlan`]: where every pair of a step goes, on the send side and
//! the receive side, once the route matrix of the step is known. Pure (no
//! buffers, no engine): the CPU path and the GPU kernels use the same
//! formulas.
//!
//! Slots are counted in units of a dispatch slot (`B_in` bytes) or a combine
//! slot (`B_out` bytes).
//!
//! * Send side of rank r: pairs to destination d occupy send slots
//!   `seg(d) .. seg(d) + n(r→d)`. The first `min(P, n(r→d))` go
//!   speculatively to d's private region for r; the rest ("overflow") go to
//!   d's contiguous region at `off(r→d) = Σ_{s<r, s≠d} max(0, n(s→d) − P)`
//!   (compact, no holes).
//! * Receive side: row `i` of source s's segment comes from own send slot
//!   `seg(r) + i` (s = r), private slot `s·P + i` (i < P), or contiguous
//!   slot `off(s→r) + i − P`.
//! * Combine: an expert-layout row of remote source s goes to send slot
//!   `cstart(s) + i` (`cstart(s) = Σ_{s'<s, s'≠r} n(s'→r)`) and is scattered
//!   to s's combine region at `seg_s(r) + i`; a row of r itself goes
//!   straight to r's own combine region at `seg(r) + i`.

use crate::config::Dims;
use crate::error::MoeError;
use crate::routes::RouteMatrix;

/// Where one expert-layout row is read from at unpack time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SrcSlot {
    /// The rank's own send buffer (a pair it routed to itself).
    Local(u32),
    /// The private region of the receive buffer (slot `s·P + i`).
    Private(u32),
    /// The contiguous region of the receive buffer (slot index inside it).
    Contig(u32),
}

/// Where one expert-layout row's output goes at combine-pack time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CombineSlot {
    /// Send buffer slot (a remote source's row, scattered back later).
    Send(u32),
    /// Own receive buffer combine slot (a row of this rank's own pairs).
    Recv(u32),
}

/// What this rank sends one destination during dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchDest {
    /// n(r→d): pairs routed to the destination.
    pub pairs: u32,
    /// seg(d): first send slot of the destination's segment.
    pub seg: u32,
    /// Pairs sent speculatively to the private region (0 for self).
    pub private: u32,
    /// The overflow write, if any (never for self).
    pub overflow: Option<Overflow>,
}

/// One overflow write: `len` slots from send slot `src_slot` to contiguous
/// slot `dst_slot` of the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    /// First send slot.
    pub src_slot: u32,
    /// First slot inside the destination's contiguous region.
    pub dst_slot: u32,
    /// Slots.
    pub len: u32,
}

/// One combine scatter entry: `len` combine slots from send slot `src_slot`
/// to the source rank's combine region at `dst_slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineSend {
    /// The source rank the rows go back to.
    pub rank: u32,
    /// First send slot (`cstart(s)`).
    pub src_slot: u32,
    /// First slot in the source's combine region (`seg_s(r)`).
    pub dst_slot: u32,
    /// Slots (`n(s→r)`, possibly 0: the entry is sent anyway).
    pub len: u32,
}

/// The plan of one step at one rank. Built from the route matrix only, so
/// every rank computes the same numbers for the same pair of ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    rank: u32,
    ranks: u32,
    private: u32,
    dests: Vec<DispatchDest>,
    /// n(s→r) per source s.
    recv_pairs: Vec<u32>,
    /// Overflow slots used in this rank's contiguous region.
    contig_used: u64,
    unpack: Vec<SrcSlot>,
    expert_offsets: Vec<u32>,
    source_rank: Vec<u32>,
    combine: Vec<CombineSlot>,
    combine_sends: Vec<CombineSend>,
}

/// Member index of `peer` in the rotated peer group of `rank`
/// (member j is rank `(rank + 1 + j) % ranks`); `None` for self or a rank
/// out of range.
pub fn member_index(ranks: u32, rank: u32, peer: u32) -> Option<usize> {
    if peer == rank || peer >= ranks || rank >= ranks {
        return None;
    }
    Some(((peer + ranks - rank - 1) % ranks) as usize)
}

/// The rank of member `j` of `rank`'s rotated peer group.
pub fn member_rank(ranks: u32, rank: u32, j: usize) -> u32 {
    ((u64::from(rank) + 1 + j as u64) % u64::from(ranks.max(1))) as u32
}

/// n(r→d) from a route row: pairs of the row routed to rank `d`'s experts.
pub fn n_to_rank(dims: &Dims, row: &[u32], d: u32) -> u32 {
    let l = dims.local as usize;
    let start = d as usize * l;
    row.get(start..start + l).map_or(0, |c| c.iter().sum())
}

impl StepPlan {
    /// Builds the plan of `rank` for the step whose routes are `m`.
    pub fn new(dims: &Dims, rank: u32, m: &RouteMatrix) -> Result<StepPlan, MoeError> {
        let n = dims.ranks;
        if rank >= n {
            return Err(MoeError::NoSuchRank { rank, ranks: n });
        }
        if m.ranks() != n || m.row(0).len() != dims.experts as usize {
            return Err(MoeError::Shape {
                what: "route matrix",
                got: u64::from(m.ranks()) * m.row(0).len() as u64,
                want: u64::from(n) * u64::from(dims.experts),
            });
        }
        let p = dims.private;
        // nr[s][d] = n(s→d); rows were validated (Σ ≤ T·R ≤ u32::MAX).
        let nr: Vec<Vec<u32>> = (0..n)
            .map(|s| (0..n).map(|d| m.n_rank(dims, s, d)).collect())
            .collect();
        let over = |s: u32, d: u32| nr[s as usize][d as usize].saturating_sub(p);
        // off(s→d) for this rank as sender (d varies) and as receiver.
        let off = |s: u32, d: u32| -> u64 {
            (0..s)
                .filter(|&x| x != d)
                .map(|x| u64::from(over(x, d)))
                .sum()
        };
        let mut dests = Vec::with_capacity(n as usize);
        let mut seg = 0u32;
        for d in 0..n {
            let pairs = nr[rank as usize][d as usize];
            let (private, overflow) = if d == rank {
                (0, None)
            } else {
                let o = over(rank, d);
                let overflow = if o > 0 {
                    let dst = off(rank, d);
                    check_contig(dims, d, dst + u64::from(o))?;
                    Some(Overflow {
                        src_slot: seg + p,
                        dst_slot: dst as u32,
                        len: o,
                    })
                } else {
                    None
                };
                (pairs.min(p), overflow)
            };
            dests.push(DispatchDest {
                pairs,
                seg,
                private,
                overflow,
            });
            seg += pairs;
        }
        let recv_pairs: Vec<u32> = (0..n).map(|s| nr[s as usize][rank as usize]).collect();
        let contig_used: u64 = (0..n)
            .filter(|&s| s != rank)
            .map(|s| u64::from(over(s, rank)))
            .sum();
        check_contig(dims, rank, contig_used)?;
        // Per source: segment start at the source (seg_s(r)), overflow
        // offset (off(s→r)) and combine send start (cstart(s)).
        let seg_at: Vec<u32> = (0..n)
            .map(|s| nr[s as usize][..rank as usize].iter().sum())
            .collect();
        let mut off_from = vec![0u32; n as usize];
        let mut cstart = vec![0u32; n as usize];
        let (mut o, mut c) = (0u32, 0u32);
        for s in 0..n {
            if s == rank {
                continue;
            }
            off_from[s as usize] = o;
            cstart[s as usize] = c;
            o += over(s, rank);
            c += recv_pairs[s as usize];
        }
        let total: u64 = recv_pairs.iter().map(|&x| u64::from(x)).sum();
        let mut unpack = Vec::with_capacity(total as usize);
        let mut combine = Vec::with_capacity(total as usize);
        let mut source_rank = Vec::with_capacity(total as usize);
        let mut expert_offsets = Vec::with_capacity(dims.local as usize + 1);
        expert_offsets.push(0u32);
        // i-cursor of each source inside its segment for this rank.
        let mut cur = vec![0u32; n as usize];
        let first = rank * dims.local;
        for e in first..first + dims.local {
            for s in 0..n {
                let cnt = m.n_expert(s, e);
                for _ in 0..cnt {
                    let i = cur[s as usize];
                    cur[s as usize] += 1;
                    let su = s as usize;
                    unpack.push(if s == rank {
                        SrcSlot::Local(dests[rank as usize].seg + i)
                    } else if i < p {
                        SrcSlot::Private(s * p + i)
                    } else {
                        SrcSlot::Contig(off_from[su] + i - p)
                    });
                    combine.push(if s == rank {
                        CombineSlot::Recv(dests[rank as usize].seg + i)
                    } else {
                        CombineSlot::Send(cstart[su] + i)
                    });
                    source_rank.push(s);
                }
            }
            expert_offsets.push(unpack.len() as u32);
        }
        let combine_sends = (0..n.saturating_sub(1) as usize)
            .map(|j| {
                let s = member_rank(n, rank, j);
                CombineSend {
                    rank: s,
                    src_slot: cstart[s as usize],
                    dst_slot: seg_at[s as usize],
                    len: recv_pairs[s as usize],
                }
            })
            .collect();
        Ok(StepPlan {
            rank,
            ranks: n,
            private: p,
            dests,
            recv_pairs,
            contig_used,
            unpack,
            expert_offsets,
            source_rank,
            combine,
            combine_sends,
        })
    }

    /// The rank the plan is for.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks of the group.
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// Private slots per (source, destination) (P).
    pub fn private(&self) -> u32 {
        self.private
    }

    /// What this rank sends destination `d` (indexed by rank; self included,
    /// with no private part and no overflow).
    pub fn dests(&self) -> &[DispatchDest] {
        &self.dests
    }

    /// n(s→r): pairs this rank receives from source `s` (self included).
    pub fn recv_pairs(&self) -> &[u32] {
        &self.recv_pairs
    }

    /// Contiguous-region slots used at this rank (≤ C).
    pub fn contig_used(&self) -> u64 {
        self.contig_used
    }

    /// Unpack map: the source of every expert-layout row, in output order
    /// (local expert, then source rank, then the source's (t, k) order).
    pub fn unpack(&self) -> &[SrcSlot] {
        &self.unpack
    }

    /// Row offsets of the local experts in the expert layout (L + 1 entries).
    pub fn expert_offsets(&self) -> &[u32] {
        &self.expert_offsets
    }

    /// Source rank of every expert-layout row.
    pub fn source_rank(&self) -> &[u32] {
        &self.source_rank
    }

    /// Combine-pack map: where every expert-layout row's output goes.
    pub fn combine(&self) -> &[CombineSlot] {
        &self.combine
    }

    /// The combine scatter, one entry per peer-group member in member order
    /// (zero-length entries included).
    pub fn combine_sends(&self) -> &[CombineSend] {
        &self.combine_sends
    }
}

fn check_contig(dims: &Dims, rank: u32, need: u64) -> Result<(), MoeError> {
    if need > dims.contig_slots {
        return Err(MoeError::RecvOverflow {
            rank,
            need,
            cap: dims.contig_slots,
        });
    }
    Ok(())
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
