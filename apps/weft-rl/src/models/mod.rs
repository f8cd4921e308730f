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

mod build;
mod hf;

pub use build::build;
pub use hf::{InferMesh, LayoutFile, ModelFamily, TrainMesh};

use crate::meta::ModelLayout;
use std::borrow::Cow;

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

/// How a model names its MoE parameters (its checkpoint's convention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Naming {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (Qwen, DeepSeek).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}`
    /// (Mixtral: w1 gate, w3 up, w2 down).
    Mixtral,
}

/// The numbers of a model config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Name.
    pub name: Cow<'static, str>,
    /// Where the numbers come from.
    pub source: Cow<'static, str>,
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
    /// Grouped-query attention has per-head `q_norm` / `k_norm` (Qwen3).
    pub qk_norm: bool,
    /// `q_proj`, `k_proj`, `v_proj` have biases (Qwen2, and
    /// `attention_bias` models).
    pub qkv_bias: bool,
    /// `o_proj` has a bias (`attention_bias` of Llama-style models).
    pub o_bias: bool,
    /// `lm_head` is the embedding (`tie_word_embeddings`): no parameter of
    /// its own, and no inference tensor of its own.
    pub tied_embeddings: bool,
    /// Names of the MoE parameters.
    pub naming: Naming,
}

/// Qwen3-235B-A22B.
pub const QWEN3_235B: ModelConfig = ModelConfig {
    name: Cow::Borrowed("qwen3-235b-a22b"),
    source: Cow::Borrowed("Qwen/Qwen3-235B-A22B config.json"),
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
    qk_norm: true,
    qkv_bias: false,
    o_bias: false,
    tied_embeddings: false,
    naming: Naming::Qwen,
};

/// DeepSeek-V3 (671B).
pub const DEEPSEEK_V3: ModelConfig = ModelConfig {
    name: Cow::Borrowed("deepseek-v3"),
    source: Cow::Borrowed("deepseek-ai/DeepSeek-V3 config.json"),
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
    qk_norm: false,
    qkv_bias: false,
    o_bias: false,
    tied_embeddings: false,
    naming: Naming::Qwen,
};

/// Kimi-K2 (1T).
pub const KIMI_K2: ModelConfig = ModelConfig {
    name: Cow::Borrowed("kimi-k2"),
    source: Cow::Borrowed("moonshotai/Kimi-K2-Instruct config.json"),
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
    qk_norm: false,
    qkv_bias: false,
    o_bias: false,
    tied_embeddings: false,
    naming: Naming::Qwen,
};

/// A small MoE with the same structure (for real runs and tests): GQA,
/// 4 layers (1 dense), 8 experts + 1 shared; fp8-tile-aligned up to TP 2.
pub const TINY_MOE: ModelConfig = ModelConfig {
    name: Cow::Borrowed("tiny-moe"),
    source: Cow::Borrowed("weft test model (not published)"),
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
    qk_norm: true,
    qkv_bias: false,
    o_bias: false,
    tied_embeddings: false,
    naming: Naming::Qwen,
};

/// A small MLA MoE (DeepSeek structure) for real runs and tests.
pub const TINY_MLA: ModelConfig = ModelConfig {
    name: Cow::Borrowed("tiny-mla"),
    source: Cow::Borrowed("weft test model (not published)"),
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
    qk_norm: false,
    qkv_bias: false,
    o_bias: false,
    tied_embeddings: false,
    naming: Naming::Qwen,
};

/// Every known model.
pub const MODELS: [ModelConfig; 5] = [QWEN3_235B, DEEPSEEK_V3, KIMI_K2, TINY_MOE, TINY_MLA];

/// Looks a model up by name.
pub fn model(name: &str) -> Option<ModelConfig> {
    MODELS.iter().find(|m| m.name == name).cloned()
}

/// A built-in model by name, or the Hugging Face `config.json` at the path
/// `name_or_path` (named after its directory when the file is
/// `config.json`, as `Qwen3-8B/config.json` is `Qwen3-8B`, else after the
/// file, as `llama-405b.config.json` is `llama-405b`).
pub fn load(name_or_path: &str) -> Result<ModelConfig, crate::RlError> {
    if let Some(m) = model(name_or_path) {
        return Ok(m);
    }
    let path = std::path::Path::new(name_or_path);
    let text = std::fs::read_to_string(path).map_err(|e| {
        let known: Vec<&str> = MODELS.iter().map(|m| m.name.as_ref()).collect();
        crate::RlError::ModelConfig {
            field: "model".into(),
            reason: format!(
                "{name_or_path:?} is neither a known model ({}) nor a readable config.json: {e}",
                known.join(", ")
            ),
        }
    })?;
    // `Qwen3-8B/config.json` is `Qwen3-8B`; `llama-405b.config.json` or
    // `llama-405b.json` is `llama-405b`.
    let abs = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let file = abs.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let name = if file == "config.json" {
        abs.parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("custom")
    } else {
        let stem = file.strip_suffix(".json").unwrap_or(file);
        stem.strip_suffix(".config").unwrap_or(stem)
    };
    let name = if name.is_empty() { "custom" } else { name };
    ModelConfig::from_hf_config(name, &text)
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
    /// Tensor-parallel degree inside an FSDP shard (1: none). With TP,
    /// every weight is a DTensor on an `[fsdp, tp]` mesh (dense weights:
    /// `[fsdp · ep, tp]`): rows FSDP-sharded, and column-parallel weights
    /// (q/k/v, gate/up, embedding, LM head) split by rows, row-parallel
    /// ones (o, down) by columns, norms and routers replicated over TP.
    pub tp: u32,
    /// HSDP replicas (1: none): the whole layout above repeated this many
    /// times, replica `r` on trainers `r · n ..` (`n` the ranks of one
    /// replica); every weight is held by one rank of each replica, and the
    /// planner may pick any of them to write it.
    pub replicas: u32,
}

impl TrainLayout {
    /// Trainers of one replica: `fsdp * tp * pp * ep`.
    pub fn replica_ranks(&self) -> u32 {
        self.fsdp * self.tp.max(1) * self.pp * self.ep
    }

    /// Trainers: `replicas * fsdp * tp * pp * ep`.
    pub fn ranks(&self) -> u32 {
        self.replicas.max(1) * self.replica_ranks()
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
    /// Pipeline stages per instance (1: none). An instance's GPUs split
    /// into `pp` stages of `instance / pp`; stage `s` holds layers
    /// `s·L/pp ..`, the first the embedding, the last the final norm and
    /// the LM head; attention TP and the experts split over a stage's GPUs.
    pub pp: u32,
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
        tp: 1,
        replicas: 1,
    };
    if m.name == TINY_MOE.name || m.name == TINY_MLA.name {
        return (
            TrainLayout {
                fsdp: 2,
                pp: 1,
                ep: 2,
                tp: 1,
                replicas: 1,
            },
            InferLayout {
                ranks: 2,
                instance: 2,
                attn_tp: 2,
                pp: 1,
            },
        );
    }
    let i = if m.name == QWEN3_235B.name {
        InferLayout {
            ranks: 128,
            instance: 8,
            attn_tp: 4,
            pp: 1,
        }
    } else {
        InferLayout {
            ranks: 128,
            instance: 128,
            attn_tp: 8,
            pp: 1,
        }
    };
    (t, i)
}

/// Parameters of a model (elements).
pub fn param_count(m: &ModelLayout) -> u64 {
    m.params.iter().map(|p| p.rows * p.cols).sum()
}
