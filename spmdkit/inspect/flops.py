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
  loop, as `spmdkit.inspect.hlo` counts collectives).

Element-wise work (norms, softmax outside cuDNN, the optimizer) is left out: it is memory-bound and a few percent.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from spmdkit.inspect.hlo import _parse

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


def hlo_flops(compiled_or_text: Any, where: re.Pattern[str] | None = None) -> dict[str, int]:
    """Per-device FLOPs per call of a compiled program: `{"matmul", "attention", "total"}` (see the module
    docstring for what each counts); with `where`, only of the instructions whose attributes (their metadata's
    `op_name` among them) it matches."""
    module, runs = _parse(compiled_or_text)
    matmul = attention = 0
    for comp, instrs in module.by_comp.items():
        times = runs.get(comp, 0)
        for ins in instrs:
            if where is not None and not where.search(ins.attrs):
                continue
            operand_types = [module.types.get(n, "") for n in ins.operands]
            if ins.opcode == "dot" and (m := _CONTRACTING.search(ins.attrs)) and operand_types:
                matmul += times * _matmul_flops(ins.type, operand_types[0], [i for i in m.group(1).split(",") if i])
            elif ins.opcode == "custom-call" and (target := re.search(r'custom_call_target="([^"]+)"', ins.attrs)):
                name, config = target.group(1), _backend_config(ins.attrs)
                if name in _GEMM_TARGETS and operand_types:
                    numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
                    contracting = numbers.get("lhs_contracting_dimensions", [])
                    matmul += times * _matmul_flops(ins.type, operand_types[0], contracting)
                elif name.startswith("__cudnn$fmha"):
                    attention += times * _attention_flops(name, operand_types, config)
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}
