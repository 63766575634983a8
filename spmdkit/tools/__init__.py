"""Tools over checkpoints and runs: inspection and verification, resharding and conversion, the benchmark."""
