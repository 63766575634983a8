"""Training: the run's config (`config`), the loop (`loop.Trainer`), and below it the step and its program
(`step/`), the job's health (`health/`) and what a run reports (`reporting/`)."""
