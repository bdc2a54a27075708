"""What a new user meets in the first hour: the memory table, the fp16 schedule, TensorBoard's units, the log and
summary lines, a checkpoint that knows its tokenizer, --validate-only, flag hints and a --help without torch.

Every run here is one in-process rank on a tiny model (a few seconds each)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.optim.lr_scheduler import schedule_from_config
from megareshard.parallel import ParallelContext
from megareshard.tracking import format_duration
from megareshard.training import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _train(argv: list[str]) -> tuple[Trainer, str]:
    out = io.StringIO()
    trainer = Trainer(parse_args(argv + TINY, world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                      out=out)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, out.getvalue()


def _state_bytes(optimizer) -> int:
    """The optimizer's state as it is after a step, counted directly: the fp32 masters that are not views of the
    model's parameters, and every tensor AdamW keeps (its moments and step counters)."""
    masters = sum(e.master.nbytes for e in optimizer.entries if not e.master_is_view)
    return masters + sum(v.nbytes for st in optimizer.inner.state.values() for v in st.values() if torch.is_tensor(v))


@pytest.fixture(scope="module")
def fp32_run(stdlib_text, tmp_path_factory):
    """Real data with the quick start's tokenizer kind, TensorBoard, a checkpoint at the end."""
    tmp = tmp_path_factory.mktemp("fp32_run")
    argv = ["--data-path", str(stdlib_text / "text"), "--tokenizer-model", str(stdlib_text / "tok.model"),
            "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1", "--train-iters", "3",
            "--global-batch-size", "4", "--lr", "1e-3", "--tensorboard-dir", str(tmp / "tb"), "--save",
            str(tmp / "ckpt")]
    trainer, log = _train(argv)
    return trainer, log, tmp


def test_memory_table_counts_the_optimizer_state_after_its_step(fp32_run):
    trainer, log, _ = fp32_run
    mem = trainer.memory[0]
    assert mem.optimizer == _state_bytes(trainer.optimizer) > 0  # 0.0 when measured before AdamW's first step
    assert mem.optimizer >= 2 * mem.params  # fp32: the masters are the parameters; two moments of their size
    assert f"optimizer {mem.optimizer / 2**20:.1f}" in log and f"total {mem.total / 2**20:.1f}" in log


def test_memory_table_bf16_zero1_counts_masters_and_moments():
    trainer, _ = _train(["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--bf16", "--zero-stage", "1"])
    mem = trainer.memory[0]
    assert mem.optimizer == _state_bytes(trainer.optimizer)
    # bf16 parameters (2 B each) under fp32 masters and two fp32 moments (12 B each), step counters aside
    assert 6 * mem.params <= mem.optimizer < 6 * mem.params + 4 * 64


def test_a_tensor_parallel_shard_holds_only_its_own_rows():
    """The quick start's memory table showed params 3.3 MiB per rank where the shards hold 1.8: a dim-0 shard was a
    view keeping the whole unsharded weight alive (on CPU; a copy to a GPU holds only the view)."""
    from types import SimpleNamespace

    from megareshard.tensor_parallel.layers import _shard_param

    ctx = SimpleNamespace(tp_size=2, tp_rank=lambda: 1)
    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    for dim in (0, 1):
        shard = _shard_param(full, ctx, dim, torch.device("cpu"), torch.float32)
        assert torch.equal(shard, full.chunk(2, dim)[1]) and shard.untyped_storage().nbytes() == 16 * 4


def test_fp16_learning_rate_schedule_advances_only_with_applied_updates():
    # 2^24 overflows fp16 gradients at first; with hysteresis 1 the scale halves at every overflow until it fits
    trainer, log = _train(["--mock-data", "--vocab-size", "64", "--train-iters", "12", "--fp16",
                           "--initial-loss-scale", str(2.0 ** 24), "--hysteresis", "1", "--lr", "1e-3",
                           "--lr-decay-style", "linear", "--lr-decay-iters", "20", "--no-check-for-nan-in-loss-and-grad"])
    skipped = [r["skipped"] for r in trainer.records]
    assert skipped[0] and skipped[1] and not all(skipped), skipped  # the run starts with overflows
    schedule = schedule_from_config(trainer.cfg.training)
    applied = 0
    for rec in trainer.records:  # Megatron-LM: iteration k trains at the rate of the samples of applied updates
        assert rec["lr"] == pytest.approx(schedule(applied + 1)), (rec["iteration"], applied)
        applied += not rec["skipped"]
    assert trainer.scheduler.num_steps == applied
    assert "step skipped (gradient overflow)" in log and "number of skipped iterations:" in log


def test_tensorboard_scalars_have_megatrons_names_and_units(fp32_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _, tmp = fp32_run
    acc = EventAccumulator(str(tmp / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    plotted = {"lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size"}
    validation = {"lm loss validation", "lm loss validation ppl"}
    assert tags == plotted | {f"{t} vs samples" for t in plotted | validation} | validation | {"iteration-time"}
    seconds = [e.value for e in acc.Scalars("iteration-time")]
    assert seconds == pytest.approx([r["ms_per_iter"] / 1e3 for r in trainer.records])  # seconds, not ms
    assert all(0 < s < 60 for s in seconds)


def test_log_lines_say_what_happens(fp32_run):
    trainer, log, _ = fp32_run
    lines = log.splitlines()
    assert any(ln.startswith(" > building the model (1 layers") for ln in lines)
    assert any(ln.startswith(" > checking the datasets") for ln in lines)
    assert any(ln.startswith(" > set-up done in ") and "model " in ln for ln in lines)
    logged = [ln for ln in lines if ln.startswith(" iteration ")]
    assert len(logged) == 2 and "       3/       3" in logged[-1]  # --log-interval 100: the first and the last
    for field in ("global batch size:     4", "number of skipped iterations:   0", "number of nan iterations:   0",
                  "elapsed: 0:", "ETA: 0:00"):
        assert field in logged[-1], field
    first = trainer.records[0]  # the ETA: the time so far per iteration, times the iterations to go
    assert first["eta_s"] == pytest.approx(2 * first["elapsed_s"]) and f"ETA: {format_duration(first['eta_s'])}" in logged[0]
    summary = [ln for ln in lines if ln.startswith(" training done: 3 iterations (1-3), 192 tokens in ")]
    assert len(summary) == 1 and f"final lm loss {trainer.records[-1]['loss']:.6E}" in summary[0]
    assert "0 skipped and 0 nan iterations" in summary[0]
    assert any(ln.startswith("checkpoint: saved iteration 3 to ") and " s (" in ln for ln in lines)


def test_generate_needs_only_the_checkpoint(fp32_run, stdlib_text, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "tools"))
    _, _, tmp = fp32_run
    ckpt = str(tmp / "ckpt")
    assert generate.main(["--load", ckpt, "--prompt", "def ", "--max-new-tokens", "4", "--ids"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("def ") and len(eval(out[1])) > 4  # the ids: the prompt's and 4 new ones
    # Megatron-LM's SentencePieceTokenizer on the same model file adds <CLS> <SEP> <EOD> <MASK> after its 800
    # pieces: 804 ids for an 800-id model. Only the ids a prompt uses must be the model's.
    assert generate.main(["--load", ckpt, "--prompt", "def ", "--max-new-tokens", "4", "--tokenizer-type",
                          "SentencePieceTokenizer", "--tokenizer-model", str(stdlib_text / "tok.model")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def ") and "trained with a megareshard tokenizer" in captured.err
    with pytest.raises(SystemExit) as e:  # a prompt holding one of those special pieces has no embedding
        generate.main(["--load", ckpt, "--prompt", "def <MASK>", "--tokenizer-type", "SentencePieceTokenizer",
                       "--tokenizer-model", str(stdlib_text / "tok.model")])
    assert e.value.code == 2 and "outside the model's vocabulary of 800 ids" in capsys.readouterr().err


def test_validate_only_checks_tokenizer_and_data_without_training(stdlib_text, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setenv("WORLD_SIZE", "4")
    data = ["--data-path", str(stdlib_text / "text"), "--tokenizer-model", str(stdlib_text / "tok.model"),
            "--global-batch-size", "8", "--validate-only", "--tensor-model-parallel-size", "2"]
    assert pretrain_gpt.main(data + TINY) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "arguments valid for 4 rank(s): tp 2 × pp 1 × dp 2, global batch 8 in 2 microbatch(es) of 2" in out
    assert "vocab_size=800" in out and "text (" in out
    assert pretrain_gpt.main(data + TINY + ["--vocab-size", "999"]) == 2
    assert "--vocab-size 999 differs from the vocabulary" in capsys.readouterr().err
    assert pretrain_gpt.main(data[:1] + [str(stdlib_text / "missing")] + data[2:] + TINY) == 2
    assert "missing" in capsys.readouterr().err


def test_argument_errors_print_once_per_node(capsys, monkeypatch):
    from megareshard.entry import run_entry_point

    def bad() -> None:
        parse_args(["--mock-data", "--vocab-size", "64", "--tensor-model-paralel-size", "2"], world_size=1)

    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank of torchrun other than its node's first: silent, still exit 2
    assert run_entry_point("pretrain_gpt.py", bad) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert run_entry_point("pretrain_gpt.py", bad) == 2
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: unknown flag(s) --tensor-model-paralel-size (did you "
                                       "mean --tensor-model-parallel-size?): neither megareshard's nor one of the "
                                       "Megatron-LM flags it knows (see --help)\n")


@pytest.mark.parametrize("argv, kind, note", [
    (["--use-rotary-position-embeddings"], "rope", "sets --position-embedding-type rope"),
    (["--use-rotary-position-embeddings", "--no-position-embedding"], "rope", "--no-position-embedding (rotary"),
    (["--position-embedding-type", "rope", "--no-position-embedding"], "rope", "no position-embedding table"),
])
def test_old_megatron_position_flags_map_as_megatron_maps_them(argv, kind, note):
    cfg = parse_args(["--mock-data", "--vocab-size", "64"] + argv + TINY, world_size=1)
    assert cfg.model.position_embedding_type == kind and any(note in n for n in cfg.notes), cfg.notes


def test_no_position_embedding_without_rope_is_refused_as_in_megatron():
    with pytest.raises(ConfigError, match="--no-position-embedding is deprecated and, as in Megatron-LM, only "
                                          "accepted with rotary embeddings, not with --position-embedding-type "
                                          "learned_absolute"):
        parse_args(["--mock-data", "--vocab-size", "64", "--no-position-embedding"] + TINY, world_size=1)


def test_help_and_validate_only_answer_without_torch(stdlib_text):
    """--help, and --validate-only on a real tokenizer and dataset (the launch scripts' check before torchrun), in
    a fresh interpreter that never imports torch: the launch scripts' one-line answer comes in a fraction of a
    second, not after torch's seconds of start-up."""
    data = ["--data-path", str(stdlib_text / "text"), "--tokenizer-model", str(stdlib_text / "tok.model"),
            "--global-batch-size", "8", "--validate-only"] + TINY
    code = ("import runpy, sys\n"
            "for argv in (['--help'], sys.argv[1:]):\n"
            "    sys.argv = ['pretrain_gpt.py'] + argv\n"
            "    try:\n        runpy.run_path(sys.argv[0], run_name='__main__')\n    except SystemExit as e:\n"
            "        print('exit', e.code)\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    p = subprocess.run([sys.executable, "-c", code, *data], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="2"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith("exit 0\nNO TORCH"), p.stdout[-500:]
    assert "--num-layers N " in p.stdout and "--lr LR " in p.stdout and "--save SAVE " in p.stdout
    assert "MODEL." not in p.stdout and "MEGATRON." not in p.stdout and "TRAINING." not in p.stdout
    assert "arguments valid for 2 rank(s)" in p.stdout and "vocab_size=800" in p.stdout, p.stdout[-500:]


def _tool(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))


def test_preprocess_data_shows_share_and_eta(tmp_path, capsys):
    tool = _tool("preprocess_data")
    assert tool.progress_line(10, 500, 12 * 2**20, 30 * 2**20, 6.0) == (
        "[preprocess_data] 10 documents, 500 tokens, 12.0 of 30.0 MB (40%), 2.00 MB/s, ETA 0:09")
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{i} {i + 1} {i + 2}"}}\n' for i in range(2000)))
    tool.preprocess([str(tmp_path / "docs.jsonl")], dict(tokenizer_type="NullTokenizer", vocab_size=3000),
                    str(tmp_path / "d"), log_interval=1000)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " documents, " in ln]
    assert lines and all("%)" in ln and ", ETA " in ln for ln in lines) and "(100%)" in lines[-1]


def test_train_tokenizer_says_what_it_does_while_sentencepiece_learns(capsys):
    import time

    progress = _tool("train_tokenizer")._Progress(100, enabled=True, tick=0.01)
    with progress:
        progress.reading_done(3, 1000, "bpe")
        deadline = time.monotonic() + 30  # the thread speaks every 0.01 s; 30 s only bounds a stalled machine
        seen = ""
        while "still learning" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().err
    assert "learning 1000 bpe pieces from 3 sentences (sentencepiece;" in seen
    assert "[train_tokenizer] still learning 1000 bpe pieces from 3 sentences: " in seen


def test_timeline_and_layout_pictures_name_their_units(capsys):
    import argparse

    plot = _tool("plot_schedule")
    args = plot.parse_args(["--schedule", "1f1b", "--stages", "2", "--microbatches", "4"])
    timelines = plot.build_timelines(args)
    assert plot.time_unit(args) == "cost units, F = 1"
    assert plot.time_unit(argparse.Namespace(trace="t.json")) == "s"  # a measured trace: seconds
    assert plot.format_table(timelines, "s").splitlines()[0].startswith("schedule  makespan (s)  bubble")
    from megareshard.pipeline.draw import title as panel_title

    title = panel_title(timelines[0], "s", 30)
    assert "makespan" in title and " s," in title and all(len(line) <= 30 for line in title.splitlines())
    plan = _tool("plan_layout")
    helptext = " ".join(plan.build_parser().format_help().split())
    for default in ("(default: 80, an H100)", "(default: 989, an H100 SXM)", "(default: 400)"):
        assert default in helptext
    assert plan.main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
                      "--vocab-size", "100", "--global-batch-size", "4", "--hosts", "1", "--devices-per-host", "2",
                      "--micro-batch-sizes", "1", "--zero-stages", "0", "--no-recompute", "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith(
        "cluster (the flags' defaults, an H100 cluster: give yours or --cluster FILE): 1 hosts × 2 devices; per "
        "device 80 GiB, 989 TFLOP/s peak (45% of it achieved in GEMMs), intra-host links 3600 Gbit/s; NIC 400 Gbit/s")
