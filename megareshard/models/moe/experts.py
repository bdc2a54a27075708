"""A rank's experts: ``E / ep`` MLPs of width ``moe_ffn_hidden_size / etp``, weights stacked per expert.

Weights (``[experts, out, in]``, each expert a Linear's ``[out, in]``): ``fc1`` (GELU) or ``fc1_gate`` and
``fc1_up`` (SwiGLU, as the dense MLP), each ``[E/ep, F/etp, h]`` (column-parallel over etp), and ``fc2``
``[E/ep, h, F/etp]`` (row-parallel over etp: with etp > 1 the output is a partial sum the dispatcher
reduce-scatters). Every full ``[E, out, in]`` tensor is drawn from the global name's generator and sliced
(experts over ep, width over etp), so any layout holds the same model.

Megatron's order of operations (experts.py): the routing probability multiplies the activation,
``fc2(act(fc1(x)) · p) + b2 · p``, which is ``p · expert(x)``. The rows arrive grouped by local expert
(``counts[e]`` rows each). With ``moe_grouped_gemm`` all experts run as one grouped GEMM per matrix
(``torch._grouped_mm``: on CUDA one kernel; on CPU torch runs it as its own loop of the same GEMMs, so the CPU
checks the grouped path's arithmetic bit for bit); otherwise one GEMM per expert (a loop over experts, never over
tokens). Either
way a matrix is one ``expert_gemm.expert_linear``, whose weight gradient a pipeline schedule with delayed weight
gradients runs in W, as the dense linear layers' (the module's ``wgrad_store``).

Parameter attributes: ``expert_parallel`` (True), ``expert_partition_dim`` (0: experts over ep),
``expert_tp_partition_dim`` (the dim split over etp, or -1), ``expert_width_dim`` (the dim an etp > 1 splits, or
-1, whatever this layout's etp: live weight transfer describes other layouts with it) and ``expert_box`` (global
shape and offset of this shard in the full ``[E, ...]`` tensor: what checkpoints and ZeRO's optimizer shards
record). When etp equals tp and ep is 1 they are also
marked like any tensor-parallel weight (``tensor_model_parallel``, ``partition_dim``): the trainer, the
gradient reduction over dp and checkpoints then treat them as the dense weights they equal in layout.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...config.moe import expert_width
from ...parallel import ParallelContext
from ...tensor_parallel import set_tensor_model_parallel_attributes
from ..components import gelu, swiglu
from .expert_gemm import expert_linear

__all__ = ["GroupedExperts"]

InitFn = Callable[[str, float], Callable[[tuple[int, ...]], torch.Tensor]]


class _ExpertLinear(nn.Module):
    """``weight [E_local, out, in]`` and an optional ``bias [E_local, out]`` (named like a Linear's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None


class GroupedExperts(nn.Module):
    """This rank's ``num_experts / ep`` experts (global indices ``local_expert_indices``)."""

    def __init__(self, cfg, ctx: ParallelContext, prefix: str, init: InitFn, out_std: float, *,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        E, h = cfg.num_experts, cfg.hidden_size
        f = expert_width(cfg)
        ep, etp = ctx.ep_size, ctx.etp_size
        self.num_local_experts = E // ep
        first = ctx.ep_rank() * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.swiglu, self.openai_gelu = cfg.swiglu, cfg.openai_gelu
        self.grouped_gemm = cfg.moe_grouped_gemm
        f_local, t = f // etp, ctx.etp_rank()
        bias = cfg.add_bias_linear
        dense_like = ep == 1 and etp == ctx.tp_size   # laid out exactly as a tensor-parallel weight

        def make(name: str, shape: tuple[int, int, int], tp_dim: int, std: float) -> _ExpertLinear:
            full = init(f"{prefix}.{name}.weight", std)((E, *shape))[first:first + self.num_local_experts]
            w = full.narrow(tp_dim, t * (shape[tp_dim - 1] // etp), shape[tp_dim - 1] // etp)
            b = None
            if bias:
                out = shape[0]
                b = torch.zeros(self.num_local_experts, out // etp if tp_dim == 1 else out)
            lin = _ExpertLinear(w.to(device=device, dtype=dtype, copy=True).contiguous(),
                                None if b is None else b.to(device=device, dtype=dtype))
            for p, dim in ((lin.weight, tp_dim), (lin.bias, 1 if tp_dim == 1 else -1)):
                if p is None:
                    continue
                split = dim >= 0 and etp > 1
                set_tensor_model_parallel_attributes(p, dense_like and split, dim if dense_like and split else -1)
                p.expert_parallel, p.expert_partition_dim = True, 0
                p.expert_tp_partition_dim = dim if split else -1
                p.expert_width_dim = dim   # the dim etp splits when > 1, whatever this layout's etp (weight transfer)
                gshape, goff = list(p.shape), [0] * p.dim()
                gshape[0], goff[0] = E, first
                if split:
                    goff[dim], gshape[dim] = t * gshape[dim], gshape[dim] * etp
                p.expert_box = (tuple(gshape), tuple(goff))   # this shard's box in the full [E, ...] tensor
            return lin

        if self.swiglu:
            self.fc1_gate = make("experts.fc1_gate", (f, h), 1, cfg.init_method_std)
            self.fc1_up = make("experts.fc1_up", (f, h), 1, cfg.init_method_std)
        else:
            self.fc1 = make("experts.fc1", (f, h), 1, cfg.init_method_std)
        self.fc2 = make("experts.fc2", (h, f), 2, out_std)
        self.f_local = f_local
        # delayed weight gradients (pipeline I/W): the store the expert GEMMs queue their weight gradients in,
        # read at backward time (None: computed at once)
        self.wgrad_store = None

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        """``x [N, h]`` grouped by local expert (``counts``), ``probs [N]`` -> ``[N, h]`` (a partial sum over etp).

        Each matrix is one `expert_linear` over all local experts (a GEMM per expert, or one grouped GEMM),
        whose weight gradient a pipeline's W may run later (``wgrad_store``, set by the stage module's
        ``set_wgrad_store``); the element-wise steps between them act on each row alone."""
        def lin(m: _ExpertLinear, v: torch.Tensor, bias: bool = True) -> torch.Tensor:
            return expert_linear(v, m.weight, m.bias if bias else None, counts, self, self.grouped_gemm)

        inner = self._act(lin(self.fc1_gate, x), lin(self.fc1_up, x)) if self.swiglu else self._act(lin(self.fc1, x), None)
        p = probs.unsqueeze(-1)
        out = lin(self.fc2, (inner * p).to(x.dtype), bias=False)
        if self.fc2.bias is not None:   # the bias scaled by the row's probability (Megatron's order), by autograd
            rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                           torch.tensor(counts, device=x.device), output_size=x.size(0))
            out = out + self.fc2.bias[rows] * p
        return out

    def _act(self, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return swiglu(a, b) if self.swiglu else gelu(a, openai=self.openai_gelu)
