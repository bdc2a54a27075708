#!/usr/bin/env python3
"""Tokenize text into a memory-mapped indexed dataset (PREFIX.bin + PREFIX.idx).

Example:
    python tools/preprocess_data.py --input 'corpus/*.py' --tokenizer-model tok/code.model \
        --output-prefix data/code --workers 4 --append-eod
    python tools/preprocess_data.py --input docs.jsonl --json-key text ...

Each plain text file is one document; each line of a .jsonl file is one document (its
--json-key field). Document order in the dataset is input order. Tokens are stored as uint16
when the vocabulary has fewer than 65500 ids, else int32. The output appears atomically: temp
files are renamed into place only after everything was written, so an interrupted run leaves
no PREFIX.bin/PREFIX.idx that looks valid. Progress (documents, tokens, MB/s) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

try:
    from megareshard.data.indexed_dataset import IndexedDatasetWriter, best_dtype
    from megareshard.data.tokenizer import SentencePieceTokenizer
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megareshard.data.indexed_dataset import IndexedDatasetWriter, best_dtype
    from megareshard.data.tokenizer import SentencePieceTokenizer

try:
    from train_tokenizer import expand_inputs  # same directory (on sys.path when run as a script)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_tokenizer import expand_inputs

_BATCH_BYTES = 1 << 20  # documents are sent to workers in batches of about this much text


def iter_documents(files: Sequence[str], json_key: str, skip_invalid: bool = False) -> Iterator[tuple[str, int]]:
    """(text, size in bytes) of every document, in input order.

    A text file that is not UTF-8 is an error naming the file, or, with ``skip_invalid``, a
    warning on stderr and the file is left out (so document i no longer equals input file i).
    """
    for path in files:
        if path.endswith(".jsonl") or path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[json_key]
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ValueError(f"{path}:{lineno}: bad JSON line or no key {json_key!r}: {exc}") from exc
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{lineno}: field {json_key!r} is {type(text).__name__}, not a string")
                    yield text, len(line.encode("utf-8"))
        else:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if skip_invalid:
                    print(f"[preprocess_data] warning: skipping {path}: not UTF-8 text: {exc}", file=sys.stderr)
                    continue
                raise ValueError(f"{path}: not UTF-8 text: {exc} (use --skip-invalid to leave such files out)") from exc
            yield text, len(raw)


def iter_batches(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    batch: list[str] = []
    size = 0
    for text, n in docs:
        batch.append(text)
        size += n
        if size >= _BATCH_BYTES or len(batch) >= 1024:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


class _Encoder:
    """Per-process tokenizer state (each pool worker loads the model once)."""

    def __init__(self, model: str, append_eod: bool, dtype: type) -> None:
        self.tok = SentencePieceTokenizer(model)
        self.append_eod, self.dtype = append_eod, dtype

    def __call__(self, batch_and_size: tuple[list[str], int]) -> tuple[list[np.ndarray], int]:
        batch, size = batch_and_size
        out = []
        for ids in self.tok.encode_batch(batch):
            if self.append_eod:
                ids.append(self.tok.eod)
            out.append(np.asarray(ids, dtype=self.dtype))
        return out, size


def _worker_init(model: str, append_eod: bool, dtype: type) -> None:
    global _ENCODER  # per-worker-process state, set once by the pool initializer
    _ENCODER = _Encoder(model, append_eod, dtype)


def _worker_encode(batch_and_size: tuple[list[str], int]) -> tuple[list[np.ndarray], int]:
    return _ENCODER(batch_and_size)


def preprocess(files: Sequence[str], tokenizer_model: str, output_prefix: str, workers: int = 1,
               append_eod: bool = False, json_key: str = "text", quiet: bool = False,
               skip_invalid: bool = False) -> dict:
    """Tokenize ``files`` into ``output_prefix.bin/.idx``; returns counts (documents, tokens, bytes, seconds)."""
    tok = SentencePieceTokenizer(tokenizer_model)
    dtype = best_dtype(tok.vocab_size)
    batches = iter_batches(iter_documents(files, json_key, skip_invalid))
    t0 = last = time.monotonic()
    in_bytes = 0
    last_docs = -1

    def report(w: IndexedDatasetWriter, final: bool = False) -> None:
        nonlocal last, last_docs
        now = time.monotonic()
        if quiet or (not final and now - last < 2.0) or (final and last_docs == w.num_documents):
            return
        last, last_docs = now, w.num_documents
        mb = in_bytes / 2**20
        print(f"[preprocess_data] {w.num_documents} documents, {w.num_tokens} tokens, {mb:.1f} MB read, "
              f"{mb / max(now - t0, 1e-9):.2f} MB/s", file=sys.stderr, flush=True)

    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        if workers <= 1:
            results = map(_Encoder(tokenizer_model, append_eod, dtype), batches)
            pool = None
        else:
            ctx = mp.get_context("spawn")  # no fork: safe with threads (torch, sentencepiece) in the parent
            pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer_model, append_eod, dtype))
            results = pool.imap(_worker_encode, batches)
        try:
            for docs, size in results:
                writer.add_documents(docs)
                in_bytes += size
                report(writer)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        report(writer, final=True)
        stats = dict(documents=writer.num_documents, tokens=writer.num_tokens, bytes=in_bytes,
                     seconds=time.monotonic() - t0, dtype=np.dtype(dtype).name)
    if not quiet:
        print(f"[preprocess_data] wrote {output_prefix}.bin/.idx ({stats['dtype']}) in {stats['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    return stats


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="text files (one document each), .jsonl files (one document per line), directories or globs")
    p.add_argument("--json-key", default="text", help="field holding the text in .jsonl inputs")
    p.add_argument("--tokenizer-model", required=True, help="sentencepiece .model from tools/train_tokenizer.py")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--append-eod", action="store_true", help="append the <eod> id after every document")
    p.add_argument("--skip-invalid", action="store_true", help="skip (with a warning) text files that are not UTF-8")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        files = expand_inputs(args.input)
        preprocess(files, args.tokenizer_model, args.output_prefix, args.workers, args.append_eod,
                   args.json_key, args.quiet, args.skip_invalid)
    except (FileNotFoundError, ValueError) as exc:
        print(f"preprocess_data: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
