"""Per-device compute kernels that know nothing of meshes: the attention block math and the blockwise kernel.

- `spmdkit.kernels.attention_spec`: `AttentionSpec`, what one layer's attention computes besides q, k, v (causal,
  window, scale, soft cap, block sizes, key tile), checked once; every attention kernel takes it (pure Python).

- `spmdkit.kernels.attention_block`: the math of one (query block, key block) pair in float32 accumulators
  (scores and their mask, the online-softmax fold, the pair's gradients). Ring attention
  (`spmdkit.parallel.context`) and the blockwise kernel both call it: one copy of the math.
- `spmdkit.kernels.blockwise_attention`: flash-attention-style attention over blocks of one device's sequence,
  with a `jax.custom_vjp` that recomputes the block scores in the backward pass (memory O(seq) per head).
"""
