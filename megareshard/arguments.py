"""Megatron-style command-line flags turned into the configuration types of ``config.py``, validated up front.

A thin adapter: each field's ``help`` metadata is its one-line docstring and its ``--flag`` help at once; the flag
name is the field name with dashes (``micro_batch_size`` -> ``--micro-batch-size``) unless the field names
another. `parse_args` returns what `config_checks.validate` returns: the configuration with its resolved run
plan (``cfg.plan``); every error names the values and the reason. The configuration types are re-exported here,
so every import site of Megatron-style code keeps working.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

from . import megatron_flags, plugins
from .config import (SECTIONS, CheckpointConfig, Config, LaunchConfig, LoggingConfig,  # noqa: F401 (re-exported)
                     MemoryConfig, TrainingConfig)
from .config_checks import validate  # noqa: F401 (re-exported: `from megareshard.arguments import validate`)
from .config_fields import ConfigError  # noqa: F401 (re-exported)
from .data.config import DataConfig  # noqa: F401 (re-exported)
from .flag_checks import parse_known_strictly, refuse_repeated_flags
from .models.config import ModelConfig, check_model_shape  # noqa: F401 (re-exported: every import site keeps working)
from .parallel.config import ParallelConfig  # noqa: F401 (re-exported)
from .pipeline.config import PipelineConfig

if TYPE_CHECKING:
    from .model_spec.protocol import ModelSpec


# old or alternative flag -> (its replacement, why)
DEPRECATED = {
    "--batch-size": ("--micro-batch-size", "Megatron renamed it; the global batch is --global-batch-size"),
    "--model-parallel-size": ("--tensor-model-parallel-size", "model parallelism is tp × pp here"),
    "--warmup": ("--lr-warmup-iters", "warm-up is counted in iterations"),
}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _int_or_str(text: str) -> int | str:
    """An integer when the text is one, else the text (Megatron-LM's --moe-layer-freq: N or a 0/1 pattern)."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _base_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("list[str]"):
        return list
    if text.startswith("int | str"):
        return _int_or_str
    for name, t in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return t
    raise TypeError(f"unsupported config field type {annotation!r}")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` placeholders that name the value: ``--num-layers N``, ``--lr LR``, ``--save SAVE`` (argparse's
    default is the destination, ``MODEL.NUM_LAYERS``)."""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type is int:
            return "N"
        return action.option_strings[-1].lstrip("-").upper().replace("-", "_")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add every config field as a flag (grouped by section) plus the deprecated spellings."""
    parser = parser or argparse.ArgumentParser(description="megareshard training", allow_abbrev=False,
                                               formatter_class=HelpFormatter)
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, cls.__doc__)
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag") == "":       # not offered on the command line (yet): its default stands
                continue
            kind = _base_type(f.type)
            dest = f"{section}.{f.name}"
            choices = f.metadata.get("choices")
            choices = choices() if callable(choices) else choices  # a registry's names, read when parsing
            if dest == "pipeline.pipeline_schedule":  # None = not given: it excludes --pipeline-schedule-file
                group.add_argument(_flag(f), dest=dest, type=kind, default=None, help=f.metadata["help"]
                                   + f" (default {f.default})", choices=choices)
            elif kind is bool and f.default is None:  # on, off, or None: decided later (--x / --no-x)
                group.add_argument(_flag(f), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=f.metadata["help"])
            elif kind is bool:  # a field defaulting to True is switched off by its --no-... flag
                group.add_argument(_flag(f), dest=dest, action="store_false" if f.default else "store_true",
                                   default=f.default, help=f.metadata["help"])
            elif kind is list:
                group.add_argument(_flag(f), dest=dest, nargs="+", default=f.default, help=f.metadata["help"],
                                   metavar=f.metadata.get("metavar"))
            else:
                group.add_argument(_flag(f), dest=dest, type=kind, default=f.default, help=f.metadata["help"],
                                   choices=choices, metavar=f.metadata.get("metavar"))
    for old, (new, _) in DEPRECATED.items():
        parser.add_argument(old, dest=f"deprecated{old}", default=None, help=f"deprecated: use {new}")
    megatron_flags.add_megatron_flags(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace) -> Config:
    refused, _ = megatron_flags.refusals(ns, [])
    if refused:
        raise ConfigError(f"not supported by megareshard: {', '.join(refused)}")
    values = vars(ns)
    used = [old for old in DEPRECATED if values.get(f"deprecated{old}") is not None]
    if used:
        old = used[0]
        new, why = DEPRECATED[old]
        raise ConfigError(f"{old} is deprecated: use {new} ({why})")
    values = dict(values)
    schedule, schedule_file = values.get("pipeline.pipeline_schedule"), values.get("pipeline.pipeline_schedule_file")
    if schedule is not None and schedule_file is not None:
        raise ConfigError(f"--pipeline-schedule {schedule} and --pipeline-schedule-file {schedule_file} conflict: "
                          "the file is the schedule; give one of them")
    if schedule is None:
        values["pipeline.pipeline_schedule"] = PipelineConfig.pipeline_schedule
    mapped = []
    if megatron_flags.given(ns, "--use-flash-attn"):  # Megatron-LM's older spelling
        backend = values["model.attention_backend"]
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn and --attention-backend {backend} conflict: give one")
        values["model.attention_backend"] = "flash"
        mapped.append("--use-flash-attn (runs as --attention-backend flash)")
    kwargs = {}
    for section, cls in SECTIONS.items():
        kwargs[section] = cls(**{f.name: values[f"{section}.{f.name}"] for f in dataclasses.fields(cls)
                                 if f"{section}.{f.name}" in values})
    notes = megatron_flags.no_effect_flags(ns) + mapped
    megatron_flags.apply_mapped_flags(ns, kwargs["model"], notes)  # old spellings of flags we have
    return Config(**kwargs, notes=notes)


def _parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; Megatron-LM flags for features not built here, and unknown flags, end in one
    ConfigError naming every one of them (never argparse's "unrecognized arguments")."""
    if argv is None:  # the process's command line: a flag typed twice is refused (code may append overrides)
        argv = sys.argv[1:]
        refuse_repeated_flags(parser, argv)
    ns, unknown = parse_known_strictly(parser, argv)
    refused, strange = megatron_flags.refusals(ns, unknown)
    if refused or strange:
        parts = []
        if refused:
            parts.append(f"not supported by megareshard: {', '.join(refused)}")
        if strange:
            named = " ".join(_with_nearest_flag(name, parser) for name in strange)
            parts.append(f"unknown flag(s) {named}: neither megareshard's nor one of the Megatron-LM flags it knows (see --help)")
        raise ConfigError("; ".join(parts))
    if unknown:
        raise ConfigError(f"unexpected argument(s) {' '.join(unknown)}")
    return ns


def _argv(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
def _with_nearest_flag(name: str, parser: argparse.ArgumentParser) -> str:
    """``name``, followed by the known flag it most likely misspells: ``--tensor-model-paralel-size (did you mean
    --tensor-model-parallel-size?)``."""
    import difflib

    known = [flag for flag in parser._option_string_actions if flag.startswith("--")]  # no public list
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f"{name} (did you mean {near[0]}?)" if near else name


def _world_size(world_size: int | None) -> int:
    return world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> Config:
    """Parse Megatron-style flags and validate them for ``world_size`` (default: ``$WORLD_SIZE`` or 1).

    Megatron-LM flags for features not built here, and unknown flags, end in one ConfigError naming
    every one of them (never argparse's "unrecognized arguments")."""
    plugins.import_modules(plugins.custom_imports(_argv(argv)))  # before the parser lists registered choices
    return validate(config_from_namespace(_parse_flags(build_parser(), argv)), _world_size(world_size))


def parse_model_args(model: str | ModelSpec, argv: Sequence[str] | None = None,
                     world_size: int | None = None) -> tuple[Config, ModelSpec]:
    """The trainer's flags plus the model's own (``spec.add_arguments``, e.g. the U-Transformer's
    ``--u-*``), for the model registered as ``model`` (or that spec): the validated Config, with the
    fields the model derives from its shape set (``spec.apply_to``), and the spec its flags configure.
    What an entry point such as ``pretrain_utransformer.py`` hands to ``training.pretrain``."""
    plugins.import_modules(plugins.custom_imports(_argv(argv)))  # before the parser lists registered choices
    from .model_spec.protocol import get_model_spec

    spec = get_model_spec(model) if isinstance(model, str) else model
    parser = spec.add_arguments(build_parser(argparse.ArgumentParser(
        description=f"megareshard training of the {spec.name} model", allow_abbrev=False,
        formatter_class=HelpFormatter)))
    ns = _parse_flags(parser, argv)
    cfg = config_from_namespace(ns)
    spec = spec.from_args(ns)
    spec.check(cfg)
    spec.apply_to(cfg)      # the model's derived shape flags, still part of parsing
    return validate(cfg, _world_size(world_size)), spec
