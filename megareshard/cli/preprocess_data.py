"""Tokenize text into memory-mapped indexed datasets (Megatron-LM's .bin/.idx format), with Megatron-LM's command line.

Example (as with Megatron-LM):
    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 4
writes data/my_text_document.bin and data/my_text_document.idx (one dataset per --json-keys key:
PREFIX_KEY_document). Other tokenizers: --tokenizer-type SentencePieceTokenizer / GPTSentencePieceTokenizer /
Llama2Tokenizer --tokenizer-model M.model, HuggingFaceTokenizer --tokenizer-model DIR, NullTokenizer
--vocab-size N; without --tokenizer-type, --tokenizer-model is a model made by tools/train_tokenizer.py.

Inputs: .jsonl/.json files (one document per line, its --json-keys fields), and, beyond Megatron-LM,
plain text files, directories and globs (each file one document). Document order in the dataset is
input order. Tokens are uint16 below 65500 ids, else int32 (Megatron's choice). The outputs appear
atomically: temp files are renamed into place only after everything was written, so an interrupted
run leaves nothing that looks valid. Progress (documents, tokens, share of the input read, MB/s, ETA) goes
to stderr.
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

from megareshard.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from megareshard.data.input_files import expand_inputs
from megareshard.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megareshard.tracking import format_duration

_BATCH_BYTES = 1 << 20  # documents are sent to workers in batches of about this much text


def iter_documents(files: Sequence[str], json_keys: Sequence[str],
                   skip_invalid: bool = False) -> Iterator[tuple[list[str], int]]:
    """(one text per key, size in bytes) of every document, in input order.

    A text file is one document (only with a single key). A text file that is not UTF-8 is an
    error naming the file, or, with ``skip_invalid``, a warning on stderr and the file is left out.
    """
    for path in files:
        if path.endswith(".jsonl") or path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                        texts = [obj[k] for k in json_keys]
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ValueError(f"{path}:{lineno}: bad JSON line or no key among {list(json_keys)}: "
                                         f"{exc}") from exc
                    for k, text in zip(json_keys, texts):
                        if not isinstance(text, str):
                            raise ValueError(f"{path}:{lineno}: field {k!r} is {type(text).__name__}, not a string")
                    yield texts, len(line.encode("utf-8"))
        else:
            if len(json_keys) != 1:
                raise ValueError(f"{path}: a plain text file is one document; --json-keys {' '.join(json_keys)} "
                                 "only applies to .jsonl inputs")
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if skip_invalid:
                    print(f"[preprocess_data] warning: skipping {path}: not UTF-8 text: {exc}", file=sys.stderr)
                    continue
                raise ValueError(f"{path}: not UTF-8 text: {exc} (use --skip-invalid to leave such files out)") from exc
            yield [text], len(raw)


def iter_batches(docs: Iterator[tuple[list[str], int]]) -> Iterator[tuple[list[list[str]], int]]:
    batch: list[list[str]] = []
    size = 0
    for texts, n in docs:
        batch.append(texts)
        size += n
        if size >= _BATCH_BYTES or len(batch) >= 1024:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


class _Encoder:
    """Per-process tokenizer state (each pool worker builds the tokenizer once)."""

    def __init__(self, tokenizer_args: dict, append_eod: bool, dtype: type) -> None:
        self.tok = build_tokenizer(**tokenizer_args)
        self.append_eod, self.dtype = append_eod, dtype

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        if hasattr(self.tok, "encode_batch"):
            return [list(x) for x in self.tok.encode_batch(texts)]
        return [list(self.tok.encode(t)) for t in texts]

    def __call__(self, batch_and_size: tuple[list[list[str]], int]) -> tuple[list[list[np.ndarray]], int]:
        batch, size = batch_and_size
        n_keys = len(batch[0]) if batch else 0
        per_key = []
        for k in range(n_keys):
            docs = []
            for ids in self._encode_all([texts[k] for texts in batch]):
                if self.append_eod:
                    ids.append(self.tok.eod)
                docs.append(np.asarray(ids, dtype=self.dtype))
            per_key.append(docs)
        return per_key, size


def _worker_init(tokenizer_args: dict, append_eod: bool, dtype: type) -> None:
    global _ENCODER  # per-worker-process state, set once by the pool initializer
    _ENCODER = _Encoder(tokenizer_args, append_eod, dtype)


def _worker_encode(batch_and_size):
    return _ENCODER(batch_and_size)


def progress_line(documents: int, tokens: int, done_bytes: int, total_bytes: int, seconds: float) -> str:
    """``[preprocess_data] 1200 documents, 3400000 tokens, 12.0 of 30.0 MB (40%), 2.00 MB/s, ETA 0:09``: the ETA
    assumes the rest of the input tokenizes at the rate so far."""
    mb, total = done_bytes / 2**20, total_bytes / 2**20
    rate = mb / max(seconds, 1e-9)
    share = min(done_bytes / total_bytes, 1.0) if total_bytes else 1.0
    eta = (total - mb) / rate if rate > 0 and total > mb else 0.0
    return (f"[preprocess_data] {documents} documents, {tokens} tokens, {mb:.1f} of {total:.1f} MB ({share:.0%}), "
            f"{rate:.2f} MB/s, ETA {format_duration(eta)}")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's output name: ``PREFIX_KEY_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess(files: Sequence[str], tokenizer_args: dict, output_prefix: str, workers: int = 1,
               append_eod: bool = False, json_keys: Sequence[str] = ("text",), quiet: bool = False,
               skip_invalid: bool = False, log_interval: int | None = None) -> dict:
    """Tokenize ``files`` into ``PREFIX_KEY_document.bin/.idx`` per key; returns counts (documents, tokens, ...)."""
    tok = build_tokenizer(**tokenizer_args)
    if append_eod:
        tok.eod  # noqa: B018 -- fail before reading anything when the tokenizer has no eod
    dtype = best_dtype(tok.vocab_size)
    batches = iter_batches(iter_documents(files, json_keys, skip_invalid))
    total_bytes = sum(os.path.getsize(f) for f in files)  # the input's size: the share read gives % and ETA
    t0 = last = time.monotonic()
    in_bytes = 0
    last_docs = -1

    def report(w: IndexedDatasetWriter, final: bool = False) -> None:
        nonlocal last, last_docs
        now = time.monotonic()
        due = (w.num_documents // log_interval != last_docs // log_interval if log_interval and last_docs >= 0
               else now - last >= 2.0)
        if quiet or (not final and not due) or (final and last_docs == w.num_documents):
            return
        last, last_docs = now, w.num_documents
        print(progress_line(w.num_documents, w.num_tokens, in_bytes, total_bytes, now - t0), file=sys.stderr,
              flush=True)

    prefixes = [output_prefix_for(output_prefix, k) for k in json_keys]
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    pool = None
    try:
        if workers <= 1:
            results = map(_Encoder(tokenizer_args, append_eod, dtype), batches)
        else:
            ctx = mp.get_context("spawn")  # no fork: safe with threads (torch, tokenizers) in the parent
            pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer_args, append_eod, dtype))
            results = pool.imap(_worker_encode, batches)
        for per_key, size in results:
            for w, docs in zip(writers, per_key):
                w.add_documents(docs)
            in_bytes += size
            report(writers[0])
        report(writers[0], final=True)
        for w in writers:
            w.finalize()
    except BaseException:
        for w in writers:
            w.discard()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    stats = dict(documents=writers[0].num_documents, tokens=sum(w.num_tokens for w in writers), bytes=in_bytes,
                 seconds=time.monotonic() - t0, dtype=np.dtype(dtype).name, prefixes=prefixes)
    if not quiet:
        print(f"[preprocess_data] wrote {', '.join(p + '.bin/.idx' for p in prefixes)} ({stats['dtype']}) in "
              f"{stats['seconds']:.1f} s", file=sys.stderr, flush=True)
    return stats


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help=".jsonl files (one document per line), text files (one document each), directories or globs")
    g.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=["text"],
                   help="fields of each JSON line to tokenize, one output dataset per key")
    g.add_argument("--split-sentences", action="store_true", help="not supported: documents are not split")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences only")
    g.add_argument("--lang", default="english", help="with --split-sentences only")
    g.add_argument("--skip-invalid", action="store_true", help="skip (with a warning) text files that are not UTF-8")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="Megatron-LM tokenizer (default: GPT2BPETokenizer with --vocab-file, megareshard's "
                        "sentencepiece with only --tokenizer-model)")
    g.add_argument("--tokenizer-model", help="sentencepiece .model, or a local Hugging Face tokenizer directory")
    g.add_argument("--vocab-file", help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="append the tokenizer's end-of-document id to every "
                                                            "document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx for each key")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--partitions", type=int, default=1, help="accepted for Megatron-LM's command line; the input "
                                                             "is streamed to the workers whatever its size")
    g.add_argument("--keep-sequential-samples", action="store_true", help="with --partitions only (order is kept)")
    g.add_argument("--log-interval", type=int, default=None,
                   help="documents between progress lines (default: one line every 2 seconds)")
    g.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.split_sentences:
            raise ValueError("--split-sentences is not supported: every document is one sequence "
                             "(sentence splitting needs NLTK's punkt models, which are not bundled)")
        if args.workers < 1 or args.partitions < 1:
            raise ValueError(f"--workers {args.workers} and --partitions {args.partitions} must be at least 1")
        if args.log_interval is not None and args.log_interval < 1:
            raise ValueError(f"--log-interval must be at least 1, got {args.log_interval}")
        files = expand_inputs(args.input)
        tokenizer_args = dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
        preprocess(files, tokenizer_args, args.output_prefix, args.workers, args.append_eod, args.json_keys,
                   args.quiet, args.skip_invalid, args.log_interval)
    except (FileNotFoundError, ValueError) as exc:  # TokenizerError is a ValueError
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
