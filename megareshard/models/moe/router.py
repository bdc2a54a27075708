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
Under full recomputation the backward runs the layer again (``recompute.replaying()``): the replay's losses
are not recorded a second time, and its loss nodes are not back-propagated (a non-reentrant checkpoint takes
only the saved tensors from the replay), so each loss reaches the gradient once.

The router's weight gradient may be delayed into a pipeline's W (``wgrad_store``, as a linear layer's).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...config.moe import capacity_factor, check_moe_config, is_moe_layer, moe_layer_pattern  # noqa: F401 (re-exported)
from ...parallel import ParallelContext
from ...tensor_parallel import linear_with_wgrad_store, set_tensor_model_parallel_attributes
from ..recompute import replaying
from .routing import (AuxLossAutoScaler, apply_token_dropping, aux_loss_scores, switch_load_balancing_loss,
                      topk_routing, z_loss)

__all__ = ["TopKRouter", "check_moe_config", "moe_layer_pattern", "is_moe_layer", "capacity_factor"]


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
        self.wgrad_store = None     # delayed weight gradients (pipeline I/W): read at backward time
        self.aux_loss_scale = 1.0   # the gradient each attached loss gets (the trainer's loss scale / micro-batches)
        self.losses: dict[str, torch.Tensor] = {}
        # every training forward's losses since the trainer last cleared it (Megatron's aux-loss tracker): the
        # step's log reads their mean over the micro-batches
        self.tracked: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, seq_length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear_with_wgrad_store(x, self.weight, None, self)   # its weight gradient may wait for W
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
        if not replaying():   # full recomputation runs the layer again in backward: its losses are recorded once
            for name, value in self.losses.items():
                self.tracked.setdefault(name, []).append(value)
        return probs, routing_map
