"""FLOPs of a compiled program, per device and per call, read from its optimized HLO with loops multiplied out.

`compiled.cost_analysis()` is no help here: it counts a `while` body once (a scanned 32-layer model reads as one
layer), and it is None for compile-only GPU executables. `hlo_flops(compiled)` walks the program instead:

- a `dot`, wherever it sits (a fusion's body, a loop's body), costs 2 x (result elements) x (the product of the
  lhs contracting dimensions); cuBLAS custom calls (`__cublas$gemm`, `__cublas$lt$matmul`) the same, read from
  their `dot_dimension_numbers`;
- a cuDNN fused attention call (`__cudnn$fmha...`) costs its two batched matmuls: forward 2 x 2 x batch x heads x
  q_len x kv_len x head_dim, backward twice that and a recomputed score matmul (5 of them in all); a causal mask
  halves it (the kernel skips the masked blocks);
- every count is multiplied by how often its computation runs per call (`known_trip_count` of each enclosing
  loop, as `spmdkit.inspect.hlo` counts collectives), and a `conditional`'s branches by how often each runs
  where the program says so (`branches=`: a pipeline's schedule), else each as often as the conditional.

Element-wise work (norms, softmax outside cuDNN, the optimizer) is left out: it is memory-bound and a few percent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from spmdkit.inspect.hlo import _executions, _Instr, _Module, _split_computations, _text

_DIMS = re.compile(r"\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


def _dims(hlo_type: str) -> list[int]:
    """The first array's dimensions of an HLO type (`bf16[8,128]{1,0}` -> [8, 128])."""
    m = _DIMS.search(hlo_type)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _backend_config(rest: str) -> dict[str, Any]:
    _, found, text = rest.partition("backend_config=")
    try:
        return json.JSONDecoder().raw_decode(text)[0] if found else {}
    except ValueError:
        return {}


def _matmul_flops(result: str, lhs: str, contracting: list) -> int:
    """2 x (result elements) x (the product of the lhs dimensions at the `contracting` indices)."""
    lhs_dims = _dims(lhs)
    return 2 * math.prod(_dims(result)) * math.prod(lhs_dims[int(i)] for i in contracting if int(i) < len(lhs_dims))


def _attention_flops(target: str, operand_types: list[str], config: dict[str, Any]) -> int:
    """cuDNN fused attention: the score and value matmuls (forward 2, backward 5), causal halved."""
    fmha = config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    if len(scores) != 4 or not operand_types:
        return 0
    head_dim = _dims(operand_types[0])[-1] if _dims(operand_types[0]) else 0
    matmuls = 5 if "Backward" in target else 2
    flops = 2 * matmuls * math.prod(scores) * head_dim
    return flops // 2 if fmha.get("mask_type", "").startswith("CAUSAL") else flops


def _instruction_flops(module: _Module, ins: _Instr) -> tuple[int, int]:
    """(matmul, attention) FLOPs of one run of one instruction (its called computations aside)."""
    operand_types = [module.types.get(n, "") for n in ins.operands]
    if ins.opcode == "dot" and (m := _CONTRACTING.search(ins.attrs)) and operand_types:
        return _matmul_flops(ins.type, operand_types[0], [i for i in m.group(1).split(",") if i]), 0
    if ins.opcode == "custom-call" and (target := re.search(r'custom_call_target="([^"]+)"', ins.attrs)):
        name, config = target.group(1), _backend_config(ins.attrs)
        if name in _GEMM_TARGETS and operand_types:
            contracting = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            return _matmul_flops(ins.type, operand_types[0], contracting.get("lhs_contracting_dimensions", [])), 0
        if name.startswith("__cudnn$fmha"):
            return 0, _attention_flops(name, operand_types, config)
    return 0, 0


def hlo_flops(
    compiled_or_text: Any, where: re.Pattern[str] | None = None, branches: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """Per-device FLOPs per call of a compiled program: `{"matmul", "attention", "total", "busiest"}` (see the
    module docstring for what each counts); with `where`, only of the instructions whose attributes (their
    metadata's `op_name` among them) it matches.

    Every branch of a `conditional` counts each time the conditional runs (an upper bound: one branch runs),
    unless `branches` {named scope: `[groups, branches]` runs} says how often each group of devices takes each
    branch of the conditional right under that scope (a pipeline: `Schedule.branch_runs()` under `TICK_SCOPE`,
    a group per stage). Then "matmul", "attention" and "total" are the mean over the groups (each group the
    same number of devices: the mean per device) and "busiest" is the largest group's total; without, "busiest"
    is "total".
    """
    computations, entry = _split_computations(_text(compiled_or_text))
    module = _Module(computations)
    local = {}  # computation -> (matmul, attention) of one run of it, its callees aside
    for comp, instrs in module.by_comp.items():
        counted = [_instruction_flops(module, i) for i in instrs if where is None or where.search(i.attrs)]
        local[comp] = (sum(m for m, _ in counted), sum(a for _, a in counted))
    groups = len(next(iter(branches.values()))) if branches else 1
    rows = []  # per group: (matmul, attention)
    for g in range(groups):
        runs = _executions(computations, entry, {k: v[g] for k, v in (branches or {}).items()}) if entry else {}
        rows.append([sum(runs.get(c, 0) * f[i] for c, f in local.items()) for i in (0, 1)])
    matmul, attention = (round(sum(r[i] for r in rows) / groups) for i in (0, 1))
    busiest = round(max(map(sum, rows)))
    return {"matmul": matmul, "attention": attention, "total": matmul + attention, "busiest": busiest}
