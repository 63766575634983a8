"""The `optimizer` section of the run's configuration: AdamW, or Muon with AdamW for what is not a hidden matrix.

No JAX here (`spmdkit.train.config` re-exports `OptimizerConfig`; the CLI reads it to print defaults).
`spmdkit.train.step.optimizer` builds the optax transformation this describes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

from spmdkit.models.fields import arg, check_types, require

__all__ = ["MUON_DEFAULTS", "OptimizerConfig", "OptimizerName"]

# Learning-rate defaults: training from scratch, and fine-tuning weights given by --init-from (a small peak lr and
# no warmup from 0, which would spend the first steps not learning).
SCRATCH_LR, SCRATCH_WARMUP = 3e-3, 10
FINE_TUNE_LR, FINE_TUNE_WARMUP = 1e-5, 0

OptimizerName = Literal["adamw", "muon"]
# Muon's own settings and their defaults (Moonlight's: Muon's update scaled to AdamW's RMS, so that AdamW's lr and
# weight decay carry over; optax.contrib.muon's momentum and Newton-Schulz steps); AdamW runs ignore them, so a
# value other than these with `name` adamw is refused rather than silently dropped.
# Muon's lr when unset: MUON_LR_SCALE x lr, Moonlight's rule (at RMS 0.2 AdamW's lr carries over, at any width).
# A tiny model likes more: on `tiny` (300 steps, the session's run of tests/conftest.py) AdamW ends at 2.009, Muon
# at 1 x lr 2.049, 2 x 1.879, 4 x 1.776; the default is not tuned to it (`--optimizer.muon-lr` sets it).
MUON_LR_SCALE = 1
MUON_DEFAULTS = {"muon_lr": None, "muon_beta": 0.95, "muon_nesterov": True, "muon_ns_steps": 5, "muon_rms": 0.2}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, or Muon (`name` muon): the momentum of each hidden weight matrix (attention q/k/v/o, MLP, expert and
    router weights) orthogonalised by Newton-Schulz iterations, one matrix at a time in a stack of them (the
    `layers` and `experts` axes); AdamW with these b1, b2, eps for the embedding, the LM head, norm scales and
    biases. `lr` is the peak: it warms up linearly over `warmup_steps`, then decays by cosine to
    `lr * final_lr_fraction` at `decay_steps`. Unset `lr` / `warmup_steps` take the defaults for training from
    scratch (3e-3, 10) or for fine-tuning `--init-from` weights (1e-5, 0: step 1 already learns)."""

    name: Annotated[
        OptimizerName, arg("adamw, or muon: Newton-Schulz orthogonalised momentum for hidden matrices, AdamW for "
                           "the rest")
    ] = "adamw"  # fmt: skip
    lr: Annotated[
        float | None, arg("peak learning rate (None: 3e-3, or 1e-5 fine-tuning --init-from weights)", "--lr")
    ] = None
    warmup_steps: Annotated[
        int | None,
        arg("linear warmup steps from 0 to lr (0: start at lr; None: 10, or 0 fine-tuning)", "--warmup-steps"),
    ] = None
    decay_steps: Annotated[int | None, arg("steps of the cosine decay (None: the run's steps)")] = None
    final_lr_fraction: Annotated[float, arg("the decay ends at lr x this")] = 0.1
    b1: Annotated[float, arg("AdamW beta1")] = 0.9
    b2: Annotated[float, arg("AdamW beta2")] = 0.95
    eps: Annotated[float, arg("AdamW epsilon")] = 1e-8
    weight_decay: Annotated[
        float, arg("decoupled weight decay x lr (AdamW's and Muon's; not applied to norm scales and biases)",
                   "--weight-decay")
    ] = 0.1  # fmt: skip
    clip_norm: Annotated[float | None, arg("clip gradients to this global norm (None: no clipping)", "--clip-norm")] = (
        1.0
    )
    max_bad_steps: Annotated[int, arg("stop after this many consecutive NaN/Inf steps", "--max-bad-steps")] = 5
    offload: Annotated[
        bool, arg("keep the AdamW moments in pinned host memory between steps (moved to the device for the update)")
    ] = False
    muon_lr: Annotated[
        float | None, arg("Muon's peak lr for the hidden matrices, on lr's schedule (None: lr)")
    ] = None  # fmt: skip
    muon_beta: Annotated[float, arg("Muon's momentum decay")] = 0.95
    muon_nesterov: Annotated[bool, arg("Muon's Nesterov momentum")] = True
    muon_ns_steps: Annotated[int, arg("Newton-Schulz iterations per update")] = 5
    muon_rms: Annotated[
        float | None, arg("scale each orthogonalised update to this RMS, x sqrt(max(fan_in, fan_out)), as AdamW's "
                          "(None: Keller Jordan's sqrt(max(1, fan_out / fan_in)), which wants a ~10x larger lr)")
    ] = 0.2  # fmt: skip

    def __post_init__(self) -> None:
        check_types(self, "optimizer")
        lr, warmup = self.lr, self.warmup_steps
        for name, value in (("learning rate", lr), ("--optimizer.muon-lr", self.muon_lr)):
            require(value is None or (math.isfinite(value) and value > 0), f"{name} {value} must be a positive number")
        require(warmup is None or warmup >= 0, f"warmup steps {warmup} must be >= 0")
        require(self.decay_steps is None or self.decay_steps >= 1, f"decay_steps {self.decay_steps} must be >= 1")
        require(0 <= self.final_lr_fraction <= 1, f"final_lr_fraction {self.final_lr_fraction} must be in [0, 1]")
        for name in ("b1", "b2"):
            require(0 <= getattr(self, name) < 1, f"AdamW {name}={getattr(self, name)} must be in [0, 1)")
        require(0 <= self.muon_beta < 1, f"--optimizer.muon-beta {self.muon_beta} must be in [0, 1)")
        require(self.eps > 0, f"AdamW eps={self.eps} must be positive")
        require(self.weight_decay >= 0, f"--weight-decay {self.weight_decay} must be >= 0")
        require(self.clip_norm is None or self.clip_norm > 0, f"--clip-norm {self.clip_norm} must be positive")
        require(self.max_bad_steps >= 1, f"--max-bad-steps {self.max_bad_steps} must be at least 1")
        require(self.muon_ns_steps >= 1, f"--optimizer.muon-ns-steps {self.muon_ns_steps} must be at least 1")
        require(self.muon_rms is None or self.muon_rms > 0, f"--optimizer.muon-rms {self.muon_rms} must be positive")
        if self.name == "adamw":
            given = [k for k, default in MUON_DEFAULTS.items() if getattr(self, k) != default]
            require(not given, f"--optimizer.{given[0].replace('_', '-') if given else ''} is a Muon setting: add "
                    "--optimizer.name muon, or leave it out")  # fmt: skip
        require(
            not (self.offload and self.name == "muon"),
            "--optimizer.offload moves AdamW's moments only: it does not combine with --optimizer.name muon (drop one)",
        )

    def for_run(self, fine_tuning: bool = False) -> OptimizerConfig:
        """This config with an unset `lr` / `warmup_steps` given the defaults for training from scratch or for
        fine-tuning (`--init-from`)."""
        lr, warmup = (FINE_TUNE_LR, FINE_TUNE_WARMUP) if fine_tuning else (SCRATCH_LR, SCRATCH_WARMUP)
        return dataclasses.replace(
            self,
            lr=lr if self.lr is None else self.lr,
            warmup_steps=warmup if self.warmup_steps is None else self.warmup_steps,
        )
