"""The run directory, which is not a checkpoint: its one writer (`lock`), its identity (`identity`), and which
directories a command may write (`ownership`)."""
