"""GPT decoder (GPT-2/3 by default, Llama-style by options), tensor- and sequence-parallel,
sliceable into pipeline stages.

Architecture options (``ModelConfig``, Megatron-LM's flags): LayerNorm or RMSNorm; learned
absolute positions, rotary embeddings or none; exact or tanh GELU, or SwiGLU (two
column-parallel projections, ``fc1_gate`` and ``fc1_up``, sharing one input gather);
grouped-query attention (key/value heads split over tp with their query heads); head width
``kv_channels``; biases on or off; the output layer tied to the word embedding or not.

Layout of hidden states: ``[s, b, h]`` (sequence first, like Megatron). With sequence
parallelism the hidden states between blocks are ``[s/tp, b, h]``: this tp rank's
contiguous sequence chunk. Tokens, labels, per-token losses and returned logits are
batch first (``[b, s]``, ``[b, s, V_pad/tp]``) — they are user-facing.

Every full weight is generated on the CPU from a generator seeded with
``(seed, global parameter name)`` and then sliced to this rank, so the same seed gives
the same full model whatever tp / pp / layer split (Megatron's CPU-init idea; the basis
of every layout-equivalence test). Layer names are global: a stage holding layers
16..23 names them ``layers.16`` .. ``layers.23``.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ..compile_boundary import outside_compiled_regions
from ..config_fields import ConfigError
from ..parallel import ParallelContext
from ..tensor_parallel import (ColumnParallelLinear, RNGStreams, RowParallelLinear, VocabParallelEmbedding,
                               WeightGradStore, padded_vocab_size, set_tensor_model_parallel_attributes,
                               vocab_parallel_cross_entropy)
from ..tensor_parallel.fused_cross_entropy import CrossEntropyKernels, fused_vocab_parallel_cross_entropy
from ..tensor_parallel.layers import scaled_init_std
from ..tensor_parallel.random import DEFAULT_STREAM, MODEL_PARALLEL_STREAM
from .components import LayerNorm1P, RMSNorm, apply_rotary, gelu, rotary_cos_sin, swiglu
from .config import ModelConfig, check_model_shape
from . import fusion
from .fusion import attention, configure_attention, residual_add
from .recompute import RECOMPUTE_GRANULARITIES, configure_recompute, checkpoint as recompute_checkpoint
from .moe import MoELayer, check_moe_config, is_moe_layer

__all__ = ["GPTModel", "check_gpt_config", "gpt_flops_per_token", "model_flops_per_iteration",
           "param_init_generator", "WORD_EMBEDDING_NAME", "OUTPUT_LAYER_NAME"]

WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"
OUTPUT_LAYER_NAME = "output_layer.weight"


# ---- deterministic, layout-independent initialisation ------------------------------------
def param_init_generator(seed: int, name: str) -> torch.Generator:
    """CPU generator seeded from (seed, global parameter name) — stable across runs and processes."""
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (2 ** 63 - 1)
    return torch.Generator().manual_seed(mixed)


def _normal_init(seed: int, name: str, std: float):
    def init(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, std, generator=param_init_generator(seed, name))
    return init


def _padded_init(seed: int, name: str, std: float, rows: int):
    """Normal init of the first ``rows`` rows (the real vocabulary), zeros in the padding rows below."""
    def init(shape: tuple[int, ...]) -> torch.Tensor:
        full = torch.zeros(shape)
        full[:rows] = _normal_init(seed, name, std)((rows, *shape[1:]))
        return full
    return init


def check_gpt_config(cfg: ModelConfig, tp: int, sequence_parallel: bool = False,
                     layer_range: tuple[int, int] | None = None) -> None:
    """The model's own shape checks (the model is also built outside the CLI's ``validate``)."""
    if cfg.vocab_size is None or cfg.vocab_size < 1:
        raise ConfigError(f"vocab_size must be a positive integer, got {cfg.vocab_size}")
    check_model_shape(cfg, tp, sequence_parallel, as_flags=False)
    # ep, etp: checked by MoELayer; tp > 1 without sequence parallelism builds (generation) and is refused by a
    # training forward (MoELayer) and at start-up (config_checks)
    check_moe_config(cfg, tp, ep=1, etp=1, sequence_parallel=sequence_parallel, training=False)
    if layer_range is not None:
        start, stop = layer_range
        if not 0 <= start < stop <= cfg.num_layers:
            raise ConfigError(f"layer_range ({start}, {stop}) must satisfy 0 <= start < stop <= "
                              f"num_layers {cfg.num_layers}")


# ---- blocks --------------------------------------------------------------------------------
def _fused_layer_norm_cls():
    """apex's FusedLayerNorm when it imports (GPU builds only; never required), else None."""
    try:
        from apex.normalization import FusedLayerNorm
    except Exception:  # not installed, or built without its CUDA extension
        return None
    return FusedLayerNorm


def _norm(cfg: ModelConfig, sequence_parallel: bool, device, dtype, size: int | None = None) -> nn.Module:
    """The configured normalization: RMSNorm, or LayerNorm (apex's fused kernel on GPU when importable:
    same parameters, same names), each with a zero-centred scale under ``apply_layernorm_1p``. Replicated
    over tp; under sequence parallelism its gradient covers this rank's sequence chunk only. ``size``: the
    channels normalized (default the hidden size; the query/key norms' head_dim)."""
    size = cfg.hidden_size if size is None else size
    if cfg.normalization == "RMSNorm":
        norm = RMSNorm(size, cfg.norm_epsilon, device=device, dtype=dtype, zero_centered_gamma=cfg.apply_layernorm_1p)
    elif cfg.apply_layernorm_1p:
        norm = LayerNorm1P(size, eps=cfg.norm_epsilon, device=device, dtype=dtype)
    else:
        fused = _fused_layer_norm_cls() if device is not None and torch.device(device).type == "cuda" else None
        if fused is not None:
            norm = fused(size, eps=cfg.norm_epsilon).to(device=device, dtype=dtype)
        else:
            norm = nn.LayerNorm(size, eps=cfg.norm_epsilon, device=device, dtype=dtype)
    for p in norm.parameters():
        set_tensor_model_parallel_attributes(p, False, -1, sequence_parallel=sequence_parallel)
    return norm


# Run eagerly inside a compiled layer (compile_boundary): dropout masks drawn from megareshard's RNG streams are
# an eager run's, and recomputation's replay restores those streams.
@outside_compiled_regions
def _attention_with_dropout(streams: RNGStreams, q, k, v, kernel: str, p: float, fused_softmax: bool) -> torch.Tensor:
    """Attention with dropout on the probabilities, drawn from this tp rank's stream (heads differ per rank)."""
    with streams.fork(MODEL_PARALLEL_STREAM):
        return attention(q, k, v, kernel=kernel, dropout_p=p, fused_softmax=fused_softmax)


@outside_compiled_regions
def _dropout_add(streams: RNGStreams, stream: str, out: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    """``residual + dropout(out)`` with the mask drawn from ``stream``."""
    with streams.fork(stream):
        out = F.dropout(out, p=p, training=True)
    return residual_add(out, residual)


@outside_compiled_regions
def _recompute_core(core, q, k, v, streams: RNGStreams) -> torch.Tensor:
    """Selective recomputation of the attention core."""
    return recompute_checkpoint(core, q, k, v, streams=streams)


class ParallelAttention(nn.Module):
    """Causal self-attention; this rank holds ``heads / tp`` query heads and ``groups / tp`` key/value
    heads (QKV column-, proj row-parallel).

    The fused QKV weight is laid out per key/value group along the output dim (Megatron-LM's
    layout): ``[groups, (q_1 .. q_{heads/groups}, k, v), head_dim]``; without grouped-query
    attention every head is its own group, ``[heads, (q, k, v), head_dim]``. A contiguous tp
    split therefore gives each rank whole groups with their query heads. Rotary embeddings
    (``position_embedding_type="rope"``) rotate q and k over the full sequence (the input is
    all-gathered first under sequence parallelism, so positions are global). With ``qk_layernorm`` every
    head's query and key are normalized over its channels first (``q_layernorm`` / ``k_layernorm``, one
    ``[head_dim]`` weight each, shared by the heads: Megatron-Core's and Qwen3's order). Each tp rank
    normalizes its own heads, so those weights' gradients are partial sums over tp: they are marked
    ``sequence_parallel`` (summed over tp), which is why training at tp > 1 needs sequence parallelism with them
    (a model built without it runs for inference; a training forward is refused).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, seed: int, sequence_parallel: bool,
                 streams: RNGStreams, device, dtype) -> None:
        super().__init__()
        h, heads, groups, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        self.heads_local, self.groups_local = heads // ctx.tp_size, groups // ctx.tp_size
        self.heads_per_group, self.head_dim = heads // groups, d
        self.rotary_dim, self.rotary_base = cfg.rotary_dim, cfg.rotary_base
        self.dropout = cfg.attention_dropout
        self.streams = streams
        self.recompute_core = False   # selective recomputation: GPTModel(recompute_granularity="selective")
        self.backend = cfg.attention_backend
        # the kernel run (models/fusion.py); flash, fused and auto on CUDA are checked and measured by
        # GPTModel.configure_attention at start-up
        self.kernel = {"flash": "flash", "fused": "cudnn", "unfused": "unfused", "local": "unfused"}.get(
            cfg.attention_backend, "sdpa")
        self.rope_fusion, self.masked_softmax_fusion = cfg.apply_rope_fusion, cfg.masked_softmax_fusion
        self.qkv = ColumnParallelLinear(h, (heads + 2 * groups) * d, ctx, bias=cfg.qkv_bias,
                                        sequence_parallel=sequence_parallel,
                                        init_method=_normal_init(seed, f"{prefix}.qkv.weight", cfg.init_method_std),
                                        device=device, dtype=dtype)
        self.q_layernorm = self.k_layernorm = None
        self._qk_norm_untrainable = cfg.qk_layernorm and ctx.tp_size > 1 and not sequence_parallel
        if cfg.qk_layernorm:
            self.q_layernorm = _norm(cfg, sequence_parallel, device, dtype, size=d)
            self.k_layernorm = _norm(cfg, sequence_parallel, device, dtype, size=d)
        out_std = scaled_init_std(cfg.init_method_std, cfg.num_layers)
        self.proj = RowParallelLinear(heads * d, h, ctx, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                                      init_method=_normal_init(seed, f"{prefix}.proj.weight", out_std),
                                      device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                        # [s, b, groups/tp · (heads/groups + 2) · d]
        s, b, _ = qkv.shape
        per = self.heads_per_group
        qkv = qkv.view(s, b, self.groups_local, per + 2, self.head_dim)
        q = qkv[:, :, :, :per].reshape(s, b, self.heads_local, self.head_dim)
        k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]          # [s, b, groups/tp, d]
        q, k = self.norm_qk(q, k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))     # [b, heads (groups), s, d]
        if self.rotary_dim:
            cos, sin = rotary_cos_sin(s, self.rotary_dim, self.rotary_base, device=q.device, dtype=q.dtype)
            rotary = apply_rotary if self.rope_fusion else fusion.apply_rotary_unfused
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.recompute_core:
            ctx = _recompute_core(self._core, q, k, v, self.streams)
        else:
            ctx = self._core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(ctx)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query/key norms (``qk_layernorm``; the identity without): ``[..., d]`` each."""
        if self.q_layernorm is None:
            return q, k
        if self._qk_norm_untrainable and self.training and torch.is_grad_enabled():
            raise RuntimeError("qk_layernorm at tensor-parallel size > 1 trains with sequence parallelism only (the "
                               "query/key norm weights' gradients are summed over tp with the sequence-parallel "
                               "ones); this model was built without it: inference only")
        return self.q_layernorm(q), self.k_layernorm(k)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ/√d)V with dropout on the probabilities: the selectively recomputed part.

        Grouped-query attention: SDPA's ``enable_gqa`` shares key/value head ``j`` among query
        heads ``j·heads/groups .. (j+1)·heads/groups - 1`` without copying K and V. The kernel is
        ``self.kernel`` (``--attention-backend``, models/fusion.py).
        """
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            return _attention_with_dropout(self.streams, q, k, v, self.kernel, p, self.masked_softmax_fusion)
        return attention(q, k, v, kernel=self.kernel, fused_softmax=self.masked_softmax_fusion)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel).

    GELU (exact, or tanh with ``openai_gelu``): one column-parallel ``fc1``. SwiGLU: two,
    ``fc1_gate`` and ``fc1_up``, sharing one input mapping (one all-gather under sequence
    parallelism), each slicing like any column-parallel weight, so checkpoints relayout by tp
    without reordering and both go through the weight-gradient store.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, seed: int, sequence_parallel: bool,
                 device, dtype) -> None:
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.ffn_hidden_size, cfg.add_bias_linear
        self.swiglu, self.openai_gelu = cfg.swiglu, cfg.openai_gelu
        self.bias_gelu_fusion, self.bias_swiglu_fusion = cfg.bias_gelu_fusion, cfg.bias_swiglu_fusion

        def column(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, f, ctx, bias=bias, sequence_parallel=sequence_parallel,
                                        init_method=_normal_init(seed, f"{prefix}.{name}.weight", cfg.init_method_std),
                                        device=device, dtype=dtype)
        if self.swiglu:
            self.fc1_gate, self.fc1_up = column("fc1_gate"), column("fc1_up")
        else:
            self.fc1 = column("fc1")
        out_std = scaled_init_std(cfg.init_method_std, cfg.num_layers)
        self.fc2 = RowParallelLinear(f, h, ctx, bias=bias, sequence_parallel=sequence_parallel,
                                     init_method=_normal_init(seed, f"{prefix}.fc2.weight", out_std),
                                     device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            x = self.fc1_gate.map_input(x)
            glu = swiglu if self.bias_swiglu_fusion else fusion.swiglu_unfused
            inner = glu(self.fc1_gate(x, input_mapped=True), self.fc1_up(x, input_mapped=True))
        else:
            act = gelu if self.bias_gelu_fusion else fusion.gelu_unfused
            inner = act(self.fc1(x), openai=self.openai_gelu)
        return self.fc2(inner)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int, seed: int, sequence_parallel: bool,
                 streams: RNGStreams, device, dtype) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        self.index = index
        self.hidden_dropout = cfg.hidden_dropout
        self.streams = streams
        # replicated hidden states need identical masks on all tp ranks; sequence shards different ones
        self.dropout_stream = MODEL_PARALLEL_STREAM if sequence_parallel else DEFAULT_STREAM
        self.bias_dropout_fusion = cfg.bias_dropout_fusion
        self.input_layernorm = _norm(cfg, sequence_parallel, device, dtype)
        self.attention = ParallelAttention(cfg, ctx, f"{prefix}.attention", seed, sequence_parallel, streams,
                                           device, dtype)
        self.post_attention_layernorm = _norm(cfg, sequence_parallel, device, dtype)
        if is_moe_layer(cfg, index):   # models/moe: routed experts (Megatron-Core's MoELayer) instead of the MLP
            self.mlp = MoELayer(cfg, ctx, f"{prefix}.mlp", lambda name, std: _normal_init(seed, name, std),
                                scaled_init_std(cfg.init_method_std, cfg.num_layers),
                                sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        else:
            self.mlp = ParallelMLP(cfg, ctx, f"{prefix}.mlp", seed, sequence_parallel, device, dtype)

    def _dropout_add(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p > 0.0:
            return _dropout_add(self.streams, self.dropout_stream, out, residual, p)
        return residual_add(out, residual) if self.bias_dropout_fusion else fusion.residual_add_unfused(out, residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._dropout_add(self.attention(self.input_layernorm(x)), x)
        return self._dropout_add(self.mlp(self.post_attention_layernorm(x)), x)


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings -> ``[s(/tp), b, h]``.

    With ``position_embedding_type`` ``rope`` or ``none`` there is no position table (rotary
    embeddings act inside attention).

    Under sequence parallelism the word embedding's partial sums are reduce-scattered
    straight into the sequence chunk and only the chunk's positions are added, so the
    position-embedding gradient covers only this chunk: it is marked ``sequence_parallel``.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, padded_vocab: int, seed: int,
                 sequence_parallel: bool, device, dtype) -> None:
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, ctx, padded_num_embeddings=padded_vocab,
            init_method=_normal_init(seed, WORD_EMBEDDING_NAME, cfg.init_method_std),
            reduce_scatter_output=sequence_parallel, device=device, dtype=dtype)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            full_pos = _normal_init(seed, "embedding.position_embeddings.weight", cfg.init_method_std)(
                (cfg.max_position_embeddings, cfg.hidden_size))
            # _weight: no default init (it would draw from, and advance, the global RNG)
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                    _weight=full_pos.to(device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.position_embeddings.weight, False, -1,
                                                 sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        words = self.word_embeddings(tokens.t())                 # [s(/tp), b, h]
        if self.position_embeddings is None:
            return words
        max_pos = self.position_embeddings.num_embeddings
        if s > max_pos:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings {max_pos}")
        if self.sequence_parallel:
            chunk = words.size(0)
            start = self.ctx.tp_rank() * chunk
        else:
            chunk, start = s, 0
        return words + self.position_embeddings.weight[start:start + chunk].unsqueeze(1)


# ---- the model ---------------------------------------------------------------------------------
class GPTModel(nn.Module):
    """GPT decoder (or one pipeline stage of it) for this rank of ``ctx``.

    ``pre_process``: this stage holds the embeddings and takes tokens. ``post_process``:
    it holds the final norm and the output layer and returns losses or logits. By default
    the output layer is tied to the word embedding (``tied_embedding``); a last stage
    without the embedding holds its own copy, ``output_layer.weight``, initialised
    identically and marked ``shared_embedding_duplicate`` (keeping the copies in sync across
    stages is the trainer's job: it sums their gradients). With
    ``untie_embeddings_and_output_weights`` the output layer has its own weight
    ``output_layer.weight`` (normal init, vocabulary padding rows zero) on whichever stage
    is last. ``layer_range=(start, stop)`` selects global layers ``start..stop-1`` (default: all).

    Activation recomputation (``models/recompute.py``): ``recompute_granularity="selective"``
    recomputes the attention core of every layer; ``"full"`` recomputes whole layers, the
    first ``recompute_num_layers`` of this stage (default: all of them). None: off.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, sequence_parallel: bool = False,
                 seed: int = 1234, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, device: torch.device | str | None = None,
                 params_dtype: torch.dtype = torch.float32, recompute_granularity: str | None = None,
                 recompute_num_layers: int | None = None, streams: RNGStreams | None = None) -> None:
        super().__init__()
        if recompute_granularity is not None and recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES} or None, "
                              f"got {recompute_granularity!r}")
        if recompute_num_layers is not None and recompute_num_layers < 0:
            raise ConfigError(f"recompute_num_layers must be >= 0, got {recompute_num_layers}")
        tp = ctx.tp_size
        check_gpt_config(cfg, tp, sequence_parallel, layer_range)
        self.cfg, self.ctx, self.seed = cfg, ctx, seed
        self.sequence_parallel = sequence_parallel and tp > 1
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = tuple(layer_range) if layer_range is not None else (0, cfg.num_layers)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.vocab_size = cfg.vocab_size
        self.tied_embedding = cfg.tied_embeddings
        self.padded_vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        # ``streams``: shared by the model chunks of one rank (virtual stages), so they draw one sequence
        self.streams = streams if streams is not None else RNGStreams.for_context(seed, ctx, self.device)
        sp, dev, dt = self.sequence_parallel, self.device, params_dtype

        if pre_process:
            self.embedding = GPTEmbedding(cfg, ctx, self.padded_vocab_size, seed, sp, dev, dt)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(cfg, ctx, i, seed, sp, self.streams, dev, dt)
            for i in range(*self.layer_range)})
        if post_process:
            self.final_layernorm = _norm(cfg, sp, dev, dt)
            if self.tied_embedding:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx, bias=False,
                                                         sequence_parallel=sp, skip_weight_param_allocation=True,
                                                         device=dev, dtype=dt)
                if not pre_process:
                    own = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx,
                                                 padded_num_embeddings=self.padded_vocab_size,
                                                 init_method=_normal_init(seed, WORD_EMBEDDING_NAME,
                                                                          cfg.init_method_std),
                                                 device=dev, dtype=dt)
                    self.output_layer.weight = own.weight
                    self.output_layer.weight.shared_embedding_duplicate = True
                    self.output_layer.weight.checkpoint_name = WORD_EMBEDDING_NAME  # saved once, as the embedding
            else:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx, bias=False,
                                                         sequence_parallel=sp, device=dev, dtype=dt,
                                                         init_method=_padded_init(seed, OUTPUT_LAYER_NAME,
                                                                                  cfg.init_method_std, cfg.vocab_size))
                self.output_layer.weight.unpadded_rows = cfg.vocab_size  # checkpoints and gathers drop the padding
        self.recompute_granularity = recompute_granularity
        self.recompute_num_layers = configure_recompute(self.layers.values(), recompute_granularity,
                                                        recompute_num_layers)
        # regional compilation (compile_regions): the compiled loss head, the cross-entropy's chunk kernels,
        # and whether the linear layers were traced (then no weight gradient may be delayed)
        self._head_call = None
        self._ce_kernels: CrossEntropyKernels | None = None
        self._linears_traced = False

    # ---- helpers ------------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        """The vocab-parallel weight of the output layer (the word embedding's when tied on this stage)."""
        if self.tied_embedding and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def set_wgrad_store(self, store: WeightGradStore | None) -> None:
        """Attach (or detach, with None) a weight-gradient store to every linear layer."""
        if store is not None and self._linears_traced:
            raise RuntimeError("this stage was compiled with its linear layers traced, so no weight gradient can "
                               "be delayed; compile it with traceable_linears=False for a schedule that delays "
                               "weight gradients")
        for m in self.modules():
            if hasattr(m, "wgrad_store"):
                m.wgrad_store = store

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``tokens [b, s]``; later stages: ``hidden [s(/tp), b, h]``.

        Returns per-token losses ``[b, s]`` fp32 (post_process with labels), the logits
        shard ``[b, s, V_pad/tp]`` (post_process, no labels; columns >= vocab_size are
        padding), or the hidden states ``[s(/tp), b, h]`` for the next stage.
        """
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first stage (pre_process=True) needs tokens [b, s]")
            x = self.embedding(tokens)
            p = self.cfg.hidden_dropout if self.training else 0.0
            if p > 0.0:
                with self.streams.fork(MODEL_PARALLEL_STREAM if self.sequence_parallel else DEFAULT_STREAM):
                    x = F.dropout(x, p=p, training=True)
        else:
            if hidden is None:
                raise ValueError("a stage without pre_process needs hidden [s(/tp), b, h] from the previous stage")
            x = hidden
        for i, layer in enumerate(self.layers.values()):
            if i < self.recompute_num_layers:
                x = recompute_checkpoint(layer, x, streams=self.streams)
            else:
                x = layer(x)
        if not self.post_process:
            return x
        logits = (self._head_call or self._logits)(x)   # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1)
        if self.cfg.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(logits, labels.t(), self.ctx, vocab_size=self.vocab_size,
                                                      kernels=self._ce_kernels)
        else:
            loss = vocab_parallel_cross_entropy(logits, labels.t(), self.ctx, vocab_size=self.vocab_size)
        return loss.t().contiguous()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The loss head's compiled part: the final norm and the output layer (the logits' vocabulary shard)."""
        return self.output_layer(self.final_layernorm(x), weight=self.output_weight())

    # ---- the fast path ------------------------------------------------------------------------
    def configure_attention(self, micro_batch_size: int) -> list[str]:
        """Check (flash, fused) or measure (auto on CUDA) the attention kernel at this stage's shape; returns
        what each distinct layer shape runs and why (models/fusion.py)."""
        return configure_attention(self.layers.values(), micro_batch_size, self.cfg.seq_length, self.device)

    def compile_regions(self, opts) -> list[str]:
        """Compile every Transformer layer and the loss head in place (models/compile.py, ``opts`` a
        ``CompileOptions``); the fused cross-entropy's chunk kernels too; with ``opts.scope`` "model" the whole
        model as one region instead. Returns the regions' names."""
        from .compile import (compile_function, compile_layers, compile_module, compiled_cross_entropy_kernels,
                              plain_layer_norms)

        plain_layer_norms(self)
        self._linears_traced = opts.traceable_linears
        if opts.scope == "model":   # one graph, embedding to loss (the chunk functions traced into it)
            compile_module(self, "the whole model", opts)
            return ["model"]
        names = compile_layers({f"layers.{i}": layer for i, layer in self.layers.items()}, opts)
        if self.post_process:
            self._head_call = compile_function(self._logits, "the loss head (final norm, output layer)", opts,
                                               [self.output_layer])
            names.append("head")
            if self.cfg.cross_entropy_loss_fusion:
                self._ce_kernels = compiled_cross_entropy_kernels(opts)
                names.append("cross-entropy chunks")
        return names


# ---- FLOPs -----------------------------------------------------------------------------------
def gpt_flops_per_token(cfg: ModelConfig, seq_length: int | None = None, *, recompute: bool = False,
                        vocab_size: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward; 4 × with full recomputation).

    Forward per token, with q = heads·d query channels and kv = groups·d key/value channels:
    per layer 2·h·(q + 2·kv) (QKV) + 2·q·h (projection) + 2·h·f·(3 with SwiGLU, else 2) (MLP)
    plus 4·s·q for the attention scores and their product with V (counted as non-causal, like
    Megatron), plus 2·h·V for the logits. For GPT-2 (q = kv = h, f = 4h) this is Megatron's
    ``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token.
    """
    s = seq_length if seq_length is not None else cfg.seq_length
    v = vocab_size if vocab_size is not None else cfg.vocab_size
    h, f, l = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    mlp_matrices = 3 if cfg.swiglu else 2
    forward = l * (2 * h * (q + 2 * kv) + 2 * q * h + 2 * mlp_matrices * h * f + 4 * s * q) + 2 * h * v
    return float((4 if recompute else 3) * forward)


def model_flops_per_iteration(cfg: ModelConfig, global_batch: int, seq: int | None = None, *,
                              recompute: bool = False) -> float:
    """FLOPs of one training iteration over ``global_batch`` samples of ``seq`` tokens (for TFLOP/s)."""
    s = seq if seq is not None else cfg.seq_length
    return gpt_flops_per_token(cfg, s, recompute=recompute) * global_batch * s
