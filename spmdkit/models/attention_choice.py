"""Which attention kernel runs: the rules, in one place (pure Python: the trainer, the model and the planner read it).

`choose_attention(kind, ...)` turns the model's `attention` setting into the kernel that runs:

- `auto`: with a context axis > 1, the context-parallel algorithm `context_parallel` names (`CONTEXT_PARALLEL`;
  its `auto`: Ulysses around cuDNN on an NVIDIA GPU where cuDNN takes the shape and the heads split over tensor x
  context, else the ring); without one, cuDNN's fused kernel on an NVIDIA GPU where
  cuDNN supports the shape (bfloat16 or float16, head_dim a multiple of 8 up to 128, 256 on Hopper); else the
  blockwise kernel. Pipeline stages and gradient accumulation over replica axes run the model inside a partly
  manual `shard_map`; cuDNN runs there too, in regions nested over the axes still automatic
  (`spmdkit.models.attention`; its backward recomputes the forward kernel, docs/jax-limits.md says why).
  cuDNN has no attention-logit soft cap (Gemma 2): with `softcap` > 0 `auto` runs the blockwise kernel and
  `cudnn` is refused. Attention sinks (GPT-OSS) run in `dot`, `blockwise`, `ring` and Ulysses around the first two:
  with `sinks` `auto` runs the blockwise kernel (the ring under a context axis), and cuDNN is refused in one line
  (`ulysses_cudnn` too). On CPU the blockwise kernel is also the faster one at every length measured, 32 to 4096
  tokens (docs/benchmarks.md, "Attention kernels"), so `dot` is only ever the explicit reference.
- `dot` (the reference, O(seq^2) scores), `blockwise` (O(seq) memory), `cudnn`, `ring`: that kernel, or one
  SpmdkitError saying why it cannot run here. Under Ulysses (`spmdkit.parallel.context.ulysses`) `dot`,
  `blockwise` and `cudnn` name its per-device kernel: the choice is `ulysses_<kernel>` (`ring` is refused there).
"""

from __future__ import annotations

from typing import Literal

from spmdkit.errors import SpmdkitError

KERNELS = ("dot", "blockwise", "cudnn", "ring")
LOCAL_KERNELS = ("dot", "blockwise", "cudnn")  # what runs per device under Ulysses
ULYSSES = tuple(f"ulysses_{k}" for k in LOCAL_KERNELS)  # a resolved choice: Ulysses around that kernel
CONTEXT_PARALLEL = ("auto", "ring", "ulysses", "2d")  # 2d: the ring of Ulysses groups (its kernel is "ring")
ContextParallel = Literal["auto", "ring", "ulysses", "2d"]
CONTEXT_PARALLEL_HELP = (
    "the algorithm over a context axis > 1: ring (K/V travel a zigzag ring), ulysses (all-to-alls to a head split, "
    "any kernel per device), 2d (a ring of Ulysses groups of --ulysses devices), auto (ulysses around cuDNN on an "
    "NVIDIA GPU where the heads split, else ring)"
)
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention before Hopper
CUDNN_MAX_HEAD_DIM_HOPPER = 256  # sm_90 and later


def cudnn_refusal(dtype: str, head_dim: int, compute_capability: int = 0) -> str | None:
    """Why cuDNN's fused kernel cannot take this shape, or None when it can. `compute_capability`: the GPU's major
    version (9: Hopper; 0: unknown, the limit every GPU runs)."""
    if dtype not in CUDNN_DTYPES:
        return f"cuDNN attention needs a bfloat16 or float16 compute dtype, not {dtype}: set --dtype bfloat16"
    limit = CUDNN_MAX_HEAD_DIM_HOPPER if compute_capability >= 9 else CUDNN_MAX_HEAD_DIM
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN attention needs head_dim a multiple of 8 up to {limit}, not {head_dim}"
    return None


def choose_attention(
    kind: str,
    *,
    context: int,
    platform: str | None,
    dtype: str,
    head_dim: int,
    compute_capability: int = 0,
    softcap: float = 0.0,
    context_parallel: str = "auto",
    head_split: int | None = None,
    sinks: bool = False,
) -> str:
    """The kernel that runs for the setting `kind` (auto, dot, blockwise, cudnn, ring, or a resolved ulysses_*).

    context: the mesh's context-axis size; platform: "cuda" (an NVIDIA GPU), "gpu" (another GPU), "tpu", "cpu",
    or None (unknown, in a traced model: "auto" never picks cuDNN, and cuDNN's limits are Hopper's);
    dtype: the compute dtype's name; compute_capability: the GPU's major version (0: unknown); softcap: the
    attention-logit soft cap (0: none; cuDNN has none); context_parallel: the algorithm over a context axis > 1
    (`CONTEXT_PARALLEL`); head_split: heads / (tensor x context) when whole, else 0 (Ulysses cannot split them),
    None: unknown (the kernel checks); sinks: the model has attention sinks (every kernel but cuDNN takes them).
    Raises SpmdkitError when an explicit choice cannot run.
    """
    if context_parallel not in CONTEXT_PARALLEL:
        raise SpmdkitError(f"unknown --context-parallel {context_parallel!r}: choose {', '.join(CONTEXT_PARALLEL)}")
    if kind in ULYSSES:  # a resolved choice: Ulysses around its local kernel
        if context_parallel == "ring":
            raise SpmdkitError(f"--attention {kind} and --context-parallel ring contradict: drop one")
        kind, context_parallel = kind.removeprefix("ulysses_"), "ulysses"
        if context <= 1:
            raise SpmdkitError("Ulysses attention needs a context axis > 1 in the mesh (e.g. --mesh context=4,fsdp=2)")
    if sinks and kind == "cudnn":
        raise SpmdkitError("--attention cudnn has no attention sinks (GPT-OSS): use blockwise (or auto)")
    if context > 1:
        return _context_kernel(kind, context, platform, dtype, head_dim, compute_capability, softcap,
                               context_parallel, head_split, sinks)  # fmt: skip
    if context_parallel != "auto":
        raise SpmdkitError(f"--context-parallel {context_parallel} needs a context axis > 1 in the mesh: drop it")
    return _local_kernel(kind, platform, dtype, head_dim, compute_capability, softcap, sinks)


def _context_kernel(
    kind: str, context: int, platform: str | None, dtype: str, head_dim: int, capability: int, softcap: float,
    algorithm: str, head_split: int | None, sinks: bool = False,
) -> str:  # fmt: skip
    """`choose_attention` under a context axis > 1: "ring" or "ulysses_<local kernel>" (with sinks: the ring)."""
    if kind not in ("auto", *KERNELS):
        raise SpmdkitError(f"unknown attention {kind!r}: choose auto, {', '.join(KERNELS)}")
    if algorithm == "auto":
        local = _local_kernel(kind if kind != "ring" else "auto", platform, dtype, head_dim, capability, softcap, sinks)
        algorithm = "ulysses" if kind != "ring" and local == "cudnn" and head_split and platform == "cuda" else "ring"
    if algorithm in ("ring", "2d"):
        if kind not in ("auto", "ring"):
            raise SpmdkitError(
                f"--attention {kind} cannot split the sequence over context={context}: the ring runs its own kernel; "
                "use --attention auto, or --context-parallel ulysses (the kernel per device), or drop context"
            )
        return "ring"
    if kind == "ring":
        raise SpmdkitError("--attention ring and --context-parallel ulysses contradict: drop one")
    if head_split == 0:
        raise SpmdkitError(
            f"--context-parallel ulysses: the heads do not split over tensor x context={context}: use "
            "--context-parallel ring, or a context axis that divides the heads"
        )
    return "ulysses_" + _local_kernel(kind, platform, dtype, head_dim, capability, softcap, sinks)


def _local_kernel(
    kind: str, platform: str | None, dtype: str, head_dim: int, capability: int, softcap: float, sinks: bool = False
) -> str:
    """The kernel of one device's whole sequence (no context axis, or per device under Ulysses)."""
    if kind == "auto":
        cudnn_ok = cudnn_refusal(dtype, head_dim, capability) is None and not softcap and not sinks
        return "cudnn" if platform == "cuda" and cudnn_ok else "blockwise"
    if kind not in KERNELS:
        raise SpmdkitError(f"unknown attention {kind!r}: choose auto, {', '.join(KERNELS)}")
    if kind == "ring":
        raise SpmdkitError("--attention ring needs a context axis > 1 in the mesh (e.g. --mesh context=2,fsdp=4)")
    if kind == "cudnn":
        if platform is not None and platform != "cuda":
            raise SpmdkitError(f"--attention cudnn needs an NVIDIA GPU, not {platform}: use blockwise (or auto)")
        # In a traced model the device is unknown: the widest head_dim any GPU takes (Hopper's); build_program
        # checked the run's own GPU already.
        if reason := cudnn_refusal(dtype, head_dim, capability if platform else 9):
            raise SpmdkitError(reason)
        if softcap:
            raise SpmdkitError(
                f"--attention cudnn has no logit soft-capping (softcap={softcap}): use blockwise (or auto)"
            )
    return kind
