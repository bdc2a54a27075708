"""Synthetic GPT data for ``--mock-data``: deterministic and learnable, no files needed.

Each sample is one of two patterns, chosen per sample from ``(seed, index)``:

* an arithmetic sequence ``(a + d * t) mod vocab_size`` with a small step ``d`` (1..4);
* a short random motif (2..8 tokens) repeated to fill the sample.

Both are predictable from the previous few tokens, so a model's loss falls well below
``log(vocab_size)`` within a few hundred steps, which makes mock runs useful as smoke tests of
the training loop, not just of its throughput. Items are generated on the fly from a per-sample
RNG, so memory does not grow with ``num_samples`` and any index can be read in any order.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

_RNG = threading.local()   # one RandomState per thread, re-seeded per sample (see MockGPTDataset.tokens)


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` items ``{"tokens": LongTensor[seq_length + 1]}`` with ids in ``[0, vocab_size)``."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234) -> None:
        if vocab_size < 2 or seq_length < 1 or num_samples < 0:
            raise ValueError(f"need vocab_size >= 2, seq_length >= 1, num_samples >= 0; got "
                             f"{vocab_size}, {seq_length}, {num_samples}")
        self.vocab_size, self.seq_length = int(vocab_size), int(seq_length)
        self.num_samples, self.seed = int(num_samples), int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, idx: int) -> np.ndarray:
        """The int64 tokens of sample ``idx`` (numpy)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for MockGPTDataset of {self.num_samples} samples")
        # re-seeding a kept RandomState draws what a new RandomState(seed) draws, without the new one's entropy
        # gathering, which costs some twenty times the re-seeding (the batch is read while the device waits)
        rng = getattr(_RNG, "state", None)
        if rng is None:
            rng = _RNG.state = np.random.RandomState(0)
        rng.seed([self.seed & 0xFFFFFFFF, int(idx) & 0xFFFFFFFF, int(idx) >> 32])
        n, v = self.seq_length + 1, self.vocab_size
        t = np.arange(n, dtype=np.int64)
        if rng.randint(2) == 0:
            a, d = rng.randint(v), rng.randint(1, 5)
            return (a + d * t) % v
        motif = rng.randint(0, v, size=rng.randint(2, 9)).astype(np.int64)
        return motif[t % len(motif)]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(self.tokens(int(idx)))}

    def __repr__(self) -> str:
        return (f"MockGPTDataset(vocab_size={self.vocab_size}, seq_length={self.seq_length}, "
                f"num_samples={self.num_samples}, seed={self.seed})")
