"""Tokenizers: Megatron-LM's ``--tokenizer-type`` names, and megareshard's lossless SentencePiece.

``build_tokenizer(type, ...)`` builds one of Megatron-LM's tokenizers with its meaning:

* ``GPT2BPETokenizer``: byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt), through the ``tokenizers`` library; eod is ``<|endoftext|>``.
* ``SentencePieceTokenizer``: a sentencepiece model plus the special pieces ``<CLS> <SEP> <EOD>
  <MASK>`` (added after the model's pieces when it lacks them); eod is ``<EOD>``.
* ``GPTSentencePieceTokenizer``: a sentencepiece model as it is; eod is its eos.
* ``Llama2Tokenizer``: a sentencepiece model, bos prepended to every text; eod is its eos.
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local directory holding a ``tokenizer.json``
  (a Hugging Face fast tokenizer; never downloaded); special tokens as its post-processor adds
  them; eod is the ``eos_token`` of its ``tokenizer_config.json``.
* ``NullTokenizer``: ids are the text (``"5 17 3"``); ``--vocab-size`` ids plus eod = vocab-size.

Without ``--tokenizer-type``, ``--vocab-file``/``--merge-file`` mean GPT2BPETokenizer and a
``--tokenizer-model`` file means megareshard's own ``SentencePieceTokenizer`` below (models made
by ``tools/train_tokenizer.py``: identity normalisation, no whitespace collapsing, no dummy prefix
and byte fallback, so ``decode(encode(text)) == text`` for any string; eod is its ``<eod>`` piece).

Every tokenizer has ``vocab_size``, ``eod``, ``encode(text)`` / ``decode(ids)`` (and Megatron's
spellings ``tokenize`` / ``detokenize``). A missing file raises ``TokenizerError`` naming it.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import sentencepiece as spm


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the arguments given (missing file, wrong kind of file, ...)."""

#: Name of the end-of-document control piece added by ``tools/train_tokenizer.py``.
EOD_PIECE = "<eod>"

#: Settings that make sentencepiece lossless; shared with the training tool so they cannot drift.
LOSSLESS_TRAINER_KWARGS = dict(
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    add_dummy_prefix=False,
    byte_fallback=True,
    split_digits=True,
)

#: Special ids: pad 0, unk 1, bos 2, eos 3, then the <eod> control piece at 4.
SPECIAL_IDS = dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3)


class SentencePieceTokenizer:
    """Encode/decode text with a sentencepiece model.

    ``eod`` is the id appended between documents when building datasets: the ``<eod>`` control
    piece if the model has one (ours do), else the model's ``</s>`` id. Control pieces are never
    produced by ``encode`` from text, so a literal "<eod>" in a document cannot fake a boundary.
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise TokenizerError(
                f"--tokenizer-model {self.model_path}: sentencepiece model file not found "
                f"(train one with tools/train_tokenizer.py --model-prefix PREFIX, which writes PREFIX.model)")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"cannot load sentencepiece model {self.model_path!r}: {exc}") from exc
        eod = self._sp.piece_to_id(EOD_PIECE)
        if eod == self._sp.unk_id() or eod < 0:
            eod = self._sp.eos_id()
        if eod < 0:
            raise TokenizerError(f"sentencepiece model {self.model_path!r} has neither an {EOD_PIECE} piece nor an eos id")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        """Number of pieces (ids are in ``[0, vocab_size)``)."""
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._eod

    @property
    def pad(self) -> int:
        return int(self._sp.pad_id())

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def eos(self) -> int:
        return int(self._sp.eos_id())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos/eod added)."""
        return list(self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (sentencepiece's batched C++ path)."""
        return [list(x) for x in self._sp.encode(list(texts), out_type=int)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; control pieces (``<eod>``, bos, eos, pad) decode to ''."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size}, eod={self.eod})"

    tokenize = encode
    detokenize = decode


def _require_file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerError(f"{kind} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path}: file not found ({kind})")
    return os.fspath(path)


class _SentencePieceModel:
    """Shared loading of a sentencepiece model for Megatron's sentencepiece tokenizer types."""

    kind = "SentencePieceTokenizer"

    def __init__(self, model_path: str) -> None:
        self.model_path = _require_file(model_path, "--tokenizer-model", self.kind)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"--tokenizer-model {self.model_path}: not a sentencepiece model ({exc})") from None

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def __repr__(self) -> str:
        return f"{self.kind}({self.model_path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """Megatron's GPTSentencePieceTokenizer: the model as it is; eod = eos."""

    kind = "GPTSentencePieceTokenizer"

    @property
    def eod(self) -> int:
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise TokenizerError(f"--tokenizer-model {self.model_path} has no eos piece, which {self.kind} uses as eod")
        return eos


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: bos prepended to every text; eod = eos."""

    kind = "Llama2Tokenizer"

    def encode(self, text: str) -> list[int]:
        bos = int(self._sp.bos_id())
        return ([bos] if bos >= 0 else []) + super().encode(text)


class MegatronSentencePieceTokenizer(_SentencePieceModel):
    """Megatron's SentencePieceTokenizer: special pieces <CLS> <SEP> <EOD> <MASK> (+ pad, bos, eos) are
    found in the text as written and map to their ids; ones the model lacks get ids after its pieces."""

    kind = "SentencePieceTokenizer"

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        sp = self._sp
        self._vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self.special: dict[str, int] = {}

        def add(piece: str) -> int:
            if piece not in self._vocab:
                self._vocab[piece] = len(self._vocab)
            self.special[piece] = self._vocab[piece]
            return self._vocab[piece]

        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(piece)
        for get, fallback in ((sp.pad_id, "<PAD>"), (sp.bos_id, "<BOS>"), (sp.eos_id, "<EOS>")):
            i = int(get())
            add(sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else fallback)
        self._inv_special = {i: p for p, i in self.special.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self.special["<EOD>"]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while True:
            hits = [(text.find(p, pos), p) for p in self.special]
            hits = [(i, p) for i, p in hits if i >= 0]
            if not hits:
                break
            i, piece = min(hits)
            ids += list(self._sp.encode(text[pos:i], out_type=int)) + [self.special[piece]]
            pos = i + len(piece)
        return ids + list(self._sp.encode(text[pos:], out_type=int))

    def decode(self, ids: Iterable[int]) -> str:
        """Megatron's detokenize: special pieces are written out, each followed by a space."""
        out, run = [], []
        for i in (int(x) for x in ids):
            if i in self._inv_special:
                out.append(self._sp.decode(run) + " " if run else "")
                out.append(self._inv_special[i] + " ")
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer: byte-level BPE (GPT-2's pre-tokenisation) from vocab.json + merges.txt."""

    kind = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.vocab_file = _require_file(vocab_file, "--vocab-file", self.kind)
        self.merge_file = _require_file(merge_file, "--merge-file", self.kind)
        try:
            bpe = models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as exc:  # the Rust library raises its own exception types
            raise TokenizerError(f"--vocab-file {self.vocab_file} / --merge-file {self.merge_file}: cannot build "
                                 f"a byte-level BPE from them ({exc})") from None
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise TokenizerError(f"--vocab-file {self.vocab_file} has no <|endoftext|> entry, which "
                                 f"{self.kind} uses as eod")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return f"GPT2BPETokenizer({self.vocab_file!r}, {self.merge_file!r}, vocab_size={self.vocab_size})"


class HuggingFaceTokenizer:
    """Megatron's HuggingFaceTokenizer for a local directory with a ``tokenizer.json`` (never downloaded)."""

    kind = "HuggingFaceTokenizer"

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        if not path:
            raise TokenizerError(f"{self.kind} needs --tokenizer-model DIR (a local directory with tokenizer.json)")
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise TokenizerError(f"--tokenizer-model {self.path}: directory not found ({self.kind} reads a local "
                                 "directory holding tokenizer.json; nothing is downloaded)")
        tj = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"--tokenizer-model {self.path}: no tokenizer.json in it ({self.kind} reads "
                                 "Hugging Face fast tokenizers)")
        try:
            self._tok = Tokenizer.from_file(tj)
        except Exception as exc:
            raise TokenizerError(f"{tj}: cannot load ({exc})") from None
        self._eod = None
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            cfg_path = os.path.join(self.path, name)
            if self._eod is None and os.path.isfile(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if eos is not None:
                    self._eod = self._tok.token_to_id(eos)
                    if self._eod is None:
                        raise TokenizerError(f"{cfg_path}: eos_token {eos!r} is not in {tj}")

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise TokenizerError(f"--tokenizer-model {self.path}: no eos_token in tokenizer_config.json or "
                                 "special_tokens_map.json, so there is no eod id to append")
        return int(self._eod)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class NullTokenizer:
    """Megatron's NullTokenizer: the text is the ids, space-separated; eod = ``vocab_size`` argument."""

    kind = "NullTokenizer"

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(f"NullTokenizer needs --vocab-size (a positive number), got {vocab_size}")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def encode(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(" ")] if text else []
        except ValueError:
            raise TokenizerError(f"NullTokenizer reads space-separated integer ids, got {text[:40]!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size})"


#: Megatron-LM's --tokenizer-type names built here.
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "NullTokenizer")


def resolve_tokenizer_type(tokenizer_type: str | None, tokenizer_model: str | None = None,
                           vocab_file: str | None = None, merge_file: str | None = None) -> str | None:
    """The type a run uses: the one given, else GPT2BPETokenizer for vocab/merge files, else megareshard's
    own sentencepiece ("megareshard") for a bare --tokenizer-model, else None (no tokenizer)."""
    if tokenizer_type is not None:
        return tokenizer_type
    if vocab_file or merge_file:
        return "GPT2BPETokenizer"
    if tokenizer_model:
        return "megareshard"
    return None


def build_tokenizer(tokenizer_type: str | None, *, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, vocab_size: int | None = None):
    """Build the tokenizer Megatron-LM's flags name (``TokenizerError`` with the reason when it cannot)."""
    kind = resolve_tokenizer_type(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "SentencePieceTokenizer":
        return MegatronSentencePieceTokenizer(tokenizer_model)
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if kind == "megareshard":
        return SentencePieceTokenizer(tokenizer_model)
    if kind is None:
        raise TokenizerError("no tokenizer: give --tokenizer-type with its files (--tokenizer-model, or "
                             "--vocab-file and --merge-file, or --vocab-size for NullTokenizer)")
    raise TokenizerError(f"--tokenizer-type {kind} is not supported here (supported: {', '.join(TOKENIZER_TYPES)})")


def tokenizer_record(d) -> dict | None:
    """What a checkpoint records of the tokenizer of a run whose data flags are ``d`` (a DataConfig; None: none):
    its type as ``build_tokenizer`` resolves it and its files as absolute paths, so that ``tools/generate.py
    --load CKPT`` builds the same tokenizer with no other flag. None when the run had no tokenizer."""
    if d is None:
        return None
    kind = resolve_tokenizer_type(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
    if kind is None:
        return None

    def absolute(path: str | None) -> str | None:
        return os.path.abspath(path) if path else None

    return {"type": kind, "model": absolute(d.tokenizer_model), "vocab_file": absolute(d.vocab_file),
            "merge_file": absolute(d.merge_file)}


def build_recorded_tokenizer(record: dict, model_vocab_size: int):
    """The tokenizer ``tokenizer_record`` described, for a model of ``model_vocab_size`` ids (a NullTokenizer's
    --vocab-size is that less its eod)."""
    return build_tokenizer(record["type"], tokenizer_model=record.get("model"), vocab_file=record.get("vocab_file"),
                           merge_file=record.get("merge_file"), vocab_size=model_vocab_size - 1)
