"""The micro-batch setting of the strategies that take partial steps (`ops.ComputePartial`):
`absp` always, `ako` when a worker is behind its peers."""

from __future__ import annotations

from ako.checks import ConfigError, integer


def default_micro_batch(config) -> int:
    """A quarter of the mini-batch (at least 1 sample)."""
    return max(1, config.batch_size // 4)


def check_micro_batch(value, config) -> int:
    """An integer from 1 to a step's samples (batch_size x accumulate). Raises ConfigError."""
    micro_batch = integer("micro_batch", value, low=1)
    if micro_batch > config.step_samples:
        per_step = f"batch_size {config.batch_size}" + (f" x accumulate {config.accumulate}" if config.accumulate > 1 else "")
        raise ConfigError(f"micro_batch {micro_batch}: must be at most a step's samples, {per_step}")
    return micro_batch
