"""Run outputs: the run directory, the evaluation log, time-to-accuracy and the summary.

A run directory holds `config.toml` (the resolved config), `metrics.jsonl` (one JSON object per
evaluation) and `summary.json`. Whole files are written through a temporary file and a rename;
`metrics.jsonl` grows by whole lines, flushed as they are written.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ACCURACY_MILESTONES = (0.80, 0.85, 0.88, 0.90)


class WriteFailed(OSError):
    """A file of the run that could not be written (a full disk, a read-only file system): its
    message is one line naming the file and the system's reason ("No space left on device")."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text, UTF-8; or bytes) to `path` through a temporary file in the same
    directory and a rename, so a reader never sees a half-written file. The temporary file is
    removed on any error. Raises WriteFailed (an OSError naming `path`) when it cannot be
    written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a full disk is kept full by what was written of it
        if isinstance(e, OSError) and not isinstance(e, WriteFailed):
            raise WriteFailed(e.errno, e.strerror or str(e), str(path)) from None
        raise


def save_torch(obj, path: str | os.PathLike) -> None:
    """`torch.save(obj)` to `path`, atomically as `write_atomic` (which raises WriteFailed).
    It is serialised in memory first: torch's own writer meets a full disk as "unexpected pos",
    without the file or the reason."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getbuffer())


def create_run_dir(out_dir: str | os.PathLike, strategy: str) -> Path:
    """Make `out_dir/<YYYYmmdd-HHMMSS>-<strategy>[-k]/`, a fresh directory (never reused)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy}"
    for k in range(1, 1000):
        path = root / (stem if k == 1 else f"{stem}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{root}: cannot make a new run directory named {stem}")


def _record(line: str) -> dict | None:
    """One line of metrics.jsonl as a record, or None when it is not one (no number "time")."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    good = isinstance(record, dict) and isinstance(record.get("time"), (int, float)) and not isinstance(record["time"], bool)
    return record if good else None


class MetricsLog:
    """Appends evaluation records to `metrics.jsonl` and keeps them for the summary; with a
    `board` (`ako.run.board.Board`), writes each to TensorBoard as well."""

    def __init__(self, path: Path, board=None):
        self.path, self.board = path, board
        self.records: list[dict] = []
        self.unwritten: str | None = None  # why the last records are not in the file yet

    def resume(self, until: float) -> None:
        """A resumed run: keep the records up to `until` training seconds (the checkpoint's),
        drop any the failed run logged after it, and go on appending."""
        lines = self.path.read_text(errors="replace").splitlines() if self.path.exists() else []
        records = [r for r in map(_record, lines) if r is not None]
        if len(records) < len(lines):  # a line cut short by a crash mid-append, or an edit
            print(f"ako: {self.path}: {len(lines) - len(records)} damaged line(s) left out", file=sys.stderr, flush=True)
        self.records = [r for r in records if r["time"] <= until + 1e-9]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict) -> None:
        """Log one evaluation record (NaN and infinities become null). A line that cannot be
        written (a full disk) is cut off again, and from then on the records are only kept
        (`unwritten` says why, in one line printed once) until `write_pending`."""
        record = finite(record)
        self.records.append(record)
        if self.unwritten is None:
            try:
                _append_line(self.path, json.dumps(record) + "\n")
            except OSError as e:
                self.unwritten = str(WriteFailed(e.errno, e.strerror or str(e), str(self.path)))
                print(f"ako: {self.unwritten}; its records are kept in memory and written at the end", file=sys.stderr, flush=True)
        if self.board is not None:
            self.board.add(record)

    def write_pending(self) -> None:
        """Write the whole log again (atomically) if some records could not be appended.
        Raises WriteFailed when it still cannot be written."""
        if self.unwritten is not None:
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            self.unwritten = None

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def _append_line(path: Path, line: str) -> None:
    """Append `line` to `path` whole or not at all: a write cut short (a full disk) is
    truncated away, so that the file holds only whole lines. Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        data = memoryview(line.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def time_to_accuracy(records: list[dict], target: float, key: str = "test_accuracy") -> float | None:
    """Training seconds at the first evaluation whose `key` (rank 0's test accuracy, or
    "average_accuracy": the replicas' average's) is >= target, or None."""
    return next((r["time"] for r in records if (r.get(key) or 0.0) >= target), None)


def milestones(records: list[dict], target: float | None, key: str = "test_accuracy") -> dict[str, float | None]:
    """Time to each standard accuracy milestone and to the run's target, keyed "0.85" etc.
    Empty when the evaluation gives no accuracy (a user's eval_fn)."""
    if not any(r.get(key) is not None for r in records):
        return {}
    levels = sorted(set(ACCURACY_MILESTONES) | ({target} if target else set()))
    return {f"{a:g}": time_to_accuracy(records, a, key) for a in levels}


def time_to_target(records: list[dict], goal, prefix: str = "test") -> float | None:
    """Training seconds at the first evaluation whose `prefix`_<metric> meets `goal` (a
    `config.Target`: rank 0's replica with "test", the replicas' average with "average")."""
    key = f"{prefix}_{goal.metric}"
    return next((r["time"] for r in records if goal.met({goal.metric: r.get(key)})), None)


def objective(goal, metrics) -> tuple[str, bool]:
    """The metric that says which of two models is better, and whether higher is better: the
    target's, else a language model's loss, else accuracy, else loss, else the first the
    evaluation gives."""
    if goal is not None:
        return goal.metric, goal.op == ">="
    if "perplexity" in metrics:  # a language model: judged by its loss, not its next-token accuracy
        return "loss", False
    for name, higher in (("accuracy", True), ("loss", False)):
        if name in metrics:
            return name, higher
    return next(iter(metrics)), True


def format_summary(s: dict) -> str:
    """The summary as the lines printed at the end of a run."""
    evaluating = s.get("evaluation_seconds", s["wall_seconds"] - s["train_seconds"])  # a simulation's take no virtual time
    paused = f" (+ {evaluating:.1f} s evaluating)" if evaluating >= 0.05 else ""
    sec = time_unit(s)
    lines = [
        f"ako {s['strategy']}: {s['workers']} worker{'s' if s['workers'] > 1 else ''}, {s['model']} on "
        f"{s['dataset']}, {s['epochs']:.2f} epochs ({s['iterations']} iterations) in {duration(s['train_seconds'])} {sec} "
        f"of training{paused}",
        *_metric_lines(s),
        *_replica_lines(s),
        f"  throughput       {s['samples_per_second']:.0f} samples/{sec}{_tokens(s, sec)}; samples trained per worker{f' ({_ranks(s)})' if _ranks(s) else ''} "
        + per_worker(s, "samples"),
        f"  sent per worker  {s['bytes_sent_per_worker_per_second'] / 1e6:.2f} MB/{sec} "
        f"(received {s['bytes_received_per_worker_per_second'] / 1e6:.2f} MB/{sec})",
    ]
    if data := _data_line(s):
        lines.append(data)
    if s.get("lr_factor", 1.0) != 1.0:
        why = ": sqrt(workers), as the workers' own adaptive steps are averaged" if s["lr_scaling"] == "auto" else ""
        lines.append(f"  learning rate    {s['lr']:.4g} = --lr {s['lr'] / s['lr_factor']:.4g} x {s['lr_factor']:.4g} "
                     f"(--lr-scaling {s['lr_scaling']}{why})")  # fmt: skip
    if betas := s.get("stale_betas"):
        lines.append(f"  betas            {betas[0]:g}, {betas[1]:g} (beta1 lowered for the workers' steps on stale parameters: "
                     "asynchrony adds momentum; --optimizer-arg betas=B1,B2 to set)")  # fmt: skip
    if s.get("stragglers"):
        lines.append(f"  stragglers       {'; '.join(s['stragglers'])} (injected: a slowed step takes factor x its compute time)")
    for server in s.get("per_server", []):
        lines.append(
            f"  server rank {server['rank']:<4} in {server['bytes_in_per_second'] / 1e6:.2f} MB/{sec}, "
            f"out {server['bytes_out_per_second'] / 1e6:.2f} MB/{sec}"
        )
    if s.get("staleness_mean") is not None:
        lines.append(f"  staleness        mean {s['staleness_mean']:.2f}, max {s['staleness_max']} (server updates)")
    if s.get("handed_in") is not None:
        each = per_worker(s, "handed_in", "{:.0%}".format)
        lines.append(
            f"  absp             share of its assignment handed in per iteration {each} (mean {s['handed_in']:.0%}); "
            f"oldest waiting sample {s['oldest_waiting']} iteration{'s' if s['oldest_waiting'] != 1 else ''} old"
        )
    if s.get("resumed_from_step") is not None:
        copies = s.get("resumed_as_rank_0") or []
        again = (f"; worker rank{'s' if len(copies) > 1 else ''} {', '.join(map(str, copies))}, lost before it, began again "
                 "from rank 0's part: its per-worker figures count rank 0's up to then" if copies else "")  # fmt: skip
        lines.append(f"  resumed          from the checkpoint at step {s['resumed_from_step']}{again}")
    if s.get("lost_ranks"):
        lost = s.get("lost") or [{"rank": r, "role": "worker", "how": "died", "reason": ""} for r in s["lost_ranks"]]
        lines.append(f"  lost             {'; '.join(map(loss_text, lost))}; the others carried on")
    lines += plan_lines(s)
    if s.get("partial_steps"):
        cut, short = per_worker(s, "partial_steps"), per_worker(s, "samples_short")
        lines.append(f"  partial steps    steps cut short behind the peers {cut}, samples fewer than whole steps {short} "
                     f"(per worker{f', {_ranks(s)}' if _ranks(s) else ''}; what a step left went first in the next, so the run trained that many samples fewer)")  # fmt: skip
    if s.get("final_model"):
        m = s["final_model"]
        name = m["metric"]
        flushed, unflushed = figures_apart(m[f"flushed_{name}"], m[f"unflushed_{name}"])
        if m["source"] == "the replicas after the flush":
            lines.append(f"  final model      the replicas after the flush ({name} {flushed}; rank 0's before it {unflushed})")
        else:
            lines.append(f"  final model      rank 0's replica before the flush ({name} {unflushed}): the flush made "
                         f"the replicas worse ({flushed})")  # fmt: skip
    if s.get("saved_model"):
        m = s["saved_model"]
        tested = sorted(((k[5:], v) for k, v in m.items() if k.startswith("test_")), key=_accuracy_first)
        figures = ", ".join(f"{name} {figure(v)}" for name, v in tested)
        where = m["file"] or "not saved"
        lines.append(f"  saved model      {where}: {m['source']} ({figures})")
    for line in s.get("not_saved", []):  # a full disk: what the run directory lacks
        lines.append(f"  not saved        {line}")
    if s.get("run_dir"):
        lines.append(f"  run directory    {s['run_dir']}")
    return "\n".join(lines)


def _metric_lines(s: dict) -> list[str]:
    """The test metrics of rank 0's replica (and of the average and the centre), the time to
    each accuracy milestone, and the time to the target."""
    lines = []
    language = s.get("tokens_per_sample") is not None
    for name, value in s["test_metrics"].items():
        text = f"{figure(value)}{' nats per token' if language and name == 'loss' else ''} (rank 0's replica)"
        for where, label in (("average", "average of the replicas"), ("centre", "centre variable")):
            present = "average_time_to_accuracy" in s if where == "average" else f"{where}_{name}" in s
            if present and f"{where}_{name}" in s:
                text += f", {figure(s[f'{where}_{name}'])} ({label})"
        lines.append(f"  {'validation' if language else 'test'} {name:<{5 if language else 11}} {text}")
    target = s.get("target_accuracy")
    if s["time_to_accuracy"]:
        lines.append(f"  time to accuracy {_milestone_text(s['time_to_accuracy'], time_unit(s))}" + ("" if target is None else f"  (target {target:.0%})"))
    if s.get("target") and not (target is not None and s["target"] == f"accuracy>={target:g}"):
        reached = s["time_to_target"]
        lines.append(f"  time to target   {s['target']}: {'not reached' if reached is None else f'{duration(reached)} {time_unit(s)}'}")
    return lines


def _tokens(s: dict, sec: str) -> str:
    """A language model's throughput in tokens: " (12345 tokens/s)", else ""."""
    return f" ({s['tokens_per_second']:.0f} tokens/{sec})" if s.get("tokens_per_second") is not None else ""


def _data_line(s: dict) -> str | None:
    """The training samples an epoch leaves out (whole steps of equal shards), and the shards
    of lost workers; None when every sample is trained every epoch."""
    dead = [loss["rank"] for loss in s.get("lost") or () if loss.get("role", "worker") == "worker"]
    if not (s.get("samples_left_out_per_epoch") or (dead and s.get("train_samples"))):
        return None
    left, total = s.get("samples_left_out_per_epoch") or 0, s["train_samples"]
    cut = "; fewer where steps were cut short (partial steps, below)" if s.get("partial_steps") else ""
    if (s.get("handed_in") or 1) < 1:
        cut += "; fewer where a worker handed in part of its assignment (absp, below)"
    if dead:
        shard = (total - left) // s["workers"]
        whose = f"shard of lost worker rank {dead[0]} ({shard} samples)" if len(dead) == 1 else (
            f"shards of lost worker ranks {', '.join(map(str, dead))} ({shard} samples each)")
        cut += f"; the {whose} not trained from the loss on"
    return (f"  data             {total - left} of {total} training samples an epoch: {left} ({left / total:.1%}) left out "
            f"each epoch, other ones each time (whole steps of equal shards){cut}")  # fmt: skip


PER_WORKER_LISTED = 8  # up to this many workers, the summary lists each one's figure


def per_worker(s: dict, key: str, show=str) -> str:
    """The workers' figure `key` (0 where a report lacks it), each as `show` writes it:
    "464 each" when they are all equal, "464 / 470 / 12" for up to PER_WORKER_LISTED workers,
    else their spread, with the rank of an extreme only one worker has: "12 (rank 3) to 470,
    median 464"."""
    values = [w.get(key, 0) for w in s["per_worker"]]
    shown = [show(v) for v in values]
    if len(set(shown)) == 1:
        return shown[0] if len(shown) == 1 else f"{shown[0]} each"
    if len(values) <= PER_WORKER_LISTED:
        return " / ".join(shown)

    def extreme(value) -> str:
        holders = [w["rank"] for w, v in zip(s["per_worker"], values) if v == value]
        return show(value) + (f" (rank {holders[0]})" if len(holders) == 1 else "")

    middle = statistics.median_low(values)  # a worker's own figure, not a mean of two
    return f"{extreme(min(values))} to {extreme(max(values))}, median {show(middle)}"


_HOW = {
    "died": "died",
    "stopped": "was stopped (SIGSTOP or a debugger) and dropped",
    "silent": "fell silent (stopped, stuck or far too slow) and was dropped",
}


def _ranks(s: dict) -> str:
    """Whose the per-worker figures are where workers were lost (the survivors'): "ranks 0, 2,
    3", or past PER_WORKER_LISTED workers "the 63 live workers"; else ""."""
    if not s.get("lost_ranks"):
        return ""
    if len(s["per_worker"]) > PER_WORKER_LISTED:
        return f"the {len(s['per_worker'])} live workers"
    return f"rank{'s' if len(s['per_worker']) > 1 else ''} " + ", ".join(str(w["rank"]) for w in s["per_worker"])


def loss_text(loss: dict) -> str:
    """One lost rank ({"rank", "role", "how", "reason"}), as the summary prints it: "worker rank
    1 died (Connection reset by peer)", "worker rank 2 was stopped (SIGSTOP or a debugger) and
    dropped (silent for 5 s)"."""
    reason = f" ({loss['reason']})" if loss.get("reason") else ""
    return f"{loss.get('role', 'worker')} rank {loss['rank']} {_HOW.get(loss['how'], loss['how'])}{reason}"


def _milestone_text(times: dict, unit: str) -> str:
    return ", ".join(f"{float(k):.0%}: {'not reached' if v is None else f'{duration(v)} {unit}'}" for k, v in times.items())


def time_unit(s: dict) -> str:
    """The unit of the summary's times: "s", or "virtual s" for the simulator's clock."""
    return "virtual s" if "simulation" in s else "s"


def duration(x: float) -> str:
    """A duration in seconds: one decimal, or two significant digits below 1 s (a simulated
    run's 0.0046 s is not 0.0)."""
    return f"{x:.1f}" if x >= 0.95 or x == 0 else f"{x:.2g}"


def _replica_lines(s: dict) -> list[str]:
    """The average's time to accuracy, the final consensus distance, gossip's settings."""
    lines = []
    if s.get("average_time_to_accuracy"):
        lines.append(f"  average reaches  {_milestone_text(s['average_time_to_accuracy'], time_unit(s))}")
    if s.get("consensus_distance") is not None:
        most = s.get("consensus_distance_max")
        during = f", at most {most:.3g} during training" if most is not None and most > s["consensus_distance"] else ""
        lines.append(
            f"  consensus        {s['consensus_distance']:.3g} at the end{during} "
            "(mean distance of the replicas to their average, relative to its norm)"
        )
    return lines


def write_summary(run_dir: Path, summary: dict) -> None:
    """Write `run_dir/summary.json` atomically."""
    write_atomic(run_dir / "summary.json", json.dumps(finite(summary), indent=2) + "\n")


def finite(record):
    """`record` (a dict, and the dicts and lists in it) with NaN and infinite numbers (a
    diverged run's loss) as None: JSON has no NaN."""
    if isinstance(record, dict):
        return {k: finite(v) for k, v in record.items()}
    if isinstance(record, list):
        return [finite(v) for v in record]
    return None if isinstance(record, float) and not math.isfinite(record) else record


def figure(x, decimals: int = 4) -> str:
    """A metric as printed: 4 decimals, or "n/a" where it diverged (NaN, infinite, None)."""
    return f"{x:.{decimals}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a (diverged)"


def plan_lines(s: dict) -> list[str]:
    """The strategy's plan as summary lines, from rank 0's facts in the summary: Ako's
    partitions and staleness bound, DiLoCo's outer steps, EASGD's elastic rounds, gossip's
    rounds."""
    lines = []
    if "partitions" in s:
        lines.append(
            f"  partitions       p = {s['partitions']}, {s['exchange']}, staleness bound {s['staleness_bound']}"
            f"{', windows of ' + s['windows'] if 'windows' in s else ''} ({s['partitions_reason']})"
        )
    if "outer_steps" in s:
        lines.append(_syncs(s))
    if "tau_reason" in s:
        never = f"; longer than this run's {s['iterations']} steps: one round, at its end" if s["tau"] > s["iterations"] else ""
        lines.append(f"  elastic rounds   every tau = {s['tau']} step{'s' if s['tau'] != 1 else ''} ({s['tau_reason']}){never}")
    if "gossip" in s:
        lines.append(f"  gossip           {s['gossip']}, {s['peers']} peers, tau = {s['tau']}; {s['rounds']} rounds on rank 0")
    return lines


def strategy_facts(reports: list[dict]) -> dict:
    """Rank 0's program's own facts (p, s, tau, outer steps...): its report less the counts
    every rank reports."""
    return {k: v for k, v in reports[0].items() if k not in _REPORT_KEYS}


def _syncs(s: dict) -> str:
    """diloco's and streaming-diloco's summary line: their outer steps, and where H is longer
    than the run, that the replicas trained apart."""
    every = s["sync_every"] // s["fragments"]
    fragments = f", one of {s['fragments']} fragments every {every}" if s["fragments"] > 1 else ""
    never = (f": H is longer than this run's {s['iterations']} steps, so the replicas trained apart "
             "(a smaller --sync-every syncs them)") if s["outer_steps"] == 0 else ""  # fmt: skip
    steps = f"{s['sync_every']} step{'s' if s['sync_every'] != 1 else ''}"
    return f"  outer steps      {s['outer_steps']} (every H = {steps}{fragments}){never}"


def figures_apart(a, b) -> tuple[str, str]:
    """Two metrics as printed, with up to 6 decimals where 4 would print different values alike."""
    for decimals in (4, 5, 6):
        x, y = figure(a, decimals), figure(b, decimals)
        if x != y:
            return x, y
    return figure(a), figure(b)  # equal: as every other figure


def _rounded(x: float | None) -> float | None:
    """`x` to 5 decimals; None for None, NaN or infinity (a diverged run)."""
    return round(x, 5) if isinstance(x, (int, float)) and math.isfinite(x) else None


_REPORT_KEYS = ("rank", "role", "steps", "samples", "partial_steps", "samples_short", "bytes_sent", "bytes_received")


def _accuracy_first(item: tuple[str, object]) -> int:
    return {"accuracy": 0, "loss": 1}.get(item[0], 2)


def build_summary(
    strategy: str,
    config,
    dataset: str,
    reports: list[dict],
    records: list[dict],
    final: dict,
    average: bool,
    train_seconds: float,
    wall_seconds: float,
) -> dict:
    """The run summary (summary.json) from rank 0's records, the `final` one included (with
    the replicas' average's metrics when `average`), and every live rank's report (rank, role,
    steps, samples, bytes, scalar facts). Rates are per second of training (rank 0's clock,
    which leaves out its evaluations); bytes are per worker, averaged over the live workers;
    each server's bytes in and out per second are listed as well."""
    workers = [r for r in reports if r["role"] == "worker"]
    servers = [r for r in reports if r["role"] == "server"]
    samples = sum(w["samples"] for w in workers)
    seconds = max(train_seconds, 1e-9)
    summary = {
        "strategy": strategy,
        "workers": config.workers,
        "model": config.model,
        "dataset": dataset,
        "epochs": final["epoch"],
        "iterations": reports[0]["steps"],
        "test_accuracy": final.get("test_accuracy"),
        "test_loss": final.get("test_loss"),
        "test_metrics": dict(sorted(((k[5:], v) for k, v in final.items() if k.startswith("test_")), key=_accuracy_first)),
        "average_accuracy": _rounded(final.get("average_accuracy")) if average else None,
        "average_loss": _rounded(final.get("average_loss")) if average else None,  # None when it diverged
        "target_accuracy": config.target_accuracy,
        "target": None if config.goal is None else str(config.goal),
        "time_to_target": None if config.goal is None else time_to_target(records, config.goal),
        "time_to_accuracy": milestones(records, config.target_accuracy),
        "train_seconds": float(f"{train_seconds:.6g}"),  # a simulated run's may be milliseconds
        "wall_seconds": round(wall_seconds, 3),
        "samples": samples,
        "samples_per_second": round(samples / seconds, 1),
        "bytes_sent_per_worker_per_second": round(sum(w["bytes_sent"] for w in workers) / len(workers) / seconds),
        "bytes_received_per_worker_per_second": round(
            sum(w["bytes_received"] for w in workers) / len(workers) / seconds
        ),
        "per_worker": workers,
    }
    if average:
        summary.update({k: _rounded(v) for k, v in final.items() if k.startswith("average_") and k not in summary})
        summary["average_time_to_accuracy"] = milestones(records, config.target_accuracy, "average_accuracy")
        if config.goal is not None:
            summary["average_time_to_target"] = time_to_target(records, config.goal, "average")
        summary["consensus_distance"] = final.get("consensus_distance")
        during = [d for r in records if isinstance(d := r.get("consensus_distance"), (int, float)) and math.isfinite(d)]
        summary["consensus_distance_max"] = max(during, default=None)  # before Ako's flush evens the replicas out
    if servers:
        summary["per_server"] = [
            {**r, "bytes_in_per_second": round(r["bytes_received"] / seconds), "bytes_out_per_second": round(r["bytes_sent"] / seconds)}
            for r in servers
        ]  # fmt: skip
    summary.update(strategy_facts(reports))
    return summary
