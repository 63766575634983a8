"""What a training step is compiled from, decided once: `build_program(config, devices)`.

The run's config resolves to a `TrainProgram`: the mesh over `devices` (real ones, or compile-only GPU devices of
`spmdkit.targets`), the model config, the logical-axis rules, the attention kernel that runs on those devices, the
pipeline schedule and the optimizer. The Trainer runs it on real devices; `spmdkit compile` lowers the same step on
`ShapeDtypeStruct`s (`abstract_state`, `abstract_batch`) for a GPU target, so both compile the one program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from spmdkit.data.packing.rows import FIELDS
from spmdkit.data.resolve import resolve_source, source_tokenizer
from spmdkit.errors import SpmdkitError
from spmdkit.interop.sources import weights_checksum
from spmdkit.models.attention_choice import ULYSSES, choose_attention
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora import check_lora
from spmdkit.models.lora_config import LoraConfig
from spmdkit.parallel.collective_matmul import rings
from spmdkit.parallel.context.chunks import ring_balance
from spmdkit.parallel.context.ulysses import choose_parts
from spmdkit.parallel.pipeline.schedule import Schedule
from spmdkit.plan.dispatch import choose_dispatch
from spmdkit.plan.layout import Layout, check_layout
from spmdkit.sharding.mesh import MeshConfig, make_mesh
from spmdkit.sharding.rules import Rules, make_rules
from spmdkit.sharding.strategy import mesh_text
from spmdkit.targets.device_facts import compute_capability, device_platform
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.optimizer import make_optimizer, schedule
from spmdkit.train.step.pipeline import pipeline_schedule
from spmdkit.train.step.state import TrainState, abstract_train_state, create_train_state, gradient_shardings
from spmdkit.train.step.train_step import StepFn, batch_shardings, make_train_step


@dataclasses.dataclass
class TrainProgram:
    """The resolved run: `config` (model settings resolved, vocabulary from the data, optimizer defaults for a
    fresh or fine-tuning run), the mesh, the model, the rules, the attention kernel, the pipeline schedule (None
    without a pipeline axis), the optimizer and its learning-rate schedule."""

    config: TrainConfig
    mesh: Mesh
    model_config: TransformerConfig
    rules: Rules
    attention: str  # the kernel that runs: dot, blockwise, cudnn or ring
    pipeline: Schedule | None
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    dispatch_reason: str = ""  # MoE: which dispatch runs and why (`--moe-dispatch auto`'s count); "" without experts

    @property
    def context(self) -> int:
        return self.mesh.shape["context"]

    def layout(self) -> Layout:
        return layout(self.config, self.mesh, self.model_config)

    def batch_keys(self) -> tuple[str, ...]:
        """The batch's arrays as the data gives them (packed documents add `segment_ids` and `loss_mask`)."""
        return FIELDS[resolve_source(self.config.data).packing]

    def _state_args(self) -> tuple[Any, ...]:
        """What `abstract_train_state` and `create_train_state` take: model, optimizer, mesh, rules, seed, offload,
        LoRA."""
        config = self.config
        return self.model_config, self.tx, self.mesh, self.rules, config.run.seed, config.optimizer.offload, config.lora

    def abstract_state(self) -> TrainState:
        """The train state as `ShapeDtypeStruct`s carrying their shardings: nothing is allocated."""
        graphdef, abstract, shardings = abstract_train_state(*self._state_args())
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        shapes = jax.tree.map(
            lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
            abstract, shardings, is_leaf=is_variable,
        )  # fmt: skip
        grads = gradient_shardings(graphdef, abstract, self.mesh, self.rules)
        return TrainState(graphdef, shapes, shardings, grads)

    def create_state(self) -> TrainState:
        """The train state of this program, initialised on its devices (the moments in host memory under
        `--optimizer.offload`): what `abstract_state` describes."""
        return create_train_state(*self._state_args())

    def abstract_batch(self, keys: Sequence[str]) -> dict[str, jax.ShapeDtypeStruct]:
        """int32 [batch, seq] `ShapeDtypeStruct`s named by `keys`, sharded as the step takes them."""
        run = self.config.run
        shardings = batch_shardings(self.mesh, self.rules, tuple(keys))
        return {k: jax.ShapeDtypeStruct((run.batch_size, run.seq_len), "int32", sharding=shardings[k]) for k in keys}

    def train_step(self, state: TrainState, keys: Sequence[str], token_bytes: Any = None) -> StepFn:
        """The jitted train step of this program (see `spmdkit.train.step.train_step.make_train_step`)."""
        run = self.config.run
        return make_train_step(
            state, self.mesh, self.rules, run.grad_accum, self.lr_schedule, tuple(run.fail_steps), self.pipeline,
            tuple(keys), token_bytes,
        )  # fmt: skip


def microbatches(config: TrainConfig, mesh: Mesh) -> int:
    """The step's one microbatch count: with a pipeline axis `--microbatches` (default: twice the stages), else
    `--grad-accum`; the other knob is refused, not ignored."""
    stages, settings, run = mesh.shape["pipeline"], config.mesh, config.run
    if stages > 1 and run.grad_accum != 1:
        raise SpmdkitError("--grad-accum does not combine with pipelining: raise --microbatches instead")
    if stages == 1 and settings.microbatches not in (None, run.grad_accum):
        raise SpmdkitError("--microbatches counts a pipeline's microbatches: without one, set --grad-accum instead")
    return (settings.microbatches or 2 * stages) if stages > 1 else run.grad_accum


def layout(config: TrainConfig, mesh: Mesh, model: TransformerConfig) -> Layout:
    """The run's layout as the planner describes it (and `check_layout` checks it)."""
    settings, run = config.mesh, config.run
    return Layout(
        mesh_text(mesh.shape), settings.zero, settings.sequence_parallel, microbatches(config, mesh),
        settings.pipeline_schedule, settings.virtual_stages, config.optimizer.offload, settings.context_parallel,
        settings.ulysses or 1, config.optimizer.name == "muon", model=model,
        batch_size=run.batch_size, seq_len=run.seq_len, lora=config.lora if config.lora.enabled else None,
    )  # fmt: skip


def with_data_vocab(config: TrainConfig) -> TrainConfig:
    """A model trained from scratch on prepared datasets takes its vocabulary from their tokenizer (rounded up to
    a multiple of 128, `Tokenizer.model_vocab_size`) unless `--model.vocab-size` sets it; weights from
    `--init-from` keep theirs (the data stream checks that the tokenizer fits)."""
    model = config.model
    if model.vocab_size is None and not model.init_from and resolve_source(config.data).kind in ("prepared", "mixture"):
        vocab = source_tokenizer(config.data).model_vocab_size
        config = dataclasses.replace(config, model=dataclasses.replace(model, vocab_size=vocab))
    return config


def resolve_config(config: TrainConfig) -> TrainConfig:
    """The config as the run saves it: the model's full shape (not a preset or a path that may move), its
    vocabulary from the data, and the learning rate of a fresh run or of a fine-tuning one (`--init-from`)."""
    fine_tuning = bool(config.model.init_from)
    config = with_data_vocab(config)
    optimizer = config.optimizer.for_run(fine_tuning)
    return dataclasses.replace(config, model=config.model.resolved(), optimizer=optimizer, lora=lora_base(config))


def lora_base(config: TrainConfig) -> LoraConfig:
    """The LoRA settings with the checksum of the `--init-from` weights they train on (`weights_checksum`); a
    checksum given beforehand must be theirs."""
    lora, source = config.lora, config.model.init_from
    if not lora.enabled or not source:
        return lora
    checksum = weights_checksum(source)
    if lora.base_checksum not in (None, checksum):
        raise SpmdkitError(
            f"--init-from {source} is not the base these adapters were trained on (checksum {checksum}, expected "
            f"{lora.base_checksum}): give the run's base weights"
        )
    return dataclasses.replace(lora, base_checksum=checksum)


def check_levers(model: TransformerConfig, rules: Rules, mesh: Mesh) -> None:
    """Refuse the speed levers' combinations that have no implementation yet, in one line each."""
    ring = rings(rules, mesh.shape)
    if model.fp8 and ring:
        raise SpmdkitError("--overlap-tp's collective matmuls have no FP8 form yet: drop --model.fp8 or --overlap-tp")
    if ring and mesh.shape["pipeline"] > 1:  # Shardy cannot nest the rings' shard_map in a pipeline stage
        raise SpmdkitError("--overlap-tp's collective matmuls do not run inside pipeline stages yet: drop one")
    if model.fp8 and mesh.shape["pipeline"] > 1:  # the pipeline's own backward has no path for the FP8 scales
        raise SpmdkitError("--model.fp8 does not run with a pipeline axis yet: drop --model.fp8 or the pipeline")
    for axis, why in (("pipeline", "its stages run the main model only"), ("context", "its sequence layout")):
        if model.mtp_depth and mesh.shape[axis] > 1:  # MTP shifts targets along the sequence, after the last layer
            raise SpmdkitError(f"--model.mtp-depth does not run with a {axis} axis yet ({why}): drop one")


def check_lora_run(config: TrainConfig, mesh: Mesh, model: TransformerConfig, abstract: bool = False) -> None:
    """Refuse, in one line each, what `--lora.rank` does not combine with yet; `abstract`: the program is only
    compiled (`spmdkit compile`), on a base of shapes, so it needs no `--init-from` weights."""
    if not config.lora.enabled:
        return
    if not config.model.init_from and not abstract:
        raise SpmdkitError("--lora.rank trains adapters on frozen weights: give them with --init-from HF_DIR")
    check_lora(model, config.lora)
    for on, what in (
        (mesh.shape["pipeline"] > 1, "a pipeline axis (its schedule computes every parameter's gradients)"),
        (config.mesh.overlap_tp, "--overlap-tp (its collective matmuls bypass the adapted projections)"),
        (config.optimizer.offload, "--optimizer.offload (the adapters' moments are small: keep them on the device)"),
        (config.optimizer.name == "muon", "--optimizer.name muon (it is set up for the base's matrices)"),
        (model.mtp_depth > 0, "--model.mtp-depth (the MTP modules would stay frozen): pass --model.mtp-depth 0"),
    ):
        if on:
            raise SpmdkitError(f"--lora does not run with {what} yet: drop one")


def ulysses_factor(factor: int | None, sizes: Mapping[str, int], model: TransformerConfig) -> int:
    """2D context parallelism's Ulysses factor U (1 without it), checked: a divisor of context strictly between 1
    and context (U = context is --context-parallel ulysses, U = 1 the ring), dividing the heads per tensor rank."""
    if factor is None:
        return 1
    C, T = sizes["context"], sizes["tensor"]
    if not 1 < factor < C or C % factor:
        raise SpmdkitError(
            f"--ulysses {factor} must divide context={C} and lie strictly between 1 and it (--context-parallel "
            "ulysses is the whole axis, ring none of it)"
        )
    if (model.heads // T) % factor:
        raise SpmdkitError(
            f"--ulysses {factor}: the {model.heads // T} heads per tensor rank do not split over it: pick a factor "
            "that divides them"
        )
    return factor


def moe_dispatch(
    config: TrainConfig, mesh: Mesh, model: TransformerConfig, platform: str
) -> tuple[TransformerConfig, str]:
    """The MoE dispatch that runs on `platform` (`--moe-dispatch auto` resolved by the planner's count of expert
    FLOPs, `spmdkit.plan.dispatch`) and why, for the reports; a dense model is returned as it is, with ""."""
    if not model.moe_layers:
        return model, ""
    if model.dispatch != "auto":
        return model, f"{model.dispatch}: as configured"
    split = layout(config, mesh, model).replicas > 1  # the experts run in expert_ffn's shard_map
    choice = choose_dispatch(model, config.run.seq_len, split, platform)
    return model.replace(dispatch=choice.dispatch), f"{choice.reason} (--moe-dispatch auto)"


def output_parts(config: TrainConfig, mesh: Mesh, model: TransformerConfig, kernel: str) -> int:
    """The head parts attention's output is exchanged and projected in under Ulysses (`--model.ulysses-parts`, its
    0 resolved: `spmdkit.parallel.context.ulysses.choose_parts`); 1 for every other kernel."""
    requested, lora = model.ulysses_parts, config.lora
    if kernel not in ULYSSES:
        if requested > 1:
            raise SpmdkitError(f"--model.ulysses-parts {requested} needs Ulysses attention, not {kernel}: drop it")
        return 1
    blocker = (
        "the output projection is FP8" if model.fp8
        else "the output projection runs in --overlap-tp's ring" if config.mesh.overlap_tp
        else "the output projection has LoRA adapters" if lora.rank and "o" in lora.targets.split(",")
        else "the output projection is quantized (QLoRA)" if lora.rank and lora.quantize != "none"
        else None
    )  # fmt: skip
    return choose_parts(requested, model.heads, model.kv_heads, mesh.shape["tensor"], mesh.shape["context"], blocker)


def build_program(config: TrainConfig, devices: Sequence[Any] | None = None, abstract: bool = False) -> TrainProgram:
    """The program of `config` on `devices` (default: every device of every process). Everything the mesh, model
    and batch must agree on is checked here, before any array exists; an explicit attention kernel that cannot run
    on these devices is an error now. `abstract`: only its `abstract_state` will be used (`spmdkit compile`), so
    LoRA's frozen base needs no weights."""
    config = resolve_config(config)
    mesh = make_mesh(MeshConfig.parse(config.mesh.mesh, config.mesh.dcn), devices)
    model = config.model.build()
    ulysses = ulysses_factor(config.mesh.ulysses, mesh.shape, model)
    device, split = mesh.devices.flat[0], mesh.shape["tensor"] * mesh.shape["context"]
    kernel = choose_attention(
        model.attention, context=mesh.shape["context"], platform=device_platform(device), dtype=model.dtype,
        head_dim=model.head_dim, compute_capability=compute_capability(device), softcap=model.attention_softcap,
        sinks=model.attention_sinks,
        context_parallel=config.mesh.context_parallel, head_split=0 if model.heads % split else model.heads // split,
    )  # fmt: skip
    model, dispatch_reason = moe_dispatch(config, mesh, model, device_platform(device))
    windows = [model.window_of(i) for i in range(model.layers)]
    ring_layout = ring_balance(windows, config.run.seq_len, mesh.shape["context"] // ulysses)
    settings = config.mesh
    rules = make_rules(
        settings.zero, settings.sequence_parallel, overlap_tp=settings.overlap_tp, ulysses=ulysses,
        ring_layout=ring_layout,
    )  # fmt: skip
    check_layout(layout(config, mesh, model))
    run, pipeline = config.run, None
    check_levers(model, rules, mesh)
    check_lora_run(config, mesh, model, abstract)
    if mesh.shape["pipeline"] > 1:
        count = microbatches(config, mesh)
        pipeline = pipeline_schedule(settings.pipeline_schedule, mesh, count, settings.virtual_stages, model.layers)
    tx = make_optimizer(config.optimizer, run.steps, model)
    parts = output_parts(config, mesh, model, kernel)
    model = model.replace(attention=kernel, ulysses_parts=parts)  # decided once, here: the model runs its config
    return TrainProgram(
        config, mesh, model, rules, kernel, pipeline, tx, schedule(config.optimizer, run.steps), dispatch_reason
    )
