"""A worker or server killed mid-run, and resuming from a checkpoint.

Every strategy: a 2-worker run that checkpoints every 0.2 s loses worker 1 (kill -9) once a
complete checkpoint is in. A synchronous job ends within 20 s naming the rank; a decentralised
or asynchronous one carries on without it and reports the loss. Either way a resumed run then
continues from the last complete checkpoint to the end, and for the deterministic strategies
it ends with the parameters of a run that was never interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import default_sigint, descendants, find_process, gone, run_and_kill, wait_for_checkpoint

import ako
from ako.config import PARAMETER_SERVER, STRATEGIES, TrainConfig, load_toml
from ako.metrics import format_summary
from ako.runtime.distributed import checkpoint, launcher

SURVIVES = {"ako", "gossip", "asp", "easgd"}  # carry on without a dead worker
DETERMINISTIC = {"allreduce", "bsp"}


def start_and_kill(out_dir: Path, strategy: str, victim: str = "ako-rank1", *extra: str):
    """Start a 2-worker `ako train` that checkpoints, kill -9 `victim` once a complete checkpoint is in;
    returns (exit status, stdout, stderr, seconds from the kill to the end)."""
    world = 3 if strategy in PARAMETER_SERVER else 2
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "2",
           "--dataset", "digits", "--batch-size", "16", "--epochs", "16", "--eval-every", "4",
           "--checkpoint-every", "0.2s", "--out-dir", str(out_dir), "--timeout", "60", "--no-progress",
           *extra]  # fmt: skip
    ready = lambda d, deadline: wait_for_checkpoint(d, world, deadline)  # noqa: E731
    return run_and_kill(cmd, victim, out_dir, ready=ready)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_killed_worker_then_resume(tmp_path, strategy):
    out_dir = tmp_path / "runs"
    code, out, err, elapsed = start_and_kill(out_dir, strategy)
    assert "Traceback" not in err, err
    (run_dir,) = out_dir.glob("*")
    if strategy in SURVIVES:
        assert code == 0, err
        assert "worker rank 1 died (killed by SIGKILL)" in out and "the others carried on" in out, out  # the launcher's cause
        assert "samples trained per worker (rank 0) " in out, out  # the figures are the survivors'
        assert "the shard of lost worker rank 1 (" in out and "samples) not trained from the loss on" in out, out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["lost_ranks"] == [1]
        assert [(loss["rank"], loss["role"], loss["how"]) for loss in summary["lost"]] == [(1, "worker", "died")]
        assert [w["rank"] for w in summary["per_worker"]] == [0]
    else:
        assert code == 1, err
        assert elapsed < 20, f"took {elapsed:.1f} s"
        assert "worker rank 1 failed: killed by SIGKILL" in err, err
        assert err.count("ako: ") == 1, err  # the others' lines (they only met the loss) are folded
    world = 3 if strategy in PARAMETER_SERVER else 2
    point = checkpoint.latest(run_dir, world)
    config = TrainConfig(**load_toml(run_dir / "config.toml"))
    resumed = ako.train(replace(config, resume=str(run_dir)))
    summary = resumed.summary
    assert summary["resumed_from_step"] == point > 0
    steps = [w["steps"] for w in summary["per_worker"]]
    assert steps[0] == steps[1] > point  # both workers back, to the end
    assert summary["lost_ranks"] == []
    if strategy in DETERMINISTIC:
        whole = ako.train(replace(config, checkpoint_every=None, out_dir=str(tmp_path / "whole")))
        for a, b in zip(whole.workers, resumed.workers, strict=True):
            torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["asp"])  # even a strategy that survives worker losses
def test_killed_server_stops_the_job_naming_it(tmp_path, strategy):
    code, _, err, elapsed = start_and_kill(tmp_path / "runs", strategy, "ako-server2")
    assert code == 1, err
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert "server rank 2 failed: killed by SIGKILL" in err, err
    assert err.count("ako: ") == 1 and "lost worker rank 2" not in err, err
    assert "Traceback" not in err, err


def test_a_stopped_server_is_one_line_under_asp_as_under_bsp(tmp_path):
    """SIGSTOP the server of asp (which goes on without a lost worker, never without a server):
    the workers are not told it was "dropped"; one line names it, as under bsp."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "asp", "--workers", "2", "--dataset", "digits",
           "--epochs", "1000", "--max-time", "30", "--timeout", "3", "--checkpoint-every", "0.5s",
           "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    ready = lambda out_dir, deadline: wait_for_checkpoint(out_dir, 3, deadline)  # noqa: E731 -- training is under way
    code, _, err, _ = run_and_kill(cmd, "ako-server2", out_dir, sig=signal.SIGSTOP, limit=60, ready=ready)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("ako: server rank 2 failed: stopped (SIGSTOP or a debugger); the others timed out waiting for it"), err
    assert "dropped" not in err, err


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    """Under `torchrun --max-restarts 1`, a killed worker makes the agent restart the group,
    and the new attempt resumes in the same run directory from its last complete checkpoint,
    and ends with the parameters of the run never interrupted (the short version of
    benchmarks/soak.py's restart soak)."""
    out_dir = tmp_path / "runs"
    train = ["-m", "ako", "train", "--strategy", "allreduce", "--dataset", "digits", "--batch-size", "16",
             "--epochs", "6", "--eval-every", "2", "--checkpoint-every", "0.2s", "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *train]
    ready = lambda d, deadline: wait_for_checkpoint(d, 2, deadline)  # noqa: E731
    code, out, err, _ = run_and_kill(cmd, "ako-rank1", out_dir, ready=ready)
    assert code == 0, err[-3000:]
    (run_dir,) = out_dir.glob("*")  # the restart went on in the first attempt's directory
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] > 0
    assert f"resuming {run_dir} from its checkpoint at step {summary['resumed_from_step']}" in err
    assert [w["steps"] for w in summary["per_worker"]] == [summary["iterations"]] * 2
    config = TrainConfig(**load_toml(run_dir / "config.toml"))
    whole = ako.train(replace(config, checkpoint_every=None, out_dir=str(tmp_path / "whole")))
    saved, reference = (torch.load(Path(d) / "model.pt", weights_only=True) for d in (run_dir, whole.summary["run_dir"]))
    for name, value in reference.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6)


def test_a_lost_worker_under_the_ring_is_named_as_the_cause(tmp_path):
    """Ako's ring exchange cannot survive a loss (a collective needs every member): the run ends
    within seconds in one line, naming the killed rank (not rank 0 that failed on it), with no
    "lost" line first."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "ako", "--exchange", "ring", "--workers", "3",
           "--dataset", "digits", "--epochs", "1000", "--timeout", "30", "--checkpoint-every", "0.5s",
           "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    ready = lambda out_dir, deadline: wait_for_checkpoint(out_dir, 3, deadline)  # noqa: E731 -- training is under way
    code, _, err, elapsed = run_and_kill(cmd, "ako-rank1", out_dir, ready=ready)
    assert code == 1 and elapsed < 20, (code, elapsed)
    assert [line for line in err.splitlines() if "rank" in line] == ["ako: worker rank 1 failed: killed by SIGKILL"], err


def _dies_at_start(started: bool) -> int:
    """A launched process: rank 1 dies (SIGKILL). Unless `started`, the others then wait 60 s
    for a key no one sets, as ranks forming their process groups wait for a lost one; with
    `started`, rank 0 first marks the job started (its first step) and the others return."""
    from datetime import timedelta

    import torch.distributed as dist

    from ako.runtime.distributed import liveness

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))  # fmt: skip
    if started:
        if rank == 0:
            liveness.mark_started(store)
        store.wait([liveness.STARTED_KEY])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if not started:
        store.wait(["never set"])
    return rank


def test_a_worker_lost_before_training_begins_ends_the_job_at_once(capfd):
    """Before rank 0's first step no strategy goes on without a worker: the others are still
    starting (process groups, the plan's collectives) and would wait out the start-up timeout
    for it. The launcher ends the job when the worker dies, in one line naming it; from the
    first step on, the same loss is survived where the strategy survives it."""
    began = time.monotonic()
    with pytest.raises(launcher.WorkerFailed, match=r"^worker rank 1 failed: killed by SIGKILL before training began$"):
        launcher.launch_function(_dies_at_start, 3, False, timeout=60.0, survivable=(1, 2))
    assert time.monotonic() - began < 20  # not the others' 60 s
    assert "lost" not in capfd.readouterr().err
    assert launcher.launch_function(_dies_at_start, 3, True, timeout=60.0, survivable=(1, 2)) == {0: 0, 2: 2}
    assert "ako: worker rank 1 lost: killed by SIGKILL" in capfd.readouterr().err


@pytest.mark.parametrize("strategy,rank", [("ako", 2), ("allreduce", 2), ("gossip", 0)])
def test_a_stopped_worker_never_hangs_the_run(tmp_path, strategy, rank):
    """SIGSTOP for good: the process is alive but silent. The run still ends within the
    timeout, as after a kill: with the others carrying on and the summary saying it was
    stopped (ako), or with one line naming the stopped rank (allreduce; rank 0, which no
    strategy goes on without, after it has logged its metrics)."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "3", "--dataset", "digits",
           "--epochs", "1000", "--max-time", "8", "--timeout", "5", "--checkpoint-every", "1s",
           "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    ready = lambda out_dir, deadline: wait_for_checkpoint(out_dir, 3, deadline)  # noqa: E731 -- training is under way
    code, out, err, elapsed = run_and_kill(cmd, f"ako-rank{rank}", out_dir, sig=signal.SIGSTOP, limit=60, ready=ready)
    assert "Traceback" not in err, err
    assert elapsed < 5 * 3 + 10, f"took {elapsed:.1f} s"
    if strategy == "ako":
        assert code == 0, err
        assert "worker rank 2 was stopped (SIGSTOP or a debugger) and dropped (silent for 5 s" in out, out
        assert re.search(r"^ako: worker rank 2 was stopped \(SIGSTOP or a debugger\) and dropped \(.*5 s; found by rank [01]\)$", err, re.M), err
        assert err.count("was stopped") == 1, err  # by the first peer to drop it, not by each
        assert elapsed < 11.5, f"took {elapsed:.1f} s"  # 8 s here; 13 s when the stopped one was waited for again after rank 0
        return
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"ako: worker rank {rank} failed: stopped (SIGSTOP or a debugger); the others timed out"), err
    (run_dir,) = out_dir.glob("*")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and all(0 <= r["test_accuracy"] <= 1 for r in records)


@pytest.mark.parametrize("strategy", ["ako", "gossip"])
def test_a_worker_stopped_past_the_timeout_is_dropped_and_ends(tmp_path, strategy):
    """SIGSTOP for twice the timeout, then SIGCONT: the healthy workers wait at most about the
    timeout for it, then drop it and finish; the summary says it was stopped, the stopped one
    ends with one line (it was dropped), and the checkpoints after the drop are complete
    without it: a resume starts it again from rank 0's part and trains all three to the end."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "3", "--dataset", "digits",
           "--epochs", "120", "--timeout", "3", "--checkpoint-every", "0.5s", "--out-dir", str(out_dir),
           "--no-progress"]  # fmt: skip
    ready = lambda out_dir, deadline: wait_for_checkpoint(out_dir, 3, deadline)  # noqa: E731
    code, out, err, _ = run_and_kill(cmd, "ako-rank2", out_dir, sig=signal.SIGSTOP, limit=90, ready=ready, cont_after=6)
    assert code == 0 and "Traceback" not in err, err
    assert "worker rank 2 was stopped (SIGSTOP or a debugger) and dropped (silent for 3 s" in out, out
    assert "ako: worker rank 2 lost: dropped by the others: rank " in err, err
    assert re.search(r"^ako: worker rank 2 was stopped \(SIGSTOP or a debugger\) and dropped \(.*3 s; found by rank [01]\)$", err, re.M), err
    (run_dir,) = out_dir.glob("*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(loss["rank"], loss["how"]) for loss in summary["lost"]] == [(2, "stopped")]
    assert re.fullmatch(r"silent for 3 s; found by rank [01]", summary["lost"][0]["reason"]), summary["lost"]  # as stderr said
    assert [w["rank"] for w in summary["per_worker"]] == [0, 1]
    assert summary["per_worker"][0]["steps"] == summary["per_worker"][1]["steps"] == summary["iterations"]
    if strategy != "ako":
        return
    point = checkpoint.latest(run_dir, 3)
    assert checkpoint.stand_ins(run_dir, point) == [2]
    config = TrainConfig(**load_toml(run_dir / "config.toml"))
    resumed = ako.train(replace(config, resume=str(run_dir), epochs=125))
    assert resumed.summary["resumed_from_step"] == point and resumed.summary["lost_ranks"] == []
    assert [w["steps"] for w in resumed.summary["per_worker"]] == [resumed.summary["iterations"]] * 3
    assert resumed.summary["resumed_as_rank_0"] == [2]  # its figures are rank 0's up to the checkpoint: the summary says so
    assert "worker rank 2, lost before it, began again from rank 0's part" in format_summary(resumed.summary)


@pytest.mark.parametrize("strategy", ["allreduce", "ssp"])
def test_a_failed_run_without_checkpoints_keeps_its_metrics(tmp_path, strategy):
    """Snapshots are evaluated after training; when a worker is killed mid-run, rank 0
    evaluates and logs the snapshots it took before the job ends: when it meets the failure
    (allreduce), or when the launcher tells it (ssp, whose server goes on without the dead
    worker, so rank 0 would not notice)."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "2", "--dataset", "digits",
           "--batch-size", "16", "--epochs", "400", "--eval-every", "0.5", "--out-dir", str(out_dir), "--timeout", "10",
           "--no-progress"]  # fmt: skip

    def training(d, deadline):
        while time.monotonic() < deadline and not list(d.glob("*/config.toml")):
            time.sleep(0.05)
        time.sleep(3.0)  # a few evaluation points (every 23 steps) in

    code, out, err, _ = run_and_kill(cmd, "ako-rank1", out_dir, ready=training)
    assert code == 1 and err == "ako: worker rank 1 failed: killed by SIGKILL\n", err
    (run_dir,) = out_dir.glob("*")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) >= 2 and all(0 <= r["test_accuracy"] <= 1 for r in records)
    assert [r["epoch"] for r in records] == sorted(r["epoch"] for r in records) and records[-1]["time"] > 0


def test_ctrl_c_and_sigterm_held_off_an_import_come_after_it():
    """`held`: a Ctrl-C in the block raises KeyboardInterrupt after it, not in it (torch._dynamo's
    import swallowed 1 in 30); SIGTERM reaches its handler of before after the block; with
    deliver=False they are only noted, for the caller to act on."""
    from ako.interrupts import held

    reached = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored where pytest runs in the background
    try:
        with held() as noted:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # handled here, and held
            inside, during = list(noted), list(reached)
        assert inside == [signal.SIGTERM] and during == [] and reached == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            with held() as noted:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                inside = list(noted)
        assert inside == [signal.SIGINT]
        with held(deliver=False) as noted:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert noted == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_python_exits_after_the_command_leaves_it_finished():
    """Ctrl-C once the command is done, while Python exits (0.6 s with torch loaded): the
    command ends with its own status, not killed by the signal (-2) or with a traceback. The
    signal is sent from an exit handler, so that it lands there every time."""
    import subprocess

    code = ("import atexit, os, signal, time\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
            "from ako import cli\n"
            "cli.main = lambda: 0\n"
            "cli.console()\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=default_sigint)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_a_killed_launcher_takes_every_process_with_it(tmp_path):
    """kill -9 of `ako train` itself mid-run: its workers and the fork server they came from
    end within seconds (they once trained on to the end: the workers kept the fork server
    alive, and the parent-death signal was the fork server's)."""
    import subprocess

    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits",
           "--epochs", "400", "--out-dir", str(tmp_path / "runs"), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    under = []
    try:
        deadline = time.monotonic() + 90
        for rank in range(2):
            find_process(f"ako-rank{rank}", proc.pid, deadline)
        under = descendants(proc.pid)
        proc.kill()
        proc.wait()
        assert len(under) >= 3 and gone(under, within=2.0), "a process is left"
    finally:
        proc.kill()
        proc.wait()
        for pid in under:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


STOPPING = "ako: stopping: rank 0 logs the evaluations it has first (up to 5 s; Ctrl-C again stops it at once)\n"


def _ctrl_c_while_evaluating(tmp_path, epochs: str, eval_every: str):
    """Train allreduce on digits with a slow evaluation (0.5 s a snapshot), Ctrl-C as soon as
    the bar of the evaluations after training shows; returns (exit status, stdout, stderr,
    seconds from Ctrl-C to the end, the run directory)."""
    import subprocess

    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits",
           "--test-samples", "100", "--epochs", epochs, "--eval-every", eval_every, "--eval-fn", "own_training:slow_metrics",
           "--out-dir", str(out_dir), "--progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint, env=env)
    try:
        seen = b""
        while b"evaluating:" not in seen and (chunk := proc.stderr.read1(4096)):
            seen += chunk
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=30)
        ended = time.monotonic() - interrupted
    finally:
        proc.kill()
        proc.wait()
    (run_dir,) = out_dir.glob("*")
    return proc.returncode, out.decode(), err.decode(), ended, run_dir


def test_ctrl_c_while_rank_0_evaluates_after_training_keeps_what_it_evaluated(tmp_path):
    """Without a target rank 0 evaluates its snapshots after training (here 14, 0.5 s each):
    Ctrl-C then gives it the same 5 s as during training, and the records it evaluated are in
    metrics.jsonl (they were logged only once all were evaluated: a run interrupted there kept
    none); exit status 130."""
    code, _, err, _, run_dir = _ctrl_c_while_evaluating(tmp_path, "1.2", "0.1")
    assert code == 130 and STOPPING in err and err.endswith(f"evaluation/s]ako: interrupted; what the run logged is in {run_dir}\n")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["epoch"] for r in records]
    assert 5 <= len(records) < 14 and epochs == sorted(set(epochs)) and epochs[0] == 0
    assert not (run_dir / "summary.json").exists()


def test_ctrl_c_while_rank_0_finishes_its_evaluations_ends_when_they_do(tmp_path):
    """Ctrl-C while rank 0 evaluates after training, with less than the 5 s grace left (3
    snapshots, 0.5 s each): it hands in its result and the run ends with its summary. It used
    to end only after the whole grace: the launcher waited for rank 0 to exit without reading
    its result, which, larger than the pipe's buffer, held rank 0 in its send (found by a
    breaker's trial)."""
    code, out, _, ended, run_dir = _ctrl_c_while_evaluating(tmp_path, "0.5", "0.25")
    assert code == 0 and "saved model" in out and (run_dir / "summary.json").exists()
    assert ended < 4.5, f"{ended:.1f} s from Ctrl-C to the end: the 5 s grace was waited out"


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm to the group"])
@pytest.mark.parametrize("strategy", ["ako", "allreduce"])
def test_ctrl_c_keeps_the_metrics_so_far_and_ends_every_process(tmp_path, strategy, how):
    """Ctrl-C (SIGINT to the launcher), or SIGTERM to the launcher and every worker at once
    (`timeout`, `kill -- -PGID`, a batch scheduler; rank 0 used to die at once, keeping only
    config.toml), mid-run: rank 0 logs the snapshots it has taken, then every process ends:
    exit status 130, one line, no process left."""
    import subprocess

    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "2", "--dataset", "digits",
           "--batch-size", "16", "--epochs", "400", "--eval-every", "0.5", "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        for rank in range(2):
            find_process(f"ako-rank{rank}", proc.pid, deadline)
        under = descendants(proc.pid)  # the ranks and the fork server they came from
        while time.monotonic() < deadline and not list(out_dir.glob("*/config.toml")):
            time.sleep(0.05)
        time.sleep(3.0)  # a few evaluation points (every 23 steps) in
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        interrupted = time.monotonic()
        _, err = proc.communicate(timeout=30)
        ended = time.monotonic() - interrupted
    finally:
        proc.kill()
        proc.wait()
    (run_dir,) = out_dir.glob("*")
    assert proc.returncode == 130 and err == f"{STOPPING}ako: interrupted; what the run logged is in {run_dir}\n", err
    assert ended < 10, f"{ended:.1f} s from the signal to the end"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) >= 2 and all(0 <= r["test_accuracy"] <= 1 for r in records)
    assert [r["epoch"] for r in records] == sorted(r["epoch"] for r in records)
    assert not (run_dir / "summary.json").exists()  # the run did not finish
    assert len(under) >= 3 and gone(under, within=2.0), "a process is left"
