"""Loss, perplexity and bits per byte of a model on held-out data, sharded over the inference mesh (`spmdkit eval`).

The eval split of a `DataConfig` source (`spmdkit.data.stream.make_data(..., split="eval")`: the stdlib's held-out
files, a prepared dataset's held-out documents, a token file's tail) in batches of [batch_size, seq_len], rows
over `data`, the model's heads and MLP over `tensor`. Per batch the compiled step returns sums (loss x tokens,
tokens, bytes of text), so the totals are exact token-weighted means over every batch read:

    loss = sum(cross-entropy x mask) / sum(mask)      perplexity = exp(loss)
    bits per byte = loss x tokens / bytes / ln 2      (`spmdkit.data.bits`; None when the source has no tokenizer)

Packed documents (`segment_ids`) are evaluated as the trainer trains them: attention stays inside each document
and the loss mask skips padding and each document's last token. The loss is the model's chunked one
(`Transformer.loss`): the float32 logits [batch, seq, vocab] never exist whole.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.data.bits import bits_per_byte, target_bytes
from spmdkit.data.config import DataConfig
from spmdkit.data.stream import global_batch_arrays, make_data
from spmdkit.errors import SpmdkitError
from spmdkit.inference.layerwise import shardings_of
from spmdkit.models.transformer import Transformer
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.rules import Rules


def evaluate(
    model: Transformer,
    data: DataConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """{loss, perplexity, bits_per_byte, tokens, bytes, batches} of `model` (placed on `mesh`) on `data`'s eval split,
    reading at most `max_batches` batches of [batch_size, seq_len] (None: the whole split)."""
    replicas = mesh.shape.get("data", 1)
    if batch_size < 1 or seq_len < 1 or batch_size % replicas:
        raise SpmdkitError(
            f"--batch-size {batch_size} and --seq-len {seq_len} must be positive, the batch a multiple of "
            f"data={replicas}"
        )
    if max_batches is not None and max_batches < 1:
        raise SpmdkitError(f"--batches {max_batches} must be at least 1")
    stream = make_data(
        data, seq_len=seq_len, global_batch=batch_size, vocab_size=model.config.vocab_size, seed=seed, split="eval"
    )
    graphdef, params = nnx.split(model)
    rows = NamedSharding(mesh, PartitionSpec("data") if replicas > 1 else PartitionSpec())
    shardings = {key: rows for key in stream.keys}
    token_bytes = None if stream.token_bytes is None else jnp.asarray(stream.token_bytes)

    def sums(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        model = nnx.merge(graphdef, params)
        x, _ = model.hidden(batch["inputs"], batch["positions"], batch.get("segment_ids"))
        mask = batch.get("loss_mask")
        loss_sum = model.loss(x, batch["targets"], mask, 1.0)[0]  # denominator 1: the sum over scored tokens
        scored = jnp.sum(mask, dtype=jnp.float32) if mask is not None else jnp.float32(batch["targets"].size)
        text = jnp.float32(0) if token_bytes is None else target_bytes(batch["targets"], token_bytes, mask)
        return jnp.stack([loss_sum, scored, text])

    replicated = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(sums, in_shardings=(shardings_of(params), shardings), out_shardings=replicated)
    limit = stream.steps_per_epoch if max_batches is None else min(max_batches, stream.steps_per_epoch)
    totals, batches = np.zeros(3), 0
    with use_rules(rules, mesh):
        for local in itertools.islice(stream, limit):
            totals += np.asarray(jax.device_get(step(params, global_batch_arrays(local, shardings))), np.float64)
            batches += 1
    if batches == 0 or totals[1] == 0:
        raise SpmdkitError(f"the eval split of {data.source} gave no scored tokens: use more data or a smaller batch")
    loss = totals[0] / totals[1]
    bpb = None if token_bytes is None else float(bits_per_byte(loss, totals[1], totals[2]))
    return {
        "loss": float(loss),
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": bpb,
        "tokens": int(totals[1]),
        "bytes": None if token_bytes is None else int(totals[2]),
        "batches": batches,
    }
