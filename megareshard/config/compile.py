"""`CompileConfig`: regional compilation of the model (``--torch-compile``), and the error a failed compile raises.

Lives apart from the models and the trainer so that both read it: the trainer decides whether to
compile (on by default on CUDA, off on CPU), the models compile their own regions
(``models/compile.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import config_field as _f

__all__ = ["CompileConfig", "CompileOptions", "TorchCompileError", "COMPILE_MODES", "COMPILE_SCOPES", "compile_enabled"]

#: torch.compile's modes (None: its default); reduce-overhead adds CUDA graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: what one torch.compile covers: each Transformer layer and the loss head, or the whole model
COMPILE_SCOPES = ("layers", "model")


class TorchCompileError(RuntimeError):
    """torch.compile could not compile a region of the model: the message names the region and the way out
    (``--no-torch-compile``). It stops the run in one line, like a failed checkpoint save."""


@dataclass
class CompileConfig:
    """Regional compilation: each Transformer layer and the loss head compiled with torch.compile."""

    torch_compile: bool | None = _f(None, "compile each Transformer layer and the loss head with torch.compile, "
                                          "so their element-wise chains fuse (default: on with CUDA, off on CPU; "
                                          "--no-torch-compile turns it off)")
    torch_compile_backend: str = _f("inductor", "torch.compile backend (inductor: generated kernels; aot_eager: "
                                                "the same graphs run by PyTorch's own kernels, for checking)")
    torch_compile_mode: str = _f("default", "torch.compile mode (max-autotune-no-cudagraphs searches kernel "
                                            "configurations, longer to compile; reduce-overhead and max-autotune "
                                            "add CUDA graphs, which cannot train here: refused)",
                                 choices=COMPILE_MODES)
    torch_compile_scope: str = _f("layers", "what one torch.compile covers: layers (each Transformer layer and the "
                                            "loss head; layers of one shape share a compiled graph, so depth costs "
                                            "no compile time) or model (the whole model, embedding to loss, one "
                                            "graph: fusions across layer boundaries and one call instead of one per "
                                            "layer, for small models; compile time grows with depth; one pipeline "
                                            "stage, tp 1, no recomputation, no experts)", choices=COMPILE_SCOPES)


@dataclass(frozen=True)
class CompileOptions:
    """How a model compiles its regions (``model.compile_regions(options)``): torch.compile's ``backend`` (a
    name or a callable) and ``mode``, whether the linear layers are traced (False when a weight gradient
    may be delayed: the delayable linear stays outside the compiled regions), and the ``scope`` of one
    compilation (``COMPILE_SCOPES``)."""

    backend: Any = "inductor"
    mode: str | None = None
    traceable_linears: bool = True
    scope: str = "layers"

    def torch_compile_kwargs(self) -> dict[str, Any]:
        return dict(backend=self.backend, dynamic=False, mode=None if self.mode in (None, "default") else self.mode)

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")


def compile_enabled(c: CompileConfig, device_type: str) -> bool:
    """Whether the run compiles: as asked, or by default on CUDA only."""
    return c.torch_compile if c.torch_compile is not None else device_type == "cuda"
