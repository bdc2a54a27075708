"""Loss scaling for fp16 training (Megatron's ``DynamicGradScaler`` / ``ConstantGradScaler``).

fp16 gradients underflow below ~6e-8; multiplying the loss by a large scale before
backward keeps them representable, and the optimizer divides the (fp32) gradients by
the same scale before using them. A too-large scale overflows (inf/nan gradients): the
step is then skipped on EVERY rank (the found-inf flag is all-reduced over the world,
so ranks never disagree on whether parameters moved) and the scale is lowered.

Dynamic rule (Megatron/DeepSpeed): each overflow consumes one unit of ``hysteresis``;
when it is exhausted the scale is multiplied by ``backoff_factor`` (0.5), never below
``min_scale``. After ``growth_interval`` (``--loss-scale-window``) consecutive clean
steps the scale is multiplied by ``growth_factor`` (2) and the hysteresis refilled.
"""
from __future__ import annotations

import logging

import torch

__all__ = ["LossScaler", "ConstantLossScaler", "DynamicLossScaler", "build_loss_scaler"]

logger = logging.getLogger("megareshard")


class LossScaler:
    """Interface: ``scale`` (float), ``update(found_inf)``, ``state_dict``/``load_state_dict``."""

    scale: float = 1.0
    dynamic: bool = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class ConstantLossScaler(LossScaler):
    """``--loss-scale S``: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass


class DynamicLossScaler(LossScaler):
    """Dynamic loss scale: halve after ``hysteresis`` overflows, double after ``window`` clean steps."""

    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 16, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2, growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        if not initial_scale > 0 or not min_scale > 0:
            raise ValueError(f"initial ({initial_scale}) and min ({min_scale}) loss scales must be positive")
        if window < 1 or hysteresis < 1:
            raise ValueError(f"loss_scale_window ({window}) and hysteresis ({hysteresis}) must be >= 1")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"growth_factor must be > 1 and backoff_factor in (0, 1), got "
                             f"{growth_factor}, {backoff_factor}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self._hysteresis_left = self.hysteresis
        self._clean_steps = 0
        self.num_overflows = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.num_overflows += 1
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                old = self.scale
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._hysteresis_left = self.hysteresis
                logger.info("loss scale %g -> %g after overflow", old, self.scale)
            return
        self._clean_steps += 1
        if self._clean_steps >= self.window:
            self.scale *= self.growth_factor
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left,
                "num_overflows": self.num_overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state.get("clean_steps", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        self.num_overflows = int(state.get("num_overflows", 0))


def build_loss_scaler(memory_cfg) -> LossScaler | None:
    """From a ``MemoryConfig``: None unless ``fp16``; a constant scaler with ``loss_scale``, else dynamic."""
    if not memory_cfg.fp16:
        return None
    if memory_cfg.loss_scale is not None:
        return ConstantLossScaler(memory_cfg.loss_scale)
    return DynamicLossScaler(memory_cfg.initial_loss_scale, memory_cfg.min_loss_scale,
                             memory_cfg.loss_scale_window, memory_cfg.hysteresis)
