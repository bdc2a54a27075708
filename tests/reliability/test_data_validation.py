"""Bad data is refused at start-up with one line naming the file and the offset: a truncated .bin, an .idx of
another .bin, token ids >= the vocabulary size, an empty dataset, a zero blend weight. --no-data-validation
skips the token pass (huge corpora); the bad id is then only caught when a batch holds it."""
import contextlib
import io
import os
import shutil

import numpy as np
import pytest

import pretrain_gpt
from megareshard.data.indexed_dataset import IndexedDataset, IndexedDatasetError, write_indexed_dataset
from megareshard.data.validate import check_token_range

VOCAB = 50
ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "0",
        "--vocab-size", str(VOCAB), "--device", "cpu", "--split", "1,0,0"]


def docs(n=20, length=30, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length) for _ in range(n)]


def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain_gpt.main(ARGS + argv)
    lines = err.getvalue().strip().splitlines()
    return code, lines[-1] if lines else ""


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_indexed_dataset(prefix, docs())
    return prefix


def test_truncated_bin_names_file_and_offset(good):
    size = os.path.getsize(good + ".bin")
    with open(good + ".bin", "r+b") as f:
        f.truncate(size - 10)
    code, line = run(["--data-path", good])
    assert code == 2, line
    assert f"good.bin: size {size - 10} bytes does not match its index" in line, line
    assert f"truncated at byte offset {size - 10}, inside or before sequence 19 (document 19" in line, line


def test_idx_of_another_bin(good, tmp_path):
    other = str(tmp_path / "other")
    write_indexed_dataset(other, docs(n=10, seed=1))
    shutil.copy(other + ".idx", good + ".idx")   # a shorter index next to the longer .bin
    code, line = run(["--data-path", good])
    assert code == 2 and "good.bin" in line and f"unindexed bytes from offset {10 * 30 * 2}" in line, line


def test_token_ids_beyond_the_vocabulary(tmp_path):
    prefix = str(tmp_path / "big")
    d = docs()
    d[7][11] = VOCAB + 3
    write_indexed_dataset(prefix, d)
    code, line = run(["--data-path", prefix])
    offset = (7 * 30 + 11) * 2
    assert code == 2, line
    assert line.startswith(f"pretrain_gpt.py: error: {prefix}.bin: token id {VOCAB + 3} at byte offset {offset} "
                           f"(sequence 7, document 7, token 11 of the sequence) is outside the vocabulary "
                           f"[0, {VOCAB})"), line
    # --no-data-validation: start-up skips the pass; the id is caught when a batch holds it
    everywhere = str(tmp_path / "everywhere")
    d = docs()
    for doc in d:
        doc[::4] = VOCAB + 3  # every sample holds one
    write_indexed_dataset(everywhere, d)
    code, line = run(["--data-path", everywhere, "--no-data-validation"])
    assert code == 2 and f"token id {VOCAB + 3} in {everywhere} is outside the model's vocabulary" in line, line


def test_chunks_are_shared_and_each_finds_its_own():
    """The ranks split the chunks: only the rank whose chunk holds the bad id finds it (then all agree)."""
    ds_dir = os.environ.get("TMPDIR", "/tmp")
    prefix = os.path.join(ds_dir, f"chunks-{os.getpid()}")
    d = docs()
    d[15][0] = VOCAB  # token 450 of the .bin (byte 900): chunk 7 of 64-token chunks
    write_indexed_dataset(prefix, d)
    try:
        ds = IndexedDataset(prefix)
        check_token_range(ds, VOCAB, chunks=range(0, 10, 2), chunk_tokens=64)   # rank 0 of 2: even chunks, clean
        with pytest.raises(IndexedDatasetError, match="token id 50 at byte offset 900"):
            check_token_range(ds, VOCAB, chunks=range(1, 10, 2), chunk_tokens=64)  # rank 1: odd chunks, 7 among them
        with pytest.raises(IndexedDatasetError, match="token id 50 at byte offset 900"):
            check_token_range(ds, VOCAB)  # one rank: every chunk
    finally:
        for ext in (".bin", ".idx"):
            os.remove(prefix + ext)


def test_empty_dataset_and_zero_weight(good, tmp_path):
    empty = str(tmp_path / "empty")
    write_indexed_dataset(empty, [])
    code, line = run(["--data-path", empty])
    assert code == 2 and f"{empty}.bin: empty dataset (0 sequences, 0 tokens)" in line, line
    code, line = run(["--data-path", "0.5", good, "0", good + "2"])
    assert code == 2 and f"weight 0 for {good}2" in line, line
