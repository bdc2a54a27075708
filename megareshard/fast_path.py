"""The trainer's side of the GPU fast path (docs/design.md §5b): the attention kernel, the cross-entropy and
regional compilation set on the model, and the start-up line that says what runs.

The trainer imports no model: it reaches the model's ``configure_attention`` and ``compile_regions`` (GPT,
U-Transformer and the pipeline's model chunks have them) through the module it was given.
"""
from __future__ import annotations

from typing import Any

import torch

from .compile_config import CompileOptions, compile_enabled
from .config_fields import ConfigError

__all__ = ["set_up_fast_path", "may_delay_wgrad"]

_FUSION_SWITCHES = (("--no-bias-gelu-fusion", "bias_gelu_fusion"), ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                    ("--no-rope-fusion", "apply_rope_fusion"), ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                    ("--no-bias-dropout-fusion", "bias_dropout_fusion"))


def may_delay_wgrad(cfg: Any) -> bool:
    """Whether a weight gradient of this run may be delayed (--delay-wgrad-compute, a zero-bubble schedule, a
    schedule file): then the linear layers stay outside the compiled regions."""
    if cfg.pp == 1:
        return False
    pipe = cfg.plan.pipeline
    return bool(pipe.delay_wgrad or pipe.schedule_file is not None or pipe.kind.zero_bubble)


def set_up_fast_path(model: torch.nn.Module, cfg: Any, device: torch.device, micro_batch_size: int,
                     model_name: str) -> tuple[list[str], list[str]]:
    """Set the attention kernel (--attention-backend: checked or measured at the stage's shape) and compile the
    model's regions when --torch-compile is on (by default with CUDA). Returns (what runs, one phrase each;
    the compiled regions' names)."""
    lines: list[str] = []
    configure = getattr(model, "configure_attention", None)
    if configure is not None:
        lines += [f"attention {line}" for line in configure(micro_batch_size)]
    m = cfg.model
    lines.append("cross-entropy fused, chunked over tokens" if m.cross_entropy_loss_fusion else
                 "cross-entropy unfused (fp32 logits of the whole vocabulary; --cross-entropy-loss-fusion chunks them)")
    if not compile_enabled(cfg.compile, device.type):
        off = [flag for flag, field in _FUSION_SWITCHES if not getattr(m, field)]
        lines.append("not compiled (--torch-compile is off" +
                     (f"; {', '.join(off)} change nothing: nothing is fused)" if off else ")"))
        return lines, []
    compile_regions = getattr(model, "compile_regions", None)
    if compile_regions is None:
        raise ConfigError(f"--torch-compile: the {model_name} model has no regions to compile; pass --no-torch-compile")
    delays = may_delay_wgrad(cfg)
    c = cfg.compile
    regions = compile_regions(CompileOptions(c.torch_compile_backend, c.torch_compile_mode,
                                             traceable_linears=not delays))
    lines.append(f"torch.compile (backend {c.torch_compile_backend}, mode {c.torch_compile_mode}) of {len(regions)} "
                 "regions, compiled at the first iteration; linear layers "
                 + ("outside them (weight gradients may be delayed)" if delays else "inside them"))
    return lines, regions
