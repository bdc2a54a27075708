"""GPT pretraining samples cut from an indexed dataset, Megatron-style.

Each sample is ``seq_length + 1`` consecutive tokens (inputs = ``tokens[:-1]``, labels =
``tokens[1:]``) from the concatenation of the split's documents, read straight across document
boundaries (an ``<eod>`` appended by ``tools/preprocess_data.py --append-eod`` marks them).
Consecutive samples overlap by one token, so every token is a label exactly once per epoch.

Indices, built with numpy at construction (building is O(documents x epochs + samples) and takes
well under a second for millions of documents; with ``cache_dir`` (``--data-cache-path``) they are
saved there as .npy files named by a hash of everything they depend on, and reused):

* ``doc_idx``: for each epoch, a seeded permutation of the split's documents, concatenated
  for as many epochs as ``num_samples`` needs;
* ``sample_doc``/``sample_offset``: where in ``doc_idx`` each sample starts;
* ``shuffle_idx``: a seeded permutation of the samples, so batches mix documents and epochs.

Everything derives from ``seed`` through ``np.random.RandomState``, whose streams numpy keeps
stable across versions, so a resumed run sees the same samples in the same order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from typing import Sequence

import numpy as np
import torch

from megareshard.data.indexed_dataset import IndexedDataset


def parse_split(split: str | Sequence[float]) -> list[float]:
    """Weights of a Megatron ``--split`` string (``"969,30,1"`` or ``"98/2/0"``), normalised, padded to 3."""
    if isinstance(split, str):
        sep = "," if "," in split else "/"
        try:
            weights = [float(x) for x in split.split(sep) if x.strip()]
        except ValueError as exc:
            raise ValueError(f"bad split {split!r}: expected numbers like '969,30,1'") from exc
    else:
        weights = [float(x) for x in split]
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"bad split {split!r}: need 1 to 3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_documents(num_docs: int, split: str | Sequence[float] = "969,30,1") -> list[tuple[int, int]]:
    """Train/valid/test document ranges ``[(begin, end)] * 3``, contiguous and disjoint.

    Same rounding as Megatron's ``get_train_valid_test_split_``: each boundary is the rounded
    cumulative share, and any rounding excess is taken off every boundary after the first, so
    the ranges always cover exactly ``[0, num_docs)``.
    """
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_docs))))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [max(0, b - diff) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents ``split_range`` of ``indexed``.

    ``ds[i]`` is ``{"tokens": LongTensor[seq_length + 1]}``. Deterministic in (seed, split,
    seq_length, num_samples); as many epochs over the split as needed are built.
    """

    def __init__(self, indexed: IndexedDataset | str | os.PathLike, seq_length: int, num_samples: int, seed: int,
                 split_range: tuple[int, int] | None = None, name: str = "train", cache_dir: str | None = None) -> None:
        if not isinstance(indexed, IndexedDataset):
            indexed = IndexedDataset(indexed)
        self.indexed, self.name = indexed, name
        self.seq_length, self.num_samples, self.seed = int(seq_length), int(num_samples), int(seed)
        if self.seq_length < 1 or self.num_samples < 0:
            raise ValueError(f"seq_length must be >= 1 and num_samples >= 0, got {seq_length} and {num_samples}")
        begin, end = split_range if split_range is not None else (0, len(indexed))
        if not 0 <= begin <= end <= len(indexed):
            raise ValueError(f"split range ({begin}, {end}) outside the {len(indexed)} documents of {indexed.prefix!r}")
        self.split_range = (int(begin), int(end))
        lengths = np.asarray(indexed.doc_lengths[begin:end], dtype=np.int64)
        self.tokens_per_epoch = int(lengths.sum())
        need = self.seq_length + 1
        if self.tokens_per_epoch < need:
            raise ValueError(
                f"{name} split of {indexed.prefix!r} (documents [{begin}, {end})) has {self.tokens_per_epoch} tokens, "
                f"fewer than one sample of seq_length {self.seq_length} + 1 = {need} tokens")
        # Tokens needed: samples overlap by one, so n samples span n * seq_length + 1 tokens.
        self.num_epochs = max(1, math.ceil((self.num_samples * self.seq_length + 1) / self.tokens_per_epoch))

        self.cache_files: list[str] = []
        arrays = self._load_cached(cache_dir) if cache_dir else None
        if arrays is None:
            arrays = self._build_indices(lengths, begin, end)
            if cache_dir:
                self._save_cached(cache_dir, arrays)
        self.doc_idx, self.sample_doc, self.sample_offset, self.shuffle_idx = arrays

    _INDEX_NAMES = ("doc_idx", "sample_doc", "sample_offset", "shuffle_idx")

    def _build_indices(self, lengths: np.ndarray, begin: int, end: int) -> tuple[np.ndarray, ...]:
        rng = np.random.RandomState(self.seed)
        docs = np.arange(begin, end, dtype=np.int64)
        doc_idx = np.concatenate([rng.permutation(docs) for _ in range(self.num_epochs)])
        cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
        np.cumsum(lengths[doc_idx - begin], out=cum[1:])
        starts = np.arange(self.num_samples, dtype=np.int64) * self.seq_length
        # side="right" - 1 lands on the last document starting at or before the position,
        # which skips empty documents.
        sample_doc = np.searchsorted(cum, starts, side="right") - 1
        sample_offset = starts - cum[sample_doc]
        shuffle_idx = rng.permutation(self.num_samples)
        return doc_idx, sample_doc, sample_offset, shuffle_idx

    def _cache_paths(self, cache_dir: str) -> list[str]:
        ix = self.indexed
        desc = dict(kind="GPTDataset/1", prefix=os.path.abspath(ix.prefix), sequences=len(ix), tokens=ix.num_tokens,
                    idx_bytes=os.path.getsize(ix.prefix + ".idx"), split_range=list(self.split_range),
                    seq_length=self.seq_length, num_samples=self.num_samples, seed=self.seed)
        key = hashlib.md5(json.dumps(desc, sort_keys=True).encode()).hexdigest()
        return [os.path.join(cache_dir, f"{key}-{self.name}-{n}.npy") for n in self._INDEX_NAMES]

    def _load_cached(self, cache_dir: str) -> tuple[np.ndarray, ...] | None:
        paths = self._cache_paths(cache_dir)
        if not all(os.path.isfile(p) for p in paths):
            return None
        self.cache_files = paths
        return tuple(np.load(p, mmap_mode="r") for p in paths)

    def _save_cached(self, cache_dir: str, arrays: tuple[np.ndarray, ...]) -> None:
        os.makedirs(cache_dir, exist_ok=True)
        paths = self._cache_paths(cache_dir)
        for path, arr in zip(paths, arrays):  # temp file + rename: ranks writing at once never see half a file
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path), suffix=".tmp", dir=cache_dir)
            with os.fdopen(fd, "wb") as f:
                np.save(f, arr)
            os.replace(tmp, path)
        self.cache_files = paths

    def __len__(self) -> int:
        return self.num_samples

    def sample_spans(self, idx: int) -> list[tuple[int, int, int]]:
        """(document, offset, length) pieces making up sample ``idx`` (after shuffling), in order."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {self.num_samples} samples")
        s = int(self.shuffle_idx[idx])
        j, off = int(self.sample_doc[s]), int(self.sample_offset[s])
        remaining = self.seq_length + 1
        spans = []
        lengths = self.indexed.doc_lengths
        while remaining > 0:
            doc = int(self.doc_idx[j])
            take = min(remaining, int(lengths[doc]) - off)
            if take > 0:
                spans.append((doc, off, take))
                remaining -= take
            j, off = j + 1, 0
        return spans

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        parts = [self.indexed.get(d, o, n) for d, o, n in self.sample_spans(int(idx))]
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return {"tokens": torch.from_numpy(arr.astype(np.int64))}

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.prefix!r}, {self.name}, docs {self.split_range}, seq_length="
                f"{self.seq_length}, samples={self.num_samples}, epochs={self.num_epochs}, seed={self.seed})")
