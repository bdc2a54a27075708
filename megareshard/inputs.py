"""A run's inputs checked without starting it: the tokenizer (against ``--vocab-size``) and the dataset files.

``resolve_vocab`` gives a configuration its vocabulary from the tokenizer (a new one: the trainer's, and
``--validate-only``'s);
``validate_only`` is ``--validate-only``: the launch scripts run it once, in one process, before
torchrun starts a process per rank, so a bad argument, a missing tokenizer or a missing dataset is
one line instead of one per rank followed by torchrun's traceback. It opens every dataset (its
index checked against its ``.bin``, not empty) but leaves the scan of every token id to the run,
whose ranks share it. It checks ``--load`` and ``--save`` too (``checkpoint_plan``): what ``--load`` holds (a
megareshard or Megatron-LM checkpoint, or nothing yet in the auto-resume pattern), ``--save`` a directory, and
the iteration and data position a megareshard checkpoint records against ``--train-iters``.

``resume_plan`` is that last check where the run makes it, on rank 0 before anything is built.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from .config_fields import ConfigError

__all__ = ["resolve_vocab", "dataset_prefixes", "validate_only", "checkpoint_plan", "resume_plan"]


def resolve_vocab(cfg: Any) -> tuple[Any, Any]:
    """(the configuration with ``model.vocab_size`` from the run's tokenizer, the tokenizer); without a tokenizer
    ``(cfg, None)``. NullTokenizer: --vocab-size ids plus its eod. A --vocab-size that differs from the
    tokenizer's is a ConfigError. ``cfg`` itself is left as it is (a new configuration is returned)."""
    m, d = cfg.model, cfg.data
    if d.tokenizer_type is None and not (d.tokenizer_model or d.vocab_file or d.merge_file):
        return cfg, None
    from .data.tokenizer import TokenizerError, build_tokenizer

    try:
        tok = build_tokenizer(d.tokenizer_type, tokenizer_model=d.tokenizer_model, vocab_file=d.vocab_file,
                              merge_file=d.merge_file, vocab_size=m.vocab_size)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    if d.tokenizer_type != "NullTokenizer" and m.vocab_size is not None and m.vocab_size != tok.vocab_size:
        raise ConfigError(f"--vocab-size {m.vocab_size} differs from the vocabulary of tokenizer "
                          f"{tok!r} ({tok.vocab_size} ids); drop --vocab-size or use the tokenizer the data "
                          "was made with")
    if m.vocab_size == tok.vocab_size:
        return cfg, tok
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=tok.vocab_size)), tok


def dataset_prefixes(d: Any) -> list[str]:
    """Every dataset prefix the data flags name (blends parsed, each prefix once)."""
    from .data.config import parse_blend

    prefixes: list[str] = []
    for values in (d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path):
        if values:
            prefixes += [p for p in parse_blend(values)[0] if p not in prefixes]
    return prefixes


def _check_progress(cfg: Any, progress: Any) -> str | None:
    from .checkpoint.detect import check_progress

    t = cfg.training
    return check_progress(progress, train_iters=t.train_iters, global_batch_size=t.global_batch_size,
                          train_samples=t.train_samples)


def resume_plan(cfg: Any) -> str | None:
    """A resume set against its plan at the run's start, before anything is built: None to go on; the line to print
    when the checkpoint ``--load`` names is at ``--train-iters`` (nothing left to train: the run ends, exit 0); a
    ConfigError line when it is past it (``detect.check_progress``), or when ``--load`` holds no checkpoint to load
    (``detect.load_decision``: a Hugging Face directory names its converter). A Megatron-LM checkpoint the run reads
    is left to its loader (its weights load as ``--finetune`` does: from iteration 0), and so is a checkpoint whose
    ``checkpoint.json`` cannot be read (the loader names what is wrong)."""
    from .checkpoint.detect import (KIND_CHECKPOINT, KIND_MEGATRON_ITERATION, KIND_MEGATRON_ROOT, KIND_ROOT,
                                    describe_path, load_decision, megatron_iteration, read_progress)

    ck = cfg.checkpoint
    if not ck.load:
        return None
    if describe_path(ck.load).kind in (KIND_MEGATRON_ROOT, KIND_MEGATRON_ITERATION):
        try:
            if megatron_iteration(ck.load) is not None:
                return None
        except ConfigError:   # a corrupt tracker, a missing iteration: the Megatron-LM loader's own line
            return None
    if load_decision(ck.load, ck.save).kind not in (KIND_CHECKPOINT, KIND_ROOT) or ck.finetune:
        return None
    try:
        progress = read_progress(ck.load)
    except ConfigError:
        return None
    return _check_progress(cfg, progress)


def checkpoint_plan(cfg: Any) -> str:
    """--validate-only's checks of ``--save`` and ``--load`` (no torch: paths and ``checkpoint.json``, read as JSON):
    the part of its line that says what ``--load`` starts from ("" without checkpoint flags); a ConfigError line for
    what the run would stop on at start-up."""
    from .checkpoint.detect import (KIND_ABSENT, KIND_EMPTY, KIND_MEGATRON_ITERATION, KIND_MEGATRON_ROOT,
                                    check_save, read_progress, resume_source)

    ck = cfg.checkpoint
    if ck.save:
        check_save(ck.save)
    if not ck.load:
        return ""
    found = resume_source(ck.load, ck.save)
    if found.kind in (KIND_MEGATRON_ROOT, KIND_MEGATRON_ITERATION):
        return f"--load {ck.load} {found.what}: its weights, from iteration 0 (as --finetune)"
    if found.kind in (KIND_EMPTY, KIND_ABSENT):
        return f"--load {ck.load} holds no checkpoint yet: training starts from scratch"
    progress = read_progress(ck.load)
    saved = f"--load {progress.directory}: iteration {progress.iteration}" + (
        f", {progress.consumed_samples} samples consumed" if progress.consumed_samples is not None else "")
    if ck.finetune:
        return f"{saved} (--finetune: its weights, from iteration 0)"
    done = _check_progress(cfg, progress)
    if done is not None:
        return done
    return f"{saved}; training iterations {progress.iteration + 1}-{cfg.training.train_iters}"


def validate_only(cfg: Any, world_size: int | None = None) -> str:
    """--validate-only: the checks above on a config ``arguments.parse_args`` validated for ``world_size`` ranks
    (default ``$WORLD_SIZE``, as there); returns the line to print (a ConfigError names the first problem)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, tok = resolve_vocab(cfg)
    found = []
    if not cfg.data.mock_data:
        from .data.indexed_dataset import IndexedDataset
        from .data.validate import check_not_empty

        for prefix in dataset_prefixes(cfg.data):
            try:
                ds = IndexedDataset(prefix)
                check_not_empty(ds)
            except (OSError, ValueError) as e:
                raise ConfigError(str(e)) from None
            found.append(f"{prefix} ({len(ds)} sequences, {ds.num_tokens} tokens)")
    resume = checkpoint_plan(cfg)
    p, t = cfg.parallel, cfg.training
    layout = (f"stages {p.stage_layouts}" if p.stage_layouts
              else f"tp {cfg.tp} × pp {cfg.pp} × dp {cfg.plan.dp}")
    data = ", ".join(found) if found else "mock data"
    vocab = f"tokenizer {tok!r}" if tok is not None else f"vocabulary {cfg.model.vocab_size}"
    return (f"megareshard: arguments valid for {world_size} rank(s): {layout}, global batch {t.global_batch_size} "
            f"in {cfg.plan.num_microbatches} microbatch(es) of {t.micro_batch_size} per dp rank, --train-iters "
            f"{t.train_iters}; {vocab}; data {data}" + (f"; {resume}" if resume else ""))
