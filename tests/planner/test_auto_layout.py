"""--auto-layout: the trainers take their layout from the planner, start and train."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megareshard.arguments import ConfigError, parse_args
from tests.harness import run_pretrain

MODEL = ["--mock-data", "--vocab-size", "256", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads",
         "4", "--seq-length", "32", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
         "--lr-warmup-iters", "1"]
# a CPU "cluster": 2 hosts x 2 processes, slow devices and a slow network, memory as given
CLUSTER = ["--auto-layout", "--nproc-per-node", "2", "--auto-layout-device-tflops", "0.05",
           "--auto-layout-nic-gbps", "1", "--auto-layout-device-memory-gib", "4"]


def test_flags_come_from_the_planner_and_hand_degrees_are_refused() -> None:
    cfg = parse_args(MODEL + CLUSTER, world_size=4)
    note = cfg.plan.auto_layout
    assert note.startswith("auto layout: tp") and "same as: --tensor-model-parallel-size" in note
    flags = note.split("same as: ")[1].split()
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(cfg.tp)
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == str(cfg.pp)
    assert cfg.tp * cfg.pp * cfg.plan.dp == 4 and 8 % (cfg.training.micro_batch_size * cfg.plan.dp) == 0
    with pytest.raises(ConfigError, match="--auto-layout chooses the layout itself; drop --tensor-model-parallel-size"):
        parse_args(MODEL + CLUSTER + ["--tensor-model-parallel-size", "2"], world_size=4)
    with pytest.raises(ConfigError, match="--auto-layout: no layout fits"):
        parse_args(MODEL + CLUSTER + ["--auto-layout-device-memory-gib", "0.0001"], world_size=4)


@pytest.mark.slow
def test_auto_layout_starts_and_trains(tmp_path) -> None:
    """pretrain_gpt.py on 4 forked ranks (torchrun's own start is tests/test_pretrain_gpt.py's)."""
    argv = [*[a for a in MODEL if a not in ("--train-iters", "20")], *CLUSTER,
            "--train-iters", "4", "--log-interval", "1",  # (a command line refuses a flag given twice)
            "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu"]
    log = str(tmp_path / "rank{}.log")
    assert run_pretrain(argv, 4, log, timeout=300, env={"WANDB_MODE": "disabled"}) == [0] * 4
    out = "".join(Path(log.format(r)).read_text() for r in range(4))
    m = re.search(r"auto layout: tp(\d+) pp(\d+) dp(\d+)", out)
    assert m and int(m[1]) * int(m[2]) * int(m[3]) == 4, out
    assert f"tp {m[1]} × dp {m[3]} × pp {m[2]}" in out, out
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.]+)", out)]
    assert len(losses) == 4, out
