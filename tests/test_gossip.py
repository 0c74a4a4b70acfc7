"""Gossiping SGD (pull and push-sum), peer selection, consensus distance, and a dead peer."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from helpers import GOSSIP_LR0, LATE_PUBLISHER, STAR_PULL, run_and_kill, small_config

import ako
from ako.cli import build_parser, config_from_args, main
from ako.run.consensus import consensus_distance
from ako.strategies.gossip import WEIGHT_UNIT, PeerSelector, PushSumState, rotating_partner
from ako.strategies.ops import Message

GRAD_BYTES = 22_602 * 4  # the cnn on 8x8 digits


# ---- peer selection ---------------------------------------------------------------------


def spread_rounds(n: int, limit: int = 200) -> int:
    """Rounds of the rotating schedule until every worker's information has reached every
    other (each pair exchanging what it knows)."""
    know = [{i} for i in range(n)]
    for r in range(limit):
        if all(len(k) == n for k in know):
            return r
        partners = [rotating_partner(i, r, n) for i in range(n)]
        know = [know[i] | (know[p] if p is not None else set()) for i, p in enumerate(partners)]
    raise AssertionError(f"n = {n}: information did not spread in {limit} rounds")


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_rotating_pairs_every_worker_exactly_once_per_round_for_powers_of_two(n):
    m = int(math.log2(n))
    for r in range(3 * m):
        partners = [rotating_partner(i, r, n) for i in range(n)]
        assert None not in partners
        assert all(partners[p] == i for i, p in enumerate(partners))  # symmetric pairs
        assert all(p != i for i, p in enumerate(partners))
    assert spread_rounds(n) == m


@pytest.mark.parametrize("n", [n for n in range(3, 65) if n & (n - 1)])
def test_rotating_for_other_n_sits_out_missing_partners_and_spreads_within_2m_minus_1(n):
    m = math.ceil(math.log2(n))
    for r in range(2 * m):
        partners = [rotating_partner(i, r, n) for i in range(n)]
        for i, p in enumerate(partners):
            if i ^ (1 << (r % m)) >= n:
                assert p is None  # its partner would be a worker that does not exist
            else:
                assert partners[p] == i
    assert m < spread_rounds(n) <= 2 * m - 1
    assert spread_rounds(5) == 5  # the bound is reached


def test_rotating_single_worker_has_no_partner():
    assert rotating_partner(0, 0, 1) is None


def test_random_peers_are_seeded_uniform_and_skip_the_dead():
    def draws(seed, rank=1, count=3000):
        selector = PeerSelector(rank, 4, "random", seed)
        return [selector.next(r, frozenset()) for r in range(count)]

    picks = draws(seed=3)
    assert picks == draws(seed=3)  # seeded: the same run seed, the same sequence
    assert picks != draws(seed=4) and picks[:50] != draws(seed=3, rank=2)[:50]
    counts = {p: picks.count(p) for p in set(picks)}
    assert set(counts) == {0, 2, 3}  # never itself
    assert all(900 < c < 1100 for c in counts.values()), counts  # 1000 +- 3.9 sigma
    selector = PeerSelector(1, 4, "random", seed=3)
    assert {selector.next(r, frozenset({0, 3})) for r in range(50)} == {2}
    assert selector.next(0, frozenset({0, 2, 3})) is None


def test_rotating_selector_sits_out_a_dead_partner():
    selector = PeerSelector(0, 4, "rotating", seed=0)
    assert [selector.next(r, frozenset()) for r in range(4)] == [1, 2, 1, 2]
    assert [selector.next(r, frozenset({2})) for r in range(4)] == [1, None, 1, None]


# ---- push-sum merge and consensus distance -------------------------------------------------


def test_push_sum_merge_conserves_the_weighted_sum_and_the_weights_exactly():
    torch.manual_seed(0)
    a, b = PushSumState(torch.randn(1000)), PushSumState(torch.randn(1000))
    before = a.params.double() + b.params.double()
    for k in range(40):  # ping-pong: half of the sender's weight travels each time
        src, dst = (a, b) if k % 2 else (b, a)
        half = src.weight // 2
        message = Message(0, 0, k, half, src.params.clone())
        src.weight -= half
        dst.merge(message)
    assert a.weight + b.weight == 2 * WEIGHT_UNIT
    weighted = (a.weight * a.params.double() + b.weight * b.params.double()) / WEIGHT_UNIT
    # exact but for float32 rounding (about an ulp a merge)
    torch.testing.assert_close(weighted, before, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.params, b.params, rtol=1e-6, atol=1e-7)  # and they agree


def test_consensus_distance_values():
    replicas = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    distance, average = consensus_distance(replicas)
    assert distance == pytest.approx(0.5)  # both at distance 1 from (2, 0), whose norm is 2
    torch.testing.assert_close(average, torch.tensor([2.0, 0.0]))
    distance, average = consensus_distance(replicas, weights=[3.0, 1.0])
    torch.testing.assert_close(average, torch.tensor([1.5, 0.0]))
    assert distance == pytest.approx((0.5 + 1.5) / 2 / 1.5)
    same = torch.randn(5).expand(3, 5)
    distance, average = consensus_distance(same)
    assert distance == 0.0 and torch.equal(average, same[0])  # exactly: no float32 rounding
    assert math.isnan(consensus_distance(torch.zeros(2, 3))[0])
    with pytest.raises(ValueError):
        consensus_distance(replicas, weights=[0.0, 0.0])


# ---- on the distributed runtime ------------------------------------------------------------


def test_push_sum_preserves_the_average_exactly_with_learning_rate_0(tmp_path):
    """lr 0, replicas made different: once every push is merged (the end-of-run handshake),
    the weights sum to n and sum_i a_i z_i / n is the initial average, to 1e-6."""
    n = 4
    config = small_config(tmp_path, strategy="gossip", gossip="push-sum", workers=n, epochs=10.0)  # 60 rounds
    result = ako.train(config, strategy=GOSSIP_LR0)
    weights = [w.facts["average_weight"] for w in result.workers]
    assert sum(weights) == pytest.approx(n, abs=1e-12)
    assert len(set(weights)) > 1  # weights did move between workers
    initial = torch.stack([w.facts["initial"] for w in result.workers]).double()
    final = torch.stack([w.params for w in result.workers]).double()
    preserved = (torch.tensor(weights, dtype=torch.float64) @ final) / n
    torch.testing.assert_close(preserved, initial.mean(0), rtol=0, atol=1e-6)
    # and the pushes mixed them: from about 0.05 x sqrt(numel) apart to 100 times closer at
    # least (not to 0: a worker that finishes first is pushed to no more, and keeps its replica)
    spread = (initial - initial.mean(0)).norm(dim=1).mean()
    assert spread > 5
    assert (final - preserved).norm(dim=1).mean() < spread / 100
    assert all(w["rounds"] == 60 for w in result.summary["per_worker"])
    assert result.summary["consensus_distance"] < consensus_distance(initial.float())[0] / 100


def test_push_sum_keeps_a_straggler_weighted(tmp_path):
    """Rank 3 computes 4 times slower, so the others finish long before it. Pushes go only to
    peers still training: a finished worker would keep every weight sent to it, and rank 3,
    halving its weight each round for the rest of its run, would end with almost none."""
    config = small_config(
        tmp_path, strategy="gossip", gossip="push-sum", workers=4, epochs=5.0, straggler=("rank=3,factor=4",)
    )
    result = ako.train(config)
    weights = [w["average_weight"] for w in result.summary["per_worker"]]
    assert sum(weights) == pytest.approx(4, abs=1e-12)
    assert weights[3] > 0.05, weights
    assert [w["steps"] for w in result.summary["per_worker"]] == [30] * 4


def test_pull_with_learning_rate_0_drives_consensus_distance_to_0_geometrically(tmp_path):
    """Every step is an evaluation point: distance at point k <= 2 x D_0 x 0.85^k, down to the
    float noise floor. (Random pairwise averaging of 4 replicas contracts by about 0.5 a round;
    simulated, D_k <= D_0 x 0.8^k held in 3000 runs out of 3000.)"""
    config = small_config(tmp_path, strategy="gossip", gossip="pull", workers=4, epochs=10.0, eval_every=1 / 6)
    result = ako.train(config, strategy=GOSSIP_LR0)
    run_dir = tmp_path / "runs" / result.summary["run_dir"].split("/")[-1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 61  # 60 points, one per step, and the end
    assert all(r["replicas"] == 4 for r in records)
    distances = [r["consensus_distance"] for r in records]
    d0 = distances[0]
    assert d0 > 0.1
    for k, d in enumerate(distances[:-1]):
        if d0 * 0.85**k > 1e-5:
            assert d <= 2 * d0 * 0.85**k, (k, distances)
    assert distances[-1] < 1e-5
    assert result.summary["consensus_distance"] == distances[-1]


@pytest.mark.parametrize("peers,strategy", [("rotating", None), ("star", STAR_PULL)], ids=["mutual", "many-to-one"])
def test_pull_gossip_never_deadlocks(tmp_path, peers, strategy):
    """tau = 1 on 4 workers, 120 rounds each, a 10 s timeout on every wait. Rotating on 4
    workers pairs i with i XOR 2^(r mod 2): the two of each pair pull from each other at
    once, every round. Star: all three others pull from rank 0 every round. Every pull gets
    exactly one snapshot, and each worker serves exactly the pulls aimed at it."""
    config = small_config(
        tmp_path, strategy="gossip", workers=4, epochs=20.0, timeout=10.0,
        peers="rotating" if peers == "rotating" else "random",
    )  # fmt: skip
    result = ako.train(config, strategy=strategy)
    per_worker = result.summary["per_worker"]
    assert [w["steps"] for w in per_worker] == [120] * 4
    assert [w["rounds"] for w in per_worker] == [120] * 4
    assert all(w["failed_rounds"] == 0 for w in per_worker)
    assert [w["bytes_received"] for w in per_worker] == [120 * GRAD_BYTES] * 4
    served = [1, 1, 1, 1] if peers == "rotating" else [3, 1, 0, 0]
    assert [w["bytes_sent"] for w in per_worker] == [120 * GRAD_BYTES * k for k in served]


def test_pull_before_the_first_publish_is_answered_at_that_publish(tmp_path):
    result = ako.train(small_config(tmp_path, strategy="gossip"), strategy=LATE_PUBLISHER)
    rank0, rank1 = result.workers
    assert rank1.facts["pulled_step"] == 7
    torch.testing.assert_close(rank1.facts["pulled"], rank0.facts["published"], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["pull", "push-sum"])
def test_killed_worker_is_dropped_and_the_others_finish(tmp_path, mode):
    """Kill rank 2 of 3 mid-run: exit status 0, the summary names rank 2 as lost, both others
    train to the end (700 steps), and a dead peer costs a survivor at most a couple of gossip
    rounds (it is dropped from selection within seconds), not the 60 s timeout."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "gossip", "--gossip", mode, "--workers", "3",
           "--dataset", "digits", "--epochs", "100", "--eval-every", "10", "--target-accuracy", "1.0",
           "--out-dir", str(out_dir), "--timeout", "60", "--no-progress"]  # fmt: skip
    code, out, err, elapsed = run_and_kill(cmd, "ako-rank2", out_dir)
    assert code == 0, err
    assert elapsed < 45, f"took {elapsed:.1f} s after the kill"
    assert "worker rank 2 died (" in out and "the others carried on" in out, out
    summary = json.loads(next(out_dir.glob("*/summary.json")).read_text())
    assert summary["lost_ranks"] == [2]
    assert summary["time_to_accuracy"]["1"] is None  # so nobody stopped early
    per_worker = summary["per_worker"]
    assert [w["rank"] for w in per_worker] == [0, 1]
    assert [w["steps"] for w in per_worker] == [700, 700]  # 100 epochs x 7 steps
    if mode == "pull":
        assert all(w["failed_rounds"] <= 2 for w in per_worker), per_worker
    records = [json.loads(line) for line in next(out_dir.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert records[-1]["replicas"] == 2  # the dead worker's replica is left out
    assert summary["average_accuracy"] is not None


# ---- configuration -------------------------------------------------------------------------


BAD_GOSSIP_INPUT = [
    (["--strategy", "gossip", "--gossip", "push"], "unknown gossip 'push': choose one of pull, push-sum"),
    (["--strategy", "gossip", "--peers", "ring"], "unknown peers 'ring': choose one of random, rotating"),
    (["--strategy", "gossip", "--tau", "0"], "tau '0': must be an integer >= 1"),
    (["--strategy", "gossip", "--tau", "1.5"], "tau '1.5': must be an integer >= 1"),
    (["--strategy", "ako", "--gossip", "push-sum"], "gossip 'push-sum': strategy ako has no such option (it is for gossip)"),
    (["--strategy", "allreduce", "--peers", "rotating"], "peers 'rotating': strategy allreduce has no such option"),
    (["--strategy", "ako", "--tau", "2"], "tau 2: strategy ako has no such option"),
]


@pytest.mark.parametrize("args,message", BAD_GOSSIP_INPUT, ids=[" ".join(a) for a, _ in BAD_GOSSIP_INPUT])
def test_bad_gossip_flag_is_one_line_exit_2(args, message, tmp_path, capsys):
    out_dir = tmp_path / "runs"
    code = main(["train", "--dataset", "digits", "--out-dir", str(out_dir), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ako: error: "), err
    assert message in err
    assert not out_dir.exists()


def test_gossip_flags_and_defaults():
    parse = build_parser().parse_args
    config = config_from_args(parse(["train", "--strategy", "gossip", "--gossip", "push-sum", "--peers", "rotating", "--tau", "3"]))
    assert (config.gossip, config.peers, config.tau) == ("push-sum", "rotating", 3)
    config = config_from_args(parse(["train", "--strategy", "gossip"]))
    assert (config.gossip, config.peers, config.tau) == ("pull", "random", 1)
