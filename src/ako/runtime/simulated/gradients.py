"""The simulated workers' gradients, computed together: each `Compute` files its replica and
mini-batch here and lets its compute time pass; the first worker whose time is up computes
every gradient filed by then, on `threads` threads at once.

Deferring is exact: a worker's replica changes only in its own program, which is suspended
until its gradient is taken, so a gradient computed later is the one computed at once. Each
replica has its own module, and each gradient is computed on one thread with one torch
thread, so the result is bit for bit the one-at-a-time result, whatever the thread count.
(The one exception: a model that draws random numbers in its forward, such as dropout, draws
from the shared generator in thread order, which varies from run to run.)

Why threads and not one vmapped call (`torch.func.vmap` over stacked parameters): on a CPU,
vmap was no faster than one replica at a time for the built-in models (benchmarks/sim_batching.py,
64 replicas: the cnn 1.08x at batch 2 but 0.78x at 8 and 0.24x at 32, the mlp 0.67x to
0.83x; nor was one grouped convolution and one batched matrix product per layer: the cnn 0.56x
to 0.95x; nor an exact batched form, bit for bit this one, with each replica's convolution
kernels: the cnn 0.28x to 1.26x); the gain of computing together is the cores.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ako.replica import Replica


@dataclass
class _Filed:
    """One worker's gradient to compute: its replica and one step's micro-batches; `loss`
    once computed (the mean loss `Replica.compute_gradient` returns)."""

    replica: Replica
    batches: list
    loss: float | None = None


class Gradients:
    """Gradients filed and not yet computed. `threads`: how many are computed at once (1: one
    at a time, on the caller's thread; the simulator gives torch's thread count: the cores,
    OMP_NUM_THREADS, or `torch.set_num_threads`).
    `seconds`: real seconds spent computing them (the simulator's forward/backward time)."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, threads)
        self.filed: list[_Filed] = []
        self.seconds = 0.0
        self._pool = None
        if self.threads > 1:  # each thread computes with one torch thread (OpenMP's count is per thread)
            self._pool = ThreadPoolExecutor(self.threads, "ako-gradients", initializer=torch.set_num_threads, initargs=(1,))

    def file(self, replica: Replica, batches: list) -> _Filed:
        """File `replica`'s gradient of `batches` (computed into `replica.grad` by `take`).
        The replica must not change until then."""
        entry = _Filed(replica, batches)
        self.filed.append(entry)
        return entry

    def take(self, entry: _Filed) -> float:
        """`entry`'s mean loss, its gradient in its replica's `grad`: computing every gradient
        filed so far if it is not yet computed. Errors of the user's loss or model are raised
        here (the first, in filing order)."""
        if entry.loss is None:
            self._compute_filed()
        return entry.loss

    def _compute_filed(self) -> None:
        filed, self.filed = self.filed, []
        start = time.perf_counter()
        try:
            if self._pool is None:
                losses = [entry.replica.compute_gradient(entry.batches) for entry in filed]
            else:  # every one on a pool thread, even alone, so that each runs on one torch thread
                losses = list(self._pool.map(lambda entry: entry.replica.compute_gradient(entry.batches), filed))
        finally:
            self.seconds += time.perf_counter() - start
        for entry, loss in zip(filed, losses):
            entry.loss = loss

    def map(self, fn, items) -> list:
        """`fn` of each of `items`, in order: on the threads, each with one torch thread (as the
        gradients; the simulator's evaluations run their test batches so), or here with one."""
        if self._pool is None:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        """Stop the threads (gradients still filed are dropped); what comes after runs on the
        caller's thread."""
        self.filed = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
