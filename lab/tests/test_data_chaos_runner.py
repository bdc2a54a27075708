"""lab/chaos/chaos.py end to end on one cheap data fault: a real 2-process torchrun job, the table, the JSON.
(Each data fault's trial is lab/chaos/chaos_data.py's; a zero blend weight's refusal is
tests/reliability/test_data_validation.py's.) The runner itself runs in the test process (its own interpreter
would cost seconds of imports); the trial's job is real torchrun."""
import json
import tempfile

import pytest

from lab.chaos import chaos
from lab.tests import run_main


@pytest.mark.slow
def test_chaos_runner_table_and_json(tmp_path, capsys, monkeypatch):
    out = tmp_path / "chaos.json"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the trial's work directory goes
    p = run_main(chaos.main, ["--quick", "--trials", "1", "--only", "token-beyond-vocab", "--json", str(out)], capsys)
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
