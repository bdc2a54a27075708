"""The trainer's side of the GPU fast path (docs/design.md §5b): the attention kernel, the cross-entropy and
regional compilation set on the model, and the start-up line that says what runs; ``--deterministic-mode``.

The trainer imports no model: it reaches the model's ``configure_attention`` and ``compile_regions`` (GPT,
U-Transformer and the pipeline's model chunks have them) through the module it was given. The attention kernels
are chosen through a `KernelBook` (kernel_record.py) holding what the checkpoint ``--load`` names recorded
(``checkpoint.json``'s ``kernel_choices``): a resumed run runs the recorded kernels; what this run chose is
left on the model (``model.kernel_choices``) for its checkpoints.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .compile_config import CompileOptions, compile_enabled
from .config_fields import ConfigError
from .kernel_record import KernelBook, kernel_book
from .tensor_parallel.fused_cross_entropy import fusing_backend

__all__ = ["set_up_fast_path", "may_delay_wgrad", "apply_deterministic_mode", "recorded_kernel_choices",
           "NCCL_ALGOS"]

#: Megatron-LM's --deterministic-mode accepts these NCCL_ALGO values (arguments.py); we set the first when unset
NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "^NVLS")
#: the cuBLAS workspace settings PyTorch's deterministic mode accepts (the first is set when unset)
CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")
_ENV_SET: dict[str, str] = {}   # what apply_deterministic_mode set in this process (said as set, not as given)

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


def apply_deterministic_mode(cfg: Any, device: torch.device) -> str | None:
    """--deterministic-mode (Megatron-LM's) at start-up, before the process group and CUDA work: on CUDA
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and ``NCCL_ALGO=Ring`` where unset (another NCCL_ALGO than Megatron-LM
    accepts, or a cuBLAS setting PyTorch does not, is a ConfigError); everywhere
    ``torch.use_deterministic_algorithms(True, warn_only=False)`` (an operation without a deterministic
    implementation then stops the run, naming it), cuDNN deterministic and not benchmarking, and, with
    --torch-compile, inductor without on-device benchmarking. The phrase the start-up line says; None without
    the flag (nothing is touched). Idempotent."""
    if not getattr(cfg.training, "deterministic_mode", False):
        return None
    done = []
    if device.type == "cuda":
        for name, accepted in (("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIGS), ("NCCL_ALGO", NCCL_ALGOS)):
            value = os.environ.get(name)
            if value is None:
                os.environ[name] = _ENV_SET[name] = value = accepted[0]
            if _ENV_SET.get(name) == value:
                done.append(f"{name}={value}")
            elif value not in accepted:
                raise ConfigError(f"--deterministic-mode: {name}={value} is not one it can make deterministic; "
                                  f"unset it or use one of {', '.join(accepted)}")
            else:
                done.append(f"{name}={value} (given)")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    done[:0] = ["torch.use_deterministic_algorithms", "cuDNN deterministic"]
    if compile_enabled(cfg.compile, device.type):
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = True   # no on-device benchmarking that changes numerics
        done.append("inductor deterministic")
    return f"deterministic mode ({', '.join(done)})"


def recorded_kernel_choices(cfg: Any) -> tuple[dict | None, str | None]:
    """(the kernel choices the megareshard checkpoint --load names records, its directory) for a resumed run
    (--load without --finetune); (None, None) for a fresh run, --finetune, a Megatron-LM or Hugging Face
    directory, one that holds no checkpoint yet or cannot be read (its loader says why), and (None, directory)
    for a checkpoint saved before the record (then the kernels are chosen)."""
    ck = cfg.checkpoint
    if not ck.load or ck.finetune:
        return None, None
    from .checkpoint.detect import KIND_CHECKPOINT, KIND_ROOT, load_decision, read_progress

    try:
        if load_decision(ck.load, ck.save).kind not in (KIND_CHECKPOINT, KIND_ROOT):
            return None, None
        progress = read_progress(ck.load)
    except (ConfigError, OSError):
        return None, None
    return progress.kernel_choices, progress.directory


def set_up_fast_path(model: torch.nn.Module, cfg: Any, device: torch.device, micro_batch_size: int,
                     model_name: str) -> tuple[list[str], list[str]]:
    """--deterministic-mode's settings (`apply_deterministic_mode`), the attention kernel (--attention-backend:
    checked, measured at the stage's shape, or as the checkpoint --load names recorded; the choices left on
    ``model.kernel_choices`` for the checkpoints), and the model's regions compiled when --torch-compile is on
    (by default with CUDA). Returns (what runs, one phrase each; the compiled regions' names)."""
    lines: list[str] = []
    deterministic = apply_deterministic_mode(cfg, device)
    if deterministic is not None:
        lines.append(deterministic)
    configure = getattr(model, "configure_attention", None)
    if configure is not None:
        recorded, directory = recorded_kernel_choices(cfg)
        if recorded is None and directory is not None:
            recorded = {}   # a checkpoint from before the record: chosen, and the line says so
        book = KernelBook(recorded=recorded, source=f"the checkpoint {directory}" if directory else "the checkpoint",
                          rechoose=cfg.checkpoint.attention_backend_rechoose, deterministic=deterministic is not None)
        with kernel_book(book):
            lines += [f"attention {line}" for line in configure(micro_batch_size)]
        model.kernel_choices = book.record()
    m = cfg.model
    c = cfg.compile
    whole = (compile_enabled(c, device.type) and fusing_backend(c.torch_compile_backend)
             and c.torch_compile_scope != "model")   # the chunk kernels compiled on their own, fused
    lines.append("cross-entropy unfused (fp32 logits of the whole vocabulary; --cross-entropy-loss-fusion chunks them)"
                 if not m.cross_entropy_loss_fusion else "cross-entropy fused, one chunk a microbatch (inductor's "
                 "kernels keep its fp32 values)" if whole else "cross-entropy fused, chunked over tokens")
    if not compile_enabled(cfg.compile, device.type):
        off = [flag for flag, field in _FUSION_SWITCHES if not getattr(m, field)]
        lines.append("not compiled (--torch-compile is off" +
                     (f"; {', '.join(off)} change nothing: nothing is fused)" if off else ")"))
        return lines, []
    compile_regions = getattr(model, "compile_regions", None)
    if compile_regions is None:
        raise ConfigError(f"--torch-compile: the {model_name} model has no regions to compile; pass --no-torch-compile")
    delays = may_delay_wgrad(cfg)
    regions = compile_regions(CompileOptions(c.torch_compile_backend, c.torch_compile_mode,
                                             traceable_linears=not delays, scope=c.torch_compile_scope))
    what = "the whole model as one region" if c.torch_compile_scope == "model" else f"{len(regions)} regions"
    lines.append(f"torch.compile (backend {c.torch_compile_backend}, mode {c.torch_compile_mode}) of {what}, "
                 "compiled at the first iteration; linear layers "
                 + ("outside them (weight gradients may be delayed)" if delays else "inside them"))
    return lines, regions
