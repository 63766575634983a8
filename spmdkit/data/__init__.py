"""Training data: the embedded stdlib corpus, token files and synthetic tokens, as resumable grain streams."""
