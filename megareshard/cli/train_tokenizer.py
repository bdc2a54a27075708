"""Train a lossless sentencepiece tokenizer (BPE or unigram) on text files.

Example:
    python tools/train_tokenizer.py --input 'corpus/*.py' --model-prefix tok/code \
        --vocab-size 32000 --model-type bpe

Writes PREFIX.model and PREFIX.vocab. Settings are lossless (identity normalisation, no
whitespace collapsing, no dummy prefix, byte fallback), so ``decode(encode(t)) == t``.
Special pieces: <pad>=0, <unk>=1, <s>=2, </s>=3, <eod>=4 (control piece: never produced from
text, used as the end-of-document id by tools/preprocess_data.py).

Training text is streamed from the files to sentencepiece through an iterator (no temp
copy). Documents are cut into "sentences" of whole lines up to --max-sentence-length bytes,
keeping their newlines, so pieces can learn newline+indent patterns common in code.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import threading
import time
from typing import Iterator, Sequence

from megareshard.data.input_files import expand_inputs
from megareshard.data.tokenizer import EOD_PIECE, LOSSLESS_TRAINER_KWARGS, SPECIAL_IDS


def read_documents(path: str, json_key: str) -> Iterator[str]:
    """Documents of one input file: the whole file, or one per line of a .jsonl file."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[json_key]
                    except (ValueError, KeyError) as exc:
                        raise ValueError(f"{path}:{lineno}: bad JSON line or no key {json_key!r}: {exc}") from exc
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def chunk_document(text: str, max_bytes: int) -> Iterator[str]:
    """Cut a document into sentences of whole lines (newlines kept) of at most ``max_bytes``.

    sentencepiece silently skips sentences longer than max_sentence_length, so lines that are
    too long on their own are cut by characters.
    """
    buf: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if size + n > max_bytes and buf:
            yield "".join(buf)
            buf, size = [], 0
        if n > max_bytes:
            step = max(1, max_bytes // 4)  # a character is at most 4 UTF-8 bytes
            for i in range(0, len(line), step):
                yield line[i:i + step]
            continue
        buf.append(line)
        size += n
    if buf:
        yield "".join(buf)


class _Progress:
    """Progress on stderr: a rate-limited line while the input is read (bytes read of the input total), then,
    while sentencepiece learns the pieces (silent itself: it releases the GIL, so a thread can speak), what it
    does and for how long, every ``tick`` seconds."""

    def __init__(self, total_bytes: int, enabled: bool, tick: float = 10.0) -> None:
        self.total, self.enabled, self.tick = total_bytes, enabled, tick
        self.start = self.last = time.monotonic()
        self.learning: str | None = None  # what sentencepiece does once every sentence is read
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def reading_done(self, sentences: int, vocab_size: int, model_type: str) -> None:
        self.learning = f"learning {vocab_size} {model_type} pieces from {sentences} sentences"
        self._learn_start = time.monotonic()
        if self.enabled:
            print(f"[train_tokenizer] {self.learning} (sentencepiece; a line every {self.tick:g} s until it is done)",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "_Progress":
        if self.enabled:
            self._thread = threading.Thread(target=self._still_learning, name="train_tokenizer-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _still_learning(self) -> None:
        while not self._done.wait(self.tick):
            if self.learning is not None:
                print(f"[train_tokenizer] still {self.learning}: {time.monotonic() - self._learn_start:.0f} s",
                      file=sys.stderr, flush=True)

    def update(self, done_bytes: int, files: int, sentences: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 2.0):
            return
        self.last = now
        mb = done_bytes / 2**20
        rate = mb / max(now - self.start, 1e-9)
        pct = 100.0 * done_bytes / max(self.total, 1)
        print(f"[train_tokenizer] read {files} files, {mb:.1f} MB ({pct:.0f}%), {sentences} sentences, "
              f"{rate:.1f} MB/s", file=sys.stderr, flush=True)


def sentence_iterator(files: Sequence[str], json_key: str, max_bytes: int, progress: _Progress,
                      learning: tuple[int, str] = (0, "")) -> Iterator[str]:
    """Every sentence of ``files``; at the end, tells ``progress`` that sentencepiece now learns ``learning``
    (vocabulary size, model type)."""
    done = sentences = 0
    for i, path in enumerate(files, 1):
        for doc in read_documents(path, json_key):
            for s in chunk_document(doc, max_bytes):
                sentences += 1
                yield s
        done += os.path.getsize(path)
        progress.update(done, i, sentences)
    progress.update(done, len(files), sentences, final=True)
    progress.reading_done(sentences, *learning)


def train(files: Sequence[str], model_prefix: str, vocab_size: int, model_type: str = "bpe",
          max_sentence_length: int = 8192, json_key: str = "text", input_sentence_size: int = 0,
          num_threads: int | None = None, character_coverage: float = 0.9999, quiet: bool = False) -> str:
    """Train and write ``model_prefix + '.model'`` (atomically); returns that path."""
    import sentencepiece as spm

    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    total = sum(os.path.getsize(f) for f in files)
    progress = _Progress(total, enabled=not quiet)
    model = io.BytesIO()
    t0 = time.monotonic()
    with progress:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentence_iterator(files, json_key, max_sentence_length, progress,
                                                (vocab_size, model_type)),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            max_sentence_length=max_sentence_length,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            character_coverage=character_coverage,
            control_symbols=[EOD_PIECE],
            num_threads=num_threads or max(1, os.cpu_count() or 1),
            minloglevel=2 if quiet else 1,
            **SPECIAL_IDS,
            **LOSSLESS_TRAINER_KWARGS,
        )
    model_path = model_prefix + ".model"
    tmp = f"{model_path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, model_path)

    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab_tmp = f"{model_prefix}.vocab.tmp.{os.getpid()}"
    with open(vocab_tmp, "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n")
    os.replace(vocab_tmp, model_prefix + ".vocab")
    if not quiet:
        print(f"[train_tokenizer] wrote {model_path} (vocab {sp.get_piece_size()}, {model_type}) "
              f"from {len(files)} files, {total / 2**20:.1f} MB in {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return model_path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_tokenizer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="text files, directories or globs (quote them); .jsonl files are read with --json-key")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--max-sentence-length", type=int, default=8192,
                   help="bytes per training sentence (documents are cut into line groups of at most this)")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="sample at most this many sentences for training (0 = all)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress or sentencepiece logs")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        files = expand_inputs(args.input)
    except FileNotFoundError as exc:
        print(f"train_tokenizer: error: {exc}", file=sys.stderr)
        return 2
    train(files, args.model_prefix, args.vocab_size, args.model_type, args.max_sentence_length,
          args.json_key, args.input_sentence_size, args.num_threads, args.character_coverage, args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
