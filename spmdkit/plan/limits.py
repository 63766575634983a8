"""The largest sizes a command takes, checked before anything is allocated (`check_sizes`): one line naming the
limit instead of minutes of work and gigabytes of host memory on a mistyped number.

- `--devices` (and `--devices-per-host`, `--gpus-per-node`): 65,536 (2^16) devices in one job, more than any
  cluster trains on today.
- `--seq-len` (and generation's `--max-len`): 4,194,304 (2^22) tokens, four times the longest context trained in
  public (1M); longer sequences make host tables (RoPE, masks) of several GB before XLA compiles anything.
- `--microbatches`, `--grad-accum`, `--virtual-stages`: 4,096 per step; a pipeline's schedule is a table of
  microbatches x stages, simulated tick by tick (the planner) and unrolled into the program.
- `--cpu-devices`: 4,096 simulated devices, each a share of one machine (100,000,000 took 24 GB before any check).
- `--batch-size` x `--seq-len`: under 2^31 tokens per step, the reach of the int32 token indexes (a step's
  token count, the data's row offsets).

A 70B model at 128k tokens on 512 GPUs is well inside every limit.
"""

from __future__ import annotations

from spmdkit.errors import SpmdkitError

LIMITS = {  # flag -> (the largest value, why)
    "--devices": (2**16, "devices in one job"),
    "--devices-per-host": (2**16, "devices in one job"),
    "--gpus-per-node": (2**16, "devices in one job"),
    "--seq-len": (2**22, "tokens per sequence, 4x the longest context trained in public"),
    "--max-len": (2**22, "tokens of context, 4x the longest context trained in public"),
    "--microbatches": (4096, "microbatches per step"),
    "--grad-accum": (4096, "microbatches per step"),
    "--virtual-stages": (4096, "layer chunks per pipeline stage"),
    "--cpu-devices": (4096, "simulated CPU devices (each a share of this machine's cores and memory)"),
}
MAX_TOKENS = 2**31 - 1  # tokens per step: int32 token indexes


def check_sizes(sizes: dict[str, int | None]) -> None:
    """SpmdkitError (one line naming the limit) when a size of `sizes` (flag -> value; None: not given) is above
    its limit in `LIMITS`, or `--batch-size` x `--seq-len` is above `MAX_TOKENS`. Values below 1 are the
    commands' own checks."""
    for flag, value in sizes.items():
        if flag in LIMITS and value is not None and value > LIMITS[flag][0]:
            limit, what = LIMITS[flag]
            raise SpmdkitError(f"{flag} {value:,} is above spmdkit's limit of {limit:,} {what}: pass a smaller value")
    batch, seq_len = sizes.get("--batch-size"), sizes.get("--seq-len")
    if batch and seq_len and batch * seq_len > MAX_TOKENS:
        raise SpmdkitError(
            f"--batch-size {batch:,} x --seq-len {seq_len:,} is {batch * seq_len:,} tokens per step, above spmdkit's "
            f"limit of 2^31 - 1 (int32 token indexes): shorten the batch or the sequence"
        )
