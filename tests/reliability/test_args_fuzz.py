"""Property-based test of pretrain_gpt.py's flags (hypothesis): every drawn combination either passes
validation and starts — the pure start-up work for world sizes 1..4 (topology, stage layouts, pipeline
checks and schedule) and, for world size 1, the real Trainer (model, optimizer, data) — or ends in one
clear ConfigError (one line). Never another exception, never a hang (each example has a deadline).

Deterministic in CI (``derandomize=True``); ``MEGARESHARD_FUZZ_EXAMPLES=N`` draws N random examples instead
(a longer local run, new draws each time; hypothesis prints the seed of a failure to reproduce it).
"""
import io
import os
import signal
import warnings
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megareshard.arguments import ConfigError, parse_args
from megareshard.pipeline.schedules import schedule_names

EXAMPLES = int(os.environ.get("MEGARESHARD_FUZZ_EXAMPLES", "100"))
LONG_RUN = "MEGARESHARD_FUZZ_EXAMPLES" in os.environ


def _opt(flag, values):
    """Absent, or ``flag`` with one of ``values`` (None: a switch)."""
    return st.one_of(st.just([]), st.sampled_from(values).map(lambda v: [flag] if v is None else [flag, str(v)]))


FLAGS = [
    _opt("--num-layers", [1, 2, 3, 4, 0, -1]),
    _opt("--hidden-size", [16, 24, 32, 48, 0, 30]),
    _opt("--num-attention-heads", [1, 2, 3, 4, 8, 0]),
    _opt("--ffn-hidden-size", [32, 64, 0]),
    _opt("--seq-length", [8, 16, 32, 0]),
    _opt("--max-position-embeddings", [8, 16, 64, 0]),
    _opt("--vocab-size", [50, 64, 100, 0, -3]),
    _opt("--make-vocab-size-divisible-by", [1, 8, 128, 0]),
    _opt("--tensor-model-parallel-size", [1, 2, 3, 4, 0]),
    _opt("--pipeline-model-parallel-size", [1, 2, 3, 4, 0]),
    _opt("--sequence-parallel", [None]),
    _opt("--stage-layouts", ["tp1dp2,tp2dp1", "tp1dp1,tp1dp1", "tp2dp1", "tp1dp1,tp1dp3", "tp3", "x"]),
    _opt("--rank-order", ["tp-dp-pp", "dp-tp-pp", "tp-tp-pp", "zz"]),
    _opt("--nproc-per-node", [1, 2, 3, 0]),
    _opt("--micro-batch-size", [1, 2, 3, 0]),
    _opt("--global-batch-size", [1, 2, 4, 6, 8, 16, 0]),
    _opt("--train-iters", [1, 3, 0]),
    _opt("--train-samples", [4, 16, 0]),
    _opt("--pipeline-schedule", list(schedule_names())),
    _opt("--pipeline-schedule-file", ["/nonexistent/schedule.txt"]),
    _opt("--pipeline-recv-posting", ["auto", "early", "grouped", "mixed"]),
    _opt("--delay-wgrad-compute", [None]),
    _opt("--num-layers-per-stage", ["1,1", "2,1", "1,2,1", "a", "0,2"]),
    _opt("--reshard-strategy", ["sendrecv", "allgather", "broadcast"]),
    _opt("--reshard-scheduler", ["naive", "loadbalance", "dfs", "greedy", "auto"]),
    _opt("--reshard-chunks", [1, 2, 0]),
    _opt("--bf16", [None]),
    _opt("--fp16", [None]),
    _opt("--loss-scale", [1024.0, 0.0, -1.0]),
    _opt("--initial-loss-scale", [1024.0, 0.0]),
    _opt("--min-loss-scale", [1.0, 0.0]),
    _opt("--loss-scale-window", [10, 0]),
    _opt("--hysteresis", [1, 0]),
    _opt("--zero-stage", [0, 1, 2]),
    _opt("--use-distributed-optimizer", [None]),
    _opt("--overlap-grad-reduce", [None]),
    _opt("--recompute-activations", [None]),
    _opt("--recompute-granularity", ["full", "selective"]),
    _opt("--recompute-num-layers", [1, 2, 0]),
    _opt("--checkpoint-activations", [None]),
    _opt("--lr", [1e-3, 0.0, -1.0]),
    _opt("--min-lr", [0.0, 1e-4, 1.0]),
    _opt("--lr-decay-style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"]),
    _opt("--lr-warmup-iters", [0, 1, 10]),
    _opt("--lr-warmup-samples", [0, 8]),
    _opt("--lr-warmup-fraction", [0.1, 2.0]),
    _opt("--lr-decay-iters", [2, 0]),
    _opt("--lr-wsd-decay-iters", [1, 5]),
    _opt("--decoupled-lr", [1e-3, 0.0]),
    _opt("--clip-grad", [0.0, 1.0, -1.0]),
    _opt("--hidden-dropout", [0.0, 0.1, 1.0]),
    _opt("--normalization", ["LayerNorm", "RMSNorm"]),
    _opt("--position-embedding-type", ["learned_absolute", "rope"]),
    _opt("--swiglu", [None]),
    _opt("--group-query-attention", [None]),
    _opt("--num-query-groups", [1, 2, 3]),
    _opt("--kv-channels", [4, 8, 0]),
    _opt("--untie-embeddings-and-output-weights", [None]),
    _opt("--disable-bias-linear", [None]),
    _opt("--split", ["969,30,1", "1,0,0", "a,b", "0,0,0"]),
    _opt("--eval-interval", [0, 1, 5, -1]),
    _opt("--eval-iters", [0, 1, 2]),
    _opt("--save-interval", [1, 0]),
    _opt("--exit-interval", [2]),
    _opt("--load", ["/nonexistent/ckpt"]),
    _opt("--finetune", [None]),
    _opt("--on-save-failure", ["stop", "continue"]),
    _opt("--no-check-for-nan-in-loss-and-grad", [None]),
    _opt("--no-data-validation", [None]),
    _opt("--distributed-timeout-minutes", [1.0, 0.0]),
    _opt("--comm-timeout", [30.0, 0.0]),
    _opt("--context-parallel-size", [1, 2]),
    _opt("--use-flash-attn", [None]),
    _opt("--num-experts", [2]),
]
DATA = st.sampled_from([["--mock-data"], [], ["--data-path", "/nonexistent/corpus_text_document"],
                        ["--data-path", "1", "/nonexistent/a", "0", "/nonexistent/b"]])
# small defaults, so that what passes is cheap to build
BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "2", "--device", "cpu"]


def _one_line_config_error(e: ConfigError) -> None:
    text = str(e)
    assert text.strip() and "\n" not in text and "Traceback" not in text, repr(text)


def _start(cfg, world: int) -> None:
    """What a run does at start-up before communicating: the layout, the stage layouts and the schedule of the
    resolved plan for any world size; the whole Trainer (model, optimizer, data) in one process."""
    from megareshard.parallel import StageTopology, Topology, parse_stage_layouts
    from megareshard.pipeline.generators import generate
    from megareshard.pipeline.stage import stage_layouts

    p = cfg.parallel
    if p.stage_layouts:
        topo = StageTopology(world, parse_stage_layouts(p.stage_layouts), nproc_per_node=p.nproc_per_node or world)
    else:
        topo = Topology(world, tp=cfg.tp, pp=cfg.pp, nproc_per_node=p.nproc_per_node or world,
                        order=p.rank_order or "tp-dp-pp")
    if cfg.pp > 1:
        stage_layouts(cfg, topo)
        v = cfg.plan.virtual_stages
        generate(cfg.plan.pipeline.schedule, cfg.pp, cfg.plan.num_microbatches, virtual_stages=v if v > 1 else None)
    if world == 1:
        from megareshard.parallel import ParallelContext
        from megareshard.training import Trainer

        Trainer(cfg, ParallelContext.single_process(), torch.device("cpu"), out=io.StringIO()).close()


@settings(max_examples=EXAMPLES, derandomize=not LONG_RUN, deadline=timedelta(seconds=20), database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(flags=st.lists(st.sampled_from(range(len(FLAGS))), max_size=8, unique=True).flatmap(
           lambda idx: st.tuples(*[FLAGS[i] for i in idx])),
       data=DATA, world=st.integers(1, 4))
def test_random_flags_start_or_fail_with_one_config_error(flags, data, world):
    argv = BASE + data + [tok for f in flags for tok in f]
    previous = signal.signal(signal.SIGALRM, _hang)  # a hang ends the example (hypothesis' deadline only
    signal.alarm(60)                                 # judges examples that finish)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cfg = parse_args(argv, world_size=world)
                _start(cfg, world)
            except ConfigError as e:
                _one_line_config_error(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _hang(signum, frame):
    raise TimeoutError("the example ran for 60 s: a hang")
