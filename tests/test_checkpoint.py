"""Checkpoint files: written atomically, read with weights_only=True, and a checkpoint that
cannot be read or does not fit the run is refused with one line (exit status 2) before any
process starts."""

from __future__ import annotations

import json
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from helpers import small_config

from ako.cli import main
from ako.config import to_toml
from ako.runtime.distributed import checkpoint
from ako.run.job import Job


class Payload:
    """Not a tensor, number, string, list or dict: weights_only=True refuses to unpickle it."""


def worker_state(numel: int) -> dict:
    """A worker's part of a checkpoint, as `Checkpoints.save` lays it out (the values do not matter here)."""
    return {
        "role": "worker",
        "params": torch.zeros(numel),
        "optimizer": {"optimizer": {"state": {}, "param_groups": [{"params": [0]}]}, "scheduler": None, "steps": 0},
        "buffers": {},
        "worker": {"step": 7, "samples": 0, "taken": 0, "waiting": torch.zeros(0, dtype=torch.long),
                   "waiting_since": torch.zeros(0, dtype=torch.long),
                   "slowdown_rng": json.dumps(np.random.default_rng(0).bit_generator.state),
                   "torch_rng": torch.get_rng_state(), "seconds": 1.0, "wall": 1.0},
        "bytes": [0, 0],
    }  # fmt: skip


SERVER_STATE = {
    "role": "server",
    "shard": {"params": torch.zeros(3), "optimizer": {"optimizer": {"state": {}, "param_groups": [{"params": [0]}]}, "steps": 0},
              "version": 7, "staleness_sum": 0, "staleness_count": 0, "staleness_max": 0},
    "bytes": [0, 0],
}  # fmt: skip


def checkpointed_run(tmp_path, servers: int = 0, **overrides):
    """A run directory as `ako train --checkpoint-every` leaves it: its config and a complete
    checkpoint at step 7 that fits it (2 workers, then `servers` servers)."""
    config = small_config(tmp_path, checkpoint_every="1s", servers=servers or None, **overrides)
    job = Job(config)
    numel = job.build_replica(job.load_data(), torch.device("cpu")).numel
    path = tmp_path / "runs" / "run"
    path.mkdir(parents=True)
    (path / "config.toml").write_text(to_toml(config))
    for rank in range(2 + servers):
        checkpoint.save(path, 7, rank, 2 + servers, {**job.identity(numel, "digits"), **(worker_state(numel) if rank < 2 else SERVER_STATE)})
    return path


@pytest.fixture
def run_dir(tmp_path):
    return checkpointed_run(tmp_path, strategy="allreduce")


def resume(run_dir, capsys, *flags):
    code = main(["train", "--resume", str(run_dir), *flags])
    return code, capsys.readouterr().err


def test_a_fitting_checkpoint_is_found(run_dir):
    assert checkpoint.latest(run_dir, 2) == 7
    assert checkpoint.load(run_dir, 7, 1)["rank"] == 1
    assert [p.name for p in run_dir.rglob("*") if p.name.startswith(".")] == []  # no temporary files


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--workers", "3"], "written by a run with world 2, not 3"),
        (["--model", "mlp"], "written by a run with model 'cnn', not 'mlp'"),
        (["--strategy", "gossip"], "written by a run with strategy 'allreduce', not 'gossip'"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused(run_dir, capsys, flags, message):
    code, err = resume(run_dir, capsys, *flags)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_corrupt_checkpoint_is_refused(run_dir, capsys):
    checkpoint.path(run_dir, 7, 0).write_bytes(b"not a checkpoint")
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "rank0.pt': cannot read it" in err, err


def test_a_corrupt_file_of_any_rank_is_refused_before_anything_starts(run_dir, capsys):
    checkpoint.path(run_dir, 7, 1).write_bytes(b"not a checkpoint")
    before = (run_dir / "config.toml").read_text()
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "rank1.pt': cannot read it" in err, err
    assert (run_dir / "config.toml").read_text() == before


def test_another_worker_server_split_is_refused(tmp_path, capsys):
    """bsp with 2 workers and 1 server, resumed as 1 worker and 2 servers: the same world size."""
    run_dir = checkpointed_run(tmp_path, servers=1, strategy="bsp")
    code, err = resume(run_dir, capsys, "--workers", "1", "--servers", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert "rank1.pt': written by a run with role 'worker', not 'server'" in err, err


def test_a_checkpoint_that_would_run_code_is_refused(run_dir, capsys):
    torch.save({"format": checkpoint.FORMAT, "payload": Payload()}, checkpoint.path(run_dir, 7, 0))
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot read it (it holds an object of test_checkpoint.Payload, not only tensors" in err, err
    assert "weights_only" not in err, err


def test_an_incomplete_checkpoint_is_not_resumed(run_dir, capsys):
    checkpoint.path(run_dir, 7, 1).unlink()
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "no complete checkpoint in it" in err, err


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, 3, 0, 1, {"unpicklable": lambda: None})
    assert list(tmp_path.rglob("*.pt")) == [] and list(tmp_path.rglob(".*")) == []


def test_each_rank_keeps_two_files_and_the_latest_complete_checkpoint(tmp_path):
    checkpoint.save(tmp_path, 1, 1, 2, {})
    checkpoint.save(tmp_path, 1, 0, 2, {})  # step 1 is complete
    for point in (2, 3, 4):  # rank 1 is gone: later checkpoints stay incomplete
        checkpoint.save(tmp_path, point, 0, 2, {})
    kept = sorted(str(p.relative_to(tmp_path / "checkpoints")) for p in tmp_path.rglob("*.pt"))
    assert kept == ["000000001/rank0.pt", "000000001/rank1.pt", "000000003/rank0.pt", "000000004/rank0.pt"]
    assert checkpoint.latest(tmp_path, 2) == 1


class _Rank:
    """What `checkpoint.Checkpoints` reads of a runtime: the worker state (None on a server)."""

    def __init__(self, state):
        self.state = state


class _State:
    checkpoint_at = None


@pytest.mark.parametrize("role", ["worker", "server"])
def test_a_pending_call_for_a_checkpoint_is_kept_over_a_newer_one(role):
    # A rank that lags rank 0 meets the next call before the step it was called for: it must
    # still save at that step, or under asp it may never save a complete checkpoint.
    state = _State() if role == "worker" else None
    calls = checkpoint.Checkpoints(_Rank(state), None, 0.2, {})
    calls.called(40)
    calls.called(85)
    assert (state.checkpoint_at if state else calls.due) == 40
    if state:
        state.checkpoint_at = None  # saved at step 40
    else:
        calls.due = None
    calls.called(130)
    assert (state.checkpoint_at if state else calls.due) == 130


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    """Steps 7 and 9 complete; step 9's rank 1 file damaged: the resume takes step 7 and
    says why in one whole line."""
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    job = Job(small_config(tmp_path, checkpoint_every="1s", strategy="allreduce"))
    identity = job.identity(job.build_replica(job.load_data(), torch.device("cpu")).numel, "digits")
    for rank in range(2):
        checkpoint.save(run_dir, 9, rank, 2, {**identity, **worker_state(identity["numel"])})
    checkpoint.path(run_dir, 9, 1).write_bytes(b"cut off")
    assert checkpoint.find(run_dir, identity, 2, say=True) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "000000009/rank1.pt': cannot read it" in err
    assert err.rstrip().endswith("resuming from the intact checkpoint at step 7 instead of step 9")
    checkpoint.path(run_dir, 7, 0).write_bytes(b"cut off too")
    with pytest.raises(checkpoint.CheckpointError, match="no intact complete checkpoint; the newest: checkpoint .*000000009"):
        checkpoint.find(run_dir, identity, 2)


def _damage(run_dir, how: str) -> None:
    """Damage rank 1's file of the checkpoint at step 9 in one of the ways a disk or a hand does."""
    file = checkpoint.path(run_dir, 9, 1)
    state = torch.load(file, weights_only=True)
    if how == "text":
        file.write_bytes(b"hello" * 100)
    elif how == "random bytes":
        file.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist()))
    elif how == "plain pickle":
        file.write_bytes(pickle.dumps({"format": checkpoint.FORMAT}, protocol=4))
    else:
        if how == "step 'abc'":
            state["worker"]["step"] = "abc"
        elif how == "optimizer {}":
            state["optimizer"] = {}
        elif how == "params cut":
            state["params"] = state["params"][:5]
        elif how == "step -5":
            state["worker"]["step"] = -5
        elif how == "two parameter groups":
            groups = state["optimizer"]["optimizer"]["param_groups"]
            groups.append(dict(groups[0]))
        elif how == "torch rng cut":
            state["worker"]["torch_rng"] = state["worker"]["torch_rng"][:7]
        elif how == "buffers of numbers":
            state["buffers"] = {"1.running_mean": 0.5}
        elif how == "another numpy rng":
            state["worker"]["slowdown_rng"] = json.dumps({"bit_generator": "MT19937", "state": {}})
        torch.save(state, file)


@pytest.mark.parametrize(
    "how,why",
    [
        ("text", "cannot read it (not a file of torch.save: KeyError 101)"),
        ("random bytes", "cannot read it (not a file of torch.save: UnpicklingError"),
        ("plain pickle", "cannot read it (not a file of torch.save: UnpicklingError Unsupported operand 149)"),
        ("step 'abc'", "damaged, its worker.step is 'abc' (str, not int)"),
        ("optimizer {}", "damaged, it has no optimizer.optimizer"),
        ("params cut", "damaged, its params are 5 numbers, not"),
        ("step -5", "damaged, its worker.step is -5, negative"),
        ("two parameter groups", "damaged, its optimizer has 2 parameter groups, not 1"),
        ("torch rng cut", "damaged, its worker.torch_rng is not a state of torch's generator (7 torch.uint8 values)"),
        ("another numpy rng", "damaged, its worker.slowdown_rng is not a state of NumPy's PCG64 generator"),
        ("buffers of numbers", "damaged, its buffers are not tensors by name"),
    ],
)
def test_damaged_contents_fall_back_to_the_newest_intact_checkpoint(tmp_path, capsys, how, why):
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    identity = {**torch.load(checkpoint.path(run_dir, 7, 0), weights_only=True)}
    identity = {k: identity[k] for k in ("strategy", "model", "optimizer_name", "numel", "world")}
    for rank in range(2):
        checkpoint.save(run_dir, 9, rank, 2, {**identity, **worker_state(identity["numel"])})
    _damage(run_dir, how)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warnings about the file stay out of the one line
        assert checkpoint.find(run_dir, identity, 2, say=True) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"000000009/rank1.pt': {why}" in err, err
    assert err.rstrip().endswith("resuming from the intact checkpoint at step 7 instead of step 9"), err


def test_a_checkpoint_that_does_not_fit_the_optimizer_is_one_line(tmp_path):
    """Values of the right types that torch refuses (another number of parameter groups)."""
    replica = Job(small_config(tmp_path)).build_replica(Job(small_config(tmp_path)).load_data(), torch.device("cpu"))
    state = {**worker_state(replica.numel)["optimizer"], "optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(checkpoint.CheckpointError, match=r"^checkpoint 'f.pt': damaged, it does not fit this run \(ValueError: "):
        with checkpoint.restoring("f.pt"):
            replica.optimizer.load_state_dict(state)


def test_a_replica_s_buffers_go_into_another_and_misfits_are_one_line(tmp_path):
    """BatchNorm's running statistics travel through `buffers` and `load_buffers` (what a
    worker's checkpoint holds); a missing buffer or one of another shape is one line."""
    job = Job(small_config(tmp_path, model="own_training:digits_net"))
    data = job.load_data()
    trained, fresh = (job.build_replica(data, torch.device("cpu")) for _ in range(2))
    trained.compute_gradient([(data.train[:16][0], data.train[:16][1])])  # a forward in train mode moves the statistics
    saved = trained.buffers()
    assert saved.keys() == {"1.running_mean", "1.running_var", "1.num_batches_tracked"} and saved["1.num_batches_tracked"] == 1
    fresh.load_buffers(saved)
    assert all(torch.equal(fresh.buffers()[name], saved[name]) for name in saved)
    for broken, error in (({**saved, "1.running_mean": torch.zeros(3)}, "ValueError"),
                          ({**saved, "1.running_mean": torch.zeros(1)}, "ValueError"),  # copy_ would broadcast it
                          ({**saved, "1.num_batches_tracked": torch.tensor(2.7)}, "ValueError"),  # or convert it
                          ({k: v for k, v in saved.items() if k != "1.running_var"}, "ValueError")):  # fmt: skip
        with pytest.raises(checkpoint.CheckpointError, match=rf"^checkpoint 'f.pt': damaged, it does not fit this run \({error}: "):
            with checkpoint.restoring("f.pt"):
                fresh.load_buffers(broken)


def test_saved_buffers_that_do_not_fit_the_model_are_found_before_the_resume(tmp_path):
    """`find` with the model's buffer layout refuses a checkpoint whose buffers another model
    wrote, in one line; a file without buffers (of an older ako) fits."""
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    state = torch.load(checkpoint.path(run_dir, 7, 1), weights_only=True)
    identity = {k: state[k] for k in ("strategy", "model", "optimizer_name", "numel", "world")}
    layout = {"bn.running_mean": (torch.float32, (16,)), "bn.num_batches_tracked": (torch.int64, ())}
    for saved in ({"bn.running_mean": torch.zeros(16), "bn.num_batches_tracked": torch.tensor(3)}, None):
        if saved is None:
            state.pop("buffers")
        else:
            state["buffers"] = saved
        for rank in range(2):
            torch.save({**state, "rank": rank}, checkpoint.path(run_dir, 7, rank))
        assert checkpoint.find(run_dir, identity, 2, buffers=layout) == 7
    for saved, why in (({"bn.running_mean": torch.zeros(8), "bn.num_batches_tracked": torch.tensor(3)},
                        "buffer bn.running_mean is torch.float32 (8,), the model's torch.float32 (16,)"),
                       ({"bn.running_mean": torch.zeros(16)}, "it has no buffer bn.num_batches_tracked"),
                       ({"bn.running_mean": torch.zeros(16).to_sparse(), "bn.num_batches_tracked": torch.tensor(3)},
                        "buffer bn.running_mean is not a dense tensor with values (torch.sparse_coo)")):  # fmt: skip
        state["buffers"] = saved
        torch.save(state, checkpoint.path(run_dir, 7, 1))
        with pytest.raises(checkpoint.CheckpointError, match=rf"^checkpoint '.*rank1.pt': written by another model \({re.escape(why)}\); resume with the model it was written with$"):
            checkpoint.find(run_dir, identity, 2, buffers=layout)
    # BatchNorm's statistics, resumed with a module without buffers (GroupNorm, as many parameters)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank1.pt': written by another model \(buffer bn.num_batches_tracked is not the model's \(it has none\)\)"):
        checkpoint.find(run_dir, identity, 2, buffers={})


def test_a_resume_leaves_out_damaged_metrics_lines_in_one_line(tmp_path, capsys):
    """metrics.jsonl on resume: a line a crash cut short mid-append, or an edit, is left out
    with one line on stderr (it ended in a JSONDecodeError traceback); the records up to the
    checkpoint's time are kept, those after it dropped."""
    from ako.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"time": 1.0, "x": 1}\ngarbage\n{"foo": 1}\n{"time": "x"}\n{"time": 2.0, "x": 2}\n{"time": 9.0}\n{"tim')
    log = MetricsLog(path)
    log.resume(until=5.0)
    assert log.records == [{"time": 1.0, "x": 1}, {"time": 2.0, "x": 2}]
    assert [json.loads(line) for line in path.read_text().splitlines()] == log.records
    assert capsys.readouterr().err == f"ako: {path}: 4 damaged line(s) left out\n"
