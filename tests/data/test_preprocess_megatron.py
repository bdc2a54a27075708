"""tools/preprocess_data.py with Megatron-LM's command line: names, keys, tokenizers, workers, progress."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megareshard.data.indexed_dataset import IndexedDataset
from megareshard.data.tokenizer import build_tokenizer
from tests.data.test_megatron_format import ref_read
from tests.data.test_tokenizers import CORPUS, train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    train_bpe(d).model.save(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_megatron_command_line_two_keys_two_workers(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    src = tmp_path / "x.jsonl"
    rows = [{"text": t, "title": t[:7], "id": i} for i, t in enumerate(CORPUS)]
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    prefix = str(tmp_path / "out" / "P")
    res = run_tool("--input", str(src), "--json-keys", "text", "title", "--output-prefix", prefix,
                   "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                   "--append-eod", "--workers", "2", "--log-interval", "4")
    assert res.returncode == 0, res.stderr
    assert "[preprocess_data]" in res.stderr and "documents" in res.stderr  # progress
    assert sorted(os.listdir(tmp_path / "out")) == ["P_text_document.bin", "P_text_document.idx",
                                                   "P_title_document.bin", "P_title_document.idx"]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    for key in ("text", "title"):
        dt, seqs, doc_idx, _ = ref_read(f"{prefix}_{key}_document")  # Megatron's layout, read independently
        assert dt == np.uint16 and doc_idx == list(range(len(rows) + 1))
        for seq, row in zip(seqs, rows):
            assert seq[-1] == tok.eod and tok.decode(seq[:-1].tolist()) == row[key]
        assert len(IndexedDataset(f"{prefix}_{key}_document")) == len(rows)


def test_null_tokenizer_and_huge_vocab_dtype(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "5 17 3"}\n{"text": "70000 1"}\n', encoding="utf-8")
    res = run_tool("--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", "100000", "--append-eod", "--workers", "1", "--quiet")
    assert res.returncode == 0, res.stderr
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds.dtype == np.int32  # 100001 ids: Megatron's int32
    assert ds[0].tolist() == [5, 17, 3, 100000] and ds[1].tolist() == [70000, 1, 100000]


@pytest.mark.parametrize("args, message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/v.json", "--merge-file", "/n/m.txt"],
     "--vocab-file /nonexistent/v.json: file not found"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--split-sentences"], "--split-sentences is not "
                                                                                          "supported"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"], "directory not found"),
])
def test_errors_are_one_line(tmp_path, args, message):
    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "1 2"}\n', encoding="utf-8")
    res = run_tool("--input", str(src), "--output-prefix", str(tmp_path / "o"), *args)
    assert res.returncode == 2 and res.stderr.startswith("preprocess_data.py: error: ") and message in res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == ["x.jsonl"]


def test_preprocessed_gpt2_corpus_trains_with_megatrons_flags(tmp_path, gpt2_files):
    """The Megatron-LM path end to end: preprocess with GPT-2 BPE, then train on PREFIX_text_document."""
    import io

    from megareshard.arguments import parse_args
    from megareshard.inputs import resolve_vocab
    from megareshard.training import pretrain

    vocab, merges = gpt2_files
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t * 4}, ensure_ascii=False) + "\n" for t in CORPUS * 3),
                   encoding="utf-8")
    res = run_tool("--input", str(src), "--output-prefix", str(tmp_path / "c"), "--vocab-file", vocab,
                   "--merge-file", merges, "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1",
                   "--quiet")
    assert res.returncode == 0, res.stderr
    cfg = parse_args(["--data-path", str(tmp_path / "c_text_document"), "--vocab-file", vocab, "--merge-file", merges,
                      "--split", "90,10,0", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                      "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "2",
                      "--eval-iters", "1", "--device", "cpu"], world_size=1)
    records = pretrain(cfg, out=io.StringIO())
    assert resolve_vocab(cfg)[0].model.vocab_size == len(json.load(open(vocab)))        # what the trainer used
    assert len(records) == 2 and "eval_loss" in records[-1]
