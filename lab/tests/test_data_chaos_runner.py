"""lab/chaos/chaos.py end to end on one cheap data fault: a real 2-process torchrun job, the table, the JSON.
(Each data fault's trial is lab/chaos/chaos_data.py's; a zero blend weight's refusal is
tests/reliability/test_data_validation.py's.)"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import ROOT, module_command  # noqa: F401


@pytest.mark.slow
def test_chaos_runner_table_and_json(tmp_path):
    out = tmp_path / "chaos.json"
    p = subprocess.run([*module_command("lab.chaos.chaos"), "--quick", "--trials", "1", "--only",
                        "token-beyond-vocab", "--json", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("| fault") and "detected" in lines[0] and "data lost" in lines[0], p.stdout
    assert len(lines) == 3, p.stdout                      # header, rule, one row per fault
    assert "[chaos] 1/1 token-beyond-vocab: trial 1/1 detected" in p.stderr  # progress lines
    data = json.loads(out.read_text())
    rows = {r["fault"]: r for r in data["rows"]}
    assert set(rows) == {"token-beyond-vocab"}
    for name, row in rows.items():
        assert row["trials"] == 1 and row["detected"] == 1 and row["steps_lost"] == 0, row
        assert row["detect_s"] is not None and row["detect_s"] > 0, row
        trial = data["trials"][name][0]
        assert set(trial) == {"fault", "detected", "how", "detect_s", "recovered", "steps_lost", "data_lost"}
    assert "token id 64 at byte offset" in rows["token-beyond-vocab"]["how"]
    assert not list(tmp_path.glob("chaos-*"))            # temp dirs removed
