//! Models from Hugging Face `config.json` files and layouts from layout
//! files: the real configs of the shipped models read back to the same
//! numbers, small configs of every family plan to plans that place every
//! byte exactly once (executed in memory against the reference), and
//! hostile files are typed errors.

use crate::plan_props::check_model;
use weft_rl::models::{self, LayoutFile, ModelConfig, Naming};
use weft_rl::{PlanConfig, RlError};

/// DeepSeek-V3's published config.json (the fields weft reads, plus some
/// it ignores).
const DEEPSEEK_V3_JSON: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
  "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
  "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "vocab_size": 129280, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "rope_scaling": {"type": "yarn", "factor": 40}
}"#;

const KIMI_K2_JSON: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
  "n_shared_experts": 1, "n_routed_experts": 384, "first_k_dense_replace": 1,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
  "tie_word_embeddings": false
}"#;

const QWEN3_235B_JSON: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
  "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
  "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
  "tie_word_embeddings": false, "attention_bias": false
}"#;

/// The shipped tables and the parsed configs agree but for name and source.
#[test]
fn published_configs_read_back_as_the_shipped_tables() {
    for (json, want) in [
        (DEEPSEEK_V3_JSON, models::DEEPSEEK_V3),
        (KIMI_K2_JSON, models::KIMI_K2),
        (QWEN3_235B_JSON, models::QWEN3_235B),
    ] {
        let got = ModelConfig::from_hf_config(&want.name, json).unwrap();
        assert_eq!(
            ModelConfig {
                source: want.source.clone(),
                ..got
            },
            want
        );
    }
}

/// A small config of each family, with a layout file, planned and checked
/// byte for byte.
fn plan_and_check(name: &str, json: &str, layout: &str, block: u64) -> weft_rl::ModelLayout {
    let m = ModelConfig::from_hf_config(name, json).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (t, i) = LayoutFile::parse(layout).unwrap().layouts();
    let ml = models::build(&m, t, i).unwrap_or_else(|e| panic!("{name}: {e}"));
    let cfg = PlanConfig {
        block,
        unit_bytes: 2048,
        align: 8,
        watermark: 1 << 20,
        min_direct_bytes: 64,
        ramp: 2,
    };
    if let Err(e) = check_model(&ml, &cfg, 3) {
        panic!("{name}: {e}");
    }
    ml
}

fn names(ml: &weft_rl::ModelLayout) -> Vec<&str> {
    ml.params.iter().map(|p| p.name.as_str()).collect()
}

#[test]
fn llama_with_fewer_kv_heads_than_tp_ranks() {
    let json = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100}"#;
    // TP 4 over 2 key/value heads: each head on two ranks.
    let ml = plan_and_check(
        "llama-tiny",
        json,
        r#"{"train": {"fsdp": 4}, "inference": {"ranks": 8, "instance": 4, "tp": 4}}"#,
        16,
    );
    let n = names(&ml);
    assert!(n.contains(&"model.layers.1.mlp.down_proj.weight") && n.contains(&"lm_head.weight"));
    assert!(!n
        .iter()
        .any(|n| n.contains("q_norm") || n.contains("experts") || n.contains("bias")));
    // Ranks 0 and 1 of an instance hold key/value head 0, ranks 2 and 3 head 1.
    let kv_rows = |r: usize| {
        let t = ml.inference[r]
            .iter()
            .find(|t| t.name == "layers.0.qkv_proj")
            .unwrap();
        t.segments[1].src.rows.clone()
    };
    assert_eq!(kv_rows(0), kv_rows(1));
    assert_eq!(kv_rows(2), kv_rows(3));
    assert_ne!(kv_rows(1), kv_rows(2));
    assert_eq!(kv_rows(0), 0..16);
}

#[test]
fn qwen2_biases_and_tied_embeddings() {
    let json = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 120, "tie_word_embeddings": true}"#;
    let ml = plan_and_check(
        "qwen2-tiny",
        json,
        r#"{"train": {"fsdp": 2, "pp": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    let n = names(&ml);
    assert!(n.contains(&"model.layers.0.self_attn.k_proj.bias"));
    assert!(
        !n.contains(&"lm_head.weight"),
        "tied: no lm_head of its own"
    );
    assert!(ml.inference[0]
        .iter()
        .any(|t| t.name == "layers.1.qkv_proj.bias"));
    assert!(!ml.inference[0].iter().any(|t| t.name == "lm_head"));
}

#[test]
fn qwen3_dense_and_moe() {
    let dense = r#"{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 64, "tie_word_embeddings": true}"#;
    let ml = plan_and_check(
        "qwen3-tiny",
        dense,
        r#"{"train": {"fsdp": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    assert!(names(&ml).contains(&"model.layers.1.self_attn.q_norm.weight"));
    let moe = r#"{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 80}"#;
    let ml = plan_and_check(
        "qwen3-moe-tiny",
        moe,
        r#"{"train": {"fsdp": 2, "ep": 2}, "inference": {"ranks": 4, "instance": 2, "tp": 2}}"#,
        16,
    );
    assert!(names(&ml).contains(&"model.layers.1.mlp.experts.3.down_proj.weight"));
}

#[test]
fn mixtral_names_its_experts_w1_w3_w2() {
    let json = r#"{"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 70}"#;
    let m = ModelConfig::from_hf_config("mixtral-tiny", json).unwrap();
    assert_eq!(m.naming, Naming::Mixtral);
    let ml = plan_and_check(
        "mixtral-tiny",
        json,
        r#"{"train": {"fsdp": 2, "ep": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    let n = names(&ml);
    for want in [
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
        "model.layers.1.block_sparse_moe.experts.2.w2.weight",
    ] {
        assert!(n.contains(&want), "{want} missing");
    }
}

#[test]
fn deepseek_mla_with_a_dense_first_layer() {
    let json = r#"{"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
        "n_shared_experts": 1, "n_routed_experts": 4, "first_k_dense_replace": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 64}"#;
    let ml = plan_and_check(
        "mla-tiny",
        json,
        r#"{"train": {"fsdp": 2, "ep": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    let n = names(&ml);
    assert!(n.contains(&"model.layers.0.mlp.down_proj.weight"));
    assert!(n.contains(&"model.layers.2.mlp.gate.e_score_correction_bias"));
}

/// Hostile and unsupported files: typed errors naming the field.
#[test]
fn refused_configs_name_the_field() {
    let base = r#""hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 64"#;
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "config.json"),
        ("[1, 2]".into(), "config.json"),
        (format!(r#"{{{base}}}"#), "model_type"),
        (format!(r#"{{"model_type": "gpt2", {base}}}"#), "model_type"),
        (
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}"#.into(),
            "intermediate_size",
        ),
        (
            format!(r#"{{"model_type": "llama", {base}, "num_key_value_heads": 3}}"#),
            "num_key_value_heads",
        ),
        (
            r#"{"model_type": "llama", "hidden_size": -64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}"#.into(),
            "hidden_size",
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 1e30, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}"#.into(),
            "hidden_size",
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 99999999999, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}"#.into(),
            "hidden_size",
        ),
        (
            format!(r#"{{"model_type": "llama", {base}, "tie_word_embeddings": "yes"}}"#),
            "tie_word_embeddings",
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 65, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}"#.into(),
            "head_dim",
        ),
        (
            format!(
                r#"{{"model_type": "qwen3_moe", {base}, "num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [0]}}"#
            ),
            "mlp_only_layers",
        ),
        (
            format!(
                r#"{{"model_type": "qwen3_moe", {base}, "num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 2}}"#
            ),
            "decoder_sparse_step",
        ),
        (
            format!(
                r#"{{"model_type": "deepseek_v3", {base}, "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "moe_intermediate_size": 32}}"#
            ),
            "q_lora_rank",
        ),
        (
            format!(
                r#"{{"model_type": "deepseek_v3", {base}, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 3}}"#
            ),
            "first_k_dense_replace",
        ),
    ];
    for (json, field) in cases {
        match ModelConfig::from_hf_config("x", &json) {
            Err(RlError::ModelConfig { field: f, .. }) => assert_eq!(f, field, "{json}"),
            other => panic!("{json}: {other:?}"),
        }
    }
    // Every truncation of a real config is an error, never a panic.
    for n in 0..DEEPSEEK_V3_JSON.len() {
        if DEEPSEEK_V3_JSON.is_char_boundary(n) {
            assert!(ModelConfig::from_hf_config("x", &DEEPSEEK_V3_JSON[..n]).is_err());
        }
    }
    for bad in [
        r#"{"train": {"fsdp": 2, "cp": 2}, "inference": {"ranks": 2}}"#,
        r#"{"train": {"fsdp": 2}}"#,
        r#"{"train": {"fsdp": -1}, "inference": {"ranks": 2}}"#,
        r#"{"train": {"fsdp": 2}, "inference": {"ranks": 2}, "extra": 1}"#,
    ] {
        assert!(
            matches!(LayoutFile::parse(bad), Err(RlError::ModelConfig { .. })),
            "{bad}"
        );
    }
}

/// `models::load` takes a known name or a path, naming the model after
/// its directory.
#[test]
fn load_reads_a_config_file() {
    let dir = std::env::temp_dir().join(format!("weft-rl-hf-{}", std::process::id()));
    let model_dir = dir.join("Tiny-Llama");
    std::fs::create_dir_all(&model_dir).unwrap();
    let path = model_dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}"#,
    )
    .unwrap();
    let m = models::load(path.to_str().unwrap()).unwrap();
    assert_eq!(m.name, "Tiny-Llama");
    assert_eq!(models::load("kimi-k2").unwrap(), models::KIMI_K2);
    match models::load(dir.join("nope.json").to_str().unwrap()) {
        Err(RlError::ModelConfig { field, reason }) => {
            assert_eq!(field, "model");
            assert!(reason.contains("kimi-k2"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Biases: `attention_bias` adds q/k/v and o_proj biases (o_proj's whole
/// on every TP rank); `mlp_bias` is refused.
#[test]
fn attention_bias_adds_o_proj_bias_and_mlp_bias_is_refused() {
    let json = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "attention_bias": true}"#;
    let ml = plan_and_check(
        "llama-bias",
        json,
        r#"{"train": {"fsdp": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    let n = names(&ml);
    assert!(n.contains(&"model.layers.0.self_attn.o_proj.bias"));
    assert!(n.contains(&"model.layers.0.self_attn.v_proj.bias"));
    let with_mlp_bias = json.replace("\"attention_bias\": true", "\"mlp_bias\": true");
    match ModelConfig::from_hf_config("x", &with_mlp_bias) {
        Err(RlError::ModelConfig { field, .. }) => assert_eq!(field, "mlp_bias"),
        other => panic!("{other:?}"),
    }
}

/// Layouts that would split heads, or sizes that would overflow, are typed
/// errors of `build`, never a silent layout or a panic.
#[test]
fn build_refuses_split_heads_and_overflowing_sizes() {
    let gqa = |heads: u32, kv: u32| {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 640, "intermediate_size": 256,
            "num_hidden_layers": 1, "num_attention_heads": {heads}, "num_key_value_heads": {kv},
            "head_dim": 16, "vocab_size": 64}}"#
        )
    };
    let layout = |tp: u32| {
        LayoutFile::parse(&format!(
            r#"{{"train": {{"fsdp": 2}}, "inference": {{"ranks": {tp}, "tp": {tp}}}}}"#
        ))
        .unwrap()
        .layouts()
    };
    for (heads, kv, tp, ok) in [
        (40, 8, 16, false), // 40 heads over 16 ranks
        (4, 4, 8, false),   // fewer query heads than ranks
        (24, 6, 4, false),  // 6 kv heads: neither split nor replicated evenly
        (16, 2, 8, true),   // kv heads replicated 4 times
        (16, 16, 8, true),
    ] {
        let m = ModelConfig::from_hf_config("x", &gqa(heads, kv)).unwrap();
        let (t, i) = layout(tp);
        let r = models::build(&m, t, i);
        assert_eq!(
            r.is_ok(),
            ok,
            "{heads} heads, {kv} kv, TP {tp}: {:?}",
            r.err()
        );
        if !ok {
            assert!(matches!(r, Err(RlError::Layout(_))));
        }
    }
    let huge = r#"{"model_type": "llama", "hidden_size": 16777216, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 16777216}"#;
    let m = ModelConfig::from_hf_config("x", huge).unwrap();
    let (t, i) = layout(1);
    assert!(matches!(models::build(&m, t, i), Err(RlError::Layout(_))));
    let many = r#"{"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 16000000, "num_attention_heads": 4, "num_local_experts": 1000,
        "vocab_size": 64}"#;
    let m = ModelConfig::from_hf_config("x", many).unwrap();
    assert!(matches!(models::build(&m, t, i), Err(RlError::Layout(_))));
    let wide = LayoutFile::parse(
        r#"{"train": {"fsdp": 4000000000, "pp": 4000000000}, "inference": {"ranks": 2}}"#,
    )
    .unwrap()
    .layouts();
    let m = ModelConfig::from_hf_config("x", &gqa(4, 4)).unwrap();
    assert!(matches!(
        models::build(&m, wide.0, wide.1),
        Err(RlError::Layout(_))
    ));
}

/// Inference pipeline stages: each layer's tensors on the ranks of its
/// stage only, the embedding on the first, the final norm and LM head on
/// the last (the embedding as LM head when tied), experts over a stage's
/// GPUs; planned and checked byte for byte, dense and MoE.
#[test]
fn inference_pipeline_stages() {
    let moe = r#"{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 80,
        "tie_word_embeddings": true}"#;
    // Two instances of 4 GPUs: 2 stages of 2 GPUs, TP 2.
    let ml = plan_and_check(
        "qwen3-moe-pp",
        moe,
        r#"{"train": {"fsdp": 2, "ep": 2}, "inference": {"ranks": 8, "instance": 4, "tp": 2, "pp": 2}}"#,
        16,
    );
    for (r, ts) in ml.inference.iter().enumerate() {
        let stage = (r % 4) / 2;
        let has = |n: &str| ts.iter().any(|t| t.name == n);
        let layers: Vec<usize> = (0..4)
            .filter(|l| has(&format!("layers.{l}.qkv_proj")))
            .collect();
        assert_eq!(layers, [stage * 2, stage * 2 + 1], "rank {r}");
        assert_eq!(has("embed_tokens"), stage == 0, "rank {r}");
        assert_eq!(has("norm") && has("lm_head"), stage == 1, "rank {r}");
        // Four experts over a stage's two GPUs: two each.
        let w2 = ts
            .iter()
            .find(|t| t.name == format!("layers.{}.experts.w2", stage * 2))
            .unwrap();
        assert_eq!(w2.segments.len(), 2, "rank {r}");
    }
    let dense = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100}"#;
    let ml = plan_and_check(
        "llama-pp3",
        dense,
        r#"{"train": {"fsdp": 2, "pp": 1}, "inference": {"ranks": 3, "pp": 3}}"#,
        16,
    );
    assert_eq!(ml.inference.len(), 3);
    assert!(ml.inference[2].iter().any(|t| t.name == "lm_head"));
    assert!(!ml.inference[1]
        .iter()
        .any(|t| t.name == "lm_head" || t.name == "embed_tokens"));
    // More stages than layers, or stages that do not divide an instance.
    let m = ModelConfig::from_hf_config("llama", dense).unwrap();
    for layout in [
        r#"{"train": {"fsdp": 1}, "inference": {"ranks": 4, "pp": 4}}"#,
        r#"{"train": {"fsdp": 1}, "inference": {"ranks": 4, "pp": 3}}"#,
        r#"{"train": {"fsdp": 1}, "inference": {"ranks": 4, "pp": 2, "tp": 4}}"#,
    ] {
        let (t, i) = LayoutFile::parse(layout).unwrap().layouts();
        assert!(
            matches!(models::build(&m, t, i), Err(weft_rl::RlError::Layout(_))),
            "{layout}"
        );
    }
}

/// Training TP (FSDP × TP meshes: column-parallel weights split by rows,
/// row-parallel by columns, norms replicated over TP) into inference TP
/// larger, equal and smaller than it; dense and MoE; byte-checked.
#[test]
fn training_tp_into_any_inference_tp() {
    use weft_rl::meta::{Layout, Placement};
    let dense = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 96}"#;
    for itp in [1, 2, 4] {
        let layout = format!(
            r#"{{"train": {{"fsdp": 2, "tp": 2}}, "inference": {{"ranks": {itp}, "tp": {itp}}}}}"#
        );
        let ml = plan_and_check("llama-ttp", dense, &layout, 16);
        assert_eq!(ml.trainers, 4);
        let by = |n: &str| ml.params.iter().find(|p| p.name == n).unwrap();
        let pl = |n: &str| match &by(n).layout {
            Layout::Mesh { placements, .. } => placements.clone(),
            other => panic!("{n}: {other:?}"),
        };
        assert_eq!(
            pl("model.layers.0.self_attn.q_proj.weight"),
            [Placement::Shard(0), Placement::Shard(0)]
        );
        assert_eq!(
            pl("model.layers.0.mlp.down_proj.weight"),
            [Placement::Shard(0), Placement::Shard(1)]
        );
        assert_eq!(
            pl("model.layers.0.input_layernorm.weight"),
            [Placement::Shard(0), Placement::Replicate]
        );
    }
    let moe = r#"{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 80}"#;
    let ml = plan_and_check(
        "qwen3-moe-ttp",
        moe,
        r#"{"train": {"fsdp": 2, "ep": 2, "tp": 2}, "inference": {"ranks": 2, "tp": 1}}"#,
        16,
    );
    assert_eq!(ml.trainers, 8);
}

/// HSDP: the whole training layout replicated; every weight has one holder
/// per replica and the planner spreads the writing over all of them.
#[test]
fn hsdp_replicas_all_write() {
    let dense = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 96}"#;
    let ml = plan_and_check(
        "llama-hsdp",
        dense,
        r#"{"train": {"fsdp": 2, "tp": 2, "replicas": 2}, "inference": {"ranks": 2, "tp": 2}}"#,
        16,
    );
    assert_eq!(ml.trainers, 8);
    for p in 0..ml.params.len() {
        for (holders, _) in ml.pieces(p) {
            // The same holders in each replica (norms: also every TP rank).
            let (a, b): (Vec<u32>, Vec<u32>) = holders.iter().partition(|&&r| r < 4);
            let shifted: Vec<u32> = a.iter().map(|r| r + 4).collect();
            assert!(
                !a.is_empty() && shifted == b,
                "{}: {holders:?}",
                ml.params[p].name
            );
        }
    }
    let cfg = PlanConfig {
        block: 16,
        unit_bytes: 2048,
        align: 8,
        watermark: 1 << 20,
        min_direct_bytes: 64,
        ramp: 2,
    };
    let p = weft_rl::plan(&ml, &cfg).unwrap();
    let load = p.trainer_load();
    assert!(
        load.iter().all(|&b| b > 0),
        "every trainer writes: {load:?}"
    );
}
