"""Regional compilation (``--torch-compile``): each Transformer layer, and the loss head, compiled with torch.compile.

As torchtitan's ``apply_compile`` does (one ``torch.compile`` per Transformer block: the blocks share one
compiled graph, so compiling 24 layers costs what one does), with three differences:

* **in place**: the layer's ``_compiled_call_impl`` is set (what ``nn.Module.compile`` sets), instead of
  wrapping the layer in an ``OptimizedModule``: parameter, state-dict and checkpoint names stay the model's
  own (no ``_orig_mod.``), so checkpoints load across compiled and eager runs;
* **graph breaks where the program's order matters** (``compile_boundary``): tensor-parallel collectives,
  dropout from megareshard's RNG streams, recomputation's replay, fusions switched off, and — when the
  run may delay weight gradients (``--delay-wgrad-compute``, zb-h1, zbv, schedule files) — the linear
  layers, whose autograd Function decides at backward time whether the weight gradient is queued for W.
  Otherwise the linear layers are marked ``traceable`` and compiled with their neighbours (a stage then
  refuses a weight-gradient store: nothing could be delayed);
* **a failed compile names its region** and says to pass ``--no-torch-compile`` (`TorchCompileError`),
  for the forward and, compiled at the same first call, the backward; a region that would exceed
  torch.compile's recompilation limit fails the same way instead of silently running eagerly
  (`prepare_compiler`).

Full-layer recomputation wraps the compiled layer (non-reentrant checkpoint replays the compiled graph);
selective recomputation runs the attention core eagerly, inside the checkpoint.

``--torch-compile-scope model`` compiles the whole model instead (`compile_module`): one graph from the embedding
to the loss (the fused cross-entropy's chunks traced into it), fused across layer boundaries and called once
instead of once per layer; every layer is traced anew, so compile time grows with depth (small models). The same
graph breaks apply (dropout from the RNG streams splits it); where the model is not one graph it is refused
(``compile_config.check_compile_scope``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ..compile_boundary import prepare_graph_breaks
from ..compile_config import CompileOptions, TorchCompileError, compiler_failure

__all__ = ["compile_layers", "compile_module", "compile_function", "compiled_cross_entropy_kernels", "mark_linears_traceable",
           "plain_layer_norms", "prepare_compiler", "guarded"]


#: recompilations allowed per code object: a graph break inside a submodule (a collective in a linear layer)
#: makes torch.compile compile that submodule's code on its own, once per shape it runs at (qkv, fc1, ...)
RECOMPILE_LIMIT = 64


def prepare_compiler() -> None:
    """torch.compile's settings for compiled regions, set for the process (a training process compiles its
    model's regions only; patching them around every call would cost more than the call): a region's backward
    is compiled with its forward, at its first call, so a failure is reported there, naming the region,
    instead of later from inside autograd; recompiling past `RECOMPILE_LIMIT` is an error instead of a silent
    fall back to eager."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # older name
    setattr(cfg, limit, max(getattr(cfg, limit), RECOMPILE_LIMIT))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def guarded(compiled: Callable, name: str, opts: CompileOptions) -> Callable:
    """``compiled`` whose compiler errors become one `TorchCompileError` naming region ``name``."""
    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except Exception as e:
            if not compiler_failure(e):
                raise
            what = str(e).strip().splitlines()
            raise TorchCompileError(f"torch.compile (backend {opts.backend_name}) failed on {name}: "
                                    f"{what[0] if what else type(e).__name__}; pass --no-torch-compile to run "
                                    "without compiling") from e
    return call


def mark_linears_traceable(module: nn.Module, traceable: bool) -> None:
    """Set ``traceable`` on every linear layer under ``module`` (the tensor-parallel layers carry it)."""
    for m in module.modules():
        if hasattr(m, "traceable") and hasattr(m, "wgrad_store"):
            m.traceable = traceable


def plain_layer_norms(module: nn.Module) -> None:
    """apex's FusedLayerNorm (used on GPU when importable) is a CUDA extension the compiler cannot trace:
    inside a compiled region it becomes torch's LayerNorm holding the very same parameters, which the
    compiler fuses with its neighbours."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ == "FusedLayerNorm" and isinstance(child, nn.Module):
                plain = nn.LayerNorm(child.normalized_shape, eps=child.eps, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, child_name, plain)


def compile_layers(layers: Mapping[str, nn.Module], opts: CompileOptions) -> list[str]:
    """Compile each module of ``layers`` (name → Transformer layer) in place; returns the region names."""
    prepare_graph_breaks()
    prepare_compiler()
    names = []
    for name, layer in layers.items():
        mark_linears_traceable(layer, opts.traceable_linears)
        layer._compiled_call_impl = guarded(torch.compile(layer._call_impl, **opts.torch_compile_kwargs()),
                                             name, opts)
        names.append(name)
    return names


def compile_module(module: nn.Module, name: str, opts: CompileOptions) -> None:
    """``--torch-compile-scope model``: ``module`` compiled whole, in place, as region ``name`` (its submodules are
    traced into the one graph; nothing inside it is compiled on its own)."""
    prepare_graph_breaks()
    prepare_compiler()
    mark_linears_traceable(module, opts.traceable_linears)
    module._compiled_call_impl = guarded(torch.compile(module._call_impl, **opts.torch_compile_kwargs()), name, opts)


def compile_function(fn: Callable, name: str, opts: CompileOptions, modules: Iterable[nn.Module] = ()) -> Callable:
    """``fn`` compiled as region ``name``; the linear layers of ``modules`` (what it calls) marked as a
    layer's are."""
    prepare_graph_breaks()
    prepare_compiler()
    for m in modules:
        mark_linears_traceable(m, opts.traceable_linears)
    return guarded(torch.compile(fn, **opts.torch_compile_kwargs()), name, opts)


def compiled_cross_entropy_kernels(opts: CompileOptions):
    """The fused cross-entropy's chunk functions compiled (``tensor_parallel.fused_cross_entropy``), as region
    "cross-entropy chunks"."""
    from ..tensor_parallel.fused_cross_entropy import CrossEntropyKernels, compiled_kernels

    prepare_compiler()
    # CUDA graphs (reduce-overhead) would copy every chunk, a view at a new address, into its static buffers
    k = compiled_kernels(opts.backend, None if opts.mode == "reduce-overhead" else opts.mode)
    name = "the fused cross-entropy's chunks"
    return CrossEntropyKernels(guarded(k.stats, name, opts), guarded(k.grad, name, opts), k.name, k.fuses)
