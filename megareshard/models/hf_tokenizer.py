"""A checkpoint's tokenizer as Hugging Face files (``tools/checkpoint_util.py export-hf``).

``write_hf_tokenizer(record, out_dir, vocab_size)`` writes the tokenizer a checkpoint records
(``megareshard.data.tokenizer.tokenizer_record``) into an exported model directory, in the form
``AutoTokenizer.from_pretrained`` loads (``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json``, class ``PreTrainedTokenizerFast``), and returns its special ids for
``config.json`` and ``generation_config.json``. Only the ``tokenizers`` package is needed (and
``protobuf``, which wandb brings, to read a sentencepiece model):

* ``HuggingFaceTokenizer``: its directory's tokenizer files, copied as they are;
* sentencepiece (megareshard's own, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer`` with its bos
  prepended, Megatron-LM's ``SentencePieceTokenizer`` with its ``<CLS> <SEP> <EOD> <MASK>``): converted to
  a ``tokenizers`` BPE or Unigram model following the sentencepiece model's own normalizer settings
  (whitespace escaping, dummy prefix, extra-whitespace removal, byte fallback);
* ``GPT2BPETokenizer``: vocab.json + merges.txt as a byte-level BPE, ``<|endoftext|>`` its bos and eos.

The exported tokenizer is checked against the checkpoint's on a few texts before it is written: both
give the same ids (``HFTokenizerExport.mismatch`` names a text where they do not). One difference is
Hugging Face's convention: a special token written literally in a text (``"<eod>"``) is that token
there, where sentencepiece never produces a control piece from text. eos is the id the run appended
between documents (its eod), so ``generate`` stops where a document ends. A ``NullTokenizer`` (the ids
are the text) has no files, only its eod.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

from ..data.tokenizer import TokenizerError, build_recorded_tokenizer

__all__ = ["HFTokenizerExport", "write_hf_tokenizer", "PROBE_TEXTS"]

#: texts both tokenizers must encode alike: code, runs of spaces and tabs, non-ASCII (byte fallback), digits
PROBE_TEXTS = ("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", "  two  spaces\n\n\ttab  ",
               "naïve café, 漢字 🙂 ∑", "12345 + 67.89e-3 = x", " leading space", "The end.")

# the files of a Hugging Face tokenizer directory (the model's own files are not copied)
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


@dataclass
class HFTokenizerExport:
    """What ``write_hf_tokenizer`` wrote: its files, the special ids, and what it is."""

    description: str
    files: list[str] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mismatch: str | None = None     # a probe text the two tokenizers encode differently, with both id lists
    unreadable: bool = False        # the recorded tokenizer's files cannot be read here: nothing written

    def special_ids(self) -> dict[str, int | None]:
        return {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id}


def write_hf_tokenizer(record: dict | None, out_dir: str, vocab_size: int) -> HFTokenizerExport:
    """Write the tokenizer ``record`` describes into ``out_dir`` (see the module docstring); ``vocab_size``: the
    model's vocabulary. ``TokenizerError`` when its files cannot be read."""
    if not record:
        return HFTokenizerExport("no tokenizer: the checkpoint records none (imported weights, or trained on mock "
                                 "data)")
    kind = record.get("type")
    ours = build_recorded_tokenizer(record, vocab_size)
    if kind == "NullTokenizer":
        return HFTokenizerExport("NullTokenizer (its ids are the text): no tokenizer files", eos_token_id=ours.eod)
    if kind == "HuggingFaceTokenizer":
        return _copy_hf(ours, record["model"], out_dir)
    tok, specials = _convert(kind, ours)
    files = _save(tok, specials, out_dir)
    ids = {k: (tok.token_to_id(v) if v is not None else None) for k, v in specials.items()}
    source = record.get("model") or record.get("vocab_file")
    return HFTokenizerExport(f"{kind} {source}", files, ids["bos_token"], ids["eos_token"], ids["pad_token"],
                             _mismatch(ours.encode, lambda t: tok.encode(t).ids))


def _copy_hf(ours, src: str, out_dir: str) -> HFTokenizerExport:
    files = []
    for name in _HF_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out_dir, name))   # a hub cache's symlink: its content
            files.append(name)
    names = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            for key in ("bos_token", "eos_token", "pad_token"):
                value = saved.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    names.setdefault(key, value)
    ids = {k: ours._tok.token_to_id(v) for k, v in names.items()}
    from tokenizers import Tokenizer

    exported = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    return HFTokenizerExport(f"HuggingFaceTokenizer {src}", files, ids.get("bos_token"), ids.get("eos_token"),
                             ids.get("pad_token"), _mismatch(ours.encode, lambda t: exported.encode(t).ids))


def _mismatch(ours, theirs) -> str | None:
    for text in PROBE_TEXTS:
        a, b = list(ours(text)), list(theirs(text))
        if a != b:
            return f"{text!r}: {a[:12]} here, {b[:12]} exported"
    return None


# ---- sentencepiece and GPT-2 BPE -> tokenizers ---------------------------------------------------------
def _piece(sp, i: int) -> str | None:
    return sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else None


def _convert(kind: str, ours):
    """(a ``tokenizers.Tokenizer`` encoding as ``ours`` does, {bos_token, eos_token, pad_token, unk_token: piece})."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.processors import TemplateProcessing

    if kind == "GPT2BPETokenizer":
        tok = Tokenizer.from_str(ours._tok.to_str())     # a copy: the check below compares the two
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        return tok, {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": None,
                     "unk_token": None}
    sp = ours._sp
    tok = sentencepiece_to_tokenizers(ours.model_path)
    specials = {"bos_token": _piece(sp, sp.bos_id()), "eos_token": _piece(sp, ours.eod),
                "pad_token": _piece(sp, sp.pad_id()), "unk_token": _piece(sp, sp.unk_id())}
    if kind == "SentencePieceTokenizer":     # Megatron-LM's: its special pieces, those past the model's added
        order = sorted(ours.special.items(), key=lambda kv: kv[1])
        tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, _ in order])
        wrong = [(p, i, tok.token_to_id(p)) for p, i in order if tok.token_to_id(p) != i]
        if wrong:
            raise TokenizerError(f"special piece {wrong[0][0]} gets id {wrong[0][2]} in the export, {wrong[0][1]} here")
        specials["eos_token"] = "<EOD>"
    if kind == "Llama2Tokenizer" and specials["bos_token"] is not None:
        bos = specials["bos_token"]
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, int(sp.bos_id()))])
    return tok, specials


def sentencepiece_to_tokenizers(model_path: str):
    """A ``tokenizers.Tokenizer`` that encodes as ``SentencePieceProcessor.encode`` does with the model at
    ``model_path`` (BPE: merges ranked by the merged piece's score; Unigram: the pieces' scores, control and
    byte pieces unreachable from text), its normalizer, dummy prefix and byte fallback as the model sets them."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:   # protobuf (wandb installs it)
        raise TokenizerError(f"reading a sentencepiece model's settings needs protobuf: pip install protobuf ({e})") \
            from None
    m = pb.ModelProto()
    with open(model_path, "rb") as f:
        m.ParseFromString(f.read())
    ts, ns = m.trainer_spec, m.normalizer_spec
    pieces = list(m.pieces)
    normal_type, user_type = 1, 4
    if ts.model_type == 2:       # BPE
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == normal_type}
        ranked = []
        for piece, (score, i) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, i, left, right))
        merges = [(left, right) for _, _, left, right in sorted(ranked)]
        user = any(p.type == user_type for p in pieces)
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=ts.unk_piece, fuse_unk=True,
                            byte_fallback=ts.byte_fallback, ignore_merges=user))
    elif ts.model_type == 1:     # Unigram: pieces text cannot produce (control, unused, bytes) get no chance
        floor = min((p.score for p in pieces), default=0.0) - 1e6
        tok = Tokenizer(Unigram([(p.piece, p.score if p.type in (normal_type, user_type) else floor) for p in pieces],
                                unk_id=ts.unk_id, byte_fallback=ts.byte_fallback))
    else:
        raise TokenizerError(f"{model_path}: sentencepiece model type {ts.model_type} (only BPE and Unigram models are "
                             "converted)")
    steps = []
    if ns.precompiled_charsmap:
        steps.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if ns.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if ns.add_dummy_prefix:      # sentencepiece prefixes a text already starting with ▁ too
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    tok.normalizer = normalizers.Sequence(steps)
    if ns.add_dummy_prefix:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    parts = [decoders.Replace("▁", " ")] + ([decoders.ByteFallback()] if ts.byte_fallback else []) + [decoders.Fuse()]
    if ns.add_dummy_prefix:
        parts.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(parts)
    return tok


def _save(tok, specials: dict, out_dir: str) -> list[str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of ``tok`` (class PreTrainedTokenizerFast:
    the tokenizer.json is used as it is)."""
    from tokenizers import AddedToken

    named = {k: v for k, v in specials.items() if v is not None}
    tok.add_special_tokens([AddedToken(v, special=True, normalized=False) for v in dict.fromkeys(named.values())])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False, **named}
    for name, body in (("tokenizer_config.json", config), ("special_tokens_map.json", named)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2, ensure_ascii=False)
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
