"""Exports and generation (issue #51, "Exports and generation"), each path run in this process on tiny models:

* ``export-hf`` writes the tokenizer the checkpoint records (megareshard's sentencepiece, Megatron-LM's
  sentencepiece types, a Hugging Face tokenizer, GPT-2's BPE files) in a form ``AutoTokenizer`` loads, which
  encodes as the checkpoint's tokenizer does, and its bos/eos/pad ids into config.json and
  generation_config.json: transformers warns of no special id, and ``generate`` runs on the export as it is;
  a checkpoint with no tokenizer gets null ids (no GPT-2 default 50256 outside a 100-id vocabulary);
* ``import-hf org/model`` reads the local Hugging Face cache (laid out as the hub lays it, HF_HUB_OFFLINE=1) and
  says so; a name not cached is one line saying so;
* ``tools/generate.py --load`` reads a Megatron-LM checkpoint directory (the same continuation as from the
  checkpoint it was exported from), and ``import-megatron --tokenizer-model`` records the tokenizer, so generate
  needs no tokenizer flag afterwards; ``import-megatron`` of a directory naming no tokenizer prints no note;
* ``examples/finetune_hf.sh``: fine-tuning with its ``--seq-length`` from the tiny Llama it makes warns nothing,
  and its compare_generation.py runs without a transformers warning.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

from megareshard.arguments import parse_args  # noqa: E402
from megareshard.checkpoint import (FORMAT_VERSION, Piece, read_full_model, read_info,  # noqa: E402
                                    resolve_checkpoint_dir, write_checkpoint)
from megareshard.checkpoint.megatron import our_shape, sources  # noqa: E402
from megareshard.data.tokenizer import (EOD_PIECE, LOSSLESS_TRAINER_KWARGS, SPECIAL_IDS,  # noqa: E402
                                        build_recorded_tokenizer)
from megareshard.models.config import ModelConfig  # noqa: E402

from ._helpers import load_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", "  two  spaces\n\n\ttab  ",
         "naïve café, 漢字 🙂 ∑", "12345 + 67.89e-3 = x", " leading space", "class A:\n    pass\n"]
CORPUS = "".join((ROOT / "megareshard" / name).read_text() for name in ("generation.py", "data/tokenizer.py"))


# ---- fixtures: tokenizers and checkpoints ---------------------------------------------------------------------
def _sentencepiece(path: Path, model_type: str = "bpe") -> str:
    """A 400-piece sentencepiece model trained as tools/train_tokenizer.py trains (lossless, <eod>), in ~0.05 s."""
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines()), model_writer=buf, vocab_size=400,
                                   model_type=model_type, control_symbols=[EOD_PIECE], minloglevel=2, num_threads=1,
                                   **SPECIAL_IDS, **LOSSLESS_TRAINER_KWARGS)
    path.write_bytes(buf.getvalue())
    return str(path)


def _hf_tokenizer_dir(d: Path) -> str:
    """A Hugging Face fast tokenizer directory (byte-level BPE, <|endoftext|> its eos) saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                         bos_token="<|endoftext|>").save_pretrained(str(d))
    return str(d)


def _gpt2_files(d: Path) -> tuple[str, str]:
    """vocab.json + merges.txt of a byte-level BPE with <|endoftext|> (Megatron-LM's GPT2BPETokenizer files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    d.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def _config(vocab: int, llama: bool = True) -> ModelConfig:
    argv = ["--mock-data", "--vocab-size", str(vocab), "--num-layers", "1", "--hidden-size", "16",
            "--num-attention-heads", "2", "--ffn-hidden-size", "32", "--seq-length", "32",
            "--max-position-embeddings", "32", "--hidden-dropout", "0", "--attention-dropout", "0"]
    if llama:
        argv += ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    return parse_args(argv, world_size=1).model


def _checkpoint(tool, out: Path, cfg: ModelConfig, tokenizer: dict | None) -> str:
    """A megareshard checkpoint of random weights of ``cfg`` recording ``tokenizer`` as a training run does."""
    del tool
    g = torch.Generator().manual_seed(0)
    pieces = {}
    for n in sources(cfg):
        t = torch.randn(our_shape(n, cfg), generator=g) * 0.3
        pieces["model." + n] = Piece(t, tuple(t.shape), (0,) * t.dim())
    mc = dataclasses.asdict(cfg)
    common = {"iteration": 0, "format_version": FORMAT_VERSION, "model_config": mc, "loss_scaler": None,
              "layout": {"imported_from": str(out)}}
    info = {"layout": {"imported_from": str(out), "rank_coords": []}, "model_config": mc, "args": None,
            "has_optimizer": False, "has_rng": False, "consumed_samples": None, "wandb_run_id": None,
            "tokenizer": tokenizer}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return write_checkpoint(str(out), 0, pieces, {"common": common}, info)


class _Warnings(logging.Handler):
    """Every warning transformers logs while installed (its loggers propagate to 'transformers')."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def _record(kind: str, model=None, vocab_file=None, merge_file=None) -> dict:
    return {"type": kind, "model": model, "vocab_file": vocab_file, "merge_file": merge_file}


# ---- 1. export-hf writes the tokenizer and its special ids ------------------------------------------------------
KINDS = ["megareshard-bpe", "Llama2Tokenizer-unigram", "SentencePieceTokenizer-bpe", "HuggingFaceTokenizer",
         "GPT2BPETokenizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_export_hf_writes_the_checkpoints_tokenizer(tmp_path, kind, capsys):
    tool = load_tool()
    if kind == "HuggingFaceTokenizer":
        record = _record(kind, model=_hf_tokenizer_dir(tmp_path / "hf_tok"))
    elif kind == "GPT2BPETokenizer":
        vocab, merges = _gpt2_files(tmp_path / "gpt2")
        record = _record(kind, vocab_file=vocab, merge_file=merges)
    else:
        name, model_type = kind.split("-")
        record = _record(name, model=_sentencepiece(tmp_path / "tok.model", model_type))
    ours = build_recorded_tokenizer(record, 0 if record["type"] != "NullTokenizer" else 1)
    ck, out = tmp_path / "ck", tmp_path / "hf"
    _checkpoint(tool, ck, _config(ours.vocab_size, llama=kind != "GPT2BPETokenizer"), record)
    assert tool.main(["export-hf", str(ck), str(out)]) == 0
    printed = capsys.readouterr()
    with _Warnings() as w:
        tok = transformers.AutoTokenizer.from_pretrained(str(out))
        config = transformers.AutoConfig.from_pretrained(str(out))
    for text in TEXTS:
        assert tok(text).input_ids == ours.encode(text), text
    saved = json.loads((out / "config.json").read_text())
    assert saved["eos_token_id"] == tok.eos_token_id == ours.eod            # generate stops where a document ends
    assert saved["bos_token_id"] == tok.bos_token_id
    assert saved["pad_token_id"] == tok.pad_token_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ours.eod and gen["pad_token_id"] is not None
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        assert value is None or 0 <= value < config.vocab_size, (name, value)
    assert not [m for m in w.seen if "token_id" in m], w.seen
    assert "tokenizer: " + record["type"] in printed.out and "warning" not in printed.err, printed
    if kind == "megareshard-bpe":     # generate on the export as it is: no warning, stops at most at the budget
        with _Warnings() as w:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
            enc = tok("def f(x):", return_tensors="pt")
            ids = model.generate(**enc, max_new_tokens=4, do_sample=False)
        assert ids.shape[1] <= enc.input_ids.shape[1] + 4
        assert not [m for m in w.seen if "token" in m], w.seen


def test_export_hf_without_a_tokenizer_writes_null_ids(tmp_path, capsys):
    """GPT-2's config defaults bos/eos to 50256: for a 100-id vocabulary transformers warned; now they are null."""
    tool = load_tool()
    ck, out = tmp_path / "ck", tmp_path / "hf"
    _checkpoint(tool, ck, _config(100, llama=False), None)
    assert tool.main(["export-hf", str(ck), str(out)]) == 0
    with _Warnings() as w:
        config = transformers.AutoConfig.from_pretrained(str(out))
    assert config.bos_token_id is None and config.eos_token_id is None
    assert not [m for m in w.seen if "token_id" in m], w.seen
    saved = json.loads((out / "config.json").read_text())
    assert saved["bos_token_id"] is None and saved["eos_token_id"] is None
    assert "tokenizer: no tokenizer" in capsys.readouterr().out
    # a recorded tokenizer whose files are gone (a checkpoint moved elsewhere): the weights go out, with a warning
    ck2 = tmp_path / "ck2"
    _checkpoint(tool, ck2, _config(100, llama=False), _record("megareshard", model=str(tmp_path / "gone.model")))
    assert tool.main(["export-hf", str(ck2), str(tmp_path / "hf2")]) == 0
    err = capsys.readouterr().err
    assert "warning: tokenizer: none written: the tokenizer" in err and "gone.model" in err, err
    assert (tmp_path / "hf2" / "model.safetensors").exists() and not (tmp_path / "hf2" / "tokenizer.json").exists()


# ---- 2. import-hf of a hub name: the local cache ------------------------------------------------------------------
def test_import_hf_reads_a_hub_name_from_the_local_cache(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants
    tool = load_tool()
    ck, exported = tmp_path / "ck", tmp_path / "exported"
    cfg = _config(300)
    _checkpoint(tool, ck, cfg, _record("HuggingFaceTokenizer", model=_hf_tokenizer_dir(tmp_path / "hf_tok")))
    assert tool.main(["export-hf", str(ck), str(exported)]) == 0
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots").mkdir(parents=True)
    os.rename(exported, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))     # read when huggingface_hub was imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()

    assert tool.main(["import-hf", "tiny-org/tiny-llama", str(tmp_path / "imported")]) == 0
    out = capsys.readouterr().out
    assert "tiny-org/tiny-llama from the local Hugging Face cache" in out, out
    assert "recorded its tokenizer: HuggingFaceTokenizer" in out, out
    got, want = (read_full_model(d, read_info(d)) for d in (resolve_checkpoint_dir(str(p)) for p in (tmp_path /
                                                                                                     "imported", ck)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    assert tool.main(["import-hf", "tiny-org/not-cached", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "tiny-org/not-cached is neither a directory here nor in the local Hugging Face cache" in err, err
    assert "HF_HUB_OFFLINE forbids a download" in err and len(err.strip().splitlines()) == 1


# ---- 3. generate.py reads a Megatron-LM directory; import-megatron records the tokenizer --------------------------
def _generate(argv: list[str], capsys) -> str:
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(argv + ["--prompt", "def f(x):", "--max-new-tokens", "4", "--ids"]) == 0
    return capsys.readouterr().out


def _megatron(tmp_path, capsys) -> tuple[str, str, str]:
    """(a megareshard checkpoint recording a sentencepiece tokenizer, its export-megatron directory, the model)."""
    tool = load_tool()
    model_path = _sentencepiece(tmp_path / "tok.model")
    vocab = build_recorded_tokenizer(_record("megareshard", model=model_path), 0).vocab_size
    ck, meg = tmp_path / "ck", tmp_path / "megatron"
    _checkpoint(tool, ck, _config(vocab), _record("megareshard", model=model_path))
    assert tool.main(["export-megatron", str(ck), str(meg)]) == 0
    capsys.readouterr()
    return str(ck), str(meg), model_path


def test_generate_reads_a_megatron_directory(tmp_path, capsys):
    """--load of the Megatron-LM directory itself (its arguments name no tokenizer: the flag gives it): the same
    continuation as from the checkpoint it was exported from."""
    ck, meg, model_path = _megatron(tmp_path, capsys)
    want = _generate(["--load", ck], capsys)
    assert _generate(["--load", meg, "--tokenizer-model", model_path], capsys) == want


def test_import_megatron_records_the_tokenizer_and_notes_nothing_spurious(tmp_path, capsys):
    ck, meg, model_path = _megatron(tmp_path, capsys)
    tool = load_tool()
    # the tokenizer flags given at import are recorded: generate needs none afterwards
    assert tool.main(["import-megatron", meg, str(tmp_path / "imported"), "--tokenizer-model", model_path]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "recorded its tokenizer: megareshard" in out, out
    assert read_info(resolve_checkpoint_dir(str(tmp_path / "imported")))["tokenizer"]["model"] == model_path
    assert _generate(["--load", str(tmp_path / "imported")], capsys) == _generate(["--load", ck], capsys)
    # no note for the vocabulary the arguments state exactly (they name no tokenizer: export-megatron of a run on
    # mock data); it read "vocabulary 400: the run's --vocab-size (with None; ...)"
    assert tool.main(["import-megatron", meg, str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out, out


# ---- 4. examples/finetune_hf.sh prints no warning of its own making ------------------------------------------------
def test_finetune_hf_example_sequence_length_warns_nothing(tmp_path, capsys):
    """The example fine-tunes the tiny Llama examples/hf/make_tiny_llama.py makes with its own --seq-length: the
    load of the imported checkpoint (what its runs print first) must warn nothing."""
    from megareshard.parallel import ParallelContext
    from megareshard.training import Trainer
    script = (ROOT / "examples" / "finetune_hf.sh").read_text()
    maker = (ROOT / "examples" / "hf" / "make_tiny_llama.py").read_text()
    seq = int(re.search(r"--seq-length (\d+)", script).group(1))
    positions = int(re.search(r"max_position_embeddings=(\d+)", maker).group(1))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    tool = load_tool()
    assert tool.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    flags = capsys.readouterr().out.split("--finetune ", 1)[1].split()
    argv = ["--mock-data", "--seq-length", str(seq), "--load", str(tmp_path / "ck"), "--finetune", "--device", "cpu",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            *flags]
    log = io.StringIO()
    Trainer(parse_args(argv, world_size=1), ParallelContext.single_process(), torch.device("cpu"), out=log)
    printed = log.getvalue() + "".join(capsys.readouterr())
    assert "loaded" in printed and "WARNING" not in printed and "differs" not in printed, printed


def test_compare_generation_example_warns_nothing(tmp_path, monkeypatch, capsys):
    """examples/hf/compare_generation.py (step 5 of finetune_hf.sh) on an export: no transformers warning."""
    tool = load_tool()
    ck, out = tmp_path / "ck", tmp_path / "hf"
    _checkpoint(tool, ck, _config(300), _record("HuggingFaceTokenizer", model=_hf_tokenizer_dir(tmp_path / "tok")))
    assert tool.main(["export-hf", str(ck), str(out)]) == 0
    spec = importlib.util.spec_from_file_location("compare_generation", ROOT / "examples" / "hf" /
                                                  "compare_generation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["compare_generation.py", str(out), str(ck), "def ", "--max-new-tokens", "3"])
    with _Warnings() as w:
        assert mod.main() == 0
    assert "greedy continuations identical" in capsys.readouterr().out
    assert not w.seen, w.seen
