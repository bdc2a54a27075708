"""Megatron-LM's indexed-dataset format, checked against an independent implementation in this file.

The reference writer/reader below follow the published description of Megatron-LM's ``.idx``
(megatron/core/datasets/readme.md and its IndexedDataset docstrings): a 9-byte header
``MMIDIDX\\0\\0``, a uint64 version 1, a uint8 dtype code (uint8 1, int8 2, int16 3, int32 4, int64 5,
float64 6, float32 7, uint16 8), uint64 sequence count, uint64 document-index count, then int32
sequence lengths, int64 byte pointers, int64 document indices and, for multimodal data, int8 modes.
They use only struct and numpy and share no code with megareshard.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megareshard.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, convert_legacy_index,
                                              write_indexed_dataset, main as indexed_main)

REF_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
             8: np.uint16}


def ref_write(prefix: str, docs: list[list[np.ndarray]], code: int, modes: list[list[int]] | None = None) -> None:
    """Reference writer: ``docs`` is a list of documents, each a list of sequences."""
    dt = np.dtype(REF_CODES[code])
    seqs = [s for d in docs for s in d]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dt).tobytes())
    lengths = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * dt.itemsize
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
        if modes is not None:
            flat = [m for d in modes for m in d]
            f.write(struct.pack(f"<{len(flat)}b", *flat))


def ref_read(prefix: str, multimodal: bool = False):
    """Reference reader: (dtype, sequences, document indices, modes)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    assert version == 1
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off)
    off += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off)
    off += 8 * n_doc
    modes = struct.unpack_from(f"<{n_seq}b", raw, off) if multimodal else None
    assert len(raw) == off + (n_seq if multimodal else 0)
    dt = np.dtype(REF_CODES[code])
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [np.frombuffer(data, dtype=dt, count=n, offset=p) for n, p in zip(lengths, pointers)]
    return dt, seqs, list(doc_idx), modes


def random_documents(seed: int, n_docs: int, lo: int, hi: int, max_seqs: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(lo, hi, size=int(rng.integers(0, 40))) for _ in range(int(rng.integers(1, max_seqs + 1)))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("code", sorted(REF_CODES))
def test_reads_every_megatron_dtype_code(tmp_path, code):
    dt = np.dtype(REF_CODES[code])
    hi = 100 if dt.itemsize == 1 else 30000
    lo = -50 if dt.kind in "if" else 0
    docs = random_documents(code, 25, lo, hi, max_seqs=3)
    prefix = str(tmp_path / "m")
    ref_write(prefix, docs, code)
    ds = IndexedDataset(prefix)
    seqs = [s for d in docs for s in d]
    assert ds.dtype == dt and not ds.legacy
    assert len(ds) == len(seqs) and ds.num_documents == len(docs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s.astype(dt))
        assert ds[i].dtype == dt
    bounds = np.cumsum([0] + [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, bounds)
    assert ds.sequence_modes is None


def test_reads_multimodal_modes(tmp_path):
    docs = random_documents(7, 10, 0, 1000, max_seqs=2)
    modes = [[(3 * j + k) % 5 for k in range(len(d))] for j, d in enumerate(docs)]
    prefix = str(tmp_path / "mm")
    ref_write(prefix, docs, 8, modes)
    ds = IndexedDataset(prefix)
    assert list(ds.sequence_modes) == [m for d in modes for m in d]
    np.testing.assert_array_equal(ds[3], [s for d in docs for s in d][3])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_written_here_reads_with_the_reference(tmp_path, dtype):
    docs = random_documents(int(np.dtype(dtype).itemsize), 30, 0, 200, max_seqs=3)
    prefix = str(tmp_path / "w")
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.concatenate(d), lengths=[len(s) for s in d])
    dt, seqs, doc_idx, _ = ref_read(prefix)
    assert dt == np.dtype(dtype)
    want = [s for d in docs for s in d]
    assert len(seqs) == len(want)
    for a, b in zip(seqs, want):
        np.testing.assert_array_equal(a, b)
    assert doc_idx == list(np.cumsum([0] + [len(d) for d in docs]))


def test_written_here_with_modes_reads_with_the_reference(tmp_path):
    prefix = str(tmp_path / "wm")
    with IndexedDatasetWriter(prefix, np.uint16, multimodal=True) as w:
        w.add_document([1, 2, 3, 4], lengths=[1, 3], modes=[0, 1])
        w.add_document([5, 6], modes=[2])
    _, seqs, doc_idx, modes = ref_read(prefix, multimodal=True)
    assert [list(s) for s in seqs] == [[1], [2, 3, 4], [5, 6]] and doc_idx == [0, 2, 3] and modes == (0, 1, 2)
    assert list(IndexedDataset(prefix).sequence_modes) == [0, 1, 2]


def test_float_tokens_and_out_of_range_ids_refused_by_the_writer(tmp_path):
    with pytest.raises(ValueError, match="unsupported token dtype float32"):
        IndexedDatasetWriter(str(tmp_path / "f"), np.float32)
    with pytest.raises(ValueError, match="do not add up"):
        with IndexedDatasetWriter(str(tmp_path / "g"), np.uint16) as w:
            w.add_document([1, 2, 3], lengths=[1, 1])


def ref_write_legacy(prefix: str, docs: list[np.ndarray], code: int = 8) -> None:
    """The index megareshard wrote before adopting Megatron's (magic MRSHIDX)."""
    dt = np.dtype(REF_CODES[code])
    lengths = [len(d) for d in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dt).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<8sQB7xQQ", b"MRSHIDX\x00", 1, code, len(docs), int(offsets[-1])))
        f.write(offsets.astype("<i8").tobytes())
        f.write(np.asarray(lengths, dtype="<i4").tobytes())


def test_legacy_index_loads_and_converts(tmp_path, capsys):
    docs = [d[0] for d in random_documents(3, 12, 0, 5000)]
    prefix = str(tmp_path / "old")
    ref_write_legacy(prefix, docs)
    bin_before = open(prefix + ".bin", "rb").read()
    ds = IndexedDataset(prefix)
    assert ds.legacy and len(ds) == 12
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    del ds
    assert indexed_main(["--convert", prefix]) == 0
    assert "converted to Megatron's format" in capsys.readouterr().out
    assert open(prefix + ".bin", "rb").read() == bin_before
    _, seqs, doc_idx, _ = ref_read(prefix)
    assert doc_idx == list(range(13))
    for a, b in zip(seqs, docs):
        np.testing.assert_array_equal(a, b)
    assert convert_legacy_index(prefix) is False  # already converted
    assert sorted(os.listdir(tmp_path)) == ["old.bin", "old.idx"]


def test_empty_documents_round_trip(tmp_path):
    ds = write_indexed_dataset(str(tmp_path / "e"), [[], [1, 2], []])
    assert len(ds) == 3 and list(ds.doc_lengths) == [0, 2, 0]
    _, seqs, doc_idx, _ = ref_read(str(tmp_path / "e"))
    assert [list(s) for s in seqs] == [[], [1, 2], []] and doc_idx == [0, 1, 2, 3]
