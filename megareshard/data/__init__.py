"""Data pipeline: tokenizers (Megatron-LM's types), memory-mapped indexed datasets, GPT samples, mock data
and deterministic global-batch sampling.

Submodules are imported lazily so that the data tools (tokenizer training, preprocessing) do not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SentencePieceTokenizer", "build_tokenizer", "TokenizerError",
    "IndexedDataset", "IndexedDatasetWriter", "IndexedDatasetError", "best_dtype",
    "GPTDataset", "split_documents", "build_train_valid_test_datasets",
    "BlendedDataset", "build_blend", "parse_blend",
    "MockGPTDataset",
    "GlobalBatchSampler", "build_microbatches", "collate",
]


def _module_of(name: str) -> str:
    if name in ("SentencePieceTokenizer", "build_tokenizer", "TokenizerError"):
        return "tokenizer"
    if name.startswith("Indexed") or name == "best_dtype":
        return "indexed_dataset"
    if name in ("GPTDataset", "split_documents"):
        return "gpt_dataset"
    if name == "parse_blend":
        return "config"
    if name in ("BlendedDataset", "build_blend", "build_train_valid_test_datasets"):
        return "blended"
    if name == "MockGPTDataset":
        return "mock"
    return "sampler"


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_module_of(name)}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
