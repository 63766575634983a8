"""Pipeline schedules as data: a numpy table `[ticks, stages, fields]` that the shard_map program follows.

Time is counted in ticks. In one tick every stage runs at most one op on one microbatch and one model chunk:
a forward (F) or a backward (B) of that chunk, both taken as one time unit. With `v` virtual stages the model's
`num_layers` are cut into `C = P * v` chunks; global chunk `c` lives on stage `c % P` as local chunk `c // P`
(stage s holds chunks s, s+P, ..., s+(v-1)P). A forward of chunk c feeds chunk c+1 on the next stage (ring
order), a backward of chunk c feeds chunk c-1 on the previous stage. A message sent in tick t arrives at the
start of tick t+1.

Per-stage op orders (standard ones), turned into ticks by a greedy simulation (an op runs in the first tick
after its inputs arrived, in its stage's order):
- gpipe: all M forwards, then all M backwards (last microbatch first). T = 2(M+P-1).
- 1f1b: stage s runs P-1-s warm-up forwards, then alternates F/B, then the cool-down backwards.
  T = 2(M+P-1); a stage never holds more than P stashed inputs.
- interleaved (Megatron): microbatches in groups of P, chunks in order (forward) or reversed (backward);
  stage s runs 2(P-1-s) + (v-1)P warm-up forwards, then alternates. T = 2(vM+P-1) chunk ticks.
Bubble (idle fraction of the T x P grid): (P-1)/(M+P-1) for gpipe and 1f1b, (P-1)/(vM+P-1) interleaved.

Buffers: each stage has a *stash* of stage inputs (written on arrival, read by the forward and again by the
backward, which recomputes the chunk) and a *cotangent buffer* (written on arrival, read by the backward).
Slots are allocated from each value's lifetime `[arrival tick, backward tick]` by interval colouring, so the
number of slots is the peak number of values alive. Stage 0's chunk 0 reads the pipeline inputs directly
(no stash slot) and the last chunk takes its cotangent from the loss (no buffer slot).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spmdkit.errors import SpmdkitError

KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")

IDLE, FORWARD, BACKWARD = 0, 1, 2
# Fields of a table row `table[tick, stage]`; -1 means "none".
OP = 0  # IDLE / FORWARD / BACKWARD
MB = 1  # microbatch
CHUNK = 2  # local chunk index (0..v-1) on this stage
SLOT = 3  # stash slot holding this op's stage input (-1: read the pipeline inputs, stage 0 chunk 0)
GRAD_SLOT = 4  # cotangent-buffer slot a backward reads (-1: last chunk, cotangent from the loss)
RECV_X = 5  # stash slot the activation arriving this tick is written to (-1: drop it)
RECV_G = 6  # cotangent slot the cotangent arriving this tick is written to (-1: drop it)
FIRST = 7  # 1 if this op's chunk is global chunk 0 (its input is the pipeline input)
LAST = 8  # 1 if this op's chunk is the last global chunk (the loss follows it)
FIELDS: tuple[str, ...] = ("op", "mb", "chunk", "slot", "grad_slot", "recv_x", "recv_g", "first", "last")
# The named scope of the program's `lax.switch` over a tick's branches (`branch_table`): what the FLOPs count
# (`spmdkit.inspect.flops`) finds the switch's `conditional` by, in the compiled program's metadata.
TICK_SCOPE = "pipeline_tick"


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: `table[tick, stage, field]` (int32, fields in `FIELDS`) and buffer sizes.

    `num_stash_slots` / `num_grad_slots` are the maxima over stages of the live stash / cotangent values.
    """

    kind: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    table: np.ndarray
    num_stash_slots: int
    num_grad_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.table.shape[0])

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def bubble_fraction(self) -> float:
        """Idle fraction of the `ticks x stages` grid (a forward and a backward are one unit each)."""
        return float(np.mean(self.table[:, :, OP] == IDLE))

    def forward_ticks(self) -> int:
        """Number of leading ticks that hold every forward (the forward phase of GPipe)."""
        ticks = np.nonzero((self.table[:, :, OP] == FORWARD).any(axis=1))[0]
        return int(ticks[-1]) + 1

    def branch_table(self) -> np.ndarray:
        """`[ticks, stages]`: the branch of the program's `lax.switch` each stage takes in each tick of its loop.

        1f1b / interleaved: 0 idle, 1 forward, 2 backward, 3 backward of the last chunk (with the loss); the last
        chunk's forward tick is idle (its backward recomputes it). gpipe, over the forward ticks only (autodiff runs
        them backwards): 0 idle, 1 forward, 2 forward of the last chunk (with the loss).
        """
        op, last = self.table[:, :, OP], self.table[:, :, LAST] == 1
        if self.kind == "gpipe":
            return np.where(last & (op == FORWARD), 2, op)[: self.forward_ticks()].astype(np.int32)
        return np.where(last, np.where(op == BACKWARD, 3, IDLE), op).astype(np.int32)

    def branch_runs(self) -> np.ndarray:
        """`[stages, branches]`: how many ticks of its loop each stage takes each branch of `branch_table`."""
        table = self.branch_table()
        branches = 3 if self.kind == "gpipe" else 4
        return np.stack([np.bincount(table[:, s], minlength=branches) for s in range(self.num_stages)])

    def peak_stash(self) -> np.ndarray:
        """`[stages]`: the most stage inputs each stage holds at once (stash slots in use): a value is live from its
        arrival to its backward's read."""
        T, P, _ = self.table.shape
        peaks = np.zeros(P, np.int64)
        for s in range(P):
            counts = np.zeros(T, np.int64)
            for t0 in np.nonzero(self.table[:, s, RECV_X] >= 0)[0]:
                slot = self.table[t0, s, RECV_X]
                reads = (self.table[t0:, s, OP] == BACKWARD) & (self.table[t0:, s, SLOT] == slot)
                counts[t0 : t0 + int(np.argmax(reads)) + 1] += 1
            peaks[s] = counts.max()
        return peaks

    def format(self) -> str:
        """Text grid: one row per stage, one column per tick, cells `F3`/`B3` (`F3.1` = chunk 1), `.` idle."""
        cells = [[_cell(row, self.virtual_stages) for row in self.table[:, s]] for s in range(self.num_stages)]
        width = max(len(c) for r in cells for c in r)
        lines = [f"stage {s}: " + " ".join(c.rjust(width) for c in r) for s, r in enumerate(cells)]
        head = (
            f"{self.kind}: P={self.num_stages} M={self.num_microbatches} v={self.virtual_stages} "
            f"ticks={self.num_ticks} bubble={self.bubble_fraction():.3f}"
        )
        return "\n".join([head, *lines])

    def plot(self, path: str) -> None:
        """Write a PNG: stages as rows, ticks as columns; forwards blue, backwards orange, microbatch numbers.

        With virtual stages the chunk sets the shade (darker = later chunk).
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's backend
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle

        T, P, v = self.num_ticks, self.num_stages, self.virtual_stages
        fig = Figure(figsize=(max(4.0, 0.35 * T + 1), 0.5 * P + 1))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colours = {FORWARD: np.array([0.25, 0.45, 0.85]), BACKWARD: np.array([0.95, 0.55, 0.15])}
        for t in range(T):
            for s in range(P):
                row = self.table[t, s]
                if row[OP] == IDLE:
                    continue
                shade = 1.0 - 0.45 * row[CHUNK] / max(v - 1, 1) if v > 1 else 1.0
                colour = np.clip(colours[int(row[OP])] * shade + (1 - shade) * 0.1, 0, 1)
                ax.add_patch(Rectangle((t, s), 1, 1, facecolor=colour, edgecolor="white"))
                ax.text(t + 0.5, s + 0.5, str(row[MB]), ha="center", va="center", fontsize=7, color="white")
        ax.set_xlim(0, T)
        ax.set_ylim(P, 0)
        ax.set_yticks(np.arange(P) + 0.5, [f"stage {s}" for s in range(P)])
        ax.set_xlabel("tick")
        ax.set_title(
            f"{self.kind} P={P} M={self.num_microbatches} v={v}  bubble {self.bubble_fraction():.3f} "
            "(blue forward, orange backward)"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=100)


def check_layers(num_layers: int, num_stages: int, virtual_stages: int = 1) -> int:
    """Layers per chunk `num_layers / (num_stages * virtual_stages)`; SpmdkitError if it does not divide."""
    chunks = num_stages * virtual_stages
    if num_layers < 1 or num_layers % chunks:
        raise SpmdkitError(
            f"{num_layers} layers cannot be split into {num_stages} stages x {virtual_stages} virtual stages: "
            f"choose a layer count divisible by {chunks}"
        )
    return num_layers // chunks


def check_pipelinable(moe_layers: int, context: int) -> None:
    """SpmdkitError for what the pipeline program cannot run yet: mixture-of-experts blocks, context parallelism."""
    if moe_layers:
        raise SpmdkitError("pipelining a mixture-of-experts model is not supported yet: drop pipeline= from the mesh")
    if context > 1:
        raise SpmdkitError("pipeline and context parallelism together are not supported yet: use one of them")


def make_schedule(kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the table for `kind` in {"gpipe", "1f1b", "interleaved"} (see the module docstring)."""
    P, M, v = num_stages, num_microbatches, virtual_stages
    check_arguments(kind, P, M, v)
    orders = [_stage_order(kind, s, P, M, v) for s in range(P)]
    done = _simulate(orders, P, v)
    table = np.full((max(done.values()) + 1, P, len(FIELDS)), -1, np.int32)
    table[:, :, OP] = IDLE
    for (op, m, c), t in done.items():
        s = c % P
        table[t, s, [OP, MB, CHUNK, FIRST, LAST]] = [op, m, c // P, c == 0, c == P * v - 1]
    stash = _allocate(table, done, P, v, kind="x")
    grads = _allocate(table, done, P, v, kind="g")
    return Schedule(kind, P, M, v, table, stash, grads)


def check_arguments(kind: str, P: int, M: int, v: int) -> None:
    """SpmdkitError unless `kind` can run P stages, M microbatches and v virtual stages."""
    if kind not in KINDS:
        raise SpmdkitError(f"unknown pipeline schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if P < 1 or M < 1 or v < 1:
        raise SpmdkitError(f"pipeline stages={P}, microbatches={M}, virtual_stages={v} must all be >= 1")
    if v > 1 and kind != "interleaved":
        raise SpmdkitError(f"virtual_stages={v} needs kind='interleaved' ({kind!r} runs one chunk per stage)")
    if kind in ("1f1b", "interleaved") and M < P:
        raise SpmdkitError(
            f"{kind} needs at least as many microbatches as stages, got {M} < {P}: raise the microbatch "
            f"count or use 'gpipe'"
        )
    if kind == "interleaved" and M % P:
        raise SpmdkitError(
            f"interleaved schedule needs microbatches divisible by stages, got {M} and {P}: use a multiple of {P}"
        )


def _stage_order(kind: str, s: int, P: int, M: int, v: int) -> list[tuple[int, int, int]]:
    """Op order of stage s as (op, microbatch, global chunk)."""
    if kind == "gpipe":
        return [(FORWARD, m, s) for m in range(M)] + [(BACKWARD, m, s) for m in reversed(range(M))]

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th forward/backward -> (mb, local chunk)
        group, within = divmod(k, P * v)
        j = within // P
        return group * P + within % P, (v - 1 - j if backward else j)

    warmup = min(P - 1 - s if v == 1 else 2 * (P - 1 - s) + (v - 1) * P, M * v)
    fwd = [(FORWARD, *unit(k, False)) for k in range(M * v)]
    bwd = [(BACKWARD, *unit(k, True)) for k in range(M * v)]
    order = fwd[:warmup]
    for k in range(M * v - warmup):
        order += [fwd[warmup + k], bwd[k]]
    order += bwd[M * v - warmup :]
    return [(op, m, j * P + s) for op, m, j in order]


def _simulate(orders: list[list[tuple[int, int, int]]], P: int, v: int) -> dict[tuple[int, int, int], int]:
    """Greedy tick simulation: {(op, mb, global chunk): tick}. An op waits for its input message."""
    last, done, ptr, t = P * v - 1, {}, [0] * P, 0
    while any(ptr[s] < len(orders[s]) for s in range(P)):
        ran = []
        for s in range(P):
            if ptr[s] == len(orders[s]):
                continue
            op, m, c = orders[s][ptr[s]]
            if op == FORWARD:
                dep = (FORWARD, m, c - 1) if c > 0 else None
            else:
                dep = (BACKWARD, m, c + 1) if c < last else (FORWARD, m, c)
            if dep is None or done.get(dep, t) < t:
                ran.append((op, m, c))
                ptr[s] += 1
        done.update({key: t for key in ran})
        t += 1
        if t > 4 * sum(len(o) for o in orders):
            raise AssertionError("pipeline schedule simulation deadlocked")  # a bug, not a user error
    return done


def _allocate(table: np.ndarray, done: dict, P: int, v: int, *, kind: str) -> int:
    """Fill SLOT/RECV_X (kind "x") or GRAD_SLOT/RECV_G (kind "g") by interval colouring; return slot count."""
    last = P * v - 1
    intervals: list[list[tuple[int, int, int, int]]] = [[] for _ in range(P)]  # (arrive, read, mb, chunk)
    for (op, m, c), t in done.items():
        if op != BACKWARD:
            continue
        if kind == "x" and c > 0:
            intervals[c % P].append((done[(FORWARD, m, c - 1)] + 1, t, m, c))
        if kind == "g" and c < last:
            intervals[c % P].append((done[(BACKWARD, m, c + 1)] + 1, t, m, c))
    num_slots = 1
    for s, items in enumerate(intervals):
        free_at: list[int] = []  # per slot: first tick it may be written again
        for arrive, read, m, c in sorted(items):
            slot = next((i for i, f in enumerate(free_at) if f <= arrive), len(free_at))
            free_at[slot : slot + 1] = [read + 1]
            if kind == "x":
                table[arrive, s, RECV_X] = slot
                table[done[(FORWARD, m, c)], s, SLOT] = slot
                table[read, s, SLOT] = slot
            else:
                table[arrive, s, RECV_G] = slot
                table[read, s, GRAD_SLOT] = slot
        num_slots = max(num_slots, len(free_at))
    return num_slots


def _cell(row: np.ndarray, v: int) -> str:
    if row[OP] == IDLE:
        return "."
    name = ("F" if row[OP] == FORWARD else "B") + str(row[MB])
    return f"{name}.{row[CHUNK]}" if v > 1 else name
