"""Indexed dataset format: round trip, atomic writes, clear errors on missing/corrupt files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megareshard.data.indexed_dataset import (HEADER_SIZE, IndexedDataset, IndexedDatasetError,
                                              IndexedDatasetWriter, best_dtype, write_indexed_dataset)


def random_docs(n: int, vocab: int, seed: int = 0, max_len: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(n)]


@pytest.mark.parametrize("vocab", [1000, 65499, 70000])
def test_round_trip(tmp_path, vocab):
    docs = random_docs(50, vocab, seed=vocab)
    docs[3] = np.zeros(0, np.int64)  # empty document
    ds = write_indexed_dataset(str(tmp_path / "d"), docs, best_dtype(vocab))
    assert ds.dtype == (np.uint16 if vocab < 65500 else np.int32)
    assert len(ds) == 50 and ds.num_tokens == sum(len(d) for d in docs)
    assert list(ds.doc_lengths) == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    i = next(i for i, d in enumerate(docs) if len(d) > 20)
    np.testing.assert_array_equal(ds.get(i, 5, 10), docs[i][5:15])
    np.testing.assert_array_equal(ds.get(i, 5), docs[i][5:])
    with pytest.raises(IndexError, match="has"):
        ds.get(i, 0, len(docs[i]) + 1)
    with pytest.raises(IndexError):
        ds[50]
    assert os.path.getsize(tmp_path / "d.bin") == ds.num_tokens * ds.dtype.itemsize


def test_empty_dataset(tmp_path):
    ds = write_indexed_dataset(str(tmp_path / "e"), [])
    assert len(ds) == 0 and ds.num_tokens == 0


def test_token_out_of_dtype_range(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        write_indexed_dataset(str(tmp_path / "x"), [[1, 2, 70000]], np.uint16)
    assert os.listdir(tmp_path) == []


def test_failure_midway_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "p")
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for i, d in enumerate(random_docs(20, 1000)):
                if i == 10:
                    raise RuntimeError("boom")
                w.add_document(d)
    assert os.listdir(tmp_path) == []


def test_failure_keeps_previous_dataset(tmp_path):
    prefix = str(tmp_path / "p")
    old = random_docs(5, 1000, seed=1)
    write_indexed_dataset(prefix, old)
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(prefix) as w:
            w.add_documents(random_docs(5, 1000, seed=2))
            raise KeyboardInterrupt
    ds = IndexedDataset(prefix)
    np.testing.assert_array_equal(ds[4], old[4])
    assert sorted(os.listdir(tmp_path)) == ["p.bin", "p.idx"]


def test_missing_files_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx"):
        IndexedDataset(str(tmp_path / "nothere"))
    write_indexed_dataset(str(tmp_path / "d"), random_docs(3, 100))
    os.remove(tmp_path / "d.bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(str(tmp_path / "d"))


@pytest.fixture
def dataset(tmp_path) -> str:
    prefix = str(tmp_path / "c")
    write_indexed_dataset(prefix, random_docs(10, 1000))
    return prefix


def test_bad_magic(dataset):
    with open(dataset + ".idx", "r+b") as f:
        f.write(b"NOTMAGIC")
    with pytest.raises(IndexedDatasetError, match=r"c\.idx.*bad magic"):
        IndexedDataset(dataset)


def test_truncated_header(dataset):
    with open(dataset + ".idx", "r+b") as f:
        f.truncate(HEADER_SIZE - 3)
    with pytest.raises(IndexedDatasetError, match=r"c\.idx.*truncated"):
        IndexedDataset(dataset)


def test_truncated_index(dataset):
    size = os.path.getsize(dataset + ".idx")
    with open(dataset + ".idx", "r+b") as f:
        f.truncate(size - 4)
    with pytest.raises(IndexedDatasetError, match=r"c\.idx.*truncated index.*10 sequences"):
        IndexedDataset(dataset)


def test_bin_size_mismatch(dataset):
    with open(dataset + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: size .* does not match"):
        IndexedDataset(dataset)


def test_corrupt_lengths_and_version(dataset):
    with open(dataset + ".idx", "r+b") as f:  # sequence 2's length: the pointers no longer line up
        f.seek(HEADER_SIZE + 4 * 2)
        f.write(struct.pack("<i", 100000))
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: size .* does not match"):
        IndexedDataset(dataset)
    with open(dataset + ".idx", "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<Q", 99))
    with pytest.raises(IndexedDatasetError, match=r"c\.idx: unsupported index version 99"):
        IndexedDataset(dataset)
