"""Which axes of a weight make the matrix a matrix optimizer (Muon) orthogonalises, read from its logical axis names.

One rule for the optimizer (`spmdkit.train.step.optimizer`) and the planner (`spmdkit.plan.memory`, which counts
one moment for these weights and two for the rest). No JAX.

A weight is a stack of matrices: its `layers` (scanned blocks) and `experts` axes index matrices that are each
orthogonalised alone (Newton-Schulz per matrix, never over the flattened tensor); the other axes are the matrix's
rows (the input, reduced over in `x @ W`) and columns (the output). The input side is the one `embed` is on:
q/k/v [embed, heads, head_dim] is an [embed, heads x head_dim] matrix, o [heads, head_dim, embed] a
[heads x head_dim, embed] one (as MaxText and Moonlight treat them); with no `embed` axis the first is the input.
"""

from __future__ import annotations

from collections.abc import Sequence

STACK_AXES = ("layers", "experts")  # axes that index separate matrices
VECTOR_WORDS = ("norm", "bias")  # parameters named so are scales and offsets (as the weight-decay mask reads them)


def matrix_axes(path: str, names: Sequence[str | None]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(input axes, output axes) of the matrices of the weight at `path` (e.g. "blocks.attention.q") with logical
    axis `names`, or None for a weight that is not a hidden matrix (AdamW's in a Muon run): the embedding and the
    LM head (a `vocab` axis), norm scales and biases (`VECTOR_WORDS` in the path), and anything with fewer than two
    axes besides `STACK_AXES`."""
    if "vocab" in names or any(word in path for word in VECTOR_WORDS):
        return None
    axes = [i for i, name in enumerate(names) if name not in STACK_AXES]
    if len(axes) < 2:
        return None
    if names[axes[-1]] == "embed" and names[axes[0]] != "embed":
        return tuple(axes[:-1]), (axes[-1],)
    return (axes[0],), tuple(axes[1:])
