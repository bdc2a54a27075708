"""--check-for-nan-in-loss-and-grad (Megatron's, on by default): a non-finite loss or gradient stops every
rank at once with the iteration, the rank and the parameter, before the optimizer step; fp16 overflows
with a dynamic loss scaler keep skipping the step and lowering the scale instead."""
import math

import torch

from tests.harness import run_ranks

from lab.chaos.chaos_data import Inject, build_trainer, params_snapshot

PARAM = "layers.1.mlp.fc1.weight"


def _scenarios(rank, world):
    from megareshard.optim.numerics import NonFiniteError

    out = {}

    def run(name, argv, **inject):
        tr = build_trainer(argv, world)
        tr.forward_backward_fn = Inject(tr, **inject)
        before = {}

        def keep(*a, **k):  # the parameters right before the poisoned iteration
            before.update(params_snapshot(tr))
        try:
            # the iterations before the poisoned one; snapshot; the rest
            tr.cfg.training.train_iters, total = inject["iteration"] - 1, tr.cfg.training.train_iters
            tr.train()
            keep()
            tr.cfg.training.train_iters = total
            tr.train()
            out[name] = ("finished", [r["loss"] for r in tr.records], [r["skipped"] for r in tr.records],
                         [r["loss_scale"] for r in tr.records])
        except NonFiniteError as e:
            after = params_snapshot(tr)
            out[name] = ("stopped", str(e), all(torch.equal(before[k], after[k]) for k in before))
        finally:
            tr.close()

    dp2 = ["--mock-data", "--vocab-size", "64", "--global-batch-size", "8", "--train-iters", "3"]
    run("grad", dp2, iteration=2, rank=1, param=PARAM)
    run("loss-pp", dp2 + ["--pipeline-model-parallel-size", "2"], iteration=2, rank=1, loss=True)
    run("off", dp2 + ["--no-check-for-nan-in-loss-and-grad"], iteration=2, rank=1, param=PARAM)
    run("fp16", dp2 + ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"], iteration=2, rank=1,
        param=PARAM, value=math.inf)
    return out


def test_nan_stops_every_rank_naming_iteration_rank_and_parameter():
    results = run_ranks(_scenarios, 2, timeout=240)
    for rank in (0, 1):
        r = results[rank]
        # dp 2: rank 1's gradient goes NaN in iteration 2; the reduction spreads it, the message names its origin
        kind, msg, untouched = r["grad"]
        assert kind == "stopped" and untouched, r["grad"]
        assert msg.startswith("iteration 2: first non-finite parameter gradient: "
                              f"{PARAM} (nan) on rank 1 before the data-parallel reduction"), msg
        assert "\n" not in msg
        # pp 2: the last stage's loss goes NaN in iteration 2; the first stage stops too (no hang)
        kind, msg, untouched = r["loss-pp"]
        assert kind == "stopped" and untouched and msg.startswith("iteration 2: non-finite loss on rank 1 loss nan"), msg
        # check disabled: the run finishes (and the NaN spreads into the weights, as in Megatron)
        kind, losses, skipped, _ = r["off"]
        assert kind == "finished" and len(losses) == 3 and math.isnan(losses[-1]), r["off"]
        # fp16 + dynamic scaler (hysteresis 1): the overflow skips iteration 2 on every rank, halves the scale,
        # and training goes on
        kind, losses, skipped, scales = r["fp16"]
        assert kind == "finished", r["fp16"]
        assert skipped == [False, True, False] and scales[:2] == [1024, 512], (skipped, scales)
        assert all(math.isfinite(x) for x in losses)
