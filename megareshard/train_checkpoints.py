"""The trainer's checkpoints in its loop (`Checkpointing`, a mix-in of the `Trainer`, which holds the state it
reads: ``cfg``, ``ctx``, ``checkpoints``, ``model``, ``optimizer``, ``scheduler``, ``sampler``, ``tracker``,
``iteration``): --save-interval saves, --exit-interval, --exit-duration-in-mins and SIGTERM (agreed by every
rank) save and stop, a failed save stops or (--on-save-failure continue) is reported."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError

__all__ = ["Checkpointing"]


class Checkpointing:
    """The trainer's saves (module docstring)."""

    def _say_checkpoint(self, msg: str, warning: bool) -> None:
        if self.ctx.rank == 0:
            print(("WARNING: checkpoint: " if warning else "checkpoint: ") + msg, file=self.out, flush=True)

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True
        print(f" rank {self.ctx.rank}: SIGTERM received: saving a checkpoint after this iteration, then exiting",
              file=self.out, flush=True)

    def save_checkpoint(self) -> str | None:
        """Collective: save this iteration under --save (atomic; updates --save/latest). A failed save (every
        rank gets the same error; ``latest`` still names the previous checkpoint) stops the run, or with
        --on-save-failure continue is reported and training goes on (returns None)."""
        # untimed: writing a large checkpoint may rightly outlast --comm-timeout; a peer's failure is still named
        with self._activity(f"saving checkpoint of iteration {self.iteration} to {self.cfg.checkpoint.save} "
                            f"(collective over all {self.world_size} ranks)", timed=False):
            try:
                path = self.checkpoints.save(self.cfg.checkpoint.save, self.iteration, model=self.model,
                                             optimizer=self.optimizer, scheduler=self.scheduler, sampler=self.sampler,
                                             config=self.cfg, wandb_run_id=self.tracker.run_id)
            except CheckpointError as e:
                self._save_failed(e)
                return None
        self._last_saved = self.iteration
        return path

    def _save_failed(self, error: CheckpointError) -> None:
        if self.cfg.checkpoint.on_save_failure == "stop":
            raise error
        self.save_failures += 1
        if self.ctx.rank == 0:
            print(f"WARNING: {error}; training continues (--on-save-failure continue)", file=self.out, flush=True)

    def _checkpoint_and_maybe_exit(self) -> bool:
        """After an iteration: --save-interval saves; --exit-interval and SIGTERM (agreed on by every rank,
        whichever got the signal) save and stop. Returns True to leave the loop."""
        ck = self.cfg.checkpoint
        by_interval = stop = bool(ck.exit_interval and self.iteration % ck.exit_interval == 0)
        limit = self.cfg.training.exit_duration_in_mins
        if limit is not None:  # every rank agrees: the slowest clock decides
            flag = torch.tensor([(time.monotonic() - self._train_start) / 60.0], device=self.device)
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > limit:
                stop = True
                if self.ctx.rank == 0:
                    print(f" exiting at iteration {self.iteration}: training ran {flag.item():.1f} min > "
                          f"--exit-duration-in-mins {limit}", file=self.out, flush=True)
        if ck.exit_signal_handler:
            flag = torch.tensor([1.0 if self._sigterm else 0.0], device=self.device)
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                stop = True
                if self.reporting or self.ctx.rank == 0:
                    print(f" exiting at iteration {self.iteration} on SIGTERM (--exit-signal-handler)",
                          file=self.out, flush=True)
        due = bool(ck.save_interval and self.iteration % ck.save_interval == 0)
        if ck.save and (due or stop) and self._last_saved != self.iteration:
            self.save_checkpoint()
        if by_interval and self.ctx.rank == 0 and not self._sigterm:
            print(f" exiting at iteration {self.iteration} (--exit-interval {ck.exit_interval})", file=self.out,
                  flush=True)
        return stop
