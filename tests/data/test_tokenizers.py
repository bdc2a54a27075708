"""Megatron-LM's --tokenizer-type tokenizers: round trips on a mixed-script corpus, eod ids, clear errors.

Every vocabulary, merge list and model is made here, locally, from the corpus below (nothing is downloaded).
"""

from __future__ import annotations

import json
import os

import pytest
import sentencepiece as spm

from megareshard.data.tokenizer import (GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, TokenizerError,
                                        build_tokenizer)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "日本語の文章と漢字、カタカナ、ひらがな。",
    "中文句子：我们一起学习机器学习。",
    "العربية تكتب من اليمين إلى اليسار.",
    "हिन्दी देवनागरी लिपि में लिखी जाती है।",
    "Ελληνικά: Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιά.",
    "def f(x):\n\treturn x ** 2  # 😀 emoji 👩‍💻\n",
    "한국어 문장도 있습니다. 12345 67890",
]
# strings the tokenizers were not trained on: unseen characters must survive through bytes
PROBES = CORPUS + ["  two leading spaces, trailing\n\n", "mixed: naïve 日本 Ωmega 🚀 עברית", "", "x"]


def train_bpe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    tok = train_bpe(d)
    tok.model.save(str(d))  # vocab.json + merges.txt, the files Megatron's --vocab-file/--merge-file name
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("sp") / "m")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 5), model_prefix=prefix, vocab_size=700,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", add_dummy_prefix=False,
                                   remove_extra_whitespaces=False, minloglevel=2)
    return prefix + ".model"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import processors

    d = tmp_path_factory.mktemp("hf")
    tok = train_bpe(d)
    tok.add_special_tokens(["<|begin|>", "<|end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[
        ("<|begin|>", tok.token_to_id("<|begin|>"))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "bos_token": "<|begin|>"}))
    return str(d)


def test_gpt2_bpe_round_trip_and_eod(gpt2_files):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.vocab_size == len(json.load(open(vocab)))
    assert tok.eod == json.load(open(vocab))["<|endoftext|>"]
    for text in PROBES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0].encode())  # merges apply
    # literal "<|endoftext|>" in a document is text, not a boundary (as in Megatron's GPT-2 tokenizer)
    assert tok.eod not in tok.encode("a <|endoftext|> b")
    # the default type for --vocab-file/--merge-file is GPT2BPETokenizer
    assert isinstance(build_tokenizer(None, vocab_file=vocab, merge_file=merges), GPT2BPETokenizer)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_types_round_trip(sp_model, kind):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(kind, tokenizer_model=sp_model)
    for text in PROBES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    if kind == "SentencePieceTokenizer":
        # Megatron adds <CLS> <SEP> <EOD> <MASK> after the model's pieces when it lacks them, and <PAD>
        # for a model without a pad piece (this one: pad_id -1)
        assert sp.pad_id() == -1 and tok.vocab_size == sp.get_piece_size() + 5
        assert tok.eod == sp.get_piece_size() + 2
        ids = tok.encode("a<EOD>b")
        assert tok.eod in ids and tok.decode(ids) == "a <EOD> b"
    else:
        assert tok.vocab_size == sp.get_piece_size() and tok.eod == sp.eos_id()
        first = tok.encode("hello")[0]
        assert (first == sp.bos_id()) == (kind == "Llama2Tokenizer")


def test_huggingface_directory(hf_dir):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert isinstance(tok, HuggingFaceTokenizer)
    begin = tok._tok.token_to_id("<|begin|>")
    assert tok.eod == tok._tok.token_to_id("<|end|>")
    for text in PROBES:
        ids = tok.encode(text)
        assert ids[0] == begin  # the post-processor's special tokens, as AutoTokenizer(text).input_ids has them
        assert tok.decode(ids) == text
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer) and tok.vocab_size == 101 and tok.eod == 100
    assert tok.encode("5 17 3") == [5, 17, 3] and tok.decode([5, 17, 3]) == "5 17 3"
    with pytest.raises(TokenizerError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")


@pytest.mark.parametrize("kind, kwargs, message", [
    ("GPT2BPETokenizer", dict(vocab_file="/nonexistent/vocab.json", merge_file="/nonexistent/merges.txt"),
     r"--vocab-file /nonexistent/vocab.json: file not found"),
    ("GPT2BPETokenizer", dict(), r"GPT2BPETokenizer needs --vocab-file"),
    ("SentencePieceTokenizer", dict(tokenizer_model="/nonexistent/t.model"), r"--tokenizer-model /nonexistent"),
    ("Llama2Tokenizer", dict(tokenizer_model="/nonexistent/t.model"), r"file not found"),
    ("HuggingFaceTokenizer", dict(tokenizer_model="meta-llama/Llama-3-8B"), r"directory not found.*nothing is "
                                                                            r"downloaded"),
    ("BertWordPieceCase", dict(), r"not supported here"),
])
def test_errors_name_the_flag_and_file(kind, kwargs, message):
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer(kind, **kwargs)


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert os.listdir(tmp_path) == []
