"""Checkpoints: every rank's training state at one point of a run, so that the run can go on
after a failure (`ako train --resume RUN_DIR`, or a restart under `torchrun --max-restarts`).

Layout: RUN_DIR/checkpoints/<step>/rank<r>.pt, one file per rank (worker or server), written
atomically (a temporary file, then a rename) by `torch.save` and read by
`torch.load(weights_only=True)`, which unpickles tensors, numbers, strings, lists and dicts
only. A worker lost before the checkpoint (a strategy that carries on without it) has an
empty marker, rank<r>.lost, put there by rank 0 before its own file; on a resume it starts
again from rank 0's part, a copy of its replica. A checkpoint is complete when every rank's
file or marker is in; a run resumes from the latest complete one. Each rank keeps its last
two files, and its file of the latest complete one. The run directory must be one that every
rank can reach (one machine, or a shared file system).

When: every `--checkpoint-every` seconds of training, rank 0 picks a step T a little ahead
(a fifth of a second of its steps, at least 2, so its message reaches every rank first) and tells
every rank. A worker saves at its first step boundary at or after T, a server at its first
update at or after version T; a call that comes while an earlier one is pending is dropped.
Under the lockstep strategies (allreduce, bsp, absp) every rank saves at T itself (a rank the
call reaches after T skips that checkpoint, which stays incomplete), so a resumed run
continues exactly where it was; under the others, each rank's state is its own at about that
time.

What: a worker's replica (parameters, optimizer state, and the module's buffers such as
BatchNorm's running statistics; files written before 2026-12-03 have no buffers, and a
resume from one keeps the new module's) and `WorkerState.state_dict` (its
place in the data, straggler draws, RNG, training seconds); a server's shard (`Shard`);
both with the bytes moved so far. Not saved: state a strategy program keeps between steps
(Ako's accumulated gradient not yet sent, messages in flight), which starts empty again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tomllib
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from ako.checks import misfit
from ako.config import ConfigError
from ako.metrics import WriteFailed, save_torch
from ako.replica import buffers_misfit
from ako.strategies.tags import CHECKPOINT

FORMAT = 1
_KEEP = 2
_SINCE_LATER = ("dataset",)  # identity fields that files written before 2026-12-05 lack


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read or does not fit the run (one line, exit status 2)."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file that cannot be read or is not whole: an older one may do."""


def directory(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def path(run_dir: str | os.PathLike, point: int, rank: int) -> Path:
    """The file of rank `rank` in the checkpoint at step `point`."""
    return directory(run_dir) / f"{point:09d}" / f"rank{rank}.pt"


def _marker(run_dir: str | os.PathLike, point: int, rank: int) -> Path:
    return directory(run_dir) / f"{point:09d}" / f"rank{rank}.lost"


def save(run_dir: str | os.PathLike, point: int, rank: int, world: int, state: dict, lost=()) -> None:
    """Write rank `rank`'s `state` for step `point` atomically (rank 0 first marks the
    `lost` ranks). Of its older files it keeps the last `_KEEP` and its part of the latest
    complete checkpoint (of `world` ranks). Raises WriteFailed (naming the file and the reason,
    no temporary file left) when it cannot be written: older checkpoints are left as they are."""
    target = path(run_dir, point, rank)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for r in lost:
            _marker(run_dir, point, r).touch()
    except OSError as e:
        raise WriteFailed(e.errno, e.strerror or str(e), str(target.parent)) from None
    try:
        save_torch({"format": FORMAT, "point": point, "rank": rank, **state}, target)
    except WriteFailed:
        try:
            target.parent.rmdir()  # no empty folder per skipped checkpoint (other ranks' files keep it)
        except OSError:
            pass
        raise
    complete = latest(run_dir, world)
    mine = sorted(directory(run_dir).glob(f"*/rank{rank}.pt"))
    for old in mine[:-_KEEP]:
        if int(old.parent.name) == complete:
            continue
        for marker in old.parent.glob("*.lost") if rank == 0 else ():  # while its own file keeps the directory
            marker.unlink(missing_ok=True)
        old.unlink(missing_ok=True)
        try:
            old.parent.rmdir()
        except OSError:  # other ranks' files are still in it
            pass


def _points(run_dir: str | os.PathLike) -> list[int]:
    """The steps of the checkpoints in `run_dir`, newest first."""
    return sorted((int(d.name) for d in directory(run_dir).glob("[0-9]*") if d.name.isdigit()), reverse=True)


def drop_after(run_dir: str | os.PathLike, point: int) -> None:
    """Delete the checkpoints after step `point` (a resumed run goes on from `point`)."""
    for later in (p for p in _points(run_dir) if p > point):
        shutil.rmtree(directory(run_dir) / f"{later:09d}", ignore_errors=True)


def _complete(run_dir: str | os.PathLike, point: int, world: int) -> bool:
    return all(path(run_dir, point, r).is_file() or _marker(run_dir, point, r).is_file() for r in range(world))


def stand_ins(run_dir: str | os.PathLike, point: int) -> list[int]:
    """The ranks lost before the checkpoint at step `point`: they resume from rank 0's part."""
    return sorted(int(m.name[4:-5]) for m in (directory(run_dir) / f"{point:09d}").glob("rank*.lost"))


def latest(run_dir: str | os.PathLike, world: int) -> int | None:
    """The step of the latest checkpoint that has every one of `world` ranks' files, or None."""
    return next((p for p in _points(run_dir) if _complete(run_dir, p, world)), None)


def load(run_dir: str | os.PathLike, point: int, rank: int) -> dict:
    """Rank `rank`'s state at step `point` (rank 0's, for a rank lost before it). Raises
    DamagedCheckpoint when it cannot be read."""
    if not path(run_dir, point, rank).is_file() and _marker(run_dir, point, rank).is_file():
        rank = 0
    file = path(run_dir, point, rank)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol ...": the error, if any, says enough
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint {str(file)!r}: not found") from None
    except Exception as e:  # whatever the bytes make torch's unpickler raise: the file is damaged
        raise DamagedCheckpoint(f"checkpoint {str(file)!r}: cannot read it ({_unreadable(e)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise DamagedCheckpoint(f"checkpoint {str(file)!r}: not an ako checkpoint (a dict with format {FORMAT})")
    return state


def _unreadable(error: Exception) -> str:
    """Why torch.load failed, in a few words (not torch's advice to load the file unsafely)."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
        if text.strip().startswith("Unsupported global"):
            what = text.strip().split(" was not", 1)[0].removeprefix("Unsupported global: ").removeprefix("GLOBAL ")
            return f"it holds an object of {what}, not only tensors, numbers, strings, lists and dicts"
    first = text.strip().splitlines()[0].split(". ")[0][:160] if text.strip() else ""
    return f"not a file of torch.save: {type(error).__name__}" + (f" {first}" if first else "")


_OPTIMIZATION = {"optimizer": {"state": dict, "param_groups": list}, "steps": int}  # `Optimization.state_dict`
_LAYOUT = {  # what `Checkpoints.save` writes: the type of every value a resume reads
    "worker": {
        "params": torch.Tensor,
        "optimizer": _OPTIMIZATION,
        "worker": {"step": int, "samples": int, "taken": int, "waiting": torch.Tensor, "waiting_since": torch.Tensor,
                   "slowdown_rng": str, "torch_rng": torch.Tensor, "seconds": (int, float), "wall": (int, float)},
        "bytes": [int, int],
    },
    "server": {
        "shard": {"params": torch.Tensor, "optimizer": _OPTIMIZATION, "version": int,
                  "staleness_sum": int, "staleness_count": int, "staleness_max": int},
        "bytes": [int, int],
    },
}  # fmt: skip


def _misfit(value, layout, where: str = "") -> str | None:
    """Where `value` first differs from `layout` (a type, a tuple of types, a dict of
    layouts or a list of them, item by item), in words, or None when it fits."""
    if isinstance(layout, dict):
        if not isinstance(value, dict):
            return f"its {where} is {value!r:.40} ({type(value).__name__}, not dict)"
        for key, inner in layout.items():
            name = f"{where}.{key}" if where else key
            if key not in value:
                return f"it has no {name}"
            if (why := _misfit(value[key], inner, name)) is not None:
                return why
        return None
    if isinstance(layout, list):
        if not (isinstance(value, (list, tuple)) and len(value) == len(layout)):
            return f"its {where} is {value!r:.40} (not a list of {len(layout)})"
        return next((w for i, (v, t) in enumerate(zip(value, layout)) if (w := _misfit(v, t, f"{where}[{i}]"))), None)
    if isinstance(value, bool) or not isinstance(value, layout):
        wanted = " or ".join(t.__name__ for t in (layout if isinstance(layout, tuple) else (layout,)))
        return f"its {where} is {value!r:.40} ({type(value).__name__}, not {wanted})"
    if layout in (int, (int, float)) and value < 0:  # steps, counts, seconds and bytes
        return f"its {where} is {value!r}, negative"
    return None


def _misfit_values(state: dict, role: str) -> str | None:
    """What `_LAYOUT`'s types leave open that a resume needs: one parameter group (the
    replica's flat vector, or a server's shard), a worker's buffers (optional: older files
    have none) as tensors by name, torch's and the straggler draws' RNG states of this torch
    and NumPy."""
    optimizer = state["optimizer"] if role == "worker" else state["shard"]["optimizer"]
    groups = optimizer["optimizer"]["param_groups"]
    if len(groups) != 1:
        return f"its optimizer has {len(groups)} parameter groups, not 1"
    if role == "server":
        return None
    buffers = state.get("buffers", {})
    if not (isinstance(buffers, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items())):
        return "its buffers are not tensors by name"
    rng = state["worker"]["torch_rng"]
    if rng.dtype != torch.uint8 or rng.numel() != torch.get_rng_state().numel():
        return f"its worker.torch_rng is not a state of torch's generator ({rng.numel()} {rng.dtype} values)"
    try:
        draws = json.loads(state["worker"]["slowdown_rng"])
    except ValueError:
        draws = None
    if not (isinstance(draws, dict) and draws.get("bit_generator") == "PCG64"):
        return "its worker.slowdown_rng is not a state of NumPy's PCG64 generator"
    return None


def check(state: dict, expected: dict, file: str, contents: bool = False, buffers: dict | None = None) -> None:
    """Raise CheckpointError naming the first field of `expected` that `state` differs in;
    with `contents`, DamagedCheckpoint naming the first part of a worker's or server's state
    that is missing or of the wrong type (`_LAYOUT`), or a worker's parameters that are not
    `expected["numel"]` numbers, then CheckpointError for a worker's saved buffers that do not
    fit the model's `buffers` layout (`Replica.buffer_layout`; the files of older ako, without
    buffers, fit)."""
    role = state.get("role")
    if contents and role not in _LAYOUT:
        raise DamagedCheckpoint(f"checkpoint {file!r}: damaged, its role is {role!r:.40}, not 'worker' or 'server'")
    for key, want in expected.items():
        if key in _SINCE_LATER and key not in state:  # a file of an older ako: it does not say
            continue
        if state.get(key) != want:
            raise CheckpointError(
                f"checkpoint {file!r}: written by a run with {key} {state.get(key)!r:.60}, not {want!r}; "
                "resume with the settings it was written with"
            )
    if contents:
        why = _misfit(state, _LAYOUT[role]) or _misfit_values(state, role)
        if why is None and role == "worker" and state["params"].numel() != expected.get("numel", state["params"].numel()):
            why = f"its params are {state['params'].numel()} numbers, not {expected['numel']}"
        if why is not None:
            raise DamagedCheckpoint(f"checkpoint {file!r}: damaged, {why}")
        if role == "worker" and buffers is not None and "buffers" in state and (why := buffers_misfit(state["buffers"], buffers)):
            raise CheckpointError(f"checkpoint {file!r}: written by another model ({why}); "
                                  "resume with the model it was written with")  # fmt: skip


@contextmanager
def restoring(file: str):
    """Restore from the checkpoint `file` in this block: a file whose values have the right
    types but do not fit this run's replica or optimizer (tensor sizes, parameter groups) is
    CheckpointError, one line, rather than torch's traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CheckpointError(str(misfit(f"checkpoint {file!r}", e))) from None


def check_unfinished(config) -> None:
    """Raise CheckpointError when `config.resume` names a run that finished whole (its
    summary.json is written and no rank was lost) and `config` would not train it further (no
    more epochs or time): resuming would only redo its last steps and overwrite its results.
    A run that carried on without a lost worker may be resumed, to redo its end with all."""
    run_dir = Path(config.resume)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        saved = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):  # not finished (or unreadable: `find` says what is wrong)
        return
    if summary.get("lost_ranks"):
        return
    longer = config.epochs > float(saved.get("epochs", 0)) or (
        config.max_time is not None and config.max_time > float(saved.get("max_time") or math.inf))
    if not longer:
        raise CheckpointError(f"resume {str(run_dir)!r}: that run finished (its summary.json is written); "
                              "give a larger --epochs (or --max-time) to train it further")  # fmt: skip


def check_ahead(config, point: int, train_samples: int) -> None:
    """Raise CheckpointError when the checkpoint at step `point` that `config.resume` resumes
    from is already at or past the steps `config.epochs` plans (with `train_samples` samples
    split among `config.workers`, as `DataCursor` counts them): the resumed run would take one
    step and report the checkpoint's epochs against the config's."""
    per_epoch = max(1, train_samples // config.workers // config.step_samples)
    planned = max(1, round(config.epochs * per_epoch))
    if point >= planned:
        raise CheckpointError(f"resume {str(config.resume)!r}: its checkpoint is at step {point} ({point / per_epoch:.4g} "
                              f"epochs), and --epochs {config.epochs:g} plans {planned} in all; give more epochs to train it further")  # fmt: skip


def find(run_dir: str | os.PathLike, expected: dict, workers: int, say: bool = False, buffers: dict | None = None) -> int:
    """The step of `run_dir`'s latest complete, intact checkpoint (complete for the world size
    it was written by), after checking that every rank's file reads, is whole and fits
    `expected`, the model's `buffers` (`check`) and this job's split into `workers` workers and
    the servers after them. A
    damaged newer checkpoint is passed over for an older intact one (with `say`, a line on
    stderr says so). Raises CheckpointError: no intact complete checkpoint (the newest
    damage is named), or one written by another run."""
    if not os.path.isdir(run_dir):
        what = "a file, not a run directory" if os.path.exists(run_dir) else "no such directory"
        raise CheckpointError(f"resume {str(run_dir)!r}: {what}")
    damaged: list[tuple[int, str]] = []
    for point in _points(run_dir):
        if not path(run_dir, point, 0).is_file():
            continue
        try:
            world = load(run_dir, point, 0).get("world")
            if not (isinstance(world, int) and _complete(run_dir, point, world)):
                continue
            for rank in range(world):
                role = "worker" if rank < workers else "server"
                check(load(run_dir, point, rank), {**expected, "role": role}, str(path(run_dir, point, rank)), True, buffers)
        except DamagedCheckpoint as e:
            damaged.append((point, str(e)))
            continue
        if damaged and say:
            newest, why = damaged[0]
            print(f"ako: {why}; resuming from the intact checkpoint at step {point} instead of step {newest}",
                  file=sys.stderr, flush=True)  # fmt: skip
        lost = stand_ins(run_dir, point)
        if lost and say:
            print(f"ako: worker rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} had been lost before "
                  f"the checkpoint at step {point}: {'they start' if len(lost) > 1 else 'it starts'} again from rank 0's part",
                  file=sys.stderr, flush=True)  # fmt: skip
        return point
    if damaged:
        raise CheckpointError(f"resume {str(run_dir)!r}: no intact complete checkpoint; the newest: {damaged[0][1]}")
    raise CheckpointError(f"resume {str(run_dir)!r}: no complete checkpoint in it (one file per rank)")


class Checkpoints:
    """This rank's part in checkpointing a run (`ako.run.worker.Checkpointer`): rank 0 calls
    for a checkpoint at a step (`announce`), each worker saves its part when it gets there
    (`save`, from `WorkerState`), a server at its first update at or after that version
    (`on_update`). `runtime` is this rank's `DistributedRuntime` (its mailbox, worker state and
    byte counts); `every` the seconds of training between checkpoints; `identity` what every
    checkpoint of this run must agree with (`Job.identity`). A checkpoint a rank cannot write
    (a full disk) is skipped with one line (`store`, the job's, counts the ranks' reports) and
    training goes on; the older complete one stays."""

    def __init__(self, runtime, run_dir: Path, every: float, identity: dict, lockstep: bool = False, store=None):
        self.runtime, self.run_dir, self.every, self.identity = runtime, run_dir, every, identity
        self.store = store  # the job's torch.distributed Store: one line for a skipped checkpoint
        self.lockstep = lockstep  # `Strategy.lockstep`: save only at the very step called for
        self.due: int | None = None  # a server's: the step rank 0 called for

    def called(self, point: int) -> None:
        """Rank 0's call for a checkpoint at step `point` arrived (the mailbox's callback). A
        call still pending (this rank has not reached its step yet) is kept and the newer one
        dropped: under the asynchronous strategies a worker that lags rank 0 by more steps
        than a call leads would otherwise meet a newer call before every step it was called
        for, and never save a complete checkpoint."""
        state = self.runtime.state
        if state is not None and state.checkpoint_at is None:
            state.checkpoint_at = point
        elif state is None and self.due is None:
            self.due = point

    def announce(self, point: int) -> None:
        """Rank 0: tell every other rank to save its part of the checkpoint at step `point`."""
        mailbox = self.runtime.mailbox
        for peer in mailbox.peers:
            if peer not in mailbox.lost:
                mailbox.send(torch.empty(0), peer, CHECKPOINT, step=point, drop_lost=True)

    def save(self, point: int, shard=None) -> None:
        """Save this rank's part of the checkpoint at step `point`: a worker's replica and
        place in the run, or a server's `shard`."""
        state = self.runtime.state
        if self.lockstep and (state.cursor.step if state is not None else shard.version) != point:
            return  # the call came late (a busy receive thread): this checkpoint stays incomplete
        if state is not None:
            own = {
                "role": "worker",
                "params": state.replica.params.detach().cpu().clone(),
                "optimizer": state.replica.optimizer.state_dict(),
                "buffers": state.replica.buffers(),
                "worker": state.state_dict(),
            }
        else:
            own = {"role": "server", "shard": shard.state_dict()}
        saved = {**self.identity, **own, "bytes": list(self.runtime.bytes_moved())}
        lost = sorted(self.runtime.mailbox.lost) if self.runtime.rank == 0 else ()
        try:
            save(self.run_dir, point, self.runtime.rank, self.runtime.world_size, saved, lost)
        except WriteFailed as e:  # a full disk: training matters more than this checkpoint
            self._skipped(point, e)

    def _skipped(self, point: int, error: WriteFailed) -> None:
        """Say, once per checkpoint whichever ranks failed to write it (counted in the job's
        `store`), that it is skipped and which complete one stays."""
        try:
            first = self.store is None or self.store.add(f"ako/checkpoint-skipped/{point}", 1) == 1
        except Exception:  # noqa: BLE001 - the store's errors: say it rather than not at all
            first = True
        if first:
            kept = latest(self.run_dir, self.runtime.world_size)
            stays = f"the one at step {kept} stays the latest complete" if kept is not None else "there is no complete one yet"
            print(f"ako: checkpoint at step {point} skipped ({error}); training goes on, {stays}", file=sys.stderr, flush=True)

    def on_update(self, shard) -> None:
        """A server's shard was updated: save it if a checkpoint is due at its version."""
        if self.due is not None and shard.version >= self.due:
            point, self.due = self.due, None
            self.save(point, shard)
