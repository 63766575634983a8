"""The Trainer's public methods work in any order after `__init__`: `evaluate` before `run` (and after it)."""

import math

from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
from spmdkit.train.loop import Trainer


def test_evaluate_before_run_equals_the_eval_loss_run_logs(tmp_path):
    # One step whose gradients are NaN (`fail_steps` counts optimizer steps from 0): it is skipped, so the parameters
    # the run evaluates after step 1 are the fresh ones that `evaluate` saw before `run`.
    run = RunSettings(
        steps=1, batch_size=8, seq_len=32, log_every=1, eval_every=1, eval_batches=2, fail_steps=(0,),
        run_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    config = TrainConfig(model=ModelSettings(name="tiny", dtype="float32"), mesh=MeshSettings(mesh="fsdp=8"), run=run)
    trainer = Trainer(config, log=lambda _: None)
    before = trainer.evaluate()
    assert math.isfinite(before["eval_loss"]) and before["eval_loss"] > 0
    # the checkpointer's (empty) directory, and the run directory's lock (held until `run` ends)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".spmdkit-lock", "checkpoints"]

    result = trainer.run()
    assert result.skipped_steps == 1
    assert result.eval_losses == {1: before["eval_loss"]}
    assert not (tmp_path / "run" / ".spmdkit-lock").exists()  # released at the end of `run`
    assert trainer.evaluate() == before  # after `run` too (its checkpointer closed): the same state, the same loss
