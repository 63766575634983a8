"""Context parallelism: the zigzag layout and ring attention over the `context` mesh axis."""
