"""A residual MLP language model (no attention) as a model spec: every token is embedded, passes through
residual GELU blocks built from megareshard's tensor-parallel layers, and a vocabulary-parallel head scores
the next token. It trains in any tp × pp × dp layout the GPT does (delayed weight gradients aside)."""
from typing import Any, Sequence

import torch
from torch import nn

from megareshard.models.lm import CausalLMSpec
from megareshard.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         vocab_parallel_cross_entropy)


class MLPLM(nn.Module):
    """Layers ``layer_range`` of the model; the embedding on the first stage, the head on the last."""

    sequence_parallel = False  # what the trainer asks of a stage module
    tied_embedding = False

    def __init__(self, cfg: Any, ctx: Any, layer_range: Sequence[int], first: bool, last: bool, seed: int) -> None:
        super().__init__()
        h, vocab, tp = cfg.model.hidden_size, cfg.model.vocab_size, ctx.tp_size
        self.ctx, self.vocab = ctx, vocab
        torch.manual_seed(seed)  # the ends and each block seeded by its global index: every layout, one model
        padded = -(-vocab // tp) * tp
        self.embedding = VocabParallelEmbedding(vocab, h, ctx, padded_num_embeddings=padded) if first else None
        blocks = {}
        for i in range(*layer_range):
            torch.manual_seed(seed + 1 + i)
            blocks[str(i)] = nn.ModuleList([nn.LayerNorm(h), ColumnParallelLinear(h, 4 * h, ctx),
                                            RowParallelLinear(4 * h, h, ctx)])
        self.layers = nn.ModuleDict(blocks)
        torch.manual_seed(seed + 1 + cfg.model.num_layers)
        self.head = ColumnParallelLinear(h, padded, ctx, bias=False) if last else None

    def forward(self, tokens=None, labels=None, hidden=None):
        x = self.embedding(tokens.t()) if self.embedding is not None else hidden  # [s, b, h]
        for norm, up, down in self.layers.values():
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        if self.head is None:
            return x
        return vocab_parallel_cross_entropy(self.head(x), labels.t(), self.ctx, self.vocab)


class MLPLMSpec(CausalLMSpec):
    name = "mlp-lm"

    def edge_shapes(self, cfg: Any, layouts: Sequence[Any], batch: int) -> dict:
        return {e: (cfg.model.seq_length, batch, cfg.model.hidden_size) for e in self.graph(cfg, layouts).edges}

    def build_model(self, cfg: Any, ctx: Any, layout: Any, *, num_stages: int, seed: int, device: torch.device,
                    **model_kwargs: Any) -> MLPLM:
        if layout is None:
            return MLPLM(cfg, ctx, (0, cfg.model.num_layers), True, True, seed).to(device)
        return MLPLM(cfg, ctx, layout.layer_range, layout.stage == 0, layout.stage == num_stages - 1, seed).to(device)

    def flops_per_iteration(self, cfg: Any, global_batch: int) -> float:
        m = cfg.model
        per_token = m.num_layers * 2 * 8 * m.hidden_size ** 2 + 2 * m.hidden_size * m.vocab_size
        return 3 * per_token * global_batch * m.seq_length  # forward + backward (2x)


MLP_LM = MLPLMSpec()
