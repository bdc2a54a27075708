"""Hugging Face checkpoints in and out: Llama (``LlamaForCausalLM``), GPT-2 (``GPT2LMHeadModel``), and the
mixtures of experts Mixtral (``MixtralForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``), whose attention,
norms and embeddings are Llama's (Qwen3's ``q_norm`` / ``k_norm`` are ``--qk-layernorm``) and whose routers and
experts ``models/hf_moe.py`` maps.

Pure mappings, no file access and no ``transformers`` import: between a Hugging Face
``config.json`` (a dict) and a ``ModelConfig``, and between a Hugging Face state dict and this
GPT's full, unpadded tensors under their global names (what checkpoints store). The
checkpoint tool (``tools/checkpoint_util.py import-hf`` / ``export-hf``) reads and writes the
files. Anything a side cannot express is refused with the reason, never dropped:

* QKV: Llama's separate ``q_proj``/``k_proj``/``v_proj`` and GPT-2's ``c_attn`` (all q, then
  all k, then all v) become the fused per-group layout ``[groups, (q × heads/groups, k, v), d]``.
* GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed to ``[out, in]``.
* Rotary embeddings: Hugging Face's Llama rotates halves (``rotate_half``), as this model
  does, so q and k weights need no permutation.
* ``--apply-layernorm-1p``: norm weights are stored zero-centred here; the export adds the one.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config.moe import is_moe_layer
from ..config_fields import ConfigError
from . import hf_moe
from .config import KERNEL_FIELDS, ModelConfig, check_model_shape
from .hf_moe import HFInteropError

__all__ = ["HFInteropError", "model_config_from_hf", "hf_config_from_model_config", "state_dict_from_hf",
           "state_dict_to_hf", "megatron_flags", "hf_model_type"]

# buffers some versions save that carry no weights
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
# Llama's attention, norms and embeddings (and its dense MLP)
_LLAMA_LIKE = ("llama", *hf_moe.MOE_ARCHITECTURES)


# ---- configurations ---------------------------------------------------------------------------------
def model_config_from_hf(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (``model_type`` llama, gpt2, mixtral or qwen3_moe).
    Every size is checked first (a positive integer; heads dividing the hidden size, under the config's own key
    names): a bad config is one ``HFInteropError`` line, never a reshape error in the weights."""
    kind = hf.get("model_type") if isinstance(hf, dict) else None
    if kind not in ("llama", "gpt2", *hf_moe.MOE_ARCHITECTURES):
        raise HFInteropError(f"model_type {kind!r} is not supported: only 'llama' (LlamaForCausalLM), 'gpt2' "
                             "(GPT2LMHeadModel), 'mixtral' (MixtralForCausalLM) and 'qwen3_moe' (Qwen3MoeForCausalLM)")
    _check_sizes(hf, kind)
    try:
        if kind in hf_moe.MOE_ARCHITECTURES:
            moe = hf_moe.moe_fields_from_hf(hf, kind)      # its refusals first: they name the MoE keys
            cfg = dataclasses.replace(_llama_config(hf), **moe)
        else:
            cfg = _llama_config(hf) if kind == "llama" else _gpt2_config(hf)
    except HFInteropError:
        raise
    except (TypeError, ValueError) as e:  # a float field that is not a number, ...
        raise HFInteropError(f"config.json: {e}") from None
    try:
        check_model_shape(cfg, 1, as_flags=False)
    except ConfigError as e:
        raise HFInteropError(f"config.json gives a model that cannot be built: {e}") from None
    return cfg


# (key, required): the sizes of each config.json kind
_SIZES = {"gpt2": (("n_layer", True), ("n_embd", True), ("n_head", True), ("n_positions", True), ("vocab_size", True),
                   ("n_inner", False)),
          "llama": (("num_hidden_layers", True), ("hidden_size", True), ("num_attention_heads", True),
                    ("intermediate_size", True), ("vocab_size", True), ("max_position_embeddings", False),
                    ("num_key_value_heads", False), ("head_dim", False))}
_NUMBERS = {"gpt2": ("resid_pdrop", "attn_pdrop", "initializer_range", "layer_norm_epsilon"),
            "llama": ("rope_theta", "partial_rotary_factor", "attention_dropout", "initializer_range", "rms_norm_eps")}


def _check_sizes(hf: dict, kind: str) -> None:
    table = "gpt2" if kind == "gpt2" else "llama"      # Mixtral and Qwen3-MoE size their attention as Llama
    for key, required in _SIZES[table]:
        v = hf.get(key)
        if v is None:
            if required:
                raise HFInteropError(f"config.json has no {key} (a {kind} config needs it)")
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise HFInteropError(f"config.json: {key} {v!r} must be a positive integer")
    for key in _NUMBERS[table]:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise HFInteropError(f"config.json: {key} {v!r} must be a number")
    h, heads = (hf["n_embd"], hf["n_head"]) if kind == "gpt2" else (hf["hidden_size"], hf["num_attention_heads"])
    hk, nk = ("n_embd", "n_head") if kind == "gpt2" else ("hidden_size", "num_attention_heads")
    if h % heads and not (kind != "gpt2" and hf.get("head_dim")):
        raise HFInteropError(f"config.json: {hk} {h} is not divisible by {nk} {heads}: each of the {heads} attention "
                             f"heads takes {hk} / {nk} channels")
    kv = hf.get("num_key_value_heads") if kind != "gpt2" else None
    if kv and heads % kv:
        raise HFInteropError(f"config.json: num_attention_heads {heads} is not divisible by num_key_value_heads {kv}: "
                             "every key/value head serves the same number of query heads")


def _llama_config(hf: dict) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise HFInteropError(f"Llama hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise HFInteropError(f"rope scaling {hf.get('rope_scaling') or rope} is not supported: plain rotary "
                             "embeddings only (rope_type 'default')")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    percent = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFInteropError(f"attention_bias {attention_bias} with mlp_bias {mlp_bias}: biases are either on every "
                             "linear layer (o_proj included) or on none here (--disable-bias-linear)")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or h // heads
    mpe = hf.get("max_position_embeddings", 2048)
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
                       ffn_hidden_size=hf["intermediate_size"], seq_length=mpe, max_position_embeddings=mpe,
                       vocab_size=hf["vocab_size"], hidden_dropout=0.0,
                       attention_dropout=float(hf.get("attention_dropout", 0.0)),
                       init_method_std=float(hf.get("initializer_range", 0.02)), normalization="RMSNorm",
                       norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), position_embedding_type="rope",
                       rotary_base=theta, rotary_percent=percent, swiglu=True,
                       group_query_attention=kv_heads != heads, num_query_groups=kv_heads if kv_heads != heads else 1,
                       kv_channels=None if head_dim * heads == h else head_dim,
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                       disable_bias_linear=not attention_bias)


def _gpt2_config(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise HFInteropError(f"GPT-2 activation_function {act!r}: only gelu_new (tanh, --openai-gelu) and gelu")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if hf.get(key, ok) != ok:
            raise HFInteropError(f"GPT-2 {key}={hf[key]} is not supported (needs {ok})")
    h = hf["n_embd"]
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, seq_length=hf["n_positions"],
                       max_position_embeddings=hf["n_positions"], vocab_size=hf["vocab_size"],
                       hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
                       attention_dropout=float(hf.get("attn_pdrop", 0.1)),
                       init_method_std=float(hf.get("initializer_range", 0.02)),
                       norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), openai_gelu=act != "gelu",
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))


def hf_model_type(cfg: ModelConfig) -> str:
    """``llama``, ``gpt2``, ``mixtral`` or ``qwen3_moe``: the Hugging Face architecture that expresses ``cfg``
    (refused otherwise, with why)."""
    llama = cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope" and cfg.swiglu
    gpt2 = cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute" and not cfg.swiglu
    if cfg.num_experts is not None and not llama:
        raise HFInteropError(f"an MoE model exports as Mixtral or Qwen3-MoE, which need RMSNorm, rope and SwiGLU: "
                             f"this one has --normalization {cfg.normalization}, --position-embedding-type "
                             f"{cfg.position_embedding_type}, --swiglu {cfg.swiglu}")
    if cfg.qk_layernorm and cfg.num_experts is None:
        raise HFInteropError("--qk-layernorm without experts (a dense Qwen3) is not exported: Llama and GPT-2 have "
                             "no query/key norms")
    if llama:
        if cfg.rotary_percent != 1.0:
            raise HFInteropError(f"--rotary-percent {cfg.rotary_percent}: LlamaForCausalLM rotates whole heads")
        if cfg.disable_bias_linear and cfg.add_qkv_bias:
            raise HFInteropError("--add-qkv-bias with --disable-bias-linear: Llama's attention_bias also puts a bias "
                                 "on o_proj")
        return hf_moe.moe_hf_type(cfg) if cfg.num_experts is not None else "llama"
    if gpt2:
        if cfg.query_groups != cfg.num_attention_heads or cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise HFInteropError("GPT-2 has neither grouped-query attention nor --kv-channels")
        if cfg.disable_bias_linear:
            raise HFInteropError("GPT-2 has biases on every linear layer: --disable-bias-linear cannot be exported")
        return "gpt2"
    raise HFInteropError(f"--normalization {cfg.normalization}, --position-embedding-type "
                         f"{cfg.position_embedding_type}, --swiglu {cfg.swiglu} is neither Llama (RMSNorm, rope, "
                         "SwiGLU) nor GPT-2 (LayerNorm, learned_absolute, GELU)")


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (Llama or GPT-2, see ``hf_model_type``)."""
    kind = hf_model_type(cfg)
    if kind in hf_moe.MOE_ARCHITECTURES:
        out = {k: v for k, v in _llama_hf_config(cfg).items() if k not in ("mlp_bias", "attention_bias")}
        out.update(architectures=[hf_moe.MOE_ARCHITECTURES[kind]], model_type=kind, **hf_moe.moe_hf_fields(cfg, kind))
        return out
    return _llama_hf_config(cfg) if kind == "llama" else _gpt2_hf_config(cfg)


def _llama_hf_config(cfg: ModelConfig) -> dict:
    bias = cfg.add_bias_linear
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rotary_base,
            "rope_parameters": {"rope_theta": cfg.rotary_base, "rope_type": "default"},
            "attention_bias": bias, "mlp_bias": bias, "attention_dropout": cfg.attention_dropout,
            "tie_word_embeddings": cfg.tied_embeddings, "vocab_size": cfg.vocab_size,
            "initializer_range": cfg.init_method_std, "dtype": "float32"}


def _gpt2_hf_config(cfg: ModelConfig) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.hidden_size,
            "n_head": cfg.num_attention_heads, "n_layer": cfg.num_layers, "n_positions": cfg.max_position_embeddings,
            "n_inner": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
            "activation_function": "gelu_new" if cfg.openai_gelu else "gelu", "layer_norm_epsilon": cfg.norm_epsilon,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std, "tie_word_embeddings": cfg.tied_embeddings,
            "scale_attn_weights": True, "dtype": "float32"}


def megatron_flags(cfg: ModelConfig) -> list[str]:
    """The command-line flags that give a run this architecture (what to pass with ``--load``)."""
    default = ModelConfig()
    flags = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("seq_length", "make_vocab_size_divisible_by") or f.name in KERNEL_FIELDS:
            continue   # the run's choice (seq_length up to max_position_embeddings with learned positions; kernels)
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        elif value is not None and (value != getattr(default, f.name) or f.name in (
                "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "vocab_size")):  # the shape is always spelled out: defaults may change, a checkpoint's shape not
            flags += [flag, str(value)]
    return flags


# ---- weights ------------------------------------------------------------------------------------------
def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Separate q ``[heads·d, …]``, k and v ``[groups·d, …]`` -> the fused per-group layout."""
    g, d = cfg.query_groups, cfg.head_dim
    per = cfg.num_attention_heads // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = cfg.query_groups, cfg.head_dim
    per = cfg.num_attention_heads // g
    rest = qkv.shape[1:]
    t = qkv.reshape(g, per + 2, d, *rest)
    return (t[:, :per].reshape(-1, *rest), t[:, per].reshape(-1, *rest), t[:, per + 1].reshape(-1, *rest))


def _gpt2_qkv_to_ours(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """c_attn's output order (all q, all k, all v; head-major) -> per head ``(q, k, v)``."""
    heads, d = cfg.num_attention_heads, cfg.head_dim
    rest = t.shape[1:]
    return t.reshape(3, heads, d, *rest).transpose(0, 1).reshape(-1, *rest)


def _ours_qkv_to_gpt2(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    heads, d = cfg.num_attention_heads, cfg.head_dim
    rest = t.shape[1:]
    return t.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(-1, *rest)


def _name_pairs(cfg: ModelConfig, kind: str) -> list[tuple[str, str, str]]:
    """(our name, Hugging Face name, how) for every tensor but the fused QKV; how: 'copy' or 't' (transpose)."""
    bias = cfg.add_bias_linear
    pairs = []
    if kind in _LLAMA_LIKE:      # an MoE layer's router and experts: hf_moe (not in these pairs)
        pairs.append(("embedding.word_embeddings.weight", "model.embed_tokens.weight", "copy"))
        for i in range(cfg.num_layers):
            o, t = f"layers.{i}.", f"model.layers.{i}."
            pairs += [(o + "input_layernorm.weight", t + "input_layernorm.weight", "copy"),
                      (o + "attention.proj.weight", t + "self_attn.o_proj.weight", "copy"),
                      (o + "post_attention_layernorm.weight", t + "post_attention_layernorm.weight", "copy")]
            if cfg.qk_layernorm:
                pairs += [(o + "attention.q_layernorm.weight", t + "self_attn.q_norm.weight", "copy"),
                          (o + "attention.k_layernorm.weight", t + "self_attn.k_norm.weight", "copy")]
            if bias:
                pairs.append((o + "attention.proj.bias", t + "self_attn.o_proj.bias", "copy"))
            if is_moe_layer(cfg, i):
                continue
            pairs += [(o + "mlp.fc1_gate.weight", t + "mlp.gate_proj.weight", "copy"),
                      (o + "mlp.fc1_up.weight", t + "mlp.up_proj.weight", "copy"),
                      (o + "mlp.fc2.weight", t + "mlp.down_proj.weight", "copy")]
            if bias:
                pairs += [(o + "mlp.fc1_gate.bias", t + "mlp.gate_proj.bias", "copy"),
                          (o + "mlp.fc1_up.bias", t + "mlp.up_proj.bias", "copy"),
                          (o + "mlp.fc2.bias", t + "mlp.down_proj.bias", "copy")]
        pairs.append(("final_layernorm.weight", "model.norm.weight", "copy"))
    else:
        pairs += [("embedding.word_embeddings.weight", "transformer.wte.weight", "copy"),
                  ("embedding.position_embeddings.weight", "transformer.wpe.weight", "copy")]
        for i in range(cfg.num_layers):
            o, t = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
                pairs += [(o + ours + ".weight", t + theirs + ".weight", "copy"),
                          (o + ours + ".bias", t + theirs + ".bias", "copy")]
            for ours, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                pairs += [(o + ours + ".weight", t + theirs + ".weight", "t"),
                          (o + ours + ".bias", t + theirs + ".bias", "copy")]
        pairs += [("final_layernorm.weight", "transformer.ln_f.weight", "copy"),
                  ("final_layernorm.bias", "transformer.ln_f.bias", "copy")]
    if not cfg.tied_embeddings:
        pairs.append(("output_layer.weight", "lm_head.weight", "copy"))
    return pairs


def _hf_shapes(cfg: ModelConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor ``cfg`` has (its name -> shape), to check a state dict before
    mapping it."""
    h, v, f, d = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size, cfg.head_dim
    heads, groups = cfg.num_attention_heads, cfg.query_groups
    ours: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
                                        "embedding.position_embeddings.weight": (cfg.max_position_embeddings, h),
                                        "final_layernorm.weight": (h,), "final_layernorm.bias": (h,)}
    for i in range(cfg.num_layers):
        o = f"layers.{i}."
        ours.update({o + "input_layernorm.weight": (h,), o + "input_layernorm.bias": (h,),
                     o + "post_attention_layernorm.weight": (h,), o + "post_attention_layernorm.bias": (h,),
                     o + "attention.proj.weight": (h, heads * d), o + "attention.proj.bias": (h,),
                     o + "mlp.fc2.weight": (h, f), o + "mlp.fc2.bias": (h,),
                     o + "attention.q_layernorm.weight": (d,), o + "attention.k_layernorm.weight": (d,)})
        for fc1 in ("mlp.fc1", "mlp.fc1_gate", "mlp.fc1_up"):
            ours.update({o + fc1 + ".weight": (f, h), o + fc1 + ".bias": (f,)})
    out = {theirs: (ours[o][::-1] if how == "t" else ours[o]) for o, theirs, how in _name_pairs(cfg, kind)}
    for i in range(cfg.num_layers):
        n = _qkv_names(cfg, kind, i)
        if kind in hf_moe.MOE_ARCHITECTURES and is_moe_layer(cfg, i):
            out.update(hf_moe.expert_shapes(cfg, kind, i))
        if kind in _LLAMA_LIKE:
            for part, rows in (("q", heads * d), ("k", groups * d), ("v", groups * d)):
                out[n[part] + ".weight"] = (rows, h)
                out[n[part] + ".bias"] = (rows,)
        else:
            out[n["c_attn"] + ".weight"] = (h, 3 * h)      # Conv1D: [in, out]
            out[n["c_attn"] + ".bias"] = (3 * h,)
    return out


def _qkv_names(cfg: ModelConfig, kind: str, i: int) -> dict[str, str]:
    if kind in _LLAMA_LIKE:
        t = f"model.layers.{i}.self_attn."
        return {"q": t + "q_proj", "k": t + "k_proj", "v": t + "v_proj"}
    return {"c_attn": f"transformer.h.{i}.attn.c_attn"}


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors under this GPT's global names from a Hugging Face state dict of ``cfg``'s architecture.

    Every Hugging Face tensor must be used (a tied ``lm_head.weight`` must equal the embedding).
    """
    kind = hf_model_type(cfg)
    wrong = [(name, tuple(hf_sd[name].shape), shape) for name, shape in _hf_shapes(cfg, kind).items()
             if name in hf_sd and tuple(hf_sd[name].shape) != shape]
    if wrong:
        name, got, want = wrong[0]
        raise HFInteropError(f"config.json does not match the weights: {len(wrong)} tensor(s) of another shape, first "
                             f"{name} {got} where the config's sizes need {want}")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise HFInteropError(f"the Hugging Face checkpoint has no {name}")
        used.add(name)
        return hf_sd[name].detach().to(torch.float32).contiguous()

    out = {}
    for ours, theirs, how in _name_pairs(cfg, kind):
        t = take(theirs)
        out[ours] = t.t().contiguous() if how == "t" else t
    for i in range(cfg.num_layers):
        n = _qkv_names(cfg, kind, i)
        pre = f"layers.{i}.attention.qkv."
        if kind in hf_moe.MOE_ARCHITECTURES and is_moe_layer(cfg, i):
            out.update(hf_moe.experts_from_hf(hf_sd, take, cfg, kind, i))
        if kind in _LLAMA_LIKE:
            out[pre + "weight"] = _fuse_qkv(take(n["q"] + ".weight"), take(n["k"] + ".weight"),
                                            take(n["v"] + ".weight"), cfg)
            if cfg.qkv_bias:
                out[pre + "bias"] = _fuse_qkv(take(n["q"] + ".bias"), take(n["k"] + ".bias"),
                                              take(n["v"] + ".bias"), cfg)
        else:
            out[pre + "weight"] = _gpt2_qkv_to_ours(take(n["c_attn"] + ".weight").t(), cfg).contiguous()
            out[pre + "bias"] = _gpt2_qkv_to_ours(take(n["c_attn"] + ".bias"), cfg).contiguous()
    if cfg.tied_embeddings and "lm_head.weight" in hf_sd:
        if not torch.equal(hf_sd["lm_head.weight"].float(), out["embedding.word_embeddings.weight"]):
            raise HFInteropError("tie_word_embeddings is true but lm_head.weight differs from the word embedding")
        used.add("lm_head.weight")
    unused = sorted(k for k in hf_sd if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise HFInteropError(f"{len(unused)} Hugging Face tensor(s) have no place in this model: {', '.join(unused[:8])}")
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (Llama, GPT-2, Mixtral or Qwen3-MoE names and layouts) of full tensors ``sd`` of
    ``cfg``."""
    kind = hf_model_type(cfg)
    expected = {ours for ours, _, _ in _name_pairs(cfg, kind)}
    moe_layers = [i for i in range(cfg.num_layers) if kind in hf_moe.MOE_ARCHITECTURES and is_moe_layer(cfg, i)]
    for i in range(cfg.num_layers):
        if i in moe_layers:
            expected.update(f"layers.{i}.mlp.{n}.weight" for n in ("router", "experts.fc1_gate", "experts.fc1_up",
                                                                   "experts.fc2"))
        expected.add(f"layers.{i}.attention.qkv.weight")
        if cfg.qkv_bias:
            expected.add(f"layers.{i}.attention.qkv.bias")
    missing, extra = sorted(expected - sd.keys()), sorted(sd.keys() - expected)
    if missing or extra:
        raise HFInteropError(f"the checkpoint does not match its configuration: missing {missing[:8]}, "
                             f"unexpected {extra[:8]}")
    out = {}
    for ours, theirs, how in _name_pairs(cfg, kind):
        t = sd[ours].detach().to(torch.float32)
        if cfg.apply_layernorm_1p and ours.endswith("layernorm.weight"):
            t = t + 1      # zero-centred gamma: Hugging Face stores the scale itself (same fp32 sum as the forward)
        out[theirs] = (t.t() if how == "t" else t).contiguous()
    for i in range(cfg.num_layers):
        n = _qkv_names(cfg, kind, i)
        w = sd[f"layers.{i}.attention.qkv.weight"].detach().float()
        b = sd.get(f"layers.{i}.attention.qkv.bias")
        if i in moe_layers:
            out.update(hf_moe.experts_to_hf(sd, cfg, kind, i))
        if kind in _LLAMA_LIKE:
            for part, t in zip("qkv", _split_qkv(w, cfg)):
                out[n[part] + ".weight"] = t.contiguous()
            if b is not None:
                for part, t in zip("qkv", _split_qkv(b.detach().float(), cfg)):
                    out[n[part] + ".bias"] = t.contiguous()
        else:
            out[n["c_attn"] + ".weight"] = _ours_qkv_to_gpt2(w, cfg).t().contiguous()
            out[n["c_attn"] + ".bias"] = _ours_qkv_to_gpt2(b.detach().float(), cfg).contiguous()
    return out
