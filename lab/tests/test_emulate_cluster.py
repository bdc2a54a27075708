"""The emulated cluster (lab/cluster/emulate_cluster.py): its recipe, its arguments, and a failing 2-host job that
reports the worst exit code and leaves nothing behind. A job that runs across hosts (a 2-host training run whose
collectives cross the namespaces, ranks in both hosts' namespaces, none left behind) is
lab/tests/test_emulated_cluster_example.py's.

Needs root and working `ip netns` (CI has both); otherwise the namespace test is skipped
with the exact reason. The dry run needs neither.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import ROOT, module_command  # noqa: F401

TOOL = module_command("lab.cluster.emulate_cluster")


def _netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): creating network namespaces needs root"
    name = f"mrprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` fails here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespaces_of(prefix: str) -> list[str]:
    """One cluster's namespaces (mr12 must not claim mr123's: the other xdist worker builds clusters too)."""
    return [ns for ns in _namespaces() if re.fullmatch(rf"{re.escape(prefix)}(sw|h\d+)", ns)]


def test_dry_run_prints_recipe() -> None:
    res = subprocess.run([*TOOL, "--hosts", "3", "--procs-per-host", "2", "--nic-rate",
                          "200mbit", "--prefix", "mrdry", "--dry-run", "--", "job.py", "--flag"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "ip netns add mrdryh2" in out and "ip netns del mrdrysw" in out
    assert out.count("tbf rate 200mbit") == 6  # both directions of 3 NICs
    assert "--node-rank 2 --master-addr 10.77.0.1" in out and "job.py --flag" in out
    assert "torch.distributed.run" in out


def test_missing_separator_is_an_error() -> None:
    res = subprocess.run([*TOOL, "--hosts", "2", "--procs-per-host", "1"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "--" in (res.stderr + res.stdout)


@pytest.mark.netns
@pytest.mark.slow
def test_failing_job_reports_worst_exit_code_and_tears_down(tmp_path: Path) -> None:
    why = _netns_unavailable()
    if why:
        pytest.skip(f"emulated cluster unavailable: {why}")
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    proc = subprocess.Popen([*TOOL, "--hosts", "2", "--procs-per-host", "1",
                             "--master-port", "29518", "--timeout", "60", "--", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))
    out, _ = proc.communicate(timeout=90)
    assert not _namespaces_of(f"mr{proc.pid}")
    assert proc.returncode != 0, out
