"""`ako report <sweep dir>`: PNG plots and a Markdown table from a sweep's finished cells.

Per group of cells that differ only in their seed: time to the target accuracy (rank 0's
replica), final accuracy, accuracy at the sweep's time budget, samples/s, bytes per worker
per second, each server's bytes in, and the speed-up over the `bsp` arm (paired by seed), as
mean and standard deviation over the seeds. Plots, as the sweep's axes allow:

- accuracy-vs-time: test accuracy (or the target's metric: loss-vs-time for a language
  model's loss<=X) against (virtual) training seconds, one line per arm;
- time-to-accuracy-vs-workers, bytes-per-worker-vs-workers, accuracy-at-budget-vs-workers
  (named after the target's metric too);
- speedup-vs-straggler: time to target of bsp divided by each arm's, against the straggler axis.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ako.config import ConfigError
from ako.config import Target, parse_target
from ako.metrics import time_to_target, write_atomic
from ako.experiments.grid import Cell, Sweep, load_sweep, safe_name
from ako.experiments.runner import finished_run

DEFAULT_TARGET = 0.85


@dataclass
class Result:
    """One finished cell: its evaluation records and the measures the report uses."""

    cell: Cell
    records: list[dict]
    measures: dict = field(default_factory=dict)


@dataclass
class Group:
    """The cells of one arm at one label per axis, across seeds."""

    arm: str
    labels: tuple[tuple[str, str], ...]  # the axes other than seed
    results: list[Result]

    def values(self, measure: str) -> list[float]:
        """The finite values of `measure` over the seeds (a seed that did not reach it is left out)."""
        return [r.measures[measure] for r in self.results if _finite(r.measures.get(measure))]


def write_report(sweep_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write `report.md`, `cells.csv` and the PNG plots for `sweep_dir` into `out` (default
    `sweep_dir/report`); returns the path of report.md and the names of the cells left out
    because their run's outputs cannot be read (a damaged summary.json or metrics.jsonl),
    which report.md names too. Raises ConfigError when `sweep_dir` is not a
    sweep directory or has no finished cell."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError(f"sweep directory {str(sweep_dir)!r}: no such directory (ako sweep writes one under sweeps/)")
    if not (sweep_dir / "sweep.toml").is_file():
        raise ConfigError(f"sweep directory {str(sweep_dir)!r}: no sweep.toml in it (not written by ako sweep)")
    sweep = load_sweep(sweep_dir / "sweep.toml")
    results, damaged = collect(sweep, sweep_dir)
    if not results:
        raise ConfigError(f"sweep directory {str(sweep_dir)!r}: no finished cell yet (run ako sweep first)")
    out = Path(out) if out is not None else sweep_dir / "report"
    groups = group(sweep, results)
    try:
        out.mkdir(parents=True, exist_ok=True)
        figures = plots(sweep, groups, out)
        write_atomic(out / "cells.csv", _csv(sweep, results))
        write_atomic(out / "report.md", markdown(sweep, groups, figures, len(results), damaged))
    except OSError as e:
        raise ConfigError(f"report directory {str(out)!r}: cannot write there ({e.strerror or e})") from None
    return out / "report.md", damaged


def target_of(sweep: Sweep) -> Target:
    """The target whose time the report measures: [report] target (an accuracy, or a bound on
    any metric such as "loss<=0.3"), else the base's target or target accuracy, else 85%."""
    target = sweep.report.get("target") or sweep.base.get("target") or sweep.base.get("target_accuracy") or DEFAULT_TARGET
    return parse_target(target) if isinstance(target, str) and not _is_number(target) else Target("accuracy", ">=", float(target))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def metric_at(records: list[dict], seconds: float, metric: str = "accuracy") -> float | None:
    """Rank 0's test `metric` at the last evaluation at or before `seconds` of training (None
    before any)."""
    key = f"test_{metric}"
    before = [r for r in records if r["time"] <= seconds + 1e-9 and r.get(key) is not None]
    return before[-1][key] if before else None


def collect(sweep: Sweep, sweep_dir: Path) -> tuple[list[Result], list[str]]:
    """The finished cells with their measures: tta (seconds to the target), accuracy (final),
    budget_accuracy (at [report] budget seconds), samples/s, bytes/s per worker, server bytes
    in/s; and the names of the cells whose run wrote a summary.json that cannot be read with
    its metrics.jsonl (damaged: left out, and run again by the next `ako sweep`)."""
    target, budget = target_of(sweep), sweep.report.get("budget")
    results, damaged = [], []
    for cell in sweep.cells():
        run = finished_run(sweep_dir / "cells" / cell.name, cell)
        if run is None:
            if any((sweep_dir / "cells" / cell.name).glob("*/summary.json")):
                damaged.append(cell.name)
            continue
        _, summary, records = run
        servers = [s["bytes_in_per_second"] for s in summary.get("per_server", [])]
        measures = {
            "tta": time_to_target(records, target),
            "accuracy": summary.get("test_metrics", {}).get(target.metric, summary.get(f"test_{target.metric}")),
            "budget_accuracy": None if budget is None else metric_at(records, budget, target.metric),
            "samples_per_second": summary["samples_per_second"],
            "bytes_per_worker": summary["bytes_sent_per_worker_per_second"],
            "server_bytes_in": round(float(np.mean(servers))) if servers else None,
            "partitions": summary.get("partitions"),
        }
        results.append(Result(cell, records, measures))
    _speedups(sweep, results)
    return results, damaged



def baseline_arm(sweep: Sweep) -> str | None:
    """The arm speed-ups are measured against: the one named bsp, else the first bsp arm."""
    if "bsp" in sweep.arms:
        return "bsp"
    strategy = sweep.base.get("strategy")
    return next((a for a, s in sweep.arms.items() if s.get("strategy", strategy) == "bsp"), None)


def _speedups(sweep: Sweep, results: list[Result]) -> None:
    """speedup = the baseline's time to target / this cell's, for the same labels (seed too)."""
    base = baseline_arm(sweep)
    if base is None:
        return
    tta = {r.cell.labels: r.measures["tta"] for r in results if r.cell.arm == base}
    for r in results:
        mine, theirs = r.measures["tta"], tta.get(r.cell.labels)
        r.measures["speedup"] = theirs / mine if _finite(mine) and _finite(theirs) and mine > 0 else None


def group(sweep: Sweep, results: list[Result]) -> list[Group]:
    """Results grouped by arm and every label but the seed, in the sweep's cell order."""
    groups: dict[tuple, Group] = {}
    for r in results:
        labels = tuple((a, v) for a, v in r.cell.labels if a != "seed")
        key = (labels, r.cell.arm)
        groups.setdefault(key, Group(r.cell.arm, labels, [])).results.append(r)
    order = {arm: i for i, arm in enumerate(sweep.arms)}
    return sorted(groups.values(), key=lambda g: (_label_order(sweep, g.labels), order[g.arm]))


def _label_order(sweep: Sweep, labels: tuple) -> tuple:
    return tuple(list(sweep.axes[a]).index(v) for a, v in labels)


# --- the table ----------------------------------------------------------------------------


def markdown(sweep: Sweep, groups: list[Group], figures: list[Path], finished_cells: int, damaged: list[str]) -> str:
    """report.md: what was run (and the `damaged` cells left out), the table, and the plots."""
    target, budget = target_of(sweep), sweep.report.get("budget")
    seeds = list(sweep.axes.get("seed", {}))
    spread = f"mean ± standard deviation over seeds {', '.join(seeds)}" if len(seeds) > 1 else "one seed"
    lines = [
        f"# Sweep {sweep.name}",
        "",
        f"{finished_cells} of {len(sweep.cells())} cells finished, on the {'simulated' if sweep.runtime == 'simulate' else 'distributed'} "
        f"runtime ({'virtual' if sweep.runtime == 'simulate' else 'training'} seconds). Figures: {spread}. "
        f"Time to {_goal(target)} is of rank 0's replica's test {target.metric}; a seed that did not reach it is left out "
        "of the mean, and (k/n) counts the seeds that did. Speed-up: per seed, the baseline's time to the target "
        "over the arm's, where both reached it. Each cell's run directory is under `cells/<cell>/`; `cells.csv` "
        "has every finished cell.",
        "",
        *(f"Left out: cell `{name}`, whose summary.json or metrics.jsonl cannot be read (`ako sweep` runs it again)."
          for name in damaged),
        *([""] if damaged else []),
        *_table(sweep, groups, target, budget),
        "",
    ]
    lines += [f"![{f.stem}]({f.name})" for f in figures]
    return "\n".join(lines) + "\n"


def _table(sweep: Sweep, groups: list[Group], target: Target, budget: float | None) -> list[str]:
    base = baseline_arm(sweep)
    axes = [a for a in sweep.axes if a != "seed"]
    servers = any(g.values("server_bytes_in") for g in groups)
    partitions = any(g.values("partitions") for g in groups)
    header = [*axes, "arm", f"time to {_goal(target)} (s)", f"final {target.metric}"]
    header += [f"{target.metric} at {budget:g} s"] if budget is not None else []
    header += ["samples/s", "sent per worker (MB/s)"] + (["server in (MB/s)"] if servers else [])
    header += [f"speed-up over {base}"] if base is not None else []
    header += ["p"] if partitions else []
    reached = {g.labels: len(g.values("tta")) for g in groups if g.arm == base}
    rows = []
    for g in groups:
        n = len(g.results)
        row = [dict(g.labels)[a].replace("|", "\\|") for a in axes] + [g.arm, _reached(g.values("tta"), n, _sig), _stat(g.values("accuracy"), "{:.4f}".format)]
        row += [_stat(g.values("budget_accuracy"), "{:.4f}".format)] if budget is not None else []
        row += [_stat(g.values("samples_per_second"), "{:.0f}".format), _stat([b / 1e6 for b in g.values("bytes_per_worker")], _sig)]
        row += [_stat([b / 1e6 for b in g.values("server_bytes_in")], _sig)] if servers else []
        if base is not None:
            row += ["baseline" if g.arm == base else f"{base} not reached" if not reached.get(g.labels) else _reached(g.values("speedup"), n, "{:.2f}".format)]
        row += [", ".join(str(p) for p in sorted(set(g.values("partitions")))) or "-"] if partitions else []
        rows.append(row)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _stat(values: list[float], show: Callable[[float], str]) -> str:
    """mean ± std (sample standard deviation), or just the value for one, or "-" for none."""
    if not values:
        return "-"
    mean = float(np.mean(values))
    if len(values) == 1:
        return show(mean)
    spread = float(np.std(values, ddof=1))
    if show is _sig:  # the spread to the mean's decimals: 4.44 ± 0.59, 124 ± 0
        return f"{_sig(mean)} ± {spread:.{_decimals(mean)}f}"
    return f"{show(mean)} ± {show(spread)}"


def _goal(target: Target) -> str:
    """85% for an accuracy target, else the bound itself (loss<=0.3)."""
    return f"{target.value * 100:.4g}%" if target.metric == "accuracy" and target.op == ">=" else str(target)


def _decimals(x: float) -> int:
    """Decimals that show three significant digits of `x`."""
    return max(0, 2 - (0 if x == 0 else math.floor(math.log10(abs(x)))))


def _sig(x: float) -> str:
    """Three significant digits, keeping trailing zeros (4.00, 12.3, 0.213, 1234)."""
    return f"{x:.{_decimals(x)}f}"


def _reached(values: list[float], n: int, fmt: Callable[[float], str]) -> str:
    """_stat, with "(k/n)" when only k of the n seeds reached the target."""
    if not values:
        return f"not reached (0/{n})"
    return _stat(values, fmt) + ("" if len(values) == n else f" ({len(values)}/{n})")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


_CSV = {  # column -> measure
    "time_to_target_s": "tta", "final_accuracy": "accuracy", "accuracy_at_budget": "budget_accuracy",
    "speedup_over_baseline": "speedup", "samples_per_s": "samples_per_second",
    "bytes_sent_per_worker_per_s": "bytes_per_worker", "bytes_in_per_server_per_s": "server_bytes_in", "partitions": "partitions",
}  # fmt: skip


def _csv(sweep: Sweep, results: list[Result]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["cell", "arm", *sweep.axes, *_CSV])
    for r in results:
        values = [r.measures.get(m) for m in _CSV.values()]
        writer.writerow([r.cell.name, r.cell.arm, *(r.cell.label(a) for a in sweep.axes), *("" if v is None else v for v in values)])
    return buffer.getvalue()


# --- plots --------------------------------------------------------------------------------


def plots(sweep: Sweep, groups: list[Group], out: Path) -> list[Path]:
    """Every plot the sweep's axes allow; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    target, budget = target_of(sweep), sweep.report.get("budget")
    files = _per_panel(sweep, groups, None, out, f"{target.metric}-vs-time", _accuracy_vs_time)
    if len(sweep.axes.get("workers", {})) > 1:
        files += _per_panel(sweep, groups, "workers", out, f"time-to-{target.metric}-vs-workers", _against("tta", f"seconds to {_goal(target)}", log=True))
        files += _per_panel(sweep, groups, "workers", out, "bytes-per-worker-vs-workers", _bytes_against)
        if budget is not None:
            files += _per_panel(sweep, groups, "workers", out, f"{target.metric}-at-budget-vs-workers", _against("budget_accuracy", f"test {target.metric} at {budget:g} s"))
    if "straggler" in sweep.axes and baseline_arm(sweep) is not None:
        ylabel = f"speed-up over {baseline_arm(sweep)} (time to {_goal(target)})"
        files += _per_panel(sweep, groups, "straggler", out, "speedup-vs-straggler", _against("speedup", ylabel, skip=baseline_arm(sweep), unity=True))
    return files


def _per_panel(sweep: Sweep, groups: list[Group], x_axis: str | None, out: Path, stem: str, draw) -> list[Path]:
    """One PNG per combination of the labels not plotted (not the seed, the arm or `x_axis`)."""
    import matplotlib.pyplot as plt

    panels: dict[tuple, list[Group]] = {}
    for g in groups:
        panels.setdefault(tuple((a, v) for a, v in g.labels if a != x_axis), []).append(g)
    files = []
    for labels, members in panels.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        draw(ax, members, sweep, x_axis)
        title = ", ".join(f"{a} {v}" for a, v in labels)
        ax.set_title(f"{sweep.name}" + (f": {title}" if title else ""), fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no seed has a value here", transform=ax.transAxes, ha="center", color="grey")
        if not any(len(line.get_xdata()) for line in ax.lines):  # nothing to show: no made-up negative axis
            ax.set_ylim(0.0, 1.0)
        path = out / safe_name(stem + ("_" + ",".join(f"{a}={v}" for a, v in labels) if labels else "") + ".png")
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=110)
        tmp.replace(path)
        plt.close(fig)
        files.append(path)
    return files


def _accuracy_vs_time(ax, groups: list[Group], sweep: Sweep, _x) -> None:
    """Rank 0's test metric of the target (accuracy by default) against time: each seed's curve
    thin; the mean over seeds bold, up to the shortest run's end, with the min-max band."""
    target = target_of(sweep)
    key = f"test_{target.metric}"
    for g in groups:
        color = _colour(sweep, g.arm)
        starts, ends = [r.records[0]["time"] for r in g.results], [r.records[-1]["time"] for r in g.results]
        grid = np.linspace(max(starts), min(ends), 200)  # where every seed has an evaluation
        curves = np.array([[metric_at(r.records, t, target.metric) or 0.0 for t in grid] for r in g.results])
        for r in g.results:
            times, values = [x["time"] for x in r.records], [x.get(key) or 0.0 for x in r.records]
            ax.plot(times, values, color=color, lw=0.6, alpha=0.4, drawstyle="steps-post")
        seeds = len(g.results)
        ax.plot(grid, curves.mean(axis=0), color=color, lw=1.8, drawstyle="steps-post", label=f"{g.arm} ({seeds} seed{'s' if seeds > 1 else ''})")
        if len(g.results) > 1:
            ax.fill_between(grid, curves.min(axis=0), curves.max(axis=0), color=color, alpha=0.15, step="post")
    ax.axhline(target.value, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(f"{'virtual' if sweep.runtime == 'simulate' else 'training'} seconds")
    ax.set_ylabel(f"test {target.metric} (rank 0)")
    if target.metric == "accuracy":
        ax.set_ylim(0.0, 1.0)


def _against(measure: str, ylabel: str, skip: str | None = None, unity: bool = False, log: bool = False):
    """A plot of `measure` (mean, with the standard deviation as error bars) against the x axis;
    a hollow marker where only some seeds have a value."""

    def draw(ax, groups: list[Group], sweep: Sweep, x_axis: str) -> None:
        positions, ticks = _positions(sweep, x_axis)
        for arm in (a for a in sweep.arms if a != skip):
            _line(ax, [g for g in groups if g.arm == arm], measure, x_axis, positions, _colour(sweep, arm), arm)
        if unity:
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        if log and any(g.values(measure) for g in groups):  # times that span orders of magnitude
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter("{x:g}")
            ax.yaxis.set_minor_formatter("{x:g}")
        _x_axis(ax, x_axis, positions, ticks)
        ax.set_ylabel(ylabel)

    return draw


def _bytes_against(ax, groups: list[Group], sweep: Sweep, x_axis: str) -> None:
    """Bytes sent per worker per second (solid) and each server's bytes in (dashed)."""
    positions, ticks = _positions(sweep, x_axis)
    for arm in sweep.arms:
        mine, colour = [g for g in groups if g.arm == arm], _colour(sweep, arm)
        _line(ax, mine, "bytes_per_worker", x_axis, positions, colour, f"{arm}: per worker", scale=1e-6)
        if any(g.values("server_bytes_in") for g in mine):
            _line(ax, mine, "server_bytes_in", x_axis, positions, colour, f"{arm}: per server, in", scale=1e-6, ls="--")
    _x_axis(ax, x_axis, positions, ticks)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter("{x:g}")
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.set_ylabel("MB/s")


def _line(ax, groups: list[Group], measure: str, x_axis: str, positions: dict, color: str, label: str, scale: float = 1.0, ls: str = "-") -> None:
    points = []
    for g in groups:
        values = [v * scale for v in g.values(measure)]
        if values:
            spread = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            points.append((positions[dict(g.labels)[x_axis]], float(np.mean(values)), spread, len(values) == len(g.results)))
    if not points:
        ax.plot([], [], color=color, ls=ls, label=f"{label}: none reached")  # said in the legend
        return
    points.sort()
    xs, ys, errs, whole = zip(*points)
    ax.errorbar(xs, ys, yerr=errs, color=color, ls=ls, marker="none", capsize=3, label=label)
    ax.scatter(xs, ys, color=[color if w else "white" for w in whole], edgecolors=color, zorder=3, s=28)


def _colour(sweep: Sweep, arm: str) -> str:
    """An arm's colour, the same in every figure."""
    return f"C{list(sweep.arms).index(arm) % 10}"


def _positions(sweep: Sweep, x_axis: str) -> tuple[dict[str, float], bool]:
    """label -> x position: the number itself when every label is one, else 0, 1, 2..."""
    labels = list(sweep.axes[x_axis])
    try:
        return {label: float(label) for label in labels}, False
    except ValueError:
        return {label: float(i) for i, label in enumerate(labels)}, True


def _x_axis(ax, x_axis: str, positions: dict[str, float], categorical: bool) -> None:
    if x_axis == "workers" and not categorical:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(positions.values()), list(positions))
    ax.set_xlabel("workers" if x_axis == "workers" else "straggler factor" if x_axis == "straggler" else x_axis)
