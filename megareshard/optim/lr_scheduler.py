"""Learning-rate schedules, as Megatron-LM's OptimizerParamScheduler computes them; the state is the step count.

``ParamSchedule`` counts in samples, as Megatron does: iteration k (1-based) trains at the rate of
``(k - 1) × global batch`` consumed samples. Linear warm-up from ``init_lr`` over the warm-up samples,
then ``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD`` (warm-up, stable, then
an anneal over the last ``wsd_decay_steps`` samples of the decay) down to ``min_lr`` at the end of the
decay samples, ``min_lr`` after. ``WarmupCosine`` is the simpler per-iteration form kept for tools and tests.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only a type here: parse_args validates the schedule without loading torch
    import torch

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True)
class ParamSchedule:
    """Megatron-LM's learning rate per (1-based) iteration, with its steps counted in samples."""

    max_lr: float
    min_lr: float
    warmup_steps: int  # samples of linear warm-up
    decay_steps: int  # samples of warm-up plus decay
    decay_style: str = "linear"
    samples_per_iter: int = 1  # the global batch
    init_lr: float = 0.0  # where the warm-up starts
    wsd_decay_steps: int | None = None  # samples of the WSD anneal
    wsd_decay_style: str = "exponential"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.decay_style!r} is not one of {DECAY_STYLES}")
        if self.wsd_decay_style not in WSD_STYLES:
            raise ValueError(f"WSD decay style {self.wsd_decay_style!r} is not one of {WSD_STYLES}")

    def at_samples(self, n: int) -> float:
        """The rate once ``n`` samples have been consumed (Megatron's ``get_lr`` at ``num_steps = n``)."""
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(n, 1)))
        ratio = (n - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps samples
            start = self.decay_steps - self.wsd_decay_steps
            if n <= start:
                coeff = 1.0
            else:
                r = (n - start) / self.wsd_decay_steps
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[
                    self.wsd_decay_style]
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def __call__(self, step: int) -> float:
        return self.at_samples((step - 1) * self.samples_per_iter)


def decoupled_schedule_from_config(t: Any) -> ParamSchedule | None:
    """--decoupled-lr / --decoupled-min-lr (default --min-lr): the schedule of the embedding and output layer."""
    if getattr(t, "decoupled_lr", None) is None:
        return None
    base = schedule_from_config(t)
    min_lr = t.decoupled_min_lr if t.decoupled_min_lr is not None else t.min_lr
    return dataclasses.replace(base, max_lr=t.decoupled_lr, min_lr=min_lr)


def schedule_from_config(t: Any) -> ParamSchedule:
    """The schedule of a TrainingConfig (validated: global batch, decay iterations or samples filled in)."""
    gb = t.global_batch_size
    decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.lr_decay_iters * gb
    if t.lr_warmup_fraction is not None:
        warmup = int(t.lr_warmup_fraction * decay)
    else:
        warmup = t.lr_warmup_samples or t.lr_warmup_iters * gb
    wsd = (t.lr_wsd_decay_samples if t.lr_wsd_decay_samples is not None
           else t.lr_wsd_decay_iters * gb if t.lr_wsd_decay_iters is not None else None)
    return ParamSchedule(t.lr, t.min_lr, warmup, decay, t.lr_decay_style, gb, t.lr_warmup_init, wsd,
                         t.lr_wsd_decay_style)


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
    """Sets the optimizer's learning rate from a schedule before every step; ``num_steps`` counts the iterations
    begun whose update was applied (``skipped`` takes back one whose update was not).

    Parameter groups marked ``decoupled`` (Megatron's ``--decoupled-lr``: the input embedding and output
    layer) follow ``decoupled_schedule``, the same shape between their own peak and minimum rates."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: WarmupCosine | ParamSchedule,
                 decoupled_schedule: WarmupCosine | ParamSchedule | None = None) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.decoupled_schedule = decoupled_schedule
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        step = max(self.num_steps, 1)
        lr = self.schedule(step)
        other = self.decoupled_schedule(step) if self.decoupled_schedule is not None else lr
        for group in self.optimizer.param_groups:
            group["lr"] = other if group.get("decoupled") else lr

    def step(self) -> float:
        """Advance to the next iteration and return its learning rate."""
        self.num_steps += 1
        self._apply()
        return self.optimizer.param_groups[0]["lr"]

    def skipped(self) -> None:
        """The update of the iteration ``step()`` began was skipped (fp16 overflow): take the step back, so the
        schedule counts applied updates only and the next iteration trains at this rate again, as Megatron-LM's
        scheduler advances only after a successful update. The data position still advances (the caller's)."""
        self.num_steps = max(self.num_steps - 1, 0)

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "schedule": vars(self.schedule).copy()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
