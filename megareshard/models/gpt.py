"""GPT-2/3 style decoder, tensor- and sequence-parallel, sliceable into pipeline stages.

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

from ..arguments import ConfigError, ModelConfig, check_model_shape
from ..parallel import ParallelContext
from ..tensor_parallel import (ColumnParallelLinear, RNGStreams, RowParallelLinear, VocabParallelEmbedding,
                               WeightGradStore, padded_vocab_size, set_tensor_model_parallel_attributes,
                               vocab_parallel_cross_entropy)
from ..tensor_parallel.layers import scaled_init_std
from ..tensor_parallel.random import DEFAULT_STREAM, MODEL_PARALLEL_STREAM
from .recompute import RECOMPUTE_GRANULARITIES, configure_recompute, checkpoint as recompute_checkpoint

__all__ = ["GPTModel", "check_gpt_config", "gpt_flops_per_token", "model_flops_per_iteration",
           "param_init_generator", "WORD_EMBEDDING_NAME"]

WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"


# ---- deterministic, layout-independent initialisation ------------------------------------
def param_init_generator(seed: int, name: str) -> torch.Generator:
    """CPU generator seeded from (seed, global parameter name) — stable across runs and processes."""
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (2 ** 63 - 1)
    return torch.Generator().manual_seed(mixed)


def _normal_init(seed: int, name: str, std: float):
    def init(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, std, generator=param_init_generator(seed, name))
    return init


def check_gpt_config(cfg: ModelConfig, tp: int, sequence_parallel: bool = False,
                     layer_range: tuple[int, int] | None = None) -> None:
    """The model's own shape checks (the model is also built outside the CLI's ``validate``)."""
    if cfg.vocab_size is None or cfg.vocab_size < 1:
        raise ConfigError(f"vocab_size must be a positive integer, got {cfg.vocab_size}")
    check_model_shape(cfg, tp, sequence_parallel, as_flags=False)
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


def _layer_norm(cfg: ModelConfig, sequence_parallel: bool, device, dtype) -> nn.Module:
    """LayerNorm (apex's fused kernel on GPU when importable: same parameters, same names)."""
    fused = _fused_layer_norm_cls() if device is not None and torch.device(device).type == "cuda" else None
    if fused is not None:
        ln = fused(cfg.hidden_size, eps=cfg.layernorm_epsilon).to(device=device, dtype=dtype)
    else:
        ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)
    for p in ln.parameters():
        set_tensor_model_parallel_attributes(p, False, -1, sequence_parallel=sequence_parallel)
    return ln


class ParallelAttention(nn.Module):
    """Causal self-attention; this rank holds ``heads / tp`` heads (QKV column-, proj row-parallel).

    The fused QKV weight is laid out per head, ``[heads, (q, k, v), head_dim]`` along the
    output dim, so a contiguous tp split gives each rank whole heads with their q, k, v.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, seed: int, sequence_parallel: bool,
                 streams: RNGStreams, device, dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads_local = cfg.num_attention_heads // ctx.tp_size
        self.head_dim = h // cfg.num_attention_heads
        self.dropout = cfg.attention_dropout
        self.streams = streams
        self.recompute_core = False   # selective recomputation: GPTModel(recompute_granularity="selective")
        self.qkv = ColumnParallelLinear(h, 3 * h, ctx, sequence_parallel=sequence_parallel,
                                        init_method=_normal_init(seed, f"{prefix}.qkv.weight", cfg.init_method_std),
                                        device=device, dtype=dtype)
        out_std = scaled_init_std(cfg.init_method_std, cfg.num_layers)
        self.proj = RowParallelLinear(h, h, ctx, sequence_parallel=sequence_parallel,
                                      init_method=_normal_init(seed, f"{prefix}.proj.weight", out_std),
                                      device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                        # [s, b, 3h/tp]
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.heads_local, 3, self.head_dim).unbind(3)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))     # [b, heads, s, d]
        if self.recompute_core:
            ctx = recompute_checkpoint(self._core, q, k, v, streams=self.streams)
        else:
            ctx = self._core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(ctx)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ/√d)V with dropout on the probabilities: the selectively recomputed part."""
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            with self.streams.fork(MODEL_PARALLEL_STREAM):       # heads differ per tp rank
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, seed: int, sequence_parallel: bool,
                 device, dtype) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(h, f, ctx, sequence_parallel=sequence_parallel,
                                        init_method=_normal_init(seed, f"{prefix}.fc1.weight", cfg.init_method_std),
                                        device=device, dtype=dtype)
        out_std = scaled_init_std(cfg.init_method_std, cfg.num_layers)
        self.fc2 = RowParallelLinear(f, h, ctx, sequence_parallel=sequence_parallel,
                                     init_method=_normal_init(seed, f"{prefix}.fc2.weight", out_std),
                                     device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: ``x + drop(attn(ln(x)))``, then ``x + drop(mlp(ln(x)))``."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int, seed: int, sequence_parallel: bool,
                 streams: RNGStreams, device, dtype) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        self.index = index
        self.hidden_dropout = cfg.hidden_dropout
        self.streams = streams
        # replicated hidden states need identical masks on all tp ranks; sequence shards different ones
        self.dropout_stream = MODEL_PARALLEL_STREAM if sequence_parallel else DEFAULT_STREAM
        self.input_layernorm = _layer_norm(cfg, sequence_parallel, device, dtype)
        self.attention = ParallelAttention(cfg, ctx, f"{prefix}.attention", seed, sequence_parallel, streams,
                                           device, dtype)
        self.post_attention_layernorm = _layer_norm(cfg, sequence_parallel, device, dtype)
        self.mlp = ParallelMLP(cfg, ctx, f"{prefix}.mlp", seed, sequence_parallel, device, dtype)

    def _dropout_add(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p > 0.0:
            with self.streams.fork(self.dropout_stream):
                out = F.dropout(out, p=p, training=True)
        return residual + out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._dropout_add(self.attention(self.input_layernorm(x)), x)
        return self._dropout_add(self.mlp(self.post_attention_layernorm(x)), x)


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings -> ``[s(/tp), b, h]``.

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
        full_pos = _normal_init(seed, "embedding.position_embeddings.weight", cfg.init_method_std)(
            (cfg.max_position_embeddings, cfg.hidden_size))
        # _weight: no default init (it would draw from, and advance, the global RNG)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                _weight=full_pos.to(device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.position_embeddings.weight, False, -1,
                                             sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        max_pos = self.position_embeddings.num_embeddings
        if s > max_pos:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings {max_pos}")
        words = self.word_embeddings(tokens.t())                 # [s(/tp), b, h]
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
    it holds the final LayerNorm and the output layer and returns losses or logits. The
    output layer is tied to the word embedding; a last stage without the embedding holds
    its own copy, ``output_layer.weight``, initialised identically (keeping the copies in
    sync across stages is the pipeline's job). ``layer_range=(start, stop)`` selects
    global layers ``start..stop-1`` (default: all).

    Activation recomputation (``models/recompute.py``): ``recompute_granularity="selective"``
    recomputes the attention core of every layer; ``"full"`` recomputes whole layers, the
    first ``recompute_num_layers`` of this stage (default: all of them). None: off.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, sequence_parallel: bool = False,
                 seed: int = 1234, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, device: torch.device | str | None = None,
                 params_dtype: torch.dtype = torch.float32, recompute_granularity: str | None = None,
                 recompute_num_layers: int | None = None) -> None:
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
        self.padded_vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        self.streams = RNGStreams.for_context(seed, ctx, self.device)
        sp, dev, dt = self.sequence_parallel, self.device, params_dtype

        if pre_process:
            self.embedding = GPTEmbedding(cfg, ctx, self.padded_vocab_size, seed, sp, dev, dt)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(cfg, ctx, i, seed, sp, self.streams, dev, dt)
            for i in range(*self.layer_range)})
        if post_process:
            self.final_layernorm = _layer_norm(cfg, sp, dev, dt)
            self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, ctx, bias=False,
                                                     sequence_parallel=sp, skip_weight_param_allocation=True,
                                                     device=dev, dtype=dt)
            if not pre_process:
                own = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx,
                                             padded_num_embeddings=self.padded_vocab_size,
                                             init_method=_normal_init(seed, WORD_EMBEDDING_NAME, cfg.init_method_std),
                                             device=dev, dtype=dt)
                self.output_layer.weight = own.weight
        self.recompute_granularity = recompute_granularity
        self.recompute_num_layers = configure_recompute(self.layers.values(), recompute_granularity,
                                                        recompute_num_layers)

    # ---- helpers ------------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        """The (tied) vocab-parallel weight of the output layer."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def set_wgrad_store(self, store: WeightGradStore | None) -> None:
        """Attach (or detach, with None) a weight-gradient store to every linear layer."""
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
        x = self.final_layernorm(x)
        logits = self.output_layer(x, weight=self.output_weight())   # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.ctx, vocab_size=self.vocab_size)
        return loss.t().contiguous()


# ---- FLOPs -----------------------------------------------------------------------------------
def gpt_flops_per_token(cfg: ModelConfig, seq_length: int | None = None, *, recompute: bool = False,
                        vocab_size: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward; 4 × with full recomputation).

    Forward per token: per layer 2·(3h² + h² + 2·h·f) for the GEMMs plus 4·s·h for the
    attention scores and their product with V (counted as non-causal, like Megatron),
    plus 2·h·V for the logits. With f = 4h this is Megatron's
    ``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token.
    """
    s = seq_length if seq_length is not None else cfg.seq_length
    v = vocab_size if vocab_size is not None else cfg.vocab_size
    h, f, l = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    forward = l * (2 * (4 * h * h + 2 * h * f) + 4 * s * h) + 2 * h * v
    return float((4 if recompute else 3) * forward)


def model_flops_per_iteration(cfg: ModelConfig, global_batch: int, seq: int | None = None, *,
                              recompute: bool = False) -> float:
    """FLOPs of one training iteration over ``global_batch`` samples of ``seq`` tokens (for TFLOP/s)."""
    s = seq if seq is not None else cfg.seq_length
    return gpt_flops_per_token(cfg, s, recompute=recompute) * global_batch * s
