"""Kernel choices of the Transformer layer: the element-wise chains regional compilation fuses, each with its
Megatron-LM switch, and the attention kernel (``--attention-backend``).

**Fusions.** With ``--torch-compile`` a whole layer is one compiled region, so its element-wise chains
(fc1's bias with GELU, SwiGLU's gating, the rotary embedding, the unfused attention's scale-mask-softmax,
the dropout and residual add after attention and MLP) are fused by the compiler with their neighbours.
Megatron-LM's switches keep their meaning, "use the fused kernel or not": a fusion switched off
(``--no-bias-gelu-fusion``, ``--no-bias-swiglu-fusion``, ``--no-rope-fusion``, ``--no-masked-softmax-fusion``,
``--no-bias-dropout-fusion``) runs its chain outside the compiled region, op by op, as a graph break
(`unfused`). Without ``--torch-compile`` nothing is fused and the switches change nothing (the start-up
line says so). A switch the model has no chain for (``--no-bias-swiglu-fusion`` without ``--swiglu``) is
refused (``config.check_fusion_flags``).

**Attention** (Megatron-LM's ``AttnBackend``): ``flash`` is PyTorch's FlashAttention kernel (CUDA:
FlashAttention-2; CPU: PyTorch's flash kernel for CPU, which has no dropout); ``fused`` is cuDNN's fused
attention (CUDA only); ``unfused`` and ``local`` write softmax(QKᵀ/√d)V out (two matrix products and a
masked softmax in fp32, the scores materialised); ``auto`` measures, on CUDA, FlashAttention, cuDNN and
the memory-efficient kernel at the model's shape at start-up and keeps the preferred one (that order) unless
another is faster by more than ``AUTO_MARGIN`` (`pick_kernel`: noise does not flip the choice); on CPU it is
PyTorch's own choice, unmeasured. A choice that cannot run the model's attention (a kernel the device lacks, a
head size or dropout it does not support) is refused at start-up with PyTorch's reason.

**The record** (``kernel_record.KernelBook``): what each layer shape runs is recorded with the run (the
trainer's fast path puts it in its checkpoints); a resumed run runs the recorded kernel instead of measuring
again (a new measurement could pick another kernel, with other dropout masks and summation orders). The
measurement is a seam (`AutoTiming`, `AUTO_TIMING`): tests inject timings and the device types measured on.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..compile_boundary import outside_compiled_regions
from ..config_fields import ConfigError
from ..kernel_record import KernelBook, active_book
from .components import apply_rotary, gelu, swiglu

__all__ = ["masked_softmax", "residual_add", "attention", "choose_attention_kernel", "configure_attention", "KERNELS",
           "AUTO_CANDIDATES", "AUTO_MARGIN", "AutoTiming", "AUTO_TIMING", "pick_kernel", "measure_candidates",
           "choice_key",
           "gelu_unfused", "swiglu_unfused", "apply_rotary_unfused", "masked_softmax_unfused", "residual_add_unfused"]

_this = sys.modules[__name__]  # marked functions are looked up at call time (compile_boundary)

#: the kernels a layer runs: "sdpa" is PyTorch's own choice among its kernels
SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
KERNELS = ("sdpa", "unfused", *SDPA_KERNELS)
#: what auto measures on CUDA, in order of preference (PyTorch's): a later one is chosen only when it is faster
#: than every one before it by more than ``AUTO_MARGIN`` (`pick_kernel`)
AUTO_CANDIDATES = ("flash", "cudnn", "efficient")
#: how much faster a less preferred kernel must measure to be chosen (a fraction of the preferred one's time)
AUTO_MARGIN = 0.05
#: what auto runs on CUDA under --deterministic-mode, unmeasured: memory-efficient attention, whose backward
#: PyTorch computes deterministically under torch.use_deterministic_algorithms(True, warn_only=False)
DETERMINISTIC_KERNEL = "efficient"


def masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of ``scores · scale`` over the last dim, in fp32, cast back to the scores' dtype."""
    s = scores.size(-1)
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax((scores.float() * scale).masked_fill(future, float("-inf")), dim=-1).to(scores.dtype)


def residual_add(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + out`` (the add that follows attention and the MLP)."""
    return residual + out


# The chains a fusion switch governs, op by op: outside any compiled region once a model is compiled
# (compile_boundary). Callers reach them as ``fusion.<name>`` at call time.
@outside_compiled_regions
def gelu_unfused(x: torch.Tensor, openai: bool = False) -> torch.Tensor:
    return gelu(x, openai=openai)


@outside_compiled_regions
def swiglu_unfused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu(gate, up)


@outside_compiled_regions
def apply_rotary_unfused(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rotary(t, cos, sin)


@outside_compiled_regions
def masked_softmax_unfused(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return masked_softmax(scores, scale)


@outside_compiled_regions
def residual_add_unfused(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual_add(out, residual)


# ---- attention ---------------------------------------------------------------------------------------
def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                      fused_softmax: bool = True) -> torch.Tensor:
    """softmax(QKᵀ/√d)V with the scores written out; grouped key/value heads repeated as SDPA's ``enable_gqa``.
    ``fused_softmax`` False: the scale-mask-softmax runs op by op (``--no-masked-softmax-fusion``)."""
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores, scale = torch.matmul(q, k.transpose(-2, -1)), 1.0 / math.sqrt(q.size(-1))
    probs = masked_softmax(scores, scale) if fused_softmax else _this.masked_softmax_unfused(scores, scale)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: str, dropout_p: float = 0.0,
              fused_softmax: bool = True) -> torch.Tensor:
    """Causal attention ``[b, heads, s, d]`` (k, v may hold fewer, grouped heads) with one of `KERNELS`."""
    if kernel == "unfused":
        return unfused_attention(q, k, v, dropout_p, fused_softmax)
    gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)
    with sdpa_kernel([SDPA_KERNELS[kernel]]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)


def _probe_inputs(shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device):
    b, heads, groups, s, d = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, heads, s, d, dtype=dtype, device=device, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, dtype=dtype, device=device, generator=gen, requires_grad=True)
            for _ in range(2))
    return q, k, v


def _run(kernel: str, q, k, v, dropout_p: float) -> None:
    attention(q, k, v, kernel=kernel, dropout_p=dropout_p).sum().backward()


def _failure(kernel: str, q, k, v, dropout_p: float) -> str | None:
    """Why ``kernel`` cannot run (forward and backward) on these inputs, or None."""
    try:
        _run(kernel, q, k, v, dropout_p)
    except RuntimeError as e:  # PyTorch: "No available kernel", "No viable backend ..." (warnings say why)
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def _disagreement(kernel: str, q, k, v) -> str | None:
    """Why ``kernel`` is wrong here: its output or query gradient (one sample, no dropout) more than 5 % of the
    largest value away from softmax(QKᵀ/√d)V written out in fp32 (bf16 rounding is under 1 %), or not finite;
    None when it agrees."""
    gen = torch.Generator(device=q.device).manual_seed(1)
    grad_out = torch.randn(q[:1].shape, device=q.device, generator=gen)
    got = []
    for kern, dtype in ((kernel, q.dtype), ("unfused", torch.float32)):
        a, b, c = (t[:1].detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        out = attention(a, b, c, kernel=kern)
        out.backward(grad_out.to(out.dtype))
        got.append((out.detach().float(), a.grad.float()))
    (out, dq), (ref, ref_dq) = got
    for what, x, r in (("output", out, ref), ("query gradient", dq, ref_dq)):
        err = (x - r).abs().max().item()
        if not torch.isfinite(x).all() or err > 0.05 * r.abs().max().item():
            return f"its {what} differs from softmax(QKᵀ/√d)V in fp32 by {err:.3g} (largest value {r.abs().max():.3g})"
    return None


def _seconds(kernel: str, q, k, v, dropout_p: float, repeats: int = 5) -> float:
    """Median wall time of one forward and backward (synchronised), after two warm-up runs."""
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize(q.device)
        t0 = time.perf_counter()
        _run(kernel, q, k, v, dropout_p)
        torch.cuda.synchronize(q.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_candidates(shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device,
                       dropout_p: float) -> dict[str, float]:
    """Seconds of one forward and backward of each of `AUTO_CANDIDATES` that runs this shape and agrees with
    softmax(QKᵀ/√d)V (the others left out): what auto measures on CUDA."""
    q, k, v = _probe_inputs(shape, dtype, device)
    usable = [c for c in AUTO_CANDIDATES if _failure(c, q, k, v, dropout_p) is None
              and _disagreement(c, q, k, v) is None]
    return {c: _seconds(c, q, k, v, dropout_p) for c in usable}


@dataclass(frozen=True)
class AutoTiming:
    """How ``--attention-backend auto`` measures, a seam tests replace (``fusion.AUTO_TIMING``, looked up at each
    choice): ``measure(shape, dtype, device, dropout_p)`` gives the seconds of each usable candidate;
    ``device_types`` are the devices it measures on (elsewhere auto is PyTorch's choice, unmeasured);
    ``margin`` as `AUTO_MARGIN`."""

    measure: Callable[[tuple, torch.dtype, torch.device, float], dict[str, float]] = measure_candidates
    device_types: tuple[str, ...] = ("cuda",)
    margin: float = AUTO_MARGIN


AUTO_TIMING = AutoTiming()


def _percent(margin: float) -> str:
    return f"{100 * margin:g} %"


def pick_kernel(seconds: dict[str, float], margin: float = AUTO_MARGIN) -> tuple[str, str]:
    """(kernel, why) from measured ``seconds`` per kernel: the most preferred (`AUTO_CANDIDATES` order) whose time
    is within ``margin`` of the fastest's (``t <= (1 + margin) · fastest``), so a less preferred kernel is chosen
    only when it beats every preferred one by more than the margin, and timings that move by less than the margin
    keep the choice. ``why`` is the table and the reason, e.g. "auto: flash 0.39 ms, efficient 0.38 ms: flash kept
    (efficient within the 5 % margin; flash preferred)"."""
    if not seconds:
        raise ValueError("pick_kernel: no kernel was measured")
    order = [c for c in AUTO_CANDIDATES if c in seconds] + sorted(c for c in seconds if c not in AUTO_CANDIDATES)
    fastest = min(order, key=lambda c: seconds[c])   # the first of equal times
    chosen = next(c for c in order if seconds[c] <= (1.0 + margin) * seconds[fastest])
    table = ", ".join(f"{c} {1e3 * seconds[c]:.2f} ms" for c in order)
    before = order[:order.index(chosen)]
    if len(order) == 1:
        reason = f"{chosen}, the only kernel that runs this shape"
    elif chosen != fastest:
        reason = f"{chosen} kept ({fastest} within the {_percent(margin)} margin; {chosen} preferred)"
    elif before:
        reason = (f"{chosen} chosen (faster than {' and '.join(before)} by more than the {_percent(margin)} "
                  "margin)")
    else:
        reason = f"{chosen} fastest"
    return chosen, f"auto: {table}: {reason}"


_CHOICES: dict[tuple, tuple[str, str]] = {}


def choose_attention_kernel(backend: str, *, shape: tuple[int, int, int, int, int], dtype: torch.dtype,
                            device: torch.device, dropout_p: float, timing: AutoTiming | None = None,
                            deterministic: bool = False) -> tuple[str, str]:
    """(kernel, why) for ``--attention-backend backend`` at ``shape`` = (batch, query heads, key/value heads,
    sequence, head size) on ``device``; raises ``ConfigError`` when the chosen kernel cannot run it.
    ``timing``: how auto measures (default `AUTO_TIMING`); ``deterministic`` (--deterministic-mode): auto
    measures nothing and runs `DETERMINISTIC_KERNEL` (or the unfused attention where it cannot run the shape).
    Chosen once per process, shape and timing."""
    timing = AUTO_TIMING if timing is None else timing
    key = (backend, shape, dtype, str(device), dropout_p, timing, deterministic)
    if key not in _CHOICES:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # probes draw dropout masks
            _CHOICES[key] = _choose(backend, shape, dtype, device, dropout_p, timing, deterministic)
    return _CHOICES[key]


def _choose(backend: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device,
            dropout_p: float, timing: AutoTiming, deterministic: bool) -> tuple[str, str]:
    if backend in ("unfused", "local"):
        choice = ("unfused", f"--attention-backend {backend}: softmax(QKᵀ/√d)V written out")
    elif backend in ("flash", "fused"):
        kernel = "flash" if backend == "flash" else "cudnn"
        if kernel == "cudnn" and device.type != "cuda":
            raise ConfigError(f"--attention-backend fused is cuDNN's fused attention, which needs CUDA (device "
                              f"{device}); use flash, unfused or auto")
        q, k, v = _probe_inputs(shape, dtype, device)
        why = _failure(kernel, q, k, v, dropout_p)
        if why is None and device.type == "cuda":
            why = _disagreement(kernel, q, k, v)
        if why is not None:
            raise ConfigError(f"--attention-backend {backend} cannot run this model's attention on {device} "
                              f"(batch, heads, key/value heads, sequence, head size {shape}, {dtype}, dropout "
                              f"{dropout_p}): {why}")
        choice = (kernel, f"--attention-backend {backend}")
    elif deterministic and device.type == "cuda":
        q, k, v = _probe_inputs(shape, dtype, device)
        why = _failure(DETERMINISTIC_KERNEL, q, k, v, dropout_p) or _disagreement(DETERMINISTIC_KERNEL, q, k, v)
        choice = ((DETERMINISTIC_KERNEL, "--attention-backend auto under --deterministic-mode: memory-efficient "
                   "attention (its deterministic backward), not measured") if why is None else
                  ("unfused", f"--attention-backend auto under --deterministic-mode: softmax(QKᵀ/√d)V written out "
                   f"(memory-efficient attention cannot run this shape: {why})"))
    elif deterministic:   # CPU: PyTorch's CPU kernels are deterministic
        choice = ("sdpa", f"--attention-backend auto under --deterministic-mode on {device.type}: PyTorch's "
                          "choice, not measured")
    elif device.type not in timing.device_types:
        choice = ("sdpa", f"--attention-backend auto on {device.type}: PyTorch's choice, not measured")
    else:
        timed = timing.measure(shape, dtype, device, dropout_p)
        if timed:
            kernel, why = pick_kernel(timed, timing.margin)
            choice = (kernel, f"--attention-backend {why}")
        else:
            choice = ("sdpa", "--attention-backend auto: no fused kernel runs this shape; PyTorch's choice")
    return choice


# ---- the record: a run's kernel choices, kept with its checkpoints and reused on resume -----------------
def choice_key(backend: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device,
               dropout_p: float) -> str:
    """What a kernel was chosen for, as a record's key (JSON): the backend asked, the shape, dtype, device type
    and dropout."""
    b, heads, groups, s, d = shape
    return (f"{backend} batch {b} heads {heads} groups {groups} seq {s} head {d} {str(dtype).replace('torch.', '')} "
            f"{device.type} dropout {dropout_p:g}")


def _choose_through_book(book: KernelBook, backend: str, *, shape: tuple[int, int, int, int, int],
                         dtype: torch.dtype, device: torch.device, dropout_p: float) -> tuple[str, str]:
    """(kernel, the phrase that says what runs and why) for one layer shape through ``book``: the kernel the
    checkpoint recorded for its `choice_key` (auto only; probed on CUDA: another card may lack it), else
    `choose_attention_kernel`; noted in ``book.chosen``."""
    key = choice_key(backend, shape, dtype, device, dropout_p)
    old = book.recorded_entry(key) if backend == "auto" else None
    if old is not None and old["kernel"] not in KERNELS:
        old = None
    if old is not None and not book.rechoose and not book.deterministic:
        kernel, why = old["kernel"], str(old.get("why", ""))
        failed = None
        if device.type == "cuda" and kernel in SDPA_KERNELS:
            failed = _failure(kernel, *_probe_inputs(shape, dtype, device), dropout_p)
        if failed is None:
            book.chosen[key] = {"kernel": kernel, "why": why}
            return kernel, f"{kernel}, as recorded in {book.source} ({why}; --attention-backend-rechoose chooses again)"
    kernel, why = choose_attention_kernel(backend, shape=shape, dtype=dtype, device=device, dropout_p=dropout_p,
                                          deterministic=book.deterministic)
    book.chosen[key] = {"kernel": kernel, "why": why}
    phrase = f"{kernel} ({why}"
    if old is not None and book.rechoose:
        phrase += f"; chosen again: --attention-backend-rechoose, {book.source} recorded {old['kernel']}"
    elif old is not None and book.deterministic:
        if old["kernel"] != kernel:
            phrase += f"; {book.source} recorded {old['kernel']}, --deterministic-mode runs {kernel}"
    elif old is not None:
        phrase += f"; {book.source} recorded {old['kernel']}, which this device cannot run"
    elif backend == "auto" and book.recorded is not None and not book.deterministic:
        phrase += f"; {book.source} recorded no choice for this shape"
    return kernel, phrase + ")"


def configure_attention(layers, micro_batch_size: int, seq_length: int, device: torch.device) -> list[str]:
    """Set each Transformer layer's attention kernel for ``--attention-backend`` (`choose_attention_kernel` at
    the layer's shape: ``micro_batch_size`` samples of ``seq_length`` tokens, its heads on this rank, its
    weights' dtype; through the active `kernel_book`, which records it and reuses a checkpoint's record);
    returns one line per distinct choice."""
    lines: list[str] = []
    for layer in layers:
        att = layer.attention
        shape = (micro_batch_size, att.heads_local, att.groups_local, seq_length, att.head_dim)
        book = active_book() or KernelBook()
        att.kernel, line = _choose_through_book(book, att.backend, shape=shape, dtype=att.qkv.weight.dtype,
                                                device=torch.device(device), dropout_p=att.dropout)
        if line not in lines:
            lines.append(line)
    return lines
