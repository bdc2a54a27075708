"""The model seam: model specs and their registry, the stage graph, stage placement.

Neutral ground between the models (``megareshard.models``), which implement a `ModelSpec`, and
the trainer and the pipeline engine, which use one: nothing here imports a model, the pipeline
runtime, the trainer or the command-line module.

    spec = get_model_spec("gpt")                      # or "utransformer", or a registered one
    layouts = spec.stage_layouts(cfg, topology)       # layers, mesh, boundary layout per stage
    graph = spec.graph(cfg, layouts)                  # chain + skip edges
    decls = spec.edge_tensors(cfg, layouts, batch=b, dtype=torch.float32)
    stage = spec.build_model(cfg, ctx, layouts[i], num_stages=len(layouts), seed=s, device=d)
    loss = spec.forward_step(model, microbatch, device, num_microbatches=m)
"""
from __future__ import annotations

import importlib
from typing import Any

from .graph import Edge, EdgeTensor, PipelineGraph, ScheduleError

# the rest loads on first use: the schedule IR (``megareshard.pipeline``) imports the graph, and
# stays free of torch and of the process-group code that placement and the protocol bring
_LAZY = {**dict.fromkeys(["ModelSpec", "register_model_spec", "get_model_spec", "model_spec_names",
                          "BUILTIN_MODEL_SPECS", "DEFAULT_MODEL_SPEC", "declare_edges"], ".protocol"),
         **dict.fromkeys(["StageLayout", "hidden_spec", "split_layers", "stage_layouts", "stage_mesh",
                          "stage_tp_dp"], ".placement")}

__all__ = ["Edge", "EdgeTensor", "PipelineGraph", "ScheduleError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
