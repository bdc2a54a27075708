"""U-Transformer: a causal language model shaped like a U, with long skip connections.

The second model of Zhuang et al., "On Optimizing the Communication of Model
Parallelism" (MLSys 2023, §5.2): widths change with depth and long skip
connections join mirrored levels, so when the U is split into pipeline stages the skip
tensors cross *non-adjacent* stages — cross-mesh resharding is the bottleneck there.

Shape (levels ``k = 0 .. L-1``, width ``w_k``, sequence ``s_k = s / f^k``, f = shortening
factor)::

    tokens ─ embedding (w_0) ─ enc 0 ─────────────────────────────── skip0 ──┐
                                 │ down 1                                     │
                                 enc 1 ───────────────────── skip1 ──┐        │
                                   │ down 2                          │        │
                                   enc 2 (the bottom: no decoder)    │        │
                                   │ up 1                            ▼        │
                                 dec 1  ◀── merge (add | concat) ────┘        │
                                 │ up 0                                       ▼
                               dec 0  ◀── merge ──────────────────────────────┘
                               final LayerNorm ─ output layer (untied) ─ loss

* **Level** (encoder and decoder alike): a residual causal depthwise 1-D convolution
  (kernel ``conv_kernel``, left-padded so position i sees i-K+1 .. i), then
  ``blocks_per_level[k]`` GPT Transformer blocks (``models.gpt.TransformerLayer``: tensor
  parallel, causal attention over the level's ``s_k`` positions).
* **Down** (k-1 → k): shift right by ``f-1`` (zeros in front), average-pool by ``f``, then a
  linear ``w_{k-1} → w_k``. Shortened position j averages original positions
  ``j·f-f+1 .. j·f``: nothing after ``j·f`` — no token sees the future.
* **Up** (k+1 → k): a linear ``w_{k+1} → w_k`` then repeat each position ``f`` times:
  position i takes shortened position ``i // f``, which saw only positions ``<= (i//f)·f
  <= i`` (the shift in Down is what aligns this causally, as in the Hourglass Transformer).
* **Merge** with the skip tensor (the output of encoder level k): ``add`` (up + skip) or
  ``concat`` (a linear ``2·w_k → w_k`` on [up, skip]).
* **Head**: final LayerNorm and a vocab-parallel output layer with its *own* weight
  (untied from the input embedding, deliberately: first and last stage may have
  different tp layouts and the U needs no cross-stage gradient exchange for a tie).

Tensor parallelism: the Transformer blocks, the embedding and the output layer are
tensor parallel exactly like the GPT's (every width must be divisible by the number of
heads, heads by tp). The convolutions and the down/up/merge projections are small and
replicated over tp (their inputs and output gradients are replicated, so their
gradients agree on every tp rank; the gradient norm counts them on tp rank 0).
Sequence parallelism is not supported (hidden states are ``[s_k, b, w_k]``, ``R,S0,R``).

Blocks form one flat list in execution order — encoder levels 0..L-1, then decoder levels
L-2..0 — and block j's parameters are ``layers.j.…`` whatever the pipeline split; the
other parameters are named by level (``enc_conv.k``, ``down.k``, ``up.k``, ``merge.k``,
``dec_conv.k``). Every full weight is drawn from a generator seeded by (seed, global
name), so every layout starts from the same model. A pipeline split is a split of the
flat block list (``--num-layers-per-stage``; ``--num-layers`` is set to the number of
blocks); the level's down/conv (encoder) or up/merge/conv (decoder) belong to the stage
holding the level's first block. The skip tensor of level k travels from the stage of
encoder level k's last block to the stage of decoder level k's first block: a named skip
edge ``skip<k>`` of the pipeline graph when they differ.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config_fields import ConfigError
from ..parallel import ParallelContext
from ..tensor_parallel import (ColumnParallelLinear, RNGStreams, WeightGradStore, padded_vocab_size,
                               set_tensor_model_parallel_attributes, vocab_parallel_cross_entropy)
from .config import ModelConfig
from ..tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from .fusion import configure_attention
from .gpt import GPTEmbedding, TransformerLayer, _norm, param_init_generator
from .recompute import RECOMPUTE_GRANULARITIES, configure_recompute, checkpoint as recompute_checkpoint

__all__ = ["UTransformerConfig", "UBlock", "UPlan", "UTransformerModel", "add_utransformer_args",
           "utransformer_config_from_args", "check_utransformer_config"]

SKIP_MERGES = ("add", "concat")


@dataclass
class UTransformerConfig:
    """The U's shape (the rest — vocabulary, sequence, heads, dropout — comes from ModelConfig)."""

    levels: int = 3
    """number of levels L (level L-1 is the bottom: encoder only)"""
    widths: tuple[int, ...] = (64, 128, 256)
    """hidden size of every level, top first (each divisible by the number of heads)"""
    blocks_per_level: tuple[int, ...] = (1, 1, 1)
    """Transformer blocks per level, on the encoder and (mirrored) the decoder side"""
    shorten_factor: int = 2
    """f: sequence shortening (and upsampling) factor between consecutive levels"""
    skip_merge: str = "add"
    """how a decoder level takes its skip tensor: add, or concat then project 2w -> w"""
    conv_kernel: int = 3
    """kernel of the causal depthwise convolution at the start of every level"""

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        b = tuple(int(x) for x in self.blocks_per_level)
        self.blocks_per_level = b * self.levels if len(b) == 1 else b


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{what} {text!r} must be comma-separated integers") from None


def add_utransformer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("utransformer", "shape of the U-Transformer")
    g.add_argument("--u-levels", type=int, default=3, help="number of levels (the deepest has no decoder)")
    g.add_argument("--u-widths", default="64,128,256", help="hidden size per level, top first")
    g.add_argument("--u-blocks-per-level", default="1", help="Transformer blocks per level (one number for all, "
                                                             "or one per level); the decoder mirrors them")
    g.add_argument("--u-shorten-factor", type=int, default=2, help="sequence shortening factor between levels")
    g.add_argument("--u-skip-merge", default="add", choices=SKIP_MERGES,
                   help="merge the skip tensor by adding it, or concatenating and projecting")
    g.add_argument("--u-conv-kernel", type=int, default=3, help="kernel of the causal depthwise convolutions")
    return parser


def utransformer_config_from_args(ns: argparse.Namespace) -> UTransformerConfig:
    return UTransformerConfig(levels=ns.u_levels, widths=_ints(ns.u_widths, "--u-widths"),
                              blocks_per_level=_ints(ns.u_blocks_per_level, "--u-blocks-per-level"),
                              shorten_factor=ns.u_shorten_factor, skip_merge=ns.u_skip_merge,
                              conv_kernel=ns.u_conv_kernel)


def check_utransformer_config(u: UTransformerConfig, m: ModelConfig, *, sequence_parallel: bool = False) -> None:
    """The U's own shape checks, with the numbers in the message."""
    if u.levels < 1:
        raise ConfigError(f"--u-levels must be at least 1, got {u.levels}")
    if len(u.widths) != u.levels:
        raise ConfigError(f"--u-widths {','.join(map(str, u.widths))} gives {len(u.widths)} widths for --u-levels "
                          f"{u.levels}: give one per level")
    if len(u.blocks_per_level) != u.levels or min(u.blocks_per_level) < 1:
        raise ConfigError(f"--u-blocks-per-level {','.join(map(str, u.blocks_per_level))} must give one positive "
                          f"number (or one per level, {u.levels})")
    if u.levels > 1 and u.shorten_factor < 2:
        raise ConfigError(f"--u-shorten-factor must be at least 2, got {u.shorten_factor}")
    if u.skip_merge not in SKIP_MERGES:
        raise ConfigError(f"--u-skip-merge {u.skip_merge!r}: choose one of {', '.join(SKIP_MERGES)}")
    if u.conv_kernel < 1:
        raise ConfigError(f"--u-conv-kernel must be at least 1, got {u.conv_kernel}")
    for k, w in enumerate(u.widths):
        if w < 1 or w % m.num_attention_heads:
            raise ConfigError(f"--u-widths: level {k}'s width {w} is not divisible by --num-attention-heads "
                              f"{m.num_attention_heads}")
    div = u.shorten_factor ** (u.levels - 1)
    if m.seq_length % div:
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --u-shorten-factor "
                          f"{u.shorten_factor}^{u.levels - 1} = {div} (every level's sequence must be whole)")
    if sequence_parallel:
        raise ConfigError("--sequence-parallel is not supported by the U-Transformer (its levels have different "
                          "sequence lengths); drop the flag")


# ---- the flat block list and the stage graph ------------------------------------------------------
@dataclass(frozen=True)
class UBlock:
    index: int   # global block index: parameters layers.<index>.…
    level: int
    path: str    # "enc" (levels 0..L-1; L-1 is the bottom) or "dec" (levels L-2..0)
    first: bool  # first block of its level on its path (down/conv or up/merge/conv run before it)
    last: bool   # last block of its level on its path (an encoder level's output is its skip tensor)


@dataclass(frozen=True)
class UPlan:
    """The U unrolled: blocks in execution order, every level's shape, where skips go."""

    u: UTransformerConfig
    seq_length: int
    blocks: tuple[UBlock, ...]

    @classmethod
    def build(cls, u: UTransformerConfig, seq_length: int) -> "UPlan":
        blocks: list[UBlock] = []
        order = [("enc", k) for k in range(u.levels)] + [("dec", k) for k in range(u.levels - 2, -1, -1)]
        for path, k in order:
            n = u.blocks_per_level[k]
            for i in range(n):
                blocks.append(UBlock(len(blocks), k, path, i == 0, i == n - 1))
        return cls(u, seq_length, tuple(blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def seq(self, level: int) -> int:
        return self.seq_length // self.u.shorten_factor ** level

    def width(self, level: int) -> int:
        return self.u.widths[level]

    def skip_producer(self, level: int) -> int:
        """Index of encoder level ``level``'s last block (its output is the skip tensor)."""
        return next(b.index for b in self.blocks if b.path == "enc" and b.level == level and b.last)

    def skip_consumer(self, level: int) -> int:
        """Index of decoder level ``level``'s first block (the merge runs right before it)."""
        return next(b.index for b in self.blocks if b.path == "dec" and b.level == level and b.first)

    @staticmethod
    def skip_name(level: int) -> str:
        return f"skip{level}"

    def skip_edges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, str]]:
        """(src stage, dst stage, name) of every skip crossing stages, for ``PipelineGraph``."""
        def stage_of(j: int) -> int:
            return next(i for i, (a, b) in enumerate(ranges) if a <= j < b)
        out = []
        for k in range(self.u.levels - 1):
            s, d = stage_of(self.skip_producer(k)), stage_of(self.skip_consumer(k))
            if s != d:
                out.append((s, d, self.skip_name(k)))
        return out

    def boundary_shape(self, last_block: int, batch: int) -> tuple[int, int, int]:
        """Global ``[s_k, batch, w_k]`` of the hidden state after block ``last_block``."""
        k = self.blocks[last_block].level
        return (self.seq(k), batch, self.width(k))

    def skip_shape(self, level: int, batch: int) -> tuple[int, int, int]:
        return (self.seq(level), batch, self.width(level))


# ---- layers ---------------------------------------------------------------------------------------
def _replicated(t: torch.Tensor, device, dtype) -> nn.Parameter:
    p = nn.Parameter(t.to(device=device, dtype=dtype).contiguous())
    set_tensor_model_parallel_attributes(p, False, -1)
    return p


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, std, generator=param_init_generator(seed, name))


class ReplicatedLinear(nn.Module):
    """A small linear layer replicated over tp (weights from (seed, name))."""

    def __init__(self, name: str, n_in: int, n_out: int, seed: int, std: float, device, dtype) -> None:
        super().__init__()
        self.weight = _replicated(_normal(seed, f"{name}.weight", (n_out, n_in), std), device, dtype)
        self.bias = _replicated(torch.zeros(n_out), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class CausalDepthwiseConv(nn.Module):
    """``x + conv(x)`` with a depthwise kernel over the sequence, left-padded: position i sees i-K+1 .. i."""

    def __init__(self, name: str, width: int, kernel: int, seed: int, std: float, device, dtype) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = _replicated(_normal(seed, f"{name}.weight", (width, 1, kernel), std), device, dtype)
        self.bias = _replicated(torch.zeros(width), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, w]
        xt = F.pad(x.permute(1, 2, 0), (self.kernel - 1, 0))          # [b, w, K-1+s]
        y = F.conv1d(xt, self.weight, self.bias, groups=self.weight.shape[0])
        return x + y.permute(2, 0, 1)


def shorten(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``[s, b, w] -> [s/f, b, w]``: shift right by f-1 (zeros in front), then average f positions."""
    s, b, w = x.shape
    shifted = F.pad(x, (0, 0, 0, 0, factor - 1, 0))[:s]
    return shifted.reshape(s // factor, factor, b, w).mean(1)


def upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``[s', b, w] -> [s'·f, b, w]``: position i takes shortened position i // f."""
    return x.repeat_interleave(factor, dim=0)


# ---- the model --------------------------------------------------------------------------------------
class UTransformerModel(nn.Module):
    """The U-Transformer (or one pipeline stage of it: blocks ``layer_range`` of the flat list)."""

    tied_embedding = False  # the trainer must not sum an embedding/output-layer gradient pair
    sequence_parallel = False

    def __init__(self, cfg: ModelConfig, u: UTransformerConfig, ctx: ParallelContext, *, seed: int = 1234,
                 pre_process: bool = True, post_process: bool = True, layer_range: tuple[int, int] | None = None,
                 device: torch.device | str | None = None, params_dtype: torch.dtype = torch.float32,
                 recompute_granularity: str | None = None, recompute_num_layers: int | None = None,
                 streams: RNGStreams | None = None) -> None:
        super().__init__()
        check_utransformer_config(u, cfg)
        if recompute_granularity is not None and recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES} or None")
        tp = ctx.tp_size
        if cfg.num_attention_heads % tp:
            raise ConfigError(f"num_attention_heads {cfg.num_attention_heads} is not divisible by tensor-parallel "
                              f"size {tp}")
        self.cfg, self.u, self.ctx, self.seed = cfg, u, ctx, seed
        self.plan = plan = UPlan.build(u, cfg.seq_length)
        self.layer_range = tuple(layer_range) if layer_range is not None else (0, plan.num_blocks)
        a, b = self.layer_range
        if not 0 <= a < b <= plan.num_blocks:
            raise ConfigError(f"layer_range {self.layer_range} must lie in 0..{plan.num_blocks} (the U has "
                              f"{plan.num_blocks} blocks)")
        self.pre_process, self.post_process = pre_process, post_process
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        # ``streams``: shared by the model chunks of one rank (virtual stages), so they draw one sequence
        self.streams = streams if streams is not None else RNGStreams.for_context(seed, ctx, self.device)
        dev, dt, std = self.device, params_dtype, cfg.init_method_std

        def level_cfg(k: int) -> ModelConfig:
            w = u.widths[k]
            return dataclasses.replace(cfg, hidden_size=w, ffn_hidden_size=4 * w, num_layers=plan.num_blocks)

        if pre_process:
            self.embedding = GPTEmbedding(level_cfg(0), ctx, self.padded_vocab_size, seed, False, dev, dt)
        mine = plan.blocks[a:b]
        self.layers = nn.ModuleDict({str(blk.index): TransformerLayer(level_cfg(blk.level), ctx, blk.index, seed,
                                                                      False, self.streams, dev, dt)
                                     for blk in mine})
        self.enc_conv, self.down = nn.ModuleDict(), nn.ModuleDict()
        self.up, self.merge, self.dec_conv = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
        for blk in mine:
            if not blk.first:
                continue
            k, w = blk.level, u.widths[blk.level]
            if blk.path == "enc":
                if k > 0:
                    self.down[str(k)] = ReplicatedLinear(f"down.{k}", u.widths[k - 1], w, seed, std, dev, dt)
                self.enc_conv[str(k)] = CausalDepthwiseConv(f"enc_conv.{k}", w, u.conv_kernel, seed, std, dev, dt)
            else:
                self.up[str(k)] = ReplicatedLinear(f"up.{k}", u.widths[k + 1], w, seed, std, dev, dt)
                if u.skip_merge == "concat":
                    self.merge[str(k)] = ReplicatedLinear(f"merge.{k}", 2 * w, w, seed, std, dev, dt)
                self.dec_conv[str(k)] = CausalDepthwiseConv(f"dec_conv.{k}", w, u.conv_kernel, seed, std, dev, dt)
        # skips this stage produces for a later stage / consumes from an earlier one
        self.skips_out = [plan.skip_name(k) for k in range(u.levels - 1)
                          if a <= plan.skip_producer(k) < b and not a <= plan.skip_consumer(k) < b]
        self.skips_in = [plan.skip_name(k) for k in range(u.levels - 1)
                         if a <= plan.skip_consumer(k) < b and not a <= plan.skip_producer(k) < b]
        if post_process:
            w0, V, Vp = u.widths[0], cfg.vocab_size, self.padded_vocab_size
            self.final_layernorm = _norm(level_cfg(0), False, dev, dt)

            def head_init(shape: tuple[int, ...]) -> torch.Tensor:  # real rows drawn, padding rows zero
                full = torch.zeros(shape)
                full[:V] = _normal(seed, "output_layer.weight", (V, w0), std)
                return full
            self.output_layer = ColumnParallelLinear(w0, Vp, ctx, bias=False, init_method=head_init,
                                                     device=dev, dtype=dt)
            self.output_layer.weight.unpadded_rows = V
        self.recompute_num_layers = configure_recompute(self.layers.values(), recompute_granularity,
                                                        recompute_num_layers)

    def set_wgrad_store(self, store: WeightGradStore | None) -> None:
        if store is not None and getattr(self, "_linears_traced", False):
            raise RuntimeError("this stage was compiled with its linear layers traced, so no weight gradient can "
                               "be delayed")
        for m in self.modules():
            if hasattr(m, "wgrad_store"):
                m.wgrad_store = store

    def configure_attention(self, micro_batch_size: int) -> list[str]:
        """The attention kernel of every block at its level's sequence length (models/fusion.py)."""
        lines: list[str] = []
        for blk in self.plan.blocks[self.layer_range[0]:self.layer_range[1]]:
            for line in configure_attention([self.layers[str(blk.index)]], micro_batch_size,
                                            self.plan.seq(blk.level), self.device):
                if line not in lines:
                    lines.append(line)
        return lines

    def compile_regions(self, opts) -> list[str]:
        """Compile every Transformer block in place (models/compile.py); the convolutions, resampling and the
        loss head stay eager (the fused cross-entropy's chunk kernels are compiled)."""
        from .compile import compile_layers, compiled_cross_entropy_kernels, plain_layer_norms

        if opts.scope != "layers":
            raise ConfigError(f"--torch-compile-scope {opts.scope}: the U-Transformer compiles its Transformer "
                              "blocks only (its convolutions and resampling stay eager); use --torch-compile-scope "
                              "layers")
        plain_layer_norms(self)
        names = compile_layers({f"layers.{i}": layer for i, layer in self.layers.items()}, opts)
        self._linears_traced = opts.traceable_linears
        if self.post_process and self.cfg.cross_entropy_loss_fusion:
            self._ce_kernels = compiled_cross_entropy_kernels(opts)
            names.append("cross-entropy chunks")
        return names

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, skips: dict[str, torch.Tensor] | None = None):
        """First stage: ``tokens [b, s]``; later stages: ``hidden [s_k, b, w_k]`` and the skip tensors
        received from earlier stages (``skips={"skip<k>": [s_k, b, w_k]}``).

        Returns per-token losses ``[b, s]`` (post_process with labels), logits ``[b, s, V_pad/tp]``
        (post_process, no labels), or — an intermediate stage — ``{"": hidden, "skip<k>": …}``: the
        chain output and every skip tensor a later stage needs.
        """
        plan, u, f = self.plan, self.u, self.u.shorten_factor
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first stage needs tokens [b, s]")
            x = self.embedding(tokens)
        else:
            if hidden is None:
                raise ValueError("a stage without pre_process needs hidden [s_k, b, w_k] from the previous stage")
            x = hidden
        held = dict(skips or {})
        missing = [n for n in self.skips_in if n not in held]
        if missing:
            raise ValueError(f"blocks {self.layer_range} need skip tensor(s) {missing} from an earlier stage")
        a, b = self.layer_range
        for i, blk in enumerate(plan.blocks[a:b]):
            k = str(blk.level)
            if blk.first and blk.path == "enc":
                if blk.level > 0:
                    x = self.down[k](shorten(x, f))
                x = self.enc_conv[k](x)
            elif blk.first:  # decoder level: up, merge the skip, conv
                x = upsample(self.up[k](x), f)
                skip = held.pop(plan.skip_name(blk.level))
                x = x + skip if u.skip_merge == "add" else self.merge[k](torch.cat([x, skip], dim=-1))
                x = self.dec_conv[k](x)
            layer = self.layers[str(blk.index)]
            x = recompute_checkpoint(layer, x, streams=self.streams) if i < self.recompute_num_layers else layer(x)
            if blk.path == "enc" and blk.last and blk.level < u.levels - 1:
                held[plan.skip_name(blk.level)] = x
        if not self.post_process:
            return {"": x, **{n: held[n] for n in self.skips_out}}
        x = self.final_layernorm(x)
        logits = self.output_layer(x)                       # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1)
        if self.cfg.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(logits, labels.t(), self.ctx, vocab_size=self.vocab_size,
                                                      kernels=getattr(self, "_ce_kernels", None))
        else:
            loss = vocab_parallel_cross_entropy(logits, labels.t(), self.ctx, vocab_size=self.vocab_size)
        return loss.t().contiguous()
