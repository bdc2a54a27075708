"""Models built from the tensor-parallel layers; parameter names are global (``layers.17``).

Each model is a `megareshard.model_spec.ModelSpec` (``gpt_spec.py``, ``utransformer_spec.py``), found by
name through ``megareshard.model_spec.get_model_spec``. Importing this package loads no model (the
command-line module imports ``models.config``): the names below load their module on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from .config import ModelConfig, check_model_shape

__all__ = ["ModelConfig", "check_model_shape", "GPTModel", "check_gpt_config", "gpt_flops_per_token",
           "model_flops_per_iteration"]

_LAZY = {"GPTModel": ".gpt", "check_gpt_config": ".gpt", "gpt_flops_per_token": ".gpt",
         "model_flops_per_iteration": ".gpt"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
