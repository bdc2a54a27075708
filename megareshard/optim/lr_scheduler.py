"""Linear warm-up then cosine decay, as in Megatron-LM; the state is just the step count."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WarmupCosine:
    """The learning rate at each (1-based) iteration."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int

    def __call__(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if step > self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        ratio = (step - self.warmup_iters) / span
        return self.min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (self.max_lr - self.min_lr)


class LRScheduler:
    """Sets the optimizer's learning rate from a schedule before every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: WarmupCosine) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule(max(self.num_steps, 1))
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """Advance to the next iteration and return its learning rate."""
        self.num_steps += 1
        self._apply()
        return self.optimizer.param_groups[0]["lr"]

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "schedule": vars(self.schedule).copy()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
