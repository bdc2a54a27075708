"""The configurations and flags of lab/bench/bench_pipeline.py: what a run measures and how it is set up.

A configuration (``BenchConfig``) is ``SCHEDULE+STRATEGY[+dw]`` (``parse_config``; ``expand_configs`` adds one
signal run per schedule); ``build_parser`` holds every flag, ``resolve_defaults`` fills the ones whose default
depends on ``--grid`` and ``check_args`` checks them; ``model_argv`` and ``parse_model_config`` turn one
configuration into the trainer's command line and its ``Config`` (and model spec). The constants: the names a
configuration may use, the default and grid configurations, the grid's example rates, and the flags a grid
point hands to its worker (``WORKER_DESTS``). Imports no torch.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from lab.bench import pipeline_grid  # the grid's configurations and target method
from lab.cluster.pacing import needed_kinds, parse_pace  # no torch import

# --help's description: the first line of lab/bench/bench_pipeline.py's docstring
DESCRIPTION = "Pipeline schedules × cross-stage resharding strategies, side by side in one launch (paper §4–§5)."

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b")
STRATEGY_NAMES = ("sendrecv", "allgather", "broadcast", "signal")
MODELS = ("gpt", "utransformer")
DEFAULT_CONFIGS = ("1f1b+sendrecv,1f1b+allgather,1f1b+broadcast,eager-1f1b+broadcast,"
                   "eager-1f1b+broadcast+dw,gpipe+broadcast")
GRID_CONFIGS = f"{pipeline_grid.BASELINE},{pipeline_grid.EXTRA},{pipeline_grid.METHOD}"
# The rates of the previous grid (issue 13), an example for --rates; the grid itself runs the operating points
# of grid_points.GRID_POINTS (chosen with --choose-points before running).
GRID_RATES = "10,20,40,80,160"
# what the grid runs per point unless given: few timed rounds (paced compute repeats to within a few %)
GRID_DEFAULTS = {"iters": 4, "warmup": 2, "microbatches": 8, "pace": "auto"}
RUN_DEFAULTS = {"iters": 10, "warmup": 2, "microbatches": 8, "pace": "none"}
# flags a grid point hands to its worker (the rest are the grid's own, or set per point)
WORKER_DESTS = ("configs", "no_signal", "baseline", "tp", "pp", "num_layers", "hidden_size", "num_attention_heads",
                "seq_length", "micro_batch_size", "microbatches", "vocab_size", "num_layers_per_stage", "u_levels",
                "u_widths", "u_blocks_per_level", "u_shorten_factor", "u_skip_merge", "reshard_scheduler",
                "reshard_chunks", "recv_posting", "iters", "warmup", "pace", "pace_quantile", "pace_margin")


@dataclass(frozen=True)
class BenchConfig:
    schedule: str
    strategy: str
    dw: bool

    @property
    def name(self) -> str:
        return f"{self.schedule}+{self.strategy}{'+dw' if self.dw else ''}"

    @property
    def signal(self) -> "BenchConfig":
        return BenchConfig(self.schedule, "signal", self.dw)

    def flags(self) -> list[str]:
        return (["--pipeline-schedule", self.schedule, "--reshard-strategy", self.strategy]
                + (["--delay-wgrad-compute"] if self.dw else []))


def parse_config(text: str) -> BenchConfig:
    """``SCHEDULE+STRATEGY[+dw]`` (``+delayw``/``+delayed`` accepted for ``+dw``)."""
    parts = text.strip().split("+")
    dw = False
    if parts and parts[-1] in ("dw", "delayw", "delayed"):
        dw, parts = True, parts[:-1]
    if len(parts) != 2 or parts[0] not in SCHEDULE_NAMES or parts[1] not in STRATEGY_NAMES:
        raise ValueError(f"bad configuration {text!r}: write SCHEDULE+STRATEGY[+dw] with SCHEDULE in "
                         f"{'|'.join(SCHEDULE_NAMES)} and STRATEGY in {'|'.join(STRATEGY_NAMES)}, "
                         "e.g. eager-1f1b+broadcast+dw")
    return BenchConfig(parts[0], parts[1], dw)


def expand_configs(text: str, with_signal: bool = True) -> list[BenchConfig]:
    """The listed configurations (duplicates dropped), then one signal run per (schedule, dw) pair."""
    out: list[BenchConfig] = []
    for t in text.split(","):
        if t.strip():
            c = parse_config(t)
            if c not in out:
                out.append(c)
    if not out:
        raise ValueError("--configs is empty")
    if with_signal:
        for c in list(out):
            if c.signal not in out:
                out.append(c.signal)
    return out


# ---- arguments ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=MODELS)
    p.add_argument("--configs", default=None, help="comma list of SCHEDULE+STRATEGY[+dw] (default: "
                   f"{DEFAULT_CONFIGS}; with --grid: {GRID_CONFIGS})")
    p.add_argument("--no-signal", action="store_true", help="do not add the signal upper-bound runs")
    p.add_argument("--baseline", default="1f1b+allgather",
                   help="speedups and gap closure are relative to this configuration (default: the Megatron-style "
                        "baseline, send to one rank per receiving host then all-gather inside it)")
    p.add_argument("--nproc", type=int, default=8, help="ranks when this tool starts torchrun itself")
    p.add_argument("--procs-per-host", type=int, default=None,
                   help="ranks per (emulated) host for placement and the network model; default: "
                        "torchrun's LOCAL_WORLD_SIZE (plain torchrun: all ranks on one host)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size inside a stage")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (per dp rank; "
                   "default 8)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--num-layers-per-stage", default=None,
                   help="comma list (default: even split; utransformer with 5 blocks on 4 stages: 1,1,1,2)")
    u = p.add_argument_group("utransformer", "--model utransformer: the U's shape (--num-layers and "
                                             "--hidden-size are derived from it)")
    u.add_argument("--u-levels", type=int, default=3)
    u.add_argument("--u-widths", default="128,256,512")
    u.add_argument("--u-blocks-per-level", default="1")
    u.add_argument("--u-shorten-factor", type=int, default=2)
    u.add_argument("--u-skip-merge", default="add", choices=("add", "concat"))
    p.add_argument("--reshard-scheduler", default="auto")
    p.add_argument("--recv-posting", default=None, choices=("auto", "early", "grouped", "mixed"),
                   help="--pipeline-recv-posting of every configuration (default: the runtime's, auto)")
    p.add_argument("--reshard-chunks", type=int, default=None,
                   help="broadcast chunks per task (default: the network model's choice per task)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed rounds, one iteration of every config each (default 10; --grid: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2)")
    p.add_argument("--nic-gbps", type=float, default=1.0,
                   help="NIC rate for the network model's per-transfer time (set it to the emulated rate)")
    p.add_argument("--json", default=None, help="write the records (a JSON list) here")
    p.add_argument("--plot", default=None, help="bar chart PNG of ms/iteration per configuration")
    p.add_argument("--trace-dir", default=None, help="write each configuration's measured timeline here")
    p.add_argument("--trace-every-round", action="store_true",
                   help="with --trace-dir: also every timed round's timeline, CONFIG.roundK.json (K from 1), written "
                        "between rounds (a round's spread can then be read off its own timeline)")
    p.add_argument("--compare", default="1f1b+allgather,eager-1f1b+broadcast+dw",
                   help="two (or more) configurations for --compare-plot")
    p.add_argument("--compare-plot", default=None, help="PNG: their timelines (last round) stacked")
    p.add_argument("--simulate", action="store_true", help="no processes: megareshard.pipeline.simulate")
    p.add_argument("--from-json", default=None,
                   help="no run: redraw the table, --plot and --compare-plot (traces from --trace-dir) from records")
    p.add_argument("--costs-from", default=None,
                   help="--simulate: per-action costs from this JSON (action_ms of a measured run)")
    p.add_argument("--cost-f", type=float, default=None, help="--simulate: ms per F (default 10 or measured)")
    p.add_argument("--cost-b", type=float, default=None, help="--simulate: ms per B (default 2×F or measured)")
    p.add_argument("--cost-i", type=float, default=None, help="--simulate: ms per I (default B/2 or measured)")
    p.add_argument("--cost-w", type=float, default=None, help="--simulate: ms per W (default B−I or measured)")
    p.add_argument("--hosts", type=int, default=None, help="--simulate: hosts (default pp: one stage per host)")
    p.add_argument("--timeout", type=float, default=900.0, help="plain torchrun launch: kill after this long")
    p.add_argument("--pace", default=None,
                   help="emulate a dedicated device per rank: every F/B/I/W takes at least a fixed wall time "
                        "(a faster one sleeps the rest). 'none' (default); 'auto': after the warm-up rounds, "
                        "per stage and kind, --pace-quantile of the warm-up durations × --pace-margin; or "
                        "'F=60,B=120,I=90,W=30' (ms, every stage; every kind the configurations execute needs one). "
                        "--grid: default 'auto'")
    p.add_argument("--pace-quantile", type=float, default=0.9, help="--pace auto: quantile of warm-up durations")
    p.add_argument("--pace-margin", type=float, default=1.25, help="--pace auto: budget = quantile × this")
    g = p.add_argument_group("grid", "--grid: every model at every NIC rate, each point one run on the emulated "
                                     "cluster (lab/cluster/emulate_cluster.py, needs root)")
    g.add_argument("--grid", action="store_true", help="run the NIC-rate grid")
    g.add_argument("--models", default=",".join(MODELS), help="--grid: comma list of models")
    g.add_argument("--rates", default=None, help="--grid: NIC rates in Mbit/s, each direction (comma list): the points "
                   "are these rates at the flags' shape (default: --points)")
    g.add_argument("--points", default=None,
                   help="--grid: operating points RATE[:m=MICROBATCHES][:seq=SEQ_LENGTH], comma list (default: the "
                        "model's grid_points.GRID_POINTS, chosen with --choose-points before running); with "
                        "--choose-points: the candidates (default grid_points.CANDIDATES)")
    g.add_argument("--choose-points", action="store_true",
                   help="no run: the simulator's prediction at every candidate point (baseline and method, their "
                        "physical bounds, the point's wall time), per model of --models")
    g.add_argument("--method", default=pipeline_grid.METHOD, help="--grid: the configuration the target is about")
    g.add_argument("--point-timeout", type=float, default=900.0,
                   help="--grid: stop a point's run after this many seconds (it is reported as stopped)")
    g.add_argument("--dry-run", action="store_true",
                   help="--grid: print each point's command and the simulator's wall-time estimate; run nothing")
    g.add_argument("--estimate-costs", default=None,
                   help="--grid --dry-run: per-action ms for the estimate, 'gpt=FILE,utransformer=FILE' (JSON records "
                        "of a paced run, e.g. a grid point's); default --cost-f/b/i/w or F=10, B=2F")
    g.add_argument("--results-dir", default="docs/results", help="--grid: pipeline_grid_MODEL.json goes here")
    g.add_argument("--img-dir", default="docs/img", help="--grid: pipeline_grid_MODEL.png goes here")
    return p


def resolve_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags whose default depends on --grid (a grid point runs few, paced rounds)."""
    for k, v in (GRID_DEFAULTS if a.grid else RUN_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.configs is None:
        a.configs = GRID_CONFIGS if a.grid else DEFAULT_CONFIGS
    return a


def parse_rates(text: str) -> list[float]:
    """--rates: positive Mbit/s, distinct, kept in the order given (sorted ascending for the picture)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates {text!r}: write Mbit/s numbers separated by commas, e.g. {GRID_RATES}") from None
    if not rates or any(r <= 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rates {text!r}: need at least one rate, every one > 0 and none twice")
    return sorted(rates)


def check_args(a: argparse.Namespace, world: int | None = None) -> list[BenchConfig]:
    resolve_defaults(a)
    configs = expand_configs(a.configs, not a.no_signal)
    base = parse_config(a.baseline)
    if base not in configs:
        raise ValueError(f"--baseline {a.baseline} is not among the configurations "
                         f"({', '.join(c.name for c in configs)})")
    if world is not None and world % (a.tp * a.pp):
        raise ValueError(f"{world} ranks are not divisible by tp {a.tp} × pp {a.pp}")
    if a.iters < 1 or a.warmup < 0 or a.microbatches < 1:
        raise ValueError("--iters must be >= 1, --warmup >= 0, --microbatches >= 1")
    if a.trace_every_round and not a.trace_dir:
        raise ValueError("--trace-every-round writes into --trace-dir: give one")
    parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin,
               needed=needed_kinds(c.dw for c in configs))
    return configs


def model_argv(a: argparse.Namespace, cfg: BenchConfig, world: int) -> list[str]:
    dp = world // (a.tp * a.pp)
    if a.model == "gpt":
        argv = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)]
        per_stage = a.num_layers_per_stage
    else:
        argv = ["--u-levels", str(a.u_levels), "--u-widths", a.u_widths, "--u-blocks-per-level",
                a.u_blocks_per_level, "--u-shorten-factor", str(a.u_shorten_factor), "--u-skip-merge", a.u_skip_merge]
        blocks = len(a.u_blocks_per_level.split(",")) == 1 and 2 * a.u_levels - 1 == 5
        per_stage = a.num_layers_per_stage or ("1,1,1,2" if blocks and a.pp == 4 and a.u_blocks_per_level == "1"
                                               else None)
    if per_stage:
        argv += ["--num-layers-per-stage", per_stage]
    argv += ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * dp * a.microbatches),
            "--train-iters", "1000000", "--lr-warmup-iters", "1", "--device", "cpu", "--log-interval", "1000000",
            "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
            "--reshard-scheduler", a.reshard_scheduler, "--hidden-dropout", "0", "--attention-dropout", "0",
            # every configuration alike: the signal runs' undefined stage inputs may give a NaN loss, which the
            # check would stop on; the benchmark times the step without the check's all-reduce
            "--no-check-for-nan-in-loss-and-grad"]
    if a.reshard_chunks is not None:
        argv += ["--reshard-chunks", str(a.reshard_chunks)]
    if getattr(a, "recv_posting", None):
        argv += ["--pipeline-recv-posting", a.recv_posting]
    if a.procs_per_host:
        argv += ["--nproc-per-node", str(a.procs_per_host)]
    return argv + cfg.flags()


def parse_model_config(a: argparse.Namespace, c: BenchConfig, world: int):
    """(Config, model spec or None for the GPT) of one configuration."""
    if a.model == "gpt":
        from megareshard.arguments import parse_args

        return parse_args(model_argv(a, c, world), world_size=world), None
    from megareshard.arguments import parse_model_args

    return parse_model_args("utransformer", model_argv(a, c, world), world_size=world)


def graph_and_shapes(cfg, spec, layouts, batch: int):
    """The stage graph (chain + skip edges) and every edge's global tensor shape."""
    if spec is None:
        from megareshard.model_spec import get_model_spec

        spec = get_model_spec("gpt")
    return spec.graph(cfg, layouts), spec.edge_shapes(cfg, layouts, batch)
