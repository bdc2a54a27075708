"""GPTDataset sample construction, document splits, and the mock dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megareshard.data.blended import build_train_valid_test_datasets
from megareshard.data.gpt_dataset import GPTDataset, split_documents
from megareshard.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from megareshard.data.mock import MockGPTDataset


@pytest.fixture
def indexed(tmp_path) -> IndexedDataset:
    # Document d holds the tokens d*1000 + 0, 1, 2, ... so every token names its document.
    rng = np.random.default_rng(0)
    docs = [d * 1000 + np.arange(rng.integers(1, 60)) for d in range(40)]
    docs[7] = np.zeros(0, np.int64)  # empty documents must be skipped transparently
    return write_indexed_dataset(str(tmp_path / "g"), docs, np.int32)


def all_tokens(ds: GPTDataset) -> np.ndarray:
    return np.stack([ds[i]["tokens"].numpy() for i in range(len(ds))])


def test_samples_shape_and_content(indexed):
    ds = GPTDataset(indexed, seq_length=32, num_samples=100, seed=3)
    toks = all_tokens(ds)
    assert toks.shape == (100, 33) and ds[0]["tokens"].dtype == torch.long
    assert ds.num_epochs > 1  # 100 samples need more tokens than one pass over ~1200
    crossing = 0
    for i in range(len(ds)):
        spans = ds.sample_spans(i)
        assert sum(n for _, _, n in spans) == 33
        expect = np.concatenate([indexed.get(d, o, n) for d, o, n in spans])
        np.testing.assert_array_equal(toks[i], expect)
        # within a document tokens are consecutive; a new document starts at its offset 0
        for (d0, o0, n0), (d1, o1, n1) in zip(spans, spans[1:]):
            assert o0 + n0 == indexed.doc_lengths[d0] and o1 == 0
        crossing += len(spans) > 1
    assert crossing > 50  # docs are shorter than samples: most samples cross boundaries


def test_epoch_covers_every_token_once(indexed):
    # Consecutive (unshuffled) samples overlap by exactly one token and walk whole documents.
    ds = GPTDataset(indexed, seq_length=16, num_samples=40, seed=5)
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx])
    order = np.argsort(ds.shuffle_idx)  # dataset index of unshuffled sample s
    for s in range(len(ds)):
        np.testing.assert_array_equal(ds[int(order[s])]["tokens"].numpy(), stream[s * 16:s * 16 + 17])
    first_epoch = ds.doc_idx[:len(indexed)]
    assert sorted(first_epoch.tolist()) == list(range(len(indexed)))


def test_deterministic_and_seed_dependent(indexed):
    a = all_tokens(GPTDataset(indexed, 24, 50, seed=1))
    b = all_tokens(GPTDataset(IndexedDataset(indexed.prefix), 24, 50, seed=1))
    c = all_tokens(GPTDataset(indexed, 24, 50, seed=2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_split_ranges_disjoint(indexed):
    ranges = split_documents(len(indexed), "80,15,5")
    assert ranges == [(0, 32), (32, 38), (38, 40)]
    names = ("train", "valid", "test")
    docs_seen = []
    for (b, e), name in zip(ranges, names):
        ds = GPTDataset(indexed, 8, 20, seed=0, split_range=(b, e), name=name)
        seen = {d for i in range(len(ds)) for d, _, _ in ds.sample_spans(i)}
        assert seen <= set(range(b, e))
        docs_seen.append(seen)
    assert not (docs_seen[0] & docs_seen[1]) and not (docs_seen[1] & docs_seen[2])


@pytest.mark.parametrize("n,split", [(1000, "969,30,1"), (10, "969,30,1"), (7, "1,1,1"), (100, "98/2/0"),
                                     (5, "100"), (0, "1,1,1"), (33, [0.5, 0.5])])
def test_split_documents_cover_exactly(n, split):
    r = split_documents(n, split)
    assert len(r) == 3 and r[0][0] == 0 and r[-1][1] == n
    assert all(b <= e for b, e in r) and r[0][1] == r[1][0] and r[1][1] == r[2][0]


def test_split_documents_megatron_values():
    assert split_documents(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    with pytest.raises(ValueError, match="bad split"):
        split_documents(10, "a,b")


def test_too_short_dataset_error(tmp_path):
    ix = write_indexed_dataset(str(tmp_path / "tiny"), [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"tiny.*has 5 tokens.*seq_length 8 \+ 1 = 9"):
        GPTDataset(ix, seq_length=8, num_samples=3, seed=0)
    ds = GPTDataset(ix, seq_length=4, num_samples=3, seed=0)  # exactly enough for one sample per epoch
    assert all(len(ds[i]["tokens"]) == 5 for i in range(3))


def test_build_train_valid_test(indexed):
    tr, va, te = build_train_valid_test_datasets(indexed.prefix, "90,10,0", 8, [10, 5, 5], seed=1)
    assert len(tr) == 10 and len(va) == 5 and te is None
    assert tr.split_range == (0, 36) and va.split_range == (36, 40)


def test_mock_dataset():
    a = MockGPTDataset(vocab_size=100, seq_length=64, num_samples=30, seed=7)
    b = MockGPTDataset(vocab_size=100, seq_length=64, num_samples=30, seed=7)
    c = MockGPTDataset(vocab_size=100, seq_length=64, num_samples=30, seed=8)
    ta = torch.stack([a[i]["tokens"] for i in range(30)])
    assert ta.shape == (30, 65) and ta.dtype == torch.long
    assert torch.equal(ta, torch.stack([b[i]["tokens"] for i in reversed(range(30))]).flip(0))
    assert not torch.equal(ta, torch.stack([c[i]["tokens"] for i in range(30)]))
    assert int(ta.min()) >= 0 and int(ta.max()) < 100
    # learnable: every sample is periodic with a short period or an arithmetic progression mod vocab
    for row in ta.numpy():
        diffs = np.diff(row) % 100
        periodic = any(np.array_equal(row[p:], row[:-p]) for p in range(2, 9))
        assert periodic or len(set(diffs.tolist())) == 1
    with pytest.raises(IndexError):
        a[30]


def _fresh_rng_tokens(ds: MockGPTDataset, idx: int) -> np.ndarray:
    """The mock stream as first published: a new RandomState per sample (runs and checkpoints made since rely on
    it; the dataset now re-seeds one RandomState a thread, which must draw the same)."""
    rng = np.random.RandomState([ds.seed & 0xFFFFFFFF, idx & 0xFFFFFFFF, idx >> 32])
    n, v = ds.seq_length + 1, ds.vocab_size
    t = np.arange(n, dtype=np.int64)
    if rng.randint(2) == 0:
        a, d = rng.randint(v), rng.randint(1, 5)
        return (a + d * t) % v
    motif = rng.randint(0, v, size=rng.randint(2, 9)).astype(np.int64)
    return motif[t % len(motif)]


def test_mock_dataset_stream_is_the_published_one_in_any_order_and_thread():
    import threading
    a = MockGPTDataset(vocab_size=50304, seq_length=32, num_samples=2 ** 33 + 9, seed=1234)
    b = MockGPTDataset(vocab_size=97, seq_length=16, num_samples=50, seed=5)
    idxs = [0, 1, 2, 17, 49, 2 ** 32 + 3, 2 ** 33 + 8]
    for i in idxs:      # interleaved with another dataset's reads: no state carries from one sample to the next
        assert np.array_equal(a.tokens(i), _fresh_rng_tokens(a, i))
        assert np.array_equal(b.tokens(i % 50), _fresh_rng_tokens(b, i % 50))
    got = {}
    th = threading.Thread(target=lambda: got.update({i: a.tokens(i) for i in idxs}))
    th.start()
    th.join()
    assert all(np.array_equal(got[i], _fresh_rng_tokens(a, i)) for i in idxs)
