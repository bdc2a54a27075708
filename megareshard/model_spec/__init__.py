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
from .graph import Edge, EdgeTensor, PipelineGraph, ScheduleError
from .protocol import (BUILTIN_MODEL_SPECS, DEFAULT_MODEL_SPEC, ModelSpec, declare_edges, get_model_spec,
                         model_spec_names, register_model_spec)
from .placement import StageLayout, hidden_spec, split_layers, stage_layouts, stage_mesh, stage_tp_dp

__all__ = ["Edge", "EdgeTensor", "PipelineGraph", "ScheduleError", "ModelSpec", "register_model_spec",
           "get_model_spec", "model_spec_names", "BUILTIN_MODEL_SPECS", "DEFAULT_MODEL_SPEC", "declare_edges",
           "StageLayout", "hidden_spec", "split_layers", "stage_layouts", "stage_mesh", "stage_tp_dp"]
