"""Write tests/slow_tests.txt, the tests marked ``slow`` (tests/conftest.py), from a pytest ``--durations=0`` report.

    python -m pytest -n 2 -q --durations=0 > durations.txt
    python scripts/slow_tests.py durations.txt [--seconds 4]

A test whose setup, call and teardown together took at least ``--seconds`` is listed (its parametrized cases by
their full node ids); ``pytest -m "not slow"`` then runs the rest, the daily loop.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    seconds: dict[str, float] = defaultdict(float)
    for line in args.report.read_text().splitlines():
        found = LINE.match(line.strip())
        if found:
            seconds[found.group(3)] += float(found.group(1))
    slow = sorted(node for node, s in seconds.items() if s >= args.seconds)
    total, kept = sum(seconds.values()), sum(seconds[n] for n in slow)
    out = Path(__file__).resolve().parents[1] / "tests" / "slow_tests.txt"
    header = f"# {len(slow)} tests of >= {args.seconds:g} s: {kept:.0f} of the suite's {total:.0f} test-seconds (scripts/slow_tests.py)\n"
    out.write_text(header + "".join(f"{node}\n" for node in slow))
    print(f"wrote {out}: {len(slow)} slow tests, {kept:.0f} of {total:.0f} s")


if __name__ == "__main__":
    main()
