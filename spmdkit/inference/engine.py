"""`Generator`: a model on an inference mesh, its compiled prefill and decode programs, and the loop around them.

A request (token-id prompts of any lengths, a `Sampling`) is padded into a shape bucket:

    batch   B = prompts rounded up to a power of two and to a multiple of `data` (padding rows generate nothing)
    prompt  P = the longest prompt rounded up to a power of two (at least 8), right-padded
    cache   S = the longest prompt + its new tokens, rounded up to a power of two, at most `max_len`

and each bucket compiles once (`Generator.programs` holds them): a prefill program (prompts -> cache, first token)
and a decode program that runs `chunk` tokens per call in a `lax.while_loop` (stopping early when every row is
done), carrying the cache, so streaming costs one host round trip per `chunk` tokens. Prompt lengths, budgets,
stop ids, temperature, top-k, top-p and the seed are arrays: changing them never recompiles.

Each row generates until a stop token (not included in its tokens), its `max_new_tokens`, or the cache's end
(`max_len` positions: prompt plus new tokens). Timing per prompt: `prefill_s` (the prefill program),
`time_to_first_token_s` (from the request to the first token on the host), `decode_tokens_per_s` (tokens after
the first / decoding time until the row finished).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.errors import SpmdkitError
from spmdkit.inference.cache import KVCache, cache_shardings, empty_cache
from spmdkit.inference.forward import decode, prefill
from spmdkit.inference.layerwise import merge_layers, shardings_of, split_layers
from spmdkit.inference.sampling import Sampling, SamplingArrays, is_stop, row_keys, sample, sampling_arrays
from spmdkit.models.transformer import Transformer
from spmdkit.sharding.logical import constrain, use_rules
from spmdkit.sharding.rules import Rules

MIN_PROMPT_BUCKET = 8
DEFAULT_CHUNK = 16


class DecodeState(NamedTuple):
    """What the decode loop carries, per row [batch]: the cache, the pending token (sampled, not yet in the
    cache), how many tokens the row has generated, whether it is done, and its token budget."""

    cache: KVCache
    token: jax.Array
    count: jax.Array
    done: jax.Array
    budget: jax.Array


@dataclasses.dataclass
class Completion:
    """One prompt's result: ids (prompt, generated), the text when a tokenizer decoded it, why it stopped
    ("stop": a stop token; "length": max_new_tokens or the context's end) and its timing in seconds (`compile_s`:
    compiling the request's bucket, 0 when it was compiled before; not part of the other timings)."""

    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str
    prefill_s: float
    time_to_first_token_s: float
    decode_tokens_per_s: float
    compile_s: float = 0.0
    text: str | None = None


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Generator:
    """Generation with `model` (its parameters already laid out on `mesh` by `rules`; `spmdkit.inference.loading`
    places them) for contexts of up to `max_len` positions. `vocab_limit`: ids at or past it are never sampled
    (embedding rows beyond the tokenizer's vocabulary)."""

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        rules: Rules,
        *,
        max_len: int,
        vocab_limit: int | None = None,
        chunk: int = DEFAULT_CHUNK,
    ):
        if max_len < 2:
            raise SpmdkitError(f"max_len={max_len} must be at least 2 (a prompt token and a new one)")
        self.config = model.config
        self.definition, self.params = split_layers(model)  # one buffer per layer: read in place per token
        self.mesh, self.rules, self.max_len, self.chunk = mesh, rules, max_len, chunk
        self.vocab_limit = min(vocab_limit or self.config.vocab_size, self.config.vocab_size)
        self.programs: dict[tuple, Any] = {}  # (kind, shape...) -> compiled executable
        self.replicas = mesh.shape.get("data", 1)

    # -- shardings and programs ---------------------------------------------------------------------------------

    def _rows(self, batch: int) -> NamedSharding:
        """[batch, ...] arrays: rows split over `data` (the rules' `batch`)."""
        return NamedSharding(self.mesh, PartitionSpec("data") if self.replicas > 1 else PartitionSpec())

    def _state_shardings(self, batch: int, max_len: int) -> DecodeState:
        rows = self._rows(batch)
        return DecodeState(cache_shardings(self.config, batch, max_len, self.mesh, self.rules), rows, rows, rows, rows)

    def _settings_shardings(self) -> SamplingArrays:
        return SamplingArrays(*[NamedSharding(self.mesh, PartitionSpec())] * len(SamplingArrays._fields))

    def _compile(self, key: tuple, fn: Callable, args: tuple, out_shardings: Any, donate=()):
        """`fn` compiled once per `key` for `args` (`ShapeDtypeStruct`s carrying the shardings it takes)."""
        if key not in self.programs:
            jitted = jax.jit(fn, in_shardings=shardings_of(args), out_shardings=out_shardings, donate_argnums=donate)
            with use_rules(self.rules, self.mesh):
                self.programs[key] = jitted.lower(*args).compile()
        return self.programs[key]

    def _abstract(self, tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    def _args(self, *middle: Any) -> tuple:
        """(params, *middle, settings) as `ShapeDtypeStruct`s carrying their shardings: what programs lower for."""
        settings = self._abstract(sampling_arrays(Sampling(), 1), self._settings_shardings())
        return (self._abstract(self.params, shardings_of(self.params)), *middle, settings)

    def prefill_program(self, batch: int, prompt: int, max_len: int) -> Any:
        """Compiled (params, tokens [B, P], lengths [B], budget [B], settings) -> DecodeState, first token taken."""
        definition, config, rows = self.definition, self.config, jnp.arange(batch)

        def run(params, tokens, lengths, budget, settings: SamplingArrays) -> DecodeState:
            layers = merge_layers(definition, params)
            logits, cache = prefill(layers, tokens, lengths, empty_cache(config, batch, max_len, lengths))
            first = sample(constrain(logits, ("batch", None)), row_keys(settings.key, rows, 0 * rows), settings)
            live = budget > 0
            done = ~live | is_stop(first, settings.stop) | (budget <= 1)
            return DecodeState(cache, first, live.astype(jnp.int32), done, budget)

        tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=self._rows(batch))
        vector = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=self._rows(batch))
        args = self._args(tokens, vector, vector)
        return self._compile(("prefill", batch, prompt, max_len), run, args, self._state_shardings(batch, max_len))

    def _step(self, batch: int) -> Callable:
        """One decode step of every row: (params, state, settings) -> (state, new tokens [B], -1 where none)."""
        definition, rows = self.definition, jnp.arange(batch)

        def step(params, state: DecodeState, settings: SamplingArrays) -> tuple[DecodeState, jax.Array]:
            layers = merge_layers(definition, params)  # merged where used: nnx modules stay at one trace level
            logits, cache = decode(layers, state.token, state.cache)
            live = ~state.done
            new = sample(constrain(logits, ("batch", None)), row_keys(settings.key, rows, state.count), settings)
            count = state.count + live
            done = state.done | (live & (is_stop(new, settings.stop) | (count >= state.budget)))
            cache = KVCache(cache.k, cache.v, cache.lengths + live)
            state = DecodeState(cache, jnp.where(live, new, state.token), count, done, state.budget)
            return state, jnp.where(live, new, -1)

        return step

    def _compile_decode(self, key: tuple, fn: Callable, batch: int, max_len: int) -> Any:
        """`fn` (params, state, settings) -> (state, tokens) compiled for this bucket, the state donated."""
        shardings = self._state_shardings(batch, max_len)
        rows, done = jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.bool_)
        cache = jax.eval_shape(lambda: empty_cache(self.config, batch, max_len))
        args = self._args(self._abstract(DecodeState(cache, rows, rows, done, rows), shardings))
        return self._compile(key, fn, args, (shardings, self._rows(batch)), donate=(1,))

    def step_program(self, batch: int, max_len: int) -> Any:
        """Compiled single decode step (params, state, settings) -> (state, new tokens [B]); the state is donated.
        What one token costs: the HLO and memory proofs read it."""
        return self._compile_decode(("step", batch, max_len), self._step(batch), batch, max_len)

    def decode_program(self, batch: int, max_len: int) -> Any:
        """Compiled (params, state, settings) -> (state, new tokens [B, chunk], -1 where a row made none): up to
        `chunk` decode steps in a `while_loop`, fewer when every row is done. The state is donated."""
        steps, step = self.chunk, self._step(batch)

        def run(params, state: DecodeState, settings: SamplingArrays) -> tuple[DecodeState, jax.Array]:
            def body(carry):
                i, state, out = carry
                state, new = step(params, state, settings)
                return i + 1, state, jax.lax.dynamic_update_index_in_dim(out, new, i, axis=1)

            def more(carry):
                i, state, _ = carry
                return (i < steps) & ~jnp.all(state.done)

            out = jnp.full((batch, steps), -1, jnp.int32)
            _, state, out = jax.lax.while_loop(more, body, (jnp.int32(0), state, out))
            return state, out

        return self._compile_decode(("decode", batch, max_len, steps), run, batch, max_len)

    # -- a request ------------------------------------------------------------------------------------------------

    def buckets(self, lengths: Sequence[int], budgets: Sequence[int]) -> tuple[int, int, int]:
        """(batch, prompt, cache length) buckets of a request (see the module docstring)."""
        batch = _round_up(_power_of_two(len(lengths)), self.replicas)
        needed = max(n + b for n, b in zip(lengths, budgets, strict=True))
        max_len = min(self.max_len, max(_power_of_two(needed), MIN_PROMPT_BUCKET))
        prompt = min(max_len, max(MIN_PROMPT_BUCKET, _power_of_two(max(lengths))))
        return batch, prompt, max_len

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        if not prompts:
            raise SpmdkitError("no prompts given: pass at least one prompt")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise SpmdkitError(f"prompt {i + 1} is empty: give it some text")
            if len(prompt) >= self.max_len:
                raise SpmdkitError(
                    f"prompt {i + 1} has {len(prompt)} tokens but the model's context is max_len={self.max_len} "
                    f"tokens: shorten it to at most {self.max_len - 1} tokens, leaving room for new ones"
                )
            if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
                raise SpmdkitError(
                    f"prompt {i + 1} has token ids outside the model's vocab of {self.config.vocab_size}"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        stop: Sequence[int] = (),
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (token ids) in one batch; `on_tokens(row, new_ids)` is called as tokens
        arrive (every `chunk` decode steps). `stop`: stop ids besides `sampling.stop_tokens` (the EOS)."""
        compile_start = time.perf_counter()
        self.check_prompts(prompts)
        n = len(prompts)
        lengths = [len(p) for p in prompts]
        budgets = [min(sampling.max_new_tokens, self.max_len - length) for length in lengths]
        batch, prompt_len, max_len = self.buckets(lengths, budgets)
        tokens = np.zeros((batch, prompt_len), np.int32)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = p
        row_lengths = np.array(lengths + [1] * (batch - n), np.int32)
        row_budgets = np.array(budgets + [0] * (batch - n), np.int32)
        prefill_fn = self.prefill_program(batch, prompt_len, max_len)
        decode_fn = self.decode_program(batch, max_len)
        started = time.perf_counter()  # compiling (once per bucket) is reported apart from the request's latency
        compile_s = started - compile_start
        settings = jax.device_put(sampling_arrays(sampling, self.vocab_limit, stop), self._settings_shardings())
        inputs = jax.device_put((tokens, row_lengths, row_budgets), self._rows(batch))

        begin = time.perf_counter()
        state = prefill_fn(self.params, *inputs, settings)
        first, done = jax.device_get((state.token, state.done))
        prefill_s = time.perf_counter() - begin
        ttft = time.perf_counter() - started
        out: list[list[int]] = [[int(first[r])] if budgets[r] > 0 else [] for r in range(n)]
        finished_at = [0.0 if done[r] else None for r in range(n)]
        self._emit(on_tokens, out, [0] * n)
        decode_start = time.perf_counter()
        while not done[:n].all():
            seen = [len(o) for o in out]
            state, new = decode_fn(self.params, state, settings)
            new, done = jax.device_get((new, state.done))
            now = time.perf_counter() - decode_start
            for r in range(n):
                out[r].extend(int(t) for t in new[r] if t >= 0)
                if done[r] and finished_at[r] is None:
                    finished_at[r] = now
            self._emit(on_tokens, out, seen)
        stop_ids = set(sampling.stop_tokens) | set(stop)
        completions = []
        for r, tokens in enumerate(out):
            stopped = bool(tokens) and tokens[-1] in stop_ids
            generated, reason = (tokens[:-1], "stop") if stopped else (tokens, "length")
            decode_s = finished_at[r] or 0.0
            rate = (len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0
            completions.append(Completion(list(prompts[r]), generated, reason, prefill_s, ttft, rate, compile_s))
        return completions

    @staticmethod
    def _emit(on_tokens: Callable | None, out: list[list[int]], seen: list[int]) -> None:
        """Hand each row's tokens past `seen` to `on_tokens` (when given)."""
        for r, tokens in enumerate(out if on_tokens is not None else ()):
            if len(tokens) > seen[r]:
                on_tokens(r, tokens[seen[r] :])
