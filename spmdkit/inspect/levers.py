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
from spmdkit.inspect.hlo import _BRANCHES, _CALLED, _MADE_SYNC, _executions, _split_computations

FP8_DTYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz")
CUBLAS_FP8 = "__cublas$lt$matmul$f8"
# the loop bodies XLA's SPMD partitioner emits (dot_handler.cc): `windowed_dot_general_body_ag` / `_rs`, prefixed
# `unrolled_` where XLA unrolls them
WINDOWED_BODY = "windowed_dot_general_body"
RING_SCOPE = "collective_matmul"  # the named scope of `spmdkit.parallel.collective_matmul`
# A collective-permute the SPMD partitioner made from a matmul (a `ppermute` of spmdkit's carries its own name):
# multi-streamed windowed einsum unrolls a short loop whole, and its hops leave the loop's body.
_FROM_MATMUL = re.compile(r'op_name="[^"]*dot_general[^"/]*"')
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*?)\)(,.*)?$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def _instructions(computations: dict[str, list[str]]) -> dict[str, list[tuple[str, str, str, list[str], str]]]:
    """{computation: [(name, type, opcode, operand names, attributes)]} of the parsed HLO lines."""
    parsed: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
    for comp, lines in computations.items():
        rows = []
        for line in lines:
            if m := _LINE.match(line):
                name, rtype, opcode, operands, attrs = m.groups()
                names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
                rows.append((name, rtype, opcode, names, attrs or ""))
        parsed[comp] = rows
    return parsed


def _is_fp8(hlo_type: str) -> bool:
    return hlo_type.split("[")[0].strip("(") in FP8_DTYPES


def _has_fp8_dot(comp: str, parsed: dict, types: dict[str, str], depth: int = 0) -> bool:
    """Does computation `comp` (or a fusion nested in it) hold a `dot` with an FP8 operand?"""
    for _, _, opcode, operands, attrs in parsed.get(comp, []):
        if opcode == "dot" and any(_is_fp8(types.get(o, "")) for o in operands):
            return True
        if opcode == "fusion" and depth < 4 and (m := _CALLS.search(attrs)):
            if _has_fp8_dot(m.group(1), parsed, types, depth + 1):
                return True
    return False


def fp8_gemms(compiled_or_text: Any) -> dict[str, int]:
    """{instructions, executions (loops multiplied), cublas (custom calls), fusions (GEMM fusions)} of the FP8
    GEMMs in a compiled GPU program (a `jax.stages.Compiled` or its `.as_text()`)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    computations, entry = _split_computations(text)
    parsed, runs = _instructions(computations), _executions(computations, entry) if entry else {}
    types = {row[0]: row[1] for rows in parsed.values() for row in rows}
    found = {"instructions": 0, "executions": 0, "cublas": 0, "fusions": 0}
    for comp, rows in parsed.items():
        for _, _, opcode, _, attrs in rows:
            if opcode == "custom-call" and f'custom_call_target="{CUBLAS_FP8}"' in attrs:
                kind = "cublas"
            elif opcode == "fusion" and "kind=kCustom" in attrs and (m := _CALLS.search(attrs)):
                if not _has_fp8_dot(m.group(1), parsed, types):
                    continue
                kind = "fusions"
            else:
                continue
            found[kind] += 1
            found["instructions"] += 1
            found["executions"] += runs.get(comp, 1) or 1
    return found


def _windowed_body(row: tuple[str, str, str, list[str], str]) -> str | None:
    """The body of a `while` instruction that is one of XLA's windowed-einsum loops, else None."""
    _, _, opcode, _, attrs = row
    body = m.group(1) if opcode == "while" and (m := _BODY.search(attrs)) else None
    return body if body is not None and WINDOWED_BODY in body else None  # also "unrolled_windowed_dot_general..."


def _windowed_bodies(parsed: dict) -> set[str]:
    """The computations XLA's windowed-einsum loops run, with the computations they call."""
    bodies = {body for rows in parsed.values() for row in rows if (body := _windowed_body(row)) is not None}
    frontier = list(bodies)
    while frontier:
        for _, _, _, _, attrs in parsed.get(frontier.pop(), []):
            # XLA 0.11 on sends each hop inside a conditional (the last iteration's branch does nothing)
            callees = [c for _, c in _CALLED.findall(attrs)]
            callees += [c.strip().lstrip("%") for group in _BRANCHES.findall(attrs) for c in group.split(",")]
            for callee in callees:
                if callee not in bodies:
                    bodies.add(callee)
                    frontier.append(callee)
    return bodies


def windowed_einsums(compiled_or_text: Any) -> dict[str, int]:
    """The decomposed collective matmuls in a compiled GPU program: {loops: XLA's windowed-einsum loops,
    collective_permutes: the hops of every collective matmul (instructions in those loops, and spmdkit's ring's,
    found by its scope, looped or unrolled), executions: those hops per call (loop trip counts multiplied)}."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    computations, entry = _split_computations(text)
    parsed, runs = _instructions(computations), _executions(computations, entry) if entry else {}
    bodies = _windowed_bodies(parsed)
    found = {"loops": 0, "collective_permutes": 0, "asynchronous": 0, "executions": 0}
    for comp, rows in parsed.items():
        for row in rows:
            _, _, opcode, _, attrs = row
            if _windowed_body(row) is not None:
                found["loops"] += 1
            elif opcode in ("collective-permute", "collective-permute-start") and (
                comp in bodies or f"/{RING_SCOPE}/" in attrs or _FROM_MATMUL.search(attrs)
            ):
                found["collective_permutes"] += 1
                found["asynchronous"] += opcode.endswith("-start") and not _MADE_SYNC.search(attrs)
                found["executions"] += runs.get(comp, 1) or 1
    return found


def expert_gemms(compiled_or_text: Any, op_names: tuple[str, ...]) -> dict[str, int]:
    """The experts' GEMMs of a compiled program, found by the JAX operations they come from (`op_names`, e.g.
    `ragged_dot` and the experts' einsums): {flops: per device per call, loops multiplied (as `hlo_flops`),
    grouped: instructions that run them as a grouped GEMM (a `ragged-dot` XLA kept, or a grouped-GEMM custom
    call), dense: `dot`s that run them (a grouped matmul XLA lowered to a dense one, or padded buffers)}."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    names = re.compile(r'op_name="[^"]*(?:' + "|".join(re.escape(n) for n in op_names) + ")")
    found = {"flops": hlo_flops(text, where=names)["matmul"], "grouped": 0, "dense": 0}
    for line in text.splitlines():
        if names.search(line):
            if re.search(r"\sragged-dot\(|custom_call_target=\"[^\"]*(?:grouped|ragged)", line, re.I):
                found["grouped"] += 1
            elif re.search(r"\sdot\(", line):
                found["dense"] += 1
    return found
