"""The GPT as a model spec (registered as ``"gpt"``): GPT-2/3 and Llama-style decoders alike.

A Llama-style decoder is the same GPT with Megatron-LM's flags (RMSNorm, rotary embeddings,
SwiGLU, grouped-query attention, untied output layer, no biases), so one spec serves both.
The stage graph is a plain chain; every edge carries the hidden states ``[s, b, h]`` of the
global microbatch, laid out ``R,S0,R`` (``S1,S0,R`` under sequence parallelism) on each stage.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..model_spec.graph import Edge
from ..model_spec.placement import StageLayout
from ..model_spec.protocol import register_model_spec
from .gpt import GPTModel, model_flops_per_iteration
from .lm import CausalLMSpec

__all__ = ["GPTSpec", "GPT_SPEC"]


class GPTSpec(CausalLMSpec):
    """The GPT decoder: `GPTModel` per stage, hidden-state chain edges, Megatron's FLOP count."""

    name = "gpt"

    def edge_shapes(self, cfg: Any, layouts: Sequence[StageLayout], batch: int) -> dict[Edge, tuple[int, ...]]:
        """``[seq, batch, hidden]`` on every edge: the global microbatch (micro batch × dp; with per-stage
        layouts × the largest dp), whatever the two stages' layouts — each end shards it over its own dp."""
        shape = (cfg.model.seq_length, batch, cfg.model.hidden_size)
        return {e: shape for e in self.graph(cfg, layouts).edges}

    def build_model(self, cfg: Any, ctx: Any, layout: StageLayout | None, *, num_stages: int, seed: int,
                    device: torch.device, **model_kwargs: Any) -> GPTModel:
        """The whole GPT, or this rank's stage: its layers, the embedding on the first stage, the head on
        the last.

        A last stage without the embedding holds its own copy of the tied word embedding
        (``output_layer.weight``, initialised identically); ``GPTModel`` marks it
        ``shared_embedding_duplicate`` so the gradient norm counts the pair once, and the trainer
        all-reduces the two copies' gradients over ``ctx.embedding_group`` (nothing to tie with
        ``--untie-embeddings-and-output-weights``).
        """
        sp = cfg.parallel.sequence_parallel and ctx.tp_size > 1
        if layout is None:
            return GPTModel(cfg.model, ctx, sequence_parallel=sp, seed=seed, device=device, **model_kwargs)
        return GPTModel(cfg.model, ctx, sequence_parallel=sp, seed=seed, pre_process=layout.stage == 0,
                        post_process=layout.stage == num_stages - 1, layer_range=layout.layer_range,
                        device=device, **model_kwargs)

    def flops_per_iteration(self, cfg: Any, global_batch: int) -> float:
        return model_flops_per_iteration(cfg.model, global_batch)


GPT_SPEC = register_model_spec(GPTSpec())
