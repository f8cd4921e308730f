//! [`build`]: a model config under a training and an inference layout
//! becomes the [`ModelLayout`] the planner takes.

use super::{Attn, InferLayout, ModelConfig, Naming, TrainLayout};
use crate::meta::{
    Box2, Concat, DType, InferTensor, Layout, ModelLayout, Placement, Quant, Rank, Segment,
    TrainParam,
};
use crate::RlError;

struct Builder {
    params: Vec<TrainParam>,
    t: TrainLayout,
}

impl Builder {
    fn tp(&self) -> u32 {
        self.t.tp.max(1)
    }
    fn stage_ranks(&self, s: u32) -> Vec<Rank> {
        let n = self.t.fsdp * self.t.ep * self.tp();
        (s * n..(s + 1) * n).collect()
    }
    /// FSDP over `ranks` (rows), and with training TP a `[.., tp]` mesh
    /// splitting the weight as its name says (see [`tp_split`]).
    /// HSDP replicas included: `ranks` (of replica 0) repeated in every
    /// replica, the replica the outermost (replicated) mesh dimension.
    fn layout(&self, name: &str, ranks: Vec<Rank>, rows: u64) -> Layout {
        let (tp, reps) = (self.tp(), self.t.replicas.max(1));
        if tp == 1 && reps == 1 {
            return Layout::fsdp(0, ranks, rows);
        }
        let n = self.t.replica_ranks();
        let outer = ranks.len() as u32 / tp;
        let (mut shape, mut placements) = (vec![outer], vec![Placement::Shard(0)]);
        if tp > 1 {
            shape.push(tp);
            placements.push(tp_split(name).map_or(Placement::Replicate, Placement::Shard));
        }
        if reps > 1 {
            shape.insert(0, reps);
            placements.insert(0, Placement::Replicate);
        }
        Layout::Mesh {
            shape,
            ranks: (0..reps)
                .flat_map(|r| ranks.iter().map(move |&x| r * n + x))
                .collect(),
            placements,
        }
    }
    fn dense(&mut self, name: String, rows: u64, cols: u64, stage: u32) -> usize {
        let layout = self.layout(&name, self.stage_ranks(stage), rows);
        self.params.push(TrainParam {
            name,
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: stage * (1 + self.t.ep),
            layout,
        });
        self.params.len() - 1
    }
    fn expert(&mut self, name: String, rows: u64, cols: u64, stage: u32, e: u64) -> usize {
        let j = (e % u64::from(self.t.ep)) as u32;
        let n = self.t.fsdp * self.tp();
        let base = stage * n * self.t.ep + j * n;
        let layout = self.layout(&name, (base..base + n).collect(), rows);
        self.params.push(TrainParam {
            name,
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: stage * (1 + self.t.ep) + 1 + j,
            layout,
        });
        self.params.len() - 1
    }
}

/// How training TP splits a weight this builder names (Megatron's
/// convention): column-parallel ones by rows (`Some(0)`), row-parallel
/// ones by columns (`Some(1)`), the rest (norms, routers, MLA's low-rank
/// down projections, row-parallel biases) replicated (`None`).
fn tp_split(name: &str) -> Option<u8> {
    const COLUMN: [&str; 11] = [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
        "q_b_proj.weight",
        "kv_b_proj.weight",
        "embed_tokens.weight",
    ];
    const ROW: [&str; 2] = ["o_proj.weight", "down_proj.weight"];
    let base = name.rsplit('.').take(2).collect::<Vec<_>>();
    let tail = match base.as_slice() {
        [last, prev] => format!("{prev}.{last}"),
        _ => name.to_string(),
    };
    if COLUMN.contains(&tail.as_str())
        || name == "lm_head.weight"
        || tail == "w1.weight"
        || tail == "w3.weight"
    {
        Some(0)
    } else if ROW.contains(&tail.as_str()) || tail == "w2.weight" {
        Some(1)
    } else {
        None
    }
}

fn full(rows: u64, cols: u64) -> Box2 {
    Box2 {
        rows: 0..rows,
        cols: 0..cols,
    }
}

/// The rows of attention heads TP rank `k` of `tp` holds: whole heads,
/// split as evenly as [`part`] splits them; with fewer heads than ranks
/// (GQA key/value heads under a large TP), each rank holds one head,
/// replicated over `tp / heads` ranks, as serving engines do.
fn head_rows(heads: u64, head_dim: u64, tp: u64, k: u64) -> std::ops::Range<u64> {
    if heads >= tp {
        let r = part(heads, tp, k);
        r.start * head_dim..r.end * head_dim
    } else {
        let head = k * heads / tp;
        head * head_dim..(head + 1) * head_dim
    }
}

fn part(n: u64, tp: u64, k: u64) -> std::ops::Range<u64> {
    let (q, r) = (n / tp, n % tp);
    let s = k * q + k.min(r);
    s..s + q + u64::from(k < r)
}

/// Parameter ids of one layer.
struct LayerIds {
    attn: Vec<usize>,
    norms: Vec<usize>,
    mlp: Option<[usize; 3]>,
    shared: Vec<[usize; 3]>,
    router: Vec<usize>,
    experts: Vec<[usize; 3]>,
    /// `q_proj`, `k_proj`, `v_proj` biases (Qwen2).
    bias: Vec<usize>,
}

/// Most trainer or inference ranks a layout may have.
const MAX_RANKS: u64 = 1 << 20;
/// Most parameters (tensors) a model may have.
const MAX_PARAMS: u64 = 1 << 24;
/// Most elements one parameter may have.
const MAX_ELEMS: u64 = 1 << 40;

/// Refuses sizes that would overflow the planner's arithmetic or exhaust
/// memory (a hostile or mistyped config or layout file), and tensor
/// parallel degrees that do not split attention heads whole.
fn check_scale(m: &ModelConfig, t: TrainLayout, inf: InferLayout) -> Result<(), RlError> {
    let bad = |what: String| Err(RlError::Layout(what));
    let trainers = u64::from(t.fsdp)
        * u64::from(t.pp)
        * u64::from(t.ep)
        * u64::from(t.tp)
        * u64::from(t.replicas);
    if trainers > MAX_RANKS || u64::from(inf.ranks) > MAX_RANKS {
        return bad(format!(
            "{trainers} trainers and {} inference ranks: at most {MAX_RANKS} each",
            inf.ranks
        ));
    }
    let per_layer = 16 + 3 * (m.experts + m.shared_experts);
    match m.layers.checked_mul(per_layer) {
        Some(n) if n <= MAX_PARAMS => {}
        _ => {
            return bad(format!(
                "{} layers of {per_layer} parameters: over {MAX_PARAMS}",
                m.layers
            ))
        }
    }
    let (rows, tp_heads) = match m.attn {
        Attn::Gqa {
            heads,
            kv_heads,
            head_dim,
        } => (heads.checked_mul(head_dim), Some((heads, kv_heads))),
        Attn::Mla {
            heads,
            q_lora,
            kv_lora,
            nope,
            rope,
            v,
        } => (
            heads
                .checked_mul(nope + rope.max(v))
                .map(|x| x.max(q_lora).max(kv_lora + rope)),
            Some((heads, heads)),
        ),
    };
    let widest = [
        rows,
        Some(m.vocab),
        Some(m.dense_inter),
        m.moe_inter.checked_mul(m.shared_experts.max(1)),
        Some(m.experts),
    ];
    for x in widest {
        match x.and_then(|x| x.checked_mul(m.hidden)) {
            Some(n) if n <= MAX_ELEMS => {}
            _ => {
                return bad(format!(
                    "a tensor of hidden size {} is over {MAX_ELEMS} elements",
                    m.hidden
                ))
            }
        }
    }
    let tp = u64::from(inf.attn_tp);
    if let Some((heads, kv)) = tp_heads {
        if !heads.is_multiple_of(tp) {
            return bad(format!("{heads} attention heads do not split over TP {tp}"));
        }
        if !(kv.is_multiple_of(tp) || tp.is_multiple_of(kv)) {
            return bad(format!(
                "{kv} key/value heads neither split over TP {tp} nor replicate evenly"
            ));
        }
    }
    Ok(())
}

/// Builds the [`ModelLayout`] of `m` under the given layouts.
pub fn build(m: &ModelConfig, t: TrainLayout, inf: InferLayout) -> Result<ModelLayout, RlError> {
    if t.fsdp == 0
        || t.pp == 0
        || t.ep == 0
        || t.tp == 0
        || t.replicas == 0
        || inf.ranks == 0
        || inf.instance == 0
        || inf.attn_tp == 0
        || inf.pp == 0
    {
        return Err(RlError::Layout("degrees must be > 0".into()));
    }
    if !inf.ranks.is_multiple_of(inf.instance)
        || !inf.instance.is_multiple_of(inf.pp)
        || !(inf.instance / inf.pp).is_multiple_of(inf.attn_tp)
    {
        return Err(RlError::Layout(format!(
            "{} inference ranks do not split into instances of {} in {} stages with TP {}",
            inf.ranks, inf.instance, inf.pp, inf.attn_tp
        )));
    }
    if u64::from(inf.pp) > m.layers {
        return Err(RlError::Layout(format!(
            "{} inference stages for {} layers",
            inf.pp, m.layers
        )));
    }
    check_scale(m, t, inf)?;
    let h = m.hidden;
    let mut b = Builder {
        params: Vec::new(),
        t,
    };
    let stage_of = |l: u64| ((l * u64::from(t.pp)) / m.layers) as u32;
    let embed = b.dense("model.embed_tokens.weight".into(), m.vocab, h, 0);
    let mut layers = Vec::new();
    for l in 0..m.layers {
        let s = stage_of(l);
        let p = format!("model.layers.{l}");
        let mut ids = LayerIds {
            attn: Vec::new(),
            norms: Vec::new(),
            mlp: None,
            shared: Vec::new(),
            router: Vec::new(),
            experts: Vec::new(),
            bias: Vec::new(),
        };
        match m.attn {
            Attn::Gqa {
                heads,
                kv_heads,
                head_dim,
            } => {
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.q_proj.weight"),
                    heads * head_dim,
                    h,
                    s,
                ));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.k_proj.weight"),
                    kv_heads * head_dim,
                    h,
                    s,
                ));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.v_proj.weight"),
                    kv_heads * head_dim,
                    h,
                    s,
                ));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.o_proj.weight"),
                    h,
                    heads * head_dim,
                    s,
                ));
                if m.qkv_bias {
                    for (x, n) in [("q", heads), ("k", kv_heads), ("v", kv_heads)] {
                        ids.bias.push(b.dense(
                            format!("{p}.self_attn.{x}_proj.bias"),
                            n * head_dim,
                            1,
                            s,
                        ));
                    }
                }
                if m.o_bias {
                    // Row-parallel o_proj: its bias is whole on every rank.
                    let o = b.dense(format!("{p}.self_attn.o_proj.bias"), h, 1, s);
                    ids.norms.push(o);
                }
                if m.qk_norm {
                    ids.norms
                        .push(b.dense(format!("{p}.self_attn.q_norm.weight"), head_dim, 1, s));
                    ids.norms
                        .push(b.dense(format!("{p}.self_attn.k_norm.weight"), head_dim, 1, s));
                }
            }
            Attn::Mla {
                heads,
                q_lora,
                kv_lora,
                nope,
                rope,
                v,
            } => {
                ids.attn
                    .push(b.dense(format!("{p}.self_attn.q_a_proj.weight"), q_lora, h, s));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
                    kv_lora + rope,
                    h,
                    s,
                ));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.q_b_proj.weight"),
                    heads * (nope + rope),
                    q_lora,
                    s,
                ));
                ids.attn.push(b.dense(
                    format!("{p}.self_attn.kv_b_proj.weight"),
                    heads * (nope + v),
                    kv_lora,
                    s,
                ));
                ids.attn
                    .push(b.dense(format!("{p}.self_attn.o_proj.weight"), h, heads * v, s));
                ids.norms.push(b.dense(
                    format!("{p}.self_attn.q_a_layernorm.weight"),
                    q_lora,
                    1,
                    s,
                ));
                ids.norms.push(b.dense(
                    format!("{p}.self_attn.kv_a_layernorm.weight"),
                    kv_lora,
                    1,
                    s,
                ));
            }
        }
        ids.norms
            .push(b.dense(format!("{p}.input_layernorm.weight"), h, 1, s));
        ids.norms
            .push(b.dense(format!("{p}.post_attention_layernorm.weight"), h, 1, s));
        if l < m.dense_layers || m.experts == 0 {
            let i = m.dense_inter;
            ids.mlp = Some([
                b.dense(format!("{p}.mlp.gate_proj.weight"), i, h, s),
                b.dense(format!("{p}.mlp.up_proj.weight"), i, h, s),
                b.dense(format!("{p}.mlp.down_proj.weight"), h, i, s),
            ]);
        } else {
            let i = m.moe_inter;
            let (moe, [gn, un, dn]) = match m.naming {
                Naming::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
            };
            ids.router
                .push(b.dense(format!("{p}.{moe}.gate.weight"), m.experts, h, s));
            if matches!(m.attn, Attn::Mla { .. }) {
                ids.router.push(b.dense(
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    m.experts,
                    1,
                    s,
                ));
            }
            if m.shared_experts > 0 {
                let si = i * m.shared_experts;
                ids.shared.push([
                    b.dense(format!("{p}.mlp.shared_experts.gate_proj.weight"), si, h, s),
                    b.dense(format!("{p}.mlp.shared_experts.up_proj.weight"), si, h, s),
                    b.dense(format!("{p}.mlp.shared_experts.down_proj.weight"), h, si, s),
                ]);
            }
            for e in 0..m.experts {
                ids.experts.push([
                    b.expert(format!("{p}.{moe}.experts.{e}.{gn}.weight"), i, h, s, e),
                    b.expert(format!("{p}.{moe}.experts.{e}.{un}.weight"), i, h, s, e),
                    b.expert(format!("{p}.{moe}.experts.{e}.{dn}.weight"), h, i, s, e),
                ]);
            }
        }
        layers.push(ids);
    }
    let last = t.pp - 1;
    let norm = b.dense("model.norm.weight".into(), h, 1, last);
    let head = (!m.tied_embeddings).then(|| b.dense("lm_head.weight".into(), m.vocab, h, last));

    // Inference side.
    let params = b.params;
    let seg = |p: usize, rows: std::ops::Range<u64>, cols: std::ops::Range<u64>| Segment {
        param: p,
        src: Box2 { rows, cols },
    };
    let whole = |p: usize| Segment {
        param: p,
        src: full(params[p].rows, params[p].cols),
    };
    let tensor = |name: String, segments: Vec<Segment>, quant: Quant| InferTensor {
        name,
        segments,
        quant,
        concat: Concat::Rows,
        block: None,
    };
    let mut inference = Vec::with_capacity(inf.ranks as usize);
    let tp = u64::from(inf.attn_tp);
    // An instance's GPUs split into `pp` stages; attention TP and the
    // experts split over a stage's GPUs.
    let stage_gpus = u64::from(inf.instance / inf.pp);
    let ipp = u64::from(inf.pp);
    let per = m.experts.div_ceil(stage_gpus);
    let inf_stage = |l: u64| l * ipp / m.layers;
    for r in 0..inf.ranks {
        let in_instance = u64::from(r % inf.instance);
        let stage = in_instance / stage_gpus;
        let local = in_instance % stage_gpus;
        let k = local % tp;
        let mut ts = Vec::new();
        let rows_of = |p: usize| part(params[p].rows, tp, k);
        let cols_of = |p: usize| part(params[p].cols, tp, k);
        if stage == 0 {
            ts.push(tensor(
                "embed_tokens".into(),
                vec![seg(embed, rows_of(embed), 0..h)],
                Quant::None,
            ));
        }
        for (l, ids) in layers.iter().enumerate() {
            if inf_stage(l as u64) != stage {
                continue;
            }
            let p = format!("layers.{l}");
            let n = |x: &str| format!("{p}.{x}");
            match m.attn {
                Attn::Gqa {
                    heads,
                    kv_heads,
                    head_dim,
                } => {
                    let (q, kk, v, o) = (ids.attn[0], ids.attn[1], ids.attn[2], ids.attn[3]);
                    let (qr, kvr) = (
                        head_rows(heads, head_dim, tp, k),
                        head_rows(kv_heads, head_dim, tp, k),
                    );
                    ts.push(tensor(
                        n("qkv_proj"),
                        vec![
                            seg(q, qr.clone(), 0..h),
                            seg(kk, kvr.clone(), 0..h),
                            seg(v, kvr.clone(), 0..h),
                        ],
                        Quant::Fp8Block,
                    ));
                    if let [qb, kb, vb] = ids.bias[..] {
                        ts.push(tensor(
                            n("qkv_proj.bias"),
                            vec![
                                seg(qb, qr, 0..1),
                                seg(kb, kvr.clone(), 0..1),
                                seg(vb, kvr, 0..1),
                            ],
                            Quant::None,
                        ));
                    }
                    ts.push(tensor(
                        n("o_proj"),
                        vec![seg(o, 0..h, cols_of(o))],
                        Quant::Fp8Block,
                    ));
                }
                Attn::Mla { .. } => {
                    let (qa, kva, qb, kvb, o) = (
                        ids.attn[0],
                        ids.attn[1],
                        ids.attn[2],
                        ids.attn[3],
                        ids.attn[4],
                    );
                    ts.push(tensor(
                        n("fused_qkv_a_proj"),
                        vec![whole(qa), whole(kva)],
                        Quant::Fp8Block,
                    ));
                    let qbc = params[qb].cols;
                    ts.push(tensor(
                        n("q_b_proj"),
                        vec![seg(qb, rows_of(qb), 0..qbc)],
                        Quant::Fp8Block,
                    ));
                    let kvc = params[kvb].cols;
                    ts.push(tensor(
                        n("kv_b_proj"),
                        vec![seg(kvb, rows_of(kvb), 0..kvc)],
                        Quant::Fp8Block,
                    ));
                    ts.push(tensor(
                        n("o_proj"),
                        vec![seg(o, 0..h, cols_of(o))],
                        Quant::Fp8Block,
                    ));
                }
            }
            for &x in &ids.norms {
                ts.push(tensor(params[x].name.clone(), vec![whole(x)], Quant::None));
            }
            let mlp = |name: &str, [g, u, d]: [usize; 3], ts: &mut Vec<InferTensor>| {
                ts.push(tensor(
                    n(&format!("{name}.gate_up_proj")),
                    vec![seg(g, rows_of(g), 0..h), seg(u, rows_of(u), 0..h)],
                    Quant::Fp8Block,
                ));
                ts.push(tensor(
                    n(&format!("{name}.down_proj")),
                    vec![seg(d, 0..h, cols_of(d))],
                    Quant::Fp8Block,
                ));
            };
            if let Some(x) = ids.mlp {
                mlp("mlp", x, &mut ts);
            }
            for &x in &ids.shared {
                mlp("shared_experts", x, &mut ts);
            }
            for &x in &ids.router {
                ts.push(tensor(params[x].name.clone(), vec![whole(x)], Quant::None));
            }
            if !ids.experts.is_empty() {
                let e0 = local * per;
                let e1 = ((local + 1) * per).min(m.experts);
                if e0 < e1 {
                    let mine = &ids.experts[e0 as usize..e1 as usize];
                    ts.push(tensor(
                        n("experts.w13"),
                        mine.iter()
                            .flat_map(|[g, u, _]| [whole(*g), whole(*u)])
                            .collect(),
                        Quant::Fp8Block,
                    ));
                    ts.push(tensor(
                        n("experts.w2"),
                        mine.iter().map(|[_, _, d]| whole(*d)).collect(),
                        Quant::Fp8Block,
                    ));
                }
            }
        }
        if stage + 1 == ipp {
            ts.push(tensor("norm".into(), vec![whole(norm)], Quant::None));
            // Tied embeddings: a last stage that does not hold the
            // embedding holds it as its LM head.
            let head = head.or((m.tied_embeddings && stage > 0).then_some(embed));
            if let Some(head) = head {
                ts.push(tensor(
                    "lm_head".into(),
                    vec![seg(head, rows_of(head), 0..h)],
                    Quant::None,
                ));
            }
        }
        inference.push(ts);
    }
    Ok(ModelLayout {
        trainers: t.ranks(),
        params,
        inference,
    })
}
