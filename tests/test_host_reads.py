"""Issue #53: an iteration of the training loop reads the device once — the logged loss, the gradient norm and the
non-finite check's flags in one transfer (on a GPU every read is a host synchronisation that leaves the device
idle while the host prepares what comes next) — and the next batch is read and collated before that read, while
the device still works. On CPU the reads are counted where the trainer makes them: every ``Tensor`` method that
copies a value to the host, called from megareshard's own code."""
from __future__ import annotations

import io
import os
import sys
from time import monotonic as time_monotonic

import pytest
import torch

import megareshard
from megareshard.arguments import parse_args
from megareshard.training import Trainer, build_context

PACKAGE = os.path.dirname(megareshard.__file__) + os.sep
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
MODEL = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "100", "--device", "cpu", "--train-iters", "4", "--no-torch-compile"]


def _trainer(argv: list[str]) -> Trainer:
    cfg = parse_args(MODEL + argv, world_size=1)
    ctx, _ = build_context(cfg, 1)
    return Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())


def _count_reads(monkeypatch, trainer: Trainer) -> list[list[tuple[str, str, int]]]:
    """Per train_step call, the host reads megareshard's code made in it: (method, file, line)."""
    steps: list[list[tuple[str, str, int]]] = []
    inside = []

    def wrap(name, orig):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if inside and caller.f_code.co_filename.startswith(PACKAGE):
                steps[-1].append((name, os.path.basename(caller.f_code.co_filename), caller.f_lineno))
            return orig(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    step = trainer.train_step

    def counted(*args, **kwargs):
        steps.append([])
        inside.append(1)
        try:
            return step(*args, **kwargs)
        finally:
            inside.pop()
    monkeypatch.setattr(trainer, "train_step", counted)
    return steps


@pytest.mark.parametrize("extra", [[], ["--no-check-for-nan-in-loss-and-grad"],
                                   ["--num-experts", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"],
                                   ["--log-num-zeros-in-grad"], ["--bf16"]],
                         ids=["nan-check", "no-nan-check", "moe-router-losses", "num-zeros", "bf16"])
def test_an_iteration_reads_the_device_once(monkeypatch, extra):
    trainer = _trainer(extra)
    steps = _count_reads(monkeypatch, trainer)
    records = trainer.train()
    assert len(steps) == 4
    moe_layers = 2 if "--num-experts" in extra else 0
    for reads in steps[1:]:   # the first iteration also measures memory
        # dropless MoE: each MoE layer's dispatch reads its experts' token counts (the shapes after it depend on
        # them), once per micro-batch in the forward; the loop itself reads once (the router losses included)
        dispatch = [r for r in reads if r[1] == "dispatch.py"]
        assert len(dispatch) == moe_layers * 2, reads   # 2 micro-batches
        assert [(name, where) for name, where, _ in reads if where != "dispatch.py"] == [("tolist", "training.py")], \
            reads
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 16]  # prefetching does not advance the sampler
    if "--log-num-zeros-in-grad" in extra:  # the count came with the one read, exact (fp64)
        assert all(r["num_zeros"] == int(r["num_zeros"]) >= 0 for r in records), records
    if "--num-experts" in extra:  # the router losses came with the one read
        assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in records), records
    trainer.close()


def test_the_prefetched_batch_is_the_one_trained_on(monkeypatch):
    """The loop's batches (prefetched during the previous iteration) are the sampler's, bitwise: the same losses and
    gradient norms as a loop that reads each batch at its own iteration."""
    loop = _trainer([])
    used, made = [], []
    step, read = loop.train_step, loop._microbatches
    monkeypatch.setattr(loop, "train_step", lambda mbs, prefetch=None: used.append(mbs) or step(mbs, prefetch))
    monkeypatch.setattr(loop, "_microbatches", lambda data, indices: made.append(read(data, indices)) or made[-1])
    records = loop.train()
    loop.close()
    # one read per batch: the first at its iteration, the next three during the iteration before theirs
    assert len(made) == 4 and all(u is m for u, m in zip(used, made))
    plain = _trainer([])
    got = []
    for _ in range(4):
        res = plain.train_step(plain._microbatches(plain.train_data, next(plain._train_iter)))
        plain.iteration += 1
        got.append((res.loss, res.grad_norm))
    plain.close()
    assert [(r["loss"], r["grad_norm"]) for r in records] == got


def test_the_loop_reads_the_device_once_an_iteration_between_log_lines(monkeypatch):
    """Outside train_step too: the peak memory per stage (a collective and, on a GPU, a read) is gathered at log
    lines only, and on one rank it is a host value; a run that stops between log lines gathers it at the end."""
    trainer = _trainer(["--train-iters", "6", "--exit-interval", "5"])
    spans: list[list[tuple[str, str]]] = [[]]   # the reads from one train_step's start to the next's (the loop's)

    def wrap(name, orig):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                spans[-1].append((name, os.path.basename(caller)))
            return orig(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda *a, **k: spans.append([]) or step(*a, **k))
    records = trainer.train()
    trainer.close()
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]   # --exit-interval 5: stopped between log lines
    assert len(spans) == 6   # set-up, then the 5 iterations (the last one's span runs to the end of train())
    for reads in spans[2:]:  # iterations 2-5 whole: train_step's one read, nothing else from the loop
        assert reads == [("tolist", "training.py")], reads
    assert "peak_mem_mb_per_stage" in records[0] and all("peak_mem_mb" not in r for r in records[1:4])
    assert records[-1]["peak_mem_mb_per_stage"] == [records[-1]["peak_mem_mb"]] and records[-1]["peak_mem_mb"] > 0


def test_an_iteration_is_timed_from_the_previous_ones_end_less_evaluation_and_saves(monkeypatch, tmp_path):
    """ms_per_iter runs from one iteration's end to the next's (on a GPU train_step returns with its optimizer step
    still running, and the next iteration's read waits for it), less evaluations and checkpoint saves, as Megatron-LM
    stops its interval timer for them. A clock the test moves: train_step takes 10, the work between iterations 3,
    an evaluation 100, a save 1000."""
    from megareshard import training

    clock = [0.0]
    monkeypatch.setattr(training, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0]),
                                                           "monotonic": staticmethod(time_monotonic)}))
    trainer = _trainer(["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--save",
                        str(tmp_path / "ck"), "--save-interval", "3"])
    step, evaluate, save = trainer.train_step, trainer.evaluate, trainer.save_checkpoint

    def advance(by, fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            clock[0] += by
            return out
        return run
    monkeypatch.setattr(trainer, "train_step", advance(10.0, step))
    monkeypatch.setattr(trainer, "evaluate", advance(100.0, evaluate))
    monkeypatch.setattr(trainer, "save_checkpoint", advance(1000.0, save))
    trainer.step_end_actions.append(lambda tr, rec: clock.__setitem__(0, clock[0] + 3.0))
    records = trainer.train()
    trainer.close()
    # 1: its train_step; 2: the 3 after iteration 1 and its own 10; 3: after the evaluation (excluded) the 3 of
    # iteration 2's end, then 10; 4: iteration 3's save excluded, what followed it (nothing timed) and its 10
    assert [r["ms_per_iter"] for r in records] == [1e4, 1.3e4, 1.3e4, 1e4], records


def test_the_nan_checks_gradient_norms_cost_the_same_operations_for_any_number_of_gradients():
    """--check-for-nan-in-loss-and-grad (on by default) keeps every gradient's norm on the device each iteration
    for its diagnosis; that costs one multi-tensor norm in fp32 and one stack, not a cast per gradient (on a GPU
    each is a kernel launch: 148 an iteration at GPT 125M in issue 53's profile)."""
    from megareshard.optim.numerics import grad_norms
    from tests.dispatched_ops import DispatchedOps

    counts = []
    for n in (3, 30):
        params = [torch.nn.Parameter(torch.zeros(5 + i, dtype=torch.bfloat16)) for i in range(n)]
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.5 + i)
        with DispatchedOps() as mode:
            norms = grad_norms([(f"p{i}", p) for i, p in enumerate(params)])
        counts.append(mode.ops)
        assert norms.norms.dtype == torch.float32 and norms.names == [f"p{i}" for i in range(n)]
        expect = torch.tensor([(0.5 + i) * (5 + i) ** 0.5 for i in range(n)])
        torch.testing.assert_close(norms.norms, expect, rtol=2 ** -7, atol=0)   # bf16 inputs, fp32 sums
    assert counts[0] == counts[1], counts
