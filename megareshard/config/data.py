"""`DataConfig`: where samples come from — datasets, blends, splits, tokenizers (Megatron-LM's flags; parsed by
`arguments`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .fields import config_field as _f


@dataclass
class DataConfig:
    """Where samples come from."""

    data_path: list[str] | None = _f(None, "PREFIX of a preprocessed dataset (.bin/.idx), or a blend "
                                           "W1 PREFIX1 W2 PREFIX2 ... split by --split")
    train_data_path: list[str] | None = _f(None, "PREFIX or blend for training only (instead of --data-path)")
    valid_data_path: list[str] | None = _f(None, "PREFIX or blend for validation only")
    test_data_path: list[str] | None = _f(None, "PREFIX or blend for testing only")
    data_args_path: str | None = _f(None, "file holding the --data-path arguments (for long blends)")
    per_split_data_args_path: str | None = _f(None, "JSON file with 'train', 'valid', 'test' keys holding the "
                                                    "per-split data paths (for long blends)")
    data_cache_path: str | None = _f(None, "directory where built sample indices are cached and reused")
    split: str = _f("969,30,1", "train,valid,test proportions of the documents")
    mock_data: bool = _f(False, "synthetic deterministic data (no files needed)")
    tokenizer_type: str | None = _f(None, "Megatron-LM tokenizer (default: GPT2BPETokenizer with --vocab-file, "
                                          "megareshard's sentencepiece with only --tokenizer-model)",
                                    choices=("GPT2BPETokenizer", "SentencePieceTokenizer",
                                             "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                             "HuggingFaceTokenizer", "NullTokenizer"))
    tokenizer_model: str | None = _f(None, "sentencepiece model file, or a local Hugging Face tokenizer directory")
    vocab_file: str | None = _f(None, "GPT-2 BPE vocabulary (vocab.json)")
    merge_file: str | None = _f(None, "GPT-2 BPE merges (merges.txt)")
    data_validation: bool = _f(True, "check every dataset at start-up (index against .bin, token ids below the "
                                     "vocabulary size, not empty; one chunked pass over the tokens shared by the "
                                     "ranks); --no-data-validation skips the token pass for huge corpora",
                               flag="--no-data-validation")


def parse_blend(values: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights or None) of ``PREFIX`` / ``W1 P1 W2 P2 ...`` / ``P1 P2 ...``."""
    values = list(values)
    if not values:
        raise ValueError("no dataset prefix given")
    if len(values) == 1:
        return values, None

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if number(values[0]) is None:  # prefixes only
        numeric = [v for v in values if number(v) is not None]
        if numeric:
            raise ValueError(f"{' '.join(values)}: mixes prefixes with numbers; give W1 PREFIX1 W2 PREFIX2 ...")
        return values, None
    if len(values) % 2:
        raise ValueError(f"{' '.join(values)}: a weighted blend is pairs W1 PREFIX1 W2 PREFIX2 ..., got "
                         f"{len(values)} values")
    weights = [number(w) for w in values[0::2]]
    prefixes = values[1::2]
    bad = [values[2 * i] for i, w in enumerate(weights) if w is None or w < 0 or not math.isfinite(w)]
    if bad:
        raise ValueError(f"weights must be non-negative numbers, got {', '.join(bad)}")
    if sum(weights) <= 0:
        raise ValueError(f"weights {weights} add up to 0")
    zero = [prefixes[i] for i, w in enumerate(weights) if w == 0]
    if zero:
        raise ValueError(f"weight 0 for {', '.join(zero)}: a dataset with no share of the blend is never read; "
                         "remove it or give it a positive weight")
    return prefixes, [float(w) for w in weights]
