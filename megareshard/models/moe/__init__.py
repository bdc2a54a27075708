"""Mixture of experts (Megatron-Core's semantics): a top-k router with load-balancing and z losses, dropless or
capacity-limited routing, experts split over expert-parallel (ep) and expert-tensor-parallel (etp) ranks, and
all-to-all or all-gather token dispatch. `MoELayer` replaces a GPT layer's dense MLP where
``ModelConfig.num_experts`` is set (``moe_layer_freq`` chooses the layers)."""
from .experts import GroupedExperts
from .layer import (MoELayer, SharedExpertMLP, expert_parameters, gather_full_expert_tensor, moe_losses,
                    reduce_expert_grads, route_dropless)
from ...config.moe import grouped_gemm_refusal
from .router import TopKRouter, capacity_factor, check_moe_config, is_moe_layer, moe_layer_pattern
from .routing import (AuxLossAutoScaler, apply_token_dropping, get_capacity, switch_load_balancing_loss,
                      topk_routing, z_loss)

__all__ = ["MoELayer", "SharedExpertMLP", "GroupedExperts", "TopKRouter", "AuxLossAutoScaler", "check_moe_config",
           "is_moe_layer", "moe_layer_pattern", "capacity_factor", "grouped_gemm_refusal", "expert_parameters",
           "reduce_expert_grads", "gather_full_expert_tensor", "moe_losses", "route_dropless", "apply_token_dropping",
           "get_capacity", "switch_load_balancing_loss", "topk_routing", "z_loss"]
