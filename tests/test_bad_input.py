"""Bad input wherever users touch ako: random values in flags and config files (a property
test), and a broken environment under torchrun. Every case ends in one clean line, or in a
run that starts; never a traceback, never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import tomli_w
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ako.api
from ako.cli import main
from ako.config import FIELDS, validate
from ako.run.outcome import WorkerResult

# every setting a user can give, with values of every kind: valid, out of range, wrong type
NAMES = sorted(set(FIELDS) - {"resume"})  # --resume reads a run directory: tests/test_checkpoint.py
VALUES = st.one_of(
    st.integers(-3, 10**7),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=10),
    st.sampled_from(["auto", "none", "1Gbit", "30s", "rank=1,factor=2", "cnn", "bsp", "ako", "gossip", "1e-3"]),
    st.lists(st.sampled_from(["rank=0,factor=2", "prob=0.5,factor=3", "x"]), max_size=2),
)
SETTINGS = st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=5)


@pytest.fixture
def started(monkeypatch, tmp_path):
    """Where `ako train` would start its processes, record the job instead (the property is
    about everything before that point; real starts are what the other tests do). Runs in
    `tmp_path`, so that a random relative --out-dir is made there, not in the checkout."""
    monkeypatch.chdir(tmp_path)
    jobs = []

    def launch(job, world):
        jobs.append(job)
        return {r: WorkerResult(r, torch.zeros(1), {}) for r in range(world)}

    monkeypatch.setattr(ako.api, "launch", launch)
    return jobs


def _flag_value(value) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value).lower() if isinstance(value, bool) else str(value)]


def check_outcome(code: int, err: str, jobs: list) -> None:
    assert "Traceback" not in err
    if code == 0:  # started with a config that validates as it is
        (job,) = jobs
        assert validate(job.config) == job.config
    else:
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("ako: error: "), err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=SETTINGS)
def test_random_flags_end_in_one_clean_line_or_a_start(values, tmp_path, started, capsys):
    started.clear()
    args = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if name in ("nesterov", "progress"):  # on/off flags
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [arg for v in _flag_value(value) for arg in (flag, v)]
    code = main(["train", "--dataset", "digits", "--out-dir", str(tmp_path / "runs"), *args])
    check_outcome(code, capsys.readouterr().err, started)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=SETTINGS)
def test_random_config_files_end_in_one_clean_line_or_a_start(values, tmp_path, started, capsys):
    started.clear()
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps({"dataset": "digits", "out_dir": str(tmp_path / "runs"), **values}))
    code = main(["train", "--config", str(path)])
    check_outcome(code, capsys.readouterr().err, started)


def _torchrun_env(port: int, addr: str = "127.0.0.1") -> dict:
    """The environment torchrun gives rank 1 of 2, pointing at `addr`:`port` for its store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_"))}
    return env | {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": addr,
                  "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip


@pytest.mark.parametrize("where", ["unreachable address", "port in use by something else"])
def test_a_broken_rendezvous_fails_within_the_timeout_naming_the_cause(tmp_path, where):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()  # accepts connections but never answers the store's handshake
        port = squatter.getsockname()[1]
        env = _torchrun_env(port, "192.0.2.1" if where == "unreachable address" else "127.0.0.1")
        cmd = [sys.executable, "-m", "ako", "train", "--dataset", "digits", "--timeout", "3",
               "--out-dir", str(tmp_path), "--no-progress"]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ako: worker rank 1: the workers did not all join within 3 s" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # torch's C++ log (a stack trace per retry) is off
    assert elapsed < 3 + 5 + 15  # the store's retries (or our guard), plus starting Python and torch


def test_under_torchrun_bad_input_fails_before_joining(tmp_path):
    """A worker checks the job before it joins the group: a batch larger than a worker's
    shard fails at once in one line, though the store it would join never answers."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        env = _torchrun_env(squatter.getsockname()[1])
        cmd = [sys.executable, "-m", "ako", "train", "--dataset", "digits", "--batch-size", "5000", "--timeout", "30",
               "--out-dir", str(tmp_path), "--no-progress"]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env | {"LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ako: error: batch_size 5000: must be at most the per-worker shard of 1497 // 2 workers")
    assert proc.stderr.count("\n") == 1 and elapsed < 30, (proc.stderr, elapsed)  # not the join's 30 s


@pytest.mark.parametrize(
    "variable, value, allowed",
    [("RANK", "abc", "from 0 to 1"), ("RANK", "2", "from 0 to 1"), ("WORLD_SIZE", "0", "from 1 to"), ("MASTER_PORT", "abc", "from 1 to 65535")],
)
def test_a_bad_torchrun_environment_is_one_line(tmp_path, variable, value, allowed):
    env = _torchrun_env(29999) | {variable: value}
    cmd = [sys.executable, "-m", "ako", "train", "--dataset", "digits", "--out-dir", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"ako: error: environment variable {variable}={value!r}: must be an integer {allowed}")
    assert proc.stderr.count("\n") == 1 and "torchrun sets it" in proc.stderr


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_a_negative_value_after_a_space_gets_the_setting_s_own_error(command, capsys):
    """argparse would take "-5MB" for an option ("expected one argument")."""
    assert main([command, "--dataset", "digits", "--bandwidth", "-5MB"]) == 2
    assert capsys.readouterr().err.startswith("ako: error: bandwidth '-5MB': expected a rate like 1Gbit")
