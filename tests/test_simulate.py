"""The simulated runtime: equivalence with SGD and the distributed runtime, hand-computed
virtual schedules, emergent server contention, Ako's constant traffic, determinism."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import simpy
import torch

import ako
from ako.cli import main
from ako.models import build_model
from ako.config import TrainConfig
from ako.runtime.simulated.costs import Costs, SharedHost
from ako.strategies import STRATEGIES
from ako.strategies.partition import partition_bounds
from helpers import make_replica, single_process_sgd, small_config

NUMEL = 22_602  # the cnn on 8x8 digits
G = NUMEL * 4  # bytes of one flat gradient


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as each distributed worker runs: on a loaded machine a second
    OpenMP thread spins and slows every gradient several-fold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def simulate(tmp_path, **overrides):
    return ako.simulate(small_config(tmp_path, **overrides))


def virtual(result) -> float:
    """Rank 0's training seconds, unrounded (the summary rounds to ms)."""
    return result.summary["simulation"]["rank0_seconds"]


def test_allreduce_equals_single_process_sgd_and_the_distributed_runtime(tmp_path):
    """Zero communication cost, no stragglers: n = 4 simulated workers equal SGD on the union
    of their mini-batches; n = 2 equal the distributed runtime's all-reduce."""
    config = small_config(tmp_path, strategy="allreduce", workers=4, seconds_per_sample=1e-3)
    result = ako.simulate(config)
    assert result.summary["per_worker"][0]["steps"] == 3  # 384 / 4 / 16 = 6 per epoch
    expected = single_process_sgd(config, 3)
    for w in result.workers:
        torch.testing.assert_close(w.params, expected, rtol=0, atol=1e-5)
    two = small_config(tmp_path, strategy="allreduce", workers=2)
    real = ako.train(two)
    simulated = ako.simulate(replace(two, seconds_per_sample=1e-3))
    for r, s in zip(real.workers, simulated.workers):
        torch.testing.assert_close(s.params, r.params, rtol=0, atol=1e-5)


# Hand-computed schedules: 2 workers, batch 16 at 1 ms per sample (c = 16 ms per step), links of
# 10 MB/s, 100 us latency, 6 steps (half an epoch of 384 samples).
C, B, LAT, STEPS = 0.016, 1e7, 1e-4, 6
COSTS = dict(seconds_per_sample=1e-3, bandwidth="10MB", latency="100us")


def test_allreduce_schedule(tmp_path):
    """Each step: compute c, then a ring all-reduce of the gradient plus the stop vote,
    2 (n-1)/n x bytes / B + 2 (n-1) x latency = (G + 4) / B + 2 x latency for n = 2."""
    result = simulate(tmp_path, strategy="allreduce", **COSTS)
    step = C + (G + 4) / B + 2 * LAT
    assert virtual(result) == pytest.approx(STEPS * step, rel=1e-12)
    w = result.summary["per_worker"][0]
    assert w["compute_seconds"] == pytest.approx(STEPS * C, abs=1e-6)
    assert w["communication_seconds"] == pytest.approx(STEPS * ((G + 4) / B + 2 * LAT), abs=1e-6)
    assert w["idle_seconds"] == pytest.approx(0, abs=1e-9)


def test_allreduce_schedule_with_a_straggler(tmp_path):
    """Worker 1 three times as slow: every step lasts 3c plus the all-reduce, and worker 0
    idles 2c per step waiting for it."""
    result = simulate(tmp_path, strategy="allreduce", straggler=("rank=1,factor=3",), **COSTS)
    assert virtual(result) == pytest.approx(STEPS * (3 * C + (G + 4) / B + 2 * LAT), rel=1e-12)
    assert result.summary["per_worker"][0]["idle_seconds"] == pytest.approx(STEPS * 2 * C, abs=1e-6)
    from ako.metrics import duration
    from ako.runtime.simulated.simulate import format_simulation

    compute, idle = duration(STEPS * C), duration(STEPS * 2 * C)  # each worker's, in the summary's lines
    assert f"  worker time      virtual s of compute {compute} / {duration(STEPS * 3 * C)}; idle {idle} / 0.0; " in format_simulation(result.summary)


def test_ako_two_partitions_lock_step_schedule(tmp_path):
    """p = 2, s = 0: each step computes c, sends partition t mod 2 (s_t bytes) to the peer
    and waits for the peer's, s_t / B + latency later; then both flush the whole accumulator
    (G / B + latency) and tell each other whether they lost a peer (1 byte / B + latency)."""
    result = simulate(tmp_path, strategy="ako", partitions=2, staleness=0, **COSTS)
    replica = make_replica(build_model("cnn", (1, 8, 8), 10), TrainConfig())
    sizes = [(hi - lo) * 4 for lo, hi in partition_bounds(NUMEL, 2, replica.boundaries)]
    expected = sum(C + sizes[t % 2] / B + LAT for t in range(STEPS)) + G / B + LAT + 1 / B + LAT
    assert virtual(result) == pytest.approx(expected, rel=1e-12)


def test_bsp_schedule(tmp_path):
    """One server. Both workers push G bytes at once; the second push queues behind the first
    on the server's downlink, and the server's replies go out one after the other on its
    uplink. From the second iteration on, worker 0 (released first) pushes while worker 1 is
    still receiving, so the downlink is free again when worker 1 pushes: every iteration costs
    c + 3 G / B + 2 x latency from worker 0's point of view, the first one included."""
    result = simulate(tmp_path, strategy="bsp", **COSTS)
    assert virtual(result) == pytest.approx(STEPS * (C + 3 * G / B + 2 * LAT), rel=1e-12)
    end = result.summary["simulation"]["virtual_seconds"]  # worker 1's last reply: one G / B later
    assert end == pytest.approx(virtual(result) + G / B, rel=1e-12)
    server = result.summary["per_server"][0]
    assert server["bytes_received"] == server["bytes_sent"] == 2 * STEPS * G
    assert server["downlink_utilisation"] == pytest.approx(2 * STEPS * G / B / end, abs=1e-4)


def test_absp_straggler_hands_in_part_of_its_assignment(tmp_path):
    """A-BSP in virtual time: worker 1 at factor 4 is told to stop after a micro-batch
    when worker 0 pushes its whole assignment, and its leftovers go first next time."""
    result = simulate(tmp_path, strategy="absp", straggler=("rank=1,factor=4",), **COSTS)
    fast, slow = result.summary["per_worker"]
    assert fast["handed_in"] == 1.0
    assert 0 < slow["handed_in"] < 1
    assert result.summary["oldest_waiting"] >= 1


def _bandwidth_bound(tmp_path, strategy, n, **overrides):
    config = small_config(
        tmp_path, strategy=strategy, workers=n, train_samples=1024, batch_size=8, epochs=10.0,
        eval_every=0.25, seconds_per_sample=1e-3, **overrides,
    )  # fmt: skip
    return ako.simulate(config).summary


def test_server_downlink_saturates_as_workers_grow(tmp_path):
    """asp, one server, each push taking c / 20 of the server's downlink: its utilisation grows
    with n (steady state n / 22 below saturation) until the link is the bottleneck (32 pushes
    per c need 1.6 c of link time). Over the whole run it stays below 1 at n = 32 only because
    the link idles during the first computation, the lock-step warm-up clocks and while the
    last workers finish (10 epochs: 40 clocks at n = 32, of which 12 in lock-step)."""
    bandwidth = f"{G * 20 / 0.008:.0f}"  # bytes/s: G / B = c / 20 for c = 8 samples x 1 ms
    use = [_bandwidth_bound(tmp_path, "asp", n, bandwidth=bandwidth)["per_server"][0]["downlink_utilisation"] for n in (4, 8, 16, 32)]
    assert use == sorted(use)
    assert use[0] < 0.25
    assert use[-1] > 0.8


@pytest.mark.parametrize("strategy,overrides", [("ako", {}), ("asp", {})])
def test_same_seed_same_result(tmp_path, strategy, overrides):
    """Random stragglers and asynchronous strategies: two runs with the same seed agree bit for
    bit (parameters, times, bytes)."""
    config = dict(strategy=strategy, straggler=("prob=0.3,factor=3",), **COSTS, **overrides)
    one, two = simulate(tmp_path, **config), simulate(tmp_path, **config)
    for a, b in zip(one.workers, two.workers):
        assert torch.equal(a.params, b.params)
    drop = ("run_dir", "wall_seconds", "simulation")
    assert {k: v for k, v in one.summary.items() if k not in drop} == {k: v for k, v in two.summary.items() if k not in drop}
    assert virtual(one) == virtual(two)


def test_shared_host_processor_sharing():
    """Computations on one shared host (1, 2, 3 at once: 1, 2, 3 s per sample): A and B of 10
    samples start at 0, C of 5 samples at 4. At 4, A and B have 8 left; C ends 5 x 3 = 15 s
    later, at 19, when A and B have 3 left; they end 3 x 2 = 6 s later, at 25."""
    env = simpy.Environment()
    host = SharedHost(env, Costs(1.0, shared=(1.0, 2.0, 3.0)))
    ends = {}

    def job(name, start, samples):
        yield env.timeout(start)
        yield host.compute(samples)
        ends[name] = env.now

    for args in (("A", 0, 10), ("B", 0, 10), ("C", 4, 5)):
        env.process(job(*args))
    env.run()
    assert ends == pytest.approx({"A": 25.0, "B": 25.0, "C": 19.0}, rel=1e-12)
    assert Costs(1.0, shared=(1.0, 2.0)).shared_seconds_per_sample(4) == 4.0  # beyond the table: linear


def test_allreduce_schedule_on_a_shared_host(tmp_path):
    """A profile from `ako calibrate --processes 2` (1 ms per sample alone, 1.5 ms each with
    two at once), free links, worker 1 at factor 3: both compute 16 samples at once (24 ms),
    then worker 1 waits 2 x 24 ms, as the distributed runtime's straggler does: 72 ms a step."""
    profile = tmp_path / "shared.toml"
    profile.write_text("model = 'cnn'\nbatch_size = 16\nseconds_per_sample = 1e-3\nshared_seconds_per_sample = [1e-3, 1.5e-3]\n")
    result = simulate(tmp_path, strategy="allreduce", profile=str(profile), straggler=("rank=1,factor=3",))
    assert virtual(result) == pytest.approx(STEPS * 0.072, rel=1e-9)
    workers = result.summary["per_worker"]
    assert workers[0]["compute_seconds"] == pytest.approx(STEPS * 0.024, rel=1e-6)
    assert workers[0]["idle_seconds"] == pytest.approx(STEPS * 0.048, rel=1e-6)
    assert result.summary["simulation"]["shared_host_seconds_per_sample"] == [1e-3, 1.5e-3]


def test_cli_simulate_and_calibrate(tmp_path, capsys):
    """`ako calibrate` writes a profile that `ako simulate --profile` takes; bad input exits 2
    with one line."""
    profile = tmp_path / "cnn.toml"
    calibrate = ["calibrate", "--model", "cnn", "--dataset", "digits", "--batch-size", "16", "--out", str(profile)]
    assert main([*calibrate, "--processes", "2"]) == 0
    assert len(tomllib.loads(profile.read_text())["shared_seconds_per_sample"]) == 2
    assert main([*calibrate, "--processes", "0"]) == 2 and "processes 0" in capsys.readouterr().err
    common = ["--dataset", "digits", "--train-samples", "384", "--batch-size", "16", "--epochs", "0.1",
              "--out-dir", str(tmp_path / "runs"), "--no-progress"]  # fmt: skip
    assert main(["simulate", "--strategy", "bsp", "--workers", "2", "--profile", str(profile), *common]) == 0
    out = capsys.readouterr().out
    assert "virtual s" in out and "server rank 2" in out
    for bad, word in [(["--latency", "5 parsecs"], "latency"), (["--latency", "1e400"], "at most 60 s"),
                      (["--latency", "61s"], "at most 60 s"), (["--profile", str(tmp_path / "none.toml")], "profile"),
                      (["--batch-size", "32", "--profile", str(profile)], "batch_size")]:  # fmt: skip
        assert main(["simulate", *common, *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and word in err
    assert main(["train", "--latency", "1ms", *common]) == 2


def _records(result) -> list[dict]:
    path = Path(result.summary["run_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["gossip-pull", "gossip-push-sum"])
def test_gossip_runs_in_the_simulator_and_its_replicas_agree(tmp_path, strategy):
    """Gossip joins the simulator unchanged: pull requests are answered with the snapshot
    published by then, and the replicas end close to their average."""
    kind = strategy.removeprefix("gossip-")
    result = simulate(tmp_path, strategy="gossip", gossip=kind, workers=4, train_samples=768)
    assert result.summary["consensus_distance"] < 0.05
    records = _records(result)  # consensus over time: every evaluation point has all 4 copies
    assert len(records) == 2 and all(r["replicas"] == 4 for r in records)  # the start and the end
    assert records[0]["consensus_distance"] == 0 < records[1]["consensus_distance"]
    averaged = torch.stack([w.params for w in result.workers]).mean(0)
    assert result.summary["average_accuracy"] is not None and averaged.isfinite().all()


def test_a_diverged_average_still_gives_a_summary():
    """A run whose replicas' average has a NaN loss (it diverged) still writes its summary:
    JSON has no NaN, so the loss is null (a 64-worker ako run once lost its outputs to this)."""
    from ako.metrics import build_summary, finite

    report = {"rank": 0, "role": "worker", "steps": 3, "samples": 30, "bytes_sent": 0, "bytes_received": 0}
    final = {"epoch": 1.0, "test_accuracy": 0.1, "test_loss": 2.3, "average_accuracy": 0.1, "average_loss": float("nan")}
    summary = build_summary("ako", ako.TrainConfig(), "digits", [report], [], final, True, 1.0, 1.0)
    assert summary["average_loss"] is None and summary["average_accuracy"] == 0.1
    json.dumps(finite(summary), allow_nan=False)  # as write_summary writes it



def test_the_summary_gives_the_spread_of_per_worker_figures_at_many_workers():
    """Up to 8 workers the summary lists each one's figures; beyond, their spread (a
    64-worker run printed 64 numbers a line); equal figures read "N each"."""
    from ako.metrics import build_summary, format_summary

    def summary(workers: int, short: list[int]) -> str:
        reports = [{"rank": r, "role": "worker", "steps": 3, "samples": 30 - short[r], "bytes_sent": 0, "bytes_received": 0,
                    "partial_steps": int(short[r] > 0), "samples_short": short[r]} for r in range(workers)]  # fmt: skip
        final = {"epoch": 1.0, "test_accuracy": 0.5, "test_loss": 1.0}
        config = ako.TrainConfig(workers=workers, epochs=1)
        s = build_summary("ako", config, "digits", reports, [], final, True, 1.0, 1.0)
        return format_summary({**s, "partial_steps": sum(r["partial_steps"] for r in reports)})  # as Ako's facts add it

    listed = summary(4, [0, 6, 0, 2])
    assert "samples trained per worker 30 / 24 / 30 / 28\n" in listed
    assert "steps cut short behind the peers 0 / 1 / 0 / 1, samples fewer than whole steps 0 / 6 / 0 / 2 (" in listed
    spread = summary(64, [0] * 60 + [1, 2, 3, 4])
    assert "samples trained per worker 26 (rank 63) to 30, median 30\n" in spread
    assert "steps cut short behind the peers 0 to 1, median 0, samples fewer than whole steps 0 to 4 (rank 63), median 0 (" in spread
    assert "samples trained per worker 30 each\n" in summary(64, [0] * 64)
    s = build_summary("ako", ako.TrainConfig(workers=64), "digits", [
        {"rank": r, "role": "worker", "steps": 3, "samples": 30, "bytes_sent": 0, "bytes_received": 0} for r in range(64) if r != 5
    ], [], {"epoch": 1.0, "test_accuracy": 0.5, "test_loss": 1.0}, True, 1.0, 1.0)  # fmt: skip
    lost = format_summary({**s, "lost_ranks": [5], "lost": [{"rank": 5, "role": "worker", "how": "died", "reason": ""}]})
    assert "samples trained per worker (the 63 live workers) 30 each\n" in lost and "worker rank 5 died; the others carried on" in lost
    simulated = format_summary({**s, "train_seconds": 0.0046, "time_to_accuracy": {"0.5": 0.0046}, "simulation": {}})
    assert " in 0.0046 virtual s of training" in simulated and "samples/virtual s;" in simulated
    assert "time to accuracy 50%: 0.0046 virtual s" in simulated and "sent per worker  0.00 MB/virtual s" in simulated
    tie = {"source": "rank 0's replica before the flush", "metric": "loss", "flushed_loss": 2.48052, "unflushed_loss": 2.48049}
    assert "(loss 2.48049): the flush made the replicas worse (2.48052)" in format_summary({**s, "final_model": tie})
    tie = {**tie, "flushed_loss": 2.5, "unflushed_loss": 2.4}  # apart at 4 decimals: as every figure
    assert "(loss 2.4000): the flush made the replicas worse (2.5000)" in format_summary({**s, "final_model": tie})
    same = {"source": "the replicas after the flush", "metric": "accuracy", "flushed_accuracy": 0.8173, "unflushed_accuracy": 0.8173}
    assert "(accuracy 0.8173; rank 0's before it 0.8173)" in format_summary({**s, "final_model": same})  # equal: 4 decimals

def test_calibrate_makes_the_profile_s_directory_or_says_why_not(tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "profile.toml"
    assert main(["calibrate", "--model", "cnn", "--dataset", "digits", "--out", str(out)]) == 0
    assert tomllib.loads(out.read_text())["seconds_per_sample"] > 0
    assert main(["calibrate", "--model", "cnn", "--dataset", "digits", "--out", "/dev/null/x/p.toml"]) == 2
    assert capsys.readouterr().err.strip().endswith("cannot make its directory (Not a directory)")


# ---- gradients computed together (runtime/simulated/gradients.py) ----------------------------


class _UsersNet(torch.nn.Module):
    """A user's model with a loss of their own (below): two layers and a tanh."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 20), torch.nn.Linear(20, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.flatten(1))))


def _users_loss(model, batch):
    x, y = batch
    return torch.nn.functional.multi_margin_loss(model(x), y)


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet", "user's"])
def test_gradients_computed_together_equal_one_at_a_time(model):
    """Four replicas, each with its own parameters and mini-batch of two micro-batches, filed
    and computed on two threads: every gradient and loss equals, bit for bit, the one computed
    alone on this thread."""
    from ako.runtime.simulated.gradients import Gradients

    config = TrainConfig(dataset="digits", model="cnn")
    make = (lambda: _UsersNet()) if model == "user's" else (lambda: build_model(model, (1, 8, 8), 10))
    replicas = []
    for i in range(4):
        torch.manual_seed(i)
        replica = make_replica(make(), config)
        replica.loss_fn = _users_loss if model == "user's" else replica.loss_fn
        replicas.append(replica)
    generator = torch.Generator().manual_seed(0)
    batches = [[(torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator))
                for _ in range(2)] for _ in replicas]  # fmt: skip
    alone = []
    for replica, batch in zip(replicas, batches):
        loss = replica.compute_gradient(batch)
        alone.append((loss, replica.grad.clone()))
        replica.grad.fill_(float("nan"))
    together = Gradients(threads=2)
    filed = [together.file(replica, batch) for replica, batch in zip(replicas, batches)]
    losses = [together.take(entry) for entry in reversed(filed)][::-1]  # the last one's take computes all
    together.close()
    for (loss, grad), replica, got in zip(alone, replicas, losses):
        assert got == loss and torch.equal(replica.grad, grad)
    assert together.seconds > 0



@pytest.mark.parametrize("model", ["cnn", "mlp", "resnet", "user's"])
def test_an_evaluation_on_the_gradients_threads_equals_one_on_this_thread(model):
    """The simulator's rank 0 evaluates its test batches on the gradients' two threads, one
    torch thread each: the metrics equal, bit for bit, those of the batches one after another
    on one torch thread (torch's two threads on a batch of 256 gave another loss in the last
    bits, so a simulated run's figures depended on the thread count)."""
    from ako.runtime.simulated.gradients import Gradients

    torch.manual_seed(0)
    replica = make_replica(_UsersNet() if model == "user's" else build_model(model, (1, 8, 8), 10), TrainConfig(dataset="digits"))
    generator = torch.Generator().manual_seed(1)
    test = torch.utils.data.TensorDataset(torch.randn(600, 1, 8, 8, generator=generator), torch.randint(0, 10, (600,), generator=generator))
    alone = replica.evaluate(test, batch_size=64)
    pool = Gradients(threads=2)
    replica.map_batches = pool.map
    torch.set_num_threads(2)  # this thread's torch threads: the pool's threads keep one each
    try:
        together = replica.evaluate(test, batch_size=64)
    finally:
        torch.set_num_threads(1)
        pool.close()
    assert together == alone and set(alone) == {"loss", "accuracy"}
    assert replica.evaluate(test, batch_size=64) == alone  # after the threads are stopped, on this one

class _NormedNet(torch.nn.Module):
    """A user's model with buffers (BatchNorm's running statistics, and one outside the state
    dict), which evaluations use."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(64, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 10)
        self.register_buffer("temperature", torch.ones(1), persistent=False)  # not in the state dict

    def forward(self, x):
        return self.b(self.norm(self.a(x.flatten(1)))) / self.temperature


def test_parameters_evaluated_before_are_not_evaluated_again():
    """`evaluate_params` evaluates the same parameters (and buffers) on the same data set once:
    a copy gets the first metrics, equal; one bit of a parameter or a buffer (persistent or not) changed, or another
    data set with the same samples, is evaluated afresh. The replica's own parameters stay."""
    torch.manual_seed(0)
    calls = []

    def counting(model, batch):
        calls.append(1)
        return ako.replica.classification_metrics(model, batch)

    replica = make_replica(_NormedNet(), TrainConfig(dataset="digits"))
    replica.eval_fn = counting
    generator = torch.Generator().manual_seed(1)
    samples = (torch.randn(100, 1, 8, 8, generator=generator), torch.randint(0, 10, (100,), generator=generator))
    test = torch.utils.data.TensorDataset(*samples)
    own = replica.params.clone()
    params = own + 0.01 * torch.randn(own.shape, generator=generator)
    first = replica.evaluate_params(params, test, batch_size=64)
    assert len(calls) == 2 and torch.equal(replica.params, own)
    assert replica.evaluate_params(params.clone(), test, batch_size=64) == first and len(calls) == 2
    changed = params.clone()
    changed[7] = torch.nextafter(changed[7], torch.tensor(1.0))
    replica.evaluate_params(changed, test, batch_size=64)
    assert len(calls) == 4
    replica.model.norm.running_mean[0] += 1.0
    assert replica.evaluate_params(params, test, batch_size=64) != first and len(calls) == 6
    replica.model.temperature.fill_(2.0)  # a buffer outside the state dict (found by a breaker's trial)
    replica.evaluate_params(params, test, batch_size=64)
    assert len(calls) == 8
    replica.evaluate_params(params, torch.utils.data.TensorDataset(*samples), batch_size=64)
    assert len(calls) == 10


@pytest.mark.parametrize("strategy", ["ako", "gossip"])
def test_a_simulated_run_evaluates_no_parameters_twice(tmp_path, strategy, monkeypatch):
    """Identical replicas (all of them at the start) are evaluated once: their average's record
    fields are rank 0's, and no parameters are evaluated twice in a run."""
    evaluated = []
    evaluate = ako.replica.Replica.evaluate

    def recording(self, dataset, batch_size=256):
        evaluated.append(self.params.clone())
        return evaluate(self, dataset, batch_size)

    monkeypatch.setattr(ako.replica.Replica, "evaluate", recording)
    result = simulate(tmp_path, strategy=strategy, workers=3, eval_every=0.25, **COSTS)
    records = [json.loads(line) for line in Path(result.summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "average_accuracy" in r)
    assert first["consensus_distance"] == 0 and first["average_loss"] == first["test_loss"]
    assert len(records) >= 3 and all(not torch.equal(a, b) for i, a in enumerate(evaluated) for b in evaluated[:i])


@pytest.mark.parametrize("strategy", ["ako", "allreduce", "easgd", "gossip"])
def test_after_training_a_bar_counts_the_evaluations_left(tmp_path, strategy, monkeypatch, capsys):
    """With a progress bar, rank 0 shows one over the evaluations after training, whose total
    is exact: the snapshots and their averages, the final replicas' average, Ako's model before
    the flush, EASGD's centre."""
    from ako.run.worker import WorkerState

    seen = []
    close = WorkerState.close_bar

    def closing(self):
        if self.bar is not None and self.bar.desc == "evaluating":
            seen.append((self.bar.n, self.bar.total))
        close(self)

    monkeypatch.setattr(WorkerState, "close_bar", closing)
    servers = {"servers": 1} if STRATEGIES[strategy].server is not None else {}
    simulate(tmp_path, strategy=strategy, eval_every=0.25, progress=True, **COSTS, **servers)
    total = {"ako": 3 + 2 + 1 + 1, "allreduce": 3, "easgd": 3 + 2 + 1 + 1, "gossip": 3 + 2 + 1}[strategy]
    assert seen == [(total, total)] and "evaluating" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["absp", "ako", "allreduce", "asp", "bsp", "easgd", "gossip", "ssp"])
def test_one_or_two_threads_give_the_same_run(tmp_path, strategy):
    """A whole short simulated run (a straggler, a costed network) with torch's one thread and
    with two (gradients two at a time): the same replicas bit for bit, the same summary."""
    servers = {"servers": 1} if STRATEGIES[strategy].server is not None else {}
    config = dict(strategy=strategy, workers=3, straggler=("rank=1,factor=2",), **COSTS, **servers)
    one = simulate(tmp_path, **config)
    torch.set_num_threads(2)
    try:
        two = simulate(tmp_path, **config)
        assert torch.get_num_threads() == 2  # the simulation ran its own tensor work on one, and gives them back
    finally:
        torch.set_num_threads(1)
    for a, b in zip(one.workers, two.workers):
        assert torch.equal(a.params, b.params)
    drop = ("run_dir", "wall_seconds", "simulation")
    assert {k: v for k, v in one.summary.items() if k not in drop} == {k: v for k, v in two.summary.items() if k not in drop}
    assert virtual(one) == virtual(two)


@pytest.mark.parametrize("strategy", ["absp", "ako", "allreduce", "easgd", "gossip"])
def test_the_saved_model_scores_what_the_summary_says(tmp_path, strategy):
    """model.pt's test metrics in the summary (known from the run's own evaluations, not
    evaluated again) are those of the saved parameters, evaluated afresh."""
    from ako.data import load_dataset

    servers = {"servers": 1} if STRATEGIES[strategy].server is not None else {}
    result = simulate(tmp_path, strategy=strategy, workers=3, **COSTS, **servers)
    saved = result.summary["saved_model"]
    model = ako.load_model(result.summary["run_dir"])
    test_set = load_dataset("digits", train_samples=384, test_samples=60).test
    metrics = make_replica(model, small_config(tmp_path)).evaluate(test_set)
    assert {f"test_{k}": round(v, 5) for k, v in metrics.items()} == {k: v for k, v in saved.items() if k.startswith("test_")}
    assert saved["source"] == {"ako": "the replicas after the flush", "easgd": "the centre variable",
                               "gossip": "the replicas' average"}.get(strategy, "rank 0's replica")  # fmt: skip


def test_the_progress_bar_counts_every_worker_s_steps_in_virtual_time(tmp_path, capsys):
    """asp with a straggler 3x slower: the bar's count is both workers' steps (6 each), not
    rank 0's, and it shows the virtual seconds and their rate in virtual seconds per real one."""
    result = simulate(tmp_path, strategy="asp", servers=1, straggler=("rank=1,factor=3",), progress=True, **COSTS)
    bar = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "step" in line][-1]
    assert "12/12" in bar and f"virtual={result.summary['simulation']['virtual_seconds']:.3g} s" in bar and "virtual/real=" in bar


@pytest.mark.parametrize("strategy", ["ako", "allreduce"])
def test_a_failed_simulation_keeps_its_metrics_so_far(tmp_path, strategy):
    """The user's loss fails at its 40th call (4 workers, 6 steps an epoch, an evaluation
    point every 2 steps; without a target rank 0 evaluates them after training): the error
    reaches the caller, and metrics.jsonl holds the evaluation points before it, as a failed
    distributed run keeps them (Ctrl-C takes the same way)."""
    import torch.nn.functional as F

    calls = 0

    def loss(model, batch):
        nonlocal calls
        calls += 1
        if calls == 40:
            raise ValueError("the loss broke")
        x, y = batch
        return F.cross_entropy(model(x), y)

    config = small_config(tmp_path, strategy=strategy, workers=4, epochs=20, eval_every=1 / 3)
    with pytest.raises(ValueError, match="the loss broke"):
        ako.simulate(config, loss_fn=loss)
    (run_dir,) = (tmp_path / "runs").glob("*")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [round(k / 3, 4) for k in range(len(records))] and len(records) >= 3
    assert not (run_dir / "summary.json").exists()


BAD_PROFILES = [
    ("seconds_per_sample = inf", "needs seconds_per_sample, a number >= 0 and <= 1000, not inf"),
    ("seconds_per_sample = nan", "needs seconds_per_sample, a number >= 0 and <= 1000, not nan"),
    ("seconds_per_sample = 1e300", "needs seconds_per_sample, a number >= 0 and <= 1000, not 1e+300"),
    ("seconds_per_sample = 1e-3\nshared_seconds_per_sample = [inf, inf]", "shared_seconds_per_sample must be a list of numbers > 0"),
    ("seconds_per_sample = 1e-3\nshared_seconds_per_sample = [0.0, 0.0]", "shared_seconds_per_sample must be a list of numbers > 0"),
    ("seconds_per_sample = 1e-3\ngradient_ready = [nan, 1.0]", "gradient_ready must be a list of fractions from 0 to 1"),
    ("seconds_per_sample = 1e-3\nshared_seconds_per_sampel = [1e-3, 2e-3]", "unknown key 'shared_seconds_per_sampel'; allowed: model,"),
    ("seconds_per_sample = 1e-3\nthreads = 'x'", "threads must be an integer >= 1, not 'x'"),
    ("seconds_per_sample = 1e-3\ngpu = 5", "gpu must be a device name (a string), not 5"),
]


@pytest.mark.parametrize("text,message", BAD_PROFILES, ids=[t for t, _ in BAD_PROFILES])
def test_a_profile_out_of_range_is_one_line_and_runs_nothing(tmp_path, capsys, text, message):
    """A profile's figures are checked as the flags are: an infinite compute time ran forever
    on a shared host, or ended in a traceback; zero shared seconds divided by zero."""
    from ako.cli import main

    profile = tmp_path / "p.toml"
    profile.write_text(f"model = 'cnn'\nbatch_size = 16\n{text}\n")
    out = tmp_path / "runs"
    code = main(["simulate", "--dataset", "digits", "--workers", "3", "--batch-size", "16", "--profile", str(profile),
                 "--out-dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()  # the --out-dir is made only after every check


def test_the_summary_names_the_injected_stragglers(tmp_path):
    """The stragglers given are in the summary and its printed lines, for a simulated run as
    for a real one (`final_summary` writes both), and absent without any."""
    from ako.metrics import format_summary

    slowed = simulate(tmp_path, strategy="allreduce", straggler=("rank=1,factor=3", "prob=0.5,factor=2"), **COSTS)
    assert slowed.summary["stragglers"] == ["rank=1,factor=3", "prob=0.5,factor=2"]
    assert "  stragglers       rank=1,factor=3; prob=0.5,factor=2 (injected: " in format_summary(slowed.summary)
    plain = simulate(tmp_path, strategy="allreduce", **COSTS)
    assert plain.summary["stragglers"] == [] and "stragglers" not in format_summary(plain.summary)


def test_sigterm_stops_a_simulation_as_ctrl_c_does(tmp_path):
    """SIGTERM to `ako simulate` mid-run: exit status 130, one line, and the evaluation points
    reached are in metrics.jsonl (it was killed by the signal, with config.toml alone)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "simulate", "--dataset", "digits", "--workers", "3", "--epochs", "200",
           "--eval-every", "0.5", "--out-dir", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(out.glob("*/config.toml")):
            time.sleep(0.05)
        time.sleep(3.0)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    (run_dir,) = out.glob("*")
    assert proc.returncode == 130 and err == f"ako: interrupted; what the run logged is in {run_dir}\n", (proc.returncode, err)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) >= 2 and not (run_dir / "summary.json").exists()


@pytest.mark.parametrize("factor, cut", [(1.5, False), (3.0, True)])
def test_absp_cuts_only_a_worker_late_by_more_than_a_quarter_of_its_step(tmp_path, factor, cut):
    """Timing noise is no straggler: worker 1 at factor 1.5 is a third of a step behind when
    worker 0 hands in, with a quarter of its assignment (one micro-batch of four) left: it
    finishes it, and absp is bsp (to float rounding: absp sums micro-batches' gradients). At
    factor 3 two of four are left: it is cut."""
    common = dict(straggler=(f"rank=1,factor={factor}",), momentum=0.0, weight_decay=0.0, micro_batch=4, **COSTS)
    absp = simulate(tmp_path / "absp", strategy="absp", **common)
    slow = absp.summary["per_worker"][1]
    assert (slow["handed_in"] < 1) == cut, slow
    if not cut:
        bsp = simulate(tmp_path / "bsp", strategy="bsp", **common)
        for a, b in zip(absp.workers, bsp.workers, strict=True):
            torch.testing.assert_close(a.params, b.params, rtol=0, atol=1e-5)
