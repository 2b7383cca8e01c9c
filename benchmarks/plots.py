"""``python -m benchmarks.plots RESULTS OUTDIR``: PNG plots of a benchmark run.

RESULTS is the runner's JSON object: a ``.json`` file, or the runner's whole output
(its last line is the JSON). Writes into OUTDIR:

- ``throughput.png``: every rate (ev/s of the relay, msg/s of the raw ceilings) as a
  bar, on a log scale (the redis-py pipeline is 100 times the slowest ceiling);
- ``latency.png``: each latency scenario's percentiles (``<scenario>_p<N>_ms``) as
  bars, on a log scale (a saturated scenario is a hundred times the others), with the
  goal of a percentile that has one drawn over its bar.

Needs matplotlib (the ``dev`` extra); without it, a one-line error says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .report import GOALS, ROWS

RATE_UNITS = {"ev/s": "#2e7d32", "msg/s": "#5b6770"}  # the relay green, the ceilings grey
PERCENTILE = re.compile(r"(?P<scenario>.+)_p(?P<n>\d+)_ms")
LABELS = {name: label.strip() for name, label, _ in ROWS}


def load(path: Path) -> dict[str, Any]:
    """The figures of ``path``: a JSON object, or an output whose last line is one."""
    text = path.read_text(encoding="utf-8")
    try:
        figures = json.loads(text)
    except ValueError:
        figures = json.loads(text.strip().splitlines()[-1])
    if not isinstance(figures, dict):
        raise ValueError(f"{path}: not a JSON object of figures")
    return figures


def rates(figures: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, value, colour) of each rate in ``figures``, in the table's order."""
    return [
        (LABELS[name], float(figures[name]), RATE_UNITS[unit])
        for name, _, unit in ROWS
        if unit in RATE_UNITS and name in figures
    ]


def percentiles(figures: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """scenario -> [(percentile, milliseconds)], lowest percentile first."""
    found: dict[str, list[tuple[int, float]]] = {}
    for name, value in figures.items():
        if match := PERCENTILE.fullmatch(name):
            found.setdefault(match["scenario"], []).append((int(match["n"]), float(value)))
    return {scenario: sorted(points) for scenario, points in found.items()}


def plot_throughput(figures: dict[str, Any], out: Path, pyplot: Any) -> Path:
    bars = rates(figures)
    figure, axes = pyplot.subplots(figsize=(9, 0.35 * len(bars) + 1.4))
    labels, values, colours = zip(*bars, strict=True) if bars else ((), (), ())
    axes.barh(range(len(bars)), values, color=colours)
    axes.set_yticks(range(len(bars)), labels)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("events or messages per second (log scale)")
    for row, value in enumerate(values):
        axes.annotate(f" {value:,.0f}", (value, row), va="center", fontsize=8)
    axes.set_title(f"Throughput ({_run(figures)}); green: the relay, grey: raw ceilings")
    return _save(figure, out / "throughput.png", pyplot)


def plot_latency(figures: dict[str, Any], out: Path, pyplot: Any) -> Path:
    groups = percentiles(figures)
    figure, axes = pyplot.subplots(figsize=(7.5, 3.8))
    positions = []
    for offset, (scenario, points) in enumerate(groups.items()):
        for index, (n, ms) in enumerate(points):
            x = offset * (len(points) + 1) + index
            positions.append((x, f"{scenario}\np{n}"))
            axes.bar(x, ms, color="#1f6fb2")
            axes.annotate(f"{ms:.2f} ms", (x, ms), ha="center", va="bottom", fontsize=8)
            if goal := GOALS.get(f"{scenario}_p{n}_ms"):
                axes.hlines(goal[1], x - 0.4, x + 0.4, colors="#b3261e", linestyles="dashed")
    axes.set_xticks([x for x, _ in positions], [label for _, label in positions], fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("milliseconds (log scale)")
    axes.set_title(f"Latency percentiles ({_run(figures)}); dashed: the goal", fontsize=10)
    return _save(figure, out / "latency.png", pyplot)


def _run(figures: dict[str, Any]) -> str:
    return f"profile {figures.get('profile', '?')}, {figures.get('cpus', '?')} CPUs"


def _save(figure: Any, path: Path, pyplot: Any) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plots", description="PNG plots of a benchmark run's JSON."
    )
    parser.add_argument("results", type=Path, help="the JSON, or the runner's output")
    parser.add_argument("outdir", type=Path, help="where the PNG files go (created)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        print("benchmarks.plots: matplotlib is missing: pip install matplotlib", file=sys.stderr)
        return 2
    figures = load(args.results)
    args.outdir.mkdir(parents=True, exist_ok=True)
    for path in (
        plot_throughput(figures, args.outdir, pyplot),
        plot_latency(figures, args.outdir, pyplot),
    ):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
