"""Starting and joining multi-process JAX jobs: process-side `initialize`, the local `launcher`, and `slurm`.

A script of your own that `spmdkit launch` (or srun, or mpirun) starts joins the job with one call, first thing::

    import spmdkit.distributed

    spmdkit.distributed.join()  # before JAX computes anything; `spmdkit train` does it itself
    import jax  # now jax.devices() lists every process's devices

`spmdkit.distributed.initialize.initialize_distributed` is the same call under its former name.
"""

from spmdkit.distributed.initialize import DistributedEnv, join

__all__ = ["DistributedEnv", "join"]
