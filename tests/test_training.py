"""Training behaviour end to end: stop conditions, run outputs, torchrun, the Python API with
the user's own model and data set."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
import torch

import ako
from ako.data import load_dataset
from ako.models import MaxPool2d
from helpers import DigitsAsList, digits_cnn, small_config
from own_training import slow_metrics


def test_run_directory_holds_config_metrics_and_summary(tmp_path):
    result = ako.train(small_config(tmp_path, strategy="ako", partitions=2, eval_every=0.25))
    run_dir = tmp_path / "runs" / result.summary["run_dir"].split("/")[-1]
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert (config["strategy"], config["workers"], config["partitions"]) == ("ako", 2, 2)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0.0, 0.25, 0.5]  # every 3 steps of 12 per epoch, then the end
    assert all(0 <= r["test_accuracy"] <= 1 for r in records)
    assert records[0]["bytes_sent"] == 0 and records[-1]["bytes_sent"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["test_accuracy"] == records[-1]["test_accuracy"]
    short = sum(w["samples_short"] for w in summary["per_worker"])  # Ako cuts a step behind its peers short
    assert summary["samples"] + short == 2 * 6 * 16
    assert not list(run_dir.glob(".*tmp"))


def test_the_summary_counts_the_evaluations_after_training(tmp_path, capfd):
    """Without a target, rank 0 evaluates its snapshots after training: those seconds are in
    the summary's evaluation_seconds and its "(+ N s evaluating)", not only the pauses during
    training. Here 3 snapshots (points 0 and 1 and the end): 3 evaluations of one slow batch,
    1.5 s at least. (Under ako how many there are depends on the run: after a flush that
    changed nothing, its model before the flush is the one evaluated already.)"""
    result = ako.train(small_config(tmp_path, strategy="allreduce", eval_every=0.25), eval_fn=slow_metrics)
    s = result.summary
    assert s["evaluation_seconds"] >= 1.5 > s["wall_seconds"] - s["train_seconds"]
    assert f"of training (+ {s['evaluation_seconds']:.1f} s evaluating)" in capfd.readouterr().out


def test_max_time_stops_every_strategy_on_an_agreed_step(tmp_path):
    for strategy in ("allreduce", "ako"):
        config = small_config(tmp_path, strategy=strategy, epochs=10_000.0, max_time=2.0)
        summary = ako.train(config).summary
        # the step at which some worker's clock passed 2 s; rank 0's clock may be a moment behind
        assert 1.95 <= summary["train_seconds"] < 8.0
        steps = {w["steps"] for w in summary["per_worker"]}
        assert len(steps) == 1 or strategy == "ako"  # allreduce workers agree on the last step


def test_target_accuracy_stops_the_run(tmp_path):
    for strategy in ("allreduce", "ako"):
        config = small_config(
            tmp_path, strategy=strategy, train_samples=None, test_samples=None, epochs=200.0,
            eval_every=0.5, target_accuracy=0.8,
        )  # fmt: skip
        summary = ako.train(config).summary
        assert summary["time_to_accuracy"]["0.8"] is not None
        assert summary["epochs"] < 200


def test_own_model_and_map_style_data_set_match_the_built_in_path(tmp_path):
    """A model factory and a plain map-style Dataset give the same replicas as the registry's
    cnn on the same digits, bit for bit up to float noise."""
    config = small_config(tmp_path, strategy="allreduce")
    built_in = ako.train(config)
    split = load_dataset("digits", train_samples=config.train_samples, test_samples=config.test_samples)
    own = ako.train(
        config, model_fn=digits_cnn, train_set=DigitsAsList(split.train), test_set=DigitsAsList(split.test)
    )
    assert own.summary["dataset"] == "custom"
    for a, b in zip(own.workers, built_in.workers):
        torch.testing.assert_close(a.params, b.params, rtol=0, atol=1e-6)


def test_torchrun_gives_the_ranks(tmp_path):
    """`torchrun -m ako train` runs one worker per process, with torchrun's ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ako", "train", "--strategy", "allreduce", "--dataset", "digits", "--epochs", "1",
        "--out-dir", str(tmp_path / "runs"), "--no-progress", "--workers", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summaries = list((tmp_path / "runs").glob("*/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["workers"] == 2
    assert [w["rank"] for w in summary["per_worker"]] == [0, 1]
    assert proc.stdout.count("test accuracy") == 1  # rank 0 prints the summary


@pytest.mark.parametrize("values", ["ties", "nan", "random"])
def test_the_cnn_s_max_pooling_is_nn_maxpool2d_bit_for_bit(values):
    """`ako.models.MaxPool2d` (channels-last on the CPU) against nn.MaxPool2d: the same output
    and the same input gradient, with many ties (small integers), with NaNs, and at random."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (4, 16, 10, 12), generator=generator).float()
    if values == "nan":
        x[0, 0, 0, 1] = x[1, 3, 5, 5] = float("nan")
    elif values == "random":
        x = torch.randn(4, 16, 10, 12, generator=generator)
    grad = torch.randn(4, 16, 5, 6, generator=generator)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = MaxPool2d(2)(ours), torch.nn.MaxPool2d(2)(theirs)
    a.backward(grad)
    b.backward(grad)
    assert torch.equal(a, b) or (values == "nan" and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
    assert torch.equal(ours.grad, theirs.grad)


def test_the_cnn_s_max_pooling_takes_double_backward_torch_func_and_torchscript():
    """What nn.MaxPool2d takes, ako's does: a gradient penalty's double backward (the same
    values), torch.func's vmap and grad, TorchScript (there it is nn.MaxPool2d)."""
    from torch.func import grad, vmap

    from ako.models import build_model

    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    second = []
    for pool in (MaxPool2d(2), torch.nn.MaxPool2d(2)):
        first = torch.autograd.grad(pool(x).pow(2).sum(), x, create_graph=True)[0]
        second.append(torch.autograd.grad(first.sum(), x)[0])
    assert torch.equal(*second) and second[0].abs().sum() > 0
    xs = torch.randn(4, 2, 3, 6, 6)
    assert torch.equal(vmap(grad(lambda t: MaxPool2d(2)(t).sum()))(xs), vmap(grad(lambda t: torch.nn.MaxPool2d(2)(t).sum()))(xs))
    model = build_model("cnn", (1, 28, 28), 10).eval()
    image = torch.randn(2, 1, 28, 28)
    assert torch.equal(torch.jit.script(model)(image), model(image))
