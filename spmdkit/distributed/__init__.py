"""Starting and joining multi-process JAX jobs: process-side `initialize`, the local `launcher`, and `slurm`."""
