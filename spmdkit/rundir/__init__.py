"""The run directory, which is not a checkpoint: its one writer (`lock`) and which directories a command may write
(`ownership`)."""
