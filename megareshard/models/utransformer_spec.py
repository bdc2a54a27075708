"""The U-Transformer as a model spec (registered as ``"utransformer"``; the model is in ``utransformer.py``).

Its own flags (``--u-*``) come through `add_arguments` / `from_args`; `apply_to` derives the
GPT-shaped fields the rest of the framework reads (``--num-layers`` = the number of blocks, which
the pipeline splits; ``--hidden-size`` = the top width). The stage graph is the chain plus one
named skip edge ``skip<k>`` per skip tensor whose producing and consuming blocks sit on
different stages; each edge carries the global ``[s_k, batch, w_k]`` of its level.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch

from ..config_fields import ConfigError
from ..parallel import TopologyError, parse_stage_layouts
from ..model_spec.graph import Edge, PipelineGraph
from ..model_spec.placement import StageLayout
from ..model_spec.protocol import register_model_spec
from .lm import CausalLMSpec
from .utransformer import (UPlan, UTransformerConfig, UTransformerModel, add_utransformer_args,
                           check_utransformer_config, utransformer_config_from_args)

__all__ = ["UTransformerSpec", "UTRANSFORMER_SPEC"]


class UTransformerSpec(CausalLMSpec):
    """The U-Transformer of shape ``u``: `UTransformerModel` per stage, chain and skip edges."""

    name = "utransformer"

    def __init__(self, u: UTransformerConfig | None = None) -> None:
        self.u = u if u is not None else UTransformerConfig()

    # ---- command line and configuration ------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_utransformer_args(parser)

    def from_args(self, ns: argparse.Namespace) -> "UTransformerSpec":
        return UTransformerSpec(utransformer_config_from_args(ns))

    def apply_to(self, cfg: Any) -> Any:
        """Set the GPT-shaped fields the rest of the framework reads: --num-layers = number of blocks
        (the pipeline splits the flat block list), --hidden-size = the top width (4× for the MLP)."""
        plan = UPlan.build(self.u, cfg.model.seq_length)
        cfg.model.num_layers = plan.num_blocks
        cfg.model.hidden_size = self.u.widths[0]
        cfg.model.ffn_hidden_size = 4 * self.u.widths[0]
        return cfg

    def check(self, cfg: Any) -> None:
        check_utransformer_config(self.u, cfg.model, sequence_parallel=cfg.parallel.sequence_parallel)
        if cfg.parallel.stage_layouts:
            try:
                layouts = parse_stage_layouts(cfg.parallel.stage_layouts)
            except TopologyError as e:
                raise ConfigError(str(e)) from None
            tps = [(i, t) for i, (t, _) in enumerate(layouts)]
        else:
            tps = [(None, cfg.tp)]
        for i, t in tps:
            where = f"stage {i}'s tp {t}" if i is not None else f"--tensor-model-parallel-size {t}"
            for k, w in enumerate(self.u.widths):
                if w % t:
                    raise ConfigError(f"--u-widths: level {k}'s width {w} is not divisible by {where}")
            if cfg.model.num_attention_heads % t:
                raise ConfigError(f"--num-attention-heads {cfg.model.num_attention_heads} is not divisible by {where}")

    def plan(self, cfg: Any) -> UPlan:
        return UPlan.build(self.u, cfg.model.seq_length)

    # ---- placement ---------------------------------------------------------------------------------
    # stage_layouts: the default (R,S0,R everywhere: `check` refuses sequence parallelism)

    def graph(self, cfg: Any, layouts: Sequence[StageLayout]) -> PipelineGraph:
        ranges = [lay.layer_range for lay in layouts]
        return PipelineGraph(len(layouts), tuple(self.plan(cfg).skip_edges(ranges)))

    def edge_shapes(self, cfg: Any, layouts: Sequence[StageLayout], batch: int) -> dict[Edge, tuple[int, ...]]:
        """Chain edges: the shape of the level at each cut; skip edges: their level's shape."""
        plan, graph = self.plan(cfg), self.graph(cfg, layouts)
        shapes = {}
        for e in graph.edges:
            if e.is_chain:
                shapes[e] = plan.boundary_shape(layouts[e.src].layer_range[1] - 1, batch)
            else:
                shapes[e] = plan.skip_shape(int(e.name[len("skip"):]), batch)
        return shapes

    # ---- modules -----------------------------------------------------------------------------------
    def build_model(self, cfg: Any, ctx: Any, layout: StageLayout | None, *, num_stages: int, seed: int,
                    device: torch.device, **model_kwargs: Any) -> UTransformerModel:
        if layout is None:
            return UTransformerModel(cfg.model, self.u, ctx, seed=seed, device=device, **model_kwargs)
        return UTransformerModel(cfg.model, self.u, ctx, seed=seed, pre_process=layout.stage == 0,
                                 post_process=layout.stage == num_stages - 1, layer_range=layout.layer_range,
                                 device=device, **model_kwargs)

    # ---- accounting --------------------------------------------------------------------------------
    def flops_per_iteration(self, cfg: Any, global_batch: int) -> float:
        """Training FLOPs (3 × forward): blocks at their level's width and length, plus the logits."""
        plan, V = self.plan(cfg), cfg.model.vocab_size
        fwd = 0.0
        for blk in plan.blocks:
            s, w = plan.seq(blk.level), plan.width(blk.level)
            fwd += s * (24 * w * w + 4 * s * w)
        fwd += 2 * plan.seq_length * self.u.widths[0] * V
        return 3.0 * fwd * global_batch


UTRANSFORMER_SPEC = register_model_spec(UTransformerSpec())
