"""A step hook: the learning rate each iteration ran with, one JSON line per iteration, in the file
$LR_TRACE_FILE (rank 0 writes). Load it with ``--custom-import lr_trace`` (the examples directory on
PYTHONPATH); the hook is called at every iteration's start, after the learning rate stepped."""
import json
import os

from megareshard.plugins import register_step_hook


def trace_lr(trainer: object, iteration: int) -> None:
    if trainer.ctx.rank != 0:
        return
    lr = trainer.optimizer.param_groups[0]["lr"]
    with open(os.environ["LR_TRACE_FILE"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"iteration": iteration, "lr": lr}) + "\n")


register_step_hook(trace_lr)  # the registry line
