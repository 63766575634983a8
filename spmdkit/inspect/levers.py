"""The marks Hopper's speed levers leave in a compiled XLA:GPU program: FP8 GEMMs and windowed einsums.

- `fp8_gemms(text)`: the GEMMs that take FP8 operands. XLA:GPU spells one either as a cuBLASLt custom call
  (`custom_call_target="__cublas$lt$matmul$f8"`, with Triton GEMMs off) or as a GEMM fusion (`kind=kCustom`, a
  Triton `__triton_gemm` / `__triton_nested_gemm_fusion` or a cuDNN fusion) whose computation holds a `dot` with an
  `f8e4m3fn` / `f8e5m2` operand. Counted per instruction and per call of the program (loop trip counts
  multiplied, as `spmdkit.inspect.hlo` counts collectives).
- `windowed_einsums(text)`: the decomposed collective matmuls. XLA's SPMD partitioner emits each as a `while`
  loop whose body it names `windowed_dot_general_body...`: collective-permutes passing one operand's shards
  round the ring while partial matmuls run (a loop unrolled whole leaves its hops outside it, named after the
  matmul they came from). spmdkit's own ring (`spmdkit.parallel.collective_matmul`: a loop, or
  unrolled where the ring is short) is found by the named scope (`RING_SCOPE`) its collective-permutes carry.
"""

from __future__ import annotations

import re
from typing import Any

from spmdkit.inspect.flops import hlo_flops
from spmdkit.inspect.hlo import _CALLS, _MADE_SYNC, _callees, _Instr, _Module, _parse, _text

FP8_DTYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz")
CUBLAS_FP8 = "__cublas$lt$matmul$f8"
# the loop bodies XLA's SPMD partitioner emits (dot_handler.cc): `windowed_dot_general_body_ag` / `_rs`, prefixed
# `unrolled_` where XLA unrolls them
WINDOWED_BODY = "windowed_dot_general_body"
RING_SCOPE = "collective_matmul"  # the named scope of `spmdkit.parallel.collective_matmul`
# A collective-permute the SPMD partitioner made from a matmul (a `ppermute` of spmdkit's carries its own name):
# multi-streamed windowed einsum unrolls a short loop whole, and its hops leave the loop's body.
_FROM_MATMUL = re.compile(r'op_name="[^"]*dot_general[^"/]*"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def _has_fp8_dot(comp: str, module: _Module, depth: int = 0) -> bool:
    """Does computation `comp` (or a fusion nested in it) hold a `dot` with an FP8 operand?"""
    for ins in module.by_comp.get(comp, []):
        dtypes = {module.types.get(o, "").split("[")[0].strip("(") for o in ins.operands}
        if ins.opcode == "dot" and not dtypes.isdisjoint(FP8_DTYPES):
            return True
        if ins.opcode == "fusion" and depth < 4 and (m := _CALLS.search(ins.attrs)):
            if _has_fp8_dot(m.group(1), module, depth + 1):
                return True
    return False


def fp8_gemms(compiled_or_text: Any) -> dict[str, int]:
    """{instructions, executions (loops multiplied), cublas (custom calls), fusions (GEMM fusions)} of the FP8
    GEMMs in a compiled GPU program (a `jax.stages.Compiled` or its `.as_text()`)."""
    module, runs = _parse(compiled_or_text)
    found = {"instructions": 0, "executions": 0, "cublas": 0, "fusions": 0}
    for comp, instrs in module.by_comp.items():
        for ins in instrs:
            if ins.opcode == "custom-call" and f'custom_call_target="{CUBLAS_FP8}"' in ins.attrs:
                kind = "cublas"
            elif ins.opcode == "fusion" and "kind=kCustom" in ins.attrs and (m := _CALLS.search(ins.attrs)):
                if not _has_fp8_dot(m.group(1), module):
                    continue
                kind = "fusions"
            else:
                continue
            found[kind] += 1
            found["instructions"] += 1
            found["executions"] += runs.get(comp, 1) or 1
    return found


def _windowed_body(ins: _Instr) -> str | None:
    """The body of a `while` instruction that is one of XLA's windowed-einsum loops, else None."""
    body = m.group(1) if ins.opcode == "while" and (m := _BODY.search(ins.attrs)) else None
    return body if body is not None and WINDOWED_BODY in body else None  # also "unrolled_windowed_dot_general..."


def _windowed_bodies(module: _Module) -> set[str]:
    """The computations XLA's windowed-einsum loops run, with the computations they call (XLA 0.11 on sends each
    hop inside a conditional: the last iteration's branch does nothing)."""
    bodies = {body for instrs in module.by_comp.values() for ins in instrs if (body := _windowed_body(ins))}
    frontier = list(bodies)
    while frontier:
        for ins in module.by_comp.get(frontier.pop(), []):
            for _, callee in _callees(ins.attrs):
                if callee not in bodies:
                    bodies.add(callee)
                    frontier.append(callee)
    return bodies


def windowed_einsums(compiled_or_text: Any) -> dict[str, int]:
    """The decomposed collective matmuls in a compiled GPU program: {loops: XLA's windowed-einsum loops,
    collective_permutes: the hops of every collective matmul (instructions in those loops, and spmdkit's ring's,
    found by its scope, looped or unrolled), executions: those hops per call (loop trip counts multiplied)}."""
    module, runs = _parse(compiled_or_text)
    bodies = _windowed_bodies(module)
    found = {"loops": 0, "collective_permutes": 0, "asynchronous": 0, "executions": 0}
    for comp, instrs in module.by_comp.items():
        for ins in instrs:
            if _windowed_body(ins) is not None:
                found["loops"] += 1
            elif ins.opcode in ("collective-permute", "collective-permute-start") and (
                comp in bodies or f"/{RING_SCOPE}/" in ins.attrs or _FROM_MATMUL.search(ins.attrs)
            ):
                found["collective_permutes"] += 1
                found["asynchronous"] += ins.opcode.endswith("-start") and not _MADE_SYNC.search(ins.attrs)
                found["executions"] += runs.get(comp, 1) or 1
    return found


def expert_gemms(compiled_or_text: Any, op_names: tuple[str, ...]) -> dict[str, int]:
    """The experts' GEMMs of a compiled program, found by the JAX operations they come from (`op_names`, e.g.
    `ragged_dot` and the experts' einsums): {flops: per device per call, loops multiplied (as `hlo_flops`),
    grouped: instructions that run them as a grouped GEMM (a `ragged-dot` XLA kept, or a grouped-GEMM custom
    call), dense: `dot`s that run them (a grouped matmul XLA lowered to a dense one, or padded buffers)}."""
    text = _text(compiled_or_text)
    names = re.compile(r'op_name="[^"]*(?:' + "|".join(re.escape(n) for n in op_names) + ")")
    found = {"flops": hlo_flops(text, where=names)["matmul"], "grouped": 0, "dense": 0}
    for line in text.splitlines():
        if names.search(line):
            if re.search(r"\sragged-dot\(|custom_call_target=\"[^\"]*(?:grouped|ragged)", line, re.I):
                found["grouped"] += 1
            elif re.search(r"\sdot\(", line):
                found["dense"] += 1
    return found
