"""Nothing silent, nothing overwritten — the single-process refusals, each one line with a bounded length:

* ``--load`` that is not a checkpoint (a directory of other files, a Megatron-LM root or iteration directory, a
  mistyped path, a file) stops; only ``--load`` = ``--save`` with no checkpoint yet starts from scratch;
* every writing command of tools/checkpoint_util.py refuses a non-empty destination and leaves it byte for byte
  as it was (``--force`` writes); a checkpoint root whose lock a live process holds is refused even forced, and
  the lock is free again once that process is SIGKILLed (no stale lock);
* ``import-hf`` on a bad Hugging Face directory (sizes that do not match the weights, heads that do not divide
  the hidden size, a non-integer or negative size, a truncated safetensors file) is one line, nothing written;
* a flag given twice with two values, and an invalid choice, are one line (not argparse's usage block).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from megareshard.arguments import ConfigError
from megareshard.checkpoint.detect import KIND_ABSENT, KIND_EMPTY, KIND_ROOT, LOCK_FILE, load_decision

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 300   # characters of an error line, its paths aside (each path counts as one character)


def _short(line: str, *paths) -> str:
    for p in sorted((str(p) for p in paths), key=len, reverse=True):
        line = line.replace(p, "P")
    return line


def _one_line(text: str, *paths) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text and len(_short(lines[0], *paths)) <= LIMIT, lines[0]
    return lines[0]


def _tree(path: Path) -> dict:
    """Every file under ``path`` with its bytes' hash and mtime: what 'unchanged on disk' compares."""
    if path.is_file():
        return {"": (hashlib.sha1(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)}
    return {str(p.relative_to(path)): (hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir",
                                       p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


# ---- --load ------------------------------------------------------------------------------------------------
def test_load_decision_refuses_anything_that_is_not_a_checkpoint(tmp_path):
    rand = tmp_path / "rand"
    rand.mkdir()
    (rand / "notes.txt").write_text("x")
    (rand / "weights.bin").write_bytes(b"\0" * 10)
    legacy = tmp_path / "mg" / "iter_0000010"
    (legacy / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("10\n")
    dist_iter = tmp_path / "mg2" / "iter_0000004"
    dist_iter.mkdir(parents=True)
    for name in ("metadata.json", "common.pt", ".metadata", "__0_0.distcp"):
        (dist_iter / name).write_bytes(b"{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {  # --load, --save -> what the line must say
        "random files": (rand, None, "holds 2 entries and no checkpoint (notes.txt, weights.bin"),
        "random files, also --save": (rand, rand, "holds 2 entries and no checkpoint"),
        "megatron iteration (legacy)": (legacy, None, f"pass its root, --load {tmp_path / 'mg'}"),
        "megatron iteration (dist)": (dist_iter, None, "Megatron-LM checkpoint iteration directory (distributed "
                                                       "format: metadata.json, common.pt"),
        "megatron root": (tmp_path / "mg", None, "is a Megatron-LM checkpoint root (latest_checkpointed_iteration.txt "
                                                 "names '10')"),
        "mistyped": (tmp_path / "chekpoints", tmp_path / "checkpoints", "does not exist: is the path mistyped?"),
        "empty, not --save": (empty, tmp_path / "other", "nothing to load"),
        "a file": (rand / "notes.txt", None, "is a file of 1 bytes"),
    }
    for name, (load, save, says) in cases.items():
        with pytest.raises(ConfigError) as e:
            load_decision(str(load), str(save) if save else None)
        line = _one_line(str(e.value), tmp_path)
        assert line.startswith(f"--load {load} ") and says in line, (name, line)
    # the auto-resume pattern: --load = --save, nothing saved yet (absent, empty, or only our own lock file)
    assert load_decision(str(tmp_path / "new"), str(tmp_path / "new")).kind == KIND_ABSENT
    assert load_decision(str(empty), str(empty) + "/").kind == KIND_EMPTY
    (empty / LOCK_FILE).write_text("{}")
    (empty / ".tmp.iter_0000002").mkdir()
    assert load_decision(str(empty), str(empty)).kind == KIND_EMPTY
    (empty / "iter_0000002").mkdir()
    assert load_decision(str(empty), None).kind == KIND_ROOT         # the loader names what is wrong inside


def test_pretrain_stops_on_a_load_that_is_not_a_checkpoint(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain_gpt import main
    finally:
        sys.path.remove(str(ROOT))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    tiny = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
            "2", "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters",
            "1", "--device", "cpu", "--eval-interval", "0"]
    assert main(tiny + ["--load", str(tmp_path / "junk"), "--save", str(tmp_path / "ck")]) == 2   # a bad input
    err = capsys.readouterr().err
    assert "not a checkpoint" in _one_line(err, tmp_path)
    assert sorted(os.listdir(tmp_path / "ck")) == [LOCK_FILE]          # nothing saved; the lock is released


# ---- tools/checkpoint_util.py -----------------------------------------------------------------------------
def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("checkpoint_util_refusals", ROOT / "tools" / "checkpoint_util.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf_gpt2(path: Path) -> None:
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def test_writing_tools_refuse_a_non_empty_destination_and_change_nothing(tmp_path, capsys):
    tool = _tool()
    hf, root, other = tmp_path / "hf", tmp_path / "root", tmp_path / "other-model"
    _hf_gpt2(hf)
    shutil.copytree(hf, other)
    assert tool.main(["import-hf", str(hf), str(root)]) == 0           # root: iter_0000000 + latest
    pt = tmp_path / "full.pt"
    assert tool.main(["export", str(root), str(pt)]) == 0
    capsys.readouterr()
    refused = {  # command -> its destination, and what the line must say is there
        "export": (["export", str(root), str(pt)], pt, "exists ("),
        "import": (["import", str(pt), str(root)], root, "is a megareshard checkpoint root (1 iteration directory); "
                                                         "its latest names iter_0000000"),
        "import-hf": (["import-hf", str(hf), str(root)], root, "its latest names iter_0000000"),
        "export-hf": (["export-hf", str(root), str(other)], other, "holds config.json, generation_config.json, "
                                                                  "model.safetensors"),
    }
    for name, (argv, dest, says) in refused.items():
        before = _tree(dest)
        assert tool.main(argv) == 2, name
        line = _one_line(capsys.readouterr().err, tmp_path)
        assert says in line and "refusing to overwrite" in line and "--force" in line, (name, line)
        assert _tree(dest) == before, name                                # not a byte, not a timestamp changed
    assert tool.main(["import", str(pt), str(root), "--iteration", "7", "--force"]) == 0
    assert (root / "latest").read_text().strip() == "iter_0000007"       # forced: written, latest moved
    assert tool.main(["export-hf", str(root), str(other), "--force"]) == 0
    capsys.readouterr()

    # a root whose lock a live process holds: refused even with --force; SIGKILL frees it (no stale lock)
    ready_r, ready_w = os.pipe()
    wait_r, wait_w = os.pipe()
    holder = os.fork()        # a child of this process (torch already imported): it only takes the lock and waits
    if holder == 0:
        try:
            from megareshard.checkpoint.lock import try_lock_dir

            lock, _ = try_lock_dir(str(root))
            os.write(ready_w, b"held")
            os.read(wait_r, 1)                                            # blocks until killed
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 4) == b"held"                             # blocks until the lock is taken
        before = _tree(root)
        assert tool.main(["import", str(pt), str(root), "--force"]) == 2
        line = _one_line(capsys.readouterr().err, tmp_path)
        assert f"is in use by another job: pid {holder} on host " in line and "nothing was written" in line, line
        assert _tree(root) == before
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        for fd in (ready_r, ready_w, wait_r, wait_w):
            os.close(fd)
    assert tool.main(["import", str(pt), str(root), "--iteration", "8", "--force"]) == 0
    assert (root / "latest").read_text().strip() == "iter_0000008"


def test_import_hf_of_a_bad_directory_is_one_line(tmp_path, capsys):
    tool = _tool()
    good = tmp_path / "good"
    _hf_gpt2(good)
    capsys.readouterr()                                                   # transformers' progress bars
    cases = {  # what is wrong -> (config.json changes, bytes cut off model.safetensors, what the line says)
        "sizes of another model": ({"n_embd": 96}, 0, "config.json does not match the weights: "),
        "heads do not divide": ({"n_embd": 96, "n_head": 5}, 0, "n_embd 96 is not divisible by n_head 5"),
        "a word for a number": ({"n_head": "four"}, 0, "n_head 'four' must be a positive integer"),
        "negative vocabulary": ({"vocab_size": -1}, 0, "vocab_size -1 must be a positive integer"),
        "truncated weights": ({}, 1000, "is not a readable safetensors file"),
    }
    for name, (changes, cut, says) in cases.items():
        d = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        if cut:
            f = d / "model.safetensors"
            os.truncate(f, f.stat().st_size - cut)
        out = tmp_path / f"out-{d.name}"
        assert tool.main(["import-hf", str(d), str(out)]) == 2, name
        line = _one_line(capsys.readouterr().err, tmp_path)
        assert says in line, (name, line)
        assert not out.exists(), name


# ---- flags ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--hidden-size", "64", "--hidden-size", "128"], "--hidden-size is given twice (64, then 128)"),
    (["--data-path", "a", "b", "--data-path=c"], "--data-path is given twice (a b, then c)"),
    (["--pipeline-schedule", "foo"], "invalid choice: 'foo' (choose from 'gpipe', '1f1b', 'eager-1f1b'"),
    (["--hidden-size", "wide"], "argument --hidden-size: invalid int value: 'wide'"),
])
def test_repeated_flag_and_invalid_choice_are_one_line(argv, says, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain_gpt import main
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--mock-data", "--vocab-size", "64"] + argv)
    assert main() == 2                                                     # the command line, as typed
    assert says in _one_line(capsys.readouterr().err)


def test_the_same_value_twice_is_harmless_and_code_may_override(monkeypatch):
    from megareshard.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["x", "--mock-data", "--vocab-size", "64", "--hidden-size", "64",
                                      "--hidden-size=64", "--bf16", "--bf16"])
    cfg = parse_args(world_size=1)
    assert cfg.model.hidden_size == 64 and cfg.memory.bf16
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--hidden-size", "32", "--hidden-size", "64"], world_size=1)
    assert cfg.model.hidden_size == 64                                     # a list built in code: the last wins


# ---- one line per job, not per rank ------------------------------------------------------------------------
def _report_twice(rank, world):
    from megareshard.entry import _first_to_report

    return [_first_to_report("pretrain_gpt.py: error: the same agreed error"),
            _first_to_report(f"pretrain_gpt.py: error: rank {rank}: its own error")]


def test_an_error_several_ranks_raise_is_printed_by_one_of_them():
    from megareshard.launch import exit_with_launcher
    from tests.harness import run_ranks

    firsts = run_ranks(_report_twice, 2, timeout=120)
    assert sorted(f[0] for f in firsts) == [False, True]                  # the agreed line: once
    assert all(f[1] for f in firsts)                                      # each rank's own line: by that rank
    assert exit_with_launcher(env={}) is None                             # not torchrun's worker: no launcher watch
