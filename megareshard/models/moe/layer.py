"""The MoE layer (Megatron-Core's ``MoELayer``): router -> dispatch -> experts -> combine (+ shared experts).

Input and output ``[s(/tp), b, h]`` like the dense MLP it replaces: under sequence parallelism each tp rank
routes its own sequence chunk. tp > 1 without it trains nothing (refused at start-up, and by a training forward,
as Megatron-Core's MoE layer refuses it), but runs for generation: every tp rank then routes the same full
sequence, the dispatcher treats each rank's copy as its own tokens (the etp ranks all-gather and reduce-scatter
them as always), so each rank gets its own copy's output — redundant work, the same numbers. The shared experts
(``moe_shared_expert_intermediate_size``) are a dense tensor-parallel MLP of that width run on every token,
added to the routed output.

Helpers for the trainer: `expert_parameters` (the parameters reduced over the expert-data-parallel group
only), `reduce_expert_grads` (that reduction: summed over edp and divided by dp — Megatron's scaling, as the
loss is a mean over the dp replicas' micro-batches whose tokens the ep group already brought together),
`gather_full_expert_tensor` (the full ``[E, out, in]`` of a sharded expert weight, for tests and exports) and
`moe_losses` (the per-layer router losses of the last forward, reduced over tp for logging).

For generation, `route_dropless` turns a model's routers dropless: the capacity factor is a training device
(Megatron-Core's ``InferenceTopKRouter`` skips token dropping, the auxiliary losses and the z-loss), and with a
key/value cache a capacity would also depend on how many tokens one forward holds (a prompt's prefill vs one new
token), so the cached decode would not equal a full-sequence forward.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...compile_boundary import outside_compiled_regions
from ...config.fields import ConfigError
from ...config.moe import expert_width, grouped_gemm_refusal
from ...parallel import ParallelContext
from ...tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..components import gelu, swiglu
from .comm import group_size
from .dispatch import make_dispatcher
from .experts import GroupedExperts
from .router import TopKRouter, check_moe_config

__all__ = ["MoELayer", "SharedExpertMLP", "expert_parameters", "reduce_expert_grads", "gather_full_expert_tensor",
           "moe_losses", "route_dropless"]


class SharedExpertMLP(nn.Module):
    """A dense tensor-parallel MLP of width ``moe_shared_expert_intermediate_size`` (GELU or SwiGLU)."""

    def __init__(self, cfg, ctx: ParallelContext, prefix: str, init: Callable, out_std: float,
                 sequence_parallel: bool, device, dtype) -> None:
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.add_bias_linear
        self.swiglu, self.openai_gelu = cfg.swiglu, cfg.openai_gelu

        def column(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, f, ctx, bias=bias, sequence_parallel=sequence_parallel, device=device,
                                        dtype=dtype, init_method=init(f"{prefix}.{name}.weight", cfg.init_method_std))
        if self.swiglu:
            self.fc1_gate, self.fc1_up = column("fc1_gate"), column("fc1_up")
        else:
            self.fc1 = column("fc1")
        self.fc2 = RowParallelLinear(f, h, ctx, bias=bias, sequence_parallel=sequence_parallel, device=device,
                                     dtype=dtype, init_method=init(f"{prefix}.fc2.weight", out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            x = self.fc1_gate.map_input(x)
            inner = swiglu(self.fc1_gate(x, input_mapped=True), self.fc1_up(x, input_mapped=True))
        else:
            inner = gelu(self.fc1(x), openai=self.openai_gelu)
        return self.fc2(inner)


_GROUPED_MM_RUNS: dict[tuple[str, torch.dtype], str | None] = {}


def _grouped_mm_missing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this torch cannot run ``torch._grouped_mm`` on ``device``'s type in ``dtype`` (None when it can): the op
    is missing, or has no kernel there (torch 2.8 on CPU; CUDA's needs bf16 on the GPUs of its release notes).
    Probed once per device type and dtype on two tiny aligned groups."""
    if not hasattr(torch, "_grouped_mm"):
        return f"--moe-grouped-gemm needs torch._grouped_mm, which torch {torch.__version__} does not have"
    key = (device.type, dtype)
    if key not in _GROUPED_MM_RUNS:
        try:
            torch._grouped_mm(torch.zeros(2, 8, device=device, dtype=dtype),
                              torch.zeros(2, 8, 8, device=device, dtype=dtype),
                              offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
            _GROUPED_MM_RUNS[key] = None
        except (NotImplementedError, RuntimeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            _GROUPED_MM_RUNS[key] = (f"--moe-grouped-gemm: torch {torch.__version__} cannot run torch._grouped_mm on "
                                     f"{device.type} in {str(dtype).replace('torch.', '')} ({first}); leave it off "
                                     "for one GEMM per expert")
    return _GROUPED_MM_RUNS[key]


class MoELayer(nn.Module):
    """Routed experts (and optional shared experts) in place of the dense MLP of one Transformer layer.

    ``init(name, std)`` returns the initialiser of the full tensor of global parameter ``name`` (the GPT's
    seeded, layout-independent one); ``out_std`` is the residual projections' scaled std."""

    def __init__(self, cfg, ctx: ParallelContext, prefix: str, init: Callable, out_std: float, *,
                 sequence_parallel: bool = False, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        sp = sequence_parallel and ctx.tp_size > 1
        check_moe_config(cfg, ctx.tp_size, ctx.ep_size, ctx.etp_size, sp, training=False)
        self.tp_without_sp = ctx.tp_size if ctx.tp_size > 1 and not sp else 0   # inference only (forward)
        if cfg.moe_grouped_gemm:
            why = grouped_gemm_refusal(cfg.hidden_size, expert_width(cfg) // ctx.etp_size,
                                       2 if dtype in (torch.bfloat16, torch.float16) else 4)
            if why is None:
                why = _grouped_mm_missing(torch.device(device) if device is not None else torch.device("cpu"), dtype)
            if why is not None:
                raise ConfigError(why)
        self.router = TopKRouter(cfg, ctx, prefix, init, sp, device, dtype)
        self.experts = GroupedExperts(cfg, ctx, prefix, init, out_std, device=device, dtype=dtype)
        self.dispatcher = make_dispatcher(cfg.moe_token_dispatcher_type, ctx, cfg.num_experts,
                                          self.experts.local_expert_indices)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(cfg, ctx, f"{prefix}.shared_experts", init, out_std, sp,
                                                  device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.tp_without_sp:
            raise ConfigError(f"MoE layers with tensor-parallel size {self.tp_without_sp} need sequence parallelism "
                              "in training (Megatron-LM's rule: each tp rank routes its own sequence chunk); "
                              "without it the model runs for generation only (eval mode)")
        out = _routed(self, x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


@outside_compiled_regions
def _routed(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Router, dispatch, experts, combine: eager inside a compiled layer (collectives with data-dependent sizes)."""
    s, b, h = x.shape
    flat = x.reshape(-1, h)
    probs, routing_map = layer.router(flat, s, b)
    rows, counts, row_probs = layer.dispatcher.dispatch(flat, probs, routing_map)
    out = layer.dispatcher.combine(layer.experts(rows, counts, row_probs))
    return out.view(s, b, h)


# ---- for the trainer, checkpoints and tests --------------------------------------------------------------
def expert_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every expert weight and bias, in ``named_parameters`` order."""
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)]


def reduce_expert_grads(model: nn.Module, ctx: ParallelContext, *, scale: float | None = None) -> int:
    """Sum the expert gradients over the expert-data-parallel group only (one flat all-reduce) and multiply by
    ``scale`` (default ``1 / dp``: Megatron's expert gradient scaling). Returns the elements reduced.
    Every rank of the edp group calls it with the same model; parameters without a gradient get zeros."""
    params = [p for _, p in expert_parameters(model) if p.requires_grad]
    if not params:
        return 0
    scale = 1.0 / ctx.dp_size if scale is None else scale
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group_size(ctx.edp_group) > 1:
        dist.all_reduce(flat, group=ctx.edp_group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for p in params:
        piece = flat[offset:offset + p.numel()].view_as(p)
        p.grad = piece.clone() if p.grad is None else p.grad.copy_(piece)
        offset += p.numel()
    return offset


def _gather_dim(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    front = t.movedim(dim, 0).contiguous()
    parts = [torch.empty_like(front) for _ in range(n)]
    dist.all_gather(parts, front, group=group)
    return torch.cat(parts).movedim(0, dim)


def gather_full_expert_tensor(t: torch.Tensor, param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The full tensor (all experts, full width) of ``t``, a shard shaped like expert ``param`` (its data or
    grad). Collective over the etp and ep groups."""
    t = t.detach()
    dim = getattr(param, "expert_tp_partition_dim", -1)
    if dim >= 0:
        t = _gather_dim(t, ctx.etp_group, dim)
    return _gather_dim(t, ctx.ep_group, 0).clone()


def route_dropless(model: nn.Module) -> int:
    """Every MoE router of ``model`` routes without a capacity from now on (generation: module docstring); returns
    how many routers had a capacity factor (0 for a dense model or a dropless one)."""
    n = 0
    for m in model.modules():
        if isinstance(m, TopKRouter):
            n += m.capacity_factor is not None
            m.capacity_factor, m.pad_to_capacity = None, False
    return n


def moe_losses(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Per MoE layer (in module order) the router losses of the last forward, for logging: load balancing
    summed over tp (each rank holds its part), z-loss averaged over tp. Collective over tp."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    names: list[str] = []
    for r in routers:
        names += [n for n in r.losses if n not in names]
    out = {}
    for name in names:
        vals = torch.stack([r.losses[name].float() if name in r.losses else torch.zeros(()) for r in routers])
        if ctx.tp_size > 1:
            dist.all_reduce(vals, group=ctx.tp_group)
            if name == "z_loss":
                vals = vals / ctx.tp_size
        out[name] = vals
    return out

