//! Models and layouts as users have them: a Hugging Face `config.json`
//! ([`ModelConfig::from_hf_config`]) and a small layout file
//! ([`LayoutFile`]).
//!
//! Field names read, by `model_type`:
//!
//! | family | `model_type` | attention | MLP |
//! |---|---|---|---|
//! | [`ModelFamily::Llama`] | `llama`, `mistral` | `num_attention_heads`, `num_key_value_heads`, `head_dim` | dense `intermediate_size` |
//! | [`ModelFamily::Qwen2`] | `qwen2` | as Llama, with q/k/v biases | dense |
//! | [`ModelFamily::Qwen3`] | `qwen3` | as Llama, with `q_norm`/`k_norm` | dense |
//! | [`ModelFamily::Qwen3Moe`] | `qwen3_moe` | as Qwen3 | `num_experts`, `moe_intermediate_size` on every layer |
//! | [`ModelFamily::Mixtral`] | `mixtral` | as Llama | `num_local_experts`, `intermediate_size` per expert, `block_sparse_moe` names |
//! | [`ModelFamily::DeepseekV3`] | `deepseek_v3`, `kimi_k2` | MLA: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` | `first_k_dense_replace` dense layers, then `n_routed_experts` + `n_shared_experts` |
//!
//! Common: `hidden_size`, `num_hidden_layers`, `vocab_size`,
//! `tie_word_embeddings` (default false), `attention_bias` (q/k/v and
//! o_proj biases; `mlp_bias` is refused). The file is untrusted input:
//! a missing field, a number out of range or a layout the planner cannot
//! express (Qwen3-MoE's `mlp_only_layers`, a `decoder_sparse_step` other
//! than 1, MLA without `q_lora_rank`) is a typed [`RlError::ModelConfig`],
//! never a guess.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{Attn, InferLayout, ModelConfig, Naming, TrainLayout};
use crate::RlError;

/// The architectures [`ModelConfig::from_hf_config`] understands (see the
/// module docs for the fields each reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModelFamily {
    /// Llama 2/3, Mistral: dense, grouped-query attention.
    Llama,
    /// Qwen2 / Qwen2.5: as Llama, q/k/v biases.
    Qwen2,
    /// Qwen3 dense: as Llama, q/k norms.
    Qwen3,
    /// Qwen3 MoE: Qwen3 attention, routed experts on every layer.
    Qwen3Moe,
    /// Mixtral: Llama attention, routed experts on every layer.
    Mixtral,
    /// DeepSeek-V3 and Kimi-K2: MLA, dense first layers, routed and
    /// shared experts.
    DeepseekV3,
}

impl ModelFamily {
    /// The family of a `model_type`.
    pub fn of_model_type(t: &str) -> Option<ModelFamily> {
        Some(match t {
            "llama" | "mistral" => ModelFamily::Llama,
            "qwen2" => ModelFamily::Qwen2,
            "qwen3" => ModelFamily::Qwen3,
            "qwen3_moe" => ModelFamily::Qwen3Moe,
            "mixtral" => ModelFamily::Mixtral,
            "deepseek_v3" | "kimi_k2" => ModelFamily::DeepseekV3,
            _ => return None,
        })
    }
}

/// The largest dimension accepted from a config (larger is a typo or a
/// hostile file: no real model comes near it).
const MAX_DIM: u64 = 1 << 24;

/// A config object's fields with typed, checked reads.
struct Fields<'a>(&'a Map<String, Value>);

fn bad(field: &str, reason: impl Into<String>) -> RlError {
    RlError::ModelConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl Fields<'_> {
    /// A positive integer of at most [`MAX_DIM`].
    fn dim(&self, field: &str) -> Result<u64, RlError> {
        self.opt_dim(field)?
            .ok_or_else(|| bad(field, "missing (or null)"))
    }

    fn opt_dim(&self, field: &str) -> Result<Option<u64>, RlError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if (1..=MAX_DIM).contains(&n) => Ok(Some(n)),
                _ => Err(bad(
                    field,
                    format!("{v} is not an integer from 1 to {MAX_DIM}"),
                )),
            },
        }
    }

    /// A non-negative integer of at most [`MAX_DIM`] (0 allowed), with a
    /// default.
    fn count(&self, field: &str, default: u64) -> Result<u64, RlError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match v.as_u64() {
                Some(n) if n <= MAX_DIM => Ok(n),
                _ => Err(bad(
                    field,
                    format!("{v} is not an integer from 0 to {MAX_DIM}"),
                )),
            },
        }
    }

    fn flag(&self, field: &str) -> Result<bool, RlError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(bad(field, format!("{v} is not a boolean"))),
        }
    }
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json` (see the module docs for the
    /// families and fields); `name` names the model in plans and reports.
    pub fn from_hf_config(name: &str, json: &str) -> Result<ModelConfig, RlError> {
        let v: Value =
            serde_json::from_str(json).map_err(|e| bad("config.json", format!("not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("config.json", "not a JSON object"))?;
        let f = Fields(obj);
        let mt = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("model_type", "missing or not a string"))?;
        let family = ModelFamily::of_model_type(mt).ok_or_else(|| {
            bad(
                "model_type",
                format!(
                    "{mt:?} is not one of llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3, kimi_k2"
                ),
            )
        })?;
        let hidden = f.dim("hidden_size")?;
        let layers = f.dim("num_hidden_layers")?;
        let vocab = f.dim("vocab_size")?;
        let heads = f.dim("num_attention_heads")?;
        let gqa = || -> Result<Attn, RlError> {
            let kv_heads = f.opt_dim("num_key_value_heads")?.unwrap_or(heads);
            if !heads.is_multiple_of(kv_heads) {
                return Err(bad(
                    "num_key_value_heads",
                    format!("{kv_heads} does not divide num_attention_heads {heads}"),
                ));
            }
            let head_dim = match f.opt_dim("head_dim")? {
                Some(d) => d,
                None if hidden.is_multiple_of(heads) => hidden / heads,
                None => {
                    return Err(bad(
                        "head_dim",
                        format!(
                            "missing, and hidden_size {hidden} is not a multiple of {heads} heads"
                        ),
                    ))
                }
            };
            Ok(Attn::Gqa {
                heads,
                kv_heads,
                head_dim,
            })
        };
        let mut m = ModelConfig {
            name: Cow::Owned(name.to_string()),
            source: Cow::Owned(format!("config.json ({mt})")),
            layers,
            hidden,
            attn: Attn::Gqa {
                heads,
                kv_heads: heads,
                head_dim: 1,
            },
            dense_layers: layers,
            dense_inter: 0,
            experts: 0,
            shared_experts: 0,
            moe_inter: 0,
            vocab,
            qk_norm: false,
            qkv_bias: false,
            o_bias: false,
            tied_embeddings: f.flag("tie_word_embeddings")?,
            naming: Naming::Qwen,
        };
        match family {
            ModelFamily::Llama | ModelFamily::Qwen2 | ModelFamily::Qwen3 => {
                m.attn = gqa()?;
                m.dense_inter = f.dim("intermediate_size")?;
                let attention_bias = f.flag("attention_bias")?;
                m.qkv_bias = family == ModelFamily::Qwen2 || attention_bias;
                m.o_bias = attention_bias;
                m.qk_norm = family == ModelFamily::Qwen3;
            }
            ModelFamily::Qwen3Moe => {
                m.attn = gqa()?;
                m.qk_norm = true;
                m.qkv_bias = f.flag("attention_bias")?;
                m.o_bias = m.qkv_bias;
                if f.count("decoder_sparse_step", 1)? != 1 {
                    return Err(bad(
                        "decoder_sparse_step",
                        "only 1 (every layer MoE) is supported",
                    ));
                }
                match obj.get("mlp_only_layers") {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(a)) if a.is_empty() => {}
                    Some(v) => {
                        return Err(bad("mlp_only_layers", format!("{v}: only [] is supported")))
                    }
                }
                m.dense_layers = 0;
                m.experts = f.dim("num_experts")?;
                m.moe_inter = f.dim("moe_intermediate_size")?;
                m.dense_inter = f.count("intermediate_size", 0)?;
            }
            ModelFamily::Mixtral => {
                m.attn = gqa()?;
                m.qkv_bias = f.flag("attention_bias")?;
                m.o_bias = m.qkv_bias;
                m.dense_layers = 0;
                m.experts = f.dim("num_local_experts")?;
                m.moe_inter = f.dim("intermediate_size")?;
                m.naming = Naming::Mixtral;
            }
            ModelFamily::DeepseekV3 => {
                let q_lora = f.opt_dim("q_lora_rank")?.ok_or_else(|| {
                    bad(
                        "q_lora_rank",
                        "null: MLA without a query down-projection is not supported",
                    )
                })?;
                m.attn = Attn::Mla {
                    heads,
                    q_lora,
                    kv_lora: f.dim("kv_lora_rank")?,
                    nope: f.dim("qk_nope_head_dim")?,
                    rope: f.dim("qk_rope_head_dim")?,
                    v: f.dim("v_head_dim")?,
                };
                m.dense_layers = f.count("first_k_dense_replace", 0)?;
                if m.dense_layers > layers {
                    return Err(bad(
                        "first_k_dense_replace",
                        format!("{} is more than the {layers} layers", m.dense_layers),
                    ));
                }
                m.dense_inter = f.dim("intermediate_size")?;
                m.experts = f.dim("n_routed_experts")?;
                m.shared_experts = f.count("n_shared_experts", 0)?;
                m.moe_inter = f.dim("moe_intermediate_size")?;
            }
        }
        if f.flag("mlp_bias")? {
            return Err(bad("mlp_bias", "MLP biases are not modelled"));
        }
        if m.dense_layers > 0 && m.dense_inter == 0 {
            return Err(bad("intermediate_size", "missing for the dense layers"));
        }
        Ok(m)
    }
}

/// Training parallelism as a layout file states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainMesh {
    /// FSDP degree inside an EP index.
    pub fsdp: u32,
    /// Pipeline stages (default 1).
    #[serde(default = "one")]
    pub pp: u32,
    /// Expert parallelism (default 1).
    #[serde(default = "one")]
    pub ep: u32,
    /// Tensor parallelism inside an FSDP shard (default 1).
    #[serde(default = "one")]
    pub tp: u32,
    /// HSDP replicas of the whole layout (default 1).
    #[serde(default = "one")]
    pub replicas: u32,
}

/// Inference parallelism as a layout file states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferMesh {
    /// Inference GPUs.
    pub ranks: u32,
    /// GPUs per serving instance (default: all ranks in one instance).
    pub instance: Option<u32>,
    /// Tensor-parallel degree of attention, dense MLPs and vocabularies
    /// (default 1).
    #[serde(default = "one")]
    pub tp: u32,
    /// Pipeline stages per instance (default 1).
    #[serde(default = "one")]
    pub pp: u32,
}

fn one() -> u32 {
    1
}

/// A layout file: the training mesh and the inference layout, as JSON:
///
/// ```json
/// {"train": {"fsdp": 16, "pp": 2, "ep": 8},
///  "inference": {"ranks": 64, "instance": 8, "tp": 4}}
/// ```
///
/// Unknown fields are refused (a typo must not silently fall back to a
/// default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutFile {
    /// The trainers.
    pub train: TrainMesh,
    /// The inference side.
    pub inference: InferMesh,
}

impl LayoutFile {
    /// Parses a layout file.
    pub fn parse(json: &str) -> Result<LayoutFile, RlError> {
        serde_json::from_str(json).map_err(|e| bad("layout", e.to_string()))
    }

    /// The training and inference layouts it describes.
    pub fn layouts(&self) -> (TrainLayout, InferLayout) {
        (
            TrainLayout {
                fsdp: self.train.fsdp,
                pp: self.train.pp,
                ep: self.train.ep,
                tp: self.train.tp,
                replicas: self.train.replicas,
            },
            InferLayout {
                ranks: self.inference.ranks,
                instance: self.inference.instance.unwrap_or(self.inference.ranks),
                attn_tp: self.inference.tp,
                pp: self.inference.pp,
            },
        )
    }
}
