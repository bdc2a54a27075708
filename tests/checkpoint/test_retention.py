"""Checkpoint retention (--save-retain-latest N, --save-retain-interval K; megareshard/checkpoint/retention.py):
the rule on iteration numbers, a real training run that keeps exactly the expected directories and resumes from
`latest`, and a prune killed with SIGKILL between its rename and its deletion."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.checkpoint import KILL_ENV, CheckpointManager, resolve_checkpoint_dir
from megareshard.checkpoint.detect import KIND_ROOT, describe_path
from megareshard.checkpoint.retention import to_prune
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer, build_context

from ._helpers import Run

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = ["--mock-data", "--vocab-size", "100", "--num-layers", "1", "--hidden-size", "16",
         "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--log-interval", "100", "--device", "cpu", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dirs(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n != ".megareshard.lock")


def _latest(root) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read().strip()


def test_the_rule():
    its = range(1, 35)
    assert to_prune(its, 34) == [] and to_prune(its, 34, 0, None) == []          # default: keep every one
    assert to_prune(range(1, 6), 5, 2) == [1, 2, 3]                              # the newest 2
    assert to_prune(range(1, 6), 5, 1) == [1, 2, 3, 4]
    assert to_prune(range(1, 11), 10, 2, 4) == [1, 2, 3, 5, 6, 7]                # + every 4th (4, 8)
    assert to_prune(range(1, 7), 6, 0, 3) == [1, 2, 4, 5]                        # Megatron's K alone: latest + 3, 6
    assert to_prune([2, 4, 6, 8, 10], 10, 9) == []                               # fewer than N
    # `latest` (a resumed older checkpoint) is kept with the N-1 below it; newer directories are never removed
    assert to_prune(range(1, 7), 4, 2) == [1, 2]
    assert to_prune(range(1, 7), 4, 1, 2) == [1, 3]
    assert to_prune(range(1, 7), None, 1) == []                                  # no `latest`: nothing
    assert to_prune([1, 2, 3], 7, 1) == []                                       # `latest` names no directory
    with pytest.raises(ValueError):
        to_prune([1, 2], 2, -1)


def test_flags():
    ck = parse_args(MODEL + ["--save", "/tmp/x", "--save-retain-latest", "3", "--save-retain-interval", "100"],
                    world_size=1).checkpoint
    assert (ck.save_retain_latest, ck.save_retain_interval) == (3, 100)
    ck = parse_args(MODEL, world_size=1).checkpoint
    assert (ck.save_retain_latest, ck.save_retain_interval) == (0, None)
    for argv, message in ((["--save-retain-latest", "2"], "--save-retain-latest need(s) --save DIR"),
                          (["--save", "d", "--save-retain-latest", "-1"], "--save-retain-latest must be at least 0"),
                          (["--save", "d", "--save-retain-interval", "0"],
                           "--save-retain-interval must be at least 1, got 0")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_args(MODEL + argv, world_size=1)


def _trainer(argv):
    cfg = parse_args(MODEL + argv, world_size=1)
    ctx, _ = build_context(cfg, 1)
    out = io.StringIO()
    return Trainer(cfg, ctx, torch.device("cpu"), out=out), out


def test_training_run_keeps_the_newest_and_every_kth_and_resumes(tmp_path):
    root = str(tmp_path / "ck")
    keep = ["--save", root, "--save-interval", "1", "--save-retain-latest", "2", "--save-retain-interval", "2"]
    t, out = _trainer(["--train-iters", "5"] + keep)
    t.train()
    t.close()
    assert _dirs(root) == ["iter_0000002", "iter_0000004", "iter_0000005", "latest"]
    assert _latest(root) == "iter_0000005"
    removed = [line for line in out.getvalue().splitlines() if "removed" in line]
    assert removed == [f"checkpoint: removed {root}/iter_000000{i} (keeping the newest 2 and those of iterations "
                       "divisible by 2)" for i in (1, 3)], removed
    # resume from `latest` with the writes in the background: the policy goes on, `latest` is never removed
    u, out = _trainer(["--train-iters", "7", "--load", root, "--async-save"] + keep)
    assert u.iteration == 5
    u.train()
    u.close()
    assert _dirs(root) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000007", "latest"]
    assert _latest(root) == "iter_0000007"
    assert [line for line in out.getvalue().splitlines() if "removed" in line] == [
        f"checkpoint: removed {root}/iter_0000005 (keeping the newest 2 and those of iterations divisible by 2)"]


_PRUNE = ("import sys; sys.path.insert(0, {root!r}); from megareshard.checkpoint.retention import prune; "
          "prune({d!r}, 1); print('survived')")


def test_sigkill_mid_prune_leaves_loadable_checkpoints_and_the_next_save_cleans_up(tmp_path):
    d = str(tmp_path / "ck")
    run = Run(ParallelContext.single_process(), zero=0)
    mgr = CheckpointManager(out=None)              # retention off: three checkpoints
    for it in (1, 2, 3):
        run.train(1)
        mgr.save(d, it, **run.objects())
    saved = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", KILL_ENV: "prune"}
    proc = subprocess.run([sys.executable, "-c", _PRUNE.format(root=ROOT, d=d)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "survived" not in proc.stdout
    # killed after renaming the first victim, before deleting it: the whole checkpoint or a .tmp. leftover
    assert _dirs(d) == [".tmp.pruned.iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    os.remove(os.path.join(d, ".tmp.pruned.iter_0000001", ".metadata"))     # as if the deletion had begun
    assert _latest(d) == "iter_0000003"
    assert resolve_checkpoint_dir(d) == os.path.join(d, "iter_0000003")
    assert describe_path(d).kind == KIND_ROOT
    # the next run resumes from `latest`, and its first save finishes the prune and applies the policy
    other = Run(ParallelContext.single_process(), zero=0, seed=5)
    lines: list[str] = []
    mgr = CheckpointManager(out=None, retain_latest=1)
    mgr._say = lambda msg, warning=False: lines.append(msg)
    assert mgr.load(d, **other.objects()).iteration == 3
    assert all(torch.equal(p, saved[n]) for n, p in other.model.named_parameters())
    other.train(1)
    mgr.save(d, 4, **other.objects())
    assert _dirs(d) == ["iter_0000004", "latest"] and _latest(d) == "iter_0000004"
    assert [m for m in lines if m.startswith("removed")] == [
        f"removed {d}/iter_000000{i} (keeping the newest one)" for i in (2, 3)]
