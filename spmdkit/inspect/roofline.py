"""A roofline of a compiled program: every kernel it launches, its FLOPs and HBM bytes, its time at the device's
peaks, grouped by kind, read from the optimized (scheduled) HLO text; no GPU and no `cost_analysis` needed.

A kernel is an instruction of a scheduled computation (the entry, a loop's body and condition, a conditional's
branch, a `call`): a fusion (cuBLAS/Triton GEMMs and elementwise work alike), a custom call (cuDNN attention), a
copy, a collective. Tuples, bitcasts, parameters and control flow launch nothing. Per run:

- FLOPs: the matmul and attention FLOPs of `spmdkit.inspect.flops` (a dot anywhere in a fusion's body counts);
  elementwise FLOPs are left out (those kernels are memory-bound);
- HBM bytes: what the kernel reads plus what it writes, the estimate XLA's HloCostAnalysis makes for a fusion:
  every operand read once, every result written once; a fusion operand only read through (dynamic-)slices costs
  the slices, a buffer updated in place (`dynamic-update-slice`, a scan stacking its residuals) costs the update,
  not the buffer. Caches are ignored: an operand counts once per kernel however often the kernel reads it, and
  again in every kernel that reads it (an L2 hit between two kernels is charged as DRAM traffic);
- time: max(FLOPs / peak FLOP/s, bytes / HBM bytes/s), times how often it runs per call (loop trip counts
  multiplied, a loop's condition counted once, a pipeline's branches as its schedule runs them); a collective's
  is its wire time from `link_seconds`, and only a synchronous one adds to the step (XLA:GPU overlaps the async
  ones with compute).

Kinds (`KINDS`): by what the kernel holds first (a collective; cuDNN attention; a dot: `gemm`, or `attention`
where an attention function made it; only data movement: `cast/copy`), then by the Python function that made it,
innermost first: the HLO's stack frames where JAX recorded them, else the metadata's `op_name` (`_RULES`); work
inside the model's forward or backward that no rule names is `norm/elementwise` (activations, residual adds),
anything else `other`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spmdkit.inspect.flops import _instruction_flops
from spmdkit.inspect.hlo import (
    _CALLS,
    _MADE_SYNC,
    COLLECTIVES,
    _arrays,
    _executions,
    _group_size,
    _Instr,
    _Module,
    _split_computations,
    _text,
    type_bytes,
)

KINDS = ("gemm", "attention", "norm/elementwise", "loss", "optimizer", "cast/copy", "collective", "other")
# Innermost first, each frame ("path/file.py:function") or else the op_name is matched against these in order
_RULES = (
    ("attention", re.compile(r"/attention\.py:|kernels/\w*attention|dot_product_attention|ulysses|ring_atten")),
    ("loss", re.compile(r"models/loss\.py:|cross_entropy|log_softmax|logsumexp")),
    ("optimizer", re.compile(r"optax/|Optimizer\.update|apply_if_finite|bias_correction|update_moment|scale_by")),
    ("norm/elementwise", re.compile(r"norm|rotary|rope", re.IGNORECASE)),
    ("other", re.compile(r"embed")),  # the embedding's gather and its gradient's scatter-add
)
_MODEL_PASS = re.compile(r"jvp\(|transpose\(")  # JAX names the forward jvp(...) and the backward transpose(...)
_MOVES = frozenset(
    "parameter constant convert bitcast copy transpose broadcast reshape slice dynamic-slice dynamic-update-slice "
    "concatenate pad tuple get-tuple-element iota".split()
)
_FREE = frozenset(
    "parameter constant get-tuple-element tuple bitcast while conditional call after-all partition-id replica-id "
    "opt-barrier add-dependency domain".split()
)
_SCHEDULED = re.compile(r"\b(body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_WRAPS_OPERANDS = ("all-gather-start", "collective-permute-start", "copy-start", "all-to-all-start")
_SCRATCH = ("u8", "s8")  # a custom call's workspace, last in its result tuple: device scratch, not traffic


@dataclasses.dataclass
class Kernel:
    """One kernel of the program: its FLOPs and HBM bytes per run, its runs per call and its time per call."""

    name: str
    opcode: str
    kind: str
    flops: int
    bytes: int
    runs: float
    seconds: float  # per call, all runs
    bound: str  # "compute", "memory" or "link"
    source: str  # what named its kind: a function, an op_name or the opcode
    exposed: bool = True  # adds to the step (False: an async collective XLA overlaps with compute)


@dataclasses.dataclass
class Roofline:
    """Every kernel of one device's program (a pipeline's busiest stage), and the sums by kind."""

    kernels: list[Kernel]
    peak_flops: float
    hbm_bw: float

    def step_seconds(self) -> float:
        """The predicted time of one call: every kernel back to back, async collectives hidden."""
        return sum(k.seconds for k in self.kernels if k.exposed)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """{kind: {kernels, runs, flops, bytes, seconds, hidden_seconds}} per call, in `KINDS` order (kinds with
        kernels only); `hidden_seconds`: the async collectives' time, overlapped with compute."""
        keys = ("kernels", "runs", "flops", "bytes", "seconds", "hidden_seconds")
        totals = {kind: dict.fromkeys(keys, 0.0) for kind in KINDS}
        for k in self.kernels:
            t = totals[k.kind]
            t["kernels"] += 1
            t["runs"] += k.runs
            t["flops"] += k.flops * k.runs
            t["bytes"] += k.bytes * k.runs
            t["seconds" if k.exposed else "hidden_seconds"] += k.seconds
        return {kind: t for kind, t in totals.items() if t["kernels"]}

    def report(self, model_flops: float | None = None) -> dict[str, Any]:
        """The JSON form: the kinds, the step, MFU against `model_flops` (per device per call), the top kernels."""
        step = self.step_seconds()
        top = sorted(self.kernels, key=lambda k: -k.seconds)[:10]
        return {
            "peak_flops": self.peak_flops, "hbm_bytes_per_second": self.hbm_bw, "kinds": self.by_kind(),
            "step_seconds": step, "mfu": model_flops / self.peak_flops / step if model_flops and step else None,
            "kernels": len(self.kernels), "launches": sum(k.runs for k in self.kernels),
            "top_kernels": [dataclasses.asdict(k) for k in top],
        }  # fmt: skip


def kind_table(report: Mapping[str, Any]) -> str:
    """`Roofline.report()` as text: one row per kind, its share of the predicted step, then the step and MFU."""
    step = report["step_seconds"] or 1.0
    lines = [f"{'kind':<18}{'kernels':>8}{'runs/step':>11}{'TFLOP':>9}{'HBM GB':>9}{'ms':>9}{'share':>7}"]
    for kind, t in report["kinds"].items():
        hidden = f"  (+{t['hidden_seconds'] * 1e3:.1f} ms overlapped)" if t.get("hidden_seconds") else ""
        lines.append(
            f"{kind:<18}{int(t['kernels']):>8}{round(t['runs']):>11}{t['flops'] / 1e12:>9.2f}{t['bytes'] / 1e9:>9.2f}"
            f"{t['seconds'] * 1e3:>9.1f}{t['seconds'] / step:>7.0%}{hidden}"
        )
    mfu = f", MFU {report['mfu']:.1%}" if report.get("mfu") else ""
    lines.append(f"{'predicted step':<18}{report['step_seconds'] * 1e3:>55.1f} ms at the peaks{mfu}")
    return "\n".join(lines)


class _Frames:
    """The Python call stack of each `stack_frame_id` in the HLO text's StackFrames table, innermost first, each
    frame "package/path/file.py:function" (the last three path parts). Empty where the text has no table."""

    def __init__(self, text: str):
        def table(title: str) -> dict[int, str]:
            m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
            rows = (line.split(" ", 1) for line in (m.group(1).splitlines() if m else []))
            return {int(i): rest for i, rest in rows if i.isdigit()}

        files = {i: "/".join(f.strip('"').split("/")[-3:]) for i, f in table("FileNames").items()}
        functions = {i: f.strip('"') for i, f in table("FunctionNames").items()}
        self.locations = {
            i: f"{files.get(int(_field(r, 'file_name_id')), '')}:{functions.get(int(_field(r, 'function_name_id')))}"
            for i, r in table("FileLocations").items()
        }
        # the printed parent id is one more than the parent's own id (0 printed as 1: no parent)
        self.frames = {
            i: (int(_field(r, "file_location_id")), int(_field(r, "parent_frame_id")) - 1)
            for i, r in table("StackFrames").items()
        }

    def stack(self, frame: int) -> list[str]:
        out: list[str] = []
        while frame in self.frames and len(out) < 200:
            location, parent = self.frames[frame]
            out.append(self.locations.get(location, ""))
            if parent == frame:
                break
            frame = parent
        return out


def _field(row: str, name: str) -> str:
    m = re.search(rf"\b{name}=(\d+)", row)
    return m.group(1) if m else "0"


def _classify(ins: _Instr, body: list[_Instr], frames: _Frames) -> tuple[str, str]:
    """(kind, what named it) of one kernel, `body` its fused instructions (empty for a bare instruction)."""
    base = ins.opcode.removesuffix("-start")
    if base in COLLECTIVES or base in ("send", "recv"):
        return "collective", base
    if "__cudnn$fmha" in ins.attrs:
        return "attention", "cuDNN fused attention"
    frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', ins.attrs)) else ""
    stack = [*(frames.stack(int(frame.group(1))) if frame else []), op_name]
    if any(i.opcode in ("dot", "convolution") for i in body) or "__cublas" in ins.attrs or ins.opcode == "dot":
        # the attention kernels' own matmuls (blockwise, ring, the reference's einsums) are attention
        attention = next((where for where in stack if _RULES[0][1].search(where)), None)
        return ("attention", attention) if attention else ("gemm", "dot")
    if all(i.opcode in _MOVES for i in (body or [ins])):
        return "cast/copy", "data movement only"
    for where in stack:
        for kind, rule in _RULES:
            if rule.search(where):
                return kind, where
    return ("norm/elementwise" if _MODEL_PASS.search(op_name) else "other"), op_name or ins.opcode


class _Program:
    """The parsed program: its instructions, roots, FLOPs per computation (callees included), stack frames."""

    def __init__(self, text: str):
        self.computations, self.entry = _split_computations(text)
        self.module = _Module(self.computations)
        self.by_name = {i.name: i for instrs in self.module.by_comp.values() for i in instrs}
        self.roots = {
            comp: m.group(1)
            for comp, lines in self.computations.items()
            for line in lines
            if (m := re.match(r"\s*ROOT\s+%?([\w.\-]+)", line))
        }
        self.frames = _Frames(text)
        self._flops: dict[str, int] = {}

    def scheduled(self) -> list[str]:
        """The computations whose instructions launch kernels: the entry and what control flow calls."""
        found = {self.entry}
        for instrs in self.module.by_comp.values():
            for ins in instrs:
                found.update(c for _, c in _SCHEDULED.findall(ins.attrs))
                if ins.opcode == "conditional" and (m := re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)):
                    found.update(c.strip().lstrip("%") for c in m.group(1).split(","))
                if ins.opcode == "call" and (m := re.search(r"to_apply=%?([\w.\-]+)", ins.attrs)):
                    found.add(m.group(1))
        return [c for c in self.module.by_comp if c in found]

    def flops(self, comp: str, depth: int = 0) -> int:
        """Matmul and attention FLOPs of one run of computation `comp`, the computations it calls included."""
        if comp not in self._flops:
            own = sum(sum(_instruction_flops(self.module, i)) for i in self.module.by_comp.get(comp, []))
            called = [c for i in self.module.by_comp.get(comp, []) for c in _CALLS.findall(i.attrs)]
            self._flops[comp] = own + (sum(self.flops(c, depth + 1) for c in called) if depth < 16 else 0)
        return self._flops[comp]

    def read_bytes(self, name: str, full: int, depth: int = 0) -> int:
        """Bytes a kernel reads of value `name` (`full` bytes): only the slices it takes, nothing of a buffer it
        updates in place, else all of it (bitcasts followed)."""
        total = 0
        for user in self.module.users.get(name, []):
            if user.opcode == "bitcast" and depth < 8:
                total += self.read_bytes(user.name, full, depth + 1)
            elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
                total += type_bytes(user.type)
            elif not (user.opcode == "dynamic-update-slice" and user.operands[0] == name):
                return full
        return min(total, full)

    def written_bytes(self, name: str, depth: int = 0) -> int:
        """Bytes a kernel writes of its result `name`: a tuple's parts, an in-place update's update only."""
        ins = self.by_name.get(name)
        if ins is None:
            return 0
        if ins.opcode == "tuple" and depth < 4:
            return sum(self.written_bytes(o, depth + 1) for o in ins.operands)
        if ins.opcode == "bitcast" and ins.operands and depth < 8:
            return self.written_bytes(ins.operands[0], depth + 1)
        if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
            return type_bytes(self.module.types.get(ins.operands[1], ""))
        return type_bytes(ins.type)

    def wrapped(self, ins: _Instr) -> _Instr:
        """The instruction an `async-start` runs (the root of the computation it calls), named after the start."""
        called = _CALLS.search(ins.attrs)
        root = self.by_name.get(self.roots.get(called.group(1), "")) if called else None
        return dataclasses.replace(root, name=ins.name) if root else ins

    def kernel_cost(self, ins: _Instr) -> tuple[int, int, list[_Instr]]:
        """(FLOPs, HBM bytes, fused body) of one run of kernel `ins`."""
        called = _CALLS.search(ins.attrs) if ins.opcode in ("fusion", "fusion-start") else None
        if called:
            body_name = called.group(1)
            body = self.module.by_comp.get(body_name, [])
            reads = sum(
                self.read_bytes(self.module.params.get((body_name, i), ""), type_bytes(self.module.types.get(o, "")))
                for i, o in enumerate(ins.operands)
            )  # fmt: skip
            return self.flops(body_name), reads + self.written_bytes(self.roots.get(body_name, "")), body
        reads = sum(type_bytes(self.module.types.get(o, "")) for o in ins.operands)
        if ins.opcode in ("dynamic-update-slice", "dynamic-slice"):  # in place / a slice: the moved part, both ways
            moved = self.module.types.get(ins.operands[1], "") if ins.opcode == "dynamic-update-slice" else ins.type
            return 0, 2 * type_bytes(moved), []
        written = sum(n * type_bytes(f"{d}[1]") for d, n in _arrays(ins.type) if d not in _SCRATCH)
        if ins.opcode in _WRAPS_OPERANDS:  # its result tuple holds its operands too
            written = max(written - reads, 0)
        return sum(_instruction_flops(self.module, ins)), reads + written, []


def _kernels(
    program: _Program, runs: Mapping[str, Any], peak_flops: float, hbm_bw: float, link_seconds: Callable | None
) -> list[Kernel]:
    """Every kernel of the program, its runs per call from `runs` (`_executions`)."""
    out = []
    for comp in program.scheduled():
        times = float(runs.get(comp, 0))
        for ins in program.module.by_comp[comp]:
            if ins.opcode in _FREE or ins.opcode.endswith(("-done", "-update")) or not times:
                continue
            asynchronous = ins.opcode.endswith("-start") and not _MADE_SYNC.search(ins.attrs)
            if ins.opcode == "async-start":  # a wrapped instruction (a collective, a fusion) on another stream
                ins = program.wrapped(ins)
            flops, moved, body = program.kernel_cost(ins)
            kind, source = _classify(ins, body, program.frames)
            if kind == "collective":
                operand = sum(type_bytes(program.module.types.get(o, "")) for o in ins.operands)
                base, group = ins.opcode.removesuffix("-start"), _group_size(ins.attrs)
                wire = link_seconds(base, group, operand) if link_seconds else 0.0
                exposed = not asynchronous
                out.append(Kernel(ins.name, ins.opcode, kind, 0, moved, times, times * wire, "link", source, exposed))
                continue
            compute, memory = flops / peak_flops, moved / hbm_bw
            bound, seconds = ("compute", compute) if compute >= memory else ("memory", memory)
            out.append(Kernel(ins.name, ins.opcode, kind, flops, moved, times, times * seconds, bound, source))
    return out


def roofline(
    compiled_or_text: Any,
    peak_flops: float,
    hbm_bw: float,
    link_seconds: Callable[[str, int, int], float] | None = None,
    branches: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Roofline:
    """The roofline of a `jax.stages.Compiled` (or its `.as_text()`) for a device of `peak_flops` FLOP/s and
    `hbm_bw` HBM bytes/s. `link_seconds(opcode, group size, operand bytes)` prices a collective (None: listed at
    0 s). `branches` {named scope: `[groups, branches]` runs}: as `hlo_flops`'s (a pipeline's schedule, a group
    per stage); the roofline is the group whose kernels take longest (the stage the others wait for)."""
    program = _Program(_text(compiled_or_text))
    if not program.entry:
        return Roofline([], peak_flops, hbm_bw)
    groups = len(next(iter(branches.values()))) if branches else 1
    best: Roofline | None = None
    for g in range(groups):
        runs = _executions(program.computations, program.entry, {k: v[g] for k, v in (branches or {}).items()})
        found = Roofline(_kernels(program, runs, peak_flops, hbm_bw, link_seconds), peak_flops, hbm_bw)
        if best is None or found.step_seconds() > best.step_seconds():
            best = found
    return best
