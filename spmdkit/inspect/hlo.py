"""Read the collectives out of compiled HLO: what XLA will send per step, per device.

`collective_report(compiled)` parses `compiled.as_text()` (the optimized, per-device program) and returns,
per collective opcode (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), how many
instructions there are, how many times they execute per call, and the bytes they move.

Loops matter: a scan over layers compiles to one `while` whose body holds one layer's collectives; they run
`known_trip_count` times. Executed counts and bytes multiply through nested loops; instructions in a
`conditional` count once per branch (an upper bound: only one branch runs), unless the caller says how often each
branch runs (`branches`: a pipeline's schedule).

Byte counts are the operand bytes (what a device contributes): for all-reduce, the buffer reduced; for
all-gather, the local shard; for reduce-scatter, the full local buffer; for collective-permute, what is sent.
Compiled HLO no longer prints operand shapes inline, so operands are looked up in a name -> type table.

Reduce-scatter on CPU: GSPMD expresses "sum, then keep my shard" as an all-reduce whose result is only read
through `dynamic-slice`s that keep 1/N of it. XLA's GPU and TPU pipelines rewrite that pattern into one
`reduce-scatter` (the ReduceScatterCreator pass); the CPU backend does not. The report classifies such an
all-reduce (per tuple element, following fusions) as `reduce-scatter` with `form="all-reduce+dynamic-slice"`,
so the same strategy reads the same on every backend.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*?)\)(,.*)?$")
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# e.g. replica_groups=mesh['a'=2,'b'=4] {'b'}, or with a device order: mesh[...], device_ids=([2,4]T(1,0)) {'b'}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_SCOPE = re.compile(r'op_name="(?:[^"]*/)?([\w.\-]+)/\w+"')  # the innermost named scope around an instruction


def _arrays(hlo_type: str) -> list[tuple[str, int]]:
    """(dtype, elements) of each array in an HLO type string such as `f32[8,16]{1,0}` or `(f32[4], bf16[2,2])`."""
    return [(dtype, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(hlo_type)]


def type_bytes(hlo_type: str) -> int:
    """Bytes of an HLO type string such as `f32[8,16]{1,0}` or a tuple `(f32[4], bf16[2,2])`."""
    return sum(count * _DTYPE_BYTES[dtype] for dtype, count in _arrays(hlo_type) if dtype in _DTYPE_BYTES)


def _elements(hlo_type: str) -> int:
    return sum(count for _, count in _arrays(hlo_type))


@dataclasses.dataclass
class Collective:
    """One collective instruction of the compiled program."""

    opcode: str
    name: str
    computation: str
    operand_bytes: int
    result_bytes: int
    group_size: int  # devices taking part in one group (0 when unknown, e.g. collective-permute)
    executions: int = 1  # times it runs per call of the program (loop trip counts multiplied)
    form: str = ""  # how the backend spelled it, where that differs from `opcode`
    asynchronous: bool = False  # a start/done pair (XLA:GPU) the scheduler overlaps with compute
    # XLA:GPU scheduled it as a start/done pair, found nothing to run between them (its result is needed next, or
    # nothing independent is left), and made it synchronous (`ConvertAsyncCollectivesToSync`: "is_sync" in its
    # backend config; jaxlib 0.10 kept the start/done spelling, 0.11 on prints the plain opcode)
    nothing_to_overlap: bool = False


@dataclasses.dataclass
class CollectiveReport:
    """Every collective of a compiled program, with per-opcode totals."""

    collectives: list[Collective]

    def count(self, opcode: str, executed: bool = False) -> int:
        """Instructions of `opcode` in the program (or, with `executed`, times they run per call)."""
        return sum(c.executions if executed else 1 for c in self.collectives if c.opcode == opcode)

    def bytes(self, opcode: str | None = None) -> int:
        """Operand bytes moved per call by `opcode` (all opcodes when None), loops multiplied."""
        return sum(c.operand_bytes * c.executions for c in self.collectives if opcode in (None, c.opcode))

    def by_opcode(self) -> dict[str, dict[str, int]]:
        keys = ("instructions", "asynchronous", "nothing_to_overlap", "executions", "operand_bytes", "result_bytes")
        totals: dict[str, dict[str, int]] = collections.defaultdict(lambda: dict.fromkeys(keys, 0))
        for c in self.collectives:
            t = totals[c.opcode]
            t["instructions"] += 1
            t["asynchronous"] += c.asynchronous
            t["nothing_to_overlap"] += c.nothing_to_overlap
            t["executions"] += c.executions
            t["operand_bytes"] += c.operand_bytes * c.executions
            t["result_bytes"] += c.result_bytes * c.executions
        return dict(sorted(totals.items()))

    def table(self) -> str:
        """A text table: opcode, instructions, executions per step, bytes per step per device."""
        header = f"{'collective':<20}{'instrs':>8}{'runs/step':>11}{'bytes/step/device':>20}"
        rows = [
            f"{op:<20}{t['instructions']:>8}{t['executions']:>11}{t['operand_bytes']:>20,}"
            for op, t in self.by_opcode().items()
        ]
        return "\n".join([header, *(rows or ["(no collectives)"])])


def _tuple_parts(hlo_type: str) -> list[str]:
    """'(f32[2], bf16[3,4]{1,0})' -> ['f32[2]', 'bf16[3,4]']; a non-tuple type -> [type]."""
    return [f"{d}[{dims}]" for d, dims in _SHAPE.findall(hlo_type)] if hlo_type.startswith("(") else [hlo_type]


def _group_size(attrs: str) -> int:
    if m := _MESH_GROUPS.search(attrs):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", m.group(2)))
    if m := _IOTA_GROUPS.search(attrs):
        return int(m.group(2))
    if m := _LIST_GROUPS.search(attrs):
        return len([d for d in m.group(1).split(",") if d])
    return 0


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str


class _Module:
    """Instructions by name, and who reads each one, for following an all-reduce to its consumers."""

    def __init__(self, computations: dict[str, list[str]]):
        self.by_comp: dict[str, list[_Instr]] = {}
        self.users: dict[str, list[_Instr]] = collections.defaultdict(list)
        self.params: dict[tuple[str, int], str] = {}  # (computation, parameter index) -> instruction name
        self.types: dict[str, str] = {}  # instruction name -> its HLO type
        for comp, lines in computations.items():
            instrs = []
            for line in lines:
                if not (m := _INSTR.match(line)):
                    continue
                name, rtype, opcode, operands, attrs = m.groups()
                names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
                ins = _Instr(name, rtype, opcode, names, attrs or "")
                instrs.append(ins)
                self.types[name] = rtype
                for o in ins.operands:
                    self.users[o].append(ins)
                if opcode == "parameter" and ins.operands and ins.operands[0].isdigit():
                    self.params[(comp, int(ins.operands[0]))] = name
            self.by_comp[comp] = instrs

    def only_sliced(self, name: str, elements: int, group: int, depth: int = 0) -> bool:
        """Is the value `name` (of `elements` elements) read only by dynamic-slices keeping 1/group of it?"""
        users = self.users.get(name, [])
        if not users or group < 2 or depth > 4:
            return False
        for user in users:
            if user.opcode == "dynamic-slice" and user.operands[0] == name:
                if _elements(user.type) * group != elements:
                    return False
            elif self._is_cast(user) and _elements(user.type) == elements:  # a dtype change or a copy: follow it
                if not self.only_sliced(user.name, elements, group, depth + 1):
                    return False
            elif user.opcode == "fusion" and (m := _CALLS.search(user.attrs)):
                for index, operand in enumerate(user.operands):
                    if operand == name and not self.only_sliced(
                        self.params.get((m.group(1), index), ""), elements, group, depth + 1
                    ):
                        return False
            else:
                return False
        return True

    def _is_cast(self, ins: _Instr) -> bool:
        """A convert, copy or bitcast, or a fusion of only those (an elementwise dtype change: CPU all-reduces bf16
        in float32 and converts back in a fusion of its own)."""
        if ins.opcode in ("bitcast", "copy", "convert"):
            return True
        m = _CALLS.search(ins.attrs) if ins.opcode == "fusion" else None
        body = self.by_comp.get(m.group(1), []) if m else []
        return bool(body) and all(i.opcode in ("parameter", "convert", "bitcast", "copy") for i in body)

    def scattered_parts(self, ins: _Instr, group: int) -> list[bool]:
        """Per tuple element of an all-reduce: is it a reduce-scatter in all-reduce form?"""
        parts = _tuple_parts(ins.type)
        if len(parts) == 1 and not ins.type.startswith("("):
            return [self.only_sliced(ins.name, _elements(ins.type), group)]
        by_index = {
            int(m.group(1)): u.name
            for u in self.users.get(ins.name, [])
            if u.opcode == "get-tuple-element" and (m := re.search(r"index=(\d+)", u.attrs))
        }
        return [i in by_index and self.only_sliced(by_index[i], _elements(p), group) for i, p in enumerate(parts)]


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """HLO module text -> ({computation name: instruction lines}, entry computation name)."""
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for raw in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", raw)
        if current is None:
            if (m := _COMP_HEADER.match(line.strip())) and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            computations[current].append(line)
    return computations, entry


def _callees(line: str) -> list[tuple[str, str]]:
    """(how, computation) of each computation an instruction calls: a loop's body and condition, a fusion's or a
    reduction's computation, a conditional's branches ("branch", in the order of their index)."""
    found = _CALLED.findall(line)
    return found + [("branch", c.strip().lstrip("%")) for group in _BRANCHES.findall(line) for c in group.split(",")]


def _branch_shares(line: str, branches: Mapping[str, Sequence[int]]) -> list[Fraction] | None:
    """The share of a conditional's executions each of its branches takes, where the conditional sits directly in
    a named scope (its op_name `.../SCOPE/cond`) that `branches` {scope: [runs of branch 0, 1, ...]} names."""
    listed = _BRANCHES.search(line) if branches else None
    scope = _SCOPE.search(line) if listed else None
    runs = branches.get(scope.group(1)) if scope else None
    if runs is None or not sum(runs) or len(runs) != len(listed.group(1).split(",")):
        return None
    return [Fraction(int(n), int(sum(runs))) for n in runs]


def _text(compiled_or_text: Any) -> str:
    return compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()


def _parse(
    compiled_or_text: Any, branches: Mapping[str, Sequence[Sequence[int]]] | None = None
) -> tuple[_Module, dict[str, int]]:
    """The instructions of a `jax.stages.Compiled` (or its `.as_text()`), and how many times each computation runs
    per call (`_executions`); with `branches` {named scope: `[groups, branches]` runs} (a pipeline's schedule, a
    group per stage), the mean over the groups, rounded."""
    computations, entry = _split_computations(_text(compiled_or_text))
    if not entry:
        return _Module(computations), {}
    groups = len(next(iter(branches.values()))) if branches else 1
    runs: dict[str, Fraction] = collections.defaultdict(Fraction)
    for g in range(groups):
        for comp, n in _executions(computations, entry, {k: v[g] for k, v in (branches or {}).items()}).items():
            runs[comp] += Fraction(n) / groups
    return _Module(computations), {comp: round(n) for comp, n in runs.items()}


def _executions(
    computations: dict[str, list[str]], entry: str, branches: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """How many times each computation runs per call, following while trip counts from the entry.

    Every branch of a conditional runs as often as the conditional (an upper bound), except where `branches` says
    how the conditional's executions split over its branches (`_branch_shares`): then each branch runs its share
    (a `Fraction` where it does not divide).
    """
    runs: dict[str, Any] = collections.defaultdict(int)

    def visit(name: str, times: Any, depth: int = 0) -> None:
        if name not in computations or depth > 64:
            return
        runs[name] += times
        for line in computations[name]:
            trip = int(m.group(1)) if (m := _TRIP.search(line)) else 1
            shares = _branch_shares(line, branches or {})
            for kind, callee in _callees(line):
                share = shares.pop(0) if shares and kind == "branch" else 1
                visit(callee, times * share * (trip if kind == "body" else 1), depth + 1)

    visit(entry, 1)
    return runs


_MADE_SYNC = re.compile(r'"is_sync":\s*true')


def collective_report(
    compiled_or_text: Any, branches: Mapping[str, Sequence[Sequence[int]]] | None = None
) -> CollectiveReport:
    """Parse a `jax.stages.Compiled` (or its `.as_text()`) into a `CollectiveReport`. A conditional's branches run
    as often as the conditional, except where `branches` says how often each runs (as `hlo_flops`'s: a pipeline's
    `Schedule.branch_runs()` under `TICK_SCOPE`; executions are then the mean over its device groups)."""
    module, runs = _parse(compiled_or_text, branches)
    found = []
    for comp, instrs in module.by_comp.items():
        for ins in instrs:
            base = ins.opcode.removesuffix("-start")
            if base not in COLLECTIVES or ins.opcode.endswith("-done"):
                continue
            group, made_sync = _group_size(ins.attrs), _MADE_SYNC.search(ins.attrs) is not None
            common = dict(
                name=ins.name, computation=comp, group_size=group, executions=runs.get(comp, 1),
                asynchronous=ins.opcode.endswith("-start") and not made_sync, nothing_to_overlap=made_sync,
            )  # fmt: skip
            operand_types = [module.types.get(o, "") for o in ins.operands]
            if base == "all-reduce":  # one per tuple element: each may be a reduce-scatter in all-reduce form
                parts = zip(module.scattered_parts(ins, group), _tuple_parts(ins.type), operand_types, strict=False)
            else:  # one: every operand's bytes, the whole result's
                parts = [(False, ins.type, " ".join(operand_types))]
            for scattered, rtype, otype in parts:
                found.append(
                    Collective(
                        opcode="reduce-scatter" if scattered else base,
                        operand_bytes=type_bytes(otype),
                        result_bytes=type_bytes(rtype) // (group if scattered else 1),
                        form="all-reduce+dynamic-slice" if scattered else "",
                        **common,
                    )
                )
    return CollectiveReport(found)
