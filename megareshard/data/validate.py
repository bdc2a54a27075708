"""Start-up validation of the datasets a run reads: one error naming the file and the offset.

Opening an ``IndexedDataset`` already checks the index against its ``.bin`` (magic, version, sizes,
pointers, document indices: a truncated ``.bin`` or an ``.idx`` of another ``.bin`` fails there).
This adds what only the token values tell, in one vectorised pass over the memory-mapped ``.bin``
in chunks (numpy max/min per chunk, a few GB/s; the ranks split the chunks between them):

* every token id in ``[0, vocab_size)`` — data made with another tokenizer would index past the
  embedding (the error names the byte offset, the sequence and the document of the first bad id);
* the dataset is not empty (no sequences or no tokens).

``--no-data-validation`` skips the token pass (huge corpora); the index checks always run.
"""
from __future__ import annotations

import numpy as np

from .indexed_dataset import IndexedDataset, IndexedDatasetError, data_file_path

__all__ = ["CHUNK_TOKENS", "check_not_empty", "check_token_range", "chunk_count"]

#: tokens per chunk of the validation pass (64 Mi tokens: 128 MiB of uint16)
CHUNK_TOKENS = 1 << 26


def check_not_empty(ds: IndexedDataset) -> None:
    if len(ds) == 0 or ds.num_tokens == 0:
        raise IndexedDatasetError(f"{data_file_path(ds.prefix)}: empty dataset ({len(ds)} sequences, {ds.num_tokens} "
                                  "tokens): nothing to train on; was preprocessing given an empty input?")


def chunk_count(ds: IndexedDataset, chunk_tokens: int = CHUNK_TOKENS) -> int:
    return -(-len(ds.tokens) // chunk_tokens)


def check_token_range(ds: IndexedDataset, vocab_size: int, *, chunks: range | None = None,
                      chunk_tokens: int = CHUNK_TOKENS) -> None:
    """Raise ``IndexedDatasetError`` at the first token id outside ``[0, vocab_size)`` in ``chunks``
    (default: all) of the ``.bin``; the message names the file, the byte offset, the sequence and document."""
    tokens = ds.tokens
    n = len(tokens)
    for c in chunks if chunks is not None else range(chunk_count(ds, chunk_tokens)):
        lo, hi = c * chunk_tokens, min((c + 1) * chunk_tokens, n)
        if lo >= hi:
            continue
        block = tokens[lo:hi]
        top = int(block.max())
        bottom = int(block.min()) if block.dtype.kind == "i" else 0
        if top < vocab_size and bottom >= 0:
            continue
        bad = lo + int(np.flatnonzero((block >= vocab_size) | (block < 0))[0])
        raise IndexedDatasetError(f"{data_file_path(ds.prefix)}: token id {int(tokens[bad])} at byte offset "
                                  f"{bad * tokens.dtype.itemsize} ({_where(ds, bad)}) is outside the vocabulary "
                                  f"[0, {vocab_size}): was the dataset made with another tokenizer? "
                                  "(--no-data-validation skips this check)")


def _where(ds: IndexedDataset, token: int) -> str:
    """'sequence S, document D, token T of it' for a flat token position of the .bin."""
    starts = np.asarray(ds.sequence_pointers, dtype=np.int64) // ds.tokens.dtype.itemsize
    seq = int(np.searchsorted(starts, token, side="right")) - 1
    if seq < 0:
        return "before the first sequence"
    doc = int(np.searchsorted(np.asarray(ds.document_indices), seq, side="right")) - 1
    return f"sequence {seq}, document {doc}, token {token - int(starts[seq])} of the sequence"
