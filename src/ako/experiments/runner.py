"""Running a sweep's cells (`ako sweep`), `jobs` at a time: simulated ones in one long-lived
process per job slot (`cell_process`), real ones each as its own `ako train` process.
Resumably: a cell is finished when its run wrote a readable summary with the settings and
runtime the sweep file gives now (`finished_run`); running again runs only the others."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import tomli_w

from ako.experiments.cell_process import CellProcess, end_process
from ako.experiments.grid import EXIT_BAD_INPUT, Cell, Sweep
from ako.metrics import figure, time_unit, write_atomic


def finished_run(cell_dir: Path, cell: Cell) -> tuple[Path, dict, list[dict]] | None:
    """The cell's run directory, summary and evaluation records when its run finished with these
    settings on this runtime and its outputs can be read, else None (the cell is to be run again)."""
    try:
        recorded = json.loads((cell_dir / "cell.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get("settings") != _jsonable(cell.settings) or recorded.get("runtime") != cell.runtime:
        return None
    run = next((p.parent for p in sorted(cell_dir.glob("*/summary.json"))), None)
    outputs = None if run is None else load_run(run)
    return None if outputs is None else (run, *outputs)


def load_run(run: Path) -> tuple[dict, list[dict]] | None:
    """A finished run's summary and evaluation records, or None when either cannot be read."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    good = isinstance(summary, dict) and (isinstance(summary.get("test_accuracy"), (int, float)) or bool(summary.get("test_metrics")))
    good = good and records and all(isinstance(r, dict) and isinstance(r.get("time"), (int, float)) for r in records)
    return (summary, records) if good else None


def _jsonable(settings: dict) -> dict:
    return json.loads(json.dumps(settings))


class SweepFailed(Exception):
    """A cell's run exited with bad input (status 2), so every other cell would fail alike; or
    another sweep is running in the same directory."""


def run_sweep(sweep: Sweep, out: Path, jobs: int = 1, progress: bool | None = None) -> list[tuple[Cell, str]]:
    """Run the cells of `sweep` not yet finished under `out`, `jobs` at a time, showing overall
    progress. Returns the failed cells with the last line of their log (the others finished).
    Raises SweepFailed when a cell reports bad input (a sweep directory made by this call is
    removed again: nothing is left behind) or another sweep holds `out`; KeyboardInterrupt
    stops the running cells.
    """
    fresh = [p for p in (out, *out.parents) if not os.path.exists(p)]  # what this sweep makes, deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "w")  # noqa: SIM115 -- held until this function returns
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        named = sweep.text if "name" in tomllib.loads(sweep.text) else f"name = {json.dumps(sweep.name)}\n{sweep.text}"
        write_atomic(out / "sweep.toml", named)  # what `ako report` reads, under the sweep's name
    except BlockingIOError:
        raise SweepFailed(f"sweep directory {str(out)!r}: another ako sweep is running in it") from None
    except OSError as e:
        raise SweepFailed(f"sweep directory {str(out)!r}: cannot write there ({e.strerror or e})") from None
    try:
        return _run_cells(sweep, out, jobs, progress)
    except SweepFailed:  # bad input a cell found: a sweep directory made for it is removed again
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
            for parent in fresh[1:]:
                try:
                    parent.rmdir()
                except OSError:
                    break
        raise
    finally:
        lock.close()


def _run_cells(sweep: Sweep, out: Path, jobs: int, progress: bool | None) -> list[tuple[Cell, str]]:
    """`run_sweep`'s part once `out` is locked: run the cells not yet finished."""
    cells = sweep.cells()
    todo = [c for c in cells if finished_run(out / "cells" / c.name, c) is None]
    bar = _progress(len(cells), len(cells) - len(todo), progress)
    failed: list[tuple[Cell, str]] = []
    running: dict = {}
    stop = threading.Event()
    slots = _Slots()
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:

            def start(cell: Cell) -> None:
                running[pool.submit(run_cell, cell, out / "cells" / cell.name, jobs, stop, slots)] = cell

            try:
                pending = iter(todo)
                for cell in itertools.islice(pending, jobs):
                    start(cell)
                while running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        cell = running.pop(future)
                        status, line = future.result()
                        if status == EXIT_BAD_INPUT:
                            raise SweepFailed(f"cell {cell.name}: {line.removeprefix('ako: error: ')}")
                        if status != 0:
                            failed.append((cell, line))
                        bar.write(f"{'failed' if status else 'done  '} {cell.name}: {line}")
                        bar.update(1)
                        for nxt in itertools.islice(pending, 1):
                            start(nxt)
            except BaseException:
                stop.set()
                raise
            finally:
                bar.close()
    finally:  # every thread is done: a process with a cell when `stop` was set has been stopped
        slots.close()
    return failed


class _Slots:
    """Each pool thread's `CellProcess`, made for its first simulated cell."""

    def __init__(self):
        self.local, self.all, self.lock = threading.local(), [], threading.Lock()

    def mine(self, env: dict | None) -> CellProcess:
        process = getattr(self.local, "process", None)
        if process is None:
            process = self.local.process = CellProcess(env)
            with self.lock:
                self.all.append(process)
        return process

    def close(self) -> None:
        for process in self.all:
            process.close()


def run_cell(cell: Cell, cell_dir: Path, jobs: int, stop: threading.Event, slots: _Slots) -> tuple[int, str]:
    """Run one cell as `ako <simulate|train> --config cell.toml` in a fresh `cell_dir`: a
    simulated cell in this thread's `CellProcess` (kept in `slots`), a real one in a process of
    its own. Returns (exit status, a one-line result or error)."""
    try:
        return _run_cell(cell, cell_dir, jobs, stop, slots)
    except OSError as e:  # the disk, not the cell: say so and go on with the others
        return 1, f"cannot write in {cell_dir}: {e.strerror or e}"


def _run_cell(cell: Cell, cell_dir: Path, jobs: int, stop: threading.Event, slots: _Slots) -> tuple[int, str]:
    if cell_dir.exists():
        shutil.rmtree(cell_dir)  # an unfinished or outdated run: start the cell again
    cell_dir.mkdir(parents=True)
    write_atomic(cell_dir / "cell.toml", tomli_w.dumps(cell.settings))
    where = cell_dir.resolve()  # absolute: a cell may change the working directory
    argv = [cell.runtime, "--config", str(where / "cell.toml"), "--out-dir", str(where), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1") if jobs > 1 else None  # one core per cell
    started = time.monotonic()
    if cell.runtime == "simulate":
        status = slots.mine(env).run(argv, where / "log.txt", stop)
    else:
        status = _own_process(argv, cell_dir / "log.txt", env, stop)
    if status == 130:
        return 130, "interrupted"
    run = next((p.parent for p in cell_dir.glob("*/summary.json")), None)
    if status == 0 and run is not None and (outputs := load_run(run)) is not None:
        record = {"arm": cell.arm, "labels": dict(cell.labels), "runtime": cell.runtime, "settings": _jsonable(cell.settings)}
        write_atomic(cell_dir / "cell.json", json.dumps(record, indent=2))
        return 0, _outcome(outputs[0], time.monotonic() - started)
    if status < 0:
        return 1, f"its process was killed by {signal.Signals(-status).name}"
    lines = (cell_dir / "log.txt").read_text().strip().splitlines()
    return status or 1, lines[-1] if lines else f"exit status {status}"


def _own_process(argv: list[str], log: Path, env: dict | None, stop: threading.Event) -> int:
    """`python -m ako <argv>` in a process of its own, output in `log`; its exit status, or
    130 when `stop` was set meanwhile (the process is then stopped)."""
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "ako", *argv], stdout=out, stderr=subprocess.STDOUT, env=env)
        while process.poll() is None:
            if stop.wait(0.2):
                end_process(process, terminate=True)  # SIGTERM: its workers die with it
                return 130
    return process.returncode


def _outcome(summary: dict, seconds: float) -> str:
    text = ", ".join(f"{name} {figure(value)}" for name, value in summary["test_metrics"].items())
    if summary.get("target"):
        tta = summary["time_to_target"]
        text += f"; {summary['target']} " + ("not reached" if tta is None else f"at {tta:.1f} {time_unit(summary)}")
    return f"{text} (took {seconds:.0f} s)"


def _progress(total: int, done: int, show: bool | None):
    """tqdm over the cells; it also writes one line per finished cell when not on a terminal."""
    from tqdm import tqdm

    if sys.stderr.isatty() if show is None else show:
        return tqdm(total=total, initial=done, unit="cell", desc="sweep")
    return _Lines(total, done)


class _Lines:
    """Progress as plain lines, "[k/n] ...", for logs and pipes."""

    def __init__(self, total: int, done: int):
        self.total, self.done = total, done
        print(f"sweep: {done} of {total} cells already finished", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n: int) -> None:
        self.done += n

    def close(self) -> None:
        pass
