"""`LoraConfig`, the `[lora]` section (`--lora.rank R --lora.alpha A --lora.targets q,k,v,o,gate,up,down`): which
projections of every block get a low-rank adapter and how it is scaled. No JAX: `spmdkit.train.config` reads it.

The adapters themselves are built by qwix (`spmdkit.models.lora`); the names here are spmdkit's projection names,
the weights of `Attention` (`q`, `k`, `v`, `o`) and of the dense `MLP` (`gate`, `up`, `down`), and each maps to
one Hugging Face module name (`HF_MODULES`: `q_proj`, ..., `down_proj`), what a PEFT adapter's `target_modules`
lists.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from spmdkit.models.fields import arg, check_types, require

# spmdkit projection -> (the block's module that holds it, its Hugging Face module name)
PROJECTIONS: dict[str, tuple[str, str]] = {
    "q": ("attention", "q_proj"), "k": ("attention", "k_proj"), "v": ("attention", "v_proj"),
    "o": ("attention", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj"),
}  # fmt: skip
HF_MODULES = {name: hf for name, (_, hf) in PROJECTIONS.items()}
Quantize = Literal["none", "int8", "nf4"]


def is_adapter(name: str) -> bool:
    """Whether a parameter's name (a path part `q_lora_a`, or a `/`-joined path) is a LoRA adapter's."""
    return "_lora_" in name


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the blocks' projections (rank 0: off). A targeted weight W stays frozen; the layer
    computes x W + (alpha / rank) x A B with A [in, rank] (he-uniform) and B [rank, out] (zeros), as PEFT's LoRA
    does (`lora_alpha / r`), so that a fresh adapter leaves the model unchanged. Only A and B train. With
    `quantize` (QLoRA) every projection W of the blocks is held quantized and dequantized where it is used."""

    rank: Annotated[int, arg("LoRA rank r of every adapter (0: no LoRA, every parameter trains)")] = 0
    alpha: Annotated[float, arg("LoRA alpha: the adapters' output is scaled by alpha / rank")] = 16.0
    targets: Annotated[
        str, arg("comma-separated projections that get adapters: any of q,k,v,o (attention), gate,up,down (MLP)")
    ] = "q,k,v,o,gate,up,down"
    quantize: Annotated[
        Quantize,
        arg(
            "QLoRA: hold the blocks' frozen projections quantized, int8 (per output channel) or nf4 (4-bit "
            "NormalFloat, a scale per 64 weights); none: in the parameter dtype"
        ),
    ] = "none"
    base_checksum: Annotated[
        str | None,
        arg("checksum of the --init-from weights the adapters are trained on (the run records it; a resume checks it)"),
    ] = None

    def __post_init__(self) -> None:
        check_types(self, "lora")
        require(self.rank >= 0, f"--lora.rank {self.rank} must be >= 0 (0: no LoRA)")
        require(self.alpha > 0, f"--lora.alpha {self.alpha} must be positive")
        require(
            self.quantize == "none" or self.rank > 0,
            f"--lora.quantize {self.quantize} quantizes the frozen base under LoRA adapters: give --lora.rank R too",
        )
        unknown = [t for t in self.target_names if t not in PROJECTIONS]
        require(
            not unknown and bool(self.target_names),
            f"--lora.targets {self.targets!r}: {', '.join(unknown) or 'none given'} is not a projection; name some "
            f"of {','.join(PROJECTIONS)}",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_names(self) -> tuple[str, ...]:
        """The targeted projections, in the order `PROJECTIONS` lists them."""
        given = {t.strip() for t in self.targets.split(",") if t.strip()}
        return tuple(t for t in PROJECTIONS if t in given) + tuple(sorted(given - set(PROJECTIONS)))

    @property
    def scale(self) -> float:
        """alpha / rank: what multiplies the adapters' product."""
        return self.alpha / self.rank
