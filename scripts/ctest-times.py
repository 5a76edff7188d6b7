#!/usr/bin/python3
"""The slowest tests of a ctest run, and the time per test binary (docs/DEVELOPERS.md, "CI time").

  scripts/ctest-times.py build/tsan          # the last ctest run in that build folder
  scripts/ctest-times.py ctest-output.log    # or ctest's printed output, saved
  scripts/ctest-times.py build/tsan -n 60    # how many tests to list (default 30)
"""
import argparse
import collections
import os
import re
import signal
import sys


def from_last_test_log(path):
    """(seconds, name, result) per test from Testing/Temporary/LastTest.log."""
    rows, name = [], None
    for line in open(path, errors="replace"):
        m = re.match(r"\d+/\d+ Testing: (.*)$", line)
        if m:
            name = m.group(1).strip()
            continue
        m = re.match(r"Test time =\s*([\d.]+) sec", line)
        if m and name is not None:
            rows.append((float(m.group(1)), name, ""))
            name = None
    return rows


def from_ctest_output(path):
    """(seconds, name, result) per test from ctest's own output."""
    rx = re.compile(r"Test +#\d+: (.*?) \.{3,}\D*?(Passed|Failed|Skipped|Timeout|Not Run)"
                    r".*?([\d.]+) sec")
    rows = []
    for line in open(path, errors="replace"):
        m = rx.search(line)
        if m:
            rows.append((float(m.group(3)), m.group(1).strip(), m.group(2)))
    return rows


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` is a normal use
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a build folder, or a file with ctest's output")
    parser.add_argument("-n", type=int, default=30, help="tests to list")
    args = parser.parse_args()
    if os.path.isdir(args.source):
        log = os.path.join(args.source, "Testing", "Temporary", "LastTest.log")
        if not os.path.exists(log):
            sys.exit(f"ctest-times: {log} is missing: run ctest in {args.source} first")
        rows = from_last_test_log(log)
    else:
        rows = from_ctest_output(args.source)
    if not rows:
        sys.exit(f"ctest-times: no test times in {args.source} (was its last ctest run a "
                 "listing, ctest -N? it overwrites LastTest.log)")
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} s together")
    for seconds, name, result in rows[:args.n]:
        print(f"{seconds:8.1f}  {result:7} {name[:120]}")
    per_binary = collections.Counter()
    for seconds, name, _ in rows:
        per_binary[re.split(r"[: ]", name, maxsplit=1)[0]] += seconds
    print("\nper test binary:")
    for binary, seconds in per_binary.most_common(args.n):
        print(f"{seconds:8.1f}  {binary}")


if __name__ == "__main__":
    main()
