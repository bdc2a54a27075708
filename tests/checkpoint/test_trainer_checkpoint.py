"""Checkpoints through the Trainer (flags --save/--load/--finetune/--exit-*): tp/pp/dp/ZeRO relayouts
(losses within 1e-5, weights and optimizer state bitwise after re-saving), exact resume with dropout and
ZeRO 1 on per-stage layouts, SIGTERM save-and-exit, W&B run resumed with the saved id.

Both 8-rank families run in one launch (start-up dominates on 2 cores). The exact resume of a uniform
tp 2 · pp 2 · dp 2 layout with dropout is tests/reliability/test_ranks_resume.py's (bitwise, after a kill)."""
from __future__ import annotations

import io
import os
import signal

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.training import Trainer, build_context
from tests.harness import run_ranks

from ._helpers import load_tool, no_saves_after

MODEL = ["--mock-data", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "100", "--device", "cpu",
         "--hidden-dropout", "0", "--attention-dropout", "0"]

# (name, tp, pp, zero): targets of the tp 2 · pp 2 · dp 2 · ZeRO 1 source
# (dp 8 at ZeRO 0 ran here too until session 15: dp 8 at ZeRO 2 re-slices the same data and more state)
TARGETS = [("tp1_pp4_dp2_z0", 1, 4, 0), ("tp4_pp1_dp2_z2", 4, 1, 2), ("tp1_pp1_dp8_z2", 1, 1, 2)]
ITERS = 4  # the source saves at 3; each target loads that and trains iteration 4, compared with the source's


def _trainer(argv, world, last_save: int | None = None):
    """A Trainer of MODEL + argv; with ``last_save`` N it saves nothing after iteration N (`no_saves_after`)."""
    cfg = parse_args(MODEL + ["--nproc-per-node", str(world)] + argv, world_size=world)
    ctx, _ = build_context(cfg, world)
    t = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    return t if last_save is None else no_saves_after(t, last_save)


def _layouts(rank: int, world: int, root: str):
    torch.set_num_threads(1)
    out = {}
    src = _trainer(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                    "--train-iters", str(ITERS), "--save", f"{root}/src", "--save-interval", "3"], world, last_save=3)
    out["src"] = [r["loss"] for r in src.train()]
    src.close()
    for name, tp, pp, zero in TARGETS:
        t = _trainer(["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                      "--zero-stage", str(zero), "--train-iters", str(ITERS), "--load", f"{root}/src/iter_0000003",
                      "--save", f"{root}/{name}"], world, last_save=3)
        start = t.iteration
        t.save_checkpoint()                      # right after loading: must equal the source's iteration 3
        losses = [r["loss"] for r in t.train()]
        out[name] = {"start": start, "losses": losses, "messages": t.loaded.messages,
                     "optim": t.loaded.loaded_optimizer}
        t.close()
    ft = _trainer(["--tensor-model-parallel-size", "4", "--zero-stage", "2", "--train-iters", "5",
                   "--load", f"{root}/src", "--finetune"], world)
    out["finetune"] = (ft.iteration, len(ft.optimizer.inner.state), ft.sampler.consumed_samples)
    ft.close()
    return out


def _both(rank: int, world: int, root: str):
    return _layouts(rank, world, f"{root}/uniform"), _stage_layouts(rank, world, f"{root}/stages")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer-ck"))
    return run_ranks(_both, 8, root, timeout=600), root


@pytest.mark.slow
def test_trainer_relayout_pp_and_finetune(launched):
    results, root = launched
    root = f"{root}/uniform"
    r = next(x for x, _ in results if len(x["src"]) == ITERS)
    src = r["src"]
    for name, *_ in TARGETS:
        got = r[name]
        assert got["start"] == 3 and got["optim"], name
        assert len(got["losses"]) == len(src[3:]) == ITERS - 3, (name, got["losses"])
        for a, b in zip(got["losses"], src[3:]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["losses"], src[3:])
        text = "\n".join(got["messages"])
        assert "layout changed: saved tp 2 · pp 2 · dp 2 · zero 1" in text and "re-sliced exactly" in text, text
        assert "RNG: tp/pp changed" in text and "re-seeded" in text, text      # never silent
        if "dp8" in name:
            assert "data: dp changed 2 -> 8" in text and "same global batch" in text, text
        else:  # tp/pp changed, dp 2 kept (it said "dp changed 2 -> 2" for pp 2 -> 4)
            assert "dp changed" not in text, text
    assert r["finetune"] == (0, 0, 0)
    tool = load_tool()
    s = tool.export(os.path.join(root, "src", "iter_0000003"), os.path.join(root, "s.pt"))
    for name, *_ in TARGETS:
        o = tool.export(os.path.join(root, name, "iter_0000003"), os.path.join(root, name + ".pt"))
        for k, t in s["model"].items():
            assert torch.equal(t, o["model"][k]), (name, k)
        for k, kinds in s["optimizer"].items():
            for kind, t in kinds.items():
                assert torch.equal(t, o["optimizer"][k][kind]), (name, k, kind)


def test_sigterm_saves_and_exits_and_wandb_resumes(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    old = signal.getsignal(signal.SIGTERM)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["--train-iters", "8", "--save", str(tmp_path / "ck"), "--exit-signal-handler",
                "--wandb-project", "mr-test", "--wandb-save-dir", str(tmp_path / "wb")]
        t = _trainer(argv, 1)
        inner = t.forward_backward_fn

        def fb(*a, **k):
            if t.iteration == 2:                        # during iteration 3
                os.kill(os.getpid(), signal.SIGTERM)
            return inner(*a, **k)

        t.forward_backward_fn = fb
        recs = t.train()
        run_id = t.tracker.run_id
        t.close()
        assert len(recs) == 3 and run_id
        with open(tmp_path / "ck" / "latest") as f:
            assert f.read().strip() == "iter_0000003"
        u = _trainer(["--train-iters", "8", "--load", str(tmp_path / "ck"), "--wandb-project", "mr-test",
                      "--wandb-save-dir", str(tmp_path / "wb")], 1)
        assert u.iteration == 3 and u.tracker.run_id == run_id
        assert len(u.train()) == 5
        u.close()
        e = _trainer(["--train-iters", "8", "--save", str(tmp_path / "ck2"), "--exit-interval", "2"], 1)
        assert len(e.train()) == 2
        e.close()
        with open(tmp_path / "ck2" / "latest") as f:
            assert f.read().strip() == "iter_0000002"
    finally:
        signal.signal(signal.SIGTERM, old)
        torch.set_num_threads(n)


def _stage_layouts(rank: int, world: int, root: str):
    torch.set_num_threads(1)
    per = ["--pipeline-model-parallel-size", "2", "--stage-layouts", "tp1dp4,tp2dp2", "--hidden-dropout", "0.1",
           "--attention-dropout", "0.1", "--train-iters", "5", "--zero-stage", "1"]  # resumed: iterations 4 and 5
    src = _trainer(per + ["--save", f"{root}/src", "--save-interval", "3"], world, last_save=3)
    ref = [r["loss"] for r in src.train()]
    src.close()
    same = _trainer(per + ["--load", f"{root}/src/iter_0000003"], world)
    resumed = (same.iteration, [r["loss"] for r in same.train()], same.loaded.messages, same.loaded.loaded_rng)
    same.close()
    uni = _trainer(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--hidden-dropout",
                    "0.1", "--attention-dropout", "0.1", "--train-iters", "5", "--load", f"{root}/src/iter_0000003",
                    "--save", f"{root}/uni"], world)
    uni.save_checkpoint()  # right after loading: must hold the per-stage run's iteration-3 state exactly
    out = {"ref": ref, "same": resumed, "uniform": (uni.iteration, uni.loaded.messages)}
    uni.close()
    return out


@pytest.mark.slow
def test_per_stage_layouts_resume_exactly_and_load_into_a_uniform_layout(launched):
    """--stage-layouts tp1dp4,tp2dp2 with ZeRO 1: the same layout resumes bitwise (dropout on, RNG restored, no
    layout message); a uniform tp 2 · pp 2 · dp 2 run loads it re-sliced exactly and says what changed."""
    results, root = launched
    root = f"{root}/stages"
    r = results[-1][1]
    start, losses, messages, loaded_rng = r["same"]
    assert start == 3 and loaded_rng and len(losses) == 2 and losses == r["ref"][3:], (losses, r["ref"])
    assert not any("layout changed" in m or "RNG:" in m or "data:" in m for m in messages), messages
    start, messages = r["uniform"]
    text = "\n".join(messages)
    assert start == 3
    assert "layout changed: saved stage layouts tp1dp4,tp2dp2 (pp 2)" in text and "re-sliced exactly" in text, text
    assert "RNG: tp/pp changed (tp 1,2 -> 2" in text and "data: dp changed 4,2 -> 2" in text, text
    tool = load_tool()
    s = tool.export(os.path.join(root, "src", "iter_0000003"), os.path.join(root, "s.pt"))
    o = tool.export(os.path.join(root, "uni", "iter_0000003"), os.path.join(root, "u.pt"))
    for k, t in s["model"].items():
        assert torch.equal(t, o["model"][k]), k
    for k, kinds in s["optimizer"].items():
        for kind, t in kinds.items():
            assert torch.equal(t, o["optimizer"][k][kind]), (k, kind)
