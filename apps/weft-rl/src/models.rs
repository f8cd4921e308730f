//! Parameter tables of real models, from their published `config.json`
//! files (numbers copied here; no weights), and the parallel layouts we
//! plan them for.
//!
//! | model | config | layers | hidden | heads | experts (top-k) | moe inter | dense inter | vocab |
//! |---|---|---|---|---|---|---|---|---|
//! | Qwen3-235B-A22B | `Qwen/Qwen3-235B-A22B/config.json` (`Qwen3MoeForCausalLM`) | 94 | 4096 | 64 q / 4 kv, head_dim 128 | 128 (8) | 1536 | — (every layer MoE) | 151936 |
//! | DeepSeek-V3 | `deepseek-ai/DeepSeek-V3/config.json` (`DeepseekV3ForCausalLM`) | 61 (3 dense) | 7168 | 128, MLA q_lora 1536, kv_lora 512, nope 128, rope 64, v 128 | 256 + 1 shared (8) | 2048 | 18432 | 129280 |
//! | Kimi-K2 | `moonshotai/Kimi-K2-Instruct/config.json` (`DeepseekV3ForCausalLM`) | 61 (1 dense) | 7168 | 64, MLA as DeepSeek-V3 | 384 + 1 shared (8) | 2048 | 18432 | 163840 |
//!
//! Not modelled: DeepSeek-V3's multi-token-prediction layer (not loaded by
//! the serving engines we target), rotary tables (not weights). Router
//! score-correction biases (f32 in the checkpoints) are carried as bf16
//! vectors. Every linear weight of the decoder layers is an fp8 target with
//! 128×128 block scales (as the FP8 checkpoints of all three store them);
//! embeddings, `lm_head`, norms and routers stay bf16.
//!
//! **Training layout** ([`TrainLayout`], the paper's FSDP/PP/EP): pipeline
//! stage `s` owns a contiguous half of the layers (stage 0 also the
//! embedding, the last stage the final norm and `lm_head`) and ranks
//! `s*F*E .. (s+1)*F*E`. Non-expert parameters are FSDP-sharded
//! (`Shard(0)`, torch chunk sizes) over all `F*E` ranks of their stage;
//! routed expert `e` lives on EP index `e % E` and is FSDP-sharded over the
//! `F` ranks of that index. Mesh groups: per stage, one for the non-expert
//! parameters and one per EP index.
//!
//! **Inference layout** ([`InferLayout`]): `ranks` GPUs in instances of
//! `instance` GPUs; routed experts are split evenly (whole experts) over an
//! instance's ranks; attention, dense MLPs, shared experts and
//! vocabularies are tensor-parallel over groups of `attn_tp` ranks
//! (column-parallel rows, row-parallel columns, vocab rows), replicated
//! across the groups; the MLA down-projections (`q_a_proj` and
//! `kv_a_proj_with_mqa`, fused into one tensor) and all norms are
//! replicated. Fused targets: `qkv_proj` (q/k/v), `gate_up_proj`,
//! `fused_qkv_a_proj`, stacked `experts.w13` (gate_e, up_e for each local
//! expert) and `experts.w2`.

use crate::meta::{
    Box2, DType, InferTensor, Layout, ModelLayout, Quant, Rank, Segment, TrainParam,
};
use crate::RlError;

/// Attention flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attn {
    /// Grouped-query attention with q/k norms (Qwen3).
    Gqa {
        /// Query heads.
        heads: u64,
        /// Key/value heads.
        kv_heads: u64,
        /// Head dimension.
        head_dim: u64,
    },
    /// Multi-head latent attention (DeepSeek-V3, Kimi-K2).
    Mla {
        /// Heads.
        heads: u64,
        /// `q_lora_rank`.
        q_lora: u64,
        /// `kv_lora_rank`.
        kv_lora: u64,
        /// `qk_nope_head_dim`.
        nope: u64,
        /// `qk_rope_head_dim`.
        rope: u64,
        /// `v_head_dim`.
        v: u64,
    },
}

/// The numbers of a model config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// Name.
    pub name: &'static str,
    /// Where the numbers come from.
    pub source: &'static str,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// `hidden_size`.
    pub hidden: u64,
    /// Attention.
    pub attn: Attn,
    /// Layers `0..dense_layers` have a dense MLP (`first_k_dense_replace`).
    pub dense_layers: u64,
    /// `intermediate_size` of the dense MLP.
    pub dense_inter: u64,
    /// Routed experts.
    pub experts: u64,
    /// Shared experts.
    pub shared_experts: u64,
    /// `moe_intermediate_size`.
    pub moe_inter: u64,
    /// `vocab_size`.
    pub vocab: u64,
}

/// Qwen3-235B-A22B.
pub const QWEN3_235B: ModelConfig = ModelConfig {
    name: "qwen3-235b-a22b",
    source: "Qwen/Qwen3-235B-A22B config.json",
    layers: 94,
    hidden: 4096,
    attn: Attn::Gqa {
        heads: 64,
        kv_heads: 4,
        head_dim: 128,
    },
    dense_layers: 0,
    dense_inter: 12288,
    experts: 128,
    shared_experts: 0,
    moe_inter: 1536,
    vocab: 151936,
};

/// DeepSeek-V3 (671B).
pub const DEEPSEEK_V3: ModelConfig = ModelConfig {
    name: "deepseek-v3",
    source: "deepseek-ai/DeepSeek-V3 config.json",
    layers: 61,
    hidden: 7168,
    attn: Attn::Mla {
        heads: 128,
        q_lora: 1536,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
    },
    dense_layers: 3,
    dense_inter: 18432,
    experts: 256,
    shared_experts: 1,
    moe_inter: 2048,
    vocab: 129280,
};

/// Kimi-K2 (1T).
pub const KIMI_K2: ModelConfig = ModelConfig {
    name: "kimi-k2",
    source: "moonshotai/Kimi-K2-Instruct config.json",
    layers: 61,
    hidden: 7168,
    attn: Attn::Mla {
        heads: 64,
        q_lora: 1536,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
    },
    dense_layers: 1,
    dense_inter: 18432,
    experts: 384,
    shared_experts: 1,
    moe_inter: 2048,
    vocab: 163840,
};

/// A small MoE with the same structure (for real runs and tests): GQA,
/// 4 layers (1 dense), 8 experts + 1 shared; fp8-tile-aligned up to TP 2.
pub const TINY_MOE: ModelConfig = ModelConfig {
    name: "tiny-moe",
    source: "weft test model (not published)",
    layers: 4,
    hidden: 256,
    attn: Attn::Gqa {
        heads: 8,
        kv_heads: 4,
        head_dim: 64,
    },
    dense_layers: 1,
    dense_inter: 512,
    experts: 8,
    shared_experts: 1,
    moe_inter: 256,
    vocab: 1024,
};

/// A small MLA MoE (DeepSeek structure) for real runs and tests.
pub const TINY_MLA: ModelConfig = ModelConfig {
    name: "tiny-mla",
    source: "weft test model (not published)",
    layers: 3,
    hidden: 256,
    attn: Attn::Mla {
        heads: 2,
        q_lora: 128,
        kv_lora: 64,
        nope: 64,
        rope: 32,
        v: 64,
    },
    dense_layers: 1,
    dense_inter: 512,
    experts: 8,
    shared_experts: 1,
    moe_inter: 256,
    vocab: 512,
};

/// Every known model.
pub const MODELS: [ModelConfig; 5] = [QWEN3_235B, DEEPSEEK_V3, KIMI_K2, TINY_MOE, TINY_MLA];

/// Looks a model up by name.
pub fn model(name: &str) -> Option<ModelConfig> {
    MODELS.iter().copied().find(|m| m.name == name)
}

/// Training parallelism (the paper's FSDP/PP/EP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainLayout {
    /// FSDP degree inside an EP index.
    pub fsdp: u32,
    /// Pipeline stages.
    pub pp: u32,
    /// Expert-parallel degree.
    pub ep: u32,
}

impl TrainLayout {
    /// Trainers: `fsdp * pp * ep`.
    pub fn ranks(&self) -> u32 {
        self.fsdp * self.pp * self.ep
    }
}

/// Inference parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InferLayout {
    /// Inference GPUs.
    pub ranks: u32,
    /// GPUs per serving instance (experts split over them).
    pub instance: u32,
    /// Tensor-parallel degree of attention / dense / vocab.
    pub attn_tp: u32,
}

/// The paper's setting, per model: FSDP/PP/EP = 16/2/8 on 256 trainers →
/// 128 inference GPUs (Kimi-K2 as in the paper's Table 5; DeepSeek-V3 and
/// Qwen3 with the same trainer layout, which the paper's text implies but
/// does not state). The tiny models: 2/1/2 on 4 trainers → 2 inference
/// ranks (one instance, TP 2). Inference: one 128-GPU EP128 instance with TP8
/// attention for Kimi-K2 and DeepSeek-V3; 16 instances of 8 GPUs (EP8,
/// attention TP4) for Qwen3-235B.
pub fn paper_layout(m: &ModelConfig) -> (TrainLayout, InferLayout) {
    let t = TrainLayout {
        fsdp: 16,
        pp: 2,
        ep: 8,
    };
    if m.name.starts_with("tiny") {
        return (
            TrainLayout {
                fsdp: 2,
                pp: 1,
                ep: 2,
            },
            InferLayout {
                ranks: 2,
                instance: 2,
                attn_tp: 2,
            },
        );
    }
    let i = if m.name == QWEN3_235B.name {
        InferLayout {
            ranks: 128,
            instance: 8,
            attn_tp: 4,
        }
    } else {
        InferLayout {
            ranks: 128,
            instance: 128,
            attn_tp: 8,
        }
    };
    (t, i)
}

struct Builder {
    params: Vec<TrainParam>,
    t: TrainLayout,
}

impl Builder {
    fn stage_ranks(&self, s: u32) -> Vec<Rank> {
        let n = self.t.fsdp * self.t.ep;
        (s * n..(s + 1) * n).collect()
    }
    fn dense(&mut self, name: String, rows: u64, cols: u64, stage: u32) -> usize {
        let ranks = self.stage_ranks(stage);
        self.params.push(TrainParam {
            name,
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: stage * (1 + self.t.ep),
            layout: Layout::fsdp(0, ranks, rows),
        });
        self.params.len() - 1
    }
    fn expert(&mut self, name: String, rows: u64, cols: u64, stage: u32, e: u64) -> usize {
        let j = (e % u64::from(self.t.ep)) as u32;
        let base = stage * self.t.fsdp * self.t.ep + j * self.t.fsdp;
        self.params.push(TrainParam {
            name,
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: stage * (1 + self.t.ep) + 1 + j,
            layout: Layout::fsdp(0, (base..base + self.t.fsdp).collect(), rows),
        });
        self.params.len() - 1
    }
}

fn full(rows: u64, cols: u64) -> Box2 {
    Box2 {
        rows: 0..rows,
        cols: 0..cols,
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
}

/// Builds the [`ModelLayout`] of `m` under the given layouts.
pub fn build(m: &ModelConfig, t: TrainLayout, inf: InferLayout) -> Result<ModelLayout, RlError> {
    if t.fsdp == 0
        || t.pp == 0
        || t.ep == 0
        || inf.ranks == 0
        || inf.instance == 0
        || inf.attn_tp == 0
    {
        return Err(RlError::Layout("degrees must be > 0".into()));
    }
    if !inf.ranks.is_multiple_of(inf.instance) || !inf.instance.is_multiple_of(inf.attn_tp) {
        return Err(RlError::Layout(format!(
            "{} inference ranks do not split into instances of {} with TP {}",
            inf.ranks, inf.instance, inf.attn_tp
        )));
    }
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
                ids.norms
                    .push(b.dense(format!("{p}.self_attn.q_norm.weight"), head_dim, 1, s));
                ids.norms
                    .push(b.dense(format!("{p}.self_attn.k_norm.weight"), head_dim, 1, s));
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
        if l < m.dense_layers {
            let i = m.dense_inter;
            ids.mlp = Some([
                b.dense(format!("{p}.mlp.gate_proj.weight"), i, h, s),
                b.dense(format!("{p}.mlp.up_proj.weight"), i, h, s),
                b.dense(format!("{p}.mlp.down_proj.weight"), h, i, s),
            ]);
        } else {
            let i = m.moe_inter;
            ids.router
                .push(b.dense(format!("{p}.mlp.gate.weight"), m.experts, h, s));
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
                    b.expert(format!("{p}.mlp.experts.{e}.gate_proj.weight"), i, h, s, e),
                    b.expert(format!("{p}.mlp.experts.{e}.up_proj.weight"), i, h, s, e),
                    b.expert(format!("{p}.mlp.experts.{e}.down_proj.weight"), h, i, s, e),
                ]);
            }
        }
        layers.push(ids);
    }
    let last = t.pp - 1;
    let norm = b.dense("model.norm.weight".into(), h, 1, last);
    let head = b.dense("lm_head.weight".into(), m.vocab, h, last);

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
    };
    let mut inference = Vec::with_capacity(inf.ranks as usize);
    let tp = u64::from(inf.attn_tp);
    let per = m.experts.div_ceil(u64::from(inf.instance));
    for r in 0..inf.ranks {
        let local = u64::from(r % inf.instance);
        let k = local % tp;
        let mut ts = Vec::new();
        let rows_of = |p: usize| part(params[p].rows, tp, k);
        let cols_of = |p: usize| part(params[p].cols, tp, k);
        ts.push(tensor(
            "embed_tokens".into(),
            vec![seg(embed, rows_of(embed), 0..h)],
            Quant::None,
        ));
        for (l, ids) in layers.iter().enumerate() {
            let p = format!("layers.{l}");
            let n = |x: &str| format!("{p}.{x}");
            match m.attn {
                Attn::Gqa { .. } => {
                    let (q, kk, v, o) = (ids.attn[0], ids.attn[1], ids.attn[2], ids.attn[3]);
                    ts.push(tensor(
                        n("qkv_proj"),
                        vec![
                            seg(q, rows_of(q), 0..h),
                            seg(kk, rows_of(kk), 0..h),
                            seg(v, rows_of(v), 0..h),
                        ],
                        Quant::Fp8Block,
                    ));
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
        ts.push(tensor("norm".into(), vec![whole(norm)], Quant::None));
        ts.push(tensor(
            "lm_head".into(),
            vec![seg(head, rows_of(head), 0..h)],
            Quant::None,
        ));
        inference.push(ts);
    }
    Ok(ModelLayout {
        trainers: t.ranks(),
        params,
        inference,
    })
}

/// Parameters of a model (elements).
pub fn param_count(m: &ModelLayout) -> u64 {
    m.params.iter().map(|p| p.rows * p.cols).sum()
}
