//! Property tests of the routing planner: exact coverage, bounds, balance,
//! determinism, and the bytes that land (an in-memory execution of the plan
//! compared against an independent reference, fp8 included).

use crate::common::{random_layout, reference_region, trainer_image};
use proptest::prelude::*;
use std::collections::BTreeMap;
use weft_rl::{plan, Plan, PlanConfig, Quant, Run, Xfer};

fn pages(r: &Run) -> impl Iterator<Item = std::ops::Range<u64>> + '_ {
    (0..r.count).map(move |k| r.offset + k * r.stride..r.offset + k * r.stride + r.page_len)
}

fn apply(x: &Xfer, src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        x.src.page_len, x.dst.page_len,
        "xfer sides differ in page length: {x:?}"
    );
    assert_eq!(
        x.src.count, x.dst.count,
        "xfer sides differ in page count: {x:?}"
    );
    for (s, d) in pages(&x.src).zip(pages(&x.dst)) {
        dst[d.start as usize..d.end as usize]
            .copy_from_slice(&src[s.start as usize..s.end as usize]);
    }
}

/// Executes the plan in memory: what the inference regions hold afterwards.
fn execute(p: &Plan, step: u64) -> Vec<Vec<u8>> {
    let imgs: Vec<Vec<u8>> = (0..p.trainers.len())
        .map(|t| trainer_image(p, t, step))
        .collect();
    let mut inf: Vec<Vec<u8>> = p
        .inference
        .iter()
        .map(|r| vec![0u8; r.len as usize])
        .collect();
    for u in &p.units {
        let w = u.writer as usize;
        match u.arena {
            None => {
                for d in &u.dests {
                    apply(&d.data, &imgs[w], &mut inf[d.inf as usize]);
                }
            }
            Some((off, len)) => {
                let mut arena = vec![0u8; p.arena_len as usize];
                assert!(off + len <= p.arena_len);
                for x in &u.local {
                    apply(x, &imgs[w], &mut arena);
                }
                for g in &u.gathers {
                    assert_ne!(g.from, u.writer);
                    apply(&g.xfer, &imgs[g.from as usize], &mut arena);
                }
                let (h, wd) = (u.src.height() as usize, u.src.width() as usize);
                let box_bytes = h * wd * 2;
                let d0 = &u.dests[0];
                let qo = d0.data.src.offset as usize;
                let so = d0
                    .scales
                    .as_ref()
                    .map(|s| s.src.offset as usize)
                    .unwrap_or(0);
                let sl = d0
                    .scales
                    .as_ref()
                    .map(|s| s.src.bytes() as usize)
                    .unwrap_or(0);
                let src = arena[off as usize..off as usize + box_bytes].to_vec();
                let mut q = vec![0u8; h * wd];
                let mut sc = vec![0u8; sl];
                let fp8 = u.quant == Quant::Fp8Block;
                assert!(
                    !fp8 || weft_rl::fp8::quantize_block(
                        &src,
                        h,
                        wd,
                        p.unit_block(u) as usize,
                        &mut q,
                        &mut sc
                    )
                );
                if fp8 {
                    arena[qo..qo + h * wd].copy_from_slice(&q);
                    arena[so..so + sl].copy_from_slice(&sc);
                }
                for d in &u.dests {
                    for x in d.xfers() {
                        apply(x, &arena, &mut inf[d.inf as usize]);
                    }
                }
            }
        }
    }
    inf
}

fn check(
    seed: u64,
    unit_bytes: u64,
    watermark: u64,
    min_direct_bytes: u64,
    ramp: u32,
) -> Result<(), TestCaseError> {
    let block = 4;
    let m = random_layout(seed, block);
    let cfg = PlanConfig {
        block,
        unit_bytes,
        align: 8,
        watermark,
        ramp,
        min_direct_bytes,
    };
    check_model(&m, &cfg, seed)
}

/// Plans `m` under `cfg` and checks the plan: deterministic, every byte of
/// every inference tensor written exactly once, arenas and waves within
/// bounds, the balance certificate, and the bytes that land (executed in
/// memory against the reference). A plan refused for the watermark passes.
pub(crate) fn check_model(
    m: &weft_rl::ModelLayout,
    cfg: &PlanConfig,
    seed: u64,
) -> Result<(), TestCaseError> {
    let (m, cfg) = (m, *cfg);
    let p = match plan(m, &cfg) {
        Ok(p) => p,
        Err(weft_rl::RlError::Plan(msg)) if msg.contains("watermark") => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("plan failed: {e}"))),
    };
    // Deterministic.
    prop_assert_eq!(&p, &plan(m, &cfg).unwrap());

    // Every byte of every inference tensor (and scales) written exactly
    // once; nothing outside the tensors or the region.
    for (i, reg) in p.inference.iter().enumerate() {
        let mut cover = vec![0u32; reg.len as usize];
        for (_, x) in p.writes_to(i as u32) {
            prop_assert!(x.dst.end() <= reg.len, "write past region {i}: {:?}", x);
            for r in pages(&x.dst) {
                for b in r {
                    cover[b as usize] += 1;
                }
            }
        }
        let mut inside = vec![false; reg.len as usize];
        for t in &reg.tensors {
            for (o, l) in std::iter::once(t.data).chain(t.scales) {
                for b in o..o + l {
                    inside[b as usize] = true;
                }
            }
        }
        for b in 0..reg.len as usize {
            prop_assert_eq!(cover[b], u32::from(inside[b]), "inference {} byte {}", i, b);
        }
    }

    // Sources inside their regions; arenas exactly assembled; waves within
    // the watermark and disjoint per writer.
    let mut wave_use: BTreeMap<(u32, u32, u32), Vec<(u64, u64)>> = BTreeMap::new();
    for u in &p.units {
        prop_assert!(u.eligible.contains(&u.writer));
        match u.arena {
            None => {
                for d in &u.dests {
                    prop_assert!(d.data.src.end() <= p.trainers[u.writer as usize].len);
                }
                prop_assert!(u.gathers.is_empty() && u.local.is_empty());
            }
            Some((off, len)) => {
                prop_assert!(off + len <= cfg.watermark);
                let bb = u.src.elems() * 2;
                let mut cover = vec![0u32; bb as usize];
                for x in u.local.iter().chain(u.gathers.iter().map(|g| &g.xfer)) {
                    for r in pages(&x.dst) {
                        prop_assert!(r.start >= off && r.end <= off + bb);
                        for b in r {
                            cover[(b - off) as usize] += 1;
                        }
                    }
                }
                for g in &u.gathers {
                    prop_assert!(g.xfer.src.end() <= p.trainers[g.from as usize].len);
                }
                prop_assert!(cover.iter().all(|&c| c == 1), "arena box not covered once");
                for d in &u.dests {
                    for x in d.xfers() {
                        if u.quant == Quant::Fp8Block {
                            prop_assert!(x.src.offset >= off + bb && x.src.end() <= off + len);
                        } else {
                            prop_assert!(x.src.offset >= off && x.src.end() <= off + bb);
                        }
                    }
                }
                wave_use
                    .entry((u.mesh_group, u.wave, u.writer))
                    .or_default()
                    .push((off, off + len));
            }
        }
    }
    for ((_, wave, _), v) in wave_use.iter_mut() {
        v.sort_unstable();
        for w in v.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "arena slots overlap in a wave");
        }
        // Within the wave's budget (ramp-up waves smaller), unless one
        // unit alone is over it.
        let used = v.last().map_or(0, |s| s.1);
        let budget = cfg.wave_budget(*wave as usize);
        prop_assert!(
            used <= budget || v.len() == 1,
            "wave {} uses {} B of a {} B budget",
            wave,
            used,
            budget
        );
    }

    // Balance certificate (per mesh group): a rank's load minus its last
    // flexible unit is at most the load of every rank that could take it.
    let mut load: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    for u in &p.units {
        *load.entry((u.mesh_group, u.writer)).or_default() += u.dest_bytes();
    }
    let mut last: BTreeMap<(u32, u32), &weft_rl::Unit> = BTreeMap::new();
    for u in p.units.iter().filter(|u| u.eligible.len() > 1) {
        let e = last.entry((u.mesh_group, u.writer)).or_insert(u);
        if u.assign_seq > e.assign_seq {
            *e = u;
        }
    }
    for ((g, r), u) in &last {
        let mine = load[&(*g, *r)] - u.dest_bytes();
        for s in &u.eligible {
            let theirs = load.get(&(*g, *s)).copied().unwrap_or(0);
            prop_assert!(
                mine <= theirs,
                "group {} rank {} load {} - {} > rank {} load {}",
                g,
                r,
                load[&(*g, *r)],
                u.dest_bytes(),
                s,
                theirs
            );
        }
    }

    // The bytes: the plan, executed in memory, gives the reference.
    let got = execute(&p, 7);
    for (i, g) in got.iter().enumerate() {
        let want = reference_region(m, &p, i, 7);
        for (b, w) in want.iter().enumerate() {
            if let Some(w) = w {
                prop_assert_eq!(g[b], *w, "inference {} byte {} (seed {})", i, b, seed);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn plan_covers_every_byte_once(seed in any::<u64>(), unit in 2u64..400, wm in 64u64..8192, direct in 0u64..64, ramp in 0u32..4) {
        check(seed, unit, wm, direct, ramp)?;
    }
}

/// The balance bound's corollary: one holder set, `max - min ≤` largest unit.
#[test]
fn replicated_params_spread_evenly() {
    use weft_rl::meta::*;
    let params = (0..7)
        .map(|i| TrainParam {
            name: format!("w{i}"),
            rows: 100 + 37 * i,
            cols: 64,
            dtype: DType::Bf16,
            mesh_group: 0,
            layout: Layout::Replicate {
                ranks: vec![0, 1, 2, 3, 4],
            },
        })
        .collect::<Vec<_>>();
    let inference = vec![(0..7)
        .map(|i| InferTensor {
            name: format!("w{i}"),
            segments: vec![Segment {
                param: i,
                src: Box2 {
                    rows: 0..100 + 37 * i as u64,
                    cols: 0..64,
                },
            }],
            concat: weft_rl::meta::Concat::Rows,
            quant: Quant::None,
            block: None,
        })
        .collect()];
    let m = ModelLayout {
        trainers: 5,
        params,
        inference,
    };
    let cfg = PlanConfig {
        unit_bytes: 4096,
        ..PlanConfig::default()
    };
    let p = plan(&m, &cfg).unwrap();
    let l = p.trainer_load();
    let max_unit = p.units.iter().map(|u| u.dest_bytes()).max().unwrap();
    let (mx, mn) = (*l.iter().max().unwrap(), *l.iter().min().unwrap());
    assert!(mx - mn <= max_unit, "loads {l:?}, largest unit {max_unit}");
}

/// The fp8 conversion matches the exhaustive-search reference on every
/// bf16 value in range.
#[test]
fn e4m3_conversion_matches_reference() {
    for b in 0u16..=0xFFFF {
        let x = weft_rl::fp8::bf16_to_f32(b);
        if !x.is_finite() {
            continue;
        }
        let got = weft_rl::fp8::f32_to_e4m3(x);
        let want = crate::common::ref_e4m3(x);
        assert_eq!(got, want, "bf16 {b:#06x} = {x}");
        if got & 0x7F != 0x7F {
            let back = weft_rl::fp8::e4m3_to_f32(got);
            assert!(
                (back - x.clamp(-448.0, 448.0)).abs() <= x.abs().max(1e-3) * 0.07 + 2f32.powi(-10)
            );
        }
    }
}

fn mesh_param(
    rows: u64,
    cols: u64,
    shape: Vec<u32>,
    ranks: Vec<u32>,
    placements: Vec<weft_rl::Placement>,
) -> weft_rl::ModelLayout {
    use weft_rl::meta::*;
    ModelLayout {
        trainers: ranks.iter().max().map_or(1, |m| m + 1),
        params: vec![TrainParam {
            name: "w".into(),
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: 0,
            layout: Layout::Mesh {
                shape,
                ranks,
                placements,
            },
        }],
        inference: vec![],
    }
}

/// `(holders, rows, cols)` of a piece.
type Piece = (Vec<u32>, (u64, u64), (u64, u64));

fn boxes(m: &weft_rl::ModelLayout) -> Vec<Piece> {
    m.pieces(0)
        .into_iter()
        .map(|(h, b)| (h, (b.rows.start, b.rows.end), (b.cols.start, b.cols.end)))
        .collect()
}

/// DTensor placements on 2-D meshes: FSDP × TP grids, nested shards of
/// one dimension (outer mesh dimension first, `torch.chunk` sizes), HSDP
/// replicas grouped as holders of one box.
#[test]
fn mesh_layouts_place_boxes_as_dtensor() {
    use weft_rl::Placement::{Replicate, Shard};
    // FSDP 2 (rows) × TP 2 (cols) of 5 × 3.
    let m = mesh_param(5, 3, vec![2, 2], vec![0, 1, 2, 3], vec![Shard(0), Shard(1)]);
    assert_eq!(
        boxes(&m),
        vec![
            (vec![0], (0, 3), (0, 2)),
            (vec![1], (0, 3), (2, 3)),
            (vec![2], (3, 5), (0, 2)),
            (vec![3], (3, 5), (2, 3)),
        ]
    );
    // Rows 10 split over 2, each half over 3: chunk sizes 5 → 2, 2, 1.
    let m = mesh_param(
        10,
        1,
        vec![2, 3],
        (0..6).collect(),
        vec![Shard(0), Shard(0)],
    );
    let rows: Vec<(u64, u64)> = boxes(&m).into_iter().map(|b| b.1).collect();
    assert_eq!(rows, vec![(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10)]);
    // HSDP: replicas on the outer dimension hold the same shard.
    let m = mesh_param(
        4,
        2,
        vec![2, 2],
        vec![5, 6, 7, 8],
        vec![Replicate, Shard(0)],
    );
    assert_eq!(
        boxes(&m),
        vec![(vec![5, 7], (0, 2), (0, 2)), (vec![6, 8], (2, 4), (0, 2))]
    );
    // torch.chunk leaves trailing ranks empty: 2 rows over 4 → 1, 1, -, -.
    let m = mesh_param(2, 2, vec![4], vec![0, 1, 2, 3], vec![Shard(0)]);
    assert_eq!(boxes(&m).len(), 2);
    assert!(m.validate(128).is_ok());
}

/// Meshes that do not describe a layout are typed errors, not panics.
#[test]
fn malformed_meshes_are_refused() {
    use weft_rl::Placement::{Replicate, Shard};
    for (shape, ranks, pl) in [
        (vec![3], vec![0, 1], vec![Shard(0)]),
        (vec![2, 0], vec![0, 1], vec![Shard(0), Replicate]),
        (vec![2], vec![0, 1], vec![Shard(0), Replicate]),
        (vec![2], vec![0, 0], vec![Shard(0)]),
        (vec![2], vec![0, 1], vec![Shard(2)]),
    ] {
        let m = mesh_param(4, 4, shape.clone(), ranks, pl);
        match m.validate(128) {
            Err(weft_rl::RlError::Layout(_)) => {}
            other => panic!("mesh {shape:?}: {other:?}"),
        }
    }
}

/// Source dtypes: f32 parameters plan with 4-byte elements; one fused
/// tensor mixing dtypes, and fp8 from f32, are refused — or, for fp8,
/// kept unquantised by the explicit fallback, which also catches fused
/// segments that are not whole tiles; the plan's slots then say bf16/f32.
#[test]
fn f32_sources_and_the_fp8_fallback() {
    use weft_rl::meta::*;
    let p = |name: &str, rows, dtype| TrainParam {
        name: name.into(),
        rows,
        cols: 8,
        dtype,
        mesh_group: 0,
        layout: Layout::Replicate { ranks: vec![0] },
    };
    let seg = |param, rows: u64| Segment {
        param,
        src: Box2 {
            rows: 0..rows,
            cols: 0..8,
        },
    };
    let t = |name: &str, segments, quant| InferTensor {
        name: name.into(),
        segments,
        quant,
        concat: weft_rl::meta::Concat::Rows,
        block: None,
    };
    let base = |inference| ModelLayout {
        trainers: 1,
        params: vec![
            p("a", 8, DType::Bf16),
            p("b", 6, DType::Bf16),
            p("f", 4, DType::F32),
        ],
        inference,
    };
    let cfg = PlanConfig {
        block: 4,
        ..PlanConfig::default()
    };
    // f32 straight through: 4 bytes an element.
    let ok = plan(
        &base(vec![vec![t("f", vec![seg(2, 4)], Quant::None)]]),
        &cfg,
    )
    .unwrap();
    assert_eq!(ok.inference[0].tensors[0].data.1, 4 * 8 * 4);
    for bad in [
        vec![t("mix", vec![seg(0, 8), seg(2, 4)], Quant::None)],
        vec![t("f8", vec![seg(2, 4)], Quant::Fp8Block)],
        vec![t("ragged", vec![seg(1, 6), seg(0, 8)], Quant::Fp8Block)],
    ] {
        let name = bad[0].name.clone();
        match plan(&base(vec![bad]), &cfg) {
            Err(weft_rl::RlError::Layout(_)) => {}
            other => panic!("{name}: {other:?}"),
        }
    }
    let mut m = base(vec![vec![
        t("f8", vec![seg(2, 4)], Quant::Fp8Block),
        t("ragged", vec![seg(1, 6), seg(0, 8)], Quant::Fp8Block),
        t("tiles", vec![seg(0, 8), seg(1, 6)], Quant::Fp8Block),
    ]]);
    let fb = m.fp8_fallback(4);
    let names: Vec<&str> = fb.iter().map(|f| f.tensor.as_str()).collect();
    assert_eq!(names, ["f8", "ragged"]);
    assert!(fb[1].reason.contains("6 rows"), "{}", fb[1].reason);
    let p = plan(&m, &cfg).unwrap();
    let q: Vec<Quant> = p.inference[0].tensors.iter().map(|s| s.quant).collect();
    assert_eq!(q, [Quant::None, Quant::None, Quant::Fp8Block]);
    // A second pass changes nothing.
    assert!(m.fp8_fallback(4).is_empty());
}

/// Inference tensors joined side by side (`Concat::Cols`): a row-parallel
/// weight at inference TP 2 assembled from training TP 4's four column
/// shards, each its own parameter (as per-rank checkpoint tensors are),
/// stored bf16 and fp8; every byte and scale against the reference; a
/// segment that is not whole tiles wide is refused for fp8 or, with the
/// fallback, kept bf16; segments of different heights are refused.
#[test]
fn column_joined_tensors_land_beside_each_other() {
    use weft_rl::meta::*;
    // Four column shards of an 12 x 40 weight: 8, 12, 12 and 8 columns.
    let widths = [8u64, 12, 12, 8];
    let params: Vec<TrainParam> = widths
        .iter()
        .enumerate()
        .map(|(r, &w)| TrainParam {
            name: format!("o_proj.tp{r}"),
            rows: 12,
            cols: w,
            dtype: DType::Bf16,
            mesh_group: 0,
            layout: Layout::fsdp(0, vec![2 * r as u32, 2 * r as u32 + 1], 12),
        })
        .collect();
    let seg = |param: usize, rows: std::ops::Range<u64>| Segment {
        param,
        src: Box2 {
            rows,
            cols: 0..widths[param],
        },
    };
    let t = |name: &str, segments, quant| InferTensor {
        name: name.into(),
        segments,
        concat: Concat::Cols,
        quant,
        block: None,
    };
    let m = |inference| ModelLayout {
        trainers: 8,
        params: params.clone(),
        inference,
    };
    let cfg = PlanConfig {
        block: 4,
        unit_bytes: 64,
        align: 8,
        ..PlanConfig::default()
    };
    // Inference rank i holds shards 2i and 2i+1 side by side, bf16 and
    // fp8 (4-wide tiles: 8 and 12 are whole tiles).
    let good = m((0..2)
        .map(|i| {
            vec![
                t(
                    "o",
                    vec![seg(2 * i, 0..12), seg(2 * i + 1, 0..12)],
                    Quant::None,
                ),
                t(
                    "o.fp8",
                    vec![seg(2 * i, 0..12), seg(2 * i + 1, 0..12)],
                    Quant::Fp8Block,
                ),
            ]
        })
        .collect());
    let p = plan(&good, &cfg).unwrap();
    assert_eq!(
        (
            p.inference[0].tensors[0].rows,
            p.inference[0].tensors[0].cols
        ),
        (12, 20)
    );
    check_model(&good, &cfg, 0).unwrap();
    // fp8 with a first segment 6 wide (not whole 4-wide tiles).
    let ragged = |quant| {
        m(vec![vec![t(
            "r",
            vec![
                Segment {
                    param: 1,
                    src: Box2 {
                        rows: 0..12,
                        cols: 0..6,
                    },
                },
                seg(0, 0..12),
            ],
            quant,
        )]])
    };
    match plan(&ragged(Quant::Fp8Block), &cfg) {
        Err(weft_rl::RlError::Layout(msg)) => assert!(msg.contains("6 columns"), "{msg}"),
        other => panic!("ragged fp8: {other:?}"),
    }
    let mut fb = ragged(Quant::Fp8Block);
    let f = fb.fp8_fallback(4);
    assert!(f.len() == 1 && f[0].reason.contains("6 columns"), "{f:?}");
    check_model(&fb, &cfg, 0).unwrap();
    check_model(&ragged(Quant::None), &cfg, 0).unwrap();
    // Side by side, the segments share one height.
    match plan(
        &m(vec![vec![t(
            "h",
            vec![seg(0, 0..12), seg(1, 0..8)],
            Quant::None,
        )]]),
        &cfg,
    ) {
        Err(weft_rl::RlError::Layout(msg)) => assert!(msg.contains("another height"), "{msg}"),
        other => panic!("uneven heights: {other:?}"),
    }
}
