"""What the benchmarks read back from a finished `ako train` run: its summary and records, and
the time at which a metric first reached a target."""

from __future__ import annotations

import json
from pathlib import Path


def latest_run(folder: Path) -> tuple[dict, list[dict]] | None:
    """The newest run under `folder` (`<folder>/<run>/summary.json`): (summary, metrics.jsonl's
    records), or None when there is none."""
    summaries = list(Path(folder).glob("*/summary.json"))
    if not summaries:
        return None
    latest = max(summaries, key=lambda p: p.stat().st_mtime)
    records = [json.loads(line) for line in (latest.parent / "metrics.jsonl").read_text().splitlines()]
    return json.loads(latest.read_text()), records


def time_to(records: list[dict], metric: str, target: float, clock: str = "time") -> float | None:
    """Training seconds (the records' `clock` key: ako's metrics.jsonl says "time", the peer arms'
    results "seconds") to the first record whose `metric` is at or past `target` (at most it for
    a loss, at least it otherwise); None: not reached."""
    passed = (lambda v: v <= target) if metric.endswith("loss") else (lambda v: v >= target)
    return next((r[clock] for r in records if r.get(metric) is not None and passed(r[metric])), None)


def targets(text: str) -> list[float]:
    """`--target`'s comma-separated values ("2.3,2.2") as floats."""
    return [float(value) for value in text.split(",")]
