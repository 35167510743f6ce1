"""The model configs (config.json fields) the Python tests build layers from."""

# A DeepSeek-V3.2 config.json's attention and indexer fields (docs/rope.md,
# docs/indexer.md quote them), with its YaRN rope_scaling.
DSV32 = dict(
    architectures=["DeepseekV32ForCausalLM"],
    model_type="deepseek_v32",
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    max_position_embeddings=163840,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
)

# GLM-5's (glm_moe_dsa): plain RoPE in transformers' rope_parameters, both styles interleaved.
GLM5 = dict(
    architectures=["GlmMoeDsaForCausalLM"],
    model_type="glm_moe_dsa",
    hidden_size=6144,
    num_attention_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    rms_norm_eps=1e-5,
    max_position_embeddings=202752,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    rope_interleave=True,
    indexer_rope_interleave=True,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
)
