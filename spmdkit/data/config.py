"""`DataConfig`: which tokens a run reads (pure Python: the CLI and the run config read it without JAX)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from spmdkit.errors import SpmdkitError


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from (each field's `metadata` holds its help and short command-line flags)."""

    source: str = dataclasses.field(
        default="stdlib",
        metadata={
            "help": "stdlib (embedded Python sources), synthetic, or a .bin/.npy token file",
            "flags": ("--data",),
        },
    )
    token_dtype: Literal["uint16", "uint32"] = dataclasses.field(
        default="uint16", metadata={"help": "dtype of a raw .bin token file", "flags": ("--token-dtype",)}
    )
    eval_fraction: float = dataclasses.field(
        default=0.05, metadata={"help": "held-out share (stdlib: whole files; a token file: its tail)", "flags": ()}
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise SpmdkitError(f"eval_fraction={self.eval_fraction} is out of range: use a value in [0, 1)")
