"""pretrain_gpt.py end to end: real tokenizer and dataset, 4 ranks, metrics file, W&B offline, eval."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_pretrain

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(stdlib_text):
    return stdlib_text


def _args(data, *extra):
    """The base flags, those that ``extra`` gives replaced by it (the command line refuses a flag given twice)."""
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1",
            "--data-path", str(data / "text"), "--tokenizer-model", str(data / "tok.model"), "--split", "80,20,0",
            "--device", "cpu"]
    given, kept, drop = {a for a in extra if a.startswith("--")}, [], False
    for a in base:
        drop = a in given if a.startswith("--") else drop
        if not drop:
            kept.append(a)
    return kept + list(extra)


@pytest.mark.slow
def test_tp2_pp2_with_eval_metrics_and_wandb(data, tmp_path):
    """pretrain_gpt.py's main on 4 ranks with torchrun's environment (forked: a torchrun worker's fresh interpreter
    costs ~4.5 CPU-s of imports on 2 cores). torchrun itself starts it in the examples' tests and tests/reliability;
    the pre-flight rendezvous and its rank map under torchrun are lab/tests/test_emulated_cluster_example.py's."""
    metrics = tmp_path / "metrics.jsonl"
    argv = _args(data, "--tensor-model-parallel-size", "2", "--train-iters", "6", "--pipeline-model-parallel-size", "2",
                 "--pipeline-schedule", "eager-1f1b", "--delay-wgrad-compute", "--zero-stage", "1",
                 "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "2", "--metrics-file", str(metrics),
                 "--log-params-norm", "--log-num-zeros-in-grad",
                 "--wandb-project", "mr-test", "--wandb-save-dir", str(tmp_path / "wb"))
    log = str(tmp_path / "rank{}.log")
    assert run_pretrain(argv, 4, log, timeout=300, env={"WANDB_MODE": "offline"}) == [0] * 4
    logs = [Path(log.format(r)).read_text() for r in range(4)]
    out = "".join(logs)  # what torchrun would have shown: rank 0 reports the set-up, the last stage the training
    assert "tp 2 × dp 1 × pp 2" in out
    assert "stage 0: layers 0..0" in out and "memory per rank after the first iteration" in out
    logged = [[int(m) for m in re.findall(r"^ iteration +(\d+)/", text, flags=re.M)] for text in logs]
    assert sorted(logged) == [[], [], [], [1, 2, 4, 6]], logged  # the first and every --log-interval, one rank
    assert "validation at iteration 3" in out and "W&B: run" in out and "offline" in out
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in recs] == list(range(1, 7))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "ms_per_iter", "params_norm", "num_zeros"} <= recs[0].keys()
    # Megatron-LM's fields, after the gradient norm (their values per layout: tests/test_training_equivalence.py)
    assert re.search(r"grad norm: [\d.]+ \| num zeros: \d+\.\d \| params norm: [\d.]+ \|", out), out[-2000:]
    assert all(r["params_norm"] > 0 and r["num_zeros"] >= 0 for r in recs)
    assert "eval_loss" in recs[2] and "eval_loss" in recs[5]
    assert any((tmp_path / "wb").rglob("*.wandb")), "the offline W&B run was written where asked"


def _run_single(args, tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def _main_here(args, capsys) -> tuple[int, str]:
    """pretrain_gpt.py's main in this process (each start of a Python that imports torch costs ~4 s of a 2-core
    machine): its exit code and what it wrote to stderr. For the errors found before any process group exists."""
    sys.path.insert(0, str(ROOT))
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(str(ROOT))
    capsys.readouterr()
    code = pretrain_gpt.main(args)
    assert not torch.distributed.is_initialized()
    return code, capsys.readouterr().err


def test_bad_input_is_reported(data, tmp_path, capsys):
    code, err = _main_here(_args(data, "--vocab-size", "999", "--train-iters", "1"), capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "--vocab-size 999 differs from the vocabulary of tokenizer" in err
    code, err = _main_here(_args(data, "--global-batch-size", "7", "--train-iters", "1"), capsys)
    assert code == 2 and "global batch 7 is not divisible by micro batch 2 × dp 1" in err
    # a dataset made with a bigger tokenizer than the model's
    code, err = _main_here(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
                            "32", "--data-path", str(data / "text"), "--vocab-size", "100", "--train-iters", "1",
                            "--lr-warmup-iters", "0", "--device", "cpu"], capsys)
    # (found at start-up by the data validation, which names the file and the offset: tests/reliability)
    assert code == 2 and "is outside the vocabulary [0, 100)" in err and "text.bin: token id" in err
    # as a script: the process's exit code and stderr
    p = _run_single(_args(data, "--train-iters", "1", "--data-path", str(tmp_path / "missing")), tmp_path)
    assert p.returncode != 0 and "missing" in p.stderr


@pytest.mark.parametrize("entry", ["pretrain_gpt", "pretrain_utransformer"])
def test_every_run_stopping_error_is_one_line_and_exit_1(entry, monkeypatch, capsys):
    """The entry points catch PeerFailure, PreflightError and each RunStopped error (found on the GPU
    machine, where a missing wandb raised inside the run: a nested tuple in `except` raised TypeError
    instead of catching, on every Python)."""
    import importlib

    from megareshard.arguments import Config
    from megareshard.checkpoint.format import CheckpointError
    from megareshard.launch import PeerFailure, PreflightError
    from megareshard.optim.numerics import NonFiniteError

    sys.path.insert(0, str(ROOT))
    try:
        mod = importlib.import_module(entry)
    finally:
        sys.path.remove(str(ROOT))
    for err in (PeerFailure("rank 3 stopped answering"), PreflightError("node 1 missing"),
                CheckpointError("disk full"), NonFiniteError("loss is nan in iteration 4")):
        def boom(*_, _err=err, **__):
            raise _err
        monkeypatch.setattr(mod, "pretrain", boom)
        if hasattr(mod, "parse_args"):
            monkeypatch.setattr(mod, "parse_args", lambda *a, **k: Config())
        else:
            monkeypatch.setattr(mod, "parse_model_args", lambda *a, **k: (Config(), object()))
        assert mod.main([]) == 1
        assert capsys.readouterr().err.strip() == f"{entry}.py: error: {err}"
        # as a script: a peer failure ends the process at once (a broken process group can abort in C++ at
        # teardown: SIGABRT instead of 1, seen in CI); the other errors exit normally
        exits = []
        monkeypatch.setattr(os, "_exit", exits.append)
        assert mod.main([], hard_exit_after_peer_failure=True) == 1
        assert exits == ([1] if isinstance(err, PeerFailure) else [])
        capsys.readouterr()
