"""`DataConfig`: which tokens a run reads (pure Python: the CLI and the run config read it without JAX).

`source` is one of:
- `stdlib` (default): the embedded standard-library corpus as bytes (`spmdkit.data.sources`);
- `synthetic`: uniform random tokens;
- a `.bin` / `.npy` token file;
- a prepared dataset directory (`spmdkit data prepare ... --out DIR`; `spmdkit.data.store`);
- a mixture of prepared datasets, `DIR_A=0.7,DIR_B=0.3` (weights: positive numbers, normalised).

`packing` (`spmdkit.data.packing`): `documents` packs whole documents into rows with segment ids and a loss mask;
`windows` cuts the token stream into windows across document boundaries (the old behaviour); `auto` is
`documents` for prepared datasets and mixtures and `windows` for the other sources.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from spmdkit.errors import SpmdkitError
from spmdkit.models.fields import arg, check_types


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from (each field is `Annotated` with its help and short command-line flags)."""

    source: Annotated[
        str,
        arg(
            "stdlib (embedded Python sources), synthetic, a .bin/.npy token file, a prepared dataset directory "
            "(spmdkit data prepare), or a mixture of prepared datasets: DIR_A=0.7,DIR_B=0.3",
            "--data",
        ),
    ] = "stdlib"
    token_dtype: Annotated[Literal["uint16", "uint32"], arg("dtype of a raw .bin token file", "--token-dtype")] = (
        "uint16"
    )
    eval_fraction: Annotated[
        float,
        arg("held-out share (stdlib and prepared data: whole documents by name; a token file: its tail)"),
    ] = 0.05
    packing: Annotated[
        Literal["auto", "documents", "windows"],
        arg(
            "documents: whole documents per row with segment ids and a loss mask; windows: cut across "
            "documents; auto: documents for prepared data, windows otherwise",
            "--packing",
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        check_types(self, "data")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise SpmdkitError(f"eval_fraction={self.eval_fraction} is out of range: use a value in [0, 1)")
