"""Deterministic, resumable global-batch sampling over data-parallel ranks.

A training iteration consumes one *global batch* of ``global_batch_size`` consecutive sample
indices ``[consumed, consumed + gb)`` (the dataset itself is already shuffled, see GPTDataset).
The global batch is the unit of determinism: whatever the dp size, the same samples make up
iteration k, so changing the parallel layout (or resuming on a different number of ranks) does
not change what the model sees. The only state is ``consumed_samples``, saved in checkpoints.

How the global batch is divided (``order``):

* ``"contiguous"`` (default): dp rank r gets samples ``[r*gb/dp, (r+1)*gb/dp)`` of the global
  batch, cut into microbatches of ``micro_batch_size`` in order.
* ``"megatron"``: the global batch is a sequence of *global microbatches* of
  ``micro_batch_size * dp`` samples and dp rank r gets the r-th ``micro_batch_size`` slice of
  each (Megatron-LM's MegatronPretrainingSampler). Global microbatch k is then the same set of
  samples for any dp, which is what a pipeline whose stages have different dp sizes needs
  (every stage processes the same global microbatch, each sharded over its own dp).

In both, concatenating the ranks' samples (per rank for contiguous, per microbatch for
megatron) gives back the global batch. The last, incomplete global batch is dropped.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

_ORDERS = ("contiguous", "megatron")


class GlobalBatchSampler:
    """Yields, per global batch, this dp rank's microbatches: ``list[list[int]]`` of
    ``num_microbatches`` lists of ``micro_batch_size`` sample indices.

    ``consumed_samples`` advances by ``global_batch_size`` when a global batch is yielded, so a
    checkpoint taken after training on it (``state_dict()``) resumes at the next one.
    """

    def __init__(self, total_samples: int, global_batch_size: int, micro_batch_size: int, dp_size: int,
                 dp_rank: int, consumed_samples: int = 0, order: str = "contiguous") -> None:
        if min(global_batch_size, micro_batch_size, dp_size) < 1:
            raise ValueError(f"global batch {global_batch_size}, micro batch {micro_batch_size} and dp "
                             f"{dp_size} must all be positive")
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro batch "
                             f"{micro_batch_size} × dp {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp rank {dp_rank} out of range for dp {dp_size}")
        if order not in _ORDERS:
            raise ValueError(f"unknown order {order!r}; choose one of {_ORDERS}")
        self.total_samples, self.global_batch_size = int(total_samples), int(global_batch_size)
        self.micro_batch_size, self.dp_size, self.dp_rank = int(micro_batch_size), int(dp_size), int(dp_rank)
        self.order = order
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.consumed_samples = 0
        self._set_consumed(consumed_samples)

    def _set_consumed(self, consumed: int) -> None:
        if not 0 <= consumed <= self.total_samples:
            raise ValueError(f"consumed samples {consumed} out of range for {self.total_samples} total samples")
        self.consumed_samples = int(consumed)

    def __len__(self) -> int:
        """Global batches left (the trailing incomplete one is dropped)."""
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def global_batch(self, start: int) -> list[list[int]]:
        """This rank's microbatches of the global batch starting at sample ``start``."""
        mb, dp, r = self.micro_batch_size, self.dp_size, self.dp_rank
        if self.order == "contiguous":
            base = start + r * (self.global_batch_size // dp)
            return [list(range(base + k * mb, base + (k + 1) * mb)) for k in range(self.num_microbatches)]
        return [list(range(start + k * mb * dp + r * mb, start + k * mb * dp + (r + 1) * mb))
                for k in range(self.num_microbatches)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        while self.consumed_samples + self.global_batch_size <= self.total_samples:
            batch = self.global_batch(self.consumed_samples)
            self.consumed_samples += self.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size,
                "total_samples": self.total_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["consumed_samples"]`` (the batch sizes and dp layout may differ from the saver's)."""
        self._set_consumed(int(state["consumed_samples"]))

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(total={self.total_samples}, gb={self.global_batch_size}, "
                f"mb={self.micro_batch_size}, dp={self.dp_size}, rank={self.dp_rank}, "
                f"consumed={self.consumed_samples}, order={self.order!r})")


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts key by key: ``tokens`` becomes ``LongTensor[len(items), seq + 1]``."""
    if not items:
        raise ValueError("cannot collate an empty microbatch")
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def build_microbatches(dataset: Any, sampler: Iterable[list[list[int]]]) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Per global batch, this rank's collated microbatches: a list of ``{"tokens": LongTensor[mb, seq+1]}``."""
    for microbatches in sampler:
        yield [collate([dataset[i] for i in mb]) for mb in microbatches]
