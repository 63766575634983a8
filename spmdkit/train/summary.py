"""What a run says about itself before it compiles (the lines `spmdkit train` prints first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from spmdkit.inspect.params import human_bytes
from spmdkit.sharding.mesh import describe_parallelism, format_sizes

if TYPE_CHECKING:
    from spmdkit.train.loop import Trainer


def describe_run(trainer: Trainer) -> str:
    """The lines a run prints before it compiles: mesh, parallelism, model, memory per device, batch."""
    params, opt = trainer.state_bytes_per_device()
    cfg, run = trainer.model_config, trainer.config.run
    zero = {0: "replicated", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[trainer.rules.zero_stage]
    return "\n".join(
        [
            f"mesh         {format_sizes(dict(trainer.mesh.shape))} on {trainer.mesh.devices.size} "
            f"{jax.devices()[0].platform.upper()} device(s), {jax.process_count()} process(es)",
            f"parallelism  {describe_parallelism(trainer.mesh)}; optimizer state {zero}"
            + ("; sequence parallel" if trainer.rules.sequence_parallel else "")
            + ("; ring attention (zigzag)" if cfg.attention == "ring" else ""),
            f"model        {_model_name(trainer)}: {cfg.num_params():,} parameters, {cfg.layers} layers, "
            f"compute {cfg.dtype}, remat {cfg.remat}",
            *([_describe_experts(trainer)] if cfg.experts else []),
            f"memory       per device: parameters {human_bytes(params)} + optimizer {human_bytes(opt)}",
            f"batch        {run.batch_size} x {run.seq_len} tokens, grad accumulation {run.grad_accum}",
            *([_describe_pipeline(trainer)] if trainer.pipeline else []),
        ]
    )


def _model_name(trainer: Trainer) -> str:
    settings = trainer.config.model
    return f"weights of {settings.init_from}" if settings.init_from else settings.name


def _describe_experts(trainer: Trainer) -> str:
    c = trainer.model_config
    return (
        f"experts      {c.moe_layers} MoE layers of {c.experts} experts, top-{c.top_k}, {c.dispatch} dispatch"
        + (f" (capacity factor {c.capacity_factor})" if c.dispatch == "capacity" else "")
        + f", over expert={trainer.mesh.shape['expert']}; {c.num_params(active=True):,} parameters active per token"
    )


def _describe_pipeline(trainer: Trainer) -> str:
    p = trainer.pipeline
    return (
        f"pipeline     {p.kind} over {p.num_stages} stages, {p.num_microbatches} microbatches, "
        f"{p.virtual_stages} virtual stage(s) each; bubble {p.bubble_fraction():.1%}"
    )
