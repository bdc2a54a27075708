"""Mixture-of-experts configuration rules (Megatron-LM's): the layer pattern of ``--moe-layer-freq``, the capacity
factor in force, and `check_moe_config` (one line with the numbers for a configuration that cannot be built).
Pure Python at the configuration floor: the validation of the command line (``config_checks``) and the MoE layers
(``models/moe``, which re-export these) both use them."""
from __future__ import annotations

import ast

from .fields import ConfigError

__all__ = ["moe_layer_pattern", "is_moe_layer", "capacity_factor", "expert_width", "check_moe_config",
           "grouped_gemm_refusal"]


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


def expert_width(cfg) -> int:
    """An expert's hidden width: ``moe_ffn_hidden_size``, or the dense ``ffn_hidden_size`` when unset (Megatron's)."""
    return cfg.moe_ffn_hidden_size if cfg.moe_ffn_hidden_size is not None else cfg.ffn_hidden_size


def check_moe_config(cfg, tp: int = 1, ep: int = 1, etp: int | None = None, sequence_parallel: bool = False, *,
                     training: bool = True) -> None:
    """One line with the numbers for an MoE configuration that cannot be built (nothing without num_experts).
    ``training`` False: a model that may only ever run for inference (generation at tp > 1 needs no sequence
    parallelism: Megatron-Core refuses tp > 1 without it during training only, in the MoE layer's forward)."""
    if cfg.num_experts is None:
        return
    etp = tp if etp is None else etp
    E, k = cfg.num_experts, cfg.moe_router_topk
    f = expert_width(cfg)
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
    if tp > 1 and not sequence_parallel and training:
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


def grouped_gemm_refusal(hidden: int, ffn_local: int, elem_bytes: int) -> str | None:
    """Why ``moe_grouped_gemm`` cannot run experts of ``hidden`` × ``ffn_local`` (a rank's width) with operands of
    ``elem_bytes`` bytes (None when it can): ``torch._grouped_mm`` needs every matrix row a multiple of 16 bytes.
    (A torch without the op is refused where the layer is built: this floor imports no torch.)"""
    per = 16 // elem_bytes
    bad = [f"{name} {n}" for name, n in (("--hidden-size", hidden), ("a rank's expert width", ffn_local)) if n % per]
    if bad:
        return (f"--moe-grouped-gemm needs rows of a multiple of 16 bytes (torch._grouped_mm): {' and '.join(bad)} "
                f"not a multiple of {per} at {elem_bytes}-byte precision; leave it off for one GEMM per expert")
    return None
