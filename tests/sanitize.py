"""Run GPU tests under compute-sanitizer, one process per test, several at a time.

    PYTHONPATH=. python3 tests/sanitize.py --tool memcheck -k "seed_case or cluster2" \
        [--jobs 12] [--timeout 480] [--out DIR] [tests/test_gpu_fusions.py]

Each selected test (pytest -k over the files given) runs in its own `compute-sanitizer --tool
TOOL` process, JOBS at a time: a whole suite under one sanitizer process is serial and,
for racecheck of the cluster kernels, longer than a device job may run. Prints one line per
test (exit status and the sanitizer's summary line) and a total; exits 1 if any test failed
or timed out. `make memcheck` / `racecheck` / `synccheck` / `initcheck` call this.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tests/sanitize.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", required=True,
                   choices=("memcheck", "racecheck", "synccheck", "initcheck"))
    p.add_argument("-k", dest="select", default="", help="pytest -k expression")
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--timeout", type=int, default=480, help="seconds per test")
    p.add_argument("--out", type=Path, help="folder for each test's log")
    p.add_argument("files", nargs="*", default=["tests/test_gpu_fusions.py"])
    return p.parse_args(argv)


def collect(files: list[str], select: str) -> list[str]:
    """The ids of the GPU tests `select` picks in `files`."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *files]
    if select:
        command += ["-k", select]
    listing = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in listing.splitlines() if "::" in line]


def run_one(test: str, args: argparse.Namespace) -> tuple[str, str, str]:
    """(status, test, summary) of one test under the sanitizer."""
    command = ["compute-sanitizer", "--error-exitcode", "1", "--report-api-errors", "no",
               "--tool", args.tool, sys.executable, "-m", "pytest", "-m", "gpu", "-q",
               "-p", "no:cacheprovider", test]
    env = {**os.environ, "FUSER_REQUIRE_GPU": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=args.timeout, check=False)
        status, log = str(done.returncode), done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status, log = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.-]", "_", test)[-150:]
        (args.out / f"{args.tool}-{name}.log").write_text(str(log))
    summaries = SUMMARY.findall(str(log))
    return status, test, summaries[-1] if summaries else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tests = collect(args.files, args.select)
    if not tests:
        print(f"sanitize: no GPU test matches -k {args.select!r}", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda t: run_one(t, args), tests))
    for status, test, summary in results:
        print(f"{status:>7} {args.tool} {test} {summary}")
    failed = [r for r in results if r[0] != "0"]
    print(f"sanitize {args.tool}: {len(results)} tests, {len(results) - len(failed)} passed, "
          f"{len(failed)} failed or timed out")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
