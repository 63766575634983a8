"""Low-rank adapters on the model's projections, added by qwix (`qwix.LoraProvider`, `qwix.apply_lora_to_model`).

qwix adds LoRA by intercepting the calls a module makes while one of its methods runs: where a rule matches the
module's path, a projection y = x W gets + (alpha / rank) x x A B, and qwix creates A and B as `nnx.LoRAParam`s
named `<W>_lora_a`, `<W>_lora_b` beside W. For q [embed, heads, head_dim] (`bse,ehd->bshd`) A is [embed, rank]
and B [rank, heads, head_dim]: each A [in..., rank], each B [rank, out...]. qwix copies W's logical axis names
onto them (A: W's input dims, B: its output dims, the rank dim None), so `spmdkit.sharding.rules` shards A like W's
input dim and B like its output dim, the rank whole.

qwix's own LoRA einsum does not work on spmdkit's projections as they were written, for two reasons, bridged here:
- It intercepts `jnp.einsum` and finds the weight an einsum reads among the module's `nnx.Param`s by object
  identity, by walking a jaxpr tracer's parents, or by a unique shape. spmdkit's projections read W cast to the
  compute dtype (`W[...].astype(bfloat16)`: a new array); under `jax.grad` or `nnx.vmap` the tracers have no
  parents; and k/v, gate/up have one shape. So k, v, gate and up got no adapter (measured: "--lora.targets v
  matched no layer") and, worse, a forward under `jax.grad` would have dropped adapters silently. The model now
  passes the weight's `nnx.Param` to `spmdkit.models.fp8.project`, and `_ProjectionLora` intercepts that function
  (a qwix intercept-map entry) and names the weight by the Variable itself; the adapters are made and applied by
  qwix's LoRA code (its einsum parsing and parameter creation), scaled by alpha / rank.
- The blocks are stacked and scanned (`nnx.vmap` / `nnx.scan`): qwix creates its parameters on a first forward
  pass, and a variable created inside `nnx.scan` cannot leave it. So the adapters are added to one block at a
  time under the same `nnx.vmap` that stacks the blocks (`_adapt_stack`): qwix runs each block once on a dummy
  input and the adapters come out stacked on the `layers` dim like every other parameter. Each block's class is
  qwix's intercepting subclass, so the scan's body runs the adapters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.providers import lora as qwix_lora  # qwix's LoRA shapes (from an einsum) and parameter creation
from qwix._src.utils import flax_util  # how qwix finds the module a call runs in

from spmdkit.errors import SpmdkitError
from spmdkit.models import fp8
from spmdkit.models.lora_config import PROJECTIONS, LoraConfig, is_adapter

STACKS = ("blocks", "moe_blocks")  # `Transformer`'s stacked blocks
PROJECT = "spmdkit.models.fp8.project"  # the function every projection of the blocks calls


class _ProjectionLora(qwix.LoraProvider):
    """qwix's LoRA provider on spmdkit's projections: the rule matches the modules holding targeted weights
    (`attention`, `mlp`) and applies to `project` calls (op name "project") whose weight is a target; the
    attention kernel's einsums and the other projections run as they are."""

    def __init__(self, config: LoraConfig):
        self.targets: dict[str, set[str]] = {}
        for name in config.target_names:
            self.targets.setdefault(PROJECTIONS[name][0], set()).add(name)
        path = "|".join(sorted(self.targets))
        super().__init__(module_path=path, op_names=("project",), rank=config.rank, alpha=config.alpha)

    def get_intercept_map(self) -> dict[str, Any]:
        return super().get_intercept_map() | {PROJECT: self.project}

    def project(self, equation: str, x: jax.Array, w: Any, scales: Any = None, *, dtype: str | None = None):
        """`fp8.project` plus, for a targeted weight, qwix's adapter: (alpha / rank) x einsum(x, A, B) in x's
        dtype."""
        y = fp8.project(equation, x, w, scales, dtype=dtype)  # the interceptor is off inside its own handler
        rule, _ = self._get_current_rule_and_op_id("project")
        module = flax_util.get_current_module()
        name = next((n for n, v in vars(module).items() if v is w), None) if isinstance(w, nnx.Variable) else None
        owner = str(module.qwix_path[-1]) if getattr(module, "qwix_path", ()) else ""
        if not isinstance(rule, qwix_lora.LoraRule) or name not in self.targets.get(owner, ()):
            return y
        a_shape, b_shape, lora_equation, a_axes, b_axes = qwix_lora._parse_einsum_str_for_lora(
            x.shape, w.shape, equation, rule.rank
        )
        a, b = qwix_lora._get_or_create_lora_params(
            name=name, rule=rule, a_shape=a_shape, b_shape=b_shape, a_sharding_transpose=a_axes,
            b_sharding_transpose=b_axes,
        )  # fmt: skip
        delta = jnp.einsum(lora_equation, x, a.astype(x.dtype), b.astype(x.dtype))
        return y + delta * jnp.asarray(rule.alpha / rule.rank, x.dtype)


def check_lora(config: Any, lora: LoraConfig) -> None:
    """Refuse, in one line, a model the adapters cannot be added to yet (`config`: its `TransformerConfig`)."""
    if config.experts:
        raise SpmdkitError("--lora on a mixture-of-experts model is not supported yet: train it without --lora.rank")
    if config.fp8:
        raise SpmdkitError("--lora with --model.fp8: qwix's adapters do not wrap the FP8 matmuls yet; drop one")


def add_adapters(model: nnx.Module, lora: LoraConfig, rngs: nnx.Rngs) -> nnx.Module:
    """`model` (a `Transformer`) with qwix's adapters on the projections `lora` targets in every block; its own
    parameters unchanged. SpmdkitError when a target matches no weight of the model."""
    check_lora(model.config, lora)
    provider = _ProjectionLora(lora)
    for stack in STACKS:
        if hasattr(model, stack):
            setattr(model, stack, _adapt_stack(getattr(model, stack), model.config, provider, rngs))
    found = {str(path[-1]).split("_lora_")[0] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    missing = [t for t in lora.target_names if t not in found]
    if missing:
        raise SpmdkitError(
            f"--lora.targets {','.join(missing)} matched no layer of this model: target some of "
            f"{','.join(sorted(found)) or 'q,k,v,o,gate,up,down'}"
        )
    return model


def _adapt_stack(stack: nnx.Module, config: Any, provider: qwix.LoraProvider, rngs: nnx.Rngs) -> nnx.Module:
    """A stack of blocks (parameters on a leading `layers` dim) with adapters, made block by block under
    `nnx.vmap` as `spmdkit.models.transformer._stacked_blocks` makes the blocks."""
    count = jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]
    x = jnp.zeros((1, 1, config.embed), config.dtype)
    positions = jnp.zeros((1, 1), jnp.int32)

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def adapt(block: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        return qwix.apply_lora_to_model(block, provider, x, positions, rngs=rngs)

    return adapt(stack, rngs)


def has_adapters(model: nnx.Module) -> bool:
    """Whether `model` holds LoRA adapters."""
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def trained_variables(model: nnx.Module) -> type[nnx.Param]:
    """The variables that train: the adapters (`nnx.LoRAParam`) of a model that has them, else every `nnx.Param`."""
    return nnx.LoRAParam if has_adapters(model) else nnx.Param


def base_params(tree: dict) -> dict:
    """A pure dict of the model's state (or its shardings) without the LoRA adapters: the base model's parameters."""
    if not isinstance(tree, dict):
        return tree
    return {k: base_params(v) for k, v in tree.items() if not is_adapter(str(k))}
