"""Learning-rate schedules with Megatron-LM's meaning: steps counted in samples, every decay style, flags."""
from __future__ import annotations

import math
import re

import pytest

from megareshard.arguments import ConfigError, parse_args
from megareshard.optim.lr_scheduler import ParamSchedule, schedule_from_config

BASE = ["--mock-data", "--vocab-size", "64"]


def test_warmup_then_each_decay_style_by_hand():
    # warm-up 100 samples from 0.1 to 1.0, decay to 0.1 at 1100 samples
    def lr(style, n, **kw):
        return ParamSchedule(1.0, 0.1, 100, 1100, style, init_lr=0.1, **kw).at_samples(n)

    assert lr("linear", 0) == pytest.approx(0.1) and lr("linear", 50) == pytest.approx(0.55)
    assert lr("linear", 100) == pytest.approx(1.0)
    assert lr("linear", 600) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lr("cosine", 600) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr("cosine", 350) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr("constant", 5000) == 1.0
    assert lr("inverse-square-root", 400) == pytest.approx(1.0 * math.sqrt(100) / math.sqrt(400))
    assert lr("inverse-square-root", 10 ** 6) == 0.1  # floored at min-lr (past the decay: min-lr)
    for style in ("linear", "cosine", "inverse-square-root"):
        assert lr(style, 1101) == 0.1 and lr(style, 1100) == pytest.approx(0.1 if style != "inverse-square-root"
                                                                             else max(0.1, 10 / math.sqrt(1100)))
    # WSD: stable at max until the last 200 samples of the decay, then the anneal's shape
    for wstyle, at_half in (("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                            ("minus_sqrt", 1 - 0.5 ** 0.5)):
        assert lr("WSD", 800, wsd_decay_steps=200, wsd_decay_style=wstyle) == 1.0
        assert lr("WSD", 1000, wsd_decay_steps=200, wsd_decay_style=wstyle) == pytest.approx(0.1 + 0.9 * at_half)


def test_iteration_k_runs_at_the_samples_consumed_before_it():
    s = ParamSchedule(1.0, 0.0, 8, 40, "linear", samples_per_iter=4)
    assert [s(k) for k in (1, 2, 3, 4)] == pytest.approx([0.0, 0.5, 1.0, 1.0 - 4 / 32])


@pytest.mark.parametrize("argv, warmup, decay", [
    (["--train-iters", "50", "--lr-warmup-iters", "5"], 5 * 8, 50 * 8),
    (["--train-iters", "50", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "40"], 32, 40 * 8),
    (["--train-samples", "400", "--lr-warmup-samples", "16", "--lr-decay-samples", "300"], 16, 300),
    (["--train-samples", "400"], 0, 400),
])
def test_flags_to_schedule(argv, warmup, decay):
    cfg = parse_args(BASE + ["--micro-batch-size", "2", "--global-batch-size", "8"] + argv, world_size=1)
    s = schedule_from_config(cfg.training)
    assert (s.warmup_steps, s.decay_steps, s.samples_per_iter) == (warmup, decay, 8)
    if "--train-samples" in argv:
        assert cfg.training.train_iters == 400 // 8


def test_megatron_defaults():
    t = parse_args(BASE, world_size=1).training
    assert (t.lr_decay_style, t.min_lr, t.lr_warmup_iters, t.weight_decay, t.adam_beta1, t.adam_beta2,
            t.adam_eps, t.lr_warmup_init, t.lr_wsd_decay_style) == ("linear", 0.0, 0, 0.01, 0.9, 0.999, 1e-8, 0.0,
                                                                   "exponential")


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "5", "--train-samples", "40"], "--train-iters 5 and --train-samples 40 conflict"),
    (["--lr-decay-iters", "5", "--lr-decay-samples", "40"], "--lr-decay-iters 5 and --lr-decay-samples 40 conflict"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction 0.1 conflicts"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1]"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--train-samples", "3", "--global-batch-size", "4"], "--train-samples 3 is less than one global batch"),
    (["--lr-warmup-samples", "900", "--train-samples", "400", "--global-batch-size", "4"],
     "--lr-warmup-samples 900 is longer than the decay"),
])
def test_schedule_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(BASE + argv, world_size=1)


def _trainer(extra):
    import io

    import torch

    from megareshard.parallel import ParallelContext
    from megareshard.training import Trainer

    argv = BASE + ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                   "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4",
                   "--lr-warmup-iters", "1", "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0"]
    return Trainer(parse_args(argv + extra, world_size=1), ParallelContext.single_process(),
                   torch.device("cpu"), out=io.StringIO())


def test_decoupled_lr_for_embedding_and_output_layer():
    plain = [r["loss"] for r in _trainer([]).train()]
    same = _trainer(["--decoupled-lr", "1e-3"])
    assert [r["loss"] for r in same.train()] == plain  # own groups at the same rates: bitwise the same run
    t = _trainer(["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"])
    t.train()
    groups = t.optimizer.param_groups
    assert [g["decoupled"] for g in groups] == [False, False, True, True]
    names = {id(e.master): e.name for e in t.optimizer.entries}
    own = {names[id(p)] for g in groups if g["decoupled"] for p in g["params"]}
    assert own and all("word_embeddings" in n or n.startswith("output_layer") for n in own)
    base = schedule_from_config(t.cfg.training)
    for g in groups:  # after 4 iterations: the rate of iteration 4, each on its own peak and floor
        want = base(4) if not g["decoupled"] else ParamSchedule(5e-3, 5e-4, base.warmup_steps, base.decay_steps,
                                                                base.decay_style, base.samples_per_iter)(4)
        assert g["lr"] == pytest.approx(want)
    with pytest.raises(ConfigError, match="--decoupled-min-lr 0.001 needs --decoupled-lr"):
        parse_args(BASE + ["--decoupled-min-lr", "1e-3"], world_size=1)
