"""Rewrite tests/durations.json (the order the suite runs its files in, costliest first: tests/conftest.py) from
the CPU census of a serial run, each test's CPU-seconds (the whole machine's: its ranks and tools count too):

    MEGARESHARD_TEST_CPU=cpu.jsonl CI=true bash tests/run.sh -n 0; python tests/update_durations.py cpu.jsonl
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/update_durations.py CPU.jsonl", file=sys.stderr)
        return 2
    per: collections.Counter[str] = collections.Counter()
    try:
        for line in Path(argv[0]).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                per[row["id"].split("::", 1)[0]] += float(row["cpu"])
    except (OSError, ValueError, KeyError) as e:
        print(f"{argv[0]}: not a CPU census ({e}); run the suite with MEGARESHARD_TEST_CPU=FILE -n 0", file=sys.stderr)
        return 2
    if not per:
        print(f"{argv[0]}: no tests recorded (run the suite with MEGARESHARD_TEST_CPU=FILE -n 0)", file=sys.stderr)
        return 2
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in per.most_common()}, indent=0) + "\n")
    print(f"{out}: {len(per)} files, {sum(per.values()):.0f} CPU-seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
