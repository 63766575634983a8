"""The step and what it is compiled from: `program` (`build_program`), `train_step`, `pipeline`, `state`,
`optimizer`, and the checks before a run writes anything (`preflight`).

`spmdkit.train.step` was the train step's module until the train package split by concern; its names stay
importable from here for one release (use `spmdkit.train.step.train_step`)."""

from spmdkit.train.step.train_step import Batch, StepFn, batch_shardings, make_eval_step, make_train_step

__all__ = ["Batch", "StepFn", "batch_shardings", "make_eval_step", "make_train_step"]
