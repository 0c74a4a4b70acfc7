"""Language models: text data (vocabulary, split, sequences, shards), the gpt's causal mask,
all-reduce and Ako with AdamW equal to one process, `ako generate`, and bad text input."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ako
from ako.cli import main
from ako.data import ShardSampler, load_dataset
from ako.data.text import VALIDATION_FRACTION, Vocabulary, load_text
from ako.generate import generate
from ako.models import GPT
from helpers import single_process_sgd, small_config

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls hum softly".split()
TINY_GPT = dict(model="gpt", context=16, layers=1, heads=2, width=16)
ADAMW = dict(optimizer="adamw", lr=0.003, momentum=None, nesterov=None, weight_decay=0.01, lr_schedule="cosine", warmup="2")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 9,000 characters of seeded random words, in lines."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(240)]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def lm_config(tmp_path, corpus, **overrides):
    """2 workers, the tiny gpt on the corpus in sequences of 16 tokens, AdamW with a cosine
    schedule: 6 steps."""
    values = dict(dataset=f"text:{corpus}", train_samples=192, test_samples=32, epochs=1.0, **TINY_GPT, **ADAMW)
    return small_config(tmp_path, **{**values, **overrides})


def test_changing_a_token_changes_no_logit_before_it():
    """The causal mask: token j changed, the logits of positions 0..j-1 are the same."""
    torch.manual_seed(0)
    model = GPT(20, context=12, layers=2, heads=2, width=16).eval()
    ids = torch.randint(20, (3, 12))
    for j in (0, 5, 11):
        changed = ids.clone()
        changed[:, j] = (changed[:, j] + 1) % 20
        before, after = model(ids), model(changed)
        assert torch.equal(before[:, :j], after[:, :j])
        assert not torch.allclose(before[:, j:], after[:, j:])


def test_the_split_is_deterministic_and_disjoint_and_the_vocabulary_round_trips(corpus, tmp_path):
    text = corpus.read_text()
    split = load_text(f"text:{corpus}", 16)
    cut = len(text) - int(len(text) * VALIDATION_FRACTION)
    assert split.characters == (cut, len(text) - cut)
    assert split.vocabulary.chars == "".join(sorted(set(text)))
    assert split.vocabulary.decode(split.train.tokens) == text[:cut]
    assert split.vocabulary.decode(split.test.tokens) == text[cut:]  # the validation text follows it, no overlap
    again = load_text(f"text:{corpus}", 16)
    assert torch.equal(again.train.tokens, split.train.tokens) and torch.equal(again.test.tokens, split.test.tokens)
    x, y = split.train[3]
    assert split.vocabulary.decode(x) == text[48:64] and split.vocabulary.decode(y) == text[49:65]
    batch_x, batch_y = split.train.batch(torch.tensor([3, 0]))
    assert torch.equal(batch_x[0], x) and torch.equal(batch_y[0], y)
    split.vocabulary.save(tmp_path / "v.json")
    assert Vocabulary.load(tmp_path / "v.json").chars == split.vocabulary.chars
    assert len(split.train) == (cut - 1) // 16


def test_shards_cover_every_sequence_once_an_epoch(corpus):
    """Each worker its shard of the sequences' start positions, reshuffled every epoch; the
    shards together hold each sequence once (less the few whole steps leave over)."""
    split = load_dataset(f"text:{corpus}", context=16)
    n, workers, batch = len(split.train), 3, 4
    epochs = []
    for epoch in range(2):
        taken = torch.cat([ShardSampler(n, r, workers, batch, seed=0)._shard(epoch) for r in range(workers)])
        assert len(set(taken.tolist())) == len(taken) == n // workers * workers
        epochs.append(taken)
    assert not torch.equal(epochs[0], epochs[1])


def test_allreduce_with_adamw_equals_one_process(tmp_path, corpus):
    """All-reduce on 2 workers equals one process's AdamW (cosine, warm-up) on the union of
    their batches, to 1e-5. (With a key bias, whose true gradient is 0, AdamW stepped its
    rounding noise: those coordinates were off by up to 2.6e-5 after 6 steps.)"""
    config = lm_config(tmp_path, corpus, strategy="allreduce")
    allreduce = ako.train(config)
    steps = allreduce.summary["iterations"]
    assert steps == 6 and allreduce.summary["tokens_per_sample"] == 16
    expected = single_process_sgd(config, steps)
    torch.testing.assert_close(allreduce.workers[0].params, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("exchange", ["all-to-all", "ring"])
def test_ako_at_one_partition_in_lock_step_equals_allreduce_with_adamw(tmp_path, corpus, exchange):
    """Ako with p = 1, s = 0 and windows of gradients (`--update gradients`) equals all-reduce
    with AdamW, on both exchanges (to 1e-5); with windows of deltas it does not: it averages
    the workers' own AdamW steps."""
    config = lm_config(tmp_path, corpus, strategy="allreduce")
    expected = ako.train(config).workers[0].params
    lock_step = replace(config, strategy="ako", partitions=1, staleness=0, exchange=exchange, update="gradients")
    for worker in ako.train(lock_step).workers:
        torch.testing.assert_close(worker.params, expected, rtol=0, atol=1e-5)
    deltas = ako.train(replace(lock_step, update="deltas")).workers[0].params
    assert (deltas - expected).abs().max() > 1e-3


@pytest.mark.parametrize("exchange", ["auto", "all-to-all"])
def test_ako_with_adamw_ends_with_equal_replicas_and_trains(tmp_path, corpus, exchange):
    """Defaults (p = auto, s = auto) with AdamW: windows of deltas with the outer step on the ring
    (p at least 8, s timed), and on all-to-all windows of gradients (s = 1): the replicas are one after the final
    call, and the validation loss falls from the start's."""
    result = ako.train(lm_config(tmp_path, corpus, strategy="ako", eval_every=1.0, epochs=4.0, exchange=exchange))
    facts = result.workers[0].facts
    if exchange == "auto":
        assert (facts["exchange"], facts["partitions"]) == ("ring", 8)
        assert result.summary["windows"] == "deltas with an outer step (lr 0.8, momentum 0.6)"
        s = facts["staleness_bound"]  # auto, from an all-reduce timed on these processes
        assert 1 <= s <= 4 and f"staleness s = {s} (auto: a window's all-reduce takes" in facts["partitions_reason"]
    else:
        assert (facts["exchange"], result.summary["windows"]) == ("all-to-all", "gradients")
    first, last = result.workers[0].params, result.workers[1].params
    assert torch.equal(first, last)
    records = [json.loads(line) for line in (Path(result.summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["test_loss"] < records[0]["test_loss"] - 0.3  # measured: 3.48 -> 3.13 in 24 steps


def test_a_run_records_the_language_model_figures_and_generates_the_same_text_for_a_seed(tmp_path, corpus):
    run = ako.train(lm_config(tmp_path, corpus, strategy="allreduce", eval_every=0.25))
    s = run.summary
    run_dir = Path(s["run_dir"])
    assert s["test_metrics"]["perplexity"] == pytest.approx(torch.tensor(s["test_loss"]).exp().item(), rel=1e-4)
    assert s["tokens_per_second"] == pytest.approx(16 * s["samples_per_second"], rel=1e-3)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("test_perplexity" in r for r in records) and len(records) >= 4
    vocabulary = json.loads((run_dir / "vocabulary.json").read_text())["chars"]
    assert "".join(vocabulary) == "".join(sorted(set(corpus.read_text())))
    first = generate(run_dir, "the ", 40, seed=3)
    assert len(first) == 40 and set(first) <= set(vocabulary)
    assert generate(run_dir, "the ", 40, seed=3) == first
    assert generate(run_dir, "the ", 40, seed=4) != first
    out = subprocess.run([sys.executable, "-m", "ako", "generate", str(run_dir), "--prompt", "the ", "--tokens", "40",
                          "--seed", "3"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "the " + first + "\n"
    (run_dir / "vocabulary.json").write_text(json.dumps({"type": "characters", "chars": list("the ")}))  # another's
    with pytest.raises(ako.ConfigError, match=f"4 characters, but the model predicts {len(vocabulary)} tokens"):
        generate(run_dir, "the ", 40)


def _bad_text(tmp_path: Path, kind: str) -> str:
    if kind == "empty":
        (tmp_path / "e.txt").write_text("")
        return f"text:{tmp_path / 'e.txt'}"
    if kind == "binary":
        (tmp_path / "b.txt").write_bytes(b"abc\0\x01\x02" * 100)
        return f"text:{tmp_path / 'b.txt'}"
    if kind == "not utf-8":
        (tmp_path / "l.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
        return f"text:{tmp_path / 'l.txt'}"
    if kind == "short":
        (tmp_path / "s.txt").write_text("too short for a sequence\n" * 4)
        return f"text:{tmp_path / 's.txt'}"
    if kind == "no .txt in folder":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "notes.md").write_text("x" * 5000)
        return f"text:{tmp_path / 'd'}"
    return f"text:{tmp_path / 'missing.txt'}"


@pytest.mark.parametrize("kind, says", [("empty", "the text is empty"), ("binary", "a binary file"),
                                        ("not utf-8", "not UTF-8 text"), ("short", "too few for one sequence"),
                                        ("no .txt in folder", "no .txt files"), ("missing", "no such file or folder")])  # fmt: skip
def test_bad_text_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, kind, says):
    dataset = _bad_text(tmp_path, kind)
    out = tmp_path / "runs"
    assert main(["train", "--dataset", dataset, "--model", "gpt", "--out-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ako: error: ") and says in err
    assert not out.exists()


def test_generate_refuses_bad_input_in_one_line(tmp_path, capsys):
    image_run = tmp_path / "image-run"
    image_run.mkdir()
    (image_run / "config.toml").write_text('model = "cnn"\n')
    for args, says in [([str(tmp_path / "none")], "no such directory"), ([str(image_run)], "not a language model"),
                       ([str(image_run), "--tokens", "0"], "tokens 0")]:  # fmt: skip
        assert main(["generate", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err
