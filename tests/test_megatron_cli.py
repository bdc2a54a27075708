"""pretrain_gpt.py as a Megatron-LM user meets it: one-line errors, TensorBoard event files, start-up notes."""
from __future__ import annotations

import importlib.util
import io
import os

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.training import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--device", "cpu"]


def pretrain_gpt_main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_script", os.path.join(ROOT, "pretrain_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("argv, message", [
    (["--mock-data", "--tokenizer-model", "/nonexistent/tok.model"], "--tokenizer-model /nonexistent/tok.model"),
    (["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/v.json", "--merge-file",
      "/nonexistent/m.txt"], "--vocab-file /nonexistent/v.json: file not found"),
    (["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/model"],
     "directory not found"),
    (["--mock-data", "--vocab-size", "64", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
     "--fp8-recipe (fp8 / Transformer Engine)"),
])
def test_bad_tokenizer_or_feature_is_one_line(argv, message, capsys):
    assert pretrain_gpt_main()(argv + TINY + ["--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_tensorboard_events_and_no_effect_line(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    out = io.StringIO()
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "3", "--tensorboard-dir", tb,
                      "--log-throughput", "--use-flash-attn", "--no-masked-softmax-fusion", "--lr", "1e-3",
                      "--attention-dropout", "0",  # PyTorch's flash kernel for CPU has no dropout
                      "--lr-warmup-iters", "1", "--log-params-norm", "--log-num-zeros-in-grad"] + TINY, world_size=1)
    records = pretrain(cfg, out=out)
    log = out.getvalue()
    lines = [ln for ln in log.splitlines() if "flags without effect" in ln]
    assert len(lines) == 1 and "--use-flash-attn" in lines[0] and "--no-masked-softmax-fusion" in lines[0]
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size", "throughput", "lm loss vs samples", "params-norm",
            "num-zeros", "params-norm vs samples"} <= tags
    assert [e.value for e in acc.Scalars("params-norm")] == pytest.approx([r["params_norm"] for r in records])
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records])
    assert [e.value for e in acc.Scalars("learning-rate")] == pytest.approx([0.0, 1e-3, 5e-4])  # Megatron's warm-up


def test_memory_to_tensorboard_writes_megatrons_tags_and_is_refused_on_cpu(tmp_path, capsys):
    """--log-memory-to-tensorboard: the four allocator statistics under Megatron-LM's tags, against the iteration
    (a record as the trainer makes it from torch.cuda.memory_stats; where a GPU is at hand, a run on it); on cpu,
    where there is no caching allocator, one line, before the launch (--device cpu) or once the device is
    resolved."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megareshard.arguments import ConfigError
    from megareshard.tracking import TensorBoardWriter, cuda_memory_fields

    stats = {"reserved_bytes.all.current": 6 << 20, "allocated_bytes.all.current": 5 << 20,
             "allocated_bytes.all.peak": 7 << 20, "allocation.all.current": 42, "num_ooms": 0}
    fields = cuda_memory_fields(stats)
    assert fields == {"mem_reserved_bytes": 6 << 20, "mem_allocated_bytes": 5 << 20,
                      "mem_max_allocated_bytes": 7 << 20, "mem_allocated_count": 42}
    assert cuda_memory_fields({}) == dict.fromkeys(fields, 0)   # nothing allocated yet
    tb = TensorBoardWriter(str(tmp_path / "tb"), interval=2)
    for step in (1, 2, 3):
        tb.log({"loss": 1.0, "consumed_samples": 4 * step, **fields}, step=step)
    tb.finish()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-allocated-count"} <= tags
    assert not any(t.startswith("mem-") and t.endswith("vs samples") for t in tags)
    assert [(e.step, e.value) for e in acc.Scalars("mem-allocated-count")] == [(1, 42), (2, 42)]  # interval 2
    with pytest.raises(ConfigError, match="device cpu has none"):
        parse_args(["--mock-data", "--vocab-size", "64", "--log-memory-to-tensorboard"] + TINY, world_size=1)
    argv = ["--mock-data", "--vocab-size", "64", "--log-memory-to-tensorboard", "--train-iters", "1"] + \
        [a for a in TINY if a not in ("--device", "cpu")]
    if not torch.cuda.is_available():   # the device resolved to cpu: refused by the trainer, one line
        assert pretrain_gpt_main()(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--log-memory-to-tensorboard" in err and "device cpu has none" in err, err
        return
    records = pretrain(parse_args(argv + ["--tensorboard-dir", str(tmp_path / "gpu")], world_size=1),
                       out=io.StringIO())
    acc = EventAccumulator(str(tmp_path / "gpu"))
    acc.Reload()
    peak = acc.Scalars("mem-max-allocated-bytes")
    assert [e.step for e in peak] == [1] and peak[0].value == records[0]["mem_max_allocated_bytes"] > 0


@pytest.mark.parametrize("level, per_iteration", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_level_empties_where_megatron_does(monkeypatch, level, per_iteration):
    """--empty-unused-memory-level: the CUDA cache emptied after each forward-backward (1) and each evaluation batch
    (1), and after each optimizer step too (2); counted here by replacing torch.cuda.empty_cache (a no-op without
    CUDA) — 3 iterations, one evaluation of 2 batches."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "3", "--eval-interval", "3",
                      "--eval-iters", "2", "--empty-unused-memory-level", str(level)] + TINY, world_size=1)
    pretrain(cfg, out=io.StringIO())
    assert len(calls) == 3 * per_iteration + (2 if level else 0)


def test_fresh_run_with_load_equal_to_save_starts_from_scratch(tmp_path):
    ck = str(tmp_path / "ck")
    out = io.StringIO()
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--save", ck, "--load", ck] + TINY,
                     world_size=1)
    pretrain(cfg, out=out)
    assert "holds no checkpoint" in out.getvalue() and "latest" in os.listdir(ck)
    out = io.StringIO()  # the second run resumes from it
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "3", "--save", ck, "--load", ck] + TINY,
                     world_size=1)
    records = pretrain(cfg, out=out)
    assert [r["iteration"] for r in records] == [3] and "holds no checkpoint" not in out.getvalue()


def test_default_evaluation_is_megatrons_and_skipped_without_validation_data(tmp_path):
    import numpy as np

    from megareshard.arguments import ConfigError
    from megareshard.data.indexed_dataset import write_indexed_dataset

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "d_text_document")
    write_indexed_dataset(prefix, [rng.integers(0, 64, size=40) for _ in range(20)])
    cfg = parse_args(["--data-path", prefix, "--vocab-size", "64", "--split", "100,0,0", "--train-iters", "2"] + TINY,
                     world_size=1)
    assert (cfg.logging.eval_interval, cfg.logging.eval_iters, cfg.logging.log_interval) == (None, 100, 100)
    out = io.StringIO()
    records = pretrain(cfg, out=out)  # Megatron-LM skips validation it has no data for; here it also says so
    assert len(records) == 2 and "no evaluation: --split 100,0,0 leaves no validation documents" in out.getvalue()
    cfg = parse_args(["--data-path", prefix, "--vocab-size", "64", "--split", "100,0,0", "--train-iters", "2",
                      "--eval-interval", "1"] + TINY, world_size=1)
    with pytest.raises(ConfigError, match="--eval-interval 1 needs validation data"):
        pretrain(cfg, out=io.StringIO())


def test_manual_gc_collects_at_the_interval_and_around_evaluations(monkeypatch):
    """--manual-gc (Megatron-LM's, in its Llama-3 script): the collector is off while training (no rank stops for a
    collection while the others wait in a collective), collects at start-up, every --manual-gc-interval iterations
    and before and after each evaluation (--no-manual-gc-eval: not there), and is back on afterwards."""
    import gc

    from megareshard.training import Trainer, build_context

    calls, enabled = [], []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a, **k: calls.append((trainer.iteration, *a, *k.values())) or real(*a, **k))
    # (iteration, generation): everything at start-up, at the interval and before an evaluation; what the evaluation
    # made (generation 0) after it, as Megatron-LM
    for extra, want in ((["--manual-gc-interval", "2"], [(0,), (2,), (2,), (2, 0), (4,), (4,), (4, 0)]),
                        (["--manual-gc-interval", "3", "--no-manual-gc-eval"], [(0,), (3,)]),
                        ([], [(0,), (2,), (2, 0), (4,), (4, 0)])):
        cfg = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "4", "--eval-interval", "2",
                          "--eval-iters", "1", "--manual-gc", "--lr", "1e-3"] + extra + TINY, world_size=1)
        trainer = Trainer(cfg, build_context(cfg, 1)[0], torch.device("cpu"), out=io.StringIO())
        trainer.step_hooks = (*trainer.step_hooks, lambda tr, it: enabled.append(gc.isenabled()))
        calls.clear()
        assert gc.isenabled()
        trainer.train()
        trainer.close()
        assert calls == want and gc.isenabled() and enabled and not any(enabled), (extra, calls)
        enabled.clear()
    from megareshard.config_fields import ConfigError

    with pytest.raises(ConfigError, match="--manual-gc-interval must be >= 0"):
        parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--manual-gc-interval", "-1"],
                   world_size=1)
