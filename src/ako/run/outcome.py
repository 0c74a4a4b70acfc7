"""A run's outcome, the same on both runtimes: what each worker hands back, the run directory,
and rank 0's summary (evaluated, written to summary.json, printed)."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ako.config import to_toml
from ako.data.text import VOCABULARY_FILE
from ako.metrics import (MetricsLog, WriteFailed, build_summary, create_run_dir, format_summary, objective, save_torch,
                         write_atomic, write_summary)
from ako.optim import lr_factor, stale_betas
from ako.run.consensus import consensus_distance
from ako.run.evaluation import prefixed
from ako.run.job import Job
from ako.run.worker import WorkerState


MODEL_FILE = "model.pt"


@dataclass
class WorkerResult:
    """What a worker process hands back: its rank, its final flat parameters (numel,), the
    strategy's facts and, on rank 0, the run summary and the model the run hands back
    (numel,; the one in model.pt)."""

    rank: int
    params: torch.Tensor
    facts: dict
    summary: dict | None = None
    model: torch.Tensor | None = None


def open_log(run_dir: Path, config) -> MetricsLog:
    """Rank 0's metrics.jsonl, and TensorBoard event files beside it with `config.tensorboard`."""
    board = None
    if config.tensorboard:
        from ako.run.board import Board

        board = Board(run_dir, time.time())
    return MetricsLog(run_dir / "metrics.jsonl", board)


def rank_report(rank: int, state: WorkerState | None, facts: dict, sent: int, received: int) -> dict:
    """One rank's report for the summary (`per_worker`, and the servers' figures): its role,
    steps and samples (a server, whose `state` is None, has none), its partial steps that left
    samples waiting and the samples it took fewer than whole steps would have, bytes sent and
    received, and its program's scalar facts."""
    cursor = state.cursor if state is not None else None
    return {
        **{k: v for k, v in facts.items() if isinstance(v, (str, int, float, bool))},
        "rank": rank,
        "role": "worker" if state is not None else "server",
        "steps": cursor.step if cursor else 0,  # a resumed run's too, not only this process's
        "samples": cursor.samples if cursor else 0,
        "partial_steps": cursor.cut if cursor else 0,
        "samples_short": cursor.step * cursor.batch_size - cursor.samples if cursor else 0,
        "bytes_sent": sent,
        "bytes_received": received,
    }


def open_run_dir(config, strategy: str, data) -> Path:
    """A new run directory under `config.out_dir` with the run's config.toml (and a text data
    set's vocabulary.json); prints the data
    set's notice (a fallback it took), if any. Raises WriteFailed (the directory removed again)
    when config.toml cannot be written."""
    run_dir = create_run_dir(config.out_dir, strategy)
    try:
        write_atomic(run_dir / "config.toml", to_toml(config))
        if data.vocabulary is not None:  # what decodes the model's tokens (`ako generate`)
            data.vocabulary.save(run_dir / VOCABULARY_FILE)
    except WriteFailed:
        shutil.rmtree(run_dir, ignore_errors=True)  # a full disk at the start: no half-made run directory left behind
        raise
    if data.notice:
        print(f"ako: {data.notice}", file=sys.stderr)
    return run_dir


def final_model(state: WorkerState, unflushed: torch.Tensor, final: dict) -> dict:
    """Which model the run hands back: the replicas after the flush (rank 0's `final` record),
    or rank 0's replica before it, `unflushed` (numel,), when that one tests better on the
    run's objective (`metrics.objective`: its target's metric, else accuracy, else loss; a
    flush that averages replicas which drifted apart can make the model worse: it is reported)."""
    metrics = state.evaluator.measure(unflushed)
    name, higher = objective(state.goal, metrics)
    flushed, mine = final.get(f"test_{name}"), round(metrics[name], 5)
    worse = _better(mine, flushed, higher)  # a tie keeps the flushed replicas
    return {
        "source": "rank 0's replica before the flush" if worse else "the replicas after the flush",
        "metric": name,
        f"test_{name}": mine if worse else flushed,
        f"flushed_{name}": flushed,
        f"unflushed_{name}": mine,
        **{f"unflushed_{k}": round(v, 5) for k, v in metrics.items() if k != name},
    }


def final_summary(
    job: Job, data, state: WorkerState, reports: list[dict], finals, facts: dict, lost: list[dict], run_dir: Path,
    resumed: int | None = None, restarted: list[int] = (),
) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """Rank 0, after training: evaluate what is left and build the run's summary (`publish`
    writes and prints it). `finals`: the
    live workers' final replicas (where replicas differ), in the order of their reports;
    their average is weighted by each worker's `average_weight` fact when it has one. `facts`:
    rank 0's program's; its `centre` is the model a strategy with a centre variable reports, and
    its `unflushed` rank 0's replica before a final flush (Ako), each (numel,) when present. `lost`:
the lost ranks (`Mailbox.losses`). `resumed`: the step of the checkpoint the run resumed from, if any; `restarted`: the
workers lost before it, which began again as copies of rank 0's part.
    Returns the summary, that model, flat (numel,), and its state_dict for model.pt
    (`model_state`; `publish` writes it)."""
    state.evaluations_ahead(bool(finals) + (facts.get("centre") is not None) + (facts.get("unflushed") is not None))
    end = {}
    if finals:
        weights = [float(r.get("average_weight", 1.0)) for r in reports if r["role"] == "worker"]
        end = state.evaluator.consensus_record(finals, weights)
    final = state.finish(end)
    summary = build_summary(
        job.strategy.name, job.config, data.name, reports, state.evaluator.log.records, final,
        bool(finals), state.clock.now(), state.clock.wall(),
    )  # fmt: skip
    if data.vocabulary is not None:
        summary.update(language_model_figures(summary, data, job.config))
    if job.strategy.summarise is not None:
        summary.update(job.strategy.summarise(reports))
    if facts.get("centre") is not None:
        summary.update(prefixed("centre", state.evaluator.measure(facts["centre"])))
    if facts.get("unflushed") is not None:
        summary["final_model"] = final_model(state, facts["unflushed"], final)
    state.close_bar()
    source, model, measured = handed_back(summary, facts, state, finals, reports, final, end)
    summary["saved_model"], model_dict = model_state(state.replica, model, source, data, measured)
    state.evaluator.log.close()
    summary.update(data_use(job, data))
    summary.update(learning_rate(job, data))
    summary["lost_ranks"] = [loss["rank"] for loss in lost]
    summary["lost"] = lost
    summary["stragglers"] = list(job.config.straggler)  # as given: "rank=3,factor=4"
    summary["resumed_from_step"] = resumed
    summary["resumed_as_rank_0"] = list(restarted)
    summary["run_dir"] = str(run_dir)
    return summary, model.detach().cpu().clone(), model_dict


def learning_rate(job: Job, data) -> dict:
    """The learning rate the optimizers are built with (before warm-up and schedule), `lr`,
    and what `--lr-scaling` multiplied the configured one by, `lr_factor`
    (`ako.optim.lr_factor`); `stale_betas`, the betas that replaced the optimizer's default
    (`ako.optim.stale_betas`), where they did; {} with the user's optimizer_fn, whose rate is
    its own."""
    lr = job.optimization(data).base_lr
    if lr is None:
        return {}
    factor = lr_factor(job.config, job.strategy.averages_own_steps)
    betas = stale_betas(job.config, job.strategy.steps_stale(job.config)).get("betas")
    return {"lr": float(f"{lr:.6g}"), "lr_factor": float(f"{factor:.6g}"), "lr_scaling": job.config.lr_scaling,
            **({"stale_betas": list(betas)} if betas else {})}  # fmt: skip


def language_model_figures(summary: dict, data, config) -> dict:
    """A language model's own summary fields: tokens per sample (the context) and per second,
    the vocabulary's file, and no accuracy milestones (next-token accuracy is not what a
    language model is judged by: its validation loss and `--target loss<=X` are)."""
    figures = {"tokens_per_sample": data.tokens_per_sample, "vocabulary": VOCABULARY_FILE,
               "tokens_per_second": round(summary["samples_per_second"] * data.tokens_per_sample, 1)}  # fmt: skip
    if config.target_accuracy is None:
        figures["time_to_accuracy"] = {}
        if "average_time_to_accuracy" in summary:
            figures["average_time_to_accuracy"] = {}
    return figures


def data_use(job: Job, data) -> dict:
    """How much of the training set an epoch uses: each worker takes whole steps of its shard
    of len(train) // workers samples, so up to workers x step_samples - 1 samples are left out
    of each epoch (other ones each epoch, as the shuffle changes), as DistributedSampler with
    drop_last does; and where the data came from (`Data.source`: a folder, the bundled digits,
    or None for the user's own data sets)."""
    c = job.config
    used = c.workers * job.steps_per_epoch(data) * c.step_samples
    return {"train_samples": len(data.train), "samples_left_out_per_epoch": len(data.train) - used,
            "data_source": getattr(data, "source", None)}  # where the data came from (None: the user's own)


def _better(a, b, higher: bool) -> bool:
    """Whether metric value `a` beats `b`; a diverged value (None, NaN) beats nothing."""
    def ok(x):
        return isinstance(x, (int, float)) and math.isfinite(x)

    if not ok(a):
        return False
    return not ok(b) or (a > b if higher else a < b)


def handed_back(summary: dict, facts: dict, state: WorkerState, finals, reports, final: dict,
                end: dict) -> tuple[str, torch.Tensor, dict]:  # fmt: skip
    """The model the run hands back (numel,), what it is, and its test metrics as measured
    already (test_<metric> fields): easgd's centre variable; under ako the flushed replicas or
    rank 0's replica before the flush, whichever tests better (`final_model`); the replicas'
    average where they differ (gossip, `end`: its consensus record); else rank 0's replica
    (`final`: its final record)."""
    def fields(record: dict, prefix: str) -> dict:
        return {f"test_{k.removeprefix(prefix)}": v for k, v in record.items() if k.startswith(prefix)}

    if facts.get("centre") is not None:
        return "the centre variable", facts["centre"], fields(summary, "centre_")
    chosen = summary.get("final_model", {}).get("source")
    if chosen == "rank 0's replica before the flush":
        return chosen, torch.as_tensor(facts["unflushed"]), fields(summary["final_model"], "unflushed_")
    if chosen is not None:
        return chosen, state.replica.params, fields(final, "test_")  # the flush made every replica the same
    if finals:
        weights = [float(r.get("average_weight", 1.0)) for r in reports if r["role"] == "worker"]
        average = consensus_distance([r.to(state.replica.params.device) for r in finals], weights)[1]
        return "the replicas' average", average, fields(end, "average_")
    return "rank 0's replica", state.replica.params, fields(final, "test_")


def model_state(replica, params: torch.Tensor, source: str, data, measured: dict | None = None) -> tuple[dict, dict]:
    """The model.pt of a run: a plain `state_dict` of the user's module with `params` (numel,)
    as its parameters and rank 0's buffers (BatchNorm statistics: each replica keeps its own,
    as DDP with broadcast_buffers=False; rank 0's are the ones evaluated), and the summary's
    `saved_model`: the file, its source, its test metrics (`measured`, test_<metric> fields,
    when the run has evaluated these parameters already; else evaluated here), and what
    `ako.load_model` needs to rebuild a built-in model. `publish` writes it."""
    own = replica.params.clone()
    replica.params.copy_(params)
    try:
        state = {k: v.detach().cpu().clone() for k, v in replica.model.state_dict().items()}
        metrics = measured or prefixed("test", replica.evaluate(data.test))
    finally:
        replica.params.copy_(own)
    shape = None if data.input_shape is None else list(data.input_shape)
    saved = {"file": MODEL_FILE, "source": source, **metrics, "input_shape": shape,
             "num_classes": data.num_classes}  # fmt: skip
    if data.standardisation is not None:  # what a user must do to raw pixels to feed this model
        saved["pixel_mean"], saved["pixel_std"] = (round(v, 6) for v in data.standardisation)
    return saved, state


RETRY_EVERY = 2.0  # seconds between tries to write model.pt on a full disk


def save_model(run_dir: Path, state: dict, retry_for: float = 0.0) -> None:
    """Write `run_dir`/model.pt (`state`, a state_dict) atomically; on a full disk (or any
    write error) say so in one line and try again every RETRY_EVERY s for up to `retry_for`
    seconds, the model kept in memory meanwhile, so that freeing space saves it. Raises
    WriteFailed (naming the file and the reason) when it could not be written."""
    path, deadline = run_dir / MODEL_FILE, time.monotonic() + retry_for
    try:
        save_torch(state, path)
        return
    except WriteFailed as e:
        if retry_for <= 0:
            raise
        print(f"ako: {e}; the model is kept in memory and the write tried again every {min(RETRY_EVERY, retry_for):g} s for "
              f"{retry_for:g} s: free space there to save it", file=sys.stderr, flush=True)  # fmt: skip
    while True:
        time.sleep(min(RETRY_EVERY, max(0.0, deadline - time.monotonic())))
        try:
            save_torch(state, path)
            print(f"ako: {path} written", file=sys.stderr, flush=True)
            return
        except WriteFailed:
            if time.monotonic() >= deadline:
                raise


def publish(run_dir: Path, summary: dict, *more_lines: str, model: dict | None = None, log: MetricsLog | None = None,
            retry_for: float = 0.0) -> None:  # fmt: skip
    """Write what the run has left to write, smallest first, then print the summary and
    `more_lines`: summary.json, the metrics records not appended yet (`log`, on a full disk),
    then model.pt (`model`, a state_dict; tried again for up to `retry_for` s, `save_model`).
    What cannot be written (a full disk) is recorded in the summary's `not_saved` (and
    `saved_model.file` becomes None), printed with it, and summary.json written again if it
    can be. Raises RuntimeError, in one line, when stdout cannot be written (not when its
    reader left)."""
    not_saved = _try_write(lambda: write_summary(run_dir, summary))
    if log is not None:
        not_saved += _try_write(log.write_pending)
    if model is not None:
        failed = _try_write(lambda: save_model(run_dir, model, retry_for))
        if failed:
            summary["saved_model"]["file"] = None
            kept = f"; the model was kept in memory and tried again for {retry_for:g} s" if retry_for > 0 else ""
            not_saved += [f"{failed[0]}{kept}"]
    if not_saved:
        summary["not_saved"] = not_saved
        if not any(str(run_dir / "summary.json") in line for line in not_saved):
            _try_write(lambda: write_summary(run_dir, summary))  # now true: it says what is missing
    try:
        print("\n".join([format_summary(summary), *more_lines]), flush=True)
    except BrokenPipeError:  # stdout was closed (piped into head?): summary.json has it all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as e:  # a full disk, a read-only descriptor: the run is whole, say so in one line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit would flush again
        raise RuntimeError(f"could not print the summary ({e.strerror or e}); {run_dir} holds it all") from None


def _try_write(write) -> list[str]:
    """Call `write`; returns [] or, when it raised WriteFailed, [its one line]."""
    try:
        write()
        return []
    except WriteFailed as e:
        return [str(e)]
