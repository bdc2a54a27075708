"""Memory-mapped indexed dataset in Megatron-LM's format: token data (``P.bin``) plus an index (``P.idx``).

``P.bin`` is the tokens of every sequence back to back, in one integer dtype. ``P.idx`` is Megatron-LM's
``MMIDIDX`` index (all little endian), so a corpus preprocessed by Megatron-LM loads here and one
written here loads there:

    size              field
    9                 magic b"MMIDIDX\\0\\0"
    8   uint64        version (1)
    1   uint8         dtype code of P.bin (DTYPE_CODES: Megatron's DType enum, 1..8)
    8   uint64        S, the number of sequences
    8   uint64        D, the number of document-index entries (documents + 1)
    4*S int32         tokens in each sequence
    8*S int64         byte offset (pointer) of each sequence in P.bin
    8*D int64         document indices: document j is sequences [doc[j], doc[j+1]); doc[0] = 0
    1*S int8          (optional, multimodal datasets) the mode of each sequence

A sequence is what training samples are cut from (Megatron's ``IndexedDataset[i]``); with
``tools/preprocess_data.py`` every document is one sequence. ``len(ds)`` is the number of sequences.

Indexes written by earlier megareshard versions (magic ``MRSHIDX``) still load; ``python -m
megareshard.data.indexed_dataset --convert PREFIX`` rewrites one as Megatron's index in place (the
``.bin`` is already the same bytes). The reader checks every size against the file lengths, so a
truncated or mismatched pair fails loudly with the file name. The writer writes temp files and
renames them into place (the old ``.idx`` is removed first, the new one renamed last), so a crash never
leaves a pair that reads as a valid dataset.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
from array import array
from types import MappingProxyType
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
HEADER_SIZE = _HEADER.size  # 34

#: Megatron-LM's DType enum: code <-> numpy dtype (every code its reader accepts).
DTYPE_CODES = MappingProxyType({1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16})

# The index format of megareshard before it adopted Megatron's (read, and converted, only).
LEGACY_MAGIC = b"MRSHIDX\x00"
_LEGACY_HEADER = struct.Struct("<8sQB7xQQ")  # magic, version, dtype code, num docs, num tokens
_LEGACY_CODES = {**DTYPE_CODES, 9: np.uint32}


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's code of a token dtype (integer dtypes only: floats are not token ids)."""
    dt = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dt and dt.kind in "iu":
            return code
    raise ValueError(f"unsupported token dtype {dt}; use one of "
                     f"{[np.dtype(t).name for t in DTYPE_CODES.values() if np.dtype(t).kind in 'iu']}")


def best_dtype(vocab_size: int) -> type:
    """Megatron's choice of token dtype: uint16 below 65500 ids (halves the disk/IO), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _write_index(f, code: int, lengths: np.ndarray, pointers: np.ndarray, doc_indices: np.ndarray,
                 modes: np.ndarray | None) -> None:
    f.write(_HEADER.pack(MAGIC, VERSION, code, len(lengths), len(doc_indices)))
    f.write(np.asarray(lengths, dtype="<i4").tobytes())
    f.write(np.asarray(pointers, dtype="<i8").tobytes())
    f.write(np.asarray(doc_indices, dtype="<i8").tobytes())
    if modes is not None:
        f.write(np.asarray(modes, dtype="<i1").tobytes())


def _atomic_write_index(prefix: str, write) -> str:
    """Write ``prefix.idx`` through a temp file in the same directory; returns the temp path moved in."""
    d = os.path.dirname(os.path.abspath(prefix))
    fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(prefix)}.idx.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.remove(tmp)
        raise
    return tmp


class IndexedDatasetWriter:
    """Append documents, then ``finalize()``; use as a context manager.

    ``add_document(tokens)`` appends one document of one sequence; ``add_document(tokens, lengths)``
    one document of several sequences (Megatron's sentence-split documents). With
    ``multimodal=True`` every sequence carries a mode (an int8, written after the document indices).
    On a clean ``with`` exit the dataset is finalized; if the block raises, the temp files are
    removed and no ``P.bin``/``P.idx`` is created (an existing dataset at P is left untouched).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16, *,
                 multimodal: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.multimodal = multimodal
        info = np.iinfo(self.dtype)
        self._min, self._max = int(info.min), int(info.max)
        d = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(d, exist_ok=True)
        base = os.path.basename(self.prefix)
        fd, self._bin_tmp = tempfile.mkstemp(prefix=f"{base}.bin.", suffix=".tmp", dir=d)
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._lengths = array("q")
        self._modes = array("b")
        self._doc_indices = array("q", [0])
        self._num_tokens = 0
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None,
                     modes: Sequence[int] | None = None) -> None:
        """Append one document: its token ids in order, split into sequences of ``lengths`` (default: one)."""
        if self._done:
            raise RuntimeError(f"IndexedDatasetWriter({self.prefix!r}) is already finalized or discarded")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token sequence, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iub":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype} writing {self.prefix!r}")
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size or any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths {lengths} do not add up to the document's {arr.size} tokens")
        if self.multimodal != (modes is not None):
            raise ValueError(f"modes {'missing' if self.multimodal else 'given'} for a "
                             f"{'multimodal' if self.multimodal else 'text-only'} dataset {self.prefix!r}")
        if modes is not None and len(modes) != len(lengths):
            raise ValueError(f"{len(modes)} modes for {len(lengths)} sequences")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._min or hi > self._max:
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit {self.dtype.name} "
                                 f"(range [{self._min}, {self._max}]) writing {self.prefix!r}")
        if max(lengths, default=0) > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the int32 length field")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths)
        if modes is not None:
            self._modes.extend(int(m) for m in modes)
        self._doc_indices.append(len(self._lengths))
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
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            modes = np.frombuffer(self._modes, dtype=np.int8) if self.multimodal else None
            if modes is not None and not len(modes):
                modes = np.zeros(0, np.int8)
            doc_indices = np.frombuffer(self._doc_indices, dtype=np.int64)
            idx_tmp = _atomic_write_index(self.prefix, lambda f: _write_index(f, self._code, lengths, pointers,
                                                                                doc_indices, modes))
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


def _read_megatron_index(idx_path: str, idx_size: int) -> tuple:
    with open(idx_path, "rb") as f:
        magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(HEADER_SIZE))
    if version != VERSION:
        raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} (this reader knows {VERSION})")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (Megatron's codes: {sorted(DTYPE_CODES)})")
    base = HEADER_SIZE + 12 * n_seq + 8 * n_doc
    if idx_size == base + n_seq and n_seq:
        has_modes = True
    elif idx_size == base:
        has_modes = False
    else:
        raise IndexedDatasetError(f"{idx_path}: {'truncated' if idx_size < base else 'oversized'} index: "
                                  f"{idx_size} bytes, expected {base} (or {base + n_seq} with sequence modes) for "
                                  f"{n_seq} sequences and {n_doc} document indices")

    def mm(dtype, offset, count):
        return np.memmap(idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else \
            np.zeros(0, dtype)

    lengths = mm("<i4", HEADER_SIZE, n_seq)
    pointers = mm("<i8", HEADER_SIZE + 4 * n_seq, n_seq)
    doc_indices = mm("<i8", HEADER_SIZE + 12 * n_seq, n_doc)
    modes = mm("<i1", base, n_seq) if has_modes else None
    return np.dtype(DTYPE_CODES[code]), lengths, pointers, doc_indices, modes


def _read_legacy_index(idx_path: str, idx_size: int) -> tuple:
    legacy_size = _LEGACY_HEADER.size
    if idx_size < legacy_size:
        raise IndexedDatasetError(f"{idx_path}: truncated index: {idx_size} bytes, shorter than the "
                                  f"{legacy_size}-byte header")
    with open(idx_path, "rb") as f:
        _, version, code, n_docs, n_tokens = _LEGACY_HEADER.unpack(f.read(legacy_size))
    if version != 1:
        raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} (this reader knows 1)")
    if code not in _LEGACY_CODES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (known: {sorted(_LEGACY_CODES)})")
    dtype = np.dtype(_LEGACY_CODES[code])
    expected = legacy_size + 8 * (n_docs + 1) + 4 * n_docs
    if idx_size != expected:
        raise IndexedDatasetError(f"{idx_path}: {'truncated' if idx_size < expected else 'oversized'} index: "
                                  f"{idx_size} bytes, expected {expected} for {n_docs} documents")
    offsets = np.fromfile(idx_path, dtype="<i8", count=n_docs + 1, offset=legacy_size)
    lengths = np.fromfile(idx_path, dtype="<i4", count=n_docs, offset=legacy_size + 8 * (n_docs + 1))
    if offsets[0] != 0 or offsets[-1] != n_tokens or not np.array_equal(np.diff(offsets), lengths):
        raise IndexedDatasetError(f"{idx_path}: corrupt index: offsets and lengths disagree")
    pointers = offsets[:-1] * dtype.itemsize
    return dtype, lengths, pointers, np.arange(n_docs + 1, dtype=np.int64), None


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin``/``prefix.idx`` (Megatron's index, or ours of old).

    ``len(ds)`` is the number of sequences, ``ds[i]`` the tokens of sequence i (a numpy view into
    the memory map; copy it before mutating), ``ds.get(i, offset, length)`` part of one.
    ``document_indices`` groups sequences into documents; ``sequence_modes`` is None unless multimodal.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for p, what in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset {what} file not found: {p!r} "
                                        f"(build it with tools/preprocess_data.py --output-prefix ...; its files are "
                                        f"PREFIX_text_document.bin/.idx)")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            magic = f.read(9)
        self.legacy = magic[:8] == LEGACY_MAGIC
        if self.legacy:
            self.dtype, lengths, pointers, doc_indices, modes = _read_legacy_index(idx_path, idx_size)
        elif magic == MAGIC:
            if idx_size < HEADER_SIZE:
                raise IndexedDatasetError(f"{idx_path}: truncated index: {idx_size} bytes, shorter than the "
                                          f"{HEADER_SIZE}-byte header")
            self.dtype, lengths, pointers, doc_indices, modes = _read_megatron_index(idx_path, idx_size)
        elif len(magic) < 9:
            raise IndexedDatasetError(f"{idx_path}: truncated index: {idx_size} bytes, shorter than the "
                                      f"{HEADER_SIZE}-byte header")
        else:
            raise IndexedDatasetError(f"{idx_path}: bad magic {magic!r} (expected Megatron's {MAGIC!r}): "
                                      f"not an indexed dataset index")
        self._lengths, self._pointers, self.document_indices, self.sequence_modes = lengths, pointers, \
            doc_indices, modes
        n_seq = len(lengths)
        if n_seq and int(lengths.min()) < 0:
            raise IndexedDatasetError(f"{idx_path}: corrupt index: negative sequence length "
                                      f"{int(lengths.min())} at sequence {int(np.argmin(lengths))}")
        if len(doc_indices) and (doc_indices[0] != 0 or np.any(np.diff(doc_indices) < 0)
                                 or doc_indices[-1] > n_seq):
            raise IndexedDatasetError(f"{idx_path}: corrupt document indices: they must rise from 0 to at most "
                                      f"the {n_seq} sequences")
        itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        self._num_tokens = int(np.sum(lengths, dtype=np.int64))
        if n_seq:
            starts = np.asarray(pointers, dtype=np.int64)
            ends = starts + np.asarray(lengths, dtype=np.int64) * itemsize
            contiguous = starts[0] == 0 and np.array_equal(starts[1:], ends[:-1])
            if not contiguous:
                bad = int(np.flatnonzero(np.concatenate([[starts[0] != 0], starts[1:] != ends[:-1]]))[0])
                if np.any(starts % itemsize) or np.any(starts < 0):
                    raise IndexedDatasetError(f"{idx_path}: corrupt index: sequence {bad} starts at byte "
                                              f"{int(starts[bad])}, not a multiple of {itemsize} ({self.dtype.name})")
            if contiguous and bin_size > int(ends[-1]):
                raise IndexedDatasetError(f"{bin_path}: size {bin_size} bytes does not match its index {idx_path} "
                                          f"({self._num_tokens} tokens x {itemsize} bytes = {int(ends[-1])} bytes): "
                                          f"unindexed bytes from offset {int(ends[-1])} (an .idx of another .bin?)")
            if int(ends.max()) > bin_size:
                bad = int(np.flatnonzero(ends > bin_size)[0])
                doc = int(np.searchsorted(np.asarray(doc_indices), bad, side="right")) - 1
                raise IndexedDatasetError(f"{bin_path}: size {bin_size} bytes does not match its index {idx_path} "
                                          f"({self._num_tokens} tokens x {itemsize} bytes = {int(ends.max())} bytes): "
                                          f"truncated at byte offset {bin_size}, inside or before sequence {bad} "
                                          f"(document {doc}, bytes [{int(starts[bad])}, {int(ends[bad])}))")
        elif bin_size:
            raise IndexedDatasetError(f"{bin_path}: size {bin_size} bytes does not match its index {idx_path} "
                                      f"(0 sequences)")
        self._starts = np.asarray(pointers, dtype=np.int64) // itemsize if n_seq else np.zeros(0, np.int64)
        n_items = bin_size // itemsize
        self._tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(n_items,)) if n_items
                        else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def doc_lengths(self) -> np.ndarray:
        """Token count of every sequence (int32, ``len(self)``; Megatron's ``sequence_lengths``)."""
        return self._lengths

    sequence_lengths = doc_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """Byte offset of every sequence in the ``.bin`` (int64, ``len(self)``)."""
        return self._pointers

    @property
    def tokens(self) -> np.ndarray:
        """The whole ``.bin`` as a flat token array (memory-mapped)."""
        return self._tokens

    def _check(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix!r} with {n} sequences")
        return i % n if n else i

    def __getitem__(self, i: int) -> np.ndarray:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = self._check(int(i))
        start = int(self._starts[i])
        return self._tokens[start:start + int(self._lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when length is None)."""
        i = self._check(int(i))
        n = int(self._lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"get({i}, offset={offset}, length={length}) out of range: sequence {i} of "
                             f"{self.prefix!r} has {n} tokens")
        start = int(self._starts[i]) + offset
        return self._tokens[start:start + length]

    def __repr__(self) -> str:
        fmt = "megareshard legacy" if self.legacy else "Megatron"
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
                f"tokens={self._num_tokens}, dtype={self.dtype.name}, format={fmt})")


def write_indexed_dataset(prefix: str, docs: Iterable[Sequence[int] | np.ndarray],
                          dtype: np.dtype | type = np.uint16) -> IndexedDataset:
    """Write ``docs`` to ``prefix.bin/.idx`` atomically and open the result."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents(docs)
    return IndexedDataset(prefix)


def convert_legacy_index(prefix: str) -> bool:
    """Rewrite an ``MRSHIDX`` index of ``prefix`` as Megatron's ``MMIDIDX`` (the ``.bin`` is unchanged).

    Returns False when the index already is Megatron's. Atomic: the new index replaces the old one
    only once fully written.
    """
    ds = IndexedDataset(prefix)
    if not ds.legacy:
        return False
    try:
        code = dtype_code(ds.dtype)
    except ValueError:
        raise IndexedDatasetError(f"{index_file_path(prefix)}: tokens are {ds.dtype.name}, which Megatron's format "
                                  f"has no code for; re-run tools/preprocess_data.py") from None
    lengths, pointers, doc_indices = (np.array(ds.doc_lengths), np.array(ds.sequence_pointers),
                                      np.array(ds.document_indices))
    del ds
    tmp = _atomic_write_index(prefix, lambda f: _write_index(f, code, lengths, pointers, doc_indices, None))
    os.replace(tmp, index_file_path(prefix))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megareshard.data.indexed_dataset [--convert] PREFIX...``: describe (or convert) datasets."""
    parser = argparse.ArgumentParser(prog="python -m megareshard.data.indexed_dataset",
                                     description="describe indexed datasets; --convert rewrites old megareshard "
                                                 "(MRSHIDX) indexes as Megatron's (MMIDIDX)")
    parser.add_argument("prefixes", nargs="+", metavar="PREFIX")
    parser.add_argument("--convert", action="store_true")
    args = parser.parse_args(argv)
    for prefix in args.prefixes:
        try:
            if args.convert:
                print(f"{prefix}: {'converted to' if convert_legacy_index(prefix) else 'already in'} "
                      f"Megatron's format")
            ds = IndexedDataset(prefix)
        except (OSError, IndexedDatasetError) as exc:
            parser.error(str(exc))
        lens = np.asarray(ds.doc_lengths)
        print(ds)
        if len(lens):
            print(f"sequence length: min {lens.min()} mean {lens.mean():.1f} max {lens.max()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
