"""SentencePiece tokenizer wrapper with an exact text <-> ids round trip.

The model must have been trained with lossless settings (see ``tools/train_tokenizer.py``):
identity normalisation, no whitespace collapsing, no dummy prefix and byte fallback. With
those, ``decode(encode(text)) == text`` for any string, which matters for code corpora where
indentation, tabs and newlines carry meaning.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import sentencepiece as spm

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
            raise FileNotFoundError(
                f"sentencepiece model file not found: {self.model_path!r} "
                f"(train one with tools/train_tokenizer.py --model-prefix PREFIX, which writes PREFIX.model)")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"cannot load sentencepiece model {self.model_path!r}: {exc}") from exc
        eod = self._sp.piece_to_id(EOD_PIECE)
        if eod == self._sp.unk_id() or eod < 0:
            eod = self._sp.eos_id()
        if eod < 0:
            raise ValueError(f"sentencepiece model {self.model_path!r} has neither an {EOD_PIECE} piece nor an eos id")
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
