"""The model seam: what the trainer and the pipeline engine need from a model, and a registry of models.

Modelled on torchtitan's train spec (``torchtitan/protocols/train_spec.py``: a spec per model,
``register_train_spec`` / ``get_train_spec``, built-in models found by name). A `ModelSpec`

* builds the **stage graph** (named chain and skip edges) for a placement of stages,
* gives the **stage layouts** (layers, mesh and boundary layout of every stage),
* declares every edge's **tensor** (global shape, dtype, sharding spec at both ends),
* builds the **stage module** of a placement (stage index, layer range, layout), or the whole
  model without pipeline parallelism,
* owns the **forward step** (microbatch dict → model outputs → loss, the normalisation over
  microbatches included), which the single-process path (``training.forward_backward``) and
  the pipeline runtime's stages both call, and
* counts the **FLOPs** of an iteration (for the TFLOP/s of the log line).

The trainer and the pipeline engine import this module, never a model; the models import it,
never the pipeline runtime, the trainer or the command-line module. The entry points
(``pretrain_gpt.py``, ``pretrain_utransformer.py``) pick a spec by name and pass it on.

Registry: ``register_model_spec(spec)`` adds one under ``spec.name`` (a user's model, from
outside the package); ``get_model_spec(name)`` returns it, importing a built-in model's module
first (`BUILTIN_MODEL_SPECS`: its import registers the spec), as torchtitan's ``get_train_spec``
does for its own models.
"""
from __future__ import annotations

import abc
import argparse
from typing import Any, Mapping, Sequence

import torch

from ..registry import Registry
from .graph import Edge, EdgeTensor, PipelineGraph
from .placement import StageLayout, stage_layouts

__all__ = ["ModelSpec", "MODEL_SPECS", "register_model_spec", "get_model_spec", "model_spec_names", "BUILTIN_MODEL_SPECS",
           "DEFAULT_MODEL_SPEC", "declare_edges"]

#: the built-in models: name -> module whose import registers the spec (found on first use)
BUILTIN_MODEL_SPECS: Mapping[str, str] = {
    "gpt": "megareshard.models.gpt_spec",
    "utransformer": "megareshard.models.utransformer_spec",
}
#: the model a Trainer builds when given none (what ``pretrain_gpt.py`` trains)
DEFAULT_MODEL_SPEC = "gpt"


class ModelSpec(abc.ABC):
    """One model as the trainer and the pipeline engine see it (see the module docstring).

    ``cfg`` below is the run's configuration (``arguments.Config``: ``cfg.model`` is the
    ``ModelConfig``), read by attribute; a spec with its own shape options (the U-Transformer's
    ``--u-*``) holds them and adds their flags through `add_arguments` / `from_args`.
    """

    name: str = ""
    #: the builders of the run's pieces — tokenizer, optimizer, learning-rate schedule, data, checkpointer,
    #: trackers — that the trainer assembles (``components.Components``, torchtitan's train spec); None: the
    #: defaults (``components.DEFAULTS``). A spec replaces some with ``DEFAULTS.replace(build_data=...)``.
    components: Any = None

    # ---- command line and configuration ------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the model's own flags to the trainer's parser (none by default)."""
        return parser

    def from_args(self, ns: argparse.Namespace) -> "ModelSpec":
        """The spec configured by its own flags in ``ns`` (itself by default)."""
        return self

    def apply_to(self, cfg: Any) -> Any:
        """Derive the configuration fields the rest of the framework reads from the model's own shape
        (e.g. ``--num-layers``); nothing by default. Returns ``cfg``."""
        return cfg

    def check(self, cfg: Any) -> None:
        """Refuse a configuration the model cannot run, with the numbers (``ConfigError``); runs before
        anything is built. Nothing by default (the model's constructor checks its own shape)."""

    # ---- placement: stage layouts, the stage graph, the edges' tensors -----------------------
    def stage_layouts(self, cfg: Any, topology: Any, placement: Sequence[int] | None = None) -> list[StageLayout]:
        """Every stage's layer range, mesh and boundary layout (default: ``[s, b, h]`` hidden states);
        ``placement``: every stage's mesh (default stage s on mesh s; virtual stages: ``pp × V`` entries)."""
        return stage_layouts(cfg, topology, placement)

    def graph(self, cfg: Any, layouts: Sequence[StageLayout]) -> PipelineGraph:
        """The stage graph for these layouts: a plain chain by default (no skip edges)."""
        return PipelineGraph(len(layouts))

    @abc.abstractmethod
    def edge_shapes(self, cfg: Any, layouts: Sequence[StageLayout], batch: int) -> dict[Edge, tuple[int, ...]]:
        """Every edge's global tensor shape, for a global microbatch of ``batch`` samples."""

    def edge_tensors(self, cfg: Any, layouts: Sequence[StageLayout], *, batch: int,
                     dtype: torch.dtype) -> list[EdgeTensor]:
        """Every edge's declared tensor: global shape, dtype, and the producing and consuming stage's mesh
        and sharding spec (each stage's boundary layout)."""
        return declare_edges(self.graph(cfg, layouts), layouts, self.edge_shapes(cfg, layouts, batch), dtype)

    # ---- modules ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def build_model(self, cfg: Any, ctx: Any, layout: StageLayout | None, *, num_stages: int, seed: int,
                    device: torch.device, **model_kwargs: Any) -> torch.nn.Module:
        """This rank's module: the whole model (``layout`` None), or stage ``layout.stage`` of
        ``num_stages`` (its layers ``layout.layer_range``; the first stage takes the batch, the last
        returns what `loss` reads). ``model_kwargs``: ``params_dtype``, ``recompute_granularity``,
        ``recompute_num_layers``."""

    # ---- the forward step ------------------------------------------------------------------------
    @abc.abstractmethod
    def model_inputs(self, batch: dict[str, torch.Tensor], device: torch.device,
                     received: Mapping[str, torch.Tensor], *, first: bool, last: bool) -> dict[str, Any]:
        """The module's keyword arguments for one microbatch: from the batch (first stage: the inputs;
        last stage: the labels) and the tensors ``received`` from earlier stages, keyed by edge name
        (``""``: the chain edge)."""

    @abc.abstractmethod
    def loss(self, output: Any, num_microbatches: int) -> torch.Tensor:
        """The last stage's output → this microbatch's share of the step's loss (a scalar): the mean
        over the step's ``num_microbatches`` microbatches is the sum of the shares."""

    def forward_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, *,
                     num_microbatches: int, received: Mapping[str, torch.Tensor] | None = None,
                     first: bool = True, last: bool = True,
                     autocast_dtype: torch.dtype | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """One microbatch through one stage (the whole model when ``first`` and ``last``).

        Returns the loss share (``last``) or the stage's outputs keyed by edge name (``""``: the
        chain edge). The module runs under autocast to ``autocast_dtype`` when given; the loss is
        taken outside it. The single-process path and the pipeline runtime both call this.
        """
        kwargs = self.model_inputs(batch, device, received or {}, first=first, last=last)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(**kwargs)
        if last:
            return self.loss(out, num_microbatches)
        return out if isinstance(out, dict) else {"": out}

    # ---- accounting ------------------------------------------------------------------------------
    @abc.abstractmethod
    def flops_per_iteration(self, cfg: Any, global_batch: int) -> float:
        """Training FLOPs of one iteration over ``global_batch`` samples (forward and backward)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def declare_edges(graph: PipelineGraph, layouts: Sequence[StageLayout], shapes: Mapping[Edge, Sequence[int]],
                  dtype: torch.dtype) -> list[EdgeTensor]:
    """Each edge's `EdgeTensor`: its shape, the producing stage's mesh and spec, the consuming stage's."""
    missing = [str(e) for e in graph.edges if e not in shapes]
    if missing:
        raise ValueError(f"no tensor shape declared for edge(s) {', '.join(missing)}")
    return [EdgeTensor(e, tuple(shapes[e]), dtype, layouts[e.src].mesh, layouts[e.src].hidden_spec,
                       layouts[e.dst].mesh, layouts[e.dst].hidden_spec) for e in graph.edges]


# ---- the registry ----------------------------------------------------------------------------------
MODEL_SPECS: Registry[ModelSpec] = Registry("model", type_=ModelSpec, lazy=dict(BUILTIN_MODEL_SPECS))


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` under ``spec.name`` (the registry rule: `megareshard.registry`). Returns the spec."""
    return MODEL_SPECS.register(spec)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name`` (a built-in model's module is imported on first use)."""
    return MODEL_SPECS.get(name)


def model_spec_names() -> list[str]:
    """Every model name `get_model_spec` knows (built-in and registered)."""
    return list(MODEL_SPECS.names())
