"""Tokenizer training (lossless round trip) and tools/preprocess_data.py end to end."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megareshard.data.indexed_dataset import IndexedDataset
from megareshard.data.tokenizer import SentencePieceTokenizer, TokenizerError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STDLIB = os.path.dirname(os.__file__)
# A fixed handful of stdlib modules: real code with tabs, unicode, long and blank lines.
CORPUS_NAMES = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "string.py",
                "calendar.py")


def corpus_files() -> list[str]:
    files = [os.path.join(STDLIB, n) for n in CORPUS_NAMES if os.path.isfile(os.path.join(STDLIB, n))]
    if len(files) < 4:  # unusual install: take whatever is there
        files = sorted(glob.glob(os.path.join(STDLIB, "*.py")))[:8]
    return files


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A 1000-piece BPE model trained on a few stdlib sources (well under a second)."""
    prefix = str(tmp_path_factory.mktemp("tok") / "sp")
    res = run_tool("train_tokenizer.py", "--input", *corpus_files(), "--model-prefix", prefix,
                   "--vocab-size", "1000", "--model-type", "bpe")
    assert res.returncode == 0, res.stderr
    assert "[train_tokenizer]" in res.stderr  # progress/summary on stderr
    assert os.path.isfile(prefix + ".vocab")
    assert not [p for p in os.listdir(os.path.dirname(prefix)) if ".tmp" in p]
    return prefix + ".model"


@pytest.fixture(scope="module")
def tok(model_path) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(model_path)


TRICKY = [
    "naïve — 日本語\t\n  x",
    "  leading spaces and trailing  \n\n",
    "\ttab\tseparated\t\r\nwindows line\r\n",
    "def f(x):\n    return x  # 12345 😀\n",
    "",
    " ",
    "\n",
    "<eod> is only text here",
    "Ω≈ç√∫˜µ≤≥÷ \x00\x7f control bytes",
]


def test_round_trip_tricky_strings(tok):
    for s in TRICKY:
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_round_trip_real_files_and_compresses(tok):
    for path in corpus_files()[:3] + [os.path.join(STDLIB, "os.py")]:
        text = open(path, encoding="utf-8").read()
        ids = tok.encode(text)
        assert tok.decode(ids) == text, path
        assert len(ids) < len(text.encode("utf-8")) / 2  # learned pieces, not just bytes


def test_special_ids(tok):
    assert tok.vocab_size == 1000
    assert tok.id_to_piece(tok.eod) == "<eod>"
    assert (tok.pad, tok.bos, tok.eos, tok.eod) == (0, 2, 3, 4)
    assert tok.eod not in tok.encode("<eod> text\n" * 3)  # control piece is never produced from text
    assert tok.decode([tok.eod]) == ""
    assert all(0 <= i < tok.vocab_size for i in tok.encode(open(corpus_files()[0]).read()))


def test_missing_model_names_path(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match="nope.model"):
        SentencePieceTokenizer(missing)


def test_train_tokenizer_bad_input_is_clear(tmp_path):
    res = run_tool("train_tokenizer.py", "--input", str(tmp_path / "nothing*.txt"), "--model-prefix",
                   str(tmp_path / "m"), "--vocab-size", "300")
    assert res.returncode == 2 and "matched no files" in res.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_text_files_end_to_end(tmp_path, model_path, tok, workers):
    files = corpus_files()[:4]
    extra = tmp_path / "tricky.txt"
    extra.write_text("".join(TRICKY), encoding="utf-8")
    files.append(str(extra))
    prefix = str(tmp_path / "out" / "code")
    res = run_tool("preprocess_data.py", "--input", *files, "--tokenizer-model", model_path,
                   "--output-prefix", prefix, "--workers", str(workers), "--append-eod")
    assert res.returncode == 0, res.stderr
    assert "documents" in res.stderr and "MB/s" in res.stderr
    ds = IndexedDataset(prefix + "_text_document")
    assert len(ds) == len(files) and ds.dtype == np.uint16
    assert ds.num_tokens == int(np.sum(ds.doc_lengths))
    for i, path in enumerate(files):
        doc = ds[i]
        assert doc[-1] == tok.eod
        assert tok.decode(doc.tolist()) == open(path, encoding="utf-8", newline="").read()
    assert sorted(os.listdir(tmp_path / "out")) == ["code_text_document.bin", "code_text_document.idx"]  # no temp files


def test_preprocess_jsonl(tmp_path, model_path, tok):
    texts = ["first doc\n\twith tab", "  второй документ  ", "", "x = 1\n" * 50]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    prefix = str(tmp_path / "j")
    res = run_tool("preprocess_data.py", "--input", str(src), "--json-key", "text", "--tokenizer-model",
                   model_path, "--output-prefix", prefix)
    assert res.returncode == 0, res.stderr
    ds = IndexedDataset(prefix + "_text_document")
    assert [tok.decode(ds[i].tolist()) for i in range(len(ds))] == texts
    assert ds.doc_lengths[2] == 0


def test_preprocess_bad_jsonl_leaves_nothing(tmp_path, model_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text key"}\n', encoding="utf-8")
    prefix = tmp_path / "bad"
    res = run_tool("preprocess_data.py", "--input", str(src), "--tokenizer-model", model_path,
                   "--output-prefix", str(prefix))
    assert res.returncode == 2 and "bad.jsonl:2" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_unigram_model_round_trip(tmp_path):
    prefix = str(tmp_path / "uni")
    res = run_tool("train_tokenizer.py", "--input", *corpus_files()[:2], "--model-prefix", prefix,
                   "--vocab-size", "500", "--model-type", "unigram", "--quiet")
    assert res.returncode == 0, res.stderr
    t = SentencePieceTokenizer(prefix + ".model")
    assert t.vocab_size == 500 and t.id_to_piece(t.eod) == "<eod>"
    for s in TRICKY:
        assert t.decode(t.encode(s)) == s, repr(s)
