"""Rewrite tests/durations.json (the order the suite runs its files in, longest first: tests/conftest.py) from
the log of a run with every duration printed:

    CI=true bash tests/run.sh --durations=0 -vv > run.log; python tests/update_durations.py run.log
"""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"\s*([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/update_durations.py RUN.log", file=sys.stderr)
        return 2
    per: collections.Counter[str] = collections.Counter()
    for line in Path(argv[0]).read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            per[m.group(2)] += float(m.group(1))
    if not per:
        print(f"{argv[0]}: no durations (run pytest with --durations=0 -vv)", file=sys.stderr)
        return 2
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in per.most_common()}, indent=0) + "\n")
    print(f"{out}: {len(per)} files, {sum(per.values()):.0f} test-seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
