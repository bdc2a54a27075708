"""examples/emulated_cluster.sh end to end: a multi-host run in network namespaces, its rank map,
its throughput line, and no namespace left behind (root only)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lab import ROOT, module_command  # noqa: F401


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(_netns_usable() is not None, reason=str(_netns_usable()))
def test_emulated_cluster_example_end_to_end(stdlib_text, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(stdlib_text / "tok.model", data / "tokenizer.model")  # prepare_data.sh finds them and skips
    shutil.copy(stdlib_text / "text.bin", data / "stdlib_text_document.bin")
    shutil.copy(stdlib_text / "text.idx", data / "stdlib_text_document.idx")
    prefix = f"mrex{os.getpid()}"  # the example's own names: tests on the other worker build clusters of their own
    env = dict(os.environ, HOSTS="2", PROCS_PER_HOST="2", TP="2", PP="2", TRAIN_ITERS="3", LAYERS="2",
               HIDDEN="32", DATA_DIR=str(data), RUN_DIR=str(tmp_path / "run"), TIMEOUT="240", WANDB_MODE="disabled",
               LOG_INTERVAL="1", PREFIX=prefix)
    proc = subprocess.run(["bash", str(ROOT / "examples/emulated_cluster.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank map" in out and "r0[pp0 tp0 dp0] r1[pp0 tp1 dp0]" in out  # tp inside a host
    assert "2 hosts × 2 ranks" in out and "tokens/s" in out
    assert f"[{prefix}h0]" in out and f"[{prefix}h1]" in out  # ranks ran in both hosts' namespaces, named as asked
    assert not _namespaces(prefix), "the example left network namespaces behind"
