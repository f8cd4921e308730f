//! Test inputs: routings (random and the edge cases), token data, weights,
//! and the deterministic test "expert".
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_moe::{num, quant, Dims, DispatchFormat, ExpertTokens, OutDtype, RankInput, NO_EXPERT};

/// How the top-k ids are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Uniform over all experts (duplicates possible).
    Random,
    /// Every pair to expert `x`.
    OneExpert(u32),
    /// Every pair to an expert of the sending rank.
    AllLocal,
    /// Each token names two experts of one rank, and one expert twice.
    DupExperts,
    /// Random, but rank `r` sends no tokens.
    SenderEmpty(u32),
    /// Most pairs to the first few experts.
    Skewed,
    /// Random, but about a quarter of the pairs go to no expert
    /// (`NO_EXPERT`, DeepEP's -1), and every pair of each rank's first
    /// token.
    SomeNone,
}

/// One rank's owned inputs.
#[derive(Debug, Clone)]
pub struct Owned {
    pub tokens: Vec<u8>,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Owned {
    pub fn input(&self) -> RankInput<'_> {
        RankInput {
            tokens: &self.tokens,
            topk_ids: &self.ids,
            topk_weights: &self.weights,
        }
    }
}

/// Inputs of every rank for one step; some ranks get fewer than T tokens
/// when `ragged`.
pub fn inputs(d: &Dims, routing: Routing, seed: u64, ragged: bool) -> Vec<Owned> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (e, l, r) = (d.experts, d.local, d.topk as usize);
    (0..d.ranks)
        .map(|rank| {
            let t = match routing {
                Routing::SenderEmpty(x) if x == rank => 0,
                _ if ragged => rng.gen_range(0..=d.max_tokens),
                _ => d.max_tokens,
            };
            let mut ids = Vec::with_capacity(t as usize * r);
            for _ in 0..t {
                for k in 0..r {
                    ids.push(match routing {
                        Routing::Random | Routing::SenderEmpty(_) => rng.gen_range(0..e),
                        Routing::SomeNone => {
                            if ids.len() < r || rng.gen_bool(0.25) {
                                NO_EXPERT
                            } else {
                                rng.gen_range(0..e)
                            }
                        }
                        Routing::OneExpert(x) => x,
                        Routing::AllLocal => rank * l + rng.gen_range(0..l),
                        Routing::DupExperts => {
                            let base = rng.gen_range(0..d.ranks) * l;
                            match k {
                                0 | 1 => base,
                                _ => base + rng.gen_range(0..l),
                            }
                        }
                        Routing::Skewed => {
                            if rng.gen_bool(0.8) {
                                rng.gen_range(0..l.min(e).max(1))
                            } else {
                                rng.gen_range(0..e)
                            }
                        }
                    });
                }
            }
            let tokens = match d.dispatch {
                // bf16 values of many magnitudes, some zero, and now and
                // then the edges: NaN (quiet and signalling), ±Inf, ±max.
                DispatchFormat::Fp8 { .. } => (0..t as usize * d.hidden as usize)
                    .flat_map(|_| {
                        let b = if rng.gen_bool(0.002) {
                            [0x7fc0u16, 0x7f81, 0x7f80, 0xff80, 0x7f7f, 0xff7f][rng.gen_range(0..6)]
                        } else if rng.gen_bool(0.05) {
                            0
                        } else {
                            num::f32_to_bf16(
                                rng.gen_range(-1.0f32..1.0) * 2f32.powi(rng.gen_range(-20..8)),
                            )
                        };
                        b.to_le_bytes()
                    })
                    .collect(),
                _ => (0..t as usize * d.token_bytes as usize)
                    .map(|_| rng.gen())
                    .collect(),
            };
            let weights = (0..ids.len())
                .map(|_| rng.gen_range(-1.0f32..1.0))
                .collect();
            Owned {
                tokens,
                ids,
                weights,
            }
        })
        .collect()
}

/// The test expert: `y[h] = f32(byte[h % token_bytes]) · (e + 1) / 7`, in
/// `out_dtype`, for every row of a rank's expert layout.
pub fn expert_outputs(d: &Dims, rank: u32, x: &ExpertTokens) -> Vec<u8> {
    let mut out = Vec::new();
    for (le, w) in x.expert_offsets.windows(2).enumerate() {
        let e = rank * d.local + le as u32;
        for row in w[0]..w[1] {
            let bytes = x.row(row as usize);
            for h in 0..d.hidden as usize {
                let v = f32::from(bytes[h % bytes.len()]) * (e + 1) as f32 / 7.0;
                num::push_elem(d.out_dtype, &mut out, v);
            }
        }
    }
    out
}

/// Checks every received row of `rank` against its origin: the source's
/// token bytes, and the source naming this row's expert at that (t, k).
/// Independent of the reference: it reads only the inputs.
pub fn check_origins(d: &Dims, rank: u32, x: &ExpertTokens, views: &[RankInput<'_>]) {
    let tb = d.token_bytes as usize;
    for (le, w) in x.expert_offsets.windows(2).enumerate() {
        let e = rank * d.local + le as u32;
        for row in w[0] as usize..w[1] as usize {
            let o = x
                .origin(row)
                .unwrap_or_else(|| panic!("rank {rank} row {row}: no origin"));
            let src = &views[o.rank as usize];
            let pair = (o.token * d.topk + o.k) as usize;
            assert_eq!(
                src.topk_ids[pair], e,
                "rank {rank} row {row}: origin {o:?} names another expert"
            );
            let t = o.token as usize;
            let ib = d.in_row_bytes() as usize;
            let input = &src.tokens[t * ib..(t + 1) * ib];
            let want = match d.dispatch {
                DispatchFormat::Fp8 { round_scale } => {
                    let mut q = vec![0u8; tb];
                    assert!(quant::quantize_token(input, round_scale, &mut q));
                    q
                }
                _ => input.to_vec(),
            };
            assert_eq!(
                x.row(row),
                &want[..],
                "rank {rank} row {row}: bytes of another token than {o:?}"
            );
        }
    }
}

/// Every routing for `d`.
pub fn routings(d: &Dims) -> Vec<Routing> {
    vec![
        Routing::Random,
        Routing::OneExpert(d.experts - 1),
        Routing::AllLocal,
        Routing::DupExperts,
        Routing::SenderEmpty(d.ranks / 2),
        Routing::Skewed,
        Routing::SomeNone,
    ]
}

/// Both output types.
pub const DTYPES: [OutDtype; 2] = [OutDtype::Bf16, OutDtype::F32];

/// NICs of every test engine on the loopback fabric.
pub const NICS: usize = 2;

/// An engine on `host` of the loopback `fabric` (all its NICs, workers
/// parking for 200 µs when idle).
pub fn engine_on(
    fabric: &weft::loopback::Fabric,
    host: weft::loopback::HostId,
) -> std::sync::Arc<weft::TransferEngine> {
    let p = std::sync::Arc::new(fabric.provider(host));
    let mut cfg = weft::EngineConfig::default();
    cfg.idle_sleep = Some(std::time::Duration::from_micros(200));
    std::sync::Arc::new(
        weft::TransferEngine::builder()
            .group(weft::DomainGroupSpec::new(p, (0..NICS).collect::<Vec<_>>()))
            .config(cfg)
            .build()
            .expect("engine builds"),
    )
}

/// The active ranks' inputs with the mask applied by hand (independently
/// of `weft_moe::mask`): a pair for a masked rank's expert is dropped,
/// every other id renumbered densely over the active ranks.
pub fn masked_inputs(full: &Dims, masked: &[u32], ins: &[Owned]) -> Vec<Owned> {
    let l = full.local;
    let active: Vec<u32> = (0..full.ranks).filter(|r| !masked.contains(r)).collect();
    active
        .iter()
        .map(|&g| {
            let mut o = ins[g as usize].clone();
            for id in &mut o.ids {
                if *id == NO_EXPERT {
                    continue;
                }
                let owner = *id / l;
                *id = match active.iter().position(|&a| a == owner) {
                    Some(a) => a as u32 * l + *id % l,
                    None => NO_EXPERT,
                };
            }
            o
        })
        .collect()
}

/// Every survivor of a dead peer fails its dispatch with a typed error (the
/// engine's, or a round's timeout) and is poisoned after it: `ranks[i]` is
/// whole-group rank `who[i]`, whose inputs are `ins[who[i]]`.
pub fn survivors_fail(ranks: &mut [weft_moe::MoeRank], who: &[usize], ins: &[Owned]) {
    use weft_moe::MoeError;
    std::thread::scope(|sc| {
        for (&r, rank) in who.iter().zip(ranks.iter_mut()) {
            sc.spawn(move || {
                let err = rank.dispatch(&ins[r].input()).expect_err("a peer is dead");
                assert!(
                    matches!(err, MoeError::Engine { .. } | MoeError::Timeout { .. }),
                    "rank {r}: {err}"
                );
                let again = rank.dispatch(&ins[r].input()).expect_err("poisoned");
                assert!(matches!(again, MoeError::Poisoned), "rank {r}: {again}");
            });
        }
    });
}
