"""examples/finetune_hf.sh end to end: a local tiny Llama imported, fine-tuned in parallel with the loss falling,
exported, reloaded by transformers, and the same greedy continuation from both. The test runs it on 2 processes,
tp 2 (the example's default is 8, tp 2 · pp 2 · dp 2): each rank's start-up costs the suite seconds on 2 cores, and an
imported Llama's relayouts into pp, dp (and ZeRO) are tested in tests/checkpoint/test_llama_checkpoint.py."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers", reason="the test extra installs transformers (tools/ensure_venv.sh)")


@pytest.mark.slow
def test_finetune_hf_example(tmp_path) -> None:
    env = dict(os.environ, RUN_DIR=str(tmp_path / "run"), TRAIN_ITERS="6", DOCS="60", NPROC="2",
               LAYOUT="--tensor-model-parallel-size 2", TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "examples" / "finetune_hf.sh")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "train it with --load" in out and "--swiglu" in out and "--group-query-attention" in out
    assert "tp 2 × dp 1 × pp 1" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    assert "(LlamaForCausalLM: config.json, model.safetensors)" in out
    assert "greedy continuations identical" in out, out[-3000:]
