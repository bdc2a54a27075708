"""Megatron-LM checkpoints: Megatron-Core's names and layouts against this GPT's (pure: no file access).

Megatron-LM writes two formats (``megatron_io.py`` reads and writes the files):

* ``torch_dist`` (Megatron-Core's ``dist_checkpointing`` over torch.distributed.checkpoint): every
  tensor under one global name, the Transformer layers stacked along a leading layer axis
  (``decoder.layers.self_attention.linear_qkv.weight`` is ``[layers, rows, hidden]``);
* the per-rank ``torch`` format: ``mp_rank_TT[_PPP]/model_optim_rng.pt`` holding each tensor-parallel
  rank's slice under per-layer names numbered from 0 on every pipeline stage
  (``decoder.layers.0.self_attention.linear_qkv.weight``).

Every tensor of this GPT is a box of one Megatron tensor (``Source``), so both directions are the
same table:

* QKV: Megatron-Core's ``linear_qkv`` rows are grouped per key/value group, ``[groups, (q × heads/groups,
  k, v), head_dim]`` — this model's layout: copied as it is (a tp slice is whole groups on both sides).
* SwiGLU: Megatron's one ``linear_fc1`` holds gate then up; ``torch_dist`` stores the global
  ``[gate (all ffn rows); up (all ffn rows)]`` (its ShardedTensorFactory splits every tp slice in two),
  per-rank files hold ``[gate slice; up slice]`` of each rank. Here they are ``mlp.fc1_gate`` and ``mlp.fc1_up``.
* Norms: Megatron-Core (both layer specs) names the norm before attention
  ``self_attention.linear_qkv.layer_norm_weight`` and the one before the MLP
  ``mlp.linear_fc1.layer_norm_weight`` (Transformer Engine fuses them into the linear that follows;
  the local spec maps its ``input_layernorm`` / ``pre_mlp_layernorm`` to those names when it saves
  ``torch_dist``; older checkpoints and local-spec ``torch`` files use the module names, also read).
* ``--apply-layernorm-1p``: Megatron stores the zero-centred gamma (gamma − 1); so does this model
  with the same flag: copied as it is.
* Vocabulary: Megatron pads the embedding and output layer to a multiple of
  ``make-vocab-size-divisible-by × tp`` and stores the padding; this model keeps the first
  ``vocab_size`` rows (the padding rows are zero-filled here on load, zero on export).
* Tied output layer: no ``output_layer.weight`` in ``torch_dist`` (the word embedding serves); a
  ``torch`` last pipeline stage holds a copy, which is not read.

* Mixture of experts (``torch_dist``): ``mlp.router.weight`` ``[layers, E, h]``, and the experts as
  SequentialMLP and TEGroupedMLP save them, ``mlp.experts.experts.linear_fc1.weight`` ``[layers, E, 2f, h]`` (each
  expert's gate rows, then up rows) and ``linear_fc2.weight`` ``[layers, E, h, f]``: this model's ``[E, ...]``
  ``mlp.experts.fc1_gate`` / ``fc1_up`` / ``fc2`` are boxes of them (``Source.expert``); ``--qk-layernorm``'s
  ``self_attention.q_layernorm`` / ``k_layernorm``. With dense and MoE layers mixed (``--moe-layer-freq`` not
  1) Megatron-Core keys every layer apart, ``decoder.layers.N.…`` without the layer axis (``per_layer_keys``).
  Shared experts are refused, as are MoE per-rank ``torch`` files.

The architecture comes from the checkpoint's saved ``args`` (``model_config_from_args``); what this
model does not build (multi-latent attention, ...) is refused with its name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..config.moe import is_moe_layer, moe_layer_pattern
from ..models.config import ModelConfig
from .format import CheckpointError

__all__ = ["TRACKER_FILE", "Source", "sources", "model_config_from_args", "args_from_model_config", "swiglu_rows",
           "padded_vocab", "megatron_shape", "refused_key", "LAYERS"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
LAYERS = "decoder.layers."

# an argument under its older and newer names (Megatron-LM moved several into TransformerConfig's)
_ALIASES = {"apply_layernorm_1p": ("apply_layernorm_1p", "layernorm_zero_centered_gamma"),
            "norm_epsilon": ("norm_epsilon", "layernorm_epsilon"),
            "num_experts": ("num_experts", "num_moe_experts"),
            "swiglu": ("swiglu", "gated_linear_unit")}


def _arg(args: Mapping[str, Any], name: str, default: Any = None) -> Any:
    for n in _ALIASES.get(name, (name,)):
        if args.get(n) is not None:
            return args[n]
    return default


# arguments that name a feature this model does not build: (argument, its neutral values, the feature)
_NOT_BUILT = (
    ("multi_latent_attention", (None, False), "multi-latent attention (--multi-latent-attention)"),
    ("moe_shared_expert_intermediate_size", (None, 0), "MoE shared experts (--moe-shared-expert-intermediate-size)"),
    ("moe_router_topk_scaling_factor", (None, 1, 1.0), "a scaled top-k (--moe-router-topk-scaling-factor)"),
    ("moe_router_num_groups", (None, 0, 1), "group-limited routing (--moe-router-num-groups)"),
    ("moe_router_enable_expert_bias", (None, False), "expert bias routing (--moe-router-enable-expert-bias)"),
    ("moe_input_jitter_eps", (None, 0, 0.0), "router input jitter (--moe-input-jitter-eps)"),
    ("moe_use_legacy_grouped_gemm", (None, False), "the legacy grouped-GEMM experts (--moe-use-legacy-grouped-gemm)"),
    ("add_bias_linear_experts", (None,), "expert biases"),
    ("qk_l2_norm", (None, False), "query/key L2 normalization (--qk-l2-norm)"),
    ("squared_relu", (None, False), "the squared-ReLU MLP (--squared-relu)"),
    ("quick_geglu", (None, False), "the quick-GeGLU MLP (--quick-geglu)"),
    ("mtp_num_layers", (None, 0), "multi-token prediction (--mtp-num-layers)"),
    ("rotary_interleaved", (None, False), "interleaved rotary embeddings (--rotary-interleaved)"),
    ("use_rope_scaling", (None, False), "Llama 3.1 rope scaling (--use-rope-scaling)"),
    ("rotary_seq_len_interpolation_factor", (None, 1), "rotary sequence-length interpolation"),
    ("no_rope_freq", (None,), "layers without rotary embeddings (--no-rope-freq)"),
    ("apply_residual_connection_post_layernorm", (None, False),
     "residual connections after the norm (--apply-residual-connection-post-layernorm)"),
    ("window_size", (None,), "sliding-window attention (--window-size)"),
    ("softmax_type", (None, "vanilla"), "an attention softmax other than vanilla (--softmax-type)"),
    ("attention_output_gate", (None, False), "gated attention output (--attention-output-gate)"),
    ("heterogeneous_layers_config_path", (None,), "heterogeneous layers"),
    ("hybrid_override_pattern", (None,), "hybrid (Mamba) models"),
    ("is_hybrid_model", (None, False), "hybrid (Mamba) models"),
    ("experimental_attention_variant", (None,), "an experimental attention variant"),
    ("use_legacy_models", (None, False), "Megatron-LM's legacy model (language_model.* names; convert it to "
                                         "Megatron-Core names with Megatron-LM's tools/checkpoint/convert.py)"),
)

# stacked-tensor name prefixes that belong to features not built here (a checkpoint without args says so too)
_REFUSED_KEYS = (("mlp.shared_experts", "MoE shared experts"), ("linear_q_down_proj", "multi-latent attention"),
                 ("linear_kv_down_proj", "multi-latent attention"), ("linear_q_up_proj", "multi-latent attention"),
                 ("linear_kv_up_proj", "multi-latent attention"), ("mlp.router.expert_bias", "expert bias routing"),
                 ("mtp.", "multi-token prediction"),
                 ("language_model.", "Megatron-LM's legacy model (language_model.* names; convert it to Megatron-Core "
                                     "names with Megatron-LM's tools/checkpoint/convert.py)"))


def refused_key(key: str) -> str | None:
    """The feature a Megatron tensor name belongs to when this model does not build it, else None."""
    for part, what in _REFUSED_KEYS:
        if part in key:
            return what
    return None


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of ``divisible_by × tp``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def model_config_from_args(args: Mapping[str, Any], vocab_size: int | None = None) -> tuple[ModelConfig, list[str]]:
    """The ``ModelConfig`` of a Megatron-LM run's saved arguments, and notes on what was inferred.

    ``vocab_size``: the real vocabulary (the tokenizer's), when the caller knows it. Otherwise it is
    NullTokenizer's ``--vocab-size`` + 1 (its eod), the run's ``--vocab-size`` with another tokenizer, or —
    when the arguments record none — the padded vocabulary itself (every stored row kept).
    """
    problems = []
    for name, neutral, what in _NOT_BUILT:
        value = _arg(args, name)
        if value not in neutral:
            problems.append(f"{what} = {value!r}" if not isinstance(value, bool) else what)
    kind = args.get("position_embedding_type") or "learned_absolute"
    if args.get("use_rotary_position_embeddings") and kind == "learned_absolute":   # the deprecated flag
        kind = "rope"
    elif args.get("add_position_embedding") is False and kind == "learned_absolute":
        kind = "none"
    if kind not in ("learned_absolute", "rope", "none"):
        problems.append(f"--position-embedding-type {kind}")
    norm = args.get("normalization") or "LayerNorm"
    if norm not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {norm}")
    if problems:
        raise CheckpointError("the checkpoint's model uses what megareshard does not build: " + "; ".join(problems))
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if not args.get(n)]
    if missing:
        raise CheckpointError(f"the checkpoint's arguments lack {', '.join(missing)}: the architecture cannot be "
                              "told")
    notes = []
    h, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    padded = args.get("padded_vocab_size")
    if vocab_size is None:
        given = args.get("vocab_size")
        if given and args.get("tokenizer_type") == "NullTokenizer":
            vocab_size = int(given) + 1
            notes.append(f"vocabulary {vocab_size}: NullTokenizer's --vocab-size {given} and its eod")
        elif given:
            vocab_size = int(given)
            if args.get("tokenizer_type"):   # none named (export-megatron of a mock-data run): the size is the model's
                notes.append(f"vocabulary {vocab_size}: the run's --vocab-size, but Megatron-LM sizes a "
                             f"{args['tokenizer_type']} vocabulary from the tokenizer itself: give --tokenizer-model "
                             "(or --vocab-size) if the tokenizer's size differs")
        elif padded:
            vocab_size = int(padded)
            notes.append(f"vocabulary {vocab_size}: the arguments record only the padded vocabulary, so every stored "
                         "row is kept (give --tokenizer-type with --tokenizer-model, or --vocab-size, to drop the "
                         "padding rows)")
        else:
            raise CheckpointError("the checkpoint's arguments record no vocabulary size (vocab_size, "
                                  "padded_vocab_size)")
    if padded and vocab_size > int(padded):
        raise CheckpointError(f"vocabulary {vocab_size} is larger than the checkpoint's padded vocabulary {padded}")
    swiglu = bool(_arg(args, "swiglu", False))
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    bias = args.get("add_bias_linear", True) is not False
    seq = int(args.get("seq_length") or args.get("max_position_embeddings") or 2048)
    cfg = ModelConfig(
        num_layers=int(args["num_layers"]), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=int(args["ffn_hidden_size"]) if args.get("ffn_hidden_size") else None,
        seq_length=seq, max_position_embeddings=int(args.get("max_position_embeddings") or seq),
        vocab_size=int(vocab_size), make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by") or 128),
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        init_method_std=float(args.get("init_method_std", 0.02)), normalization=norm,
        norm_epsilon=float(_arg(args, "norm_epsilon", 1e-5)), apply_layernorm_1p=bool(_arg(args, "apply_layernorm_1p",
                                                                                          False)),
        position_embedding_type=kind, rotary_base=float(args.get("rotary_base", 10000)),
        rotary_percent=float(args.get("rotary_percent", 1.0)), swiglu=swiglu,
        openai_gelu=bool(args.get("openai_gelu", False)) and not swiglu,
        group_query_attention=groups is not None and int(groups) != heads,
        num_query_groups=int(groups) if groups is not None and int(groups) != heads else 1,
        kv_channels=int(kv) if kv and int(kv) * heads != h else None,
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights", False)),
        disable_bias_linear=not bias, add_qkv_bias=bool(args.get("add_qkv_bias", False)) and not bias,
        qk_layernorm=bool(args.get("qk_layernorm", False)), **_moe_fields(args))
    return cfg, notes


# Megatron-LM's MoE arguments carried as they are (the same names here): (name, default)
_MOE_ARGS = (("moe_router_topk", 2), ("moe_router_score_function", "softmax"), ("moe_router_pre_softmax", False),
             ("moe_router_load_balancing_type", "aux_loss"), ("moe_aux_loss_coeff", 0.0), ("moe_z_loss_coeff", None),
             ("moe_expert_capacity_factor", None), ("moe_token_drop_policy", "probs"),
             ("moe_pad_expert_input_to_capacity", False), ("moe_token_dispatcher_type", "allgather"))


def _moe_fields(args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` MoE fields of Megatron-LM's saved arguments (none without ``num_experts``)."""
    experts = _arg(args, "num_experts")
    if not experts:
        return {}
    freq = args.get("moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):     # Megatron-LM parses its pattern into a list of 0/1
        freq = "[" + ",".join(str(int(v)) for v in freq) + "]"
    out = {"num_experts": int(experts), "moe_layer_freq": freq}
    if args.get("moe_ffn_hidden_size"):
        out["moe_ffn_hidden_size"] = int(args["moe_ffn_hidden_size"])
    for name, default in _MOE_ARGS:
        value = args.get(name)
        out[name] = default if value is None else value
    if isinstance(out["moe_router_load_balancing_type"], (list, tuple)):   # Megatron-LM allows one per loss
        kinds = list(out["moe_router_load_balancing_type"])
        if len(kinds) != 1:
            raise CheckpointError(f"--moe-router-load-balancing-type {kinds}: one kind only is built here")
        out["moe_router_load_balancing_type"] = kinds[0]
    if isinstance(out["moe_aux_loss_coeff"], (list, tuple)):
        out["moe_aux_loss_coeff"] = float(out["moe_aux_loss_coeff"][0])
    return out


def args_from_model_config(cfg: ModelConfig, tp: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Megatron-LM's arguments for ``cfg`` (what ``--use-checkpoint-args`` reads back), for a run at tensor
    parallelism ``tp`` (which sets the padded vocabulary)."""
    out = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_hidden_size,
           "num_attention_heads": cfg.num_attention_heads, "group_query_attention": cfg.group_query_attention,
           "num_query_groups": cfg.query_groups, "kv_channels": cfg.head_dim,
           "seq_length": cfg.seq_length, "max_position_embeddings": cfg.max_position_embeddings,
           "position_embedding_type": cfg.position_embedding_type,
           "add_position_embedding": cfg.position_embedding_type == "learned_absolute",
           "rotary_base": int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
           "rotary_percent": cfg.rotary_percent, "swiglu": cfg.swiglu, "openai_gelu": cfg.openai_gelu,
           "squared_relu": False, "normalization": cfg.normalization, "norm_epsilon": cfg.norm_epsilon,
           "apply_layernorm_1p": cfg.apply_layernorm_1p,
           "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
           "add_bias_linear": cfg.add_bias_linear, "add_qkv_bias": cfg.qkv_bias,
           "vocab_size": cfg.vocab_size, "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
           "padded_vocab_size": padded_vocab(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp),
           "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1,
           "hidden_dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
           "init_method_std": cfg.init_method_std, "num_experts": cfg.num_experts, "use_mcore_models": True,
           "ckpt_format": "torch_dist", "qk_layernorm": cfg.qk_layernorm}
    if cfg.num_experts is not None:
        if cfg.moe_shared_expert_intermediate_size is not None:
            raise CheckpointError("MoE shared experts are not written to Megatron-LM checkpoints yet")
        freq = cfg.moe_layer_freq if isinstance(cfg.moe_layer_freq, int) else moe_layer_pattern(cfg.moe_layer_freq,
                                                                                                 cfg.num_layers)
        out.update({"num_experts": cfg.num_experts, "moe_layer_freq": freq, "moe_ffn_hidden_size":
                    cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, "expert_model_parallel_size": 1,
                    **{name: getattr(cfg, name) for name, _ in _MOE_ARGS}})
    out.update(extra or {})
    return out


# ---- tensors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where one tensor of this GPT lives in a Megatron-LM checkpoint.

    ``key``: Megatron-Core's name (stacked over layers in ``torch_dist``; per-layer files put
    ``decoder.layers.<local index>.`` in front of what follows ``decoder.layers.``); ``alt``: older names
    of the same tensor. ``layer``: the index on the leading layer axis. ``part``: 0 (gate) or 1 (up) — a
    half of the rows of SwiGLU's fused ``linear_fc1``. ``vocab``: the rows are the padded vocabulary
    (this model's are its first ``vocab_size``). ``tp_dim``: the dim Megatron splits over tensor
    parallelism in per-rank files (None: every rank holds all of it). ``expert``: an MoE expert tensor, whose
    first dim here (the experts) is Megatron's axis after the layers'; its SwiGLU halves split the dim after it.
    """

    key: str
    alt: tuple[str, ...] = ()
    layer: int | None = None
    part: int | None = None
    vocab: bool = False
    tp_dim: int | None = None
    expert: bool = False

    @property
    def part_dim(self) -> int:
        """The dim of this model's tensor that SwiGLU's halves split in Megatron's."""
        return 1 if self.expert else 0

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.alt)


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """Every tensor of ``cfg``'s GPT (global names, unpadded) and where Megatron-Core keeps it."""
    layer_norm = cfg.normalization == "LayerNorm"
    bias = cfg.add_bias_linear
    out = {"embedding.word_embeddings.weight": Source("embedding.word_embeddings.weight", vocab=True, tp_dim=0)}
    if cfg.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = Source("embedding.position_embeddings.weight")
    D = LAYERS
    apart = per_layer_keys(cfg)
    for i in range(cfg.num_layers):
        o = f"layers.{i}."

        def put(ours: str, key: str, alt: tuple[str, ...] = (), **kw: Any) -> None:
            if apart:       # Megatron-Core's non-homogeneous layers: each its own tensors, no layer axis
                out[o + ours] = Source(f"{D}{i}.{key}", tuple(f"{D}{i}.{a}" for a in alt), **kw)
            else:
                out[o + ours] = Source(D + key, tuple(D + a for a in alt), layer=i, **kw)

        for ours, fused, module in (("input_layernorm", "self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                                    ("post_attention_layernorm", "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")):
            put(f"{ours}.weight", fused + "weight", (module + "weight",))
            if layer_norm:
                put(f"{ours}.bias", fused + "bias", (module + "bias",))
        put("attention.qkv.weight", "self_attention.linear_qkv.weight", tp_dim=0)
        if cfg.qkv_bias:
            put("attention.qkv.bias", "self_attention.linear_qkv.bias", tp_dim=0)
        if cfg.qk_layernorm:
            for qk in ("q_layernorm", "k_layernorm"):
                put(f"attention.{qk}.weight", f"self_attention.{qk}.weight")
                if layer_norm:
                    put(f"attention.{qk}.bias", f"self_attention.{qk}.bias")
        put("attention.proj.weight", "self_attention.linear_proj.weight", tp_dim=1)
        if bias:
            put("attention.proj.bias", "self_attention.linear_proj.bias")
        if is_moe_layer(cfg, i):   # Megatron-Core's SequentialMLP / TEGroupedMLP: [layers, experts, ...]
            put("mlp.router.weight", "mlp.router.weight")
            for ours, key, part in (("fc1_gate", "linear_fc1", 0), ("fc1_up", "linear_fc1", 1), ("fc2", "linear_fc2",
                                                                                                   None)):
                put(f"mlp.experts.{ours}.weight", f"mlp.experts.experts.{key}.weight", part=part, expert=True)
            continue
        for suffix in ("weight", "bias") if bias else ("weight",):
            if cfg.swiglu:
                put(f"mlp.fc1_gate.{suffix}", f"mlp.linear_fc1.{suffix}", part=0, tp_dim=0)
                put(f"mlp.fc1_up.{suffix}", f"mlp.linear_fc1.{suffix}", part=1, tp_dim=0)
            else:
                put(f"mlp.fc1.{suffix}", f"mlp.linear_fc1.{suffix}", tp_dim=0)
        put("mlp.fc2.weight", "mlp.linear_fc2.weight", tp_dim=1)
        if bias:
            put("mlp.fc2.bias", "mlp.linear_fc2.bias")
    out["final_layernorm.weight"] = Source("decoder.final_layernorm.weight")
    if layer_norm:
        out["final_layernorm.bias"] = Source("decoder.final_layernorm.bias")
    if not cfg.tied_embeddings:
        out["output_layer.weight"] = Source("output_layer.weight", vocab=True, tp_dim=0)
    return out


def per_layer_keys(cfg: ModelConfig) -> bool:
    """Whether Megatron-Core keys every layer apart (``decoder.layers.N.…``, no layer axis): an MoE model whose
    ``--moe-layer-freq`` is not 1 (its ``non_homogeneous_layers``)."""
    return cfg.num_experts is not None and cfg.moe_layer_freq != 1


def our_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The full (unpadded) shape of this GPT's tensor ``name``."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    E, fe = cfg.num_experts, cfg.moe_ffn_hidden_size or f
    if leaf.startswith("mlp.router") or leaf.startswith("mlp.experts"):
        return {"mlp.router.weight": (E, h), "mlp.experts.fc1_gate.weight": (E, fe, h),
                "mlp.experts.fc1_up.weight": (E, fe, h), "mlp.experts.fc2.weight": (E, h, fe)}[leaf]
    if leaf.startswith(("attention.q_layernorm", "attention.k_layernorm")):
        return (d,)
    table = {"embedding.word_embeddings.weight": (cfg.vocab_size, h), "output_layer.weight": (cfg.vocab_size, h),
             "embedding.position_embeddings.weight": (cfg.max_position_embeddings, h),
             "attention.qkv.weight": (qkv, h), "attention.qkv.bias": (qkv,),
             "attention.proj.weight": (h, cfg.num_attention_heads * d), "attention.proj.bias": (h,),
             "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc1_gate.weight": (f, h), "mlp.fc1_gate.bias": (f,),
             "mlp.fc1_up.weight": (f, h), "mlp.fc1_up.bias": (f,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    return table.get(leaf, (h,))      # the norms


def megatron_shape(name: str, src: Source, cfg: ModelConfig, padded: int) -> tuple[int, ...]:
    """The global shape of ``src``'s Megatron tensor (stacked over layers, fused SwiGLU rows, padded vocabulary)."""
    shape = list(our_shape(name, cfg))
    if src.part is not None:
        shape[src.part_dim] *= 2
    if src.vocab:
        shape[0] = padded
    return tuple(([cfg.num_layers] if src.layer is not None else []) + shape)


def megatron_box(src: Source, offset: tuple[int, ...], size: tuple[int, ...],
                 rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) in the Megatron tensor of the box (``offset``, ``size``) of this GPT's tensor; ``rows``:
    the rows of one SwiGLU half (ffn)."""
    offset, size = list(offset), list(size)
    if src.part is not None:
        offset[src.part_dim] += src.part * rows
    if src.layer is not None:
        return (src.layer, *offset), (1, *size)
    return tuple(offset), tuple(size)


# extra-state objects a Megatron-Core model of either layer spec asks for when it loads: one per layer and
# linear (the local spec's linears return None; Transformer Engine's hold fp8 metadata), replicated over tp
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                "self_attention.core_attention")


def to_megatron(model: Mapping[str, Any], cfg: ModelConfig, tp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, objects) of a ``torch_dist`` checkpoint that Megatron-Core loads into a model of ``cfg`` at
    tensor parallelism ``tp``: stacked layers, fused SwiGLU rows, the vocabulary padded for ``tp`` (padding rows
    zero), and an empty ``_extra_state`` per layer and linear (unique keys ``…/shard_<layer>_<layers>``, each the
    list ``[None]``: the value of a linear without fp8 state).
    ``model``: this GPT's full tensors under their global names."""
    table = sources(cfg)
    missing, extra = sorted(table.keys() - model.keys()), sorted(model.keys() - table.keys())
    if missing or extra:
        raise CheckpointError(f"the checkpoint does not match its configuration: missing {missing[:8]}, unexpected "
                              f"{extra[:8]}")
    padded = padded_vocab(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
    tensors: dict[str, Any] = {}
    for name, src in table.items():
        t = model[name]
        if tuple(t.shape) != our_shape(name, cfg):
            raise CheckpointError(f"{name} has shape {tuple(t.shape)}, its configuration needs {our_shape(name, cfg)}")
        if src.key not in tensors:
            tensors[src.key] = t.new_zeros(megatron_shape(name, src, cfg, padded))
        offset, size = megatron_box(src, (0,) * t.dim(), tuple(t.shape), swiglu_rows(name, cfg))
        box = tensors[src.key]
        for d, (o, n) in enumerate(zip(offset, size)):
            box = box.narrow(d, o, n)
        box.copy_(t.reshape(size))
    n, E, apart = cfg.num_layers, cfg.num_experts, per_layer_keys(cfg)
    moe = [i for i in range(n) if is_moe_layer(cfg, i)]
    for i in moe:   # the pre-MLP norm of an MoE layer: the local spec saves it under the fused name, Transformer
        # Engine's spec (no linear_fc1 to fuse it into) as pre_mlp_layernorm: both, for either
        pre = f"{LAYERS}{i}." if apart else LAYERS
        for part in ("weight", "bias"):
            if pre + f"mlp.linear_fc1.layer_norm_{part}" in tensors:
                tensors[pre + f"pre_mlp_layernorm.{part}"] = tensors[pre + f"mlp.linear_fc1.layer_norm_{part}"].clone()
    # Megatron-Core stores the objects of one unique key as the list of every saving rank's (here: one, None); the
    # experts' linears one per layer and expert (the router has none)
    objects: dict[str, Any] = {}
    for i in range(n):
        dense = [m for m in _EXTRA_STATE if not (i in moe and m.startswith("mlp."))]
        experts = [f"mlp.experts.experts.{m}" for m in ("linear_fc1", "linear_fc2")] if i in moe else []
        if apart:
            objects.update({f"{LAYERS}{i}.{m}._extra_state/shard_0_1": [None] for m in dense})
            objects.update({f"{LAYERS}{i}.{m}._extra_state/shard_{e}_{E}": [None] for m in experts for e in range(E)})
        else:
            objects.update({f"{LAYERS}{m}._extra_state/shard_{i}_{n}": [None] for m in dense})
            objects.update({f"{LAYERS}{m}._extra_state/shard_{i}.{e}_{n}.{E}": [None] for m in experts
                            for e in range(E)})
    return tensors, objects


def swiglu_rows(name: str, cfg: ModelConfig) -> int:
    """The rows of one SwiGLU half of ``name``'s Megatron tensor (the experts' width for expert tensors)."""
    if name.split(".", 2)[-1].startswith("mlp.experts."):
        return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    return cfg.ffn_hidden_size
