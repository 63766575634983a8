"""Low-rank adapters on the model's projections, added by qwix (`qwix.LoraProvider`, `qwix.apply_lora_to_model`),
over a frozen base held in the parameter dtype or, for QLoRA, quantized.

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

QLoRA (`--lora.quantize int8|nf4`) is qwix's own: the rule gets a `weight_qtype`, as `LoraRule(weight_qtype=...)`
does for qwix's PTQ provider, and on that first pass every projection of the blocks (targeted or not) is quantized
by qwix's `create_quantized_param`, which replaces the weight in its module by a `WithAux` of a `QArray`: for q
[embed, heads, head_dim] qvalue [embed, heads, head_dim] (int8, or nf4 codes) and a scale [1, heads, head_dim] in
the parameter dtype (one per output channel; nf4 one per 64 inputs where the contracted dim divides by 64), both
`nnx.Param`s with W's logical names (the scale's size-1 dims named None), stacked on `layers` like the rest. The
train state holds them instead of W (`{"array": {"qvalue", "scale"}}` in its pure dict); the projection
dequantizes in the compute dtype (qwix's einsum). `quantize_base` quantizes the `--init-from` weights the same
way; `as_trained` gives back the base the adapters trained on (the merged export, a run's evaluation). nf4
codes are held as int4 (code - 8): the checkpoints' TensorStore zarr3 has int4 but no uint4.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.core import einsum as qwix_einsum  # how qwix quantizes an einsum's weight
from qwix._src.providers import lora as qwix_lora  # qwix's LoRA shapes (from an einsum) and parameter creation
from qwix._src.providers import ptq  # qwix's PTQ: a quantized weight (`WithAux`) replacing the float one
from qwix._src.utils import flax_util  # how qwix finds the module a call runs in

from spmdkit.errors import SpmdkitError
from spmdkit.models import fp8
from spmdkit.models.lora_config import PROJECTIONS, LoraConfig, is_adapter
from spmdkit.models.moe import RoutingBias

STACKS = ("blocks", "moe_blocks")  # `Transformer`'s stacked blocks
PROJECT = "spmdkit.models.fp8.project"  # the function every projection of the blocks calls
QTYPES = {"int8": jnp.int8, "nf4": "nf4"}  # --lora.quantize -> qwix's qtype of the frozen projections
NF4_OFFSET = 8  # an nf4 code 0..15 is held as int4 code - 8 (`_stored`)
NF4_BLOCK = 64  # nf4 scales: one per 64 weights along the contracted dim (QLoRA's block size) where it divides


class _ProjectionLora(qwix.LoraProvider):
    """qwix's (Q)LoRA provider on spmdkit's projections: the rule matches the modules holding targeted weights
    (`attention`, `mlp`; both under QLoRA, which quantizes every projection of the blocks) and applies to
    `project` calls (op name "project"); the attention kernel's einsums run as they are."""

    def __init__(self, config: LoraConfig):
        self.targets: dict[str, set[str]] = {}
        for name in config.target_names:
            self.targets.setdefault(PROJECTIONS[name][0], set()).add(name)
        quantized = config.quantize != "none"
        path = "|".join(sorted({owner for owner, _ in PROJECTIONS.values()} if quantized else self.targets))
        rule = qwix.LoraRule(
            module_path=path, op_names=("project",), rank=config.rank, alpha=config.alpha,
            weight_qtype=QTYPES.get(config.quantize), tile_size=NF4_BLOCK if config.quantize == "nf4" else None,
        )  # fmt: skip
        super().__init__([rule])

    def get_intercept_map(self) -> dict[str, Any]:
        return super().get_intercept_map() | {PROJECT: self.project}

    def project(self, equation: str, x: jax.Array, w: Any, scales: Any = None, *, dtype: str | None = None):
        """`fp8.project` (on the dequantized weight under QLoRA) plus, for a targeted weight, qwix's adapter:
        (alpha / rank) x einsum(x, A, B) in x's dtype."""
        rule, _ = self._get_current_rule_and_op_id("project")
        module = flax_util.get_current_module()
        known = isinstance(w, nnx.Variable | ptq.WithAux)
        name = next((n for n, v in vars(module).items() if v is w), None) if known else None
        if not isinstance(rule, qwix_lora.LoraRule) or name is None:
            return fp8.project(equation, x, w, scales, dtype=dtype)  # the interceptor is off inside its handler
        if rule.weight_qtype is None:
            y = fp8.project(equation, x, w, scales, dtype=dtype)
        else:
            y = _quantized_project(equation, x, w, name, rule, dtype or x.dtype)
        owner = str(module.qwix_path[-1]) if getattr(module, "qwix_path", ()) else ""
        if name not in self.targets.get(owner, ()):
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


def _quantized_project(equation: str, x: jax.Array, w: Any, name: str, rule: Any, dtype: Any) -> jax.Array:
    """x W with W held quantized (qwix's `WithAux` of a `QArray`: qvalue in W's shape, scale with 1 on the
    contracted dims), dequantized in `dtype` by qwix's einsum. A weight still in float (the first pass, under
    `add_adapters`) is quantized here and replaced in its module by qwix's PTQ (`create_quantized_param`), as
    `qwix.PtqProvider.einsum` does; the scale's logical names drop the contracted dims (size 1: nothing to shard)."""
    if isinstance(w, nnx.Variable):
        tile = rule.tile_size if rule.tile_size and w.shape[_last_contracted(equation)] % rule.tile_size == 0 else None
        how = qwix_einsum.get_how_to_quantize(
            einsum_str=equation, ndims=(x.ndim, w.ndim), for_lhs=False, tile_size=tile, qtype=rule.weight_qtype,
            calibration_method=rule.weight_calibration_method,
        )  # fmt: skip
        names = tuple(w.get_metadata().get("out_sharding") or (None,) * w.ndim)
        ptq.create_quantized_param(name, w[...], how)  # the module's weight is now qwix's `WithAux(QArray)`
        w = getattr(flax_util.get_current_module(), name)  # boxed: its qvalue and scale are `nnx.Param`s
        w.array.qvalue.set_value(_stored(w.array.qvalue.get_value()))
        w.array.scale.set_metadata(
            "out_sharding", tuple(n if s > 1 else None for n, s in zip(names, w.array.scale.shape, strict=True))
        )
    array = flax_util.unbox(w.array)
    array = array.replace(qvalue=_unstored(array.qvalue))
    return qwix.einsum(equation, x, array.astype(dtype))


def _stored(qvalue: jax.Array) -> jax.Array:
    """qwix's nf4 codes (uint4, 0..15) as the train state holds them: int4, code - 8 (TensorStore's zarr3, where
    checkpoints go, has int4 but no uint4). int8 as it is."""
    return (qvalue.astype(jnp.int8) - NF4_OFFSET).astype(jnp.int4) if qvalue.dtype == jnp.uint4 else qvalue


def _unstored(qvalue: jax.Array) -> jax.Array:
    """The inverse of `_stored`: nf4 codes back to qwix's uint4."""
    return (qvalue.astype(jnp.int8) + NF4_OFFSET).astype(jnp.uint4) if qvalue.dtype == jnp.int4 else qvalue


def _last_contracted(equation: str) -> int:
    """The weight's last contracted dim in a projection's einsum (`bse,ehd->bshd`: 0; `bshd,hde->bse`: 1)."""
    (lhs, rhs), out = equation.split("->")[0].split(","), equation.split("->")[1]
    return max(i for i, d in enumerate(rhs) if d in lhs and d not in out)


def check_lora(config: Any, lora: LoraConfig) -> None:
    """Refuse, in one line, a model the adapters cannot be added to yet (`config`: its `TransformerConfig`)."""
    if config.experts:
        raise SpmdkitError("--lora on a mixture-of-experts model is not supported yet: train it without --lora.rank")
    if config.kv_lora_rank:
        raise SpmdkitError("--lora on latent attention (kv_lora_rank) is not supported yet: train without --lora.rank")
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


def trained_variables(model: nnx.Module) -> nnx.filterlib.Filter:
    """The variables that train: the adapters (`nnx.LoRAParam`) of a model that has them, else every `nnx.Param` but
    the router's correction bias (`RoutingBias`: no gradient reaches it; the balancing rule moves it)."""
    return nnx.LoRAParam if has_adapters(model) else nnx.All(nnx.Param, nnx.Not(RoutingBias))


def base_params(tree: dict) -> dict:
    """A pure dict of the model's state (or its shardings) without the LoRA adapters: the base model's parameters,
    as `--init-from` reads them. A QLoRA weight's node (`{"array": {"qvalue", "scale"}}`) stands for the float
    weight by its qvalue's leaf: the weight's shape and sharding."""
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"array"}:
        return tree["array"]["qvalue"]
    return {k: base_params(v) for k, v in tree.items() if not is_adapter(str(k))}


def quantized_weights(model: nnx.Module) -> dict[tuple[str, ...], Any]:
    """Path -> qwix's `HowToQuantize` of every weight `model` holds quantized (QLoRA; none without it)."""
    found = {}
    for path, module in nnx.iter_modules(model):
        for name, value in vars(module).items():
            if isinstance(value, ptq.WithAux):
                found[(*map(str, path), name)] = value.how
    return found


def _quantizer(how: Any) -> Any:
    """qwix's quantization of one weight as qwix's `HowToQuantize` `how` says (one block's: vmap it over layers)."""
    return functools.partial(
        qwix.quantize, qtype=how.qtype, channelwise_axes=how.channelwise_axes, tiled_axes=how.tiled_axes,
        calibration_method=how.calibration_method,
    )  # fmt: skip


def quantize_base(params: dict, model: nnx.Module, shardings: dict) -> dict:
    """`params` (a pure dict of the base's float weights, as read onto `base_params(shardings)`) with each weight
    `model` holds quantized replaced by qwix's quantization of it, `{"array": {"qvalue", "scale"}}` as the train
    state holds it: made in one jit with the state's `shardings` (its pure dict) as out shardings. A stacked
    weight [layers, ...] is quantized layer by layer (vmap), as its `how` was made for one block."""
    hows = quantized_weights(model)
    if not hows:
        return params

    def at(tree: dict, path: tuple[str, ...]) -> Any:
        for key in path:
            tree = tree[key]
        return tree

    def quantize(weights: dict) -> dict:
        out = {}
        for path, how in hows.items():
            one = _quantizer(how)
            q = (jax.vmap(one) if path[0] in STACKS else one)(weights[path])
            out[path] = {"array": {"qvalue": _stored(q.qvalue), "scale": q.scale}}
        return out

    weights = {path: at(params, path) for path in hows}
    with jax.set_mesh(jax.tree.leaves(shardings)[0].mesh):
        quantized = jax.jit(quantize, out_shardings={path: at(shardings, path) for path in hows})(weights)
    merged = jax.tree.map(lambda x: x, params)  # a copy of the dict structure, the arrays shared
    for path, node in quantized.items():
        at(merged, path[:-1])[path[-1]] = node
    return merged


def as_trained(params: dict, config: Any, lora: LoraConfig) -> dict:
    """A pure dict of a (Q)LoRA run's float base parameters (numpy or jax arrays, as read from its `--init-from`,
    in the parameter dtype) as the run computed with them: under QLoRA each weight the model holds quantized is
    quantized as `quantize_base` does and dequantized (qvalue x scale, in the parameter dtype): the base the
    adapters trained on, what a merged export and a run's evaluation use. Without `lora.quantize`: `params`."""
    if lora.quantize == "none":
        return params
    from spmdkit.models import Transformer  # the model, made abstractly, knows how each weight is quantized

    model = nnx.eval_shape(lambda: add_adapters(Transformer(config, rngs=nnx.Rngs(0)), lora, nnx.Rngs(1)))
    out = jax.tree.map(lambda x: x, params)  # a copy of the dict structure, the arrays shared
    for path, how in quantized_weights(model).items():
        one = _quantizer(how)
        roundtrip = lambda w, one=one: qwix.dequantize(one(w)).astype(w.dtype)  # noqa: E731
        parent = functools.reduce(lambda tree, key: tree[key], path[:-1], out)
        w = jnp.asarray(parent[path[-1]])
        parent[path[-1]] = jax.jit(jax.vmap(roundtrip) if path[0] in STACKS else roundtrip)(w)
    return out
