"""Blended datasets with Megatron-LM's semantics, per-split data paths and the sample-index cache."""
from __future__ import annotations

import io
import json
import math
import os

import numpy as np
import pytest

from megareshard.arguments import ConfigError, parse_args
from megareshard.data.blended import (BlendedDataset, blending_indices, build_blend, parse_blend,
                                      samples_per_dataset)
from megareshard.data.gpt_dataset import GPTDataset
from megareshard.data.indexed_dataset import write_indexed_dataset
from megareshard.training import pretrain


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two datasets whose token ids do not overlap (A: 0..99, B: 100..199), so a sample names its source."""
    d = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    a, b = str(d / "a_text_document"), str(d / "b_text_document")
    write_indexed_dataset(a, [rng.integers(0, 100, size=int(rng.integers(5, 60))) for _ in range(80)])
    write_indexed_dataset(b, [rng.integers(100, 200, size=int(rng.integers(5, 60))) for _ in range(80)])
    return a, b


def test_parse_blend():
    assert parse_blend(["P"]) == (["P"], None)
    assert parse_blend(["0.3", "P1", "0.7", "P2"]) == (["P1", "P2"], [0.3, 0.7])
    assert parse_blend(["P1", "P2"]) == (["P1", "P2"], None)
    for bad, msg in ((["0.3", "P1", "0.7"], "pairs"), (["-1", "P1", "2", "P2"], "non-negative"),
                     (["P1", "0.5"], "mixes prefixes"), (["0", "P1", "0", "P2"], "add up to 0")):
        with pytest.raises(ValueError, match=msg):
            parse_blend(bad)


def test_blending_indices_follow_the_weights_at_every_prefix():
    w = [0.2, 0.5, 0.3]
    ds, idx = blending_indices([2, 5, 3], 1000)  # unnormalised weights are normalised
    for i in (1, 7, 99, 500, 1000):
        counts = np.bincount(ds[:i], minlength=3)
        assert np.all(np.abs(counts - np.asarray(w) * i) <= 1.0), (i, counts)
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(idx[ds == d], np.arange((ds == d).sum()))
    ds2, idx2 = blending_indices([2, 5, 3], 1000)
    assert np.array_equal(ds, ds2) and np.array_equal(idx, idx2)  # deterministic


def test_per_dataset_sample_counts_have_megatrons_surplus():
    assert samples_per_dataset(1000, [1, 3]) == [math.ceil(250 * 1.005), math.ceil(750 * 1.005)]


def test_blend_draws_the_right_samples(corpora):
    a, b = corpora
    train, valid, test = build_blend(["0.25", a, "0.75", b], "90,10,0", 16, [200, 20, 0], seed=3)
    assert isinstance(train, BlendedDataset) and len(train) == 200 and test is None
    src = [int(train[i]["tokens"][0] >= 100) for i in range(200)]
    assert abs(sum(src) - 150) <= 1
    for i in (0, 17, 199):  # sample i is sample sample_index[i] of its dataset
        part = train.datasets[int(train.dataset_index[i])]
        assert np.array_equal(train[i]["tokens"].numpy(), part[int(train.sample_index[i])]["tokens"].numpy())
    assert len(valid) == 20 and valid.datasets[0].split_range == (72, 80)  # each dataset split by --split


def test_cache_is_written_and_reused(corpora, tmp_path):
    a, _ = corpora
    cache = str(tmp_path / "cache")
    first = GPTDataset(a, 16, 50, seed=1, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all(f.endswith(".npy") for f in files)
    again = GPTDataset(a, 16, 50, seed=1, cache_dir=cache)
    assert again.cache_files == first.cache_files and sorted(os.listdir(cache)) == files
    for i in range(50):
        assert np.array_equal(first[i]["tokens"].numpy(), again[i]["tokens"].numpy())
    GPTDataset(a, 16, 50, seed=2, cache_dir=cache)  # other parameters: other files
    assert len(os.listdir(cache)) == 8


def run(argv, tmp_path):
    out = io.StringIO()
    cfg = parse_args(argv + ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--vocab-size", "200", "--device", "cpu", "--log-interval", "1"], world_size=1)
    return pretrain(cfg, out=out), out.getvalue()


def test_training_on_a_blend_and_on_per_split_paths(corpora, tmp_path):
    a, b = corpora
    recs, _ = run(["--data-path", "0.5", a, "0.5", b, "--train-iters", "2", "--data-cache-path",
                   str(tmp_path / "c")], tmp_path)
    cached = sorted(os.listdir(tmp_path / "c"))
    # train and (default evaluation) valid blends: 2 blend index files each, 4 sample-index files per dataset
    assert len(recs) == 2 and sum("-blend-" in f for f in cached) == 4 and sum("-train-" in f for f in cached) == 8
    recs, _ = run(["--train-data-path", a, "--valid-data-path", b, "--train-iters", "2", "--eval-interval", "2",
                   "--eval-iters", "1"], tmp_path)
    assert "eval_loss" in recs[-1]
    with pytest.raises(ConfigError, match="--data-path: .*pairs"):
        run(["--data-path", "0.5", a, "0.5"], tmp_path)
    with pytest.raises(ConfigError, match="--data-path conflicts with --train-data-path"):
        run(["--data-path", a, "--train-data-path", b], tmp_path)


def test_data_args_files(corpora, tmp_path):
    a, b = corpora
    (tmp_path / "args.txt").write_text(f"0.4 {a}\n0.6 {b}\n")
    base = ["--vocab-size", "200"]
    d = parse_args(base + ["--data-args-path", str(tmp_path / "args.txt")], world_size=1).data
    assert d.data_path == ["0.4", a, "0.6", b]
    (tmp_path / "split.json").write_text(json.dumps({"train": f"1 {a} 1 {b}", "valid": [b], "test": None}))
    d = parse_args(base + ["--per-split-data-args-path", str(tmp_path / "split.json")], world_size=1).data
    assert d.train_data_path == ["1", a, "1", b] and d.valid_data_path == [b] and d.test_data_path is None
    with pytest.raises(ConfigError, match="--data-args-path .*missing.txt: No such file"):
        parse_args(base + ["--data-args-path", str(tmp_path / "missing.txt")], world_size=1)
