//! Tensor parallelism: which KV heads each rank holds, and which prefill
//! ranks feed a decode rank when the two sides use different TP degrees
//! (heads split or merged) or replicate their KV (MLA's latent, or fewer KV
//! heads than ranks).

use crate::{HeadMap, KvError};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// How a model's KV heads are spread over the prefill and decode ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpShape {
    /// KV heads of the model (1 for MLA: one latent, replicated on every rank).
    pub kv_heads: u32,
    /// Tensor-parallel degree of the prefill side.
    pub prefill_tp: u32,
    /// Tensor-parallel degree of the decode side.
    pub decode_tp: u32,
}

/// One prefill rank's part of a decode rank's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSource {
    /// The prefill rank.
    pub prefill_rank: u32,
    /// Its heads → the decode rank's heads (local indices on each rank).
    pub heads: Vec<HeadMap>,
    /// Whether this rank also writes the tail (exactly one source does).
    pub tail: bool,
}

/// The global KV heads rank `rank` of `tp` holds, in local order: a
/// contiguous block of `kv_heads / tp` when `kv_heads >= tp`, else one head,
/// replicated over `tp / kv_heads` consecutive ranks.
pub fn rank_heads(kv_heads: u32, tp: u32, rank: u32) -> Result<Vec<u32>, KvError> {
    let bad = |what: String| Err(KvError::Layout { what });
    if kv_heads == 0 || tp == 0 {
        return bad("kv_heads and tp must be > 0".into());
    }
    if rank >= tp {
        return bad(format!("rank {rank} out of range for tp {tp}"));
    }
    if kv_heads >= tp {
        if !kv_heads.is_multiple_of(tp) {
            return bad(format!("{kv_heads} KV heads do not split over tp {tp}"));
        }
        let per = kv_heads / tp;
        Ok((rank * per..(rank + 1) * per).collect())
    } else {
        if !tp.is_multiple_of(kv_heads) {
            return bad(format!("tp {tp} is not a multiple of {kv_heads} KV heads"));
        }
        Ok(vec![rank / (tp / kv_heads)])
    }
}

impl TpShape {
    /// KV heads on each prefill rank.
    pub fn prefill_heads_per_rank(&self) -> Result<u32, KvError> {
        Ok(len32(&rank_heads(self.kv_heads, self.prefill_tp, 0)?))
    }

    /// KV heads on each decode rank.
    pub fn decode_heads_per_rank(&self) -> Result<u32, KvError> {
        Ok(len32(&rank_heads(self.kv_heads, self.decode_tp, 0)?))
    }

    /// The sources of every decode rank (index = decode rank). A head held
    /// by several prefill ranks (replicated: MLA, or fewer KV heads than
    /// ranks) is taken from one of them, matched at random from `seed` so
    /// that the decode ranks wanting it are spread evenly over its holders
    /// (NIC load). The tail comes from the source of the rank's first head.
    pub fn plan(&self, seed: u64) -> Result<Vec<Vec<RankSource>>, KvError> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let p_heads: Vec<Vec<u32>> = (0..self.prefill_tp)
            .map(|r| rank_heads(self.kv_heads, self.prefill_tp, r))
            .collect::<Result<_, _>>()?;
        let d_heads: Vec<Vec<u32>> = (0..self.decode_tp)
            .map(|r| rank_heads(self.kv_heads, self.decode_tp, r))
            .collect::<Result<_, _>>()?;
        // choice[d][i]: the prefill rank that sends decode rank d its i-th head.
        let mut choice: Vec<Vec<u32>> = d_heads.iter().map(|h| vec![0; h.len()]).collect();
        for g in 0..self.kv_heads {
            let mut holders: Vec<u32> = (0..self.prefill_tp)
                .filter(|&p| p_heads[p as usize].contains(&g))
                .collect();
            holders.shuffle(&mut rng);
            let wanting = (0..self.decode_tp).flat_map(|d| {
                let pos = d_heads[d as usize].iter().position(|&h| h == g);
                pos.map(|i| (d, i))
            });
            for (k, (d, i)) in wanting.enumerate() {
                let Some(&p) = holders.get(k % holders.len().max(1)) else {
                    return Err(KvError::Layout {
                        what: format!("no prefill rank holds head {g}"),
                    });
                };
                choice[d as usize][i] = p;
            }
        }
        let mut out = Vec::with_capacity(d_heads.len());
        for (d, heads) in d_heads.iter().enumerate() {
            let mut srcs: Vec<RankSource> = Vec::new();
            for (i, &g) in heads.iter().enumerate() {
                let p = choice[d][i];
                let src = p_heads[p as usize]
                    .iter()
                    .position(|&h| h == g)
                    .and_then(|s| u32::try_from(s).ok())
                    .ok_or_else(|| KvError::Layout {
                        what: format!("head {g} not on prefill rank {p}"),
                    })?;
                let hm = HeadMap {
                    src,
                    dst: u32::try_from(i).unwrap_or(u32::MAX),
                };
                match srcs.iter_mut().find(|s| s.prefill_rank == p) {
                    Some(s) => s.heads.push(hm),
                    None => srcs.push(RankSource {
                        prefill_rank: p,
                        heads: vec![hm],
                        tail: srcs.is_empty(),
                    }),
                }
            }
            out.push(srcs);
        }
        Ok(out)
    }
}

fn len32(v: &[u32]) -> u32 {
    u32::try_from(v.len()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covers(shape: TpShape, seed: u64) {
        let plan = shape.plan(seed).unwrap();
        assert_eq!(plan.len(), shape.decode_tp as usize);
        for (d, srcs) in plan.iter().enumerate() {
            let want = rank_heads(shape.kv_heads, shape.decode_tp, d as u32).unwrap();
            let mut got = vec![None; want.len()];
            for s in srcs {
                let ph = rank_heads(shape.kv_heads, shape.prefill_tp, s.prefill_rank).unwrap();
                for hm in &s.heads {
                    assert!(got[hm.dst as usize].is_none(), "dst head twice");
                    got[hm.dst as usize] = Some(ph[hm.src as usize]);
                }
            }
            let got: Vec<u32> = got.into_iter().map(|g| g.unwrap()).collect();
            assert_eq!(got, want, "{shape:?} rank {d}");
            assert_eq!(srcs.iter().filter(|s| s.tail).count(), 1);
        }
    }

    #[test]
    fn split_merge_and_replication_cover_every_head_once() {
        for seed in 0..20 {
            covers(
                TpShape {
                    kv_heads: 8,
                    prefill_tp: 8,
                    decode_tp: 4,
                },
                seed,
            );
            covers(
                TpShape {
                    kv_heads: 8,
                    prefill_tp: 4,
                    decode_tp: 8,
                },
                seed,
            );
            covers(
                TpShape {
                    kv_heads: 4,
                    prefill_tp: 4,
                    decode_tp: 8,
                },
                seed,
            );
            covers(
                TpShape {
                    kv_heads: 4,
                    prefill_tp: 8,
                    decode_tp: 4,
                },
                seed,
            );
            covers(
                TpShape {
                    kv_heads: 1,
                    prefill_tp: 8,
                    decode_tp: 8,
                },
                seed,
            );
            covers(
                TpShape {
                    kv_heads: 1,
                    prefill_tp: 4,
                    decode_tp: 8,
                },
                seed,
            );
        }
    }

    #[test]
    fn merge_takes_two_sources_split_takes_a_subset() {
        let p = TpShape {
            kv_heads: 8,
            prefill_tp: 8,
            decode_tp: 4,
        }
        .plan(0)
        .unwrap();
        assert_eq!(p[1].len(), 2);
        assert_eq!(p[1][0].prefill_rank, 2);
        assert_eq!(p[1][1].prefill_rank, 3);
        let p = TpShape {
            kv_heads: 8,
            prefill_tp: 4,
            decode_tp: 8,
        }
        .plan(0)
        .unwrap();
        assert_eq!(p[3].len(), 1);
        assert_eq!(p[3][0].prefill_rank, 1);
        assert_eq!(p[3][0].heads, vec![HeadMap { src: 1, dst: 0 }]);
    }

    #[test]
    fn mla_matching_is_seeded_and_balanced() {
        let shape = TpShape {
            kv_heads: 1,
            prefill_tp: 8,
            decode_tp: 8,
        };
        let a = shape.plan(7).unwrap();
        assert_eq!(a, shape.plan(7).unwrap());
        let ranks: Vec<u32> = a.iter().map(|s| s[0].prefill_rank).collect();
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "a permutation");
        let differs = (0..10).any(|s| {
            shape
                .plan(s)
                .unwrap()
                .iter()
                .map(|x| x[0].prefill_rank)
                .collect::<Vec<_>>()
                != ranks
        });
        assert!(differs, "the matching depends on the seed");
        assert!(TpShape {
            kv_heads: 3,
            prefill_tp: 2,
            decode_tp: 1
        }
        .plan(0)
        .is_err());
    }
}
