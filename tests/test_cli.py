"""Bad input: one line on stderr naming the value, exit status 2, no run directory."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ako.cli import main
from ako.data import write_idx

import numpy as np


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path / "runs"


def run_cli(args, out_dir, capsys):
    code = main(["train", "--dataset", "digits", "--out-dir", str(out_dir), *args])
    err = capsys.readouterr().err
    return code, err


def corrupt_data_dir(tmp_path):
    """A Fashion-MNIST directory whose training images file is cut short."""
    d = tmp_path / "data"
    d.mkdir()
    images = np.zeros((20, 28, 28), np.uint8)
    labels = np.arange(20, dtype=np.uint8) % 10
    write_idx(d / "train-images-idx3-ubyte", images, gz=False)
    write_idx(d / "train-labels-idx1-ubyte", labels, gz=False)
    write_idx(d / "t10k-images-idx3-ubyte", images, gz=False)
    write_idx(d / "t10k-labels-idx1-ubyte", labels, gz=False)
    raw = (d / "train-images-idx3-ubyte").read_bytes()
    (d / "train-images-idx3-ubyte").write_bytes(raw[:-100])
    return d


BAD_INPUT = [
    (["--strategy", "sync"], "unknown strategy 'sync': choose one of"),
    (["--model", "vgg"], "unknown model 'vgg': choose one of mlp, cnn, resnet"),
    (["--dataset", "cifar"], "unknown data set 'cifar': choose one of"),
    (["--workers", "0"], "workers '0': must be an integer >= 1 and <= 4096"),
    (["--workers", "two"], "workers 'two': must be an integer >= 1"),
    (["--partitions", "0"], "partitions '0': must be an integer >= 1 or 'auto'"),
    (["--partitions", "100000000"], "partitions 100000000: must be at most the model's parameter count 22602"),
    (["--lr", "0"], "lr '0': must be a number > 0"),
    (["--lr", "-0.1"], "lr '-0.1': must be a number > 0"),
    (["--batch-size", "0"], "batch_size '0': must be an integer >= 1"),
    (["--batch-size", "5000"], "batch_size 5000: must be at most the per-worker shard"),
    (["--momentum", "1.5"], "momentum '1.5': must be a number >= 0 and < 1"),
    (["--target-accuracy", "85"], "target_accuracy '85': must be a number > 0 and <= 1"),
    (["--bandwidth", "fast"], "bandwidth 'fast': expected a rate like 1Gbit"),
    (["--bandwidth", "1e400"], "bandwidth '1e400': must be at least 1 byte/s and finite"),
    (["--bandwidth", "1e-320"], "bandwidth '1e-320': must be at least 1 byte/s and finite"),
    (["--exchange", "star"], "unknown exchange 'star': choose one of auto, all-to-all, ring"),
    (["--strategy", "allreduce", "--exchange", "ring"], "exchange 'ring': strategy allreduce has no such option"),
    (["--staleness", "1001"], "staleness '1001': must be an integer >= 0 and <= 1000"),
    (["--strategy", "gossip", "--tau", "auto"], "tau 'auto': must be an integer >= 1 and <= 1000000"),
    (["--strategy", "easgd", "--tau", "0"], "tau '0': must be an integer >= 1 and <= 1000000 or 'auto'"),
    (["--epochs", "nan"], "epochs 'nan': must be a number > 0"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--epochs", "inf"], "epochs 'inf': must be a number > 0 and <= 1e+06"),
    (["--timeout", "inf"], "timeout 'inf': must be a number >= 1 and <= 86400"),
    (["--seed", "1" * 30], "must be an integer >= 0 and <= 9223372036854775807"),
    (["--lr", "1e300"], "lr '1e300': must be a number > 0 and <= 1000"),
    (["--strategy", "allreduce", "--partitions", "4"], "partitions 4: strategy allreduce has no such option"),
    (["--strategy", "allreduce", "--staleness", "0"], "staleness 0: strategy allreduce has no such option"),
    (["--backend", "nccl"], "backend 'nccl' needs CUDA"),
    (["--config", ""], "config file '' not found"),
    (["--out-dir", "/dev/null/runs"], "out_dir '/dev/null/runs': cannot make it (Not a directory)"),
    (["--strategy", "allreduce", "--servers", "2"], "servers 2: strategy allreduce has no such option (it is for bsp, ssp, asp, absp, easgd)"),
    (["--strategy", "bsp", "--servers", "0"], "servers '0': must be an integer >= 1 and <= 1024"),
    (["--strategy", "bsp", "--servers", "30000"], "servers '30000': must be an integer >= 1 and <= 1024"),
    (["--strategy", "bsp", "--workers", "2", "--servers", "1024"],
     "workers 2 + servers 1024: 1026 processes of at least"),  # more than this machine's memory: it swapped, then hung
    (["--strategy", "bsp", "--staleness", "1"], "staleness 1: strategy bsp has no such option (it is for ako, ssp)"),
    (["--strategy", "ssp", "--staleness", "-1"], "staleness '-1': must be an integer >= 0"),
    (["--strategy", "absp", "--micro-batch", "0"], "micro_batch '0': must be an integer >= 1"),
    (["--strategy", "absp", "--micro-batch", "65"], "micro_batch 65: must be at most a step's samples, batch_size 64"),
    (["--strategy", "bsp", "--micro-batch", "8"], "micro_batch 8: strategy bsp has no such option (it is for ako, absp)"),
    (["--strategy", "ako", "--micro-batch", "129", "--accumulate", "2"], "micro_batch 129: must be at most a step's samples, batch_size 64 x accumulate 2"),
    (["--strategy", "easgd", "--tau", "0"], "tau '0': must be an integer >= 1"),
    (["--strategy", "easgd", "--beta", "1.5"], "beta '1.5': must be a number >= 0 and <= 1"),
    (["--strategy", "ako", "--gossip", "pull"], "gossip 'pull': strategy ako has no such option (it is for gossip)"),
    (["--strategy", "allreduce", "--staleness", "1"], "staleness 1: strategy allreduce has no such option (it is for ako, ssp)"),
    (["--target", "accuracy>=2"], "target 'accuracy>=2': can never be met, as the accuracy is a fraction in [0, 1]"),
    (["--target", "loss<=-1"], "target 'loss<=-1': can never be met, as the loss is at least 0"),
    (["--strategy", "asp", "--tau", "2"], "tau 2: strategy asp has no such option (it is for gossip, easgd)"),
    (["--straggler", "rank=1"], "straggler 'rank=1': expected rank=R,factor=K or prob=P,factor=K"),
    (["--straggler", "rank=1,prob=0.5,factor=2"], "straggler 'rank=1,prob=0.5,factor=2': expected rank=R,factor=K"),
    (["--straggler", "rank=x,factor=2"], "straggler 'rank=x,factor=2': expected rank=R,factor=K"),
    (["--straggler", "rank=2,factor=3"], "straggler 'rank=2,factor=3': rank must be a worker, in [0, 2)"),
    (["--straggler", "rank=1,factor=0.5"], "straggler 'rank=1,factor=0.5': factor must be a number >= 1 and <= 1000"),
    (["--straggler", "prob=1.5,factor=2"], "straggler 'prob=1.5,factor=2': prob must be in [0, 1]"),
    (["--straggler", "rank=1,factor=nan"], "straggler 'rank=1,factor=nan': factor must be a number >= 1"),
    (["--checkpoint-every", "often"], "checkpoint_every 'often': expected a period like 30s, 5min or 1h"),
    (["--checkpoint-every", "0s"], "checkpoint_every '0s': must be more than 0 s and at most 1e6 s"),
    (["--resume", "/nonexistent/run"], "resume '/nonexistent/run': no such directory"),
    (["--resume", "/tmp"], "resume '/tmp': not a run directory (no config.toml in it)"),
    (["--straggler", "rank=1,factor=4", "--straggler", "rank=1,factor=2"],
     "straggler 'rank=1,factor=2': rank 1 has one already ('rank=1,factor=4'); give each rank one"),
    (["--out-dir", "runs\x00"], "out_dir 'runs\\x00': contains a NUL character"),
    (["--data-dir", "/tmp"], "data_dir '/tmp': digits is bundled with scikit-learn and reads no files"),
    (["--data-dir", ""], "data_dir '': must be a directory path"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_flag_is_one_line_exit_2_and_writes_nothing(args, message, out_dir, capsys):
    code, err = run_cli(args, out_dir, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ako: error: "), err
    assert message in err
    assert not out_dir.exists()


def test_missing_data_files(tmp_path, out_dir, capsys):
    code, err = run_cli(["--dataset", "fashion-mnist", "--data-dir", str(tmp_path)], out_dir, capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"data files not found in {tmp_path}" in err
    assert not out_dir.exists()


def test_corrupt_data_file(tmp_path, out_dir, capsys):
    data = corrupt_data_dir(tmp_path)
    code, err = run_cli(["--dataset", "fashion-mnist", "--data-dir", str(data)], out_dir, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "train-images-idx3-ubyte" in err and "truncated" in err
    assert not out_dir.exists()


def test_unknown_toml_key(tmp_path, out_dir, capsys):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "ako"\nlearning_rate = 0.1\n')
    code, err = run_cli(["--config", str(path)], out_dir, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "unknown key 'learning_rate'" in err
    assert not out_dir.exists()


@pytest.mark.parametrize("resume, message", [("/nonexistent/run", "no such directory"),
                                             ("/tmp", "no complete checkpoint in it (one file per rank)")])
def test_a_bad_resume_in_a_config_file_is_one_line_and_makes_no_folder(tmp_path, out_dir, capsys, resume, message):
    path = tmp_path / "run.toml"  # the out_dir was made before the checkpoint was looked for
    path.write_text(f"resume = {resume!r}\nstrategy = 'allreduce'\nworkers = 2\ndataset = 'digits'\n")
    assert run_cli(["--config", str(path)], out_dir, capsys) == (2, f"ako: error: resume {resume!r}: {message}\n")
    assert not out_dir.exists()


@pytest.mark.parametrize("value", ["16", "32"])
def test_a_toml_key_given_with_dash_and_underscore(tmp_path, out_dir, capsys, value):
    path = tmp_path / "run.toml"
    path.write_text(f"batch-size = 16\nbatch_size = {value}\n")  # once the second silently won
    assert run_cli(["--config", str(path)], out_dir, capsys) == (
        2,
        f"ako: error: config file '{path}': 'batch_size' is given twice, spelled with - and with _\n",
    )
    assert not out_dir.exists()


def test_bad_toml_value_and_syntax(tmp_path, out_dir, capsys):
    path = tmp_path / "run.toml"
    path.write_text("workers = -3\n")
    assert run_cli(["--config", str(path)], out_dir, capsys) == (
        2,
        "ako: error: workers -3: must be an integer >= 1 and <= 4096\n",
    )
    path.write_text("model = []\n")
    assert run_cli(["--config", str(path)], out_dir, capsys) == (2, "ako: error: model []: must be a non-empty string\n")
    path.write_text("epochs = true\n")
    assert run_cli(["--config", str(path)], out_dir, capsys) == (2, "ako: error: epochs true: must be a number > 0 and <= 1e+06\n")
    path.write_text("workers = \n")
    code, err = run_cli(["--config", str(path)], out_dir, capsys)
    assert code == 2 and "run.toml" in err and err.count("\n") == 1
    path.write_text("straggler = 3\n")
    assert run_cli(["--config", str(path)], out_dir, capsys) == (
        2,
        "ako: error: straggler 3: must be a list of texts like 'rank=1,factor=3'\n",
    )


def test_stragglers_from_a_config_file_and_flags(tmp_path):
    from ako.cli import build_parser, config_from_args

    path = tmp_path / "run.toml"
    path.write_text('strategy = "absp"\nworkers = 4\nstraggler = ["rank=3, factor=2.5", "prob=0.1,factor=2"]\n')
    config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.straggler == ("rank=3,factor=2.5", "prob=0.1,factor=2")
    assert (config.servers, config.micro_batch) == (1, 16)
    flags = ["train", "--strategy", "ssp", "--straggler", "rank=1,factor=3", "--straggler", "prob=0.5,factor=2"]
    config = config_from_args(build_parser().parse_args(flags))
    assert config.straggler == ("rank=1,factor=3", "prob=0.5,factor=2")
    assert config.staleness == 2


def test_flags_override_the_config_file(tmp_path):
    from ako.cli import build_parser, config_from_args

    path = tmp_path / "run.toml"
    path.write_text('strategy = "ako"\nworkers = 3\nlr = 0.2\nstaleness = 1\nbatch-size = 32\n')
    args = build_parser().parse_args(["train", "--config", str(path), "--workers", "4", "--staleness", "none"])
    config = config_from_args(args)
    assert (config.strategy, config.workers, config.lr, config.staleness, config.batch_size) == ("ako", 4, 0.2, None, 32)


def test_compress_none_is_float32_not_the_default_auto():
    """The word none clears a setting whose None means "not given" (`--staleness none`), but
    `--compress none` is a code of its own: float32 windows, where unset is Ako's auto."""
    from ako.cli import build_parser, config_from_args

    def compress(*flags):
        return config_from_args(build_parser().parse_args(["train", "--optimizer", "adamw", *flags])).compress

    assert (compress("--compress", "none"), compress("--compress", "int8"), compress()) == ("none", "int8", "auto")
    assert compress("--strategy", "diloco") == "none"


def test_a_runs_config_file_serves_another_strategy(tmp_path):
    """A run's config.toml records its strategy's options resolved (ako: micro_batch =
    batch_size // 4; ssp: servers = 1, staleness = 2); with another --strategy they are not
    that run's: its own defaults apply, and no server is started for a strategy without one.
    In a file without a strategy of its own, an option of another strategy is taken at a
    default (and dropped), and refused at a value someone chose; as a flag, always refused."""
    from ako.checks import ConfigError
    from ako.cli import build_parser, config_from_args
    from ako.config import to_toml

    def config(*flags):
        return config_from_args(build_parser().parse_args(["train", *flags]))

    path = tmp_path / "config.toml"
    path.write_text(to_toml(config("--strategy", "ako", "--batch-size", "32")))
    assert "micro_batch = 8" in path.read_text() and "staleness" not in path.read_text()  # ssp would take it
    c = config("--config", str(path), "--strategy", "allreduce")
    assert (c.strategy, c.batch_size, c.micro_batch) == ("allreduce", 32, None)
    assert config("--config", str(path), "--strategy", "absp", "--batch-size", "64").micro_batch == 16  # its own default
    assert config("--config", str(path), "--strategy", "ssp").staleness == 2
    path.write_text(to_toml(config("--strategy", "ssp")))
    assert "servers = 1" in path.read_text() and "staleness = 2" in path.read_text()
    c = config("--config", str(path), "--strategy", "ako")
    assert (c.servers, c.staleness) == (None, None)  # no server started for ako, and its own bound
    path.write_text("batch_size = 32\nmicro_batch = 8\nservers = 1\n")  # no strategy: ako's by default
    c = config("--config", str(path))
    assert (c.strategy, c.micro_batch, c.servers) == ("ako", 8, None)
    with pytest.raises(ConfigError, match="micro_batch 8: strategy allreduce has no such option"):
        config("--config", str(path), "--strategy", "allreduce", "--batch-size", "64")
    with pytest.raises(ConfigError, match="servers 1: strategy ako has no such option"):
        config("--config", str(path), "--servers", "1")


def test_exit_status_2_from_the_console_script(tmp_path):
    """The real process: status 2, one line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "ako", "train", "--workers", "-1", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == "ako: error: workers '-1': must be an integer >= 1 and <= 4096\n"


def test_a_pipe_from_ako_train_ends_when_it_exits(tmp_path):
    """`ako train ... 2>&1 | tee log`: the pipe's end comes with ako's exit, even when that
    exit (a one-line error) comes while the workers' fork server is still loading torch, which
    held the pipe open 2.5 s longer."""
    proc = subprocess.Popen([sys.executable, "-m", "ako", "train", "--optimizer", "lbfgs", "--out-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.wait(timeout=60) == 2
    fd, out, deadline = proc.stdout.fileno(), b"", time.monotonic() + 1.0
    while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if not (chunk := os.read(fd, 65536)):
            break  # the pipe's end
        out += chunk
    else:
        pytest.fail(f"ako exited 1 s ago, the pipe is still open (read so far: {out!r})")
    assert out.decode().startswith("ako: error: unknown optimizer 'lbfgs'")

def idx_dir(tmp_path, side: int):
    """A Fashion-MNIST-like directory of 20 images of side x side pixels."""
    d = tmp_path / f"data{side}"
    d.mkdir()
    images = np.zeros((20, side, side), np.uint8)
    labels = np.arange(20, dtype=np.uint8) % 10
    for split in ("train", "t10k"):
        write_idx(d / f"{split}-images-idx3-ubyte", images, gz=False)
        write_idx(d / f"{split}-labels-idx1-ubyte", labels, gz=False)
    return d


def test_images_too_small_for_the_model(tmp_path, out_dir, capsys):
    data = idx_dir(tmp_path, side=1)
    code, err = run_cli(["--dataset", "fashion-mnist", "--data-dir", str(data), "--batch-size", "4"], out_dir, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "model 'cnn' cannot take inputs of shape (1, 1, 1)" in err


def test_images_with_no_pixels(tmp_path, out_dir, capsys):
    data = idx_dir(tmp_path, side=2)
    raw = bytearray((data / "train-images-idx3-ubyte").read_bytes()[:16])
    raw[8:16] = bytes(8)  # rows = cols = 0
    (data / "train-images-idx3-ubyte").write_bytes(bytes(raw))
    code, err = run_cli(["--dataset", "fashion-mnist", "--data-dir", str(data)], out_dir, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "every dimension must be at least 1" in err


def test_a_target_beyond_the_builtin_evaluation_is_kept_for_a_users_eval_fn():
    """accuracy>=90 can never be met by the built-in evaluation (a fraction), and is refused
    there; a user's eval_fn may count accuracy in percent, so with one it stands."""
    from ako.checks import ConfigError
    from ako.config import TrainConfig, validate

    with pytest.raises(ConfigError, match="can never be met"):
        validate(TrainConfig(target="accuracy>=90"))
    assert validate(TrainConfig(target="accuracy>=90", eval_fn="mine.metrics:percent")).goal.value == 90
    assert validate(TrainConfig(target="loss<=0")).goal.value == 0  # reachable in principle


def test_the_installed_ako_script_trains(tmp_path):
    """`ako train` through the console script that README and `make demo` run, not `python -m
    ako`: each worker imports the script again (as multiprocessing does), and that import must
    start nothing (it once started a fork server inside every worker, which failed)."""
    script = Path(sys.executable).parent / "ako"
    cmd = [str(script), "train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits", "--epochs", "0.1",
           "--out-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "ako allreduce: 2 workers, cnn on digits" in proc.stdout, proc.stdout


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_a_summary_that_cannot_be_printed_is_one_line_and_the_run_is_whole(tmp_path, command):
    """stdout on a full disk (`>/dev/full`): one line says so and where the summary is, exit
    status 1, the run directory whole (ako simulate gave a traceback; ako train a bare 'No space
    left on device'). A bar on such a stderr is dropped, not the run (`ako simulate --progress`
    failed at its start). Found by a breaker's trial."""
    cmd = [sys.executable, "-m", "ako", command, "--strategy", "allreduce", "--workers", "2", "--dataset", "digits",
           "--epochs", "0.1", "--progress"]  # fmt: skip
    with open("/dev/full", "w") as full:
        printed = subprocess.run([*cmd, "--out-dir", str(tmp_path / "out")], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        if command == "simulate":  # ako train's bar was dropped before
            barred = subprocess.run([*cmd, "--out-dir", str(tmp_path / "err")], stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
            assert barred.returncode == 0 and "saved model" in barred.stdout
    (run_dir,) = (tmp_path / "out").glob("*")
    assert printed.returncode == 1 and printed.stderr.splitlines()[-1].endswith(
        f"could not print the summary (No space left on device); {run_dir} holds it all")
    for run_dir in tmp_path.glob("*/*"):
        assert (run_dir / "summary.json").exists() and (run_dir / "model.pt").exists()


def _closing(*fds):
    return lambda: [os.close(fd) for fd in fds]


@pytest.mark.parametrize("command, closed", [("train", (1,)), ("train", (1, 2)), ("simulate", (2,))])
def test_a_run_started_with_stdout_or_stderr_closed_finishes(tmp_path, command, closed):
    """`ako train ... >&-`: by the launch another file (an epoll's) had number 1, and the
    workers took it as their stdout: a finished run failed with `Invalid argument`. They now
    print to /dev/null, and the run ends as it should, its outputs written. With both closed
    (`>&- 2>&-`) the workers had no sys.stderr and failed without a word (exit 1, no run
    directory); `ako simulate --progress 2>&-` failed in its bar (found by a breaker's trial)."""
    cmd = [sys.executable, "-m", "ako", command, "--strategy", "allreduce", "--workers", "2", "--dataset", "digits",
           "--epochs", "0.1", "--progress", "--out-dir", str(tmp_path)]  # fmt: skip
    stderr = None if 2 in closed else subprocess.PIPE
    proc = subprocess.run(cmd, stderr=stderr, text=True, timeout=120, preexec_fn=_closing(*closed))
    assert proc.returncode == 0 and "Traceback" not in (proc.stderr or ""), proc.stderr
    (run_dir,) = tmp_path.glob("*")
    assert (run_dir / "summary.json").exists() and (run_dir / "model.pt").exists()
