"""A run's outcome, the same on both runtimes: what each worker hands back, the run directory,
and rank 0's summary (evaluated, written to summary.json, printed)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ako.config import to_toml
from ako.metrics import build_summary, create_run_dir, format_summary, write_atomic, write_summary
from ako.run.job import Job
from ako.run.worker import WorkerState


@dataclass
class WorkerResult:
    """What a worker process hands back: its rank, its final flat parameters (numel,), the
    strategy's facts and, on rank 0, the run summary."""

    rank: int
    params: torch.Tensor
    facts: dict
    summary: dict | None = None


def rank_report(rank: int, state: WorkerState | None, facts: dict, sent: int, received: int) -> dict:
    """One rank's report for the summary (`per_worker`, and the servers' figures): its role,
    steps and samples (a server, whose `state` is None, has none), bytes sent and received, and
    its program's scalar facts."""
    return {
        **{k: v for k, v in facts.items() if isinstance(v, (str, int, float, bool))},
        "rank": rank,
        "role": "worker" if state is not None else "server",
        "steps": state.cursor.step if state is not None else 0,  # a resumed run's too, not only this process's
        "samples": state.cursor.samples if state is not None else 0,
        "bytes_sent": sent,
        "bytes_received": received,
    }


def open_run_dir(config, strategy: str, data) -> Path:
    """A new run directory under `config.out_dir` with the run's config.toml; prints the data
    set's notice (a fallback it took), if any."""
    run_dir = create_run_dir(config.out_dir, strategy)
    write_atomic(run_dir / "config.toml", to_toml(config))
    if data.notice:
        print(f"ako: {data.notice}", file=sys.stderr)
    return run_dir


def final_model(state: WorkerState, unflushed: torch.Tensor, final: dict, test_set) -> dict:
    """Which model the run hands back: the replicas after the flush (rank 0's `final` record),
    or rank 0's replica before it, `unflushed` (numel,), when that one tests better (a flush
    that averages replicas which drifted apart can make the model worse: it is reported)."""
    loss, accuracy = state.replica.evaluate_params(unflushed.to(state.replica.params.device), test_set)
    flushed, accuracy = final["test_accuracy"], round(accuracy, 5)
    worse = accuracy > flushed  # a tie keeps the flushed replicas
    return {
        "source": "rank 0's replica before the flush" if worse else "the replicas after the flush",
        "test_accuracy": round(max(accuracy, flushed), 5),
        "flushed_accuracy": flushed,
        "unflushed_accuracy": accuracy,
        "unflushed_loss": round(loss, 5),
    }


def final_summary(
    job: Job, data, state: WorkerState, reports: list[dict], finals, facts: dict, lost: list[int], run_dir: Path,
    resumed: int | None = None,
) -> dict:  # fmt: skip
    """Rank 0, after training: evaluate what is left and build the run's summary (`publish`
    writes and prints it). `finals`: the
    live workers' final replicas (where replicas differ), in the order of their reports;
    their average is weighted by each worker's `average_weight` fact when it has one. `facts`:
    rank 0's program's; its `centre` is the model a strategy with a centre variable reports, and
    its `unflushed` rank 0's replica before a final flush (Ako), each (numel,) when present. `resumed`: the step of the checkpoint the run resumed from, if any."""
    end = {}
    if finals:
        weights = [float(r.get("average_weight", 1.0)) for r in reports if r["role"] == "worker"]
        end = state.evaluator.consensus_record(finals, weights)
    final = state.finish(end)
    average_eval = (final["average_loss"], final["average_accuracy"]) if finals else None
    summary = build_summary(
        job.strategy.name, job.config, data.name, reports, state.evaluator.log.records, final,
        average_eval, state.clock.now(), state.clock.wall(),
    )  # fmt: skip
    if job.strategy.summarise is not None:
        summary.update(job.strategy.summarise(reports))
    if facts.get("centre") is not None:
        loss, accuracy = state.replica.evaluate_params(facts["centre"].to(state.replica.params.device), data.test)
        summary["centre_accuracy"], summary["centre_loss"] = round(accuracy, 5), round(loss, 5)
    if facts.get("unflushed") is not None:
        summary["final_model"] = final_model(state, facts["unflushed"], final, data.test)
    summary["lost_ranks"] = lost
    summary["resumed_from_step"] = resumed
    summary["run_dir"] = str(run_dir)
    return summary


def publish(run_dir: Path, summary: dict, *more_lines: str) -> None:
    """Write summary.json (atomically) and print the summary, then `more_lines`."""
    write_summary(run_dir, summary)
    try:
        print("\n".join([format_summary(summary), *more_lines]), flush=True)
    except BrokenPipeError:  # stdout was closed (piped into head?): summary.json has it all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
