"""DiLoCo and Streaming DiLoCo (strategies/diloco.py) and the compressed mean (mean.py,
compress.py): the outer loop at lr 1, momentum 0 is the average of local training, one worker
is plain local training, streaming at P = 1, tau = 0, alpha = 0 is diloco, every fragment is
synced once every H steps, the fragments cover the parameters once, the codes keep their
stated error, error feedback loses nothing, the bytes on the wire are the code's, and a lost
worker ends the run naming it. Both runtimes where it applies."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from helpers import make_replica, run_and_kill, single_process_sgd, small_config

import ako
from ako.data import ShardSampler, fetch, load_dataset
from ako.metrics import format_summary
from ako.models import build_model, model_options
from ako.cli import main
from ako.config import ConfigError
from ako.run.job import Job
from ako.strategies import STRATEGIES, Strategy
from ako.strategies import diloco
from ako.strategies.compress import BLOCK, CODECS, Residual
from ako.strategies.mean import Mean, chunks

ADAMW = dict(optimizer="adamw", lr=1e-3, momentum=None, weight_decay=None)
SIMULATED = dict(seconds_per_sample=1e-3, latency="50us", bandwidth="10MB")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def both_runtimes(config, **kwargs):
    """The run on real processes, then simulated."""
    return ako.train(config, **kwargs), ako.simulate(replace(config, **SIMULATED), **kwargs)


def averaged_local_training(config, steps: int, every: int) -> torch.Tensor:
    """Flat parameters after `steps` steps of n replicas, each with its own optimizer on its
    own shard, replaced by their mean every `every` steps (the n workers' mean at the end)."""
    split = load_dataset(config.dataset, config.data_dir, config.train_samples, config.test_samples, config.context)
    n = config.workers
    replicas, samplers = [], []
    for r in range(n):
        torch.manual_seed(config.seed)
        model = build_model(config.model, split.input_shape, split.num_classes, **model_options(config.model, config))
        replicas.append(make_replica(model, config))
        samplers.append(ShardSampler(len(split.train), r, n, config.batch_size, config.seed))
    for t in range(1, steps + 1):
        for replica, sampler in zip(replicas, samplers):
            replica.compute_gradient([fetch(split.train, sampler.batch(t - 1))])
            replica.step(replica.grad.clone())
        if t % every == 0:
            mean = sum(r.params for r in replicas) / n
            for replica in replicas:
                replica.params.copy_(mean)
    return sum(r.params for r in replicas) / n


@pytest.mark.parametrize("workers,every", [(2, 1), (3, 3)])
def test_outer_lr_1_momentum_0_averages_the_replicas(tmp_path, workers, every):
    """theta_global - 1 x mean(theta_global - theta_i) = mean(theta_i): with H = 1 that is the
    all-reduce of the parameter deltas of each AdamW step; with H = 3, local training averaged
    every 3 steps. Every replica ends equal to the reference (12 steps, a multiple of H)."""
    config = small_config(tmp_path, strategy="diloco", workers=workers, train_samples=workers * 16 * 12, epochs=1.0,
                          sync_every=every, outer_lr=1.0, outer_momentum=0.0, **ADAMW)  # fmt: skip
    reference = averaged_local_training(config, 12, every)
    for result in both_runtimes(config):
        assert result.summary["iterations"] == 12
        for w in result.workers:
            torch.testing.assert_close(w.params, reference, rtol=0, atol=1e-5)
            assert w.facts["outer_steps"] == 12 // every


def test_one_worker_is_plain_local_training(tmp_path):
    config = small_config(tmp_path, strategy="diloco", workers=1, epochs=0.5, sync_every=2, outer_lr=1.0,
                          outer_momentum=0.0, **ADAMW)  # fmt: skip
    reference = single_process_sgd(config, 12)  # 384 / 16 x 0.5 = 12 steps
    for result in both_runtimes(config):
        assert result.summary["iterations"] == 12
        torch.testing.assert_close(result.workers[0].params, reference, rtol=0, atol=1e-5)
    for name in ("bf16", "int8"):  # a compressed mean of one worker: its own vector through the code, no peers to hear
        coded = ako.simulate(replace(config, compress=name))
        assert coded.summary["iterations"] == 12
        torch.testing.assert_close(coded.workers[0].params, reference, rtol=0, atol=2e-2)


def test_streaming_with_one_fragment_no_delay_no_mixing_is_diloco(tmp_path):
    """With the papers' outer optimizer (lr 0.7, Nesterov 0.9) and H = 3."""
    config = small_config(tmp_path, strategy="diloco", epochs=1.0, sync_every=3, **ADAMW)
    streaming = replace(config, strategy="streaming-diloco", fragments=1, fragment_delay=0, fragment_alpha=0.0)
    for plain, stream in zip(both_runtimes(config), both_runtimes(streaming), strict=True):
        assert plain.summary["iterations"] == stream.summary["iterations"] == 12
        for a, b in zip(plain.workers, stream.workers, strict=True):
            torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-6)
        assert plain.workers[0].facts["sync_log"].tolist() == [[3, 0], [6, 0], [9, 0], [12, 0]]


def test_the_outer_step_is_torch_nesterov_sgd_fragment_by_fragment():
    torch.manual_seed(0)
    start = torch.randn(50)
    fragments = [[(0, 7), (30, 50)], [(7, 30)]]
    outer = diloco.OuterSGD(start, lr=0.7, momentum=0.9)
    reference = [torch.nn.Parameter(diloco.gather(start, f)) for f in fragments]
    optimizers = [torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True) for p in reference]
    for _ in range(4):
        for k, fragment in enumerate(fragments):
            grad = torch.randn(len(reference[k]))
            outer.step(fragment, grad)
            reference[k].grad = grad
            optimizers[k].step()
    for fragment, p in zip(fragments, reference):
        torch.testing.assert_close(diloco.gather(outer.params, fragment), p.detach(), rtol=0, atol=1e-6)


def test_every_fragment_is_synced_once_every_h_steps(tmp_path):
    """H = 6, P = 3, tau = 1, 24 steps: fragment k at steps 2(k + 1) + 6m, on every worker."""
    config = small_config(tmp_path, strategy="streaming-diloco", train_samples=2 * 16 * 24, epochs=1.0, sync_every=6,
                          fragments=3, fragment_delay=1, fragment_alpha=0.5, **ADAMW)  # fmt: skip
    for result in both_runtimes(config):
        for w in result.workers:
            log = w.facts["sync_log"].tolist()
            for k in range(3):
                assert [s for s, f in log if f == k] == list(range(2 * (k + 1), 25, 6)), log


def test_the_summary_counts_the_outer_steps_and_says_when_there_were_none(tmp_path):
    """24 steps: streaming at H = 6, P = 3 takes 12 fragment syncs; diloco at its default
    H = 100 takes none, and the summary says the replicas trained apart."""
    config = small_config(tmp_path, strategy="streaming-diloco", train_samples=2 * 16 * 24, epochs=1.0, sync_every=6,
                          fragments=3, fragment_delay=1, fragment_alpha=0.5, **ADAMW)  # fmt: skip
    text = format_summary(ako.simulate(replace(config, **SIMULATED)).summary)
    assert "  outer steps      12 (every H = 6 steps, one of 3 fragments every 2)\n" in text
    never = format_summary(ako.train(replace(config, strategy="diloco", sync_every=100, fragments=None,
                                             fragment_delay=None, fragment_alpha=None)).summary)  # fmt: skip
    assert ("  outer steps      0 (every H = 100 steps): H is longer than this run's 24 steps, so the replicas "
            "trained apart (a smaller --sync-every syncs them)\n") in never


def test_a_synced_fragment_is_the_same_on_every_worker_and_the_others_are_not(tmp_path):
    """alpha = 0, tau = 0, H = 4, P = 2 (equal slices, the cut inside a tensor), 12 steps:
    fragment 1 was synced at the last step, fragment 0 two steps before."""
    config = small_config(tmp_path, strategy="streaming-diloco", epochs=1.0, sync_every=4, fragments=2,
                          fragment_delay=0, fragment_alpha=0.0, **ADAMW)  # fmt: skip
    for result in both_runtimes(config):
        a, b = (w.params for w in result.workers)
        (lo0, hi0), (lo1, hi1) = diloco.slices(a.numel(), 2)
        assert torch.equal(a[lo1:hi1], b[lo1:hi1])
        assert (a[lo0:hi0] - b[lo0:hi0]).abs().max() > 1e-4


def _coverage(fragments, numel):
    seen = torch.zeros(numel, dtype=torch.int64)
    for fragment in fragments:
        for lo, hi in fragment:
            seen[lo:hi] += 1
    return seen


def test_fragments_cover_the_parameters_exactly_once(tmp_path):
    """Equal slices (a boundary inside a tensor, sizes within one) and whole modules, strided."""
    job = Job(small_config(tmp_path))
    replica = job.build_replica(job.load_data(), torch.device("cpu"))
    cut = diloco.slices(replica.numel, 3)
    assert torch.equal(_coverage([[s] for s in cut], replica.numel), torch.ones(replica.numel, dtype=torch.int64))
    assert any(lo not in replica.boundaries for lo, _ in cut)
    assert max(hi - lo for lo, hi in cut) - min(hi - lo for lo, hi in cut) <= 1
    gpt = build_model("gpt", (32,), 50, layers=4, heads=2, width=16)
    numel = sum(p.numel() for p in gpt.parameters())
    fragments = diloco.module_fragments(gpt, 2)
    assert torch.equal(_coverage(fragments, numel), torch.ones(numel, dtype=torch.int64))
    offsets, names = {}, {}
    at = 0
    for name, p in gpt.named_parameters():
        offsets[name], at = (at, at + p.numel()), at + p.numel()
    holder = lambda name: next(k for k, f in enumerate(fragments) if any(lo <= offsets[name][0] < hi for lo, hi in f))  # noqa: E731
    assert [holder(f"blocks.{i}.mlp.0.weight") for i in range(4)] == [0, 1, 0, 1]  # strided, after tokens and positions
    for name, (lo, hi) in offsets.items():  # whole tensors
        assert any(a <= lo and hi <= b for a, b in fragments[holder(name)]), name
    with pytest.raises(ValueError, match="fragments 9: the model has only 8 modules"):
        diloco.module_fragments(gpt, 9)


def test_streaming_trains_with_module_fragments(tmp_path):
    config = small_config(tmp_path, strategy="streaming-diloco", epochs=1.0, sync_every=4, fragments=2,
                          fragment_cut="modules", **ADAMW)  # fmt: skip
    plain, simulated = both_runtimes(config)
    for a, b in zip(plain.workers, simulated.workers, strict=True):
        torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-5)
    assert plain.workers[0].facts["outer_steps"] == 6


# the codes' stated errors (compress.py): |x - x'| <= bound(x, absmax of x's block)
BOUNDS = {
    "bf16": lambda x, absmax: x.abs() * 2**-8,
    "int8": lambda x, absmax: absmax / 254,
    "fp4": lambda x, absmax: torch.maximum(x.abs() / 3, absmax * 2**-7),
}


@pytest.mark.parametrize("name", BOUNDS)
@pytest.mark.parametrize("m", [1, BLOCK, 3 * BLOCK + 5])
def test_a_code_round_trip_keeps_its_stated_error(name, m):
    torch.manual_seed(m)
    x = torch.randn(m) * torch.logspace(-4, 2, m)  # values over six orders of magnitude
    x[::7] = 0.0
    codec = CODECS[name]
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes(m)
    decoded = codec.decode(payload, m)
    absmax = torch.nn.functional.pad(x.abs(), (0, -m % BLOCK)).view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[:m]
    assert torch.all((x - decoded).abs() <= BOUNDS[name](x, absmax) * (1 + 1e-6))
    assert torch.all(decoded[::7] == 0)
    assert codec.nbytes(m) < 4 * m if m >= BLOCK or name == "bf16" else True


@pytest.mark.parametrize("name", BOUNDS)
def test_a_vectors_chunks_code_as_each_chunk_alone(name):
    """`encode_chunks` and `decode_chunks` (a compressed mean's n chunks at once) give each
    chunk exactly the payload and values of its own `encode` and `decode`: chunk sizes that
    differ by one, across block boundaries, an empty chunk, and a chunk of zeros."""
    torch.manual_seed(2)
    sizes = [0, 1, 129, 128, 127, 300, 300, 301]
    x = torch.randn(sum(sizes)) * 10
    x[1 + 129 : 1 + 129 + 128] = 0.0  # a whole chunk of zeros: its blocks' scale stays 1
    codec = CODECS[name]
    payloads, sent = codec.encode_chunks(x, sizes)
    alone = [codec.encode(chunk) for chunk in x.split(sizes)]
    assert [p.tolist() for p in payloads] == [p.tolist() for p in alone]
    assert [p.numel() for p in payloads] == [codec.nbytes(m) for m in sizes]
    each = torch.cat([codec.decode(p, m) for p, m in zip(alone, sizes)])
    assert torch.equal(sent, each) and torch.equal(codec.decode_chunks(alone, sizes), each)


def test_fp4_takes_its_levels_exactly():
    levels = torch.tensor([1.0, -0.5, 0.25, 2.0**-6, -(2.0**-6), 0.0, 0.75 + 1e-3, 2.0**-8])
    decoded = CODECS["fp4"].decode(CODECS["fp4"].encode(levels), len(levels))
    assert decoded.tolist() == [1.0, -0.5, 0.25, 2.0**-6, -(2.0**-6), 0.0, 1.0, 0.0]


@pytest.mark.parametrize("name", ["bf16", "int8", "fp4"])
def test_error_feedback_loses_nothing(name):
    """Over 20 encodings of overlapping ranges: what was sent plus the residual is what was
    given, coordinate by coordinate."""
    torch.manual_seed(1)
    residual = Residual(CODECS[name], 300)
    given, sent = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for r in range(20):
        lo, x = (r * 37) % 200, torch.randn(100) * 10 ** (r % 3)
        _, decoded = residual.encode(x, lo)
        given[lo : lo + 100] += x.double()
        sent[lo : lo + 100] += decoded.double()
    torch.testing.assert_close(sent + residual.error.double(), given, rtol=0, atol=1e-4)
    assert residual.error.abs().max() > 0


def _means(ctx):
    """Five compressed means of random vectors (seeded by rank and round): facts are the sum of
    what each mean gave, the sum of the vectors given, and the residual."""
    n, numel = ctx.world_size, 1000
    mean = Mean(ctx.rank, n, CODECS[ctx.config.compress], numel)
    applied, given = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for r in range(5):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(100 * r + ctx.rank))
        pending = yield from mean.start(x, 0, vote=ctx.rank == 1 and r == 3)
        m, votes = yield from mean.finish(pending)
        applied += m.double()
        given += x.double()
        assert votes == (1 if r == 3 and n > 1 else 0)
    return {"applied": applied, "given": given, "residual": mean.residual.error.double()}


MEANS = Strategy(name="diloco", worker=_means)


@pytest.mark.parametrize("compress", ["int8", "fp4"])
def test_a_compressed_mean_is_the_same_everywhere_and_conserves(tmp_path, compress):
    """Every worker gets the same means, bit for bit; their sum plus the residuals / n is the
    mean of every vector given (error feedback: the worker's own code and the owner's code of
    the mean)."""
    config = small_config(tmp_path, strategy="diloco", workers=3, compress=compress, **ADAMW)
    for result in both_runtimes(config, strategy=MEANS):
        facts = [w.facts for w in result.workers]
        assert all(torch.equal(f["applied"], facts[0]["applied"]) for f in facts)
        total_given = sum(f["given"] for f in facts) / 3
        kept = sum(f["residual"] for f in facts) / 3
        torch.testing.assert_close(facts[0]["applied"] + kept, total_given, rtol=0, atol=1e-5)
        assert (facts[0]["applied"] - total_given).abs().max() > 1e-3  # the codes did leave something out


@pytest.mark.parametrize("compress", ["none", "bf16", "int8", "fp4"])
def test_the_bytes_on_the_wire_are_the_codes(tmp_path, compress):
    """2 workers, H = 3, 12 steps: 4 syncs, each sending the peer's half (its chunk) and the own
    half's mean; uncompressed, a ring all-reduce of the vector and the vote."""
    config = small_config(tmp_path, strategy="diloco", epochs=1.0, sync_every=3, compress=compress, **ADAMW)
    numel = 22_602
    if compress == "none":
        per_sync = 2 * (2 - 1) * (numel + 1) * 4 // 2
    else:
        per_sync = sum(CODECS[compress].nbytes(hi - lo) for lo, hi in chunks(numel, 2))
    for result in both_runtimes(config):
        for w in result.summary["per_worker"]:
            assert w["bytes_sent"] == 4 * per_sync, (w["bytes_sent"], per_sync)


@pytest.mark.parametrize("compress,delay", [("none", 1), ("int8", 1), ("fp4", 2)])
def test_compressed_streaming_is_alike_in_both_runtimes(tmp_path, compress, delay):
    """3 workers, H = 6, P = 2: a sync every 3 steps, its mean overlapping tau steps (tau = 2:
    the owners reduce after the first)."""
    config = small_config(tmp_path, strategy="streaming-diloco", workers=3, train_samples=3 * 16 * 12, epochs=1.0,
                          sync_every=6, fragments=2, fragment_delay=delay, compress=compress, **ADAMW)  # fmt: skip
    plain, simulated = both_runtimes(config)
    for a, b in zip(plain.workers, simulated.workers, strict=True):
        torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-5)
        assert a.facts["sync_log"].tolist() == [[3, 0], [6, 1], [9, 0], [12, 1]]


@pytest.mark.parametrize("staleness", [1, 2])
def test_akos_compressed_ring_is_alike_in_both_runtimes(tmp_path, staleness):
    """Ako's windows on the ring as int8 (an outer step: AdamW), 3 workers, p = 4: the same
    replicas on real processes and simulated, at s = 1 and at s = 2, where each mean's second
    half goes out a step after its first; every replica equal after the flush."""
    config = small_config(tmp_path, strategy="ako", workers=3, train_samples=3 * 16 * 12, epochs=1.0, partitions=4,
                          staleness=staleness, compress="int8", **ADAMW)  # fmt: skip
    plain, simulated = both_runtimes(config)
    assert plain.summary["compress"] == simulated.summary["compress"] == "int8"
    for a, b in zip(plain.workers, simulated.workers, strict=True):
        torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.params, plain.workers[0].params, rtol=0, atol=1e-6)


def test_options_outside_torchfts_constraints_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"sync_every 10: must be a multiple of fragments \(4\)"):
        ako.train(small_config(tmp_path, strategy="streaming-diloco", sync_every=10, fragments=4))
    with pytest.raises(ConfigError, match="fragment_delay 2: must be below sync_every / fragments = 2"):
        ako.train(small_config(tmp_path, strategy="streaming-diloco", sync_every=8, fragments=4, fragment_delay=2))
    with pytest.raises(ConfigError, match="fragments 2: strategy diloco has no such option"):
        ako.train(small_config(tmp_path, strategy="diloco", fragments=2))
    for strategy in ("diloco", "streaming-diloco"):
        with pytest.raises(ConfigError, match="compress 'fp8'"):
            ako.train(small_config(tmp_path, strategy=strategy, compress="fp8"))
        with pytest.raises(ConfigError, match="outer_momentum 1"):
            ako.train(small_config(tmp_path, strategy=strategy, outer_momentum=1.0))


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_more_module_fragments_than_modules_is_one_line_before_anything_is_written(tmp_path, capsys, command):
    """The gpt's 8 modules cannot make 50 whole-module fragments: one line naming them, exit 2,
    no run directory (not a failure inside the workers)."""
    out, text = tmp_path / "runs", tmp_path / "words.txt"
    text.write_text("a few words of text, over and over\n" * 200)
    args = [command, "--strategy", "streaming-diloco", "--fragment-cut", "modules", "--fragments", "50",
            "--sync-every", "100", "--model", "gpt", "--layers", "1", "--width", "16", "--heads", "2",
            "--context", "16", "--dataset", f"text:{text}", "--workers", "2", "--out-dir", str(out), "--no-progress"]
    if command == "simulate":
        args += ["--seconds-per-sample", "0.001"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fragments 50: the model has only" in err, err
    assert not out.exists()


def test_a_lost_worker_ends_a_compressed_run_naming_it(tmp_path):
    """A mean needs every worker (as allreduce, unlike torchft's quorum): kill -9 rank 1 of 3
    mid-run; the run ends within seconds, naming it."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", "streaming-diloco", "--compress", "int8",
           "--sync-every", "4", "--fragments", "2", "--workers", "3", "--dataset", "digits", "--epochs", "1000",
           "--timeout", "30", "--eval-every", "0.2", "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    code, _, err, elapsed = run_and_kill(cmd, "ako-rank1", out_dir, settle=1.0)
    assert code == 1 and elapsed < 20, (code, elapsed, err)
    assert "worker rank 1 failed: killed by SIGKILL" in err, err
    assert "Traceback" not in err, err


def test_the_registry_declares_both():
    assert {"diloco", "streaming-diloco"} <= set(STRATEGIES)
    names = {o.name for o in STRATEGIES["streaming-diloco"].options}
    assert {"sync_every", "outer_lr", "outer_momentum", "compress", "fragments", "fragment_delay", "fragment_alpha"} <= names


@pytest.mark.parametrize("workers", [1, 2])
def test_ako_with_an_outer_step_at_p_1_staleness_0_is_diloco_at_h_1(tmp_path, workers):
    """Ako's windows of deltas with an outer Nesterov step on each mean window (ring, p = 1,
    s = 0): each step's mean delta goes through the outer optimizer in place of the own
    delta, which is DiLoCo with H = 1 and the same outer optimizer, inner AdamW states kept."""
    config = small_config(tmp_path, strategy="diloco", workers=workers, epochs=0.5, sync_every=1, outer_lr=0.7,
                          outer_momentum=0.9, **ADAMW)  # fmt: skip
    ako_config = replace(config, strategy="ako", partitions=1, staleness=0, update="deltas", exchange="auto",
                         sync_every=None)  # fmt: skip
    for plain, windows in zip(both_runtimes(config), both_runtimes(ako_config), strict=True):
        assert windows.workers[0].facts["exchange"] == "ring"
        assert plain.summary["iterations"] == windows.summary["iterations"] == 12 // workers  # 384 samples, 0.5 epoch
        for a, b in zip(plain.workers, windows.workers, strict=True):
            torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-5)


def test_an_outer_step_where_ako_has_no_mean_window_of_deltas_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"outer lr 0.7 and momentum 0: an outer step needs windows of deltas"):
        ako.train(small_config(tmp_path, strategy="ako", outer_lr=0.7, update="gradients", **ADAMW))
    with pytest.raises(ConfigError, match=r"outer lr 0.7 and momentum 0: an outer step needs --exchange ring or auto"):
        ako.train(small_config(tmp_path, strategy="ako", outer_lr=0.7, exchange="all-to-all", **ADAMW))  # auto: gradients
    with pytest.raises(ConfigError, match=r"here update is auto, which is gradients for one worker"):
        ako.train(small_config(tmp_path, strategy="ako", outer_lr=0.7, workers=1, **ADAMW))
    with pytest.raises(ConfigError, match=r"outer lr 1 and momentum 0.5: an outer step needs --exchange ring or auto"):
        ako.train(small_config(tmp_path, strategy="ako", outer_momentum=0.5, update="deltas", exchange="all-to-all"))
    with pytest.raises(ConfigError, match=r"outer_lr 0.0: must be a number >= 1e-06 and <= 100"):  # it would never move
        ako.train(small_config(tmp_path, strategy="ako", outer_lr=0.0, update="deltas"))
    assert not list(tmp_path.glob("runs/*")), "nothing is written for bad input"
