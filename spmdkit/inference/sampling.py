"""Choosing the next token from float32 logits: greedy, temperature, top-k, top-p, with per-row random streams.

`Sampling` holds the user's settings (checked, one-line errors); `SamplingArrays` is their on-device form, passed
to the compiled programs as arrays so that changing a setting never recompiles. `sample(logits, ...)`:

- temperature 0: greedy (argmax);
- otherwise logits / temperature, then top-k (keep the k largest; 0: off) and top-p (keep the smallest set of
  most likely tokens whose probability reaches p; 1: off), then one draw by the Gumbel-max trick;
- token ids at or past `vocab_limit` (padding rows of the embedding beyond the tokenizer's vocabulary) are never
  chosen.

Random streams: the draw of row r's n-th new token uses `fold_in(fold_in(key(seed), r), n)`. It depends on nothing
else (not the mesh, the batch padding or how many tokens each compiled call decodes), so the same seed gives the
same tokens on any mesh. The logits are gathered whole over `tensor` before sampling (one [batch, vocab] all-gather
per token; the weights never move).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmdkit.errors import SpmdkitError

MAX_STOP_TOKENS = 8  # stop ids are a fixed-size array (padded with -1), so their number never recompiles


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens (each setting checked here; the CLI flags have the same names)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SpmdkitError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SpmdkitError(f"--temperature {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise SpmdkitError(f"--top-k {self.top_k} must be >= 0 (0: off)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SpmdkitError(f"--top-p {self.top_p} must be in (0, 1] (1: off)")
        if self.seed < 0:
            raise SpmdkitError(f"--seed {self.seed} must be >= 0")
        if len(self.stop_tokens) > MAX_STOP_TOKENS:
            raise SpmdkitError(f"{len(self.stop_tokens)} stop tokens given: at most {MAX_STOP_TOKENS} are supported")


class SamplingArrays(NamedTuple):
    """`Sampling` as device arrays (scalars replicated): what the compiled prefill and decode programs take."""

    temperature: jax.Array  # float32 []
    top_k: jax.Array  # int32 []
    top_p: jax.Array  # float32 []
    key: jax.Array  # the seed's key data, uint32 [2]
    stop: jax.Array  # int32 [MAX_STOP_TOKENS], -1 = unused
    vocab_limit: jax.Array  # int32 []: ids >= this are never sampled


def sampling_arrays(sampling: Sampling, vocab_limit: int, stop: Sequence[int] = ()) -> SamplingArrays:
    """The arrays of `sampling`, with extra `stop` ids (the tokenizer's EOS) after its own."""
    ids = list(dict.fromkeys([*sampling.stop_tokens, *stop]))[:MAX_STOP_TOKENS]
    return SamplingArrays(
        jnp.float32(sampling.temperature),
        jnp.int32(sampling.top_k),
        jnp.float32(sampling.top_p),
        jax.random.key_data(jax.random.key(sampling.seed)),
        jnp.asarray(ids + [-1] * (MAX_STOP_TOKENS - len(ids)), jnp.int32),
        jnp.int32(vocab_limit),
    )


def row_keys(key_data: jax.Array, rows: jax.Array, counts: jax.Array) -> jax.Array:
    """Typed keys [batch] for row `rows` [batch] drawing its `counts`-th new token."""
    base = jax.random.wrap_key_data(key_data)
    return jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(base, r), n))(rows, counts)


def _filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) what top-k and top-p leave out of scaled logits [batch, vocab] (ties at a threshold stay)."""
    vocab = scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1, descending=True)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jax.lax.dynamic_index_in_dim(ordered, k - 1, axis=-1)  # [batch, 1]
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each one
    kept = (before < top_p) & (ordered > -jnp.inf)
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, keys: jax.Array, settings: SamplingArrays) -> jax.Array:
    """Next token ids [batch] int32 from logits [batch, vocab] (float32), with one key per row."""
    allowed = jnp.arange(logits.shape[-1]) < settings.vocab_limit
    logits = jnp.where(allowed, logits, -jnp.inf)

    def greedy(logits: jax.Array) -> jax.Array:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(logits: jax.Array) -> jax.Array:
        scaled = logits / settings.temperature
        filtering = (settings.top_k > 0) | (settings.top_p < 1)
        scaled = jax.lax.cond(filtering, _filter, lambda s, *_: s, scaled, settings.top_k, settings.top_p)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    # Greedy skips the random numbers (a [batch, vocab] draw per token is not free on a CPU).
    return jax.lax.cond(settings.temperature > 0, drawn, greedy, logits)


def is_stop(tokens: jax.Array, stop: jax.Array) -> jax.Array:
    """bool [batch]: is each token one of the stop ids."""
    return jnp.any(tokens[:, None] == stop[None, :], axis=-1)
