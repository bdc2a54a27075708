"""A run's inputs checked without starting it: the tokenizer (against ``--vocab-size``) and the dataset files.

``resolve_vocab`` is what the trainer does first (the vocabulary comes from the tokenizer);
``validate_only`` is ``--validate-only``: the launch scripts run it once, in one process, before
torchrun starts a process per rank, so a bad argument, a missing tokenizer or a missing dataset is
one line instead of one per rank followed by torchrun's traceback. It opens every dataset (its
index checked against its ``.bin``, not empty) but leaves the scan of every token id to the run,
whose ranks share it.
"""
from __future__ import annotations

import os
from typing import Any

from .config_fields import ConfigError

__all__ = ["resolve_vocab", "dataset_prefixes", "validate_only"]


def resolve_vocab(cfg: Any):
    """The run's tokenizer (None without one), with ``cfg.model.vocab_size`` set from it (NullTokenizer:
    --vocab-size ids plus its eod). A --vocab-size that differs from the tokenizer's is a ConfigError."""
    m, d = cfg.model, cfg.data
    if d.tokenizer_type is None and not (d.tokenizer_model or d.vocab_file or d.merge_file):
        return None
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
    m.vocab_size = tok.vocab_size
    return tok


def dataset_prefixes(d: Any) -> list[str]:
    """Every dataset prefix the data flags name (blends parsed, each prefix once)."""
    from .data.config import parse_blend

    prefixes: list[str] = []
    for values in (d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path):
        if values:
            prefixes += [p for p in parse_blend(values)[0] if p not in prefixes]
    return prefixes


def validate_only(cfg: Any, world_size: int | None = None) -> str:
    """--validate-only: the checks above on a config ``arguments.parse_args`` validated for ``world_size`` ranks
    (default ``$WORLD_SIZE``, as there); returns the line to print (a ConfigError names the first problem)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tok = resolve_vocab(cfg)
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
    p, t = cfg.parallel, cfg.training
    layout = (f"stages {p.stage_layouts}" if p.stage_layouts
              else f"tp {cfg.tp} × pp {cfg.pp} × dp {cfg.dp(world_size)}")
    data = ", ".join(found) if found else "mock data"
    vocab = f"tokenizer {tok!r}" if tok is not None else f"vocabulary {cfg.model.vocab_size}"
    return (f"megareshard: arguments valid for {world_size} rank(s): {layout}, global batch {t.global_batch_size} "
            f"in {cfg.num_microbatches(world_size)} microbatch(es) of {t.micro_batch_size} per dp rank, --train-iters "
            f"{t.train_iters}; {vocab}; data {data}")
