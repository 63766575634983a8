"""On a machine with an NVIDIA GPU: the deviceless compile (`spmdkit compile`) against a compile for the GPU itself.

Compiles one `spmdkit train` command line's step twice in one process: for the local GPU (XLA autotunes its GEMMs
and cuDNN plans there) and for the compile-only target of the same kind (what `spmdkit compile` does on a laptop),
and prints both `memory_analysis()` results, the attention kernel and the collectives of each. The deviceless
numbers are the ones to trust before renting a cluster if the two agree.

    python scripts/check_aot_against_gpu.py --target h100 --model 1b --mesh fsdp=1 --seq-len 2048 --batch-size 8
"""

from __future__ import annotations

import json
import sys

from spmdkit.cli.compile import parse
from spmdkit.targets.flags import add_xla_flags, compile_with_options, gpu_compiler_options


def main(argv: list[str]) -> int:
    config, args = parse(argv)
    add_xla_flags()
    import jax

    from spmdkit.targets import target_devices
    from spmdkit.tools.gpu_compile import attention_in_hlo, lower_train_step, memory_bytes
    from spmdkit.train.step.program import build_program

    local = jax.devices()[: args.devices]
    rows = {}
    for name, devices in (
        ("gpu", local),
        ("deviceless", target_devices(args.target, len(local), args.devices_per_host)),
    ):
        program = build_program(config, devices)
        compiled, dropped = compile_with_options(lower_train_step(program), gpu_compiler_options())
        text = compiled.as_text()
        rows[name] = {
            "device_kind": devices[0].device_kind, "memory": memory_bytes(compiled),
            "attention": attention_in_hlo(text, program.context), "fusions": text.count(" fusion("),
            "flags_left_out": dropped,
        }  # fmt: skip
    rows["total_ratio_deviceless_over_gpu"] = rows["deviceless"]["memory"]["total"] / rows["gpu"]["memory"]["total"]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
