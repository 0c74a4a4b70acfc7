"""`ako generate`: text sampled from a language model a run saved (model.pt and
vocabulary.json), so that a user sees what it learned.

Sampling is the usual autoregressive loop (as nanoGPT's `generate`): the last `context` tokens
go in, the next token is drawn from softmax(logits / temperature), restricted to the `top_k`
likeliest tokens, and appended.
"""

from __future__ import annotations

import os

import torch

from ako.checks import ConfigError
from ako.data.text import VOCABULARY_FILE, Vocabulary


def generate(run_dir: str | os.PathLike, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 20, seed: int = 0) -> str:  # fmt: skip
    """`tokens` characters sampled from the run's model after `prompt` (not included in what
    is returned). The same run, arguments and seed give the same text.

    Args:
        run_dir: a finished run's directory, with model.pt, config.toml and vocabulary.json.
        prompt: text of characters in the run's vocabulary (at least one).
        tokens: how many tokens to sample (1 to 100,000).
        temperature: > 0; lower is likelier text, higher more varied.
        top_k: sample among the k likeliest tokens only (None or 0: all).
        seed: the sampling's random seed.

    Raises:
        ConfigError (one line): not a run directory, a run without model.pt or vocabulary.json
        (not a language model), a vocabulary of another size than the model's, a prompt with a
        character the vocabulary lacks, or an argument
        out of range.
    """
    from ako.api import load_model

    _check(prompt, tokens, temperature, top_k)
    vocabulary = _vocabulary(run_dir)
    model = load_model(run_dir)
    try:
        ids = vocabulary.encode(prompt).unsqueeze(0)
    except Exception as e:  # DataError: a character it never saw
        raise ConfigError(f"prompt {prompt[:40]!r}: {e}") from None
    with torch.no_grad():
        predicts = model(ids[:, -1:]).shape[-1]
    if predicts != vocabulary.size:  # a vocabulary.json not of this model: its ids would not decode
        raise ConfigError(f"{os.path.join(run_dir, VOCABULARY_FILE)}: {vocabulary.size} characters, but the model "
                          f"predicts {predicts} tokens: not this model's vocabulary")  # fmt: skip
    return vocabulary.decode(sample(model, ids, tokens, temperature, top_k, seed)[0, ids.shape[1]:])


@torch.no_grad()
def sample(model: torch.nn.Module, ids: torch.Tensor, tokens: int, temperature: float = 0.8,
           top_k: int | None = 20, seed: int = 0) -> torch.Tensor:  # fmt: skip
    """`ids` (B, T) int64 followed by `tokens` sampled ids: (B, T + tokens). `model` maps (B, t)
    ids to logits (B, t, vocabulary); it sees the last `model.context` ids (all when it has no
    `context`)."""
    generator = torch.Generator().manual_seed(seed)
    context = getattr(model, "context", None)
    for _ in range(tokens):
        logits = model(ids if context is None else ids[:, -context:])[:, -1, :].float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], 1)
    return ids


def _vocabulary(run_dir) -> Vocabulary:
    path = os.path.join(run_dir, VOCABULARY_FILE)
    if os.path.isdir(run_dir) and not os.path.isfile(path):
        raise ConfigError(f"run directory {str(run_dir)!r}: no {VOCABULARY_FILE}: not a language model's run "
                          "(train one with --dataset fortunes --model gpt)")  # fmt: skip
    try:
        return Vocabulary.load(path)
    except Exception as e:  # DataError: damaged; or run_dir is no directory (load_model says so first)
        if not os.path.isdir(run_dir):
            raise ConfigError(f"run directory {str(run_dir)!r}: no such directory") from None
        raise ConfigError(str(e)) from None


def _check(prompt: str, tokens: int, temperature: float, top_k: int | None) -> None:
    if not prompt:
        raise ConfigError("prompt '': give at least one character to start from")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 100_000:
        raise ConfigError(f"tokens {tokens!r}: must be an integer from 1 to 100000")
    if not (isinstance(temperature, (int, float)) and 0 < temperature <= 100):
        raise ConfigError(f"temperature {temperature!r}: must be a number above 0, at most 100")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"top_k {top_k!r}: must be a whole number >= 0 (0: all tokens)")
