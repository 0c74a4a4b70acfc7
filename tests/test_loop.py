"""Your own training loop (ako.wrap, ako.finish, ako run): the same strategy programs driven by
the user's optimizer.step() give what `ako train` gives; failures and bad usage are one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ako
from ako import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
import loop_script  # noqa: E402

SCRIPT = str(Path(__file__).parent / "loop_script.py")


def ako_run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    return subprocess.run([sys.executable, "-m", "ako", "run", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)  # fmt: skip


def trained_by_ako_train(tmp_path: Path, strategy: str, **options) -> torch.Tensor:
    """`ako train` (the API) on the script's model, data, optimizer and seed: 2 workers, 6 steps."""
    config = TrainConfig(strategy=strategy, workers=2, batch_size=loop_script.BATCH, epochs=0.5, eval_every=10.0,
                         lr=loop_script.LR, momentum=loop_script.MOMENTUM, weight_decay=loop_script.WEIGHT_DECAY,
                         nesterov=True, timeout=30.0, out_dir=str(tmp_path / "train"), progress=False, **options)  # fmt: skip
    data = loop_script.digits_like()
    result = ako.train(config, model_fn=loop_script.mlp, train_set=data, test_set=data)
    return result.model


def test_the_shards_are_ako_trains():
    """384 samples, 2 workers, batches of 16: 12 steps an epoch, the first 6 used by both."""
    assert 384 // 2 // loop_script.BATCH == 12


def test_a_wrapped_loop_under_allreduce_equals_ako_train(tmp_path):
    expected = trained_by_ako_train(tmp_path, "allreduce")
    out = ako_run("--workers", "2", "--strategy", "allreduce", SCRIPT, str(tmp_path), "6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    start = torch.cat([p.detach().reshape(-1) for p in (torch.manual_seed(0), loop_script.mlp())[1].parameters()])
    assert (expected - start).abs().max() > 1e-3  # it trained


def test_a_wrapped_loop_under_ako_at_one_partition_and_no_staleness_equals_allreduce(tmp_path):
    expected = trained_by_ako_train(tmp_path, "allreduce")
    out = ako_run("--workers", "2", "--strategy", "ako", "--partitions", "1", "--staleness", "0", SCRIPT, str(tmp_path),
                  "6", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "partial steps behind a straggler are off" in out.stderr
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_under_ako_defaults_the_replicas_are_equal_after_finish_and_the_run_directory_has_the_metrics(tmp_path):
    out = ako_run("--workers", "2", "--strategy", "ako", "--record-every", "4", SCRIPT, str(tmp_path), "12", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.allclose(first, second, atol=1e-6, rtol=0), (first - second).abs().max()
    (run_dir,) = (tmp_path / "runs").iterdir()
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_per_worker"] == [12, 12] and summary["final_consensus_distance"] < 1e-6
    # the plan Ako chose, as `ako train` prints it: 2 workers, sgd, so all-to-all with the plain swap
    assert (summary["exchange"], summary["staleness_bound"], summary["iterations"]) == ("all-to-all", 1, 12)
    assert f"  partitions       p = {summary['partitions']}, all-to-all, staleness bound 1, windows of {summary['windows']} (" in out.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert all(r["replicas"] == 2 and r["consensus_distance"] >= 0 and r["bytes_sent"] > 0 for r in records)
    assert records[-1]["bytes_sent"] > records[0]["bytes_sent"]



def _rank_pid(launcher: subprocess.Popen, rank: int, deadline: float) -> int:
    """The pid of `ako run`'s process of `rank` (its child with RANK=rank)."""
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
        time.sleep(0.1)
    raise AssertionError(f"no process of rank {rank} appeared")


def _kill_rank_while_training(tmp_path: Path, strategy: str, workers: int = 3, *flags: str, timeout: int = 20,
                              sig: int = signal.SIGKILL) -> tuple[subprocess.CompletedProcess, float]:  # fmt: skip
    """`ako run` of the script, 60 steps of 50 ms, with rank 1 killed (or sent `sig`) once
    training is under way (rank 0's run directory exists); returns the outcome and the seconds
    from the signal to the end."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    command = [sys.executable, "-m", "ako", "run", "--workers", str(workers), "--strategy", strategy, "--timeout", str(timeout),
               *flags, SCRIPT, str(tmp_path), "60", "0.05"]  # fmt: skip
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 120
        victim = _rank_pid(launcher, 1, deadline)
        while not list((tmp_path / "runs").glob("*/config.toml")):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(victim, sig)
        signalled = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr), time.monotonic() - signalled


def test_a_killed_rank_under_akos_ring_ends_the_run_in_one_line_naming_it(tmp_path):
    """On the ring (as AdamW's default takes) a loss is not survived: the launcher names the
    killed rank once, as failed, not as lost first nor the rank that met the loss."""
    out, elapsed = _kill_rank_while_training(tmp_path, "ako", 3, "--exchange", "ring")
    assert out.returncode == 1 and elapsed < 60, (out.returncode, elapsed)
    lines = [line for line in out.stderr.splitlines() if line.startswith("ako run:") and "rank" in line]
    assert lines == ["ako run: worker rank 1 failed: killed by SIGKILL"], out.stderr


@pytest.mark.parametrize("strategy", ["ako", "gossip"])
def test_a_killed_rank_under_ako_run_is_named_and_the_others_finish(tmp_path, strategy):
    out, _ = _kill_rank_while_training(tmp_path, strategy)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "rank 1" in line]
    assert lines == ["ako run: worker rank 1 lost: killed by SIGKILL; the others go on without it"], out.stderr
    assert (tmp_path / "rank0.pt").exists() and (tmp_path / "rank2.pt").exists() and not (tmp_path / "rank1.pt").exists()
    if strategy == "ako":  # the survivors' replicas are made one after the loss
        assert torch.allclose(torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank2.pt"), atol=1e-6, rtol=0)


@pytest.mark.parametrize("strategy,fail,said", [
    ("ako", "raise", "worker rank 1 lost: the script raised RuntimeError: boom; the others go on without it"),
    ("allreduce", "exit", "worker rank 1 failed: the script ended before ako.finish (sys.exit, or the loop returned early)"),
])  # fmt: skip
def test_a_script_that_fails_before_finish_is_named_with_its_cause(tmp_path, strategy, fail, said):
    """Not "killed by SIGABRT", which tearing down under the communication threads gave."""
    out = ako_run("--workers", "2", "--strategy", strategy, "--timeout", "20", SCRIPT, str(tmp_path), "8", "0.05", fail,
                  cwd=tmp_path)  # fmt: skip
    assert out.returncode == (0 if strategy == "ako" else 1), out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("ako run:")] == [f"ako run: {said}"], out.stderr
    assert "SIGABRT" not in out.stderr and "terminate called" not in out.stderr


def test_a_stopped_rank_under_ako_run_is_dropped_and_not_waited_for_again(tmp_path):
    """SIGSTOP: the others drop rank 1 after the timeout (10 s) and finish; the launcher then
    gives it up at once (it would never end), not after a second timeout (which took 23 s)."""
    out, elapsed = _kill_rank_while_training(tmp_path, "ako", 3, timeout=10, sig=signal.SIGSTOP)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "rank 1" in line]
    assert len(said) == 1 and said[0].startswith("ako: worker rank 1 was stopped (SIGSTOP or a debugger) and dropped "
                                                 "(silent for 10 s; found by rank "), out.stderr  # once, by a peer
    assert elapsed < 10 + 9, f"took {elapsed:.1f} s"  # 14-15 s on a loaded machine; 23 s when it was waited for


def test_a_killed_rank_under_allreduce_fails_the_run_in_one_line_without_a_hang(tmp_path):
    out, seconds = _kill_rank_while_training(tmp_path, "allreduce")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "ako run: worker rank 1 failed: killed by SIGKILL", out.stderr
    assert "Traceback" not in out.stderr
    assert seconds < 60


MISUSE = str(Path(__file__).parent / "loop_misuse.py")


@pytest.mark.parametrize(
    "case, line",
    [
        ("stepped", "ako: error: wrap: the optimizer (SGD) has stepped already; wrap the model and optimizer before the "
                    "first optimizer.step(), so that every replica starts alike"),
        ("not-held", "ako: error: wrap: the optimizer does not hold parameter '2.weight' of the model (2 of 4 not held); "
                     "give it model.parameters()"),
        ("absp", "ako: error: strategy absp cannot run in your own loop: its partial steps need ako to own the batch "
                 "(ako train --strategy absp)"),
        ("no-servers", "ako: error: strategy easgd needs parameter servers, and none were started: run the script with "
                       "ako run --servers S (or give servers=S to wrap and start S more processes)"),
    ],
)  # fmt: skip
def test_bad_usage_under_ako_run_is_one_line_exit_2_and_nothing_written(tmp_path, case, line):
    out = ako_run("--workers", "2", MISUSE, case, cwd=tmp_path)
    assert (out.returncode, out.stderr.strip()) == (2, line)
    assert "wrapped" not in out.stdout and list(tmp_path.iterdir()) == []


def test_a_strategy_flag_a_loop_cannot_run_is_one_line_before_any_process(tmp_path):
    out = ako_run("--workers", "2", "--strategy", "bsp", MISUSE, "fine", cwd=tmp_path)
    assert (out.returncode, out.stderr.strip()) == (2, "ako: error: strategy bsp cannot run in your own loop: its servers "
                                                    "step the optimizer, and yours lives in your script (ako train --strategy bsp)")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_a_script_that_does_not_exist_is_one_line(tmp_path):
    out = ako_run("--workers", "2", "nowhere.py", cwd=tmp_path)
    assert (out.returncode, out.stderr.strip()) == (2, "ako: error: script 'nowhere.py': no such file")
    assert list(tmp_path.iterdir()) == []


def test_without_a_launcher_wrap_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(Path(__file__).parent.parent / "src")
    out = subprocess.run([sys.executable, MISUSE, "fine"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "ako: error: no launcher environment: rank and world size unknown "
                                                    "(RANK and WORLD_SIZE are not set); start the script with torchrun "
                                                    "--nproc-per-node N or ako run --workers N")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


EXAMPLES = Path(__file__).parent.parent / "examples"


def _example_env() -> dict:
    """pytorch/examples' mnist script here: torchvision's stand-in (Fashion-MNIST's files as
    MNIST, 640 samples) and ako on the path."""
    paths = [str(Path(__file__).parent / "stubs"), str(Path(__file__).parent.parent / "src")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "STUB_MNIST_SAMPLES": "640"}


@pytest.mark.parametrize("launcher", ["ako run", "torchrun"])
def test_pytorch_examples_mnist_with_three_lines_trains_under_both_launchers(tmp_path, launcher):
    original, changed = (EXAMPLES / "mnist" / "original.py").read_text(), (EXAMPLES / "mnist" / "main.py").read_text()
    added = [line for line in changed.splitlines() if line not in original.splitlines()]
    assert len(added) == 3 and len(changed.splitlines()) == len(original.splitlines()) + 3
    start = ([sys.executable, "-m", "ako", "run", "--workers", "2", "--strategy", "allreduce"] if launcher == "ako run"
             else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"])  # fmt: skip
    args = [str(EXAMPLES / "mnist" / "main.py"), "--epochs", "2", "--test-batch-size", "320", "--save-model"]
    out = subprocess.run(start + args, capture_output=True, text=True, cwd=tmp_path, env=_example_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tests = [line for line in out.stdout.splitlines() if line.startswith("Test set:")]
    assert len(tests) == 4  # two epochs, two workers
    accuracy = [int(line.split("Accuracy: ")[1].split("/")[0]) for line in tests]
    assert accuracy[-1] > 640 * 0.3  # ten classes: it learned
    if launcher == "ako run":  # allreduce: both workers hold the same model, and test it alike
        assert accuracy[0] == accuracy[1] and accuracy[2] == accuracy[3]
    assert (tmp_path / "mnist_cnn.pt").exists()


@pytest.mark.parametrize("mode", ["no_sync", "plain", "amp"])
def test_gradient_accumulation_clipping_and_a_grad_scaler_in_a_wrapped_loop(tmp_path, mode):
    """Two micro-batches a step, reduced once (no_sync) or at each backward (plain): both equal
    `ako train --accumulate 2`; with bf16 autocast, a GradScaler and clipping, close to it."""
    expected = trained_by_ako_train(tmp_path, "allreduce", accumulate=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent / "src")])}
    out = subprocess.run([sys.executable, "-m", "ako", "run", "--workers", "2", str(Path(__file__).parent / "loop_accumulate.py"),
                          str(tmp_path), mode], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.equal(first, second)
    gap = (first - expected).abs().max().item()
    assert gap < (1e-2 if mode == "amp" else 1e-5), gap


def test_easgd_runs_with_the_server_ako_run_starts_and_hands_back_the_centre(tmp_path):
    out = ako_run("--workers", "2", "--strategy", "easgd", "--tau", "2", SCRIPT, str(tmp_path), "12", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    import json

    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "the centre variable (easgd)" and summary["final_consensus_distance"] > 0
    assert [r["role"] for r in summary["per_rank"]] == ["worker", "worker", "server"]
    assert not torch.equal(torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt"))  # rank 0: the centre


@pytest.mark.parametrize("launcher", ["ako run", "torchrun"])
def test_a_nanogpt_style_loop_with_three_lines_trains_the_gpt_under_both_launchers(tmp_path, launcher):
    original, changed = (EXAMPLES / "nanogpt" / "original.py").read_text(), (EXAMPLES / "nanogpt" / "train.py").read_text()
    assert len(changed.splitlines()) == len(original.splitlines()) + 3
    assert [line for line in changed.splitlines() if line not in original.splitlines()] == [
        "import ako", "model, optimizer = ako.wrap(model, optimizer)", "model = ako.finish(model)"]
    start = ([sys.executable, "-m", "ako", "run", "--workers", "2", "--strategy", "gossip"] if launcher == "ako run"
             else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"])  # fmt: skip
    args = [str(EXAMPLES / "nanogpt" / "train.py"), "--max-iters", "30", "--eval-interval", "29", "--out", str(tmp_path / "ckpt.pt")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    out = subprocess.run(start + args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    val = {}
    for line in out.stdout.splitlines():  # "rank R step S: train loss ..., val loss V"
        if line.startswith("rank 0 step"):
            val[int(line.split()[3].rstrip(":"))] = float(line.rsplit(" ", 1)[1])
    assert sorted(val) == [0, 29] and val[29] < val[0] - 1.0, out.stdout
    assert (tmp_path / "ckpt.pt").exists()
    if launcher == "ako run":  # the plan, as ako train prints it
        assert "\n  gossip           pull, random peers, tau = 1; " in out.stderr, out.stderr[-2000:]


def test_an_outer_step_the_loop_cannot_take_is_one_line_before_any_training(tmp_path):
    """The strategy's own checks run in a wrapped loop too (here: Ako's outer step needs the
    ring, and windows of deltas), as under ako train."""
    out = ako_run("--workers", "2", "--update", "deltas", "--exchange", "all-to-all", "--outer-lr", "0.8", MISUSE, "fine",
                  cwd=tmp_path)  # fmt: skip
    assert (out.returncode, out.stderr.strip()) == (2, "ako: error: outer lr 0.8 and momentum 0: an outer step needs "
                                                    "--exchange ring or auto (all-to-all applies each peer's window as it "
                                                    "comes, never a step's whole mean)")  # fmt: skip
    assert "wrapped" not in out.stdout and list(tmp_path.iterdir()) == []
