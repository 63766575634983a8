"""The step and what it is compiled from: `program` (`build_program`), `train_step`, `pipeline`, `state`,
`optimizer`, `balance` (auxiliary-loss-free MoE balancing), and the checks before a run writes anything
(`preflight`).

`spmdkit.train.step` was the train step's module until the train package split by concern; its names stay
importable from here for one release (use `spmdkit.train.step.train_step`), lazily: importing a module of this
package (the JAX-free `preflight`) does not import JAX."""

from spmdkit._lazy import lazy_exports

_MOVED = (
    "Batch",
    "StepFn",
    "batch_shardings",
    "check_bad_steps",
    "loss_and_grads",
    "make_eval_step",
    "make_train_step",
    "objective",
    "scored_tokens",
)
__getattr__, __dir__, __all__ = lazy_exports(__name__, dict.fromkeys(_MOVED, "spmdkit.train.step.train_step"))
