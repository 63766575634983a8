"""Model presets: shapes of the models people train, from `tiny` (the tests) to `405b` (the planner).

Presets are starting points: every field can be set (the `[model]` table, `--model.FIELD`). The big presets are
shapes only: the planner uses them; nobody initialises 405B parameters on a laptop. Family presets take their
published Hugging Face configs' shapes and functions (`spmdkit train --init-from` reads real weights' configs).
"""

from __future__ import annotations

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig

PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),
    "125m": TransformerConfig(vocab_size=32_000, embed=768, layers=12, heads=12, kv_heads=12, head_dim=64, mlp=2048),
    "1b": TransformerConfig(vocab_size=128_256, embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192),
    "7b": TransformerConfig(vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11008),
    "70b": TransformerConfig(
        vocab_size=128_256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672, rope_theta=500_000.0
    ),
}
PRESETS["405b"] = TransformerConfig(
    vocab_size=128_256, embed=16384, layers=126, heads=128, kv_heads=8, head_dim=128, mlp=53248, rope_theta=500_000.0
)

PRESETS["tiny-moe"] = TransformerConfig(experts=8, top_k=2, mlp=128, moe_every=2)
PRESETS["mixtral-8x7b"] = TransformerConfig(
    vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336, rope_theta=1_000_000.0,
    experts=8, top_k=2,
)  # fmt: skip


# The families users fine-tune (shapes for the planner; `spmdkit train --init-from` takes real weights' shapes).
_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, rope_type="llama3", rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_positions=8192, max_positions=131_072)  # fmt: skip
PRESETS["llama3-8b"] = TransformerConfig(
    embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336, rope_factor=8.0, **_LLAMA3
)
PRESETS["llama3-70b"] = TransformerConfig(
    embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672, rope_factor=8.0, **_LLAMA3
)
PRESETS["llama3.2-1b"] = TransformerConfig(
    embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192, rope_factor=32.0, tie_embeddings=True, **_LLAMA3
)
PRESETS["llama3.2-3b"] = TransformerConfig(
    embed=3072, layers=28, heads=24, kv_heads=8, head_dim=128, mlp=8192, rope_factor=32.0, tie_embeddings=True,
    **_LLAMA3,
)  # fmt: skip
PRESETS["qwen2.5-0.5b"] = TransformerConfig(
    vocab_size=151_936, embed=896, layers=24, heads=14, kv_heads=2, head_dim=64, mlp=4864, rope_theta=1_000_000.0,
    norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_positions=32_768,
)  # fmt: skip
PRESETS["qwen3-8b"] = TransformerConfig(
    vocab_size=151_936, embed=4096, layers=36, heads=32, kv_heads=8, head_dim=128, mlp=12288, rope_theta=1_000_000.0,
    norm_eps=1e-6, qk_norm=True, max_positions=40_960,
)  # fmt: skip
PRESETS["smollm-135m"] = TransformerConfig(
    vocab_size=49_152, embed=576, layers=30, heads=9, kv_heads=3, head_dim=64, mlp=1536, tie_embeddings=True,
    max_positions=2048,
)  # fmt: skip


# 2026 families, from their published config.json (tests/test_hf_families.py reads them back).
PRESETS["mistral-7b"] = TransformerConfig(  # Mistral-7B-v0.1: a 4096-token window on every layer
    vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336, sliding_window=4096,
    max_positions=32_768,
)  # fmt: skip
PRESETS["qwen3-30b-a3b"] = TransformerConfig(  # 128 experts of width 768, 8 per token, renormalised
    vocab_size=151_936, embed=2048, layers=48, heads=32, kv_heads=4, head_dim=128, mlp=6144, rope_theta=1_000_000.0,
    norm_eps=1e-6, qk_norm=True, experts=128, top_k=8, expert_mlp=768, dispatch="auto", max_positions=40_960,
)  # fmt: skip
PRESETS["gemma3-12b"] = TransformerConfig(  # five 1024-token local layers, then a global one; linear RoPE x8 globally
    vocab_size=262_208, embed=3840, layers=48, heads=16, kv_heads=8, head_dim=256, mlp=15360, norm_eps=1e-6,
    rope_theta=1_000_000.0, rope_type="linear", rope_factor=8.0, local_rope_theta=10_000.0, sliding_window=1024,
    window_pattern="LLLLLG", qk_norm=True, norm_plus_one=True, post_norm=True, embed_scale=3840**0.5,
    attention_scale=256**-0.5, activation="gelu_pytorch_tanh", tie_embeddings=True, max_positions=131_072,
)  # fmt: skip

# GPT-OSS (bf16 weights; the published MXFP4 files are dequantised first): 128-token windows on every other layer,
# attention sinks, YaRN x32 from 4096 positions, 4 of the experts per token with GPT-OSS's clamped SwiGLU.
_GPT_OSS = dict(
    vocab_size=201_088, embed=2880, heads=64, kv_heads=8, head_dim=64, mlp=2880, rope_theta=150_000.0,
    rope_type="yarn", rope_factor=32.0, rope_original_max_positions=4096, rope_truncate=False, sliding_window=128,
    window_pattern="LG", qkv_bias=True, o_bias=True, attention_sinks=True, top_k=4, router_bias=True,
    expert_bias=True, swiglu_limit=7.0, dispatch="auto", max_positions=131_072,
)  # fmt: skip
PRESETS["gpt-oss-20b"] = TransformerConfig(layers=24, experts=32, **_GPT_OSS)
PRESETS["gpt-oss-120b"] = TransformerConfig(layers=36, experts=128, **_GPT_OSS)

# deepseek-ai/DeepSeek-V3's config.json: latent attention, 256 routed experts (8 per token, in 4 of 8 groups) and a
# shared one, the first 3 layers dense, YaRN x40 with mscale_all_dim 1.
PRESETS["deepseek-v3"] = TransformerConfig(
    vocab_size=129_280, embed=7168, layers=61, heads=128, kv_heads=128, head_dim=192, mlp=18432, norm_eps=1e-6,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, rope_type="yarn",
    rope_factor=40.0, rope_original_max_positions=4096, rope_attention_factor=1.0, rope_mscale_all_dim=1.0,
    max_positions=163_840, experts=256, top_k=8, router_score="sigmoid", router_correction_bias=True,
    router_groups=8, router_top_groups=4, routed_scaling=2.5, expert_mlp=2048, shared_expert=True,
    shared_expert_mlp=2048, dense_layers=(0, 1, 2), dispatch="auto",
)  # fmt: skip


def model_preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise SpmdkitError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
