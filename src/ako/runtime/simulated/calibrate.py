"""`ako calibrate`: measure a model's compute speed on this machine and write a cluster profile.

A profile is a small TOML file that `ako simulate --profile` takes:

    model = "cnn"
    dataset = "fashion-mnist"
    batch_size = 64
    threads = 1
    seconds_per_sample = 0.00037      # CPU, one thread (as each distributed worker runs)
    gpu_seconds_per_sample = 2.1e-05  # only where CUDA is present
    gpu = "NVIDIA H200"
    shared_seconds_per_sample = [0.00037, 0.00041, 0.00062, 0.00081]  # only with --processes 4
    gradient_ready = [1.0, 0.98, 0.99, 0.97, 0.42, 0.41, 0.38, 0.37]  # per parameter tensor

Seconds per sample are forward+backward (and the flat gradient) of one mini-batch, divided by
its size: the median of `repeats` timed steps after two warm-up steps. With `processes` N > 1,
`shared_seconds_per_sample[k-1]` is the median over k processes timing at once (k = 1..N, one
thread each, as `ako train` runs k workers here): a profile of this machine as the cluster
itself, which `ako simulate` then models as one host whose cores the workers share.
`gradient_ready[i]`: the fraction of forward+backward after which parameter tensor i's gradient
is final (the median over the timed steps), for all-reduces that overlap backward.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import tomllib
from pathlib import Path

import tomli_w
import torch

from ako.config import SECONDS_PER_SAMPLE_MAX, ConfigError, TrainConfig
from ako.data import fetch, to_device
from ako.metrics import write_atomic
from ako.run.job import Job


def measure_seconds_per_sample(
    job: Job, data, device: torch.device, repeats: int = 20, threads: int | None = 1, ready=None
) -> float:
    """Median seconds per sample of forward+backward on `job.config.batch_size` training
    samples on `device`, with `threads` CPU threads (None: leave torch's setting). `ready`, if
    given, is called after the warm-up steps, before timing (to start processes together)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        replica = job.build_replica(data, device)
        samples = job.config.batch_size
        batch = to_device(fetch(data.train, torch.arange(samples), data.collate_fn), device)
        times = []
        for i in range(repeats + 2):
            if i == 2 and ready is not None:
                ready()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            replica.compute_gradient([batch])  # .item() on the loss waits for the GPU
            if i >= 2:
                times.append(time.perf_counter() - t)
        return statistics.median(times) / samples
    finally:
        torch.set_num_threads(before)


def measure_gradient_ready(job: Job, data, repeats: int = 20) -> list[float]:
    """Per parameter tensor (in the model's order), the median fraction of forward+backward on
    one CPU thread after which its gradient is final (`Replica.compute_gradient`'s `ready`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        replica = job.build_replica(data, torch.device("cpu"))
        batch = fetch(data.train, torch.arange(job.config.batch_size), data.collate_fn)
        fractions = []
        for i in range(repeats + 2):
            times = {}
            start = time.perf_counter()
            replica.compute_gradient([batch], ready=lambda k: times.setdefault(k, time.perf_counter()))
            span = time.perf_counter() - start
            if i >= 2:
                fractions.append([(times.get(k, start + span) - start) / span for k in range(len(replica.boundaries) - 1)])
        return [round(statistics.median(column), 4) for column in zip(*fractions)]
    finally:
        torch.set_num_threads(before)


def _timed_together(config: TrainConfig, repeats: int, barrier, results) -> None:
    job = Job(config)
    data = job.load_data()
    results.put(measure_seconds_per_sample(job, data, torch.device("cpu"), repeats, ready=lambda: barrier.wait(120)))


def measure_shared(config: TrainConfig, processes: int, repeats: int = 20) -> float:
    """Median seconds per sample over `processes` processes timing forward+backward at the
    same time on this machine's CPU (one thread each). Raises RuntimeError if one fails."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.SimpleQueue()
    workers = [ctx.Process(target=_timed_together, args=(config, repeats, barrier, results)) for _ in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if any(w.exitcode != 0 for w in workers):
        raise RuntimeError(f"calibrating {processes} processes at once: a process failed")
    return statistics.median(results.get() for _ in workers)


def calibrate(config: TrainConfig, out: str | None = None, repeats: int = 20, processes: int = 1) -> dict:
    """Measure `config.model` on `config.dataset` at `config.batch_size` on the CPU (one
    thread) and on the GPU where CUDA is present; with `processes` > 1 also 1..`processes`
    processes at once (the module docstring); write the profile to `out` when given.
    Returns the profile. Raises ConfigError, DataError, or RuntimeError (a process failed)."""
    if out is not None:  # before minutes of measuring: a place the profile can be written
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"out {out!r}: cannot make its directory ({e.strerror})") from None
    job = Job(config)
    data = job.load_data()
    job.validate(data, job.build_replica(data, torch.device("cpu")))
    profile = {
        "model": config.model,
        "dataset": data.name,
        "batch_size": config.batch_size,
        "threads": 1,
        "seconds_per_sample": measure_seconds_per_sample(job, data, torch.device("cpu"), repeats),
        "gradient_ready": measure_gradient_ready(job, data, repeats),
    }
    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        profile["gpu_seconds_per_sample"] = measure_seconds_per_sample(job, data, gpu, repeats, threads=None)
        profile["gpu"] = torch.cuda.get_device_name(gpu)
    if processes > 1:
        shared = [profile["seconds_per_sample"]] + [measure_shared(config, k, repeats) for k in range(2, processes + 1)]
        profile["shared_seconds_per_sample"] = shared
    if out is not None:
        try:
            write_atomic(Path(out), tomli_w.dumps(profile))
        except OSError as e:
            raise ConfigError(f"out {out!r}: cannot write the profile ({e.strerror})") from None
    return profile


PROFILE_KEYS = ("model", "dataset", "batch_size", "threads", "seconds_per_sample", "gradient_ready",
                "shared_seconds_per_sample", "gpu_seconds_per_sample", "gpu")  # what `calibrate` writes


def load_profile(path: str, config: TrainConfig, dataset: str | None = None, tensors: int | None = None) -> dict:
    """Read a profile written by `calibrate`; raise ConfigError when it cannot be read, has a
    key `calibrate` does not write (a misspelt one would be ignored) or a value of the wrong
    type, lacks seconds_per_sample, or was measured for another model, batch size or data set
    (`dataset`, the one the run loaded) than `config`'s, or for a model of other than
    `tensors` parameter tensors (gradient_ready has a fraction per tensor)."""
    try:
        with open(path, "rb") as f:
            profile = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"profile {path!r} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"profile {path!r}: cannot read it ({e})") from None
    unknown = sorted(set(profile) - set(PROFILE_KEYS))
    if unknown:
        raise ConfigError(f"profile {path!r}: unknown key {unknown[0]!r}; allowed: {', '.join(PROFILE_KEYS)}")
    sps = profile.get("seconds_per_sample")
    if not _number(sps, 0, SECONDS_PER_SAMPLE_MAX):
        raise ConfigError(f"profile {path!r}: needs seconds_per_sample, a number >= 0 and <= {SECONDS_PER_SAMPLE_MAX:g}, "
                          f"not {sps!r:.40}")  # fmt: skip
    shared = profile.get("shared_seconds_per_sample", [])
    if not isinstance(shared, list) or not all(_number(t, 0, SECONDS_PER_SAMPLE_MAX) and t > 0 for t in shared):
        raise ConfigError(f"profile {path!r}: shared_seconds_per_sample must be a list of numbers > 0 and "
                          f"<= {SECONDS_PER_SAMPLE_MAX:g}, not {shared!r:.60}")  # fmt: skip
    ready = profile.get("gradient_ready", [])
    if not isinstance(ready, list) or not all(_number(f, 0, 1) for f in ready):
        raise ConfigError(f"profile {path!r}: gradient_ready must be a list of fractions from 0 to 1")
    if ready and tensors is not None and len(ready) != tensors:
        raise ConfigError(f"profile {path!r}: gradient_ready has {len(ready)} fractions, the model {tensors} "
                          "parameter tensors; run ako calibrate for this model")  # fmt: skip
    for key, fits, allowed in _OTHER_VALUES:
        if key in profile and not fits(profile[key]):
            raise ConfigError(f"profile {path!r}: {key} must be {allowed}, not {profile[key]!r:.40}")
    wanted = {"model": config.model, "batch_size": config.batch_size, "dataset": dataset or config.dataset}
    for key, value in wanted.items():
        if key in profile and profile[key] != value:
            raise ConfigError(
                f"profile {path!r}: measured for {key} {profile[key]!r}, not {value!r}; "
                f"run ako calibrate --{key.replace('_', '-')} {value}"
            )
    return profile


_OTHER_VALUES = (  # the keys `load_profile` checks no other way: (key, test, what is allowed)
    ("threads", lambda v: not isinstance(v, bool) and isinstance(v, int) and v >= 1, "an integer >= 1"),
    ("gpu_seconds_per_sample", lambda v: _number(v, 0, SECONDS_PER_SAMPLE_MAX), f"a number >= 0 and <= {SECONDS_PER_SAMPLE_MAX:g}"),
    ("gpu", lambda v: isinstance(v, str), "a device name (a string)"),
    ("model", lambda v: isinstance(v, str), "a model name (a string)"),
    ("dataset", lambda v: isinstance(v, str), "a data set name (a string)"),
)  # fmt: skip


def _number(value, low: float, high: float) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and low <= value <= high  # NaN fails too
