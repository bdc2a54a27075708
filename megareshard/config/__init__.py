"""The configuration of a run: the bottom floor of the package. Every other module may import it; it imports
nothing else of ours. One dataclass per concern, a docstring per field (also its ``--flag`` help):

* ``fields.py``: ``ConfigError`` and ``config_field`` (and ``registry_choices``: a field's choices named by a
  registry's module and function, so no registry is imported here);
* ``model.py`` (``ModelConfig``), ``parallel.py``, ``pipeline.py``, ``data.py``, ``compile.py``: each concern's
  flags and their pure checks;
* ``run.py``: the run-level sections (memory, training, logging, launch, checkpoint) and ``Config``, which
  gathers them.

``arguments.py`` turns Megatron-LM's flags into a `Config`; ``config_checks.validate`` checks one and returns
it with its resolved ``run_plan.RunPlan``; nothing changes a `Config` after that. The modules these types
lived in before (``config_fields``, ``models.config``, ``data.config``, ``parallel.config``,
``pipeline.config``, ``compile_config``) still answer for them.
"""
from .fields import ConfigError, config_field, registry_choices
from .run import (SECTIONS, CheckpointConfig, Config, LaunchConfig, LoggingConfig, MemoryConfig,
                  TrainingConfig)

__all__ = ["ConfigError", "config_field", "registry_choices", "Config", "SECTIONS", "MemoryConfig", "TrainingConfig",
           "LoggingConfig", "LaunchConfig", "CheckpointConfig"]
