"""Time two fuser source trees against each other in one job, alternated.

    PYTHONPATH=. python3 bench/ab.py --before /path/to/old/tree [--after .] [--repeat 2] \
        [--out ab.json] -- --case softmax_fwd:16384 --case rmsnorm_fwd:16384 --warm 16

Each repeat runs bench/variants.py (the arguments after `--`) once per tree, each in a
process of its own (a process imports one fuser): before then after, the next repeat after
then before, so a drift of the GPU or of the host over the job falls on both trees alike. A
policy change is measured so: the tree before it against the tree with it, on every case whose
default it changes. Prints, per case and variant, the fraction of the copy before -> after
(the median over the repeats) and flags a tree whose default disagrees with PyTorch's eager
ops; --out writes every run's records and the summary as json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="bench/ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the tree without the change")
    p.add_argument("--after", type=Path, default=ROOT, help="the tree with it (default: this)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each tree (default: 2)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv[:split])
    args.variants_args = argv[split + 1:]
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: give 1 or more")
    if not args.variants_args:
        p.error("give bench/variants.py's arguments after --, e.g. -- --case softmax_fwd:16384")
    return args


def order(repeat: int) -> list[str]:
    """Which tree runs when: before, after, then after, before, and so on."""
    runs: list[str] = []
    for r in range(repeat):
        runs += ["before", "after"] if r % 2 == 0 else ["after", "before"]
    return runs


def summary(runs: list[dict]) -> list[dict]:
    """Per (fusion, hidden, variant), in first-seen order: the median fraction of the copy of
    each tree over its runs, and whether every run of a tree agreed with PyTorch's eager ops
    (runs that refused a variant count for neither)."""
    table: dict[tuple, dict] = {}
    for run in runs:
        for r in run["records"]:
            key = (r["fusion"], r["hidden"], r["variant"])
            row = table.setdefault(key, {"fusion": key[0], "hidden": key[1], "variant": key[2],
                                         "before": [], "after": [],
                                         "correct": {"before": True, "after": True}})
            if "fraction_of_copy" in r:
                row[run["tree"]].append(r["fraction_of_copy"])
            if r.get("correct") is False:
                row["correct"][run["tree"]] = False
    rows = []
    for row in table.values():
        for tree in ("before", "after"):
            row[tree] = statistics.median(row[tree]) if row[tree] else None
        rows.append(row)
    return rows


def line(row: dict) -> str:
    """'softmax_fwd            16384 default     0.91 -> 0.97', with what went wrong."""
    def fraction(v):
        return "  -  " if v is None else f"{v:5.2f}"
    wrong = [t for t in ("before", "after") if not row["correct"][t]]
    flag = f"  WRONG against eager: {', '.join(wrong)}" if wrong else ""
    return (f"{row['fusion']:20s} {row['hidden']:7d} {row['variant']:10s} "
            f"{fraction(row['before'])} -> {fraction(row['after'])}{flag}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, tree in enumerate(order(args.repeat)):
            out = Path(tmp) / f"{k}-{tree}.json"
            cmd = [sys.executable, str(ROOT / "bench" / "variants.py"), "--tree",
                   str(trees[tree]), "--out", str(out), *args.variants_args]
            print(f"[ab] run {k + 1}: {tree} ({trees[tree]})", flush=True)
            subprocess.run(cmd, check=True)
            result = json.loads(out.read_text())
            runs.append({"tree": tree, "path": str(trees[tree]), "source": result["source"],
                         "records": result["records"]})
    rows = summary(runs)
    print(f"\nfraction of the copy, before -> after (median of {args.repeat} run(s) each):")
    for row in rows:
        print(line(row))
    if args.out:
        args.out.write_text(json.dumps({"before": str(args.before), "after": str(args.after),
                                        "variants_args": args.variants_args, "runs": runs,
                                        "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
