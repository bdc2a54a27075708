"""Blends of datasets, with Megatron-LM's semantics for ``--data-path W1 P1 W2 P2 ...``.

* Weights are normalised to sum to 1. A list of prefixes without weights weighs each dataset by
  the samples one pass over it gives (as if the datasets were concatenated).
* Each dataset of a blend gets ``ceil(ceil(n × weight) × 1.005)`` samples for a split that needs
  ``n`` (Megatron's 0.5 % surplus, so the blend never runs a dataset dry).
* Sample i of the blend comes from the dataset whose share is furthest behind its weight
  (``weight × (i + 1) − taken``, ties to the first dataset): deterministic, no random numbers, and
  global sample i is the same whatever the parallel layout, so a run resumes in any layout.
* ``--data-path`` blends are split per dataset by ``--split``; ``--train-data-path`` (and valid/test)
  blends use each dataset whole for their split.
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

from .config import parse_blend  # the blends' spec is parsed with the data flags (and without torch)
from .gpt_dataset import GPTDataset, split_documents
from .indexed_dataset import IndexedDataset

SURPLUS = 0.005


def normalise(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    return [w / total for w in weights]


def samples_per_dataset(num_samples: int, weights: Sequence[float]) -> list[int]:
    """Megatron's per-dataset sample counts for a blend that needs ``num_samples`` (0.5 % surplus)."""
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + SURPLUS))) for w in normalise(weights)]


def blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, index of the sample within its dataset), by Megatron's greedy rule."""
    w = normalise(weights)
    k = range(len(w))
    dataset_index = np.zeros(num_samples, dtype=np.int32)
    sample_index = np.zeros(num_samples, dtype=np.int64)
    taken = [0] * len(w)
    for i in range(num_samples):
        errors = [w[j] * (i + 1) - taken[j] for j in k]
        d = errors.index(max(errors))  # the first of equal errors
        dataset_index[i] = d
        sample_index[i] = taken[d]
        taken[d] += 1
    return dataset_index, sample_index


def _cached_blending_indices(weights: list[float], num_samples: int, cache_dir: str | None):
    """``blending_indices``, kept in ``cache_dir`` (named by a hash of the weights and the count) when given."""
    if not cache_dir:
        return blending_indices(weights, num_samples)
    key = hashlib.md5(json.dumps({"kind": "blend/1", "weights": weights, "n": num_samples}).encode()).hexdigest()
    paths = [os.path.join(cache_dir, f"{key}-blend-{what}.npy") for what in ("dataset_index", "sample_index")]
    if all(os.path.isfile(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    arrays = blending_indices(weights, num_samples)
    os.makedirs(cache_dir, exist_ok=True)
    for path, arr in zip(paths, arrays):  # temp file + rename: ranks writing at once never see half a file
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path), suffix=".tmp", dir=cache_dir)
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    return arrays


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights`` (see the module doc)."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], num_samples: int,
                 name: str = "train", cache_dir: str | None = None) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.weights, self.name = list(datasets), normalise(weights), name
        self.num_samples = int(num_samples)
        self.dataset_index, self.sample_index = _cached_blending_indices(self.weights, self.num_samples, cache_dir)
        for d, ds in enumerate(self.datasets):
            need = int((self.dataset_index == d).sum())
            if need > len(ds):
                raise ValueError(f"{name} blend needs {need} samples of {ds!r}, which has {len(ds)}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.name} blend of {self.num_samples} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.sample_index[idx])]

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3f} × {ds.indexed.prefix}" for w, ds in zip(self.weights, self.datasets))
        return f"BlendedDataset({self.name}, {self.num_samples} samples: {parts})"


def _samples_in_one_pass(indexed: IndexedDataset, rng: tuple[int, int], seq_length: int) -> int:
    tokens = int(np.asarray(indexed.doc_lengths[rng[0]:rng[1]], dtype=np.int64).sum())
    return max((tokens - 1) // seq_length, 0)


def build_blend(values: Sequence[str], split: str | None, seq_length: int, num_samples: Sequence[int], seed: int,
                cache_dir: str | None = None) -> list:
    """One dataset (GPTDataset or BlendedDataset) per split that needs samples, else None.

    ``split`` None: every dataset of the blend is used whole for each split asked for (per-split paths).
    """
    prefixes, weights = parse_blend(values)
    indexed = [IndexedDataset(p) for p in prefixes]
    ranges = [split_documents(len(ix), split) if split is not None else [(0, len(ix))] * 3 for ix in indexed]
    out: list = []
    for s, (name, n) in enumerate(zip(("train", "valid", "test"), num_samples)):
        usable = [k for k in range(len(indexed)) if ranges[k][s][1] > ranges[k][s][0]]
        if n <= 0 or not usable:
            out.append(None)
            continue
        if len(indexed) == 1:
            out.append(GPTDataset(indexed[0], seq_length, n, seed, split_range=ranges[0][s], name=name,
                                  cache_dir=cache_dir))
            continue
        w = weights if weights is not None else [
            _samples_in_one_pass(indexed[k], ranges[k][s], seq_length) for k in range(len(indexed))]
        w = [w[k] if k in usable else 0.0 for k in range(len(indexed))]
        if sum(w) <= 0:
            out.append(None)
            continue
        counts = samples_per_dataset(n, w)
        parts = [GPTDataset(indexed[k], seq_length, counts[k], seed, split_range=ranges[k][s], name=name,
                            cache_dir=cache_dir) if counts[k] > 0 else None for k in range(len(indexed))]
        keep = [k for k in range(len(indexed)) if parts[k] is not None]
        out.append(BlendedDataset([parts[k] for k in keep], [w[k] for k in keep], n, name=name, cache_dir=cache_dir))
    return out


def build_train_valid_test_datasets(prefix: str | Sequence[str], split: str, seq_length: int,
                                    num_samples: Sequence[int], seed: int,
                                    cache_dir: str | None = None) -> list:
    """Megatron-style helper: one dataset per split with ``num_samples[i]`` samples (None when 0 or empty).

    ``prefix`` is one dataset prefix or a blend (``["0.3", "P1", "0.7", "P2"]``, see ``data.blended``)."""
    values = [prefix] if isinstance(prefix, (str, os.PathLike)) else list(prefix)
    return build_blend([os.fspath(v) for v in values], split, seq_length, num_samples, seed, cache_dir)
