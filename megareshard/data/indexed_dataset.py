"""Memory-mapped indexed dataset: a flat token array (``P.bin``) plus document boundaries (``P.idx``).

Like Megatron-LM's MMapIndexedDataset, but our own format (version 1, little endian):

    offset  size            field
    0       8               magic b"MRSHIDX\\0"
    8       8   uint64      version (1)
    16      1   uint8       dtype code (see DTYPE_CODES), then 7 bytes of zero padding
    24      8   uint64      number of documents N
    32      8   uint64      number of tokens T (so T * itemsize == size of P.bin)
    40      8*(N+1) int64   token offsets of each document (offsets[0] = 0, offsets[N] = T)
    ..      4*N int32       token count of each document (= diff(offsets), stored for checking)

``P.bin`` is the tokens of all documents back to back, in that dtype. The reader checks every
size against the file lengths, so a truncated or mismatched pair fails loudly with the file name
instead of silently yielding garbage. The writer writes temp files and renames them into place
(the old ``.idx`` is removed first, the new one renamed last), so a crash never leaves a pair
that reads as a valid dataset.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
from array import array
from types import MappingProxyType
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"MRSHIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sQB7xQQ")  # magic, version, dtype code, num docs, num tokens
HEADER_SIZE = _HEADER.size  # 40

#: dtype code <-> numpy dtype (codes follow Megatron's where they overlap).
DTYPE_CODES = MappingProxyType({1: np.uint8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16, 9: np.uint32})


def dtype_code(dtype: np.dtype | type) -> int:
    dt = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dt:
            return code
    raise ValueError(f"unsupported token dtype {dt}; use one of {[np.dtype(t).name for t in DTYPE_CODES.values()]}")


def best_dtype(vocab_size: int) -> type:
    """Smallest token dtype for a vocabulary: uint16 below 65500 ids (halves the disk/IO), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetWriter:
    """Append documents, then ``finalize()``; use as a context manager.

    On a clean ``with`` exit the dataset is finalized; if the block raises, the temp files are
    removed and no ``P.bin``/``P.idx`` is created (an existing dataset at P is left untouched).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        info = np.iinfo(self.dtype)
        self._min, self._max = int(info.min), int(info.max)
        d = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(d, exist_ok=True)
        base = os.path.basename(self.prefix)
        fd, self._bin_tmp = tempfile.mkstemp(prefix=f"{base}.bin.", suffix=".tmp", dir=d)
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._lengths = array("q")
        self._num_tokens = 0
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (its token ids, in order)."""
        if self._done:
            raise RuntimeError(f"IndexedDatasetWriter({self.prefix!r}) is already finalized or discarded")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token sequence, got shape {arr.shape}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._min or hi > self._max:
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit {self.dtype.name} "
                                 f"(range [{self._min}, {self._max}]) writing {self.prefix!r}")
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"document of {arr.size} tokens exceeds the int32 length field")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(arr.size)
        self._num_tokens += arr.size

    def add_documents(self, docs: Iterable[Sequence[int] | np.ndarray]) -> None:
        for d in docs:
            self.add_document(d)

    def finalize(self) -> None:
        """Write the index and move both files into place (bin first, idx last)."""
        if self._done:
            raise RuntimeError(f"IndexedDatasetWriter({self.prefix!r}) is already finalized or discarded")
        self._done = True
        idx_tmp = None
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            d = os.path.dirname(os.path.abspath(self.prefix))
            fd, idx_tmp = tempfile.mkstemp(prefix=f"{os.path.basename(self.prefix)}.idx.", suffix=".tmp", dir=d)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), self._num_tokens))
                f.write(offsets.astype("<i8").tobytes())
                f.write(lengths.astype("<i4").tobytes())
                f.flush()
                os.fsync(f.fileno())
            idx_path = index_file_path(self.prefix)
            if os.path.exists(idx_path):
                os.remove(idx_path)  # never leave an old .idx next to a new .bin
            os.replace(self._bin_tmp, data_file_path(self.prefix))
            os.replace(idx_tmp, idx_path)
            idx_tmp = None
        except BaseException:
            self._remove_tmp(idx_tmp)
            raise

    def discard(self) -> None:
        """Drop everything written so far; no dataset files are created."""
        if self._done:
            return
        self._done = True
        self._remove_tmp(None)

    def _remove_tmp(self, idx_tmp: str | None) -> None:
        try:
            self._bin.close()
        except OSError:
            pass
        for p in (self._bin_tmp, idx_tmp):
            if p and os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._done:
                self.finalize()
        else:
            self.discard()

    def __del__(self) -> None:  # an abandoned writer must not leave temp files behind
        if not getattr(self, "_done", True):
            try:
                self.discard()
            except Exception:
                pass


class IndexedDatasetError(ValueError):
    """A missing, corrupt or inconsistent ``.idx``/``.bin`` pair (the message names the file)."""


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin``/``prefix.idx``.

    ``len(ds)`` is the number of documents, ``ds[i]`` the tokens of document i (a numpy view into
    the memory map; copy it before mutating), ``ds.get(i, offset, length)`` part of one.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for p, what in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset {what} file not found: {p!r} "
                                        f"(build it with tools/preprocess_data.py --output-prefix {self.prefix})")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path}: truncated index: {idx_size} bytes, shorter than the "
                                      f"{HEADER_SIZE}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, n_docs, n_tokens = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: bad magic {magic!r} (expected {MAGIC!r}): "
                                      f"not a megareshard indexed dataset index")
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} (this reader knows {VERSION})")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + 8 * (n_docs + 1) + 4 * n_docs
        if idx_size != expected:
            raise IndexedDatasetError(f"{idx_path}: {'truncated' if idx_size < expected else 'oversized'} index: "
                                      f"{idx_size} bytes, expected {expected} for {n_docs} documents")
        self._offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER_SIZE, shape=(n_docs + 1,))
        self._lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=HEADER_SIZE + 8 * (n_docs + 1),
                                  shape=(n_docs,)) if n_docs else np.zeros(0, np.int32)
        if self._offsets[0] != 0 or self._offsets[-1] != n_tokens:
            raise IndexedDatasetError(f"{idx_path}: corrupt offsets: first {int(self._offsets[0])} (expected 0), "
                                      f"last {int(self._offsets[-1])} (expected {n_tokens} tokens)")
        if n_docs and not np.array_equal(np.diff(self._offsets), self._lengths):
            bad = int(np.flatnonzero(np.diff(self._offsets) != self._lengths)[0])
            raise IndexedDatasetError(f"{idx_path}: corrupt index: document {bad} has length "
                                      f"{int(self._lengths[bad])} but offsets span "
                                      f"{int(self._offsets[bad + 1] - self._offsets[bad])} tokens")
        bin_size = os.path.getsize(bin_path)
        want = n_tokens * self.dtype.itemsize
        if bin_size != want:
            raise IndexedDatasetError(f"{bin_path}: size {bin_size} bytes does not match its index {idx_path} "
                                      f"({n_tokens} tokens x {self.dtype.itemsize} bytes = {want} bytes)")
        self._num_docs, self._num_tokens = int(n_docs), int(n_tokens)
        self._tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(n_tokens,)) if n_tokens
                        else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return self._num_docs

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def doc_lengths(self) -> np.ndarray:
        """Token count of every document (int32 array of length ``len(self)``)."""
        return self._lengths

    @property
    def doc_offsets(self) -> np.ndarray:
        """Start of every document in the flat token array, plus the total (int64, ``len(self)+1``)."""
        return self._offsets

    @property
    def tokens(self) -> np.ndarray:
        """The flat token array of all documents (memory-mapped)."""
        return self._tokens

    def _check(self, i: int) -> int:
        n = self._num_docs
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {self.prefix!r} with {n} documents")
        return i % n if n else i

    def __getitem__(self, i: int) -> np.ndarray:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._num_docs))]
        i = self._check(int(i))
        return self._tokens[self._offsets[i]:self._offsets[i + 1]]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i`` (to its end when length is None)."""
        i = self._check(int(i))
        n = int(self._lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"get({i}, offset={offset}, length={length}) out of range: document {i} of "
                             f"{self.prefix!r} has {n} tokens")
        start = int(self._offsets[i]) + offset
        return self._tokens[start:start + length]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, documents={self._num_docs}, tokens={self._num_tokens}, "
                f"dtype={self.dtype.name})")


def write_indexed_dataset(prefix: str, docs: Iterable[Sequence[int] | np.ndarray],
                          dtype: np.dtype | type = np.uint16) -> IndexedDataset:
    """Write ``docs`` to ``prefix.bin/.idx`` atomically and open the result."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents(docs)
    return IndexedDataset(prefix)


def _describe(prefix: str) -> None:  # python -m megareshard.data.indexed_dataset PREFIX
    ds = IndexedDataset(prefix)
    lens = np.asarray(ds.doc_lengths)
    print(ds)
    if len(lens):
        print(f"doc length: min {lens.min()} mean {lens.mean():.1f} max {lens.max()}")


if __name__ == "__main__":
    for _p in sys.argv[1:]:
        _describe(_p)
