"""Start-up costs of fuser, each in a fresh process: `import fuser`, a fusion's first call
with an empty kernel cache (schedule, render, NVRTC, load, launch), and its first call with
that cache on disk (what every later process of a job pays).

    PYTHONPATH=. python3 bench/startup.py [--fusion rmsnorm_bwd] [--hidden 1024] [--rows 16]
        [--kind torch|cupy] [--warm-runs 3] [--profile 40]

FUSER_CACHE_DIR is a new temporary folder: the first process fills it (cold), the next
`--warm-runs` hit it (warm). An untimed process first writes every module's bytecode (as an
installed package has it), into a temporary PYTHONPYCACHEPREFIX all of them share. A first
call is timed from its inputs on the device (CUDA already started, torch or CuPy imported)
to the synchronized result. bench/run.py records the same under `startup` in its json.
Prints one json object; with --profile N, one more warm process runs its first call under
cProfile and its N costliest calls (cumulative) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: prints {"import_ms", "first_call_ms", "cache"} as one json line.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import fuser
t1 = time.perf_counter()
import numpy as np
from fuser import DataType
from fuser.cache import default_cache
from fuser.fusions import FUSIONS, make_inputs
name, kind, dtype = sys.argv[1], sys.argv[4], sys.argv[5]
hidden, rows = int(sys.argv[2]), int(sys.argv[3])
fd = FUSIONS[name](getattr(DataType, dtype))
host = make_inputs(name, rows, hidden, getattr(DataType, dtype), np.random.default_rng(0))
if kind == "torch":
    import torch
    inputs = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
              if a.dtype.name == "bfloat16" else torch.from_numpy(a).cuda() for a in host]
    sync = torch.cuda.synchronize
else:
    import cupy
    inputs = [cupy.asarray(a) for a in host]
    sync = cupy.cuda.Device().synchronize
sync()
profile = None
if len(sys.argv) > 6:
    import cProfile, io, pstats
    profile = cProfile.Profile()
    profile.enable()
t2 = time.perf_counter()
fd.execute(inputs)
sync()
t3 = time.perf_counter()
record = {"import_ms": (t1 - t0) * 1e3, "first_call_ms": (t3 - t2) * 1e3,
          "cache": default_cache().stats()}
if profile is not None:
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(int(sys.argv[6]))
    record["profile"] = text.getvalue()
print(json.dumps(record))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/startup.py", description=__doc__.split("\n")[0])
    p.add_argument("--fusion", default="rmsnorm_bwd")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--dtype", default="BFloat16", help="a DataType name (default %(default)s)")
    p.add_argument("--kind", choices=("torch", "cupy"), default="torch")
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N costliest calls of a profiled warm first call")
    args = p.parse_args(argv)
    if min(args.hidden, args.rows, args.warm_runs) < 1:
        p.error("--hidden, --rows and --warm-runs must be positive")
    if args.profile < 0:
        p.error(f"--profile takes a count of calls to print, not {args.profile}")
    return args


def child_run(cache_dir: str, fusion: str, hidden: int, rows: int, kind: str,
              dtype: str, pycache: str, profile: int = 0) -> dict:
    """One fresh process's measurement (CHILD's json). Its modules' bytecode is kept under
    `pycache` (PYTHONPYCACHEPREFIX), whatever PYTHONDONTWRITEBYTECODE says: an installed
    package has its .pyc files, and compiling fuser's and Jinja's sources again in every
    process (as on a machine that writes none) cost 0.19 to 0.25 s of a first call."""
    env = {**os.environ, "FUSER_CACHE_DIR": cache_dir, "PYTHONPYCACHEPREFIX": pycache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    argv = [sys.executable, "-c", CHILD, fusion, str(hidden), str(rows), kind, dtype]
    done = subprocess.run(argv + ([str(profile)] if profile else []), env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the start-up probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(cold: dict, warm: list[dict]) -> dict:
    """The record: import time (median over the warm processes), the cold first call (s),
    the warm first call (ms, median) and what the caches did in each."""
    return {
        "import_ms": round(statistics.median(r["import_ms"] for r in warm), 1),
        "cold_first_call_s": round(cold["first_call_ms"] / 1e3, 3),
        "cold_compiles": cold["cache"]["compiles"],
        "warm_first_call_ms": round(statistics.median(r["first_call_ms"] for r in warm), 1),
        "warm_disk_hits": [r["cache"]["disk_hits"] for r in warm],
        "warm_plan_hits": [r["cache"].get("plan_hits", 0) for r in warm],
    }


def measure(fusion: str, hidden: int, rows: int = 16, kind: str = "torch",
            dtype: str = "BFloat16", warm_runs: int = 3, profile: int = 0) -> dict:
    """summarize() of one cold process and `warm_runs` warm ones, in a new cache folder,
    after an untimed process (its own kernel cache) has written every module's bytecode;
    with `profile`, the text of one more, profiled, warm process under "profile"."""
    with (tempfile.TemporaryDirectory(prefix="fuser-startup-") as cache_dir,
          tempfile.TemporaryDirectory(prefix="fuser-startup-prime-") as prime_dir,
          tempfile.TemporaryDirectory(prefix="fuser-startup-pyc-") as pycache):
        child_run(prime_dir, fusion, hidden, rows, kind, dtype, pycache)
        cold = child_run(cache_dir, fusion, hidden, rows, kind, dtype, pycache)
        warm = [child_run(cache_dir, fusion, hidden, rows, kind, dtype, pycache)
                for _ in range(warm_runs)]
        profiled = (child_run(cache_dir, fusion, hidden, rows, kind, dtype, pycache, profile)
                    if profile else {})
    record = summarize(cold, warm)
    if profiled:
        record["profile"] = profiled["profile"]
    record.update(fusion=fusion, hidden=hidden, rows=rows, kind=kind, dtype=dtype)
    return record


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    record = measure(a.fusion, a.hidden, a.rows, a.kind, a.dtype, a.warm_runs, a.profile)
    if "profile" in record:
        print(record.pop("profile"), file=sys.stderr)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
