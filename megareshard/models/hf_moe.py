"""Hugging Face mixture-of-experts checkpoints: Mixtral (``MixtralForCausalLM``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``), the MoE half of ``models/hf.py`` (which maps their Llama-style attention, norms and
embeddings, and calls this module for the rest). Pure mappings, no file access and no ``transformers`` import.

Configuration (``config.json`` -> Megatron-LM's flags):

===============================================  ==============================================================
Mixtral / Qwen3-MoE                               here
===============================================  ==============================================================
``num_local_experts`` / ``num_experts``           ``--num-experts``
``num_experts_per_tok``                           ``--moe-router-topk``
Mixtral ``intermediate_size``                     each expert's width (``--ffn-hidden-size``; every layer is MoE)
Qwen3 ``moe_intermediate_size``                   ``--moe-ffn-hidden-size`` (``intermediate_size``: dense layers)
Qwen3 ``decoder_sparse_step``, ``mlp_only_layers``  ``--moe-layer-freq`` (layer i is MoE when i is not MLP-only
                                                  and (i + 1) mod step is 0: a 0/1 list unless every layer is)
router: softmax over all experts, top-k, the k    ``--moe-router-score-function softmax`` (default), top-k of the
renormalised (Mixtral; Qwen3 ``norm_topk_prob``)  logits then softmax over the k: the same numbers
Qwen3 ``norm_topk_prob`` false                    ``--moe-router-pre-softmax`` (softmax over all, top-k, no renorm)
``router_aux_loss_coef``                          ``--moe-aux-loss-coeff`` (``--moe-router-load-balancing-type
                                                  aux_loss``; see below)
Qwen3 ``q_norm`` / ``k_norm``                     ``--qk-layernorm`` (RMSNorm over each head's channels)
===============================================  ==============================================================

Both are dropless (no capacity factor) and have no shared experts, no z-loss and no expert biases.

The load-balancing loss is Megatron-LM's (``models/moe/routing.py``): per MoE layer
``E / (k·T²) · Σ_e (Σ_t p_te) · c_e`` (``p`` the softmax over all experts, ``c_e`` the top-k slots expert e got,
T the tokens), the layers' losses summed, times the coefficient. transformers' ``load_balancing_loss_func`` pools
the counts and probabilities of all layers first and does not divide by k:
``E · Σ_e (Σ_l c_le / (L·T)) · (Σ_l Σ_t p_lte / (L·T))``. They agree only for one MoE layer with k = 1; the
coefficient is carried over as it is (as Megatron-Bridge does), so the same coefficient weighs another function
(transformers adds it only with ``output_router_logits``). tests/checkpoint/test_moe_hf.py checks each formula
on the other side's router logits.

Weights: the router ``mlp.gate`` (Mixtral's saved ``block_sparse_moe.gate``) is ``mlp.router.weight``
``[E, h]``; the experts, saved per expert (Mixtral ``block_sparse_moe.experts.j.w1/w3/w2``, Qwen3
``mlp.experts.j.gate_proj/up_proj/down_proj``: what transformers 5 writes) or fused (``mlp.experts.gate_up_proj``
``[E, 2f, h]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, h, f]``: transformers 5's modules), are
``mlp.experts.fc1_gate`` / ``fc1_up`` ``[E, f, h]`` and ``fc2`` ``[E, h, f]`` here. Export writes per expert.
"""
from __future__ import annotations

import torch

from ..config.moe import moe_layer_pattern
from .config import ModelConfig

__all__ = ["HFInteropError", "MOE_ARCHITECTURES", "moe_fields_from_hf", "moe_hf_type", "moe_hf_fields",
           "router_name", "expert_shapes", "experts_from_hf", "experts_to_hf"]

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class HFInteropError(ValueError):
    """A Hugging Face checkpoint or a model configuration that the other side cannot express; says why."""


def _int(hf: dict, key: str, default=None, minimum: int = 1) -> int:
    v = hf.get(key, default)
    if v is None:
        raise HFInteropError(f"config.json has no {key} (a {hf.get('model_type')} config needs it)")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise HFInteropError(f"config.json: {key} {v!r} must be an integer of at least {minimum}")
    return v


def moe_fields_from_hf(hf: dict, kind: str) -> dict:
    """The ``ModelConfig`` fields of a Mixtral or Qwen3-MoE ``config.json`` beyond its Llama-style ones (a config
    this model cannot run exactly is one ``HFInteropError`` line naming the key)."""
    layers = _int(hf, "num_hidden_layers")
    if kind == "mixtral":
        experts = _int(hf, "num_local_experts", minimum=0)
        jitter = hf.get("router_jitter_noise") or 0.0
        if jitter:
            raise HFInteropError(f"router_jitter_noise {jitter}: transformers multiplies the MoE input by random "
                                 "noise in training, which is not built here (Megatron-LM's --moe-input-jitter-eps)")
        if hf.get("sliding_window") is not None:
            raise HFInteropError(f"sliding_window {hf['sliding_window']}: sliding-window attention is not built here")
        pattern = [1] * layers
    elif kind == "qwen3_moe":
        keys = [k for k in ("num_experts", "num_local_experts") if hf.get(k) is not None]
        if len(keys) == 2 and hf["num_experts"] != hf["num_local_experts"]:
            raise HFInteropError(f"config.json: num_experts {hf['num_experts']} and num_local_experts "
                                 f"{hf['num_local_experts']} disagree")
        experts = _int(hf, keys[0] if keys else "num_experts", minimum=0)
        if hf.get("use_sliding_window"):
            raise HFInteropError(f"use_sliding_window with sliding_window {hf.get('sliding_window')}: sliding-window "
                                 "attention is not built here")
        if hf.get("attention_bias"):
            raise HFInteropError("attention_bias true: Qwen3-MoE's q/k/v/o projections with biases and an MLP "
                                 "without cannot be expressed here (--add-qkv-bias covers q/k/v only)")
        step = _int(hf, "decoder_sparse_step", 1)
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise HFInteropError(f"config.json: mlp_only_layers {only!r} must be a list of layer indices")
        pattern = [int(i not in only and experts > 0 and (i + 1) % step == 0) for i in range(layers)]
    else:
        raise HFInteropError(f"model_type {kind!r} is not a mixture of experts read here")
    if experts < 1 or not any(pattern):
        raise HFInteropError(f"{kind} config with {experts} experts and no MoE layer: a dense model, not read as "
                             f"{MOE_ARCHITECTURES[kind]}")
    topk = _int(hf, "num_experts_per_tok", 2)
    if topk > experts:
        raise HFInteropError(f"config.json: num_experts_per_tok {topk} is more than the {experts} experts")
    coeff = hf.get("router_aux_loss_coef", 0.001)
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise HFInteropError(f"config.json: router_aux_loss_coef {coeff!r} must be a number >= 0")
    fields = {"num_experts": experts, "moe_router_topk": topk, "moe_aux_loss_coeff": float(coeff),
              "moe_router_load_balancing_type": "aux_loss",
              "moe_layer_freq": 1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"}
    if kind == "qwen3_moe":
        fields.update(moe_ffn_hidden_size=_int(hf, "moe_intermediate_size"), qk_layernorm=True,
                      moe_router_pre_softmax=not hf.get("norm_topk_prob", False))
    return fields


def moe_hf_type(cfg: ModelConfig) -> str:
    """``mixtral`` or ``qwen3_moe`` for a Llama-style ``cfg`` with experts (refused with why otherwise)."""
    what = []
    if cfg.moe_shared_expert_intermediate_size is not None:
        what.append("shared experts (--moe-shared-expert-intermediate-size)")
    if cfg.moe_router_score_function != "softmax":
        what.append(f"--moe-router-score-function {cfg.moe_router_score_function}")
    if cfg.moe_expert_capacity_factor is not None and cfg.moe_expert_capacity_factor >= 0:
        what.append(f"--moe-expert-capacity-factor {cfg.moe_expert_capacity_factor} (transformers' experts are "
                    "dropless)")
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        what.append("linear biases")
    if what:
        raise HFInteropError("Mixtral and Qwen3-MoE have no " + "; no ".join(what))
    if cfg.qk_layernorm:
        return "qwen3_moe"
    pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
    if not all(pattern) or cfg.moe_router_pre_softmax:
        raise HFInteropError(f"without --qk-layernorm an MoE model exports as Mixtral, which has experts in every "
                             f"layer (--moe-layer-freq {cfg.moe_layer_freq}) and renormalises the top-k "
                             f"probabilities (--moe-router-pre-softmax {cfg.moe_router_pre_softmax})")
    return "mixtral"


def moe_hf_fields(cfg: ModelConfig, kind: str) -> dict:
    """The ``config.json`` keys of ``kind`` beyond the Llama-style ones."""
    expert_width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    common = {"num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
              "output_router_logits": False, "sliding_window": None}
    if kind == "mixtral":
        return {**common, "num_local_experts": cfg.num_experts, "intermediate_size": expert_width,
                "router_jitter_noise": 0.0}
    pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
    return {**common, "num_experts": cfg.num_experts, "moe_intermediate_size": expert_width,
            "intermediate_size": cfg.ffn_hidden_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
            "norm_topk_prob": not cfg.moe_router_pre_softmax, "use_sliding_window": False, "attention_bias": False}


# ---- weights -----------------------------------------------------------------------------------------
def _block(kind: str, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe." if kind == "mixtral" else "mlp.")


_PER_EXPERT = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def router_name(kind: str, i: int) -> tuple[str, str]:
    """The router weight's Hugging Face name as saved, and as transformers 5's modules name it."""
    return _block(kind, i) + "gate.weight", f"model.layers.{i}.mlp.gate.weight"


def _fused_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"


def expert_shapes(cfg: ModelConfig, kind: str, i: int) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of layer ``i``'s router and experts, in both forms."""
    E, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    out = {name: (E, h) for name in router_name(kind, i)}
    gate, up, down = _PER_EXPERT[kind]
    for j in range(E):
        pre = f"{_block(kind, i)}experts.{j}."
        out.update({pre + gate + ".weight": (f, h), pre + up + ".weight": (f, h), pre + down + ".weight": (h, f)})
    gate_up, down_fused = _fused_names(i)
    out.update({gate_up: (E, 2 * f, h), down_fused: (E, h, f)})
    return out


def experts_from_hf(hf_sd: dict, take, cfg: ModelConfig, kind: str, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts under our names; ``take(name)`` reads (and marks used) one HF tensor."""
    o = f"layers.{i}.mlp."
    saved, fused_router = router_name(kind, i)
    out = {o + "router.weight": take(saved if saved in hf_sd or fused_router not in hf_sd else fused_router)}
    gate_up, down_fused = _fused_names(i)
    f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    if gate_up in hf_sd:
        both = take(gate_up)
        out.update({o + "experts.fc1_gate.weight": both[:, :f].contiguous(),
                    o + "experts.fc1_up.weight": both[:, f:].contiguous(),
                    o + "experts.fc2.weight": take(down_fused)})
        return out
    gate, up, down = _PER_EXPERT[kind]
    pre = f"{_block(kind, i)}experts."
    for ours, theirs in (("fc1_gate", gate), ("fc1_up", up), ("fc2", down)):
        out[f"{o}experts.{ours}.weight"] = torch.stack([take(f"{pre}{j}.{theirs}.weight")
                                                        for j in range(cfg.num_experts)])
    return out


def experts_to_hf(sd: dict, cfg: ModelConfig, kind: str, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts under Hugging Face's names, one tensor per expert (as transformers
    saves them)."""
    o = f"layers.{i}.mlp."
    out = {router_name(kind, i)[0]: sd[o + "router.weight"].detach().float().contiguous()}
    pre = f"{_block(kind, i)}experts."
    for ours, theirs in zip(("fc1_gate", "fc1_up", "fc2"), _PER_EXPERT[kind]):
        stacked = sd[f"{o}experts.{ours}.weight"].detach().float()
        for j in range(cfg.num_experts):
            out[f"{pre}{j}.{theirs}.weight"] = stacked[j].contiguous()
    return out
