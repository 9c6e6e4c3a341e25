"""GB/s against hidden size for one benchmark report (the dict bench/run.py writes as json),
the fraction of the copy per case of a report of named cases (bench/nd.py's), or two
bench/variants.py runs side by side (before and after a change).

Usage: python3 bench/plot.py REPORT.json [OUT.png]   (default: the json's name with .png)
       python3 bench/plot.py --compare BEFORE.json AFTER.json OUT.png
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

STYLE = {  # implementation -> (label, matplotlib format)
    "fuser": ("fuser", "o-"),
    "fuser_tuned": ("fuser (tuned)", "o:"),
    "compile": ("torch.compile", "s-"),
    "eager": ("PyTorch eager", "^-"),
    "liger": ("Liger-Kernel", "d-"),
    "copy": ("device copy (ceiling)", "k--"),
}


def series(report: dict, impl: str) -> tuple[list[int], list[float]]:
    """(hidden sizes, GB/s) of the sizes where `impl` has a measurement."""
    xs, ys = [], []
    for entry in report["results"]:
        gbps = entry.get("impls", {}).get(impl, {}).get("gbps")
        if gbps is not None:
            xs.append(entry["hidden"])
            ys.append(gbps)
    return xs, ys


def title(report: dict) -> str:
    return (f"{report['fusion']}  {report['dtype']}  rows={report['rows']}\n"
            f"{report.get('device', '?')}  ({report['date'][:10]})")


def plot_report(report: dict, path) -> Path:
    """Write the GB/s-vs-hidden plot of `report` to `path` (png, Agg backend)."""
    with _figure(figsize=(8, 5)) as (fig, axes):
        ax = axes[0][0]
        hidden = [e["hidden"] for e in report["results"]]
        for impl, (label, fmt) in STYLE.items():
            xs, ys = series(report, impl)
            if xs:
                ax.plot(xs, ys, fmt, label=label)
        ax.set_xscale("log", base=2)
        if hidden:
            ax.set_xticks(hidden)
            ax.set_xticklabels([str(h) for h in hidden])
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("hidden size")
        ax.set_ylabel("GB/s (minimal bytes / median time)")
        ax.set_title(title(report), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=9)
        return _save(fig, path)


def plot_cases(report: dict, path) -> Path:
    """Write one group of bars per case of a report of named cases (bench/nd.py's: each
    result a `case` and its `shape`), a bar per implementation measured, as the fraction of
    a device copy of the same bytes (the dashed line at 1)."""
    cases = [e for e in report["results"] if "impls" in e]
    impls = [i for i in STYLE if i != "copy"
             and any(e["impls"].get(i, {}).get("fraction_of_copy") for e in cases)]
    with _figure(figsize=(max(6.0, 1.6 * len(cases) + 2), 5)) as (fig, axes):
        ax = axes[0][0]
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            xs = [c + (k - (len(impls) - 1) / 2) * width for c in range(len(cases))]
            ys = [e["impls"].get(impl, {}).get("fraction_of_copy") or 0.0 for e in cases]
            ax.bar(xs, ys, width, label=STYLE[impl][0])
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label=STYLE["copy"][0])
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{e['case']}\n{e['shape']}" for e in cases], fontsize=8)
        ax.set_ylabel("fraction of a device copy of the same bytes")
        ax.set_title(f"N-D fusions  {report['dtype']}\n{report.get('device', '?')}  "
                     f"({report['date'][:10]})", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="best", fontsize=9)
        return _save(fig, path)


@contextlib.contextmanager
def _figure(rows: int = 1, columns: int = 1, figsize=(8, 5)):
    """A matplotlib figure and its axes (rows x columns, always 2-D) on the Agg backend,
    closed when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, columns, figsize=figsize, squeeze=False)
    try:
        yield fig, axes
    finally:
        plt.close(fig)


def _save(fig, path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def fractions(variants_report: dict) -> dict[str, tuple[list[int], list[float]]]:
    """fusion -> (hidden sizes, fraction of the copy) of a bench/variants.py json's defaults,
    in order of hidden size (cases may come in any order)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for r in variants_report["records"]:
        if r["variant"] == "default" and "fraction_of_copy" in r:
            points.setdefault(r["fusion"], []).append((r["hidden"], r["fraction_of_copy"]))
    return {name: ([h for h, _ in sorted(xy)], [f for _, f in sorted(xy)])
            for name, xy in points.items()}


def plot_comparison(before: dict, after: dict, path) -> Path:
    """One panel per fusion: the fraction of the copy before and after, against hidden."""
    old, new = fractions(before), fractions(after)
    names = list(new)
    with _figure(2, (len(names) + 1) // 2, figsize=(13, 7)) as (fig, axes):
        for ax, name in zip(axes.flat, names, strict=False):
            for (xs, ys), label, fmt in ((old.get(name, ([], [])), "before", "s--"),
                                         (new[name], "after", "o-")):
                ax.plot(xs, ys, fmt, label=label)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.15)
            ax.set_title(name, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("hidden size")
            ax.set_ylabel("fraction of a device copy")
            ax.legend(loc="lower left", fontsize=8)
        fig.suptitle(f"{before.get('tree', 'before')} -> {after.get('tree', 'after')}, "
                     f"{after.get('dtype', '')}", fontsize=10)
        return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "--compare" and len(argv) == 4:
        before, after = (json.loads(Path(a).read_text()) for a in argv[1:3])
        print(plot_comparison(before, after, argv[3]))
        return 0
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    report = json.loads(src.read_text())
    cases = any("case" in e for e in report["results"])
    print((plot_cases if cases else plot_report)(report, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
