"""The top-k router (Megatron-Core's ``TopKRouter``), the MoE configuration checks and the layer pattern.

The router's weight ``[E, h]`` is replicated over tp; under sequence parallelism each tp rank routes its own
sequence chunk, so the weight is marked ``sequence_parallel`` (its gradient is all-reduced over tp, as every
such weight's). Losses, Megatron's (router.py):

* load balancing (``aux_loss``): each tp rank's part, ``switch_load_balancing_loss`` of its own scores
  against the token counts all-reduced over tp and ``T = local tokens · tp``: the parts sum to the loss of
  the whole micro-batch; ``seq_aux_loss``: the same per sequence (the batch read as more experts), over b;
* z-loss: ``coeff / tp · mean(logsumexp²)`` of the local logits (the parts sum to the whole again).

Both only in training with gradients on, attached by `AuxLossAutoScaler` (the loss goes into the gradient,
not into the LM loss) and kept, detached and without the coefficient, in ``router.losses`` for logging:
``load_balancing_loss`` / ``seq_load_balancing_loss`` (this rank's part: sum over tp, as Megatron's tracker
reduces them over its tp group) and ``z_loss`` (this rank's mean; average over tp for the micro-batch's).
"""
from __future__ import annotations

import ast
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...config_fields import ConfigError
from ...parallel import ParallelContext
from ...tensor_parallel import set_tensor_model_parallel_attributes
from .routing import (AuxLossAutoScaler, apply_token_dropping, aux_loss_scores, switch_load_balancing_loss,
                      topk_routing, z_loss)

__all__ = ["TopKRouter", "check_moe_config", "moe_layer_pattern", "is_moe_layer", "capacity_factor"]


def _eval_pattern(node: ast.AST):
    """A list of ints from ``[1,0]``, ``[1]*3+[0]``, ``([1]*3+[0])*2`` — literals, + and * only."""
    if isinstance(node, ast.Expression):
        return _eval_pattern(node.body)
    if isinstance(node, ast.List):
        return [_eval_pattern(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _eval_pattern(node.left), _eval_pattern(node.right)
        return a + b if isinstance(node.op, ast.Add) else a * b
    raise ValueError(ast.dump(node))


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """Megatron's ``--moe-layer-freq``: an int N (layer i is MoE when i % N == 0) or a 0/1 list per layer."""
    if isinstance(freq, str):
        text = freq.strip()
        if text.lstrip("-").isdigit():
            freq = int(text)
        else:
            try:
                freq = _eval_pattern(ast.parse(text, mode="eval"))
            except (SyntaxError, ValueError):
                raise ConfigError(f"moe_layer_freq {text!r} is neither an integer nor a list of 0/1 such as "
                                  "[1,0,1,0] or ([1]*3+[0])*2") from None
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"moe_layer_freq must be at least 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"moe_layer_freq {pattern} must hold one 0 or 1 per layer ({num_layers} layers)")
    return pattern


def is_moe_layer(cfg, index: int) -> bool:
    """Whether global layer ``index`` is an MoE layer (False for every layer without ``num_experts``)."""
    return cfg.num_experts is not None and bool(moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)[index])


def capacity_factor(cfg) -> float | None:
    """The capacity factor in force: None (dropless) when unset or negative, as Megatron-Core reads it."""
    f = cfg.moe_expert_capacity_factor
    return None if f is None or f < 0 else f


def check_moe_config(cfg, tp: int = 1, ep: int = 1, etp: int | None = None, sequence_parallel: bool = False) -> None:
    """One line with the numbers for an MoE configuration that cannot be built (nothing without num_experts)."""
    if cfg.num_experts is None:
        return
    etp = tp if etp is None else etp
    E, k = cfg.num_experts, cfg.moe_router_topk
    f = cfg.moe_ffn_hidden_size if cfg.moe_ffn_hidden_size is not None else cfg.ffn_hidden_size
    if E < 1:
        raise ConfigError(f"num_experts must be at least 1, got {E}")
    if not 1 <= k <= E:
        raise ConfigError(f"moe_router_topk {k} must be between 1 and num_experts {E}")
    if E % ep:
        raise ConfigError(f"num_experts {E} is not divisible by expert-model-parallel-size {ep}")
    if f < 1 or f % etp:
        raise ConfigError(f"moe_ffn_hidden_size {f} is not a positive multiple of expert-tensor-parallel-size {etp}")
    if cfg.moe_shared_expert_intermediate_size is not None and cfg.moe_shared_expert_intermediate_size % tp:
        raise ConfigError(f"moe_shared_expert_intermediate_size {cfg.moe_shared_expert_intermediate_size} is not "
                          f"divisible by tensor-parallel size {tp}")
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"MoE layers with tensor-parallel size {tp} need sequence parallelism (Megatron-LM's rule: "
                          "each tp rank routes its own sequence chunk)")
    if cfg.add_bias_linear and etp > 1:
        raise ConfigError(f"expert biases with expert-tensor-parallel size {etp} are not supported: disable the "
                          "linear biases (disable_bias_linear) or use expert-tensor-parallel size 1")
    choices = {"moe_router_score_function": ("softmax", "sigmoid"), "moe_token_drop_policy": ("probs", "position"),
               "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "none"),
               "moe_token_dispatcher_type": ("allgather", "alltoall")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.moe_pad_expert_input_to_capacity and capacity_factor(cfg) is None:
        raise ConfigError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
    if cfg.moe_aux_loss_coeff < 0 or (cfg.moe_z_loss_coeff is not None and cfg.moe_z_loss_coeff < 0):
        raise ConfigError(f"moe_aux_loss_coeff {cfg.moe_aux_loss_coeff} and moe_z_loss_coeff {cfg.moe_z_loss_coeff} "
                          "must not be negative")
    moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)


class TopKRouter(nn.Module):
    """``x [T, h]`` -> ``(probs [T, E], routing_map [T, E])`` with the losses attached to ``probs``/the logits."""

    def __init__(self, cfg, ctx: ParallelContext, prefix: str, init: Callable, sequence_parallel: bool,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ctx, self.num_experts, self.topk = ctx, cfg.num_experts, cfg.moe_router_topk
        self.score_function, self.pre_softmax = cfg.moe_router_score_function, cfg.moe_router_pre_softmax
        self.load_balancing_type, self.aux_loss_coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        self.z_loss_coeff = cfg.moe_z_loss_coeff
        self.capacity_factor = capacity_factor(cfg)
        self.drop_policy, self.pad_to_capacity = cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity
        full = init(f"{prefix}.router.weight", cfg.init_method_std)((cfg.num_experts, cfg.hidden_size))
        self.weight = nn.Parameter(full.to(device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, False, -1, sequence_parallel=sequence_parallel)
        self.aux_loss_scale = 1.0   # the gradient each attached loss gets (the trainer's loss scale / micro-batches)
        self.losses: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, seq_length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        self.losses = {}
        training = self.training and torch.is_grad_enabled()
        tp = self.ctx.tp_size
        if training and self.z_loss_coeff:
            coeff = self.z_loss_coeff / tp
            z = z_loss(logits, coeff)
            logits = AuxLossAutoScaler.apply(logits, z, self)
            self.losses["z_loss"] = (z / coeff).detach()
        probs, routing_map = topk_routing(logits, self.topk, self.score_function, self.pre_softmax)
        if self.capacity_factor is not None:
            probs, routing_map = apply_token_dropping(probs, routing_map, self.topk, self.capacity_factor,
                                                      self.drop_policy, self.pad_to_capacity)
        if training and self.load_balancing_type != "none" and self.aux_loss_coeff > 0:
            aux_map, scores = aux_loss_scores(logits, self.topk, self.score_function)
            seq = self.load_balancing_type == "seq_aux_loss"
            if seq:   # every sequence of the batch as its own set of experts
                aux_map, scores = aux_map.reshape(seq_length, -1), scores.reshape(seq_length, -1)
            counts = aux_map.sum(dim=0)
            if tp > 1:
                dist.all_reduce(counts, group=self.ctx.tp_group)
            aux = switch_load_balancing_loss(scores, counts, aux_map.size(0) * tp, self.topk, self.num_experts,
                                             self.aux_loss_coeff)
            if seq:
                aux = aux / batch
            probs = AuxLossAutoScaler.apply(probs, aux, self)
            name = "seq_load_balancing_loss" if seq else "load_balancing_loss"
            self.losses[name] = (aux / self.aux_loss_coeff).detach()
        return probs, routing_map
