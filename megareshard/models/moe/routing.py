"""The router's arithmetic, Megatron-Core's (megatron/core/transformer/moe/moe_utils.py), as plain functions.

* `topk_routing`: scores and top-k (``topk_routing_with_score_function``): softmax after the top-k of the
  logits (default), softmax before it (``pre_softmax``), or sigmoid scores renormalised over the k;
* `apply_token_dropping`: expert capacity ``ceil(tokens·k / experts · factor)`` and the drop policy
  (``apply_router_token_dropping``);
* `switch_load_balancing_loss`, `z_loss`, `aux_loss_scores` (``switch_load_balancing_loss_func``,
  ``z_loss_func``, ``compute_routing_scores_for_aux_loss``);
* `AuxLossAutoScaler` (``MoEAuxLossAutoScaler``): the identity on an activation whose backward also sends a
  gradient of ``scale`` into an auxiliary loss, so the loss joins the gradient without joining the LM loss.

Where Megatron leaves a choice to ``torch.topk`` over ties, one is made here: among equal values the earlier
token wins. That is what the ``position`` policy is documented to do ("tokens at the end of the batch are
dropped"), which Megatron's ``topk`` over a 0/1 map does not guarantee (on CPU it keeps arbitrary ones).
"""
from __future__ import annotations

import math

import torch

__all__ = ["get_capacity", "topk_routing", "apply_token_dropping", "switch_load_balancing_loss", "z_loss",
           "aux_loss_scores", "AuxLossAutoScaler", "permute", "unpermute"]


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ``ceil(num_tokens / num_experts · capacity_factor)`` (Megatron's ``get_capacity``)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax",
                 pre_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(probs [T, E], routing_map [T, E] bool)``; probs are zero off the map."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top = torch.topk(scores, k=topk, dim=1)
        else:
            scores, top = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        scores, top = torch.topk(scores, k=topk, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"moe_router_score_function must be softmax or sigmoid, got {score_function!r}")
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return routing_probs, routing_map


def _first_k_per_column(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Mask [T, E] of the k largest ``keys`` of every column, ties to the earlier row."""
    order = torch.sort(keys, dim=0, descending=True, stable=True).indices[:k]
    return torch.zeros_like(keys, dtype=torch.bool).scatter(0, order, True)


def apply_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                         drop_policy: str = "probs", pad_to_capacity: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most its capacity of tokens: those of the highest probability (``probs``) or the
    earliest ones (``position``); with ``pad_to_capacity`` the map is the capacity mask itself (every expert
    gets exactly ``capacity`` rows, the padding ones with probability 0)."""
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        capacity_mask = _first_k_per_column(probs.detach(), capacity)
    elif drop_policy == "position":
        capacity_mask = _first_k_per_column(routing_map.to(torch.int8), capacity)
    else:
        raise ValueError(f"moe_token_drop_policy must be probs or position, got {drop_policy!r}")
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return probs * final_map, final_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing map and scores the load-balancing loss reads: softmax (or normalised sigmoid) over all
    experts and its own top-k, independent of pre-softmax and of token dropping."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True), scores


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """``coeff · E / (k · T²) · Σ_e (Σ_t scores[t, e]) · tokens_per_expert[e]`` — E·Σ f_e·P_e with f the share of
    routed slots and P the mean score, T the tokens of the whole group whose counts ``tokens_per_expert`` holds
    (``scores`` may be this rank's part of them: the partial losses then sum to the whole)."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff · mean_t logsumexp(logits[t])²``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


class AuxLossAutoScaler(torch.autograd.Function):
    """``output`` unchanged; backward returns its gradient and ``owner.aux_loss_scale`` for ``aux_loss``.

    ``owner`` is read at backward time (the trainer sets the scale its LM loss gets: loss scale over the number
    of micro-batches, Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``), as a layer's ``wgrad_store`` is."""

    @staticmethod
    def forward(fctx, output, aux_loss, owner):
        fctx.save_for_backward(aux_loss)
        fctx.owner = owner
        return output.view_as(output)

    @staticmethod
    def backward(fctx, grad_output):
        (aux_loss,) = fctx.saved_tensors
        scale = getattr(fctx.owner, "aux_loss_scale", 1.0)
        return grad_output, torch.ones_like(aux_loss) * scale, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows of ``tokens [T, h]`` grouped by expert (expert-major, tokens in order inside each):
    ``(permuted [N, h], permuted probs [N] or None, token index of each row [N])`` (Megatron's ``permute``)."""
    mask = routing_map.t().contiguous()                                   # [E, T]
    idx = torch.arange(routing_map.size(0), device=tokens.device).unsqueeze(0).expand_as(mask)
    sorted_indices = idx.masked_select(mask)
    permuted_probs = probs.t().contiguous().masked_select(mask) if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(rows: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum every row back into its token: ``[N, h]`` -> ``[T, h]`` (Megatron's ``unpermute`` without probs)."""
    out = torch.zeros((num_tokens, rows.size(-1)), dtype=rows.dtype, device=rows.device)
    return out.index_add(0, sorted_indices, rows)
