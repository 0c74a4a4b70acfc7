"""Bring your own training: torch optimizers and schedules, a loss and metrics of your own,
your model and data by name on the command line, DataLoaders, accumulation and precision,
model.pt, TensorBoard, and a resume that keeps the run's settings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

import ako
from ako.cli import main
from ako.config import TrainConfig, validate
from ako.data import load_dataset
from ako.optim import Optimization
from helpers import orphans_since, session, single_process_sgd, small_config
from own_training import DictNet, dict_collate, dict_loss, dict_metrics, digits_net

TESTS = Path(__file__).parent
ADAMW = dict(optimizer="adamw", lr=0.003, momentum=None, nesterov=None, weight_decay=0.01,
             optimizer_args={"betas": [0.8, 0.99]})  # fmt: skip


def run_dirs(tmp_path) -> list[Path]:
    return sorted((tmp_path / "runs").glob("*/"))


@pytest.mark.parametrize("strategy, servers", [("allreduce", None), ("bsp", 2)])
def test_adamw_with_a_cosine_schedule_equals_single_process_adamw(tmp_path, strategy, servers):
    """AdamW (betas 0.8, 0.99) under a cosine schedule with warm-up: all-reduce on every
    worker, and bsp on 2 servers' shards, equal one process stepping the whole vector on the
    union of the batches."""
    config = small_config(tmp_path, strategy=strategy, servers=servers, lr_schedule="cosine", warmup="2", **ADAMW)
    result = ako.train(config)
    steps = result.summary["iterations"]
    assert steps == 6
    expected = single_process_sgd(replace(config, servers=None, strategy="allreduce"), steps)
    torch.testing.assert_close(result.workers[0].params, expected, rtol=0, atol=1e-5)


def test_a_cosine_schedule_with_warmup_gives_torch_s_rates_and_resumes_at_its_step():
    """lr_k = lr (k + 1) / w for k < w, then lr (1 + cos(pi (k - w) / (T - w))) / 2: the rates
    of each step, and a schedule restored from step 4's state dict goes on from step 4."""
    config = validate(TrainConfig(optimizer="adamw", lr=0.01, lr_schedule="cosine", warmup="3", epochs=1.0))
    steps, w = 10, 3
    expected = [0.01 * (k + 1) / w if k < w else 0.01 * (1 + math.cos(math.pi * (k - w) / (steps - w))) / 2 for k in range(steps)]
    optimization = Optimization(config, steps)
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(k)) for k in range(steps)]
    whole, params = [], torch.zeros(5)
    optimizer = optimization.build(params)
    for g in grads:
        whole.append(optimizer.lr)
        optimizer.step(g)
    assert whole == pytest.approx(expected, rel=1e-12)
    resumed_params = torch.zeros(5)
    first = optimization.build(resumed_params)
    for g in grads[:4]:
        first.step(g)
    state = first.state_dict()
    again = optimization.build(resumed_params)
    again.load_state_dict(state)
    rates = []
    for g in grads[4:]:
        rates.append(again.lr)
        again.step(g)
    assert rates == pytest.approx(expected[4:], rel=1e-12)
    assert torch.equal(resumed_params, params)


@pytest.mark.parametrize("strategy, optimizer, scaling, factor", [
    ("gossip", "adamw", "auto", 2.0), ("asp", "adam", "auto", 2.0), ("ssp", "adamw", "auto", 2.0),
    ("gossip", "sgd", "auto", 1.0), ("allreduce", "adamw", "auto", 1.0), ("ako", "adamw", "auto", 1.0),
    ("easgd", "adamw", "auto", 2.0), ("diloco", "adamw", "auto", 1.0), ("gossip", "adamw", "none", 1.0), ("allreduce", "sgd", "sqrt", 2.0),
    ("allreduce", "adamw", "linear", 4.0),
])  # fmt: skip
def test_lr_scaling_auto_takes_sqrt_n_where_the_workers_own_adaptive_steps_are_averaged(strategy, optimizer, scaling, factor):
    """4 workers: the optimizer a worker builds steps at factor x the configured lr."""
    from ako.strategies import STRATEGIES

    config = validate(TrainConfig(strategy=strategy, workers=4, optimizer=optimizer, lr=0.01, lr_scaling=scaling,
                                  **({"momentum": None, "nesterov": None, "weight_decay": None} if optimizer != "sgd" else {})))  # fmt: skip
    built = Optimization(config, 8, averages_own_steps=STRATEGIES[strategy].averages_own_steps).build(torch.zeros(3))
    assert built.lr == pytest.approx(0.01 * factor, rel=1e-12)


def test_the_summary_says_the_learning_rate_and_betas_the_strategy_took(tmp_path, capfd):
    """asp with AdamW: sqrt(n) x lr (`--lr-scaling auto`) and beta1 0.5 for its stale steps."""
    code = main(["train", *SMALL, "--strategy", "asp", "--optimizer", "adamw", "--lr", "0.003", "--epochs", "0.25",
                 "--out-dir", str(tmp_path / "runs")])  # fmt: skip
    assert code == 0
    out = capfd.readouterr().out
    assert "  learning rate    0.004243 = --lr 0.003 x 1.414 (--lr-scaling auto: sqrt(workers)" in out
    assert "  betas            0.5, 0.999 (beta1 lowered for the workers' steps on stale parameters" in out
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stale_betas"] == [0.5, 0.999]
    assert (summary["lr"], summary["lr_factor"], summary["lr_scaling"]) == (0.00424264, 1.41421, "auto")


@pytest.mark.parametrize("strategy,optimizer,given,settings,betas", [
    ("asp", "adamw", None, {}, (0.5, 0.999)), ("ssp", "adam", None, {}, (0.5, 0.999)),
    ("ssp", "nadam", None, {}, (0.5, 0.999)), ("ako", "adamw", None, {}, (0.5, 0.999)),
    ("ako", "adamw", None, {"partitions": 1}, (0.5, 0.999)), ("asp", "adamw", [0.8, 0.95], {}, (0.8, 0.95)),
    ("ako", "adamw", None, {"partitions": 1, "staleness": 0}, (0.9, 0.999)),
    ("ako", "adamw", None, {"staleness": "auto"}, (0.5, 0.999)), ("ako", "adamw", None, {"workers": 1}, (0.9, 0.999)),
    ("allreduce", "adamw", None, {}, (0.9, 0.999)), ("gossip", "adamw", None, {}, (0.9, 0.999)),
    ("asp", "sgd", None, {}, None), ("ako", "sgd", None, {}, None),
])  # fmt: skip
def test_stale_steps_take_a_lower_beta1_unless_betas_are_given(strategy, optimizer, given, settings, betas):
    """ssp's, asp's and (out of lock-step, with peers) ako's workers step on stale parameters:
    Adam's family gets beta1 0.5 there, the user's betas where given, and sgd (no betas) keeps
    its momentum."""
    from ako.strategies import STRATEGIES

    config = validate(TrainConfig(strategy=strategy, optimizer=optimizer,
                                  optimizer_args={"betas": given} if given else None, **{"workers": 4, **settings},
                                  **({"momentum": None, "nesterov": None, "weight_decay": None} if optimizer != "sgd" else {})))  # fmt: skip
    built = Optimization(config, 8, stale_steps=STRATEGIES[strategy].steps_stale(config)).build(torch.zeros(3))
    group = built.optimizer.param_groups[0]
    assert group.get("betas") == betas
    if optimizer == "sgd":
        assert group["momentum"] == 0.9


def test_step_and_linear_schedules_and_the_linear_scaling_rule():
    config = validate(TrainConfig(workers=4, lr=0.1, lr_schedule="step", lr_gamma=0.5, lr_decay_epochs=0.5,
                                  lr_scaling="linear", epochs=2.0))  # fmt: skip
    optimizer = Optimization(config, 8).build(torch.zeros(3))  # 4 steps per epoch: decay every 2 steps
    rates = []
    for _ in range(8):
        rates.append(optimizer.lr)
        optimizer.step(torch.zeros(3))
    assert rates == pytest.approx([0.4, 0.4, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05])
    linear = Optimization(validate(TrainConfig(lr=0.1, lr_schedule="linear")), 4).build(torch.zeros(3))
    rates = []
    for _ in range(4):
        rates.append(linear.lr)
        linear.step(torch.zeros(3))
    assert rates == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_every_named_optimizer_steps_shards_as_the_whole_vector():
    """Elementwise: two halves stepped apart equal the whole vector stepped at once."""
    from ako.optim import OPTIMIZERS, check_elementwise

    for name in OPTIMIZERS:
        config = validate(TrainConfig(optimizer=name, momentum=None, nesterov=None, weight_decay=None))
        check_elementwise(Optimization(config, 10), "bsp")  # raises if not


class _LayerWise(torch.optim.Optimizer):
    """A LARS-like optimizer: the step is scaled by the tensor's norm, so not elementwise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * p.norm() / (p.grad.norm() + 1e-12), alpha=-group["lr"])


def layer_wise(params):
    return _LayerWise(params)


def test_a_non_elementwise_optimizer_is_refused_where_servers_step_shards(tmp_path):
    config = small_config(tmp_path, strategy="bsp", servers=2)
    with pytest.raises(ako.ConfigError, match="bsp steps it on each server's shard, and it is not elementwise"):
        ako.train(config, optimizer_fn=layer_wise)
    assert not (tmp_path / "runs").exists() or not run_dirs(tmp_path)
    result = ako.train(replace(config, strategy="allreduce", servers=None), optimizer_fn=layer_wise)  # on the workers: fine
    assert result.summary["iterations"] == 6


def test_own_loss_metrics_and_collate_on_a_dict_model_train_to_a_loss_target(tmp_path):
    """A model taking and returning dicts, its own loss, metrics without accuracy, a dict
    collate function: it trains, and `target = "loss<=X"` stops the run at the first
    evaluation below X."""
    config = small_config(tmp_path, strategy="allreduce", epochs=20.0, eval_every=0.5, lr=0.05, target="loss<=1.0")
    result = ako.train(config, model_fn=DictNet, loss_fn=dict_loss, eval_fn=dict_metrics, collate_fn=dict_collate)
    s = result.summary
    assert s["target"] == "loss<=1" and s["time_to_target"] is not None
    assert s["test_metrics"]["loss"] <= 1.0 and s["test_accuracy"] is None and 0 <= s["test_metrics"]["error"] < 0.5
    assert s["iterations"] < 20 * 12  # stopped early
    records = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["test_loss"] for r in records]
    assert all(x > 1.0 for x in losses[:-2]) and losses[-2] <= 1.0  # the last is the final record
    assert s["time_to_target"] == records[-2]["time"]


def test_a_target_on_a_metric_the_evaluation_lacks_is_refused(tmp_path):
    with pytest.raises(ako.ConfigError, match="no metric 'accuracy'"):
        ako.train(small_config(tmp_path, target="accuracy>=0.5"), model_fn=DictNet, loss_fn=dict_loss,
                  eval_fn=dict_metrics, collate_fn=dict_collate)  # fmt: skip


def test_a_dataloader_gives_its_data_collate_and_batch_size(tmp_path):
    """train_set=DataLoader(..., batch_size=16, shuffle=True, collate_fn=...) trains as the
    data set with batch_size 16 does; a DataLoader with its own sampler is refused."""
    split = load_dataset("digits", train_samples=384, test_samples=60)
    config = small_config(tmp_path, strategy="allreduce", batch_size=4)  # the loader's 16 wins
    loader = DataLoader(split.train, batch_size=16, shuffle=True, collate_fn=dict_collate)
    via_loader = ako.train(config, model_fn=DictNet, train_set=loader, test_set=DataLoader(split.test),
                           loss_fn=dict_loss, eval_fn=dict_metrics)  # fmt: skip
    direct = ako.train(replace(config, batch_size=16), model_fn=DictNet, train_set=split.train, test_set=split.test,
                       loss_fn=dict_loss, eval_fn=dict_metrics, collate_fn=dict_collate)  # fmt: skip
    assert via_loader.summary["iterations"] == 6
    torch.testing.assert_close(via_loader.workers[0].params, direct.workers[0].params, rtol=0, atol=0)
    weighted = DataLoader(split.train, batch_size=16, sampler=WeightedRandomSampler([1.0] * 384, 384))
    with pytest.raises(ako.ConfigError, match="its own sampler \\(WeightedRandomSampler\\) cannot be sharded"):
        ako.train(config, train_set=weighted, test_set=split.test)


def test_accumulation_equals_the_larger_batch_and_loader_processes_keep_the_order(tmp_path):
    """batch 8 x accumulate 2 is batch 16 (the gradient of the mean loss over the same 16
    samples); 1 loader process per worker gives the same batches as none, and the loader
    processes end with their workers (they once lived on, kept by a fork server of their own)."""
    config = small_config(tmp_path, strategy="allreduce", momentum=0.0, weight_decay=0.0, nesterov=False)
    whole = ako.train(config)
    before = session()
    accumulated = ako.train(replace(config, batch_size=8, accumulate=2, num_workers=1))
    assert accumulated.summary["iterations"] == whole.summary["iterations"] == 6
    torch.testing.assert_close(accumulated.workers[0].params, whole.workers[0].params, rtol=0, atol=1e-6)
    assert orphans_since(before, within=5.0) == []


def test_bf16_trains(tmp_path):
    result = ako.train(small_config(tmp_path, strategy="allreduce", precision="bf16", epochs=3.0))
    assert result.summary["test_accuracy"] > 0.5  # chance is 0.1


def test_model_pt_loads_with_plain_torch_and_gives_the_reported_accuracy(tmp_path):
    """model.pt is a plain state_dict, BatchNorm statistics included: a fresh module loaded
    from it with torch alone scores what the summary says; ako.load_model gives the same."""
    config = small_config(tmp_path, strategy="allreduce", model="own_training:digits_net", epochs=2.0)
    result = ako.train(config)
    run_dir = Path(result.summary["run_dir"])
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert state["1.running_mean"].abs().sum() > 0 and state["1.num_batches_tracked"] > 0
    model = digits_net()
    model.load_state_dict(state)
    model.eval()
    split = load_dataset("digits", train_samples=384, test_samples=60)
    x, y = split.test.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    saved = result.summary["saved_model"]
    assert saved["source"] == "rank 0's replica" and saved["test_accuracy"] == pytest.approx(accuracy, abs=1e-5)
    assert result.summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-5)
    loaded = ako.load_model(run_dir)
    torch.testing.assert_close(dict(loaded.state_dict()), dict(state))
    assert torch.equal(torch.nn.utils.parameters_to_vector(loaded.parameters()), result.model)


def test_tensorboard_event_files_hold_the_logged_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = ako.train(small_config(tmp_path, strategy="gossip", eval_every=0.25, tensorboard=True))
    events = EventAccumulator(str(Path(result.summary["run_dir"]) / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"test/accuracy", "test/loss", "average/accuracy", "train/consensus_distance", "train/bytes_sent", "train/loss",
            "train/lr"} <= tags
    records = [json.loads(line) for line in (Path(result.summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("test/accuracy")] == pytest.approx([r["test_accuracy"] for r in records], abs=1e-6)
    assert [e.step for e in events.Scalars("test/accuracy")] == [r["samples"] for r in records]


def _ako(*args, cwd=TESTS, timeout=180):
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "ako", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)  # fmt: skip


SMALL = ["--dataset", "digits", "--train-samples", "384", "--test-samples", "60", "--batch-size", "16",
         "--no-progress", "--workers", "2"]  # fmt: skip


def test_own_model_and_dataset_by_name_from_the_cli_and_on_resume(tmp_path):
    """`--model own_training:digits_net --dataset own_training:digits_sets` trains, writes
    checkpoints, and `--resume` with no other flag goes on with the same model (its BatchNorm
    statistics too), optimizer and schedule, keeping its config.toml and checkpointing
    further: it ends with the model the run ended with."""
    out = str(tmp_path / "runs")
    first = _ako("train", *SMALL, "--model", "own_training:digits_net", "--dataset", "own_training:digits_sets",
                 "--epochs", "15", "--optimizer", "adam", "--lr-schedule", "cosine", "--checkpoint-every", "0.1s",
                 "--out-dir", out, "--strategy", "allreduce")  # fmt: skip
    assert first.returncode == 0, first.stderr
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "own_training:digits_net" and summary["dataset"] == "own_training:digits_sets"
    from ako.runtime.distributed import checkpoint

    point = checkpoint.latest(run_dir, 2)
    assert point is not None and 0 < point < summary["iterations"]
    finished = _ako("train", "--resume", str(run_dir))
    assert finished.returncode == 2 and "that run finished" in finished.stderr, finished.stderr
    (run_dir / "summary.json").unlink()  # as if the run had been killed after that checkpoint
    file = checkpoint.path(run_dir, point, 1)
    kept = file.read_bytes()
    state = torch.load(file, weights_only=True)
    state["buffers"]["1.running_mean"] = state["buffers"]["1.running_mean"][:3]
    torch.save(state, file)  # as another model with the same parameters (say, GroupNorm) would have saved it
    misfit = _ako("train", "--resume", str(run_dir))
    assert misfit.returncode == 2 and misfit.stderr.count("\n") == 1, misfit.stderr  # before any worker starts
    assert "rank1.pt': written by another model (buffer 1.running_mean is torch.float32 (3,), the model's torch.float32 (" in misfit.stderr
    file.write_bytes(kept)
    short = _ako("train", "--resume", str(run_dir), "--epochs", "0.1")  # the checkpoint is further on than that
    assert short.returncode == 2 and short.stderr.count("\n") == 1, short.stderr
    assert f"its checkpoint is at step {point} (" in short.stderr and "--epochs 0.1 plans 1 in all" in short.stderr, short.stderr
    whole = torch.load(run_dir / "model.pt")
    resumed = _ako("train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    config = (run_dir / "config.toml").read_text()
    assert 'model = "own_training:digits_net"' in config and 'optimizer = "adam"' in config and 'lr_schedule = "cosine"' in config
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["resumed_from_step"] == point and again["iterations"] == summary["iterations"]
    # all-reduce is lockstep: the resumed run ends bit for bit where the whole run did, BatchNorm's
    # running statistics included (the checkpoint holds the module's buffers)
    resumed_model = torch.load(run_dir / "model.pt")
    assert resumed_model.keys() == whole.keys()
    assert all(torch.equal(resumed_model[name], whole[name]) for name in whole)
    assert again["test_accuracy"] == summary["test_accuracy"]


def test_resume_through_the_api_keeps_the_saved_settings(tmp_path):
    from test_checkpoint import checkpointed_run

    run_dir = checkpointed_run(tmp_path, strategy="allreduce", optimizer="adamw", lr=0.002, momentum=None, nesterov=None,
                               weight_decay=None)  # fmt: skip
    kept = ako.api.with_saved(TrainConfig(resume=str(run_dir), epochs=3.0))
    assert (kept.strategy, kept.optimizer, kept.lr, kept.batch_size, kept.epochs) == ("allreduce", "adamw", 0.002, 16, 3.0)


def test_own_model_by_name_under_torchrun_and_in_a_sweep_cell(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ako", "train",
           "--model", "own_training:digits_net", *SMALL, "--epochs", "1", "--out-dir", str(tmp_path / "runs"),
           "--strategy", "allreduce"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    [run_dir] = run_dirs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["model"] == "own_training:digits_net"
    sweep = tmp_path / "own.toml"
    sweep.write_text(
        'name = "own"\n[base]\nmodel = "own_training:digits_net"\ndataset = "digits"\ntrain_samples = 384\n'
        'test_samples = 60\nbatch_size = 16\nepochs = 0.5\nworkers = 2\ntarget = "loss<=5"\n[[arm]]\nname = "allreduce"\nstrategy = "allreduce"\n'
    )
    done = _ako("sweep", str(sweep), "--out", str(tmp_path / "sweep"), "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [cell] = list((tmp_path / "sweep" / "cells").glob("*/"))
    summaries = list(cell.rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["model"] == "own_training:digits_net"
    report = _ako("report", str(tmp_path / "sweep"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "| arm | time to loss<=5 (s) | final loss |" in table


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lbfgs"], "optimizer 'lbfgs': choose one of sgd, adam"),
    (["--optimizer", "adam", "--momentum", "0.9"], "momentum 0.9: optimizer adam has no such setting"),
    (["--optimizer-arg", "betas=2,0.9", "--optimizer", "adam"], "optimizer adam: Invalid beta parameter"),
    (["--optimizer-arg", "gamma=3"], "optimizer_args 'gamma' (--optimizer-arg): optimizer sgd takes"),
    (["--optimizer", "adam", "--optimizer-arg", "betas=0.9"], "optimizer_args betas 0.9 (--optimizer-arg): adam's betas is 2 numbers"),
    (["--optimizer", "adam", "--optimizer-arg", "amsgrad=yes"], "optimizer_args amsgrad 'yes' (--optimizer-arg): adam's amsgrad is true or false"),
    (["--optimizer-arg", "lr=0.01"], "optimizer_args 'lr': give it as --lr"),
    (["--warmup", "1000", "--epochs", "1"], "warmup 1000: 1000 optimizer steps, longer than the run's 12"),
    (["--strategy", "ako", "--partitions", "13", "--epochs", "1"], "partitions 13: more than the run's 12 steps a worker"),
    (["--lr-schedule", "exp"], "lr_schedule 'exp': choose one of constant, step, cosine, linear"),
    (["--warmup", "ten"], "warmup 'ten': expected optimizer steps"),
    (["--target", "loss<0.3"], "target 'loss<0.3': expected a metric, >= or <="),
    (["--model", "own_training:nothing"], "model 'own_training:nothing': module own_training has no 'nothing'"),
    (["--model", "no_such_module:net"], "model 'no_such_module:net': no module named 'no_such_module'"),
    (["--model", "own_training:broken_net"], "model 'own_training:broken_net' raised RuntimeError: no weights here"),
    (["--model", "own_training:not_a_module"], "the factory returned int, not an nn.Module"),
    (["--dataset", "own_training:digits_net"], "the factory must return (train_set, test_set)"),
])  # fmt: skip
def test_bad_training_settings_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, flags, message):
    code = main(["train", *SMALL, "--out-dir", str(tmp_path / "runs"), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ako: error: ") and message in lines[0], err
    assert not run_dirs(tmp_path)


def test_the_cli_takes_an_optimizer_with_its_settings(tmp_path):
    code = main(["train", *SMALL, "--strategy", "ako", "--optimizer", "adamw", "--optimizer-arg", "betas=(0.85,0.98)",
                 "--optimizer-arg", "amsgrad=True", "--lr", "0.003", "--out-dir", str(tmp_path / "runs"), "--epochs", "1"])  # fmt: skip
    assert code == 0
    [run_dir] = run_dirs(tmp_path)
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["optimizer_args"] == {"betas": [0.85, 0.98], "amsgrad": True} and config["lr"] == 0.003
    assert "weight_decay" in config and "momentum" not in config  # adamw's own default is recorded; it has no momentum
    assert json.loads((run_dir / "summary.json").read_text())["test_accuracy"] > 0.2


def test_fp16_loss_scale_unscales_drops_overflow_and_grows():
    """GradScaler's rule: the gradient is divided by the scale; an overflow zeroes it and
    halves the scale; 2000 finite steps in a row double it. On the CPU here (the CLI allows
    fp16 only with CUDA), through the replica's own fp16 path."""
    from ako.replica import LossScale, Replica

    scale = LossScale()
    grad = torch.full((4,), 2.0**16 * 3)
    scale.unscale(grad)
    assert grad.tolist() == [3.0] * 4 and scale.scale == 2.0**16
    grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    scale.unscale(grad)
    assert grad.tolist() == [0.0] * 4 and scale.scale == 2.0**15 and scale.skipped == 1
    for _ in range(2000):
        scale.unscale(torch.ones(4))
    assert scale.scale == 2.0**16
    config = validate(TrainConfig())
    torch.manual_seed(0)
    fp32 = Replica(digits_net(), Optimization(config, 1))
    torch.manual_seed(0)
    fp16 = Replica(digits_net(), Optimization(config, 1), precision="fp16")
    split = load_dataset("digits", train_samples=64, test_samples=8)
    batch = split.train.tensors
    fp32.compute_gradient([batch])
    fp16.compute_gradient([batch])
    assert fp16.loss_scale.skipped == 0
    torch.testing.assert_close(fp16.grad, fp32.grad, rtol=0.05, atol=2e-3)


def test_a_resumed_schedule_follows_the_new_plan_from_the_saved_step():
    """A cosine schedule saved at step 6 of 10, resumed by a run of 20 steps (--epochs doubled),
    goes on along the 20-step cosine from step 6, not the old plan's."""
    short = Optimization(validate(TrainConfig(lr=0.1, lr_schedule="cosine", epochs=1.0)), 10)
    long = Optimization(validate(TrainConfig(lr=0.1, lr_schedule="cosine", epochs=2.0)), 20)
    first = short.build(torch.zeros(3))
    for _ in range(6):
        first.step(torch.ones(3))
    resumed = long.build(torch.zeros(3))
    resumed.load_state_dict(first.state_dict())
    rates = []
    for _ in range(4):
        rates.append(resumed.lr)
        resumed.step(torch.ones(3))
    assert rates == pytest.approx([0.1 * (1 + math.cos(math.pi * k / 20)) / 2 for k in range(6, 10)], rel=1e-12)
    assert resumed.steps == 10


def test_a_run_of_main_s_functions_says_how_to_resume_it(tmp_path):
    """config.toml says "custom" for a model, data set or function with no importable name;
    a CLI resume of such a run says to resume it from its script, and the API's resume keeps
    the functions it is given."""
    from ako.config import to_toml

    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(small_config(tmp_path, strategy="allreduce", model="custom",
                                                              optimizer_fn="custom")))  # fmt: skip
    code = main(["train", "--resume", str(run_dir)])
    assert code == 2
    kept = ako.api.with_saved(TrainConfig(resume=str(run_dir)))
    assert (kept.model, kept.optimizer_fn, kept.strategy) == ("cnn", None, "allreduce")
    with pytest.raises(ako.ConfigError, match="optimizer_fn 'custom': the run's optimizer_fn had no importable name"):
        ako.train(TrainConfig(resume=str(run_dir), optimizer_fn="custom"), model_fn=digits_net, keep_saved=False)


def test_a_diverged_run_still_prints_and_writes_its_summary(tmp_path):
    proc = _ako("train", *SMALL, "--workers", "1", "--epochs", "0.5", "--lr", "1000", "--momentum", "0.99",
                "--out-dir", str(tmp_path / "runs"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "test loss        n/a (diverged)" in proc.stdout
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())  # strict JSON: no NaN
    assert summary["test_metrics"]["loss"] is None and summary["test_accuracy"] is not None


def test_a_resume_takes_the_new_settings_and_refuses_another_optimizer(tmp_path, capsys):
    """The saved optimizer state keeps its moments, but this run's --lr and betas apply; a
    checkpoint of adam does not resume as sgd."""
    old = validate(TrainConfig(optimizer="adam", lr=0.01, optimizer_args={"betas": [0.9, 0.99]}))
    new = validate(TrainConfig(optimizer="adam", lr=0.002, optimizer_args={"betas": [0.8, 0.9]}))
    first = Optimization(old, 10).build(torch.zeros(3))
    for _ in range(3):
        first.step(torch.ones(3))
    resumed = Optimization(new, 10).build(torch.zeros(3))
    resumed.load_state_dict(first.state_dict())
    group = resumed.optimizer.param_groups[0]
    assert (resumed.lr, group["betas"]) == (0.002, (0.8, 0.9))
    assert resumed.optimizer.state[resumed.params]["exp_avg"].abs().sum() > 0
    from test_checkpoint import checkpointed_run

    run_dir = checkpointed_run(tmp_path, strategy="allreduce", **ADAMW)
    code = main(["train", "--resume", str(run_dir), "--optimizer", "adam"])
    err = capsys.readouterr().err
    assert code == 2 and "written by a run with optimizer_name 'adamw', not 'adam'" in err and err.count("\n") == 1


def test_metrics_as_numpy_scalars_are_taken_as_numbers(tmp_path):
    """An `eval_fn` that gives NumPy scalars (np.float32) records the same figures as one that
    gives Python floats."""
    runs = [ako.simulate(small_config(tmp_path / name, strategy="allreduce", eval_fn=fn, epochs=0.5)).summary
            for name, fn in (("python", None), ("numpy", "own_training:numpy_metrics"))]  # fmt: skip
    figures = [[{k: v for k, v in json.loads(line).items() if k not in ("time", "wall")}  # the compute time is measured
                for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()] for run in runs]  # fmt: skip
    assert figures[1] == figures[0] and len(figures[0]) == 2 and all("test_accuracy" in r for r in figures[0])


@pytest.mark.parametrize("settings, functions, message", [
    ({}, {"eval_fn": "own_training:text_metrics"}, "eval_fn: metric 'accuracy' = 'high': each must be"),
    ({}, {"optimizer_fn": "own_training:no_optimizer"}, "optimizer_fn failed: TypeError: optimizer_fn returned NoneType"),
    ({}, {"scheduler_fn": "own_training:plateau"}, "scheduler_fn: a step failed: TypeError: ReduceLROnPlateau.step() missing"),
    ({"dataset": "own_training:bad_sample_sets"}, {}, "the training set failed on a sample: IndexError: sample 0 is missing"),
    ({"optimizer": "adam", "momentum": None, "nesterov": None, "optimizer_args": {"betas": [0.9, 0.95, 0.99]}}, {},
     "adam's betas is 2 numbers"),
    ({"optimizer_args": {"maximize": "no"}}, {}, "optimizer_args maximize 'no' (--optimizer-arg): sgd's maximize is true or false"),
])  # fmt: skip
def test_the_user_s_functions_and_settings_are_checked_before_the_run(tmp_path, settings, functions, message):
    config = small_config(tmp_path, strategy="allreduce", **settings, **functions)
    with pytest.raises(ako.ConfigError, match=message.replace("(", "\\(").replace(")", "\\)").replace("'", ".")):
        ako.train(config)
    assert not run_dirs(tmp_path)


def test_a_lambda_or_a_partial_is_refused_or_recorded_as_custom(tmp_path):
    import functools

    with pytest.raises(ako.ConfigError, match="loss_fn '.*<lambda>': the worker processes cannot get it"):
        ako.train(small_config(tmp_path), loss_fn=lambda model, batch: model(batch[0]).sum())
    from ako.run.imports import spec_of

    assert spec_of(functools.partial(digits_net)) is None and spec_of(digits_net) == "own_training:digits_net"


def test_a_stuck_data_loader_process_fails_the_run_within_the_timeout(tmp_path):
    proc = _ako("train", *SMALL, "--strategy", "allreduce", "--dataset", "own_training:stuck_loader_sets",
                "--num-workers", "1", "--timeout", "3", "--out-dir", str(tmp_path / "runs"), timeout=90)  # fmt: skip
    assert proc.returncode == 1 and "DataLoader timed out after 3.0 seconds" in proc.stderr, proc.stderr


def test_load_model_of_a_damaged_model_file_is_one_error(tmp_path):
    result = ako.train(small_config(tmp_path, strategy="allreduce"))
    run_dir = Path(result.summary["run_dir"])
    (run_dir / "model.pt").write_bytes(b"not a model")
    with pytest.raises(ako.ConfigError, match="model.pt: cannot load it into the model"):
        ako.load_model(run_dir)
    with pytest.raises(ako.ConfigError, match="no such directory"):
        ako.load_model(tmp_path / "nowhere")
    with pytest.raises(ako.ConfigError, match="not a run directory"):
        ako.load_model(tmp_path)


def test_samples_left_out_of_each_epoch_are_counted(tmp_path):
    """390 samples, 2 workers, batch 16: shards of 195 give 12 steps each, 384 samples an
    epoch; 6 are left out (others each epoch), and the summary says so."""
    result = ako.train(small_config(tmp_path, strategy="allreduce", train_samples=390))
    s = result.summary
    assert (s["train_samples"], s["samples_left_out_per_epoch"], s["per_worker"][0]["samples"]) == (390, 6, 96)


def test_a_rank_slow_to_start_is_waited_for_past_a_short_timeout(tmp_path):
    """Rank 1 builds its model 3 s after rank 0, with --timeout 1: the start-up waits last at
    least 30 s under ako's own launcher (a process that dies meanwhile is seen at once), and
    the run trains."""
    proc = _ako("train", *SMALL, "--strategy", "allreduce", "--model", "own_training:slow_on_rank_1",
                "--epochs", "1", "--timeout", "1", "--out-dir", str(tmp_path / "runs"), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout
